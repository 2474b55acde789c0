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
// How a kernel is named: launch<kKernel> registers the host compiler's name of the
// instantiation (the demangled type name of a template taking it), the build reads the list
// from the built
// library (jitk_nvrtc_kernel_names) and gives it to NVRTC as name expressions, and writes
// beside the library the cubin for each target (<module>.sm_XX.cubin) and a line
// "expression<TAB>lowered name" for each kernel (<module>.kernels). Whoever loads the library
// hands it those files' checked bytes (jitk_nvrtc_adopt) before its first call; the first
// launch loads the cubin of the current GPU's architecture and looks each kernel up by its
// lowered name.
#pragma once

#include <jitk/utils.h>  // JITK_DEVICE_HALF, JITK_HOST_HALF

#if JITK_HOST_HALF
#include <jitk/utils.cuh>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <typeinfo>
#endif

#if JITK_HOST_HALF && !JITK_DEVICE_HALF
// A kernel's declaration as the host compiler reads it: the launch attributes are NVRTC's.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

namespace jitk::nvrtc {

inline constexpr int kMaxKernels = 256;
inline constexpr int kMaxName = 4096;  // an expression or a lowered name, in bytes

// The kernels this library launches, in the order their instantiations registered at load.
struct Registry {
  const char* type_name[kMaxKernels];  // Named<&kernel>'s, mangled
  int count = 0;
};

// The device code the loader handed over: each file's name and bytes, kept for the process.
struct File {
  char* name = nullptr;
  char* bytes = nullptr;
  std::size_t size = 0;
};
struct Files {
  File* file = nullptr;  // grown as files come: a cubin per part and target, PTX, the names
  int count = 0;
  int capacity = 0;
};

// The library's cubins for the current GPU (one a part: NVRTC builds a module's kernels in
// parts side by side, never more parts than kernels), loaded once, and its kernels by name.
struct Loaded {
  cudaLibrary_t parts[kMaxKernels] = {};
  cudaKernel_t kernels[kMaxKernels] = {};
};

// The runtime's part (JITK_RUNTIME, jitk/utils.h): defined below, or once beside the prelude.
JITK_RUNTIME Registry& registry();
JITK_RUNTIME int add_kernel(const char* type_name);
JITK_RUNTIME void expression(const char* type_name, char (&out)[kMaxName]);
JITK_RUNTIME Files& files();
// The handed file whose name ends with `suffix` and holds `part` (if given), or nullptr.
JITK_RUNTIME const File* find_file(const char* suffix, const char* part = "");
// Once a library, at its first launch (thread-safe; a failed load is tried again next time).
JITK_RUNTIME const Loaded& loaded(DebugInfo where);

template <auto kKernel>
struct Named {
  static inline const int index = add_kernel(typeid(Named).name());
};

}  // namespace jitk::nvrtc

template <auto kKernel>
cudaKernel_t jitk::nvrtc_kernel(DebugInfo where) {
  return nvrtc::loaded(where).kernels[nvrtc::Named<kKernel>::index];
}

#if JITK_RUNTIME_BODY
namespace jitk::nvrtc {

JITK_RUNTIME Registry& registry() {
  static Registry kernels;
  return kernels;
}

JITK_RUNTIME int add_kernel(const char* type_name) {
  Registry& kernels = registry();
  RuntimeCheck(kernels.count < kMaxKernels, "a module launches more than ", kMaxKernels,
               " kernels by name");
  kernels.type_name[kernels.count] = type_name;
  return kernels.count++;
}

// "&" and the kernel's fully qualified name, from the demangled name of Named<&kernel>:
// "jitk::nvrtc::Named<&(void ns::k<ns::T<1> >(float*, long))>" for a template (its return
// type and parameters around the name), "jitk::nvrtc::Named<&ns::k>" for a plain function.
JITK_RUNTIME void expression(const char* type_name, char (&out)[kMaxName]) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(type_name, nullptr, nullptr, &status);
  const char* at = demangled != nullptr ? std::strstr(demangled, "<&") : nullptr;
  if (at == nullptr) std::free(demangled);
  RuntimeCheck(at != nullptr, "cannot read a kernel's name from '", type_name, "'");
  at += 2;
  const bool instance = *at == '(';
  if (instance) {
    at += 1;
    if (std::strncmp(at, "void ", 5) == 0) at += 5;
  }
  // A template's name ends at the first '(' outside its <>, a plain one at Named's '>'.
  std::size_t length = 0;
  for (int depth = 0; at[length] != '\0'; ++length) {
    if (depth == 0 && (instance ? at[length] == '(' : at[length + 1] == '\0')) break;
    depth += at[length] == '<' ? 1 : at[length] == '>' ? -1 : 0;
  }
  const bool fits = length + 2 <= sizeof(out);
  if (fits) {
    out[0] = '&';
    std::memcpy(out + 1, at, length);
    out[length + 1] = '\0';
  }
  std::free(demangled);
  RuntimeCheck(fits, "a kernel's name is longer than ", kMaxName, " bytes");
}

