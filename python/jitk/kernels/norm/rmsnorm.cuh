// RMSNorm over the last dimension, y = x / sqrt(mean(x^2) + eps) * weight (float32 inside,
// rounded to the dtype), and the fused form residual += input; input = rmsnorm(residual) * weight.
//
//   RMSNorm<kHidden, T>::run(input, weight, out, eps)
//   RMSNorm<kHidden, T>::run_fused_add(input, residual, weight, eps)
//   RMSNorm<kHidden, T>::run_fused_add_float_sum(input, residual, weight, eps)
//
// Inputs of any rank are rows of the hidden size (jitk/rows.h) whose leading dimensions may
// take two strides (q/k-norm on heads cut from a fused QKV buffer). A row is read once, held in
// registers while its sum of squares is reduced (read twice past 1024 threads x 16 registers),
// by some lanes of a warp or a block, in the widest vectors (<= 16 B) pointers and strides allow.
//
// The layout and rules of a width are in rmsnorm_tiling.cuh, the kernels in rmsnorm_kernels.cuh;
// this file, the one to include, holds the host side. It is written in two halves
// (jitk/nvrtc.cuh), so nvcc builds it as one unit and NVRTC its kernels apart.
#pragma once

#include <jitk/nvrtc.cuh>

#include "rmsnorm_kernels.cuh"
#include "rmsnorm_tiling.cuh"

#include <jitk/norm_order.cuh>
#include <jitk/rows.h>
#include <jitk/utils.cuh>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <jitk/tensor.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#endif

#if JITK_HOST_HALF
namespace jitk::norm {

// ---------------------------------------------------------------------------------------
// Host side.
// "row stride 64 < hidden size 128", or the strides of rows in two runs.
struct RowStridesOf {
  const RowView& v;
};
inline void append_to(Text& out, const RowStridesOf& s) {
  if (!s.v.two_runs())
    return append(out, "row stride ", s.v.inner_stride(), " < hidden size ", s.v.row_size());
  append(out, "rows of ", s.v.row_size(), " at strides ", s.v.outer_stride(), " and ",
         s.v.inner_stride(), ", in runs of ", s.v.inner_rows());
}

// Checks one operand; `written` ones must not have rows that overlap.
template <typename T>
RowView check_rows(const TensorView& t, const char* name, bool written, SymbolicSize& rows,
                   SymbolicSize& hidden, SymbolicDevice& device, DebugInfo where = {}) {
  RowView view(t, name, where);
  TensorMatcher({rows, hidden})
      .with_strides({-1, 1})
      .with_dtype<T>()
      .template with_device<kDLCUDA>(device)
      .verify(view.matrix(), name, where);
  RuntimeCheck(where, !written || view.rows_disjoint(), "rows of '", name, "' overlap in memory (",
               RowStridesOf{view}, "), so writing them would race");
  return view;
}

template <typename T>
const void* check_weight(const TensorView& weight, SymbolicSize& hidden, SymbolicDevice& device,
                         DebugInfo where = {}) {
  TensorMatcher({hidden}).with_dtype<T>().template with_device<kDLCUDA>(device).verify(
      weight, "weight", where);
  return pointer::offset(weight.data_ptr(), weight.byte_offset());
}

inline float check_eps(double eps, DebugInfo where = {}) {
  RuntimeCheck(where, std::isfinite(eps) && eps >= 0 && eps <= std::numeric_limits<float>::max(),
               "eps must be finite and >= 0 (as a float32), got ", eps);
  return static_cast<float>(eps);
}

// A tuning (jitk.autotune's choice) applies where it was timed: plain rows whose accesses are
// whole vectors. Rows in two runs, and misaligned ones, run the defaults' kernels, which all
// tunings of a width share: a module of many tunings builds them once.
template <int kHidden, typename T, typename Tune = DefaultTuning<kHidden, T>>
struct RMSNorm {
  static_assert(std::is_same_v<T, fp32_t> || std::is_same_v<T, fp16_t> || std::is_same_v<T, bf16_t>,
                "rmsnorm supports float32, float16 and bfloat16");
  static_assert(kHidden >= 1 && kHidden <= kMaxHidden);
  static_assert(std::is_same_v<Tune, DefaultTuning<kHidden, T>> ||
                    tuning_applies(kHidden, kElemBytes<T>, Tune::kMaxVecBytes, Tune::kTwoVectors),
                "this tuning would run the defaults' kernel at this width (tuning_applies)");

