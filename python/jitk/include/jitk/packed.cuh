// Float32, float16 and bfloat16 values moved as integer words and computed on as floats. A
// thread loads N elements in one access, holds them as 32-bit words (two 16-bit elements to
// a register, where typed halves would take a register each), unpacks them to float for the
// arithmetic and rounds the result back:
//
//   device::Packed<bf16_t, 8> p = row[i];             // 16 bytes: 4 words
//   device::Vec<float, 8> f = device::unpack<bf16_t, 8>(p);
//   row[i] = device::pack<bf16_t, 8>(f);              // to the nearest bfloat16
//
// A single 16-bit element travels as one uint16_t. Includes <cuda_fp16.h> and <cuda_bf16.h>
// (about 0.4 s of build time), which a kernel that only moves bytes does without.
#pragma once

#include <jitk/device.cuh>
#include <jitk/utils.cuh>

#if JITK_DEVICE_HALF
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#endif

namespace jitk::device {

template <typename T, int N>
  requires(std::is_same_v<T, fp32_t> || std::is_same_v<T, fp16_t> || std::is_same_v<T, bf16_t>)
using Packed = std::conditional_t<(N * kElemBytes<T> >= 4), Vec<uint32_t, N * kElemBytes<T> / 4>,
                                  Vec<uint16_t, 1>>;

// The rest is device code (see jitk/device.cuh).
#if JITK_DEVICE_HALF
namespace detail {

template <typename T>
__device__ __forceinline__ float half_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, fp16_t>) {
    return __half2float(std::bit_cast<fp16_t>(bits));
  } else {
    return __bfloat162float(std::bit_cast<bf16_t>(bits));
  }
}

template <typename T>
__device__ __forceinline__ uint16_t float_to_half(float v) {
  if constexpr (std::is_same_v<T, fp16_t>) {
    return std::bit_cast<uint16_t>(__float2half_rn(v));
  } else {
    return std::bit_cast<uint16_t>(__float2bfloat16_rn(v));
  }
}

// Two values rounded to T in one conversion (F2FP.*.PACK_AB on sm_90), low half first. Two
// conversions ORed together compiled to that instruction only where the word was just
// stored: where a bfloat16 word was unpacked again (the fused form's residual sum, normalised
// as stored), ptxas rounded each value apart and packed them with a PRMT a word (sm_90: 257
// instructions in fused_add_rmsnorm's bfloat16 kernel at 8192, two vectors a thread; 225 now).
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float low, float high) {
  const auto pair = [&] {
    if constexpr (std::is_same_v<T, fp16_t>)
      return __floats2half2_rn(low, high);
    else
      return __floats2bfloat162_rn(low, high);
  }();
  uint32_t word;  // memcpy: the pair types are not trivially copyable, so no std::bit_cast
  static_assert(sizeof(pair) == sizeof(word));
  memcpy(&word, &pair, sizeof(word));
  return word;
}

// Two 16-bit elements of one word, low half first.
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t word) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    // A bfloat16 is the upper half of the float of the same value.
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  } else {
    return make_float2(half_to_float<T>(static_cast<uint16_t>(word)),
                       half_to_float<T>(static_cast<uint16_t>(word >> 16)));
  }
}

}  // namespace detail

template <typename T, int N>
__device__ __forceinline__ Vec<float, N> unpack(const Packed<T, N>& p) {
  Vec<float, N> f;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = __uint_as_float(p[i]);
  } else if constexpr (N == 1) {
    f[0] = detail::half_to_float<T>(p[0]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 pair = detail::unpack_pair<T>(p[i]);
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  }
  return f;
}

// Rounds each value to the nearest T.
template <typename T, int N>
__device__ __forceinline__ Packed<T, N> pack(const Vec<float, N>& f) {
  Packed<T, N> p;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = __float_as_uint(f[i]);
  } else if constexpr (N == 1) {
    p[0] = detail::float_to_half<T>(f[0]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) p[i] = detail::round_pair<T>(f[2 * i], f[2 * i + 1]);
  }
  return p;
}

// An optimisation barrier on packed values: without it the compiler tends to keep values
// it has unpacked as floats while they wait (across a reduction, say), twice the registers
// for 16-bit elements.
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

#endif  // JITK_DEVICE_HALF

}  // namespace jitk::device
