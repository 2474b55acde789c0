// RMSNorm over the last dimension, y = x / sqrt(mean(x^2) + eps) * weight, accumulated in
// float32 and rounded to the input dtype; and its fused residual form,
// residual += input; input = rmsnorm(residual) * weight.
//
//   RMSNorm<kHidden, T>::run(input, weight, out, eps)
//   RMSNorm<kHidden, T>::run_fused_add(input, residual, weight, eps)
//
// Inputs of any rank are read as [rows, hidden] with a row stride. A row is read once and
// kept in registers while its sum of squares is reduced (only rows longer than 1024
// threads x 16 registers are read twice). Short rows get a power-of-two group of lanes of
// a warp, several rows to a block; long rows a block each. Rows move in the widest vectors
// (up to 16 bytes) that the hidden size divides into when every pointer and row stride is
// aligned to them, else element by element.
#pragma once

#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

namespace jitk::norm {

// ---------------------------------------------------------------------------------------
// How a row is spread over threads: a pure function of the hidden size and vector width.

inline constexpr int kMaxBlockThreads = 1024;
inline constexpr int kShortRowsBlockThreads = 128;
// Registers a thread gives to its part of x (and as many to the weight): several loads in
// flight per thread, and room to spare in the 64 a 1024-thread block leaves each.
inline constexpr int kRowRegisters = 16;

// The widest access (at most 16 bytes) whose element count divides the hidden size.
template <typename T>
constexpr int widest_vec_size(int hidden) {
  int size = device::kVec16<T>;
  while (hidden % size != 0) size /= 2;
  return size;
}

template <int kHidden_, typename T_, int kVecSize_>
struct RowLayout {
  static constexpr int kHidden = kHidden_;
  using T = T_;
  static constexpr int kVecSize = kVecSize_;
  static_assert(kHidden >= 1 && kHidden % kVecSize == 0);

  static constexpr int kVecBytes = kVecSize * static_cast<int>(sizeof(T));
  static constexpr int kVecsPerRow = kHidden / kVecSize;
  // Four 16-byte vectors, or sixteen narrower ones (a 16-bit element takes a register).
  static constexpr int kVecsInRegisters = kRowRegisters / max_of(1, kVecBytes / 4);
  static constexpr int kWantedThreads = div_ceil(kVecsPerRow, kVecsInRegisters);
  // A row that a warp covers is reduced with shuffles alone; a longer one needs a block.
  static constexpr bool kSubWarp = kWantedThreads <= kWarpThreads;
  static constexpr int kThreadsPerRow =
      kSubWarp ? static_cast<int>(std::bit_ceil(static_cast<unsigned>(kWantedThreads)))
               : min_of(div_ceil(kWantedThreads, kWarpThreads) * kWarpThreads,
                        kMaxBlockThreads);
  static constexpr int kBlockThreads = kSubWarp ? kShortRowsBlockThreads : kThreadsPerRow;
  static constexpr int kRowsPerBlock = kBlockThreads / kThreadsPerRow;
  static constexpr int kVecsPerThread = div_ceil(kVecsPerRow, kThreadsPerRow);
  // Only when 1024 threads are not enough does a thread get more than it keeps in registers.
  static constexpr bool kInRegisters = kVecsPerThread <= kVecsInRegisters;
  // Whether the last slot of some threads lies past the end of the row.
  static constexpr bool kRagged = kVecsPerRow % kThreadsPerRow != 0;

