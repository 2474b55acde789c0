// Ops for a persistent worker (jitk/persistent.cuh) over short bf16 rows: the chain that
// benchmarks/bench_persistent.py times and the GPU tests check. Each runs on one block of
// kBlockThreads threads, in 16-byte vectors of 8 elements where the row length and the
// pointers allow (else element by element); persistent.py checks that tensors are contiguous.
// Written in two halves (jitk/nvrtc.cuh): the ops' code is device code, their Args are
// what the host half sees.
#pragma once

#include <jitk/persistent.cuh>

#include <jitk/device.cuh>
#include <jitk/norm_order.cuh>

#if JITK_DEVICE_HALF
#include <cuda_bf16.h>
#endif
#if JITK_HOST_HALF
#include <cstdint>
#endif

namespace jitk::persistent::chain {

inline constexpr int kThreads = kBlockThreads;
inline constexpr int kVec = 8;
using Vec = device::Vec<bf16_t, kVec>;

#if JITK_DEVICE_HALF

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

#endif  // JITK_DEVICE_HALF

// y = rmsnorm(x) * w over one row of n. Where the row's threads in jitk.rmsnorm's order
// (jitk/norm_order.cuh, at the default tuning) fit this block, it adds the row in that order,
// so a row gets the bits jitk.rmsnorm gives it: in vectors of 8 where the row and pointers
// allow (jitk.rmsnorm's widest access for rows of a multiple of 8), else an element a slot
// (its access for odd or misaligned rows); up to 8192 and 4096 elements. The row stays in
// registers between the sum and the scaling, and the weight's loads go out with the row's.
// Longer rows take a general order, reading the row twice.
struct RMSNorm {
  struct Args {
    const bf16_t* x;
    const bf16_t* w;
    bf16_t* y;
    int64_t n;
    double eps;
  };
#if JITK_DEVICE_HALF
  static __device__ void run(const Args& a, BlockContext&) {
    __shared__ alignas(16) float scratch[kThreads / kWarpThreads];
    if (vectorizable(a.n, a.x, a.w, a.y)) {
      if (!run_in_order<kVec>(a, scratch)) run_long<kVec>(a, scratch);
    } else if (!run_in_order<1>(a, scratch)) {
      run_long<1>(a, scratch);
    }
  }

  // The row's sum after one barrier, in jitk.rmsnorm's tree (norm::row_block_sum's broadcast
  // form); the worker's barrier after each item frees the scratch for the next item's sum.
  // Threads past the row's add 0, which leaves the tree's sums as they are.
  static __device__ float inverse_rms(float sum, const Args& a, float* scratch) {
    const float total = norm::row_block_sum<kThreads, 1, true>(sum, scratch);
    return rsqrtf(total / static_cast<float>(a.n) + static_cast<float>(a.eps));
  }

  // jitk.rmsnorm's order; false, doing nothing, where its threads would not fit the block.
  template <int kSize>
  static __device__ bool run_in_order(const Args& a, float* scratch) {
    using Slot = device::Vec<bf16_t, kSize>;
    constexpr int kBytes = static_cast<int>(sizeof(bf16_t));
    constexpr int kMaxSlots = norm::kMaxRowRegisters / max_of(1, kSize * kBytes / 4);
    if (a.n > int64_t{kThreads} * kSize * kMaxSlots) return false;
    const int n = static_cast<int>(a.n), slots = n / kSize;
    const int threads =
        norm::threads_per_row(n, kBytes, kSize, norm::default_row_registers(n, kBytes));
    if (threads > kThreads) return false;
    const auto* xs = reinterpret_cast<const Slot*>(a.x);
    const auto* ws = reinterpret_cast<const Slot*>(a.w);
    auto* ys = reinterpret_cast<Slot*>(a.y);
    const int lane = static_cast<int>(threadIdx.x);
    Slot x[kMaxSlots], w[kMaxSlots];
#pragma unroll
    for (int k = 0; k < kMaxSlots; ++k) {
      const int v = lane + k * threads;
      if (lane < threads && v < slots) {
        x[k] = xs[v];
        w[k] = ws[v];
      }
    }
    float sums[kMaxSlots];  // norm::slot_squares, then norm::slots_sum's tree; dead slots 0
#pragma unroll
    for (int k = 0; k < kMaxSlots; ++k) {
      const bool live = lane < threads && lane + k * threads < slots;
      sums[k] =
          live ? norm::slot_squares<kSize>([&](int e) { return __bfloat162float(x[k][e]); }) : 0.0f;
    }
    const float scale = inverse_rms(norm::slots_sum(sums), a, scratch);
#pragma unroll
    for (int k = 0; k < kMaxSlots; ++k) {
      const int v = lane + k * threads;
      if (lane >= threads || v >= slots) continue;
      Slot y;
#pragma unroll
      for (int e = 0; e < kSize; ++e) {
        y[e] = __float2bfloat16(__bfloat162float(x[k][e]) * scale * __bfloat162float(w[k][e]));
      }
      ys[v] = y;
    }
    return true;
  }

  // Rows too long for the block in jitk.rmsnorm's order: a pass for the sum, one to scale.
  template <int kSize>
  static __device__ void run_long(const Args& a, float* scratch) {
    using Slot = device::Vec<bf16_t, kSize>;
    const auto* xs = reinterpret_cast<const Slot*>(a.x);
    const auto* ws = reinterpret_cast<const Slot*>(a.w);
    auto* ys = reinterpret_cast<Slot*>(a.y);
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < a.n / kSize; v += kThreads) {
      const Slot x = xs[v];
#pragma unroll
      for (int e = 0; e < kSize; ++e)
        sum = fmaf(__bfloat162float(x[e]), __bfloat162float(x[e]), sum);
    }
    const float scale = inverse_rms(sum, a, scratch);
    for (int64_t v = threadIdx.x; v < a.n / kSize; v += kThreads) {
      const Slot x = xs[v], w = ws[v];
      Slot y;
#pragma unroll
      for (int e = 0; e < kSize; ++e) {
        y[e] = __float2bfloat16(__bfloat162float(x[e]) * scale * __bfloat162float(w[e]));
      }
      ys[v] = y;
    }
  }
#endif  // JITK_DEVICE_HALF
};

#if JITK_DEVICE_HALF
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
#endif  // JITK_DEVICE_HALF

// y = x * factor.
struct Scale {
  struct Args {
    const bf16_t* x;
    bf16_t* y;
    int64_t n;
    double factor;
  };
#if JITK_DEVICE_HALF
  static __device__ void run(const Args& a, BlockContext&) {
    const float factor = static_cast<float>(a.factor);
    elementwise(a.x, nullptr, a.y, a.n, [&](float x, float) { return x * factor; });
  }
#endif
};

// y = x + b.
struct Add {
  struct Args {
    const bf16_t* x;
    const bf16_t* b;
    bf16_t* y;
    int64_t n;
  };
#if JITK_DEVICE_HALF
  static __device__ void run(const Args& a, BlockContext&) {
    elementwise(a.x, a.b, a.y, a.n, [](float x, float b) { return x + b; });
  }
#endif
};

}  // namespace jitk::persistent::chain
