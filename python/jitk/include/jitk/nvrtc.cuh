// A kernel file that load_jit(..., cuda_compiler="nvrtc") can build includes this first. NVRTC
// compiles its device half in the process, the host compiler alone its host half, and the
// host half launches each kernel by name from what NVRTC built; nvcc still builds the same
// file as one unit, as before. The file keeps its halves apart with two macros:
//
//   template <typename T>
//   __global__ void scale_kernel(T* x, int64_t n)
//   #if JITK_DEVICE_HALF
//   { ... }
//   #else
//   ;
//   #endif
//   #if JITK_HOST_HALF
//   ... LaunchKernel(grid, block, device).launch<scale_kernel<T>>(x, n);
//   #endif
//
// How a kernel is named: launch<kKernel> registers g++'s spelling of the instantiation
// (__PRETTY_FUNCTION__ of a template taking it), the build reads the list from the built
// library (jitk_nvrtc_kernel_names) and gives it to NVRTC as name expressions, and writes
// beside the library the cubin for each target (<library>.sm_XX.cubin) and a line
// "expression<TAB>lowered name" for each kernel (<library>.kernels). The first launch loads
// the cubin of the current GPU's architecture and looks each kernel up by its lowered name.
#pragma once

#if defined(__CUDACC_RTC__)
#define JITK_DEVICE_HALF 1
#define JITK_HOST_HALF 0
// NVRTC has no C library: the fixed-width types as the host's (LP64) spells them, so that a
// kernel's parameters are the same types on both sides.
using int8_t = signed char;
using uint8_t = unsigned char;
using int16_t = short;
using uint16_t = unsigned short;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long;
using uint64_t = unsigned long;
#else
#define JITK_HOST_HALF 1
#ifdef __CUDACC__
#define JITK_DEVICE_HALF 1
#else
#define JITK_DEVICE_HALF 0
#endif
#include <jitk/utils.cuh>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include <dlfcn.h>
#endif

