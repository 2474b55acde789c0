// Probes for benchmarks/exp_persistent_costs.py: one warp does one thing the persistent worker
// does (read the global timer, sleep, read pinned host memory, fence at system scope) for a
// while, to find which one leaves later kernels slower.
#pragma once

#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>

namespace persistent_exp {

using jitk::LaunchKernel;
using jitk::TensorView;

__global__ void probe_kernel(int kind, const int64_t* host, int64_t iterations, int64_t* sink) {
  int64_t acc = 0;
  for (int64_t i = 0; i < iterations; ++i) {
    if (kind == 0) {
      int64_t t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      acc += t;
    } else if (kind == 1) {
      __nanosleep(256);
    } else if (kind == 2) {
      int64_t v;
      asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(host) : "memory");
      acc += v;
    } else if (kind == 3) {
      asm volatile("fence.acq_rel.sys;" ::: "memory");
    } else if (kind == 4) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
    } else if (kind == 5) {
      __nanosleep(32);
    } else if (kind == 6 && i < 10) {
      __nanosleep(1000);
    }
  }
  if (acc == 42) sink[0] = acc;
}

inline void probe(int64_t kind, int64_t host_address, int64_t iterations, TensorView sink,
                  int64_t stream) {
  const auto* host = reinterpret_cast<const int64_t*>(host_address);
  LaunchKernel(1, 32, reinterpret_cast<cudaStream_t>(stream))(
      probe_kernel, static_cast<int>(kind), host, iterations,
      static_cast<int64_t*>(sink.data_ptr()));
}

}  // namespace persistent_exp
