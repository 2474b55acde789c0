// The order in which jitk's RMSNorm adds a row's sum of squares, shared by jitk::norm::RMSNorm
// (kernels/norm/rmsnorm.cuh) and the persistent worker's chain RMSNorm
// (kernels/persistent/persistent_chain.cuh), so that both give a row the same bits:
//   - the row is read in accesses of vec_size elements (slots), spread over threads_per_row
//     threads; in the base layout, slot k of thread t is access t + k * threads_per_row;
//   - a slot's squares in chains of fmaf from 0 over 4 consecutive elements, the chains and
//     then a thread's slots added by slots_sum's halving tree (slot_squares);
//   - the threads' sums by lanes_sum's xor tree over the row's lanes (masks 1, 2, 4, ...),
//     then over whole warps by device::lanes_tree_sum's tree (either form: they add alike);
//   - inv_rms = rsqrtf(sum / hidden + eps), and each output is x * inv_rms * w, rounded.
// A row of 16-byte accesses that the default layout gives whole warps (four slots a thread)
// may also be spread over 2 or 4 times the threads (row_registers 8 or 4) without changing
// that order: spread_slot says which access each of their slots reads, lanes_sum and
// row_block_sum add in the base layout's tree. So the tuner may pick the threads a row takes per
// batch size and a row still gets the same bits.
#pragma once

#include <jitk/device.cuh>
#include <jitk/utils.cuh>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <cstdint>
#endif