  // One access of a thread: kVecSize elements held as 32-bit words, or a single 16-bit
  // element on the element-wise path. As integer words until the arithmetic, 16-bit
  // elements stay two to a register; typed one by one, each would get a register.
  using Pack = std::conditional_t<(kVecBytes >= 4), device::Vec<uint32_t, kVecBytes / 4>,
                                  device::Vec<uint16_t, 1>>;
  using Floats = device::Vec<float, kVecSize>;
};

// ---------------------------------------------------------------------------------------
// Device side.

struct Params {
  const void* input;
  void* residual;  // fused add only
  void* output;
  const void* weight;
  int64_t input_stride;  // elements from one row to the next
  int64_t residual_stride;
  int64_t output_stride;
  int64_t rows;
  float eps;
};

__device__ __forceinline__ float to_float(fp16_t v) { return __half2float(v); }
__device__ __forceinline__ float to_float(bf16_t v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ uint16_t bits_of(float v) {
  if constexpr (std::is_same_v<T, fp16_t>) {
    return std::bit_cast<uint16_t>(__float2half_rn(v));
  } else {
    return std::bit_cast<uint16_t>(__float2bfloat16_rn(v));
  }
}

template <typename T>
__device__ __forceinline__ float float_of(uint16_t bits) {
  return to_float(std::bit_cast<T>(bits));
}

// Two 16-bit elements of one word, low half first.
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t word) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    // A bfloat16 is the upper half of the float of the same value.
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  } else {
    return make_float2(float_of<T>(static_cast<uint16_t>(word)),
                       float_of<T>(static_cast<uint16_t>(word >> 16)));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return bits_of<T>(lo) | static_cast<uint32_t>(bits_of<T>(hi)) << 16;
}

template <typename Layout>
__device__ __forceinline__ typename Layout::Floats to_floats(const typename Layout::Pack& p) {
  using T = typename Layout::T;
  typename Layout::Floats f;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < Layout::kVecSize; ++i) f[i] = __uint_as_float(p[i]);
  } else if constexpr (Layout::kVecSize == 1) {
    f[0] = float_of<T>(p[0]);
  } else {
#pragma unroll
    for (int i = 0; i < Layout::kVecSize / 2; ++i) {
      const float2 pair = unpack_pair<T>(p[i]);
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  }
  return f;
}

// Rounds to the nearest value of the row's dtype.
template <typename Layout>
__device__ __forceinline__ typename Layout::Pack from_floats(const typename Layout::Floats& f) {
  using T = typename Layout::T;
  typename Layout::Pack p;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < Layout::kVecSize; ++i) p[i] = __float_as_uint(f[i]);
  } else if constexpr (Layout::kVecSize == 1) {
    p[0] = bits_of<T>(f[0]);
  } else {
#pragma unroll
    for (int i = 0; i < Layout::kVecSize / 2; ++i) p[i] = pack_pair<T>(f[2 * i], f[2 * i + 1]);
  }
  return p;
}

// An optimisation barrier on the packs: without it the compiler tends to keep them
// converted to float across the reduction, twice the registers for 16-bit elements.
template <int kCount, typename Pack>
__device__ __forceinline__ void keep_packed(Pack (&packs)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    if constexpr (sizeof(packs[i][0]) == 4) {
      for (auto& word : packs[i].data) asm volatile("" : "+r"(word));
    } else {
      for (auto& half : packs[i].data) asm volatile("" : "+h"(half));
    }
  }
}

template <typename Layout>
__device__ __forceinline__ const typename Layout::Pack* row_in(const void* base, int64_t row,
                                                               int64_t stride) {
  using T = typename Layout::T;
  return reinterpret_cast<const typename Layout::Pack*>(static_cast<const T*>(base) +
                                                        row * stride);
}
template <typename Layout>
__device__ __forceinline__ typename Layout::Pack* row_out(void* base, int64_t row,
                                                          int64_t stride) {
  using T = typename Layout::T;
  return reinterpret_cast<typename Layout::Pack*>(static_cast<T*>(base) + row * stride);
}

