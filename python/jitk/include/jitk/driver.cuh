// The CUDA driver API, reached through the runtime's entry-point lookup rather than linked:
// a module that uses it builds and loads on a machine without a driver (CI), and a call the
// driver lacks is a null pointer the caller can report, not a failed load.
#pragma once

#include <jitk/utils.h>

#include <cuda.h>  // types and enums only
#include <cuda_runtime.h>

namespace jitk::driver {

// `name` as CUDA `version` (e.g. 12000 for 12.0) defined it, or null where the driver is
// older or absent.
template <typename Function>
void find_symbol(const char* name, Function*& function, int version) {
  void* found = nullptr;
  cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
  const cudaError_t error =
      cudaGetDriverEntryPointByVersion(name, &found, version, cudaEnableDefault, &status);
#else
  (void)version;
  const cudaError_t error = cudaGetDriverEntryPoint(name, &found, cudaEnableDefault, &status);
#endif
  if (error != cudaSuccess || status != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    found = nullptr;
  }
  function = reinterpret_cast<Function*>(found);
}

// Panics with the call's name and the driver's name for `result` unless it is CUDA_SUCCESS.
inline void check(CUresult result, const char* call, DebugInfo where = {}) {
  if (result == CUDA_SUCCESS) [[likely]]
    return;
  static const auto error_name = [] {
    CUresult (*found)(CUresult, const char**) = nullptr;
    find_symbol("cuGetErrorName", found, 12000);
    return found;
  }();
  const char* name = nullptr;
  if (error_name != nullptr) error_name(result, &name);
  Panic(where, call, " failed: ", name != nullptr ? name : "unknown CUresult", " (",
        static_cast<int>(result), ")");
}

}  // namespace jitk::driver