JITK_RUNTIME Files& files() {
  static Files handed;
  return handed;
}

JITK_RUNTIME const File* find_file(const char* suffix, const char* part) {
  const std::size_t length = std::strlen(suffix);
  for (int i = 0; i < files().count; ++i) {
    const File& file = files().file[i];
    const std::size_t name_length = std::strlen(file.name);
    if (name_length >= length && std::strcmp(file.name + name_length - length, suffix) == 0 &&
        std::strstr(file.name, part) != nullptr) {
      return &file;
    }
  }
  return nullptr;
}

// The part and lowered name of `wanted` in the names file ("expression<TAB>lowered<TAB>part"
// lines), the name copied into `out`; the part is -1 if the file has no such kernel.
JITK_RUNTIME int lowered_name(const File& names, const char* wanted, char (&out)[kMaxName]) {
  const std::size_t wanted_length = std::strlen(wanted);
  const char* line = names.bytes;
  const char* end = names.bytes + names.size;
  while (line < end) {
    const char* line_end = static_cast<const char*>(std::memchr(line, '\n', end - line));
    if (line_end == nullptr) line_end = end;
    const char* tab = static_cast<const char*>(std::memchr(line, '\t', line_end - line));
    const char* part =
        tab == nullptr ? nullptr
                       : static_cast<const char*>(std::memchr(tab + 1, '\t', line_end - tab - 1));
    if (part != nullptr && std::size_t(tab - line) == wanted_length &&
        std::memcmp(line, wanted, wanted_length) == 0 && std::size_t(part - tab) <= kMaxName) {
      std::memcpy(out, tab + 1, part - tab - 1);
      out[part - tab - 1] = '\0';
      const int index = std::atoi(part + 1);
      return index >= 0 && index < registry().count ? index : -1;
    }
    line = line_end + 1;
  }
  return -1;
}

JITK_RUNTIME Loaded load(DebugInfo where) {
  int device = 0, major = 0, minor = 0;
  RuntimeDeviceCheck(cudaGetDevice(&device), where);
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                     where);
  RuntimeDeviceCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                     where);
  const File* names = find_file(".kernels");
  RuntimeCheck(where, names != nullptr,
               "the module was loaded without its device code (jitk's loader hands it over; ",
               files().count, " files were)");
  Loaded loaded;
  char wanted[kMaxName], lowered[kMaxName], suffix[64];
  for (int i = 0; i < registry().count; ++i) {
    expression(registry().type_name[i], wanted);
    const int part = lowered_name(*names, wanted, lowered);
    RuntimeCheck(where, part >= 0, "the module's device code has no kernel ", wanted);
    if (loaded.parts[part] == nullptr) {
      std::snprintf(suffix, sizeof(suffix), ".%d.sm_%d%d.cubin", part, major, minor);
      const File* code = find_file(suffix);
      if (code == nullptr) {  // a GPU newer than the targets: the driver compiles the PTX
        std::snprintf(suffix, sizeof(suffix), ".%d.compute_", part);
        code = find_file(".ptx", suffix);
      }
      RuntimeCheck(where, code != nullptr, "no device code for this GPU (sm_", major, minor,
                   "): the module was built for other architectures");
      RuntimeDeviceCheck(cudaLibraryLoadData(&loaded.parts[part], code->bytes, nullptr, nullptr, 0,
                                             nullptr, nullptr, 0),
                         where);
    }
    RuntimeDeviceCheck(cudaLibraryGetKernel(&loaded.kernels[i], loaded.parts[part], lowered),
                       where);
  }
  return loaded;
}

JITK_RUNTIME const Loaded& loaded(DebugInfo where) {
  static const Loaded library = load(where);
  return library;
}

}  // namespace jitk::nvrtc

// Keeps a copy of one file of the library's device code (`name`, `size` bytes), unless one
// of that name is already kept. 0, or -1 when memory runs out. Called by the loader, under
// its lock, before the library's first call.
extern "C" __attribute__((visibility("default"))) int jitk_nvrtc_adopt(const char* name,
                                                                       const char* bytes,
                                                                       std::size_t size) {
  jitk::nvrtc::Files& files = jitk::nvrtc::files();
  for (int i = 0; i < files.count; ++i) {
    if (std::strcmp(files.file[i].name, name) == 0) return 0;
  }
  if (files.count == files.capacity) {
    const int capacity = files.capacity == 0 ? 16 : 2 * files.capacity;
    void* grown = std::realloc(files.file, capacity * sizeof(jitk::nvrtc::File));
    if (grown == nullptr) return -1;
    files.file = static_cast<jitk::nvrtc::File*>(grown);
    files.capacity = capacity;
  }
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
      jitk::nvrtc::expression(jitk::nvrtc::registry().type_name[i], one);
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
#endif  // JITK_RUNTIME_BODY
#endif