// Slot k of a thread is vector lane + k * kThreadsPerRow of its row. A slot is live when
// its row exists and reaches that far; dead slots are neither read nor written.
template <typename Layout>
__device__ __forceinline__ int slot_index(int lane, int k) {
  return lane + k * Layout::kThreadsPerRow;
}
template <typename Layout>
__device__ __forceinline__ bool slot_live(int lane, int k, bool row_valid) {
  if (k >= Layout::kVecsPerThread) return false;
  const bool in_row = k + 1 < Layout::kVecsPerThread || !Layout::kRagged ||
                      slot_index<Layout>(lane, k) < Layout::kVecsPerRow;
  return row_valid && in_row;
}

// Loads slots first .. first + kCount - 1, all issued before any is used. Dead slots read
// as zeros, which add nothing to a sum of squares.
template <typename Layout, int kCount, typename Pack>
__device__ __forceinline__ void load_slots(Pack (&v)[kCount], const Pack* row, int first,
                                           int lane, bool row_valid) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int k = first + i;
    v[i] = slot_live<Layout>(lane, k, row_valid) ? row[slot_index<Layout>(lane, k)] : Pack{};
  }
}

template <typename Layout, int kCount, typename Pack>
__device__ __forceinline__ void store_slots(Pack* row, const Pack (&v)[kCount], int first,
                                            int lane, bool row_valid) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int k = first + i;
    if (slot_live<Layout>(lane, k, row_valid)) row[slot_index<Layout>(lane, k)] = v[i];
  }
}

template <typename Layout, int kCount>
__device__ __forceinline__ float sum_of_squares(const typename Layout::Pack (&x)[kCount]) {
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const auto f = to_floats<Layout>(x[i]);
#pragma unroll
    for (int e = 0; e < Layout::kVecSize; ++e) sum = fmaf(f[e], f[e], sum);
  }
  return sum;
}

// x += r, rounded to the dtype: the residual stream holds the sum in its own dtype.
template <typename Layout, int kCount>
__device__ __forceinline__ void add_slots(typename Layout::Pack (&x)[kCount],
                                          const typename Layout::Pack (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    auto sum = to_floats<Layout>(x[i]);
    const auto addend = to_floats<Layout>(r[i]);
#pragma unroll
    for (int e = 0; e < Layout::kVecSize; ++e) sum[e] += addend[e];
    x[i] = from_floats<Layout>(sum);
  }
}

// x = x * inv_rms * w, rounded to the dtype.
template <typename Layout, int kCount>
__device__ __forceinline__ void scale_slots(typename Layout::Pack (&x)[kCount],
                                            const typename Layout::Pack (&w)[kCount],
                                            float inv_rms) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    auto y = to_floats<Layout>(x[i]);
    const auto scale = to_floats<Layout>(w[i]);
#pragma unroll
    for (int e = 0; e < Layout::kVecSize; ++e) y[e] = y[e] * inv_rms * scale[e];
    x[i] = from_floats<Layout>(y);
  }
}

// The sum over the threads of one row; every one of them gets it.
template <typename Layout>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  if constexpr (Layout::kSubWarp) {
    // Groups are aligned runs of kThreadsPerRow lanes, and xor stays inside its run.
#pragma unroll
    for (int offset = Layout::kThreadsPerRow / 2; offset > 0; offset /= 2) {
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
  } else {
    return device::block_sum<Layout::kThreadsPerRow>(v, scratch);
  }
}

template <typename Layout>
__device__ __forceinline__ float inverse_rms(float sum_sq, float eps, float* scratch) {
  return rsqrtf(row_sum<Layout>(sum_sq, scratch) / Layout::kHidden + eps);
}

template <typename Layout>
struct RowPointers {
  using Pack = typename Layout::Pack;
  const Pack* input;
  Pack* residual;
  Pack* output;
  const Pack* weight;
};

