// What every host half (a kernel file's host side built by the host compiler alone,
// jitk/nvrtc.cuh) reads before its own code: jitk's host headers and the standard headers
// they and the shipped kernels use (not jitk/tvm_ffi_types.h, which must follow the kernel
// files). jitk precompiles it once per compiler, flags and header set, and compiles the
// runtime it declares (JITK_RUNTIME, jitk/utils.h) once beside it (jitk/build/pch.py), so a
// build neither parses these headers nor generates that code again.
#pragma once

#include <jitk/export.h>
#include <jitk/nvrtc.cuh>
#include <jitk/rows.h>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

// The message pieces every module prints (jitk/utils.h), instantiated once in the runtime.
#if defined(JITK_RUNTIME_DEFINE)
#define JITK_RUNTIME_PIECE(T) \
  template void jitk::detail::append_erased<T>(jitk::Text&, const void*);
#elif defined(JITK_RUNTIME_LINKED)
#define JITK_RUNTIME_PIECE(T) \
  extern template void jitk::detail::append_erased<T>(jitk::Text&, const void*);
#else
#define JITK_RUNTIME_PIECE(T)
#endif
JITK_RUNTIME_PIECE(char)
JITK_RUNTIME_PIECE(const char*)
JITK_RUNTIME_PIECE(int)
JITK_RUNTIME_PIECE(long)
JITK_RUNTIME_PIECE(unsigned long)
JITK_RUNTIME_PIECE(jitk::DebugInfo)
JITK_RUNTIME_PIECE(jitk::PrintDims)
JITK_RUNTIME_PIECE(jitk::PrintTensor)
JITK_RUNTIME_PIECE(DLDataType)
JITK_RUNTIME_PIECE(DLDevice)
JITK_RUNTIME_PIECE(DLDeviceType)
#undef JITK_RUNTIME_PIECE
