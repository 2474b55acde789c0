// The order in which jitk's RMSNorm adds a row's sum of squares at its default tuning, shared
// by jitk::norm::RMSNorm (kernels/norm/rmsnorm.cuh) and the persistent worker's chain RMSNorm
// (kernels/persistent/persistent_chain.cuh), so that both give a row the same bits:
//   - the row is read in accesses of vec_size elements, spread over threads_per_row threads,
//     slot k of thread t being access t + k * threads_per_row;
//   - each thread adds the squares of its slots' elements, slot then element in order, in one
//     chain of fmaf from 0;
//   - the threads' sums are added by device::warp_sum's xor tree over the row's lanes, then
//     device::block_sum's tree over warps (either form: they add alike);
//   - inv_rms = rsqrtf(sum / hidden + eps), and each output is x * inv_rms * w, rounded.
#pragma once

#include <jitk/utils.cuh>

#include <bit>
#include <cstdint>

namespace jitk::norm {

inline constexpr int kMaxBlockThreads = 1024;
// The most registers a thread gives to its part of x (and as many to the weight) before a
// row is read twice: room to spare in the 64 a 1024-thread block leaves each.
inline constexpr int kMaxRowRegisters = 16;

// From H100 sweeps (debugging_and_performance.md). Rows under 512 bytes: a lane per 16-byte
// vector (a warp's loads cover whole lines); longer: four vectors a thread (ahead of two at
// 8192). jitk.norm overrides the launch per shape where `python -m jitk tune` found better,
// keeping this order (verifying_and_tuning.md, "Batch invariance").
constexpr int default_row_registers(int hidden, int elem_bytes) {
  return int64_t{hidden} * elem_bytes < 512 ? 4 : 16;  // up to kMaxHidden x 4 bytes
}

// The threads a row is spread over, in accesses of vec_size elements with row_registers a
// thread would rather give x: a row too short for a warp takes a power of two of its lanes, a
// longer one whole warps, at most a block. With the access width it fixes a row's order of
// summation: the slots a thread adds and the tree over lanes and warps.
constexpr int threads_per_row(int hidden, int elem_bytes, int vec_size, int row_registers) {
  const int vec_registers = max_of(1, vec_size * elem_bytes / 4);
  const int wanted = div_ceil(hidden / vec_size, max_of(1, row_registers / vec_registers));
  return wanted <= kWarpThreads
             ? static_cast<int>(std::bit_ceil(static_cast<unsigned>(wanted)))
             : min_of(div_ceil(wanted, kWarpThreads) * kWarpThreads, kMaxBlockThreads);
}

}  // namespace jitk::norm