// The whole row stays in registers: read once, reduce, scale, write.
template <typename Layout, bool kFusedAdd>
__device__ __forceinline__ void normalize_in_registers(const RowPointers<Layout>& row, int lane,
                                                       bool row_valid, float eps,
                                                       float* scratch) {
  constexpr int kSlots = Layout::kVecsPerThread;
  typename Layout::Pack x[kSlots], r[kFusedAdd ? kSlots : 1], w[kSlots];
  load_slots<Layout>(x, row.input, 0, lane, row_valid);
  if constexpr (kFusedAdd) load_slots<Layout>(r, row.residual, 0, lane, row_valid);
  load_slots<Layout>(w, row.weight, 0, lane, row_valid);
  if constexpr (kFusedAdd) {
    add_slots<Layout>(x, r);
    store_slots<Layout>(row.residual, x, 0, lane, row_valid);
  }
  const float inv_rms = inverse_rms<Layout>(sum_of_squares<Layout>(x), eps, scratch);
  keep_packed(x);
  keep_packed(w);
  scale_slots<Layout>(x, w, inv_rms);
  store_slots<Layout>(row.output, x, 0, lane, row_valid);
}

// Rows too long for registers: a pass for the sum of squares (storing the residual sum),
// then a pass that reads the row again, mostly from L2, to scale it. Both go a chunk of
// slots at a time so that a chunk's loads are in flight together.
template <typename Layout, bool kFusedAdd>
__device__ __forceinline__ void normalize_in_two_passes(const RowPointers<Layout>& row, int lane,
                                                        bool row_valid, float eps,
                                                        float* scratch) {
  constexpr int kChunk = Layout::kVecsInRegisters;
  float sum_sq = 0.0f;
#pragma unroll 1
  for (int first = 0; first < Layout::kVecsPerThread; first += kChunk) {
    typename Layout::Pack x[kChunk];
    load_slots<Layout>(x, row.input, first, lane, row_valid);
    if constexpr (kFusedAdd) {
      typename Layout::Pack r[kChunk];
      load_slots<Layout>(r, row.residual, first, lane, row_valid);
      add_slots<Layout>(x, r);
      store_slots<Layout>(row.residual, x, first, lane, row_valid);
    }
    sum_sq += sum_of_squares<Layout>(x);
  }
  const float inv_rms = inverse_rms<Layout>(sum_sq, eps, scratch);
  // The fused form normalises the sum as stored, which this thread wrote itself.
  const typename Layout::Pack* source = kFusedAdd ? row.residual : row.input;
#pragma unroll 1
  for (int first = 0; first < Layout::kVecsPerThread; first += kChunk) {
    typename Layout::Pack x[kChunk], w[kChunk];
    load_slots<Layout>(x, source, first, lane, row_valid);
    load_slots<Layout>(w, row.weight, first, lane, row_valid);
    scale_slots<Layout>(x, w, inv_rms);
    store_slots<Layout>(row.output, x, first, lane, row_valid);
  }
}

