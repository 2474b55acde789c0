// RMSNorm's device side (rmsnorm.cuh): a row's sum of squares and its reduction, the row's
// normalisation in registers or in two passes, the register caps, and the kernels: rmsnorm_kernel
// (rows spread by Tiling) and rmsnorm_two_vectors_kernel (kTwoVectors' layout).
#pragma once

#include "rmsnorm_tiling.cuh"

#include <jitk/device.cuh>
#include <jitk/norm_order.cuh>
#include <jitk/packed.cuh>
#include <jitk/rows.h>
#include <jitk/utils.cuh>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <cstdint>
#include <type_traits>
#endif

namespace jitk::norm {

#if JITK_DEVICE_HALF
// A thread's sum of squares over its slots, slot(i) being slot i's elements as floats. With one
// chain, the order of jitk/norm_order.cuh: each slot's slot_squares, the slots by slots_sum's
// tree. kChains 2 or 4 (JITK_RMSNORM_FAST_UNSTABLE only) deal the elements to as many sums in
// turn.
template <typename Tiling, int kChains, int kCount, typename Slot>
__device__ __forceinline__ float sum_of_squares(const Slot& slot) {
  if constexpr (kChains == 1) {
    float sums[kCount];
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const auto f = slot(i);
      sums[i] = slot_squares<Tiling::kVecSize>([&f](int e) { return f[e]; });
    }
    return slots_sum(sums);
  } else {
    float sums[kChains] = {};
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const auto f = slot(i);
#pragma unroll
      for (int e = 0; e < Tiling::kVecSize; ++e) {
        float& sum = sums[(i * Tiling::kVecSize + e) % kChains];
        sum = fmaf(f[e], f[e], sum);
      }
    }
    if constexpr (kChains == 4) return (sums[0] + sums[1]) + (sums[2] + sums[3]);
    return sums[0] + sums[1];
  }
}

// The row a thread's slots hold, as floats: x, or with kFloatSum x + r added in float32 and
// not rounded (the fused form's FlashInfer formula normalises that sum).
template <typename Tiling, bool kFloatSum, int kCount, int kResidualCount>
__device__ __forceinline__ auto row_values(const typename Tiling::Pack (&x)[kCount],
                                           const typename Tiling::Pack (&r)[kResidualCount]) {
  static_assert(!kFloatSum || kResidualCount == kCount);
  return [&x, &r](int i) {
    auto f = Tiling::unpack(x[i]);
    if constexpr (kFloatSum) {
      const auto g = Tiling::unpack(r[i]);
#pragma unroll
      for (int e = 0; e < Tiling::kVecSize; ++e) f[e] += g[e];
    }
    return f;
  };
}

// x[i] = f(x[i], y[i]) element by element in float32, rounded to the dtype.
template <typename Tiling, int kCount, typename F>
__device__ __forceinline__ void combine(typename Tiling::Pack (&x)[kCount],
                                        const typename Tiling::Pack (&y)[kCount], F f) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    auto a = Tiling::unpack(x[i]);
    const auto b = Tiling::unpack(y[i]);
#pragma unroll
    for (int e = 0; e < Tiling::kVecSize; ++e) a[e] = f(a[e], b[e]);
    x[i] = Tiling::pack(a);
  }
}

// out[i] = value(i) rounded to the dtype (value: row_values).
template <typename Tiling, int kCount, typename V>
__device__ __forceinline__ void pack_values(typename Tiling::Pack (&out)[kCount], const V& value) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) out[i] = Tiling::pack(value(i));
}

// out[i] = f(value(i)[e], y[i][e]) element by element (value: row_values), rounded to the dtype.
template <typename Tiling, int kCount, typename V, typename F>
__device__ __forceinline__ void combine_values(typename Tiling::Pack (&out)[kCount], const V& value,
                                               const typename Tiling::Pack (&y)[kCount], F f) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    auto a = value(i);
    const auto b = Tiling::unpack(y[i]);
#pragma unroll
    for (int e = 0; e < Tiling::kVecSize; ++e) a[e] = f(a[e], b[e]);
    out[i] = Tiling::pack(a);
  }
}

