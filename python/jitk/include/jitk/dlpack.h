// DLPack's dtypes and devices as jitk uses them: comparison, the dtype of a C++ type, the
// names PyTorch users know them by, and how messages print them.
#pragma once

#include <jitk/utils.h>

#include <dlpack/dlpack.h>

#include <concepts>
#include <cstdint>

// Declared, not included: dtype_trait only needs the names, and <cuda_fp16.h> with
// <cuda_bf16.h> cost about 0.4 s of every build. Kernels that compute on them include them.
struct __half;
struct __nv_bfloat16;

// DLPack's dtype compared as tvm-ffi's <tvm/ffi/dtype.h> does, for the translation units
// that do not include it. Templates, so that a kernel may include tvm-ffi's headers after
// this one: its plain functions then coexist with these and win overload resolution.
template <std::same_as<DLDataType> D>
bool operator==(const D& a, const D& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
template <std::same_as<DLDataType> D>
bool operator!=(const D& a, const D& b) {
  return !(a == b);
}

namespace jitk {

// "float32", "bfloat16", "int64x4": DLPack's dtype as tvm-ffi and PyTorch users read it.
inline void append_to(Text& out, const DLDataType& dtype) {
  if (dtype.code == kDLBool) return append_to(out, "bool");
  switch (dtype.code) {
    case kDLInt: append_to(out, "int"); break;
    case kDLUInt: append_to(out, "uint"); break;
    case kDLFloat: append_to(out, "float"); break;
    case kDLBfloat: append_to(out, "bfloat"); break;
    default: append(out, "dtype", static_cast<int>(dtype.code), '_');
  }
  append_to(out, static_cast<int>(dtype.bits));
  if (dtype.lanes != 1) append(out, 'x', static_cast<int>(dtype.lanes));
}

// C++ type -> DLPack dtype.
template <typename T>
struct dtype_trait;

#define JITK_DEFINE_DTYPE(T, CODE, BITS)                                    \
  template <>                                                               \
  struct dtype_trait<T> {                                                   \
    static constexpr DLDataType value{static_cast<uint8_t>(CODE), BITS, 1}; \
  }

JITK_DEFINE_DTYPE(bool, kDLBool, 8);
JITK_DEFINE_DTYPE(int8_t, kDLInt, 8);
JITK_DEFINE_DTYPE(int16_t, kDLInt, 16);
JITK_DEFINE_DTYPE(int32_t, kDLInt, 32);
JITK_DEFINE_DTYPE(int64_t, kDLInt, 64);
JITK_DEFINE_DTYPE(uint8_t, kDLUInt, 8);
JITK_DEFINE_DTYPE(uint16_t, kDLUInt, 16);
JITK_DEFINE_DTYPE(uint32_t, kDLUInt, 32);
JITK_DEFINE_DTYPE(uint64_t, kDLUInt, 64);
JITK_DEFINE_DTYPE(float, kDLFloat, 32);
JITK_DEFINE_DTYPE(double, kDLFloat, 64);
JITK_DEFINE_DTYPE(__half, kDLFloat, 16);
JITK_DEFINE_DTYPE(__nv_bfloat16, kDLBfloat, 16);
#undef JITK_DEFINE_DTYPE

template <typename T>
inline constexpr DLDataType dtype_v = dtype_trait<T>::value;

// DLPack device type -> the name PyTorch users know it by.
template <DLDeviceType D>
struct device_trait {
  static constexpr DLDeviceType value = D;
  static constexpr const char* name = D == kDLCPU           ? "cpu"
                                      : D == kDLCUDA        ? "cuda"
                                      : D == kDLCUDAHost    ? "cuda_host"
                                      : D == kDLCUDAManaged ? "cuda_managed"
                                      : D == kDLROCM        ? "rocm"
                                                            : "device";
};

inline const char* device_type_name(DLDeviceType type) {
  switch (type) {
    case kDLCPU: return device_trait<kDLCPU>::name;
    case kDLCUDA: return device_trait<kDLCUDA>::name;
    case kDLCUDAHost: return device_trait<kDLCUDAHost>::name;
    case kDLCUDAManaged: return device_trait<kDLCUDAManaged>::name;
    case kDLROCM: return device_trait<kDLROCM>::name;
    default: return "device";
  }
}

constexpr bool operator==(const DLDevice& a, const DLDevice& b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

inline void append_to(Text& out, DLDeviceType type) { append_to(out, device_type_name(type)); }

// "cuda:0", "cpu"
inline void append_to(Text& out, const DLDevice& device) {
  append_to(out, device.device_type);
  if (device.device_type != kDLCPU) append(out, ':', device.device_id);
}

}  // namespace jitk