template <typename Layout, bool kFusedAdd>
__global__ void __launch_bounds__(Layout::kBlockThreads) rmsnorm_kernel(const Params p) {
  __shared__ float scratch[Layout::kSubWarp ? 1 : Layout::kThreadsPerRow / kWarpThreads];
  const int lane = threadIdx.x % Layout::kThreadsPerRow;
  const int64_t row_id =
      int64_t{blockIdx.x} * Layout::kRowsPerBlock + threadIdx.x / Layout::kThreadsPerRow;
  // Threads of a row past the last still take part in the shuffles, adding nothing.
  const bool row_valid = row_id < p.rows;

  RowPointers<Layout> row{};
  row.input = row_in<Layout>(p.input, row_id, p.input_stride);
  row.output = row_out<Layout>(p.output, row_id, p.output_stride);
  row.weight = static_cast<const typename Layout::Pack*>(p.weight);
  if constexpr (kFusedAdd) row.residual = row_out<Layout>(p.residual, row_id, p.residual_stride);

  // Launched with PDL, this kernel may start before the previous one on the stream is done:
  // wait for it before reading anything, and let the next one start its launch now.
  device::pdl_wait();
  device::pdl_launch_dependents();

  if constexpr (Layout::kInRegisters) {
    normalize_in_registers<Layout, kFusedAdd>(row, lane, row_valid, p.eps, scratch);
  } else {
    normalize_in_two_passes<Layout, kFusedAdd>(row, lane, row_valid, p.eps, scratch);
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

// PDL needs sm_90 or newer. A module runs only on GPUs it holds code for, so when every
// target architecture is sm_90+ the launch attribute is always accepted.
inline constexpr bool kPdlOnAllTargets = [] {
#ifdef __CUDA_ARCH_LIST__
  for (const int arch : {__CUDA_ARCH_LIST__}) {
    if (arch < 900) return false;
  }
  return true;
#else
  return false;
#endif
}();

// A tensor of any rank read as [rows, hidden]: the last dimension is the hidden one, and
// the leading ones must step through memory with one stride, as view(-1, hidden) needs.
class RowMatrix {
 public:
  RowMatrix(const TensorView& t, const char* name, DebugInfo where = {}) : tensor_(t) {
    detail::check_at(t.ndim() >= 1, where, "'", name, "' must have at least one dimension ",
                     "(the hidden size), got ", PrintTensor{t});
    const int last = t.ndim() - 1;
    shape_[0] = 1;
    shape_[1] = t.size(last);
    strides_[0] = 0;  // a single row is never stepped over
    strides_[1] = t.stride(last);
    bool have_row_stride = false;
    int64_t continuing_stride = 0;  // the stride that would continue the dimensions inside
    int broken = -1;                // the first dimension that does not
    int64_t broken_expected = 0;
    for (int i = last - 1; i >= 0; --i) {
      shape_[0] *= t.size(i);
      if (t.size(i) == 1) continue;
      if (!have_row_stride) {
        strides_[0] = t.stride(i);
        have_row_stride = true;
      } else if (t.stride(i) != continuing_stride && broken < 0) {
        broken = i;
        broken_expected = continuing_stride;
      }
      continuing_stride = t.stride(i) * t.size(i);
    }
    detail::check_at(broken < 0 || shape_[0] == 0, where, "'", name, "' ", PrintTensor{t},
                     " cannot be read as rows of the hidden size: its leading dimensions do "
                     "not collapse into one row dimension with a single stride (stride#",
                     broken, " is ", broken < 0 ? 0 : t.stride(broken), ", not ",
                     broken_expected, ")");
  }

  // Valid while this object lives: the view points at its shape and strides.
  TensorView view() const {
    return tensor_.as_strided(ShapeView(shape_, 2), ShapeView(strides_, 2));
  }

 private:
  TensorView tensor_;
  int64_t shape_[2]{};
  int64_t strides_[2]{};
};

struct RowOperand {
  void* data;
  int64_t row_stride;
};

// Checks one [rows, hidden] operand; `written` ones must not have rows that overlap.
template <typename T>
RowOperand check_rows(const TensorView& t, const char* name, bool written, SymbolicSize& rows,
                      SymbolicSize& hidden, SymbolicDevice& device, DebugInfo where = {}) {
  const RowMatrix matrix(t, name, where);
  const TensorView view = matrix.view();
  TensorMatcher({rows, hidden})
      .with_strides({-1, 1})
      .with_dtype<T>()
      .template with_device<kDLCUDA>(device)
      .verify(view, name, where);
  const int64_t row_stride = view.stride(0);
  detail::check_at(!written || view.size(0) <= 1 || std::abs(row_stride) >= view.size(1), where,
                   "rows of '", name, "' overlap in memory (row stride ", row_stride,
                   " < hidden size ", view.size(1), "), so writing them would race");
  return {view.data_ptr(), row_stride};
}

template <typename T>
const void* check_weight(const TensorView& weight, SymbolicSize& hidden, SymbolicDevice& device,
                         DebugInfo where = {}) {
  TensorMatcher({hidden})
      .with_dtype<T>()
      .template with_device<kDLCUDA>(device)
      .verify(weight, "weight", where);
  return pointer::offset(weight.data_ptr(), weight.byte_offset());
}

inline float check_eps(double eps, DebugInfo where = {}) {
  detail::check_at(std::isfinite(eps) && eps >= 0, where,
                   "eps must be finite and >= 0, got ", eps);
  return static_cast<float>(eps);
}

template <int kHidden, typename T>
struct RMSNorm {
  static_assert(std::is_same_v<T, fp32_t> || std::is_same_v<T, fp16_t> ||
                    std::is_same_v<T, bf16_t>,
                "rmsnorm supports float32, float16 and bfloat16");
  static_assert(kHidden >= 1);
  static constexpr int kVecSize = widest_vec_size<T>(kHidden);

  // out = rmsnorm(input) * weight; out may be input.
  static void run(TensorView input, TensorView weight, TensorView out, double eps) {
    SymbolicSize rows{"rows"}, hidden{"hidden size", kHidden};
    SymbolicDevice device;
    const RowOperand x = check_rows<T>(input, "input", false, rows, hidden, device);
    const RowOperand y = check_rows<T>(out, "out", true, rows, hidden, device);
    const void* w = check_weight<T>(weight, hidden, device);
    const Params params{x.data, nullptr, y.data, w, x.row_stride, 0, y.row_stride,
                        rows.unwrap(), check_eps(eps)};
    launch<false>(params, device.unwrap());
  }

  // residual += input; input = rmsnorm(residual) * weight, normalising the sum as stored.
  static void run_fused_add(TensorView input, TensorView residual, TensorView weight,
                            double eps) {
    SymbolicSize rows{"rows"}, hidden{"hidden size", kHidden};
    SymbolicDevice device;
    const RowOperand x = check_rows<T>(input, "input", true, rows, hidden, device);
    const RowOperand r = check_rows<T>(residual, "residual", true, rows, hidden, device);
    const void* w = check_weight<T>(weight, hidden, device);
    const Params params{x.data, r.data, x.data, w, x.row_stride, r.row_stride, x.row_stride,
                        rows.unwrap(), check_eps(eps)};
    launch<true>(params, device.unwrap());
  }

 private:
  // Whether every access of the vectorised kernel lands on a whole vector.
  static bool vectors_aligned(const Params& p) {
    constexpr int64_t kBytes = kVecSize * sizeof(T);
    const auto aligned = [](const void* ptr) {
      return reinterpret_cast<uintptr_t>(ptr) % kBytes == 0;
    };
    const auto whole = [](int64_t stride) { return stride * int64_t{sizeof(T)} % kBytes == 0; };
    return aligned(p.input) && aligned(p.output) && aligned(p.weight) && aligned(p.residual) &&
           whole(p.input_stride) && whole(p.output_stride) && whole(p.residual_stride);
  }

  template <bool kFusedAdd>
  static void launch(const Params& p, DLDevice device) {
    if (p.rows == 0) return;
    if constexpr (kVecSize > 1) {
      if (vectors_aligned(p)) {
        return launch_with<RowLayout<kHidden, T, kVecSize>, kFusedAdd>(p, device);
      }
    }
    launch_with<RowLayout<kHidden, T, 1>, kFusedAdd>(p, device);
  }

  template <typename Layout, bool kFusedAdd>
  static void launch_with(const Params& p, DLDevice device) {
    const int64_t blocks = div_ceil(p.rows, int64_t{Layout::kRowsPerBlock});
    RuntimeCheck(blocks <= std::numeric_limits<int32_t>::max(), "too many rows for one launch: ",
                 p.rows);
    LaunchKernel(dim3(static_cast<unsigned>(blocks)), dim3(Layout::kBlockThreads), device)
        .enable_pdl(kPdlOnAllTargets)(rmsnorm_kernel<Layout, kFusedAdd>, p);
  }
};

}  // namespace jitk::norm
