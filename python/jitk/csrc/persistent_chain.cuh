// Ops for a persistent worker (jitk/persistent.cuh) over short bf16 rows: the chain that
// benchmarks/bench_persistent.py times and the GPU tests check. Each runs on one block of
// kBlockThreads threads, element by element: the rows are short, so latency counts, not
// bandwidth. persistent.py checks that every tensor is contiguous.
#pragma once

#include <jitk/device.cuh>
#include <jitk/persistent.cuh>

#include <cuda_bf16.h>

#include <cstdint>

namespace jitk::persistent::chain {

inline constexpr int kThreads = kBlockThreads;

// f(i) for every element index of n, a thread's elements spaced the block apart.
template <typename F>
__device__ __forceinline__ void for_each(int64_t n, F&& f) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads) f(i);
}

// y = rmsnorm(x) * w over one row of n.
struct RMSNorm {
  struct Args {
    const bf16_t* x;
    const bf16_t* w;
    bf16_t* y;
    int64_t n;
    double eps;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    __shared__ float scratch[kThreads / kWarpThreads];
    float sum = 0.0f;
    for_each(a.n, [&](int64_t i) {
      const float v = __bfloat162float(a.x[i]);
      sum += v * v;
    });
    const float total = device::block_sum<kThreads>(sum, scratch);
    const float scale = rsqrtf(total / static_cast<float>(a.n) + static_cast<float>(a.eps));
    for_each(a.n, [&](int64_t i) {
      a.y[i] = __float2bfloat16(__bfloat162float(a.x[i]) * scale * __bfloat162float(a.w[i]));
    });
  }
};

// y = x * factor.
struct Scale {
  struct Args {
    const bf16_t* x;
    bf16_t* y;
    int64_t n;
    double factor;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    const float factor = static_cast<float>(a.factor);
    for_each(a.n, [&](int64_t i) { a.y[i] = __float2bfloat16(__bfloat162float(a.x[i]) * factor); });
  }
};

// y = x + b.
struct Add {
  struct Args {
    const bf16_t* x;
    const bf16_t* b;
    bf16_t* y;
    int64_t n;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    for_each(a.n, [&](int64_t i) {
      a.y[i] = __float2bfloat16(__bfloat162float(a.x[i]) + __bfloat162float(a.b[i]));
    });
  }
};

}  // namespace jitk::persistent::chain