  // out = rmsnorm(input) * weight; out may be input.
  static void run(TensorView input, TensorView weight, TensorView out, double eps) {
    check_and_launch<false>(input, out, "out", weight, eps);
  }

  // residual += input; input = rmsnorm(residual) * weight, normalising the sum as stored.
  static void run_fused_add(TensorView input, TensorView residual, TensorView weight, double eps) {
    check_and_launch<true>(input, residual, "residual", weight, eps);
  }

  // The same, normalising the sum as added in float32, before it is rounded into residual
  // (FlashInfer's formula). A module that never names it builds none of its kernels.
  static void run_fused_add_float_sum(TensorView input, TensorView residual, TensorView weight,
                                      double eps) {
    check_and_launch<true, true>(input, residual, "residual", weight, eps);
  }

 private:
  using Default = DefaultTuning<kHidden, T>;
  template <typename Tuned>
  static constexpr int kVecSizeOf = widest_vec_size<T>(kHidden, Tuned::kMaxVecBytes);

  static Params params(const RowView& x, const RowView& y, const void* weight, int64_t rows,
                       double eps) {
    const RowSplit split = shared_split({&x, &y});
    const RowStrides x_rows = x.strides_in(split), y_rows = y.strides_in(split);
    // Fewer than 2^31 rows: launch_kernel's grid then covers them, one turn a block.
    const bool plain = split.inner_rows() == 0 && rows <= int64_t{INT32_MAX};
    return Params{x.data(),       y.data(),     weight,
                  x_rows.inner,   y_rows.inner, plain ? static_cast<uint32_t>(rows) : 0u,
                  check_eps(eps), split,        x_rows,
                  y_rows,         rows};
  }

  // Whether every access of a kernel of vec_size elements lands on a whole vector.
  static bool vectors_aligned(const Params& p, int vec_size) {
    const auto aligned = [vec_size](const void* ptr) {
      return reinterpret_cast<uintptr_t>(ptr) % (vec_size * kElemBytes<T>) == 0;
    };
    return vec_size > 1 && aligned(p.x) && aligned(p.y) && aligned(p.weight) &&
           p.x_rows.steps_by(vec_size) && p.y_rows.steps_by(vec_size);
  }

  // The rows of `input` and of `rows_out` (out, or the fused form's residual, which it
  // writes too), and the weight, checked against each other; then the launch. The fused
  // form writes its result into `input`.
  template <bool kFusedAdd, bool kFloatSum = false>
  static void check_and_launch(TensorView input, TensorView rows_out, const char* rows_out_name,
                               TensorView weight, double eps) {
    SymbolicSize rows{"rows"}, hidden{"hidden size", kHidden};
    SymbolicDevice device;
    const RowView x = check_rows<T>(input, "input", kFusedAdd, rows, hidden, device);
    const RowView y = check_rows<T>(rows_out, rows_out_name, true, rows, hidden, device);
    const void* w = check_weight<T>(weight, hidden, device);
    launch<kFusedAdd, kFloatSum>(params(x, y, w, rows.unwrap(), eps), device.unwrap());
  }