#if JITK_HOST_HALF && !JITK_DEVICE_HALF
namespace jitk::nvrtc {

inline constexpr int kMaxKernels = 256;
inline constexpr int kMaxName = 4096;  // an expression or a lowered name, in bytes

// The kernels this library launches, in the order their instantiations registered at load.
struct Registry {
  const char* pretty[kMaxKernels];
  int count = 0;
};
inline Registry& registry() {
  static Registry kernels;
  return kernels;
}
inline int add_kernel(const char* pretty) {
  Registry& kernels = registry();
  RuntimeCheck(kernels.count < kMaxKernels, "a module launches more than ", kMaxKernels,
               " kernels by name");
  kernels.pretty[kernels.count] = pretty;
  return kernels.count++;
}

// "&" and the instantiation's spelling, from g++'s "... [with auto kKernel = ns::k<float>]".
inline void expression(const char* pretty, char (&out)[kMaxName]) {
  const char* at = std::strstr(pretty, "kKernel = ");
  RuntimeCheck(at != nullptr, "cannot read a kernel's name from '", pretty, "'");
  at += std::strlen("kKernel = ");
  const std::size_t length = std::strlen(at) - 1;  // without the closing ']'
  RuntimeCheck(length + 2 <= sizeof(out), "a kernel's name is longer than ", kMaxName, " bytes");
  out[0] = '&';
  std::memcpy(out + 1, at, length);
  out[length + 1] = '\0';
}

template <auto kKernel>
struct Named {
  static const char* pretty() { return __PRETTY_FUNCTION__; }
  static inline const int index = add_kernel(pretty());
};

// The library's cubin for the current GPU, loaded once, and its kernels found by name.
struct Loaded {
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernels[kMaxKernels] = {};
};

inline void library_file(const char* suffix, char (&out)[kMaxName]) {
  Dl_info info{};
  RuntimeCheck(dladdr(reinterpret_cast<void*>(&registry), &info) != 0 && info.dli_fname,
               "cannot find the path of the library holding this module");
  const int written = std::snprintf(out, sizeof(out), "%.*s%s",
                                    static_cast<int>(std::strlen(info.dli_fname) - 3),
                                    info.dli_fname, suffix);  // the path without ".so"
  RuntimeCheck(written > 0 && written < kMaxName, "a module's path is too long");
}

inline Loaded load() {
  int device = 0, major = 0, minor = 0;
  RuntimeDeviceCheck(cudaGetDevice(&device));
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  char suffix[32], path[kMaxName];
  std::snprintf(suffix, sizeof(suffix), ".sm_%d%d.cubin", major, minor);
  library_file(suffix, path);
  std::FILE* file = std::fopen(path, "rb");
  RuntimeCheck(file != nullptr, "no device code for this GPU (sm_", major, minor,
               "): the module was built for other architectures; missing ", path);
  std::fseek(file, 0, SEEK_END);
  const long size = std::ftell(file);
  std::fseek(file, 0, SEEK_SET);
  char* image = size > 0 ? static_cast<char*>(std::malloc(size)) : nullptr;
  const bool read = image != nullptr && std::fread(image, 1, size, file) == std::size_t(size);
  std::fclose(file);
  Loaded loaded;
  const cudaError_t error = read ? cudaLibraryLoadData(&loaded.library, image, nullptr, nullptr,
                                                       0, nullptr, nullptr, 0)
                                 : cudaSuccess;
  std::free(image);
  RuntimeCheck(read, "cannot read ", path);
  RuntimeDeviceCheck(error);
  library_file(".kernels", path);
  file = std::fopen(path, "r");
  RuntimeCheck(file != nullptr, "cannot open ", path);
  char line[2 * kMaxName], wanted[kMaxName];
  for (int i = 0; i < registry().count; ++i) {
    expression(registry().pretty[i], wanted);
    std::rewind(file);
    while (loaded.kernels[i] == nullptr && std::fgets(line, sizeof(line), file)) {
      char* tab = std::strchr(line, '\t');
      if (tab == nullptr) continue;
      *tab = '\0';
      tab[std::strcspn(tab + 1, "\n") + 1] = '\0';
      if (std::strcmp(line, wanted) == 0) {
        const cudaError_t error = cudaLibraryGetKernel(&loaded.kernels[i], loaded.library, tab + 1);
        if (error != cudaSuccess) std::fclose(file);
        RuntimeDeviceCheck(error);
      }
    }
    if (loaded.kernels[i] == nullptr) std::fclose(file);
    RuntimeCheck(loaded.kernels[i] != nullptr, "the module's device code has no kernel ",
                 wanted, " (", path, ")");
  }
  std::fclose(file);
  return loaded;
}

inline const Loaded& loaded() {
  static const Loaded library = load();  // once a library, at its first launch; thread-safe
  return library;
}

}  // namespace jitk::nvrtc

template <auto kKernel>
cudaKernel_t jitk::nvrtc_kernel() {
  return nvrtc::loaded().kernels[nvrtc::Named<kKernel>::index];
}

// The expressions of every kernel the library launches, a line each: what the build gives
// NVRTC. Built once, on the first call.
extern "C" __attribute__((visibility("default"))) const char* jitk_nvrtc_kernel_names() try {
  static char names[jitk::nvrtc::kMaxKernels * jitk::nvrtc::kMaxName];
  if (names[0] == '\0') {
    std::size_t used = 0;
    char one[jitk::nvrtc::kMaxName];
    for (int i = 0; i < jitk::nvrtc::registry().count; ++i) {
      jitk::nvrtc::expression(jitk::nvrtc::registry().pretty[i], one);
      const std::size_t length = std::strlen(one);
      std::memcpy(names + used, one, length);
      names[used + length] = '\n';
      used += length + 1;
    }
    names[used] = '\0';
  }
  return names;
} catch (...) {  // nothing escapes to the build that asks: no names, which it reports
  return nullptr;
}
#endif
