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
// beside the library the cubin for each target (<module>.sm_XX.cubin) and a line
// "expression<TAB>lowered name" for each kernel (<module>.kernels). Whoever loads the library
// hands it those files' checked bytes (jitk_nvrtc_adopt) before its first call; the first
// launch loads the cubin of the current GPU's architecture and looks each kernel up by its
// lowered name.
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
#include <cstdlib>
#include <cstring>
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

// The device code the loader handed over: each file's name and bytes, kept for the process.
struct File {
  char* name = nullptr;
  char* bytes = nullptr;
  std::size_t size = 0;
};
inline constexpr int kMaxFiles = 32;  // a cubin per target and the names
struct Files {
  File file[kMaxFiles];
  int count = 0;
};
inline Files& files() {
  static Files handed;
  return handed;
}

// The handed file whose name ends with `suffix`, or nullptr.
inline const File* find_file(const char* suffix) {
  const std::size_t length = std::strlen(suffix);
  for (int i = 0; i < files().count; ++i) {
    const File& file = files().file[i];
    const std::size_t name_length = std::strlen(file.name);
    if (name_length >= length && std::strcmp(file.name + name_length - length, suffix) == 0) {
      return &file;
    }
  }
  return nullptr;
}

// The library's cubin for the current GPU, loaded once, and its kernels found by name.
struct Loaded {
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernels[kMaxKernels] = {};
};

// The lowered name of `wanted` in the names file ("expression<TAB>lowered" lines), copied
// into `out`; false if it has none.
inline bool lowered_name(const File& names, const char* wanted, char (&out)[kMaxName]) {
  const std::size_t wanted_length = std::strlen(wanted);
  const char* line = names.bytes;
  const char* end = names.bytes + names.size;
  while (line < end) {
    const char* line_end = static_cast<const char*>(std::memchr(line, '\n', end - line));
    if (line_end == nullptr) line_end = end;
    const char* tab = static_cast<const char*>(std::memchr(line, '\t', line_end - line));
    if (tab != nullptr && std::size_t(tab - line) == wanted_length &&
        std::memcmp(line, wanted, wanted_length) == 0 && std::size_t(line_end - tab) <= kMaxName) {
      std::memcpy(out, tab + 1, line_end - tab - 1);
      out[line_end - tab - 1] = '\0';
      return true;
    }
    line = line_end + 1;
  }
  return false;
}

inline Loaded load() {
  int device = 0, major = 0, minor = 0;
  RuntimeDeviceCheck(cudaGetDevice(&device));
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  char suffix[32];
  std::snprintf(suffix, sizeof(suffix), ".sm_%d%d.cubin", major, minor);
  const File* cubin = find_file(suffix);
  RuntimeCheck(cubin != nullptr, "no device code for this GPU (sm_", major, minor,
               "): the module was built for other architectures, or loaded without jitk's "
               "loader (",
               files().count, " device code files handed over)");
  const File* names = find_file(".kernels");
  RuntimeCheck(names != nullptr, "the module was loaded without the names of its kernels");
  Loaded loaded;
  RuntimeDeviceCheck(
      cudaLibraryLoadData(&loaded.library, cubin->bytes, nullptr, nullptr, 0, nullptr, nullptr, 0));
  char wanted[kMaxName], lowered[kMaxName];
  for (int i = 0; i < registry().count; ++i) {
    expression(registry().pretty[i], wanted);
    RuntimeCheck(lowered_name(*names, wanted, lowered), "the module's device code has no kernel ",
                 wanted);
    RuntimeDeviceCheck(cudaLibraryGetKernel(&loaded.kernels[i], loaded.library, lowered));
  }
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

// Keeps a copy of one file of the library's device code (`name`, `size` bytes), unless one
// of that name is already kept. 0, or -1 when there is no room. Called by the loader, under
// its lock, before the library's first call.
extern "C" __attribute__((visibility("default"))) int jitk_nvrtc_adopt(const char* name,
                                                                       const char* bytes,
                                                                       std::size_t size) {
  jitk::nvrtc::Files& files = jitk::nvrtc::files();
  for (int i = 0; i < files.count; ++i) {
    if (std::strcmp(files.file[i].name, name) == 0) return 0;
  }
  if (files.count == jitk::nvrtc::kMaxFiles) return -1;
  jitk::nvrtc::File file;
  file.name = static_cast<char*>(std::malloc(std::strlen(name) + 1));
  file.bytes = static_cast<char*>(std::malloc(size + 1));
  if (file.name == nullptr || file.bytes == nullptr) {
    std::free(file.name);
    std::free(file.bytes);
    return -1;
  }
  std::strcpy(file.name, name);
  std::memcpy(file.bytes, bytes, size);
  file.bytes[size] = '\0';
  file.size = size;
  files.file[files.count++] = file;
  return 0;
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
