// The host half of the developer guide's axpy for the NVRTC split (exp_nvrtc_split.py): g++
// alone, no CUDA device code. The kernel comes from the cubin NVRTC built, looked up by its
// lowered name (EXP_CUBIN, EXP_LOWERED) through the runtime's library API.
#include <jitk/export.h>
#include <jitk/utils.cuh>

#include <cstdio>
#include <cstdlib>

namespace axpy {

using namespace jitk;

// One library per process, loaded at the first call; the kernel looked up once. Plain C I/O:
// <vector> alone would cost this unit half a second of g++ (debugging_and_performance.md).
inline cudaKernel_t loaded_kernel() {
  static const cudaKernel_t kernel = [] {
    std::FILE* file = std::fopen(EXP_CUBIN, "rb");
    RuntimeCheck(file != nullptr, "cannot open ", EXP_CUBIN);
    std::fseek(file, 0, SEEK_END);
    const long size = std::ftell(file);
    std::fseek(file, 0, SEEK_SET);
    char* image = static_cast<char*>(std::malloc(size));
    const bool read = image != nullptr && std::fread(image, 1, size, file) == std::size_t(size);
    std::fclose(file);
    RuntimeCheck(read, "cannot read ", EXP_CUBIN);
    cudaLibrary_t library = nullptr;
    RuntimeDeviceCheck(
        cudaLibraryLoadData(&library, image, nullptr, nullptr, 0, nullptr, nullptr, 0));
    std::free(image);
    cudaKernel_t found = nullptr;
    RuntimeDeviceCheck(cudaLibraryGetKernel(&found, library, EXP_LOWERED));
    return found;
  }();
  return kernel;
}

template <typename T>
struct Axpy {
  static void run(double alpha, TensorView x, TensorView y) {
    SymbolicSize n{"vector length"};
    SymbolicDevice device;
    TensorMatcher({n}).with_device<kDLCUDA>(device).with_dtype<T>().verify(x, "x").verify(y, "y");
    if (n.unwrap() == 0) return;
    constexpr int kThreads = 256;
    float scale = static_cast<float>(alpha);
    const T* source = static_cast<const T*>(x.data_ptr());
    T* target = static_cast<T*>(y.data_ptr());
    int64_t count = n.unwrap();
    void* args[] = {&scale, &source, &target, &count};
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(div_ceil(count, kThreads));
    config.blockDim = dim3(kThreads);
    config.stream = current_stream(device.unwrap());
    const DeviceGuard on(device.unwrap().device_id);
    RuntimeDeviceCheck(
        cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(loaded_kernel()), args));
  }
};

}  // namespace axpy

JITK_EXPORT(axpy, (axpy::Axpy<float>::run))