// The scaling step, element by element (the residual sum is a plain add, in its own dtype).
__device__ __forceinline__ auto scale_by(float inv_rms) {
  return [inv_rms](float x, float w) { return x * inv_rms * w; };
}

// A row's sum over its threads, which every one of them gets, in jitk/norm_order.cuh's tree.
// Consecutive calls must alternate between two scratch buffers (the next call's barrier orders
// the reuse). Across warps (a block a row), with kBroadcastSum every thread adds the warps'
// sums itself from shared memory (a few loads and adds), else each warp shuffles them (5
// dependent shuffles, ~25 cycles each, after the barrier).
template <typename Tiling, bool kBroadcastSum>
__device__ __forceinline__ float row_sum(float sum, float* scratch) {
  if constexpr (Tiling::kSubWarp) {  // a row's lanes are an aligned run of kThreadsPerRow
    return lanes_sum<Tiling::kThreadsPerRow>(sum);
  } else {
    return row_block_sum<Tiling::kBlockThreads, Tiling::kSpread, kBroadcastSum>(sum, scratch);
  }
}

// One row's place in each tensor; `valid` is false past the last row (a block's last turn).
template <typename Tiling, bool kFusedAdd, bool kPinOffsets>
struct Row {
  using Pack = typename Tiling::Pack;
  const Pack* input;
  Pack* residual = nullptr;
  Pack* output;
  bool valid;

  // kPinOffsets: the offsets are worked out here, where the row is made; left alone, the
  // compiler may move their 64-bit multiplies into the loop, after pdl_wait, onto the critical
  // path of a short launch. (Pinning the pointers instead would hide that they are global.)
  template <bool kPlain>
  __device__ __forceinline__ Row(const Params& p, int64_t row, bool row_valid,
                                 std::bool_constant<kPlain>)
      : valid(row_valid) {
    if (!valid) row = 0;
    int64_t x_at, y_at;
    if constexpr (kPlain) {
      x_at = row * p.x_stride;
      y_at = row * p.y_stride;
    } else {
      const RowIndex at = p.split.index(row);
      x_at = p.x_rows.offset(at);
      y_at = p.y_rows.offset(at);
    }
    if constexpr (kPinOffsets) {
      device::compute_now(x_at);
      device::compute_now(y_at);
    }
    using T = typename Tiling::T;
    const auto x = reinterpret_cast<Pack*>(static_cast<T*>(p.x) + x_at);
    const auto y = reinterpret_cast<Pack*>(static_cast<T*>(p.y) + y_at);
    input = x;
    output = kFusedAdd ? x : y;
    if constexpr (kFusedAdd) residual = y;
  }
};

