// Device-side helpers shared by jitk kernels: 16-byte vectors, streaming memory access and
// L2 prefetch, a timed pause, warp and block reductions, and programmatic-dependent-launch
// hooks.
#pragma once

#include <jitk/utils.cuh>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <cstdint>
#endif

namespace jitk::device {

// N elements of T, aligned so that the whole vector moves in one instruction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T data[N];
  __device__ T& operator[](int i) { return data[i]; }
  __device__ const T& operator[](int i) const { return data[i]; }
};

// The number of T that fit in 16 bytes, the widest per-thread global access.
template <typename T>
inline constexpr int kVec16 = 16 / sizeof(T);

// The rest is device code: a host half built by the host compiler alone (jitk/nvrtc.cuh)
// sees only the types above.
#if JITK_DEVICE_HALF

// 16-byte loads and stores that bypass L1 and mark the line evict-first in L2: for data
// touched exactly once (copies, transfers), so it does not push out data that is reused.
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}
__device__ __forceinline__ void store_stream(void* ptr, const uint4& v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Makes the compiler compute `value` (64 bits) here, before any later volatile asm (pdl_wait,
// say), rather than where it is first used.
template <typename T>
__device__ __forceinline__ void compute_now(T& value) {
  static_assert(sizeof(T) == 8);
  asm volatile("" : "+l"(value));
}

// The global timer in nanoseconds (it advances in coarse steps, not every nanosecond).
__device__ __forceinline__ int64_t now_ns() {
  int64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits about `ns` by reading the global timer: how jitk's polls back off. Not __nanosleep:
// on one H100, CUDA graph replays of small kernels ran slower from right after a kernel ran
// __nanosleep, in each of five processes, and after none of the other things a persistent
// worker does (experiments/exp_persistent_costs.py; persistent_kernels.md). Later runs saw
// the same step without it, so the cause is not settled; a timer loop costs a waiting warp
// nothing it needs, so jitk avoids __nanosleep.
__device__ __forceinline__ void pause_ns(unsigned ns) {
  const int64_t until = now_ns() + ns;
  while (now_ns() < until) {
  }
}

// Asks L2 for the 128-byte line holding `ptr`. A hint: no value any load returns changes,
// so it is safe even before pdl_wait().
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// prefetch_l2 where `wanted`, as one predicated instruction rather than a branch: code around
// it stays one block for the compiler to schedule. Block 0's branch to its prefetch let ptxas
// issue RMSNorm's weight loads after its sum of squares, which cost more than the prefetch
// saved at SGLang's thread count (debugging_and_performance.md).
__device__ __forceinline__ void prefetch_l2_if(bool wanted, const void* ptr) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p prefetch.global.L2 [%1];\n}" ::"r"(
                   static_cast<int>(wanted)),
               "l"(ptr));
}

// The sum over each aligned run of kLanes lanes of a warp (the whole warp by default), which
// every lane of the run gets: xor stays inside the run.
template <int kLanes = kWarpThreads, typename T>
__device__ __forceinline__ T warp_sum(T value) {
  static_assert(kLanes >= 1 && kLanes <= kWarpThreads && (kLanes & (kLanes - 1)) == 0);
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

namespace detail {
// What lane kLane of a warp holds after warp_sum's shuffles down to offset kOffset, given
// value(i) in lane i (kCount of them; lanes past them hold 0): the pair of kOffset * 2's
// values kOffset apart, added depth first so that few partial sums are live at a time.
// Offsets start at kCount rounded up to a power of two: larger ones only add 0.
template <int kCount, int kLane, int kOffset, typename F>
__device__ __forceinline__ auto tree_sum(const F& value) {
  if constexpr (kOffset >= static_cast<int>(pow2_ceil(kCount))) {
    return value(kLane);
  } else if constexpr (kLane + kOffset >= kCount) {
    return tree_sum<kCount, kLane, kOffset * 2>(value);
  } else {
    return tree_sum<kCount, kLane, kOffset * 2>(value) +
           tree_sum<kCount, kLane + kOffset, kOffset * 2>(value);
  }
}
}  // namespace detail

// The sum of value(0) .. value(kCount - 1) (kCount <= 32) in warp_sum's tree, as if lane i
// held value(i): at each offset o = 16, 8, ..., 1, sum i takes sum i + o (xor pairs of lanes
// add the same two values, and a lane past kCount adds 0, which leaves any sum but -0 as it
// was). Every thread gets it: by a shuffle in each warp, or, with kBroadcast, by every thread
// calling value itself (loads from shared memory, say: same-address reads broadcast): fewer
// dependent steps, the same bits.
template <int kCount, bool kBroadcast, typename F>
__device__ __forceinline__ auto lanes_tree_sum(const F& value) {
  static_assert(kCount >= 1 && kCount <= kWarpThreads);
  if constexpr (kBroadcast) {
    return detail::tree_sum<kCount, 0, 1>(value);
  } else {
    const int lane = threadIdx.x % kWarpThreads;
    using T = decltype(value(0));
    return warp_sum(lane < kCount ? value(lane) : T{});
  }
}

// Sum over the block; every thread gets the result. After each warp's own sum and a barrier,
// the warps' sums in `scratch` (one T per warp) are added by lanes_tree_sum, in either of its
// forms (kBroadcast), which give the same bits. `scratch` is free again on return; a caller
// that alternates between two scratch buffers may drop that last barrier (kFreeScratch =
// false): the next call's barrier orders the reuse.
template <int kThreads, bool kFreeScratch = true, bool kBroadcast = false, typename T>
__device__ __forceinline__ T block_sum(T value, T* scratch) {
  static_assert(kThreads % kWarpThreads == 0 && kThreads <= 1024);
  constexpr int kWarps = kThreads / kWarpThreads;
  value = warp_sum(value);
  if constexpr (kWarps == 1) {
    return value;
  } else {
    if (threadIdx.x % kWarpThreads == 0) scratch[threadIdx.x / kWarpThreads] = value;
    __syncthreads();
    value = lanes_tree_sum<kWarps, kBroadcast>([scratch](int i) { return scratch[i]; });
    if constexpr (kFreeScratch) __syncthreads();
    return value;
  }
}

// Programmatic dependent launch (LaunchKernel::enable_pdl). Both are no-ops before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#endif  // JITK_DEVICE_HALF

}  // namespace jitk::device