  template <bool kFusedAdd, bool kFloatSum = false>
  static void launch(const Params& p, DLDevice device) {
    if (p.rows == 0) return;
    constexpr int kVec = kVecSizeOf<Tune>, kDefaultVec = kVecSizeOf<Default>;
    using Pair = TwoVectors<kHidden, T>;
    if constexpr (Tune::kTwoVectors) {
      if (p.plain_rows != 0 && vectors_aligned(p, Pair::kVecSize)) {
        // A block a row: fewer than 2^31 rows, within the grid's limit.
        return LaunchKernel(dim3(p.plain_rows), dim3(Pair::kThreads), device)
            .enable_pdl(Tune::kPdl && kPdlOnAllTargets)
            .template launch<
                rmsnorm_two_vectors_kernel<kHidden, T, kFusedAdd, kFloatSum, Tune::kLateTrigger>>(
                p);
      }
    } else if (p.plain_rows != 0 && vectors_aligned(p, kVec)) {
      return launch_kernel<Tiling<kHidden, T, kVec, typename Tune::Body>, Tune, kFusedAdd,
                           kFloatSum, true>(p, device);
    }
    if (vectors_aligned(p, kDefaultVec)) {
      return launch_default<Tiling<kHidden, T, kDefaultVec, Default>, kFusedAdd, kFloatSum>(p,
                                                                                            device);
    }
    launch_default<Tiling<kHidden, T, 1, Default>, kFusedAdd, kFloatSum>(p, device);
  }

  template <typename Tiles, bool kFusedAdd, bool kFloatSum>
  static void launch_default(const Params& p, DLDevice device) {
    if (p.plain_rows != 0) {
      return launch_kernel<Tiles, Default, kFusedAdd, kFloatSum, true>(p, device);
    }
    launch_kernel<Tiles, Default, kFusedAdd, kFloatSum, false>(p, device);
  }

  template <typename Tiles, typename Tuned, bool kFusedAdd, bool kFloatSum, bool kPlain>
  static void launch_kernel(const Params& p, DLDevice device) {
    // A block per turn of rows; blocks loop, so a grid capped at the launch limit still covers
    // every row. (A grid of what the GPU holds at once measured slower.)
    const int64_t blocks = min_of(div_ceil(p.rows, int64_t{Tiles::kRowsPerBlock}),
                                  int64_t{std::numeric_limits<int32_t>::max()});
    LaunchKernel(dim3(static_cast<unsigned>(blocks)), dim3(Tiles::kBlockThreads), device)
        .enable_pdl(Tuned::kPdl && kPdlOnAllTargets)
        .template launch<rmsnorm_kernel<Tiles, typename Tuned::Body, kFusedAdd, kFloatSum, kPlain>>(
            p);
  }
};

// ---------------------------------------------------------------------------------------
// With tuning_applies, the rules jitk.kernels.norm keeps copies of: its rules module exports
// them, and its tests hold the copies to them at every width (hidden size, element bytes).

inline int rules_knob_count() { return static_cast<int>(Tuning<1, true>::kKnobs.size()); }

// The default tuning's knob `index` (Tuning's template order).
inline int rules_default_knob(int hidden, int elem_bytes, int index) {
  using Rest = DefaultTuningWith<kMaxRowRegisters>;
  static_assert(Rest::kKnobs[0] == kMaxRowRegisters, "knob 0 is kRowRegisters");
  RuntimeCheck(index >= 0 && index < rules_knob_count(), "knob index ", index, " is not in 0..",
               rules_knob_count() - 1);
  return index == 0 ? default_row_registers(hidden, elem_bytes) : Rest::kKnobs[index];
}

// The threads a row of a tuning's own kernel is spread over (threads_per_row at the access
// width tuning_applies finds), which with kSumChains and kTwoVectors fixes its summation order.
inline int rules_threads_per_row(int hidden, int elem_bytes, int max_vec_bytes, int row_registers) {
  RuntimeCheck(hidden >= 1 && hidden <= kMaxHidden, "hidden size ", hidden, " is not in 1..",
               kMaxHidden);
  return threads_per_row(hidden, elem_bytes, widest_vec_size(hidden, elem_bytes, max_vec_bytes),
                         row_registers);
}

// row_spread at that width: above 1, the threads keep the default layout's order.
inline int rules_row_spread(int hidden, int elem_bytes, int max_vec_bytes, int row_registers) {
  RuntimeCheck(hidden >= 1 && hidden <= kMaxHidden, "hidden size ", hidden, " is not in 1..",
               kMaxHidden);
  return row_spread(hidden, elem_bytes, widest_vec_size(hidden, elem_bytes, max_vec_bytes),
                    row_registers);
}

}  // namespace jitk::norm
#endif  // JITK_HOST_HALF
