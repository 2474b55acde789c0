// The boundary between Python and a jitk entry point. load_jit's generated source writes
//   JITK_EXPORT(rmsnorm, (jitk::norm::RMSNorm<4096, bf16_t>::run))
// which defines the symbol tvm-ffi looks up for `module.rmsnorm`, on tvm-ffi's C ABI alone:
// tvm-ffi's C++ headers would cost every kernel build seconds of parsing (nvcc reads a
// translation unit three times), for what is here a few lines of argument conversion.
// A kernel that includes them anyway, to take tvm::ffi::TensorView and the like, gets those
// types converted too (jitk/tvm_ffi_types.h).
#pragma once

#include <jitk/tensor.h>
#include <jitk/utils.h>

#include <tvm/ffi/c_api.h>

#include <concepts>
#include <cstdint>
#include <exception>
#include <type_traits>
#include <utility>

namespace jitk::detail {

inline const char* any_type_name(int32_t type_index) {
  switch (type_index) {
    case kTVMFFINone: return "None";
    case kTVMFFIInt: return "int";
    case kTVMFFIBool: return "bool";
    case kTVMFFIFloat: return "float";
    case kTVMFFIDLTensorPtr:
    case kTVMFFITensor: return "Tensor";
    case kTVMFFIRawStr:
    case kTVMFFISmallStr:
    case kTVMFFIStr: return "str";
    default: return "object";
  }
}

[[noreturn]] JITK_RUNTIME void wrong_argument(int index, const char* expected,
                                              const TVMFFIAny& got);
#if JITK_RUNTIME_BODY
JITK_RUNTIME void wrong_argument(int index, const char* expected, const TVMFFIAny& got) {
  raise("TypeError", concat("argument ", index, ": expected ", expected, ", got ",
                            any_type_name(got.type_index)));
}
#endif

// The parameter types jitk converts itself. Others (tvm-ffi's own types) are taught to
// FromAny and ToAny by jitk/tvm_ffi_types.h, which load_jit includes after the kernel.
template <typename T>
concept NativeArgument = std::same_as<T, TensorView> || std::integral<T> || std::floating_point<T>;

// One Python argument as the C++ parameter type of the entry point.
template <typename T>
struct FromAny {
  static_assert(NativeArgument<T>,
                "jitk entry points take jitk::TensorView, integers, bools and floats, and "
                "tvm-ffi's own types when the kernel includes tvm-ffi's headers for them "
                "(e.g. <tvm/ffi/container/tensor.h> for tvm::ffi::TensorView)");
};

template <>
struct FromAny<TensorView> {
  static TensorView convert(const TVMFFIAny& any, int index) {
    if (any.type_index == kTVMFFITensor) return TensorView(TVMFFITensorGetDLTensorPtr(any.v_obj));
    if (any.type_index == kTVMFFIDLTensorPtr) return TensorView(static_cast<DLTensor*>(any.v_ptr));
    wrong_argument(index, "a tensor", any);
  }
};

template <std::integral T>
  requires(!std::same_as<T, bool>)
struct FromAny<T> {
  static T convert(const TVMFFIAny& any, int index) {
    if (any.type_index != kTVMFFIInt && any.type_index != kTVMFFIBool) {
      wrong_argument(index, "an int", any);
    }
    if (!std::in_range<T>(any.v_int64)) {
      raise("ValueError", concat("argument ", index, ": ", any.v_int64, " is out of range"));
    }
    return static_cast<T>(any.v_int64);
  }
};

template <>
struct FromAny<bool> {
  static bool convert(const TVMFFIAny& any, int index) {
    if (any.type_index != kTVMFFIBool && any.type_index != kTVMFFIInt) {
      wrong_argument(index, "a bool", any);
    }
    return any.v_int64 != 0;
  }
};

template <std::floating_point T>
struct FromAny<T> {
  static T convert(const TVMFFIAny& any, int index) {
    if (any.type_index == kTVMFFIFloat) return static_cast<T>(any.v_float64);
    if (any.type_index == kTVMFFIInt) return static_cast<T>(any.v_int64);
    wrong_argument(index, "a float", any);
  }
};

// The entry point's return value as a Python value.
template <typename R>
struct ToAny {
  static void convert(R value, TVMFFIAny* out) {
    static_assert(std::integral<R> || std::floating_point<R>,
                  "jitk entry points return void, ints, bools or floats, and tvm-ffi's own "
                  "types when the kernel includes tvm-ffi's headers for them");
    out->zero_padding = 0;
    if constexpr (std::same_as<R, bool>) {
      out->type_index = kTVMFFIBool;
      out->v_int64 = value;
    } else if constexpr (std::integral<R>) {
      out->type_index = kTVMFFIInt;
      out->v_int64 = static_cast<int64_t>(value);
    } else {
      out->type_index = kTVMFFIFloat;
      out->v_float64 = static_cast<double>(value);
    }
  }
};

template <typename R, typename... Params, size_t... I>
void invoke(R (*entry)(Params...), const TVMFFIAny* args, TVMFFIAny* result,
            std::index_sequence<I...>) {
  if constexpr (std::is_void_v<R>) {
    entry(FromAny<std::remove_cvref_t<Params>>::convert(args[I], static_cast<int>(I))...);
    result->type_index = kTVMFFINone;
    result->zero_padding = 0;
    result->v_int64 = 0;
  } else {
    ToAny<std::remove_cvref_t<R>>::convert(
        entry(FromAny<std::remove_cvref_t<Params>>::convert(args[I], static_cast<int>(I))...),
        result);
  }
}

template <typename R, typename... Params>
void call_entry(const char* name, R (*entry)(Params...), const TVMFFIAny* args, int32_t num_args,
                TVMFFIAny* result) {
  if (num_args != static_cast<int32_t>(sizeof...(Params))) {
    raise("TypeError",
          concat(name, "() takes ", sizeof...(Params), " arguments but ", num_args, " were given"));
  }
  invoke(entry, args, result, std::index_sequence_for<Params...>{});
}

// tvm-ffi's safe-call convention: -1 with the error set for Python.
inline int set_raised(const char* kind, const char* message) noexcept {
  TVMFFIErrorSetRaisedFromCStr(kind, message);
  return -1;
}

}  // namespace jitk::detail

// Catch clauses for a library's own exceptions, tried before std::exception. Expanded where
// JITK_EXPORT is used, so a header included after this one may redefine it:
// jitk/tvm_ffi_types.h keeps the kind of tvm-ffi's errors (TVM_FFI_THROW(ValueError) raises
// a Python ValueError).
#define JITK_EXPORT_CATCH_LIBRARY_ERRORS

// Nothing escapes to Python but an error it can raise: a jitk::Error as the exception it
// names, anything else as a RuntimeError.
#define JITK_EXPORT(NAME, ENTRY)                                                            \
  extern "C" __attribute__((visibility("default"))) int __tvm_ffi_##NAME(                   \
      void*, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {                  \
    try {                                                                                   \
      ::jitk::detail::call_entry(#NAME, &ENTRY, args, num_args, result);                    \
      return 0;                                                                             \
    } catch (const ::jitk::Error& error) {                                                  \
      return ::jitk::detail::set_raised(error.kind(), error.what());                        \
    }                                                                                       \
    JITK_EXPORT_CATCH_LIBRARY_ERRORS                                                        \
    catch (const std::exception& error) {                                                   \
      return ::jitk::detail::set_raised("RuntimeError", error.what());                      \
    }                                                                                       \
    catch (...) {                                                                           \
      return ::jitk::detail::set_raised("RuntimeError", "a C++ exception of unknown type"); \
    }                                                                                       \
  }