// The fused form's sum, added in float32 (combine rounds it to the dtype).
struct Add {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// The row stays in registers: read once, reduce, scale by `w` (this thread's slots), write.
// With kRowFirst the weight is loaded here on the first turn, after the row (it waits for the
// reduction anyway, while the row's loads, queued behind it, would delay the reduction);
// otherwise the kernel loaded it before its first turn. The fused form normalises the sum as
// stored, or with kFloatSum as added (x and r stay in registers, and each use adds them again).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum>
__device__ __forceinline__ void normalize_in_registers(
    const Row<Tiling, kFusedAdd, Tuning::kPinOffsets>& row, const typename Tiling::Pack* weight,
    typename Tiling::Pack (&w)[Tiling::kVecsPerThread], bool first_turn, int lane, float eps,
    float* scratch) {
  constexpr int kVecs = Tiling::kVecsPerThread;
  typename Tiling::Pack x[kVecs], r[kFusedAdd ? kVecs : 1];
  load_slots<Tiling>(x, row.input, 0, lane, row.valid);
  if constexpr (kFusedAdd) load_slots<Tiling>(r, row.residual, 0, lane, row.valid);
  if (Tuning::kRowFirst && first_turn) load_slots<Tiling>(w, weight, 0, lane, true);
  if constexpr (kFloatSum) {
    typename Tiling::Pack stored[kVecs];
    pack_values<Tiling>(stored, row_values<Tiling, true>(x, r));
    store_slots<Tiling>(row.residual, stored, 0, lane, row.valid);
  } else if constexpr (kFusedAdd) {
    combine<Tiling>(x, r, Add{});
    store_slots<Tiling>(row.residual, x, 0, lane, row.valid);
  }
  const float sum = row_sum<Tiling, Tuning::kBroadcastSum>(
      sum_of_squares<Tiling, Tuning::kSumChains, kVecs>(row_values<Tiling, kFloatSum>(x, r)),
      scratch);
  device::keep_packed(w);
  device::keep_packed(x);
  if constexpr (kFloatSum) device::keep_packed(r);
  // A division, not a multiply by 1 / kHidden: at widths that are no power of two its slow
  // path's branch keeps ptxas from unpacking x and w for the scaling before the reduction,
  // which the multiply let it do (sm_90: the weight spilled under 5120's 48-register cap).
  const auto scale = scale_by(rsqrtf(sum / Tiling::kHidden + eps));
  if constexpr (kFloatSum) {
    combine_values<Tiling>(x, row_values<Tiling, true>(x, r), w, scale);
  } else {
    combine<Tiling>(x, w, scale);
  }
  store_slots<Tiling>(row.output, x, 0, lane, row.valid);
}

// Rows too long for registers: a pass for the sum of squares (storing the residual sum), then
// one that reads the row again, mostly from L2, to scale it; a chunk's loads fly together.
// With kFloatSum the first pass stores nothing: the second reads input and residual again,
// stores their rounded sum and scales the float one.
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum>
__device__ __forceinline__ void normalize_in_two_passes(
    const Row<Tiling, kFusedAdd, Tuning::kPinOffsets>& row, const typename Tiling::Pack* weight,
    int lane, float eps, float* scratch) {
  constexpr int kChunk = Tiling::kMaxVecsInRegisters;
  using Pack = typename Tiling::Pack;
  float sum_sq = 0.0f;
#pragma unroll 1
  for (int first = 0; first < Tiling::kVecsPerThread; first += kChunk) {
    Pack x[kChunk], r[kFusedAdd ? kChunk : 1];
    load_slots<Tiling>(x, row.input, first, lane, row.valid);
    if constexpr (kFusedAdd) load_slots<Tiling>(r, row.residual, first, lane, row.valid);
    if constexpr (kFusedAdd && !kFloatSum) {
      combine<Tiling>(x, r, Add{});
      store_slots<Tiling>(row.residual, x, first, lane, row.valid);
    }
    sum_sq +=
        sum_of_squares<Tiling, Tuning::kSumChains, kChunk>(row_values<Tiling, kFloatSum>(x, r));
  }
  const auto scale = scale_by(
      rsqrtf(row_sum<Tiling, Tuning::kBroadcastSum>(sum_sq, scratch) / Tiling::kHidden + eps));
  // The stored sum is read back from the residual, which this thread wrote itself.
  const Pack* source = kFusedAdd && !kFloatSum ? row.residual : row.input;
#pragma unroll 1
  for (int first = 0; first < Tiling::kVecsPerThread; first += kChunk) {
    Pack x[kChunk], w[kChunk];
    load_slots<Tiling>(x, source, first, lane, row.valid);
    load_slots<Tiling>(w, weight, first, lane, row.valid);
    if constexpr (kFloatSum) {
      Pack r[kChunk], stored[kChunk];
      load_slots<Tiling>(r, row.residual, first, lane, row.valid);
      pack_values<Tiling>(stored, row_values<Tiling, true>(x, r));
      store_slots<Tiling>(row.residual, stored, first, lane, row.valid);
      combine_values<Tiling>(x, row_values<Tiling, true>(x, r), w, scale);
    } else {
      combine<Tiling>(x, w, scale);
    }
    store_slots<Tiling>(row.output, x, first, lane, row.valid);
  }
}
#endif  // JITK_DEVICE_HALF

// The registers a thread plans for: x, the weight and the fused form's residual, row_registers
// each, and 16; with float_sum 8 more, as the residual stays live through the reduction (held
// to the plan without them, three of its bodies spilled 8-12 bytes, sm_90, 4096 and 7168).
constexpr int register_plan(bool fused_add, int row_registers, bool float_sum = false) {
  return (fused_add ? 3 : 2) * row_registers + 16 + (float_sum ? 8 : 0);
}
// 8 blocks an SM (the register cap that sets) where that leaves a thread its plan at
// kMaxRowRegisters, so 1056 rows fill a wave of an H100 and 1024 rows of 4096 or 5120 in L2
// take one wave, not two as uncapped.
template <typename Tiling, bool kFusedAdd, bool kFloatSum>
inline constexpr int kMinBlocks =
    8 * Tiling::kBlockThreads * register_plan(kFusedAdd, kMaxRowRegisters, kFloatSum) <= 65536 ? 8
                                                                                               : 1;
// With kFillSm, as many blocks as an SM's 2048 threads hold while each thread keeps its plan
// for the registers its rows take, counted in the 8 a thread is given at a time: SGLang's
// block of hidden / 16 threads at 12288 holds two blocks an SM where an uncapped one of jitk
// held one; jitk's 384 threads there hold three. Offsets pinned before the wait plan 8 more
// (16 with the row loop), and the fused form's row loop 8: held to the plan without them,
// such bodies spilled 8-164 bytes (sm_90, 4096-12288). No more: 16 for the single turn too
// would cost the short path a block an SM at 12288, and time at 1024 rows in place. A spread
// layout (jitk/norm_order.cuh) plans 8 for its slots' offsets: without them, its rows of 256
// to 512 threads at 4096-8192 spilled 4-24 bytes under the 32 registers fill_sm allowed (sm_90).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum>
constexpr int fill_sm_blocks() {
  constexpr int kPlan = register_plan(kFusedAdd,
                                      min_of(Tiling::kVecsPerThread, Tiling::kMaxVecsInRegisters) *
                                          Tiling::kVecRegisters,
                                      kFloatSum) +
                        (Tuning::kPinOffsets ? (Tuning::kOneTurn ? 8 : 16) : 0) +
                        (kFusedAdd && !Tuning::kOneTurn ? 8 : 0) + (Tiling::kSpread > 1 ? 8 : 0);
  constexpr int kThreads = Tiling::kBlockThreads;  // whole warps
  int blocks = max_of(1, 2048 / kThreads);
  while (blocks > 1 && 65536 / (blocks * kThreads) / 8 * 8 < kPlan) --blocks;
  return blocks;
}
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum>
inline constexpr int kMinBlocksOf =
    Tuning::kFillSm        ? fill_sm_blocks<Tiling, Tuning, kFusedAdd, kFloatSum>()
    : Tuning::kRegisterCap ? kMinBlocks<Tiling, kFusedAdd, kFloatSum>
                           : 1;

#if JITK_DEVICE_HALF
// A plain call's grid has a block per kRowsPerBlock rows (fewer than 2^31 rows), so a block
// takes one turn, and a block of one row knows its row is there; its offset comes from
// blockIdx.x alone (uniform registers), as in SGLang's. With kOneTurn there is no loop either
// (straight-line code, where ptxas may issue the weight's loads after the sum of squares,
// unless kRowFirst loads them beside the row's; the loop keeps them before the row's).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum, bool kPlain>
__device__ __forceinline__ void normalize_rows(const Params& p, int64_t rows) {
  constexpr bool kOneTurn = kPlain && Tuning::kOneTurn;
  constexpr bool kRowPerBlock = Tiling::kRowsPerBlock == 1;
  // Turns alternate; row_sum reads the broadcast sums 16 bytes at a time.
  __shared__ alignas(Tuning::kBroadcastSum ? 16 : 4) float scratch[2][Tiling::kRowWarps];
  const int lane = kRowPerBlock ? static_cast<int>(threadIdx.x)
                                : static_cast<int>(threadIdx.x % Tiling::kThreadsPerRow);
  const int64_t step = int64_t{gridDim.x} * Tiling::kRowsPerBlock;
  const auto* weight = static_cast<const typename Tiling::Pack*>(p.weight);
  const int64_t group = kRowPerBlock ? 0 : threadIdx.x / Tiling::kThreadsPerRow;
  int64_t first = blockIdx.x * int64_t{Tiling::kRowsPerBlock};  // below p.rows: the grid fits
  const auto exists = [&](int64_t r) { return (kPlain && kRowPerBlock) || r < rows; };
  // Addresses and the prefetch (a hint: no value a load returns changes) need no data, so
  // they come before the wait and overlap the previous kernel. One block's prefetch serves all;
  // the others skip it by predicate, not a branch (device::prefetch_l2_if).
  Row<Tiling, kFusedAdd, Tuning::kPinOffsets> row(p, first + group, exists(first + group),
                                                  std::bool_constant<kPlain>{});
  if constexpr (Tuning::kPrefetchWeight) {
#pragma unroll
    for (int k = 0; k < Tiling::kVecsPerThread; ++k) {  // a prefetch per 128-byte line
      const int index = slot_index<Tiling>(lane, k);
      const bool line_start = index * Tiling::kVecBytes % 128 == 0;
      device::prefetch_l2_if(blockIdx.x == 0 && slot_live<Tiling>(lane, k, true) && line_start,
                             weight + index);
    }
  }
  // Launched with PDL, this kernel may start before the previous one is done: wait for it
  // before reading or writing anything. The next may launch now (or, with kLateTrigger, once
  // this block's work is done); either way it waits in turn for this one to finish.
  device::pdl_wait();
  if constexpr (!Tuning::kLateTrigger) device::pdl_launch_dependents();

  // Every thread of a block takes as many turns (on its first row): shuffles, barriers match.
  typename Tiling::Pack w[Tiling::kInRegisters ? Tiling::kVecsPerThread : 1];
  if constexpr (Tiling::kInRegisters && !Tuning::kRowFirst) {
    load_slots<Tiling>(w, weight, 0, lane, true);
  }
  for (int turn = 0, first_turn = 1;; turn ^= 1, first_turn = 0) {
    if constexpr (Tiling::kInRegisters) {
      normalize_in_registers<Tiling, Tuning, kFusedAdd, kFloatSum>(row, weight, w, first_turn, lane,
                                                                   p.eps, scratch[turn]);
    } else {
      normalize_in_two_passes<Tiling, Tuning, kFusedAdd, kFloatSum>(row, weight, lane, p.eps,
                                                                    scratch[turn]);
    }
    if (kOneTurn || (first += step) >= rows) break;
    row = Row<Tiling, kFusedAdd, Tuning::kPinOffsets>(p, first + group, exists(first + group),
                                                      std::bool_constant<kPlain>{});
  }
  if constexpr (Tuning::kLateTrigger) device::pdl_launch_dependents();
}
#endif  // JITK_DEVICE_HALF

// A kernel of its own for plain rows, which reads no parameter past the first line and needs
// only its own registers: as one kernel with both bodies, it took the two-run body's (47-56 a
// thread at 5120 x fp16 on 320 threads, 3 blocks an SM where SGLang's 32 fit 6).
// kFloatSum: the fused form normalises its sum as added in float32 (normalize_in_registers).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kFloatSum, bool kPlain>
__global__ void __launch_bounds__(Tiling::kBlockThreads,
                                  (kMinBlocksOf<Tiling, Tuning, kFusedAdd, kFloatSum>))
    rmsnorm_kernel(const __grid_constant__ Params p)
#if JITK_DEVICE_HALF
{
  normalize_rows<Tiling, Tuning, kFusedAdd, kFloatSum, kPlain>(p, kPlain ? p.plain_rows : p.rows);
}
#else
        ;
#endif

// ---------------------------------------------------------------------------------------
// kTwoVectors: a block a row, each thread two 16-byte vectors of it half a row apart (SGLang's
// layout for 16-bit rows of a multiple of 512). Warp 0 adds the warps' sums and works out 1/rms
// once, and a second barrier hands it out: every warp adding the sums itself after one barrier
// cost SGLang's kernel time at 1024 rows. At 7168 fp16, with the next kernel let launch at
// the start, ptxas issues the row's two loads and then the weight's, all before the sum of
// squares (with the late trigger, the weight's first), which put 1024 rows as single calls
// level with SGLang where the tuner's earlier choice trailed (verifying_and_tuning.md). Where a
// row is a multiple of 1024 bytes up to 32 KiB (kFits), for plain rows of whole vectors.
template <int kHidden, typename T>
struct TwoVectors : Access<T, 16 / kElemBytes<T>> {
  static constexpr int kVecSize = 16 / kElemBytes<T>;
  static constexpr int kThreads = kHidden / (2 * kVecSize);
  static constexpr bool kFits = two_vectors_fit(kHidden, kElemBytes<T>);
};

#if JITK_DEVICE_HALF
// `sum` plus the squares of a vector's elements, added a pair at a time.
template <int N>
__device__ __forceinline__ float add_squares(float sum, const device::Vec<float, N>& f) {
#pragma unroll
  for (int i = 0; i < N; i += 2) sum += f[i] * f[i] + f[i + 1] * f[i + 1];
  return sum;
}
#endif  // JITK_DEVICE_HALF

template <int kHidden, typename T, bool kFusedAdd, bool kFloatSum, bool kLateTrigger>
__global__ void __launch_bounds__(TwoVectors<kHidden, T>::kThreads)
    rmsnorm_two_vectors_kernel(const __grid_constant__ Params p)
#if JITK_DEVICE_HALF
{
  using Layout = TwoVectors<kHidden, T>;
  using Pack = typename Layout::Pack;
  constexpr int kThreads = Layout::kThreads;
  constexpr int kWarps = kThreads / kWarpThreads;
  __shared__ float partial[kWarpThreads];  // each warp's sum, then warp 0's 1/rms per lane
  device::pdl_wait();
  if constexpr (!kLateTrigger) device::pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  auto* x = reinterpret_cast<Pack*>(static_cast<T*>(p.x) + row * p.x_stride);
  auto* y = reinterpret_cast<Pack*>(static_cast<T*>(p.y) + row * p.y_stride);
  const auto* weight = static_cast<const Pack*>(p.weight);
  const unsigned first = threadIdx.x, second = threadIdx.x + kThreads;
  Pack v[2] = {x[first], x[second]};
  const Pack w[2] = {weight[first], weight[second]};
  Pack r[kFusedAdd ? 2 : 1];
  if constexpr (kFusedAdd) {  // y is the residual: the sum rounded and stored
    r[0] = y[first];
    r[1] = y[second];
    Pack stored[2];
    pack_values<Layout>(stored, row_values<Layout, true>(v, r));
    y[first] = stored[0];
    y[second] = stored[1];
    if constexpr (!kFloatSum) {  // normalised as stored
      v[0] = stored[0];
      v[1] = stored[1];
    }
  }
  const auto value = row_values<Layout, kFloatSum>(v, r);
  float sum = add_squares(add_squares(0.0f, value(0)), value(1));
  sum = device::warp_sum(sum);
  const unsigned warp = threadIdx.x / kWarpThreads;
  float inv_rms;
  if constexpr (kWarps == 1) {
    inv_rms = rsqrtf(sum / kHidden + p.eps);
  } else {
    partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
      const unsigned lane = threadIdx.x;
      sum = device::warp_sum(lane < unsigned{kWarps} ? partial[lane] : 0.0f);
      partial[lane] = rsqrtf(sum / kHidden + p.eps);
    }
    __syncthreads();
    inv_rms = partial[warp];
  }
  combine_values<Layout>(v, value, w, scale_by(inv_rms));
  Pack* out = kFusedAdd ? x : y;
  out[first] = v[0];
  out[second] = v[1];
  if constexpr (kLateTrigger) device::pdl_launch_dependents();
}
#else
        ;
#endif

}  // namespace jitk::norm
