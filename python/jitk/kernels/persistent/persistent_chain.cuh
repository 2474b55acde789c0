// Ops for a persistent worker (jitk/persistent.cuh) over short bf16 rows: the chain that
// benchmarks/bench_persistent.py times and the GPU tests check. Each runs on one block of
// kBlockThreads threads, in 16-byte vectors of 8 elements where the row length and the
// pointers allow (else element by element); persistent.py checks that tensors are contiguous.
#pragma once

#include <jitk/device.cuh>
#include <jitk/persistent.cuh>

#include <cuda_bf16.h>

#include <cstdint>

namespace jitk::persistent::chain {

inline constexpr int kThreads = kBlockThreads;
inline constexpr int kVec = 8;
using Vec = device::Vec<bf16_t, kVec>;

template <typename... Pointers>
__device__ __forceinline__ bool vectorizable(int64_t n, const Pointers*... p) {
  return n % kVec == 0 && ((reinterpret_cast<uintptr_t>(p) % sizeof(Vec) == 0) && ...);
}

// f(v) for each vector index v of the row, a thread's spaced the block apart; unrolled two
// deep, so a 4096-element row's two vectors a thread are loaded together.
template <typename F>
__device__ __forceinline__ void for_each_vec(int64_t n, F&& f) {
#pragma unroll 2
  for (int64_t v = threadIdx.x; v < n / kVec; v += kThreads) f(v);
}

// y = rmsnorm(x) * w over one row of n.
struct RMSNorm {
  // Rows of up to kThreads * kVec * kHeldVecs elements stay in registers between the sum and
  // the scaling, and the weight loads go out with the row's: one memory round trip an item,
  // where the general path below takes two (a chain's item time is mostly such trips).
  static constexpr int kHeldVecs = 2;
  struct Args {
    const bf16_t* x;
    const bf16_t* w;
    bf16_t* y;
    int64_t n;
    double eps;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    __shared__ alignas(16) float scratch[kThreads / kWarpThreads];
    const bool vec = vectorizable(a.n, a.x, a.w, a.y);
    const auto* xv = reinterpret_cast<const Vec*>(a.x);
    const auto* wv = reinterpret_cast<const Vec*>(a.w);
    auto* yv = reinterpret_cast<Vec*>(a.y);
    if (vec && a.n <= kThreads * kVec * kHeldVecs) return run_held(a, xv, wv, yv, scratch);
    float sum = 0.0f;
    if (vec) {
      for_each_vec(a.n, [&](int64_t v) {
        const Vec x = xv[v];
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum += __bfloat162float(x[k]) * __bfloat162float(x[k]);
      });
    } else {
      for (int64_t i = threadIdx.x; i < a.n; i += kThreads) {
        const float v = __bfloat162float(a.x[i]);
        sum += v * v;
      }
    }
    const float scale = inverse_rms(sum, a, scratch);
    if (vec) {
      for_each_vec(a.n, [&](int64_t v) {
        const Vec x = xv[v], w = wv[v];
        Vec y;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          y[k] = __float2bfloat16(__bfloat162float(x[k]) * scale * __bfloat162float(w[k]));
        }
        yv[v] = y;
      });
    } else {
      for (int64_t i = threadIdx.x; i < a.n; i += kThreads) {
        a.y[i] = __float2bfloat16(__bfloat162float(a.x[i]) * scale * __bfloat162float(a.w[i]));
      }
    }
  }

  // The row's sum after one barrier (device::block_sum's broadcast form); the worker's barrier
  // after each item frees the scratch for the next item's sum. A chain's item time is mostly such
  // dependent steps.
  static __device__ float inverse_rms(float sum, const Args& a, float* scratch) {
    const float total = device::block_sum<kThreads, false, true>(sum, scratch);
    return rsqrtf(total / static_cast<float>(a.n) + static_cast<float>(a.eps));
  }

  static __device__ void run_held(const Args& a, const Vec* xv, const Vec* wv, Vec* yv,
                                  float* scratch) {
    Vec x[kHeldVecs], w[kHeldVecs];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kHeldVecs; ++j) {
      const int64_t v = threadIdx.x + j * kThreads;
      if (v >= a.n / kVec) continue;
      x[j] = xv[v];
      w[j] = wv[v];
    }
#pragma unroll
    for (int j = 0; j < kHeldVecs; ++j) {
      if (threadIdx.x + j * kThreads >= a.n / kVec) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum += __bfloat162float(x[j][k]) * __bfloat162float(x[j][k]);
    }
    const float scale = inverse_rms(sum, a, scratch);
#pragma unroll
    for (int j = 0; j < kHeldVecs; ++j) {
      const int64_t v = threadIdx.x + j * kThreads;
      if (v >= a.n / kVec) continue;
      Vec y;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        y[k] = __float2bfloat16(__bfloat162float(x[j][k]) * scale * __bfloat162float(w[j][k]));
      }
      yv[v] = y;
    }
  }
};

// y[i] = f(x[i], b[i]) elementwise in float32, b optional (null for a one-input op).
template <typename F>
__device__ __forceinline__ void elementwise(const bf16_t* x, const bf16_t* b, bf16_t* y, int64_t n,
                                            F&& f) {
  if (vectorizable(n, x, b, y)) {
    const auto* xv = reinterpret_cast<const Vec*>(x);
    const auto* bv = reinterpret_cast<const Vec*>(b);
    auto* yv = reinterpret_cast<Vec*>(y);
    for_each_vec(n, [&](int64_t v) {
      const Vec xs = xv[v];
      const Vec bs = b != nullptr ? bv[v] : xs;
      Vec out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out[k] = __float2bfloat16(f(__bfloat162float(xs[k]), __bfloat162float(bs[k])));
      }
      yv[v] = out;
    });
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const bf16_t other = b != nullptr ? b[i] : x[i];
      y[i] = __float2bfloat16(f(__bfloat162float(x[i]), __bfloat162float(other)));
    }
  }
}

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
    elementwise(a.x, nullptr, a.y, a.n, [&](float x, float) { return x * factor; });
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
    elementwise(a.x, a.b, a.y, a.n, [](float x, float b) { return x + b; });
  }
};

}  // namespace jitk::persistent::chain
