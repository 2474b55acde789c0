// tvm-ffi's own types at jitk's export boundary, for kernels written the way tvm-ffi users
// write them:
//   #include <tvm/ffi/container/tensor.h>
//   static void run(tvm::ffi::TensorView out, tvm::ffi::TensorView in);
// load_jit's generated source includes this header after the kernel files. It adds nothing
// unless the kernel included tvm-ffi's C++ headers: only the modules that use those types
// pay for parsing them (see the developer guide, "Compile latency").
//
// With them, every type tvm-ffi converts (tvm::ffi::TensorView, Tensor, Optional<...>,
// String, DLDevice, DLDataType, ...) crosses the boundary as a parameter or a return value
// by tvm-ffi's own rules, beside jitk::TensorView and the scalars jitk converts itself; and
// a tvm::ffi::Error thrown by the kernel (TVM_FFI_THROW(ValueError) << ...) reaches Python
// as the exception it names.
#pragma once

#include <jitk/export.h>

#ifdef TVM_FFI_TYPE_TRAITS_H_

#include <optional>
#include <utility>

namespace jitk::detail {

template <typename T>
concept TvmFfiValue = !NativeArgument<T> && ::tvm::ffi::TypeTraits<T>::convert_enabled;

template <TvmFfiValue T>
struct FromAny<T> {
  static T convert(const TVMFFIAny& any, int index) {
    std::optional<T> value = ::tvm::ffi::TypeTraits<T>::TryCastFromAnyView(&any);
    if (!value.has_value()) {
      wrong_argument(index, ::tvm::ffi::TypeTraits<T>::TypeStr().c_str(), any);
    }
    return *std::move(value);
  }
};

template <TvmFfiValue R>
struct ToAny<R> {
  static void convert(R value, TVMFFIAny* out) {
    ::tvm::ffi::TypeTraits<R>::MoveToAny(std::move(value), out);
  }
};

}  // namespace jitk::detail

#endif  // TVM_FFI_TYPE_TRAITS_H_

#ifdef TVM_FFI_ERROR_H_
#undef JITK_EXPORT_CATCH_LIBRARY_ERRORS
#define JITK_EXPORT_CATCH_LIBRARY_ERRORS          \
  catch (const ::tvm::ffi::Error& error) {        \
    ::tvm::ffi::detail::SetSafeCallRaised(error); \
    return -1;                                    \
  }
#endif  // TVM_FFI_ERROR_H_