namespace jitk::norm {

inline constexpr int kMaxBlockThreads = 1024;
// The most registers a thread gives to its part of x (and as many to the weight) before a
// row is read twice: room to spare in the 64 a 1024-thread block leaves each.
inline constexpr int kMaxRowRegisters = 16;
// The slots of a thread in the layout spread layouts keep the order of: 16 registers of
// 16-byte accesses.
inline constexpr int kBaseSlots = 4;
// The lanes whose 16-byte accesses cover one 128-byte line: a spread layout's loads still
// read whole lines.
inline constexpr int kLineLanes = 8;

// From H100 sweeps (debugging_and_performance.md). Rows under 512 bytes: a lane per 16-byte
// vector (a warp's loads cover whole lines); longer: four vectors a thread (ahead of two at
// 8192). jitk.norm overrides the launch per shape where `python -m jitk tune` found better,
// keeping this order (verifying_and_tuning.md, "Batch invariance").
constexpr int default_row_registers(int hidden, int elem_bytes) {
  return int64_t{hidden} * elem_bytes < 512 ? 4 : 16;  // up to kMaxHidden x 4 bytes
}

// The threads a row takes in the base layout: a row too short for a warp takes a power of two
// of its lanes, a longer one whole warps, at most a block.
constexpr int base_threads_per_row(int hidden, int elem_bytes, int vec_size, int row_registers) {
  const int vec_registers = max_of(1, vec_size * elem_bytes / 4);
  const int wanted = div_ceil(hidden / vec_size, max_of(1, row_registers / vec_registers));
  return wanted <= kWarpThreads
             ? static_cast<int>(pow2_ceil(wanted))
             : min_of(div_ceil(wanted, kWarpThreads) * kWarpThreads, kMaxBlockThreads);
}

// How many times the threads of the default layout (16 registers) a layout of row_registers
// spreads a row over while keeping its order: 2 or 4 for 8 or 4 registers where the row is
// read in 16-byte accesses, the default gives it whole warps of four slots each, and the
// spread threads fit a block; else 1 (the layout's own base order).
constexpr int row_spread(int hidden, int elem_bytes, int vec_size, int row_registers) {
  if (vec_size * elem_bytes != 16 || (row_registers != 8 && row_registers != 4)) return 1;
  const int base = base_threads_per_row(hidden, elem_bytes, vec_size, kMaxRowRegisters);
  const int spread = kMaxRowRegisters / row_registers;
  const bool fits = base >= kWarpThreads && hidden / vec_size <= kBaseSlots * base &&
                    base * spread <= kMaxBlockThreads;
  return fits ? spread : 1;
}

// The threads a row is spread over, in accesses of vec_size elements with row_registers a
// thread would rather give x. With the access width it fixes a row's order of summation.
constexpr int threads_per_row(int hidden, int elem_bytes, int vec_size, int row_registers) {
  const int spread = row_spread(hidden, elem_bytes, vec_size, row_registers);
  return spread > 1 ? spread * base_threads_per_row(hidden, elem_bytes, vec_size, kMaxRowRegisters)
                    : base_threads_per_row(hidden, elem_bytes, vec_size, row_registers);
}

// The rest is device code (see jitk/device.cuh).
#if JITK_DEVICE_HALF
// The access slot k of thread `lane` reads in a layout spreading a base of kBaseThreads
// threads kSpread times. Lane l of warp w is line lane g = l % 8 of line group q = l / 8.
// The base layout's thread 32 w' + 8 q' + g holds slot k' of line 4 w' + q' + k' * lines,
// lines = kBaseThreads / 8: a spread thread holds base slots kb + kSpread * k of line group
// o = (4 / kSpread) w + q % (4 / kSpread), kb = q / (4 / kSpread). Each 8 lanes still read one
// 128-byte line, and the base's in-thread pairs are split over lanes 16 (then 8) apart.
template <int kBaseThreads, int kSpread>
__device__ __forceinline__ int spread_slot(int lane, int k) {
  constexpr int kSlots = kBaseSlots / kSpread, kLines = kBaseThreads / kLineLanes;
  const int w = lane / kWarpThreads, q = lane % kWarpThreads / kLineLanes, g = lane % kLineLanes;
  const int line = kSlots * w + q % kSlots, base_slot = q / kSlots + kSpread * k;
  return kLineLanes * (line + base_slot * kLines) + g;
}

// A thread's sum of its slots' sums: slot k takes slot k + h for h = P/2, P/4, ..., 1
// (P = kCount rounded up to a power of two; past kCount, 0).
template <int kCount>
__device__ __forceinline__ float slots_sum(float (&sums)[kCount]) {
  constexpr int kPow = static_cast<int>(pow2_ceil(kCount));
#pragma unroll
  for (int half = kPow / 2; half >= 1; half /= 2) {
#pragma unroll
    for (int k = 0; k < half; ++k) {
      if (k + half < kCount) sums[k] += sums[k + half];
    }
  }
  return sums[0];
}

// The sum of squares of a slot of kSize elements (element(e) is element e as a float): chains
// of fmaf from 0 over 4 consecutive elements, added by slots_sum's tree. Short chains keep a
// short launch's critical path short (a thread of two 16-byte bf16 slots: 4 FMAs and 2 adds).
inline constexpr int kChainElements = 4;
template <int kSize, typename F>
__device__ __forceinline__ float slot_squares(const F& element) {
  constexpr int kChains = div_ceil(kSize, kChainElements);
  float chains[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    chains[c] = 0.0f;
#pragma unroll
    for (int e = c * kChainElements; e < min_of(kSize, (c + 1) * kChainElements); ++e) {
      const float f = element(e);
      chains[c] = fmaf(f, f, chains[c]);
    }
  }
  return slots_sum(chains);
}

// The sum over each aligned run of kLanes lanes, in the base layout's tree: masks 1, 2, 4, ...
// A spread layout first adds the base slots it split over lanes (masks 16, then 8 with a
// spread of 4), then the line lanes (1, 2, 4), then (spread 2) the warp's two line groups (8).
template <int kLanes, int kSpread = 1>
__device__ __forceinline__ float lanes_sum(float value) {
  static_assert(kSpread == 1 || kLanes == kWarpThreads);
  const auto add = [&value](int mask) { value += __shfl_xor_sync(0xffffffffu, value, mask); };
  if constexpr (kSpread == 1) {
#pragma unroll
    for (int mask = 1; mask < kLanes; mask *= 2) add(mask);
  } else {
    add(16);
    if constexpr (kSpread == 4) add(8);
    add(1);
    add(2);
    add(4);
    if constexpr (kSpread == 2) add(8);
  }
  return value;
}

// A row of kThreads (whole warps) in one block: each warp's lanes_sum, then the warps' sums
// through `scratch` (a float a warp), kSpread consecutive ones added as the base adds its
// line groups ((0 + 1) + (2 + 3)), then the base's warps by device::lanes_tree_sum
// (kBroadcast picks its form). Every thread gets the sum. Consecutive calls must alternate
// between two scratch buffers, or have a barrier between them.
template <int kThreads, int kSpread = 1, bool kBroadcast = false>
__device__ __forceinline__ float row_block_sum(float value, float* scratch) {
  static_assert(kThreads % (kWarpThreads * kSpread) == 0 && kThreads <= kMaxBlockThreads);
  constexpr int kWarps = kThreads / kWarpThreads;
  value = lanes_sum<kWarpThreads, kSpread>(value);
  if constexpr (kWarps == 1) {
    return value;
  } else {
    if (threadIdx.x % kWarpThreads == 0) scratch[threadIdx.x / kWarpThreads] = value;
    __syncthreads();
    return device::lanes_tree_sum<kWarps / kSpread, kBroadcast>([scratch](int i) {
      const float* s = scratch + i * kSpread;
      if constexpr (kSpread == 4) return (s[0] + s[1]) + (s[2] + s[3]);
      if constexpr (kSpread == 2) return s[0] + s[1];
      return s[0];
    });
  }
}

#endif  // JITK_DEVICE_HALF

}  // namespace jitk::norm
