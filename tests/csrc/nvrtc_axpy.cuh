// The developer guide's axpy written in two halves (jitk/nvrtc.cuh): NVRTC builds the kernel,
// the host compiler alone the checks and the launch; nvcc builds the same file as one unit.
#include <jitk/nvrtc.cuh>

#if JITK_DEVICE_HALF
#include <cuda_bf16.h>  // arithmetic on bf16_t and fp16_t, on the device only
#include <cuda_fp16.h>
#endif

namespace nvrtc_axpy {

template <typename T>
__global__ void axpy_kernel(float alpha, const T* x, T* y, int64_t n)
#if JITK_DEVICE_HALF
{
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] = static_cast<T>(alpha * static_cast<float>(x[i]) + static_cast<float>(y[i]));
}
#else
    ;
#endif

#if JITK_HOST_HALF
using namespace jitk;

template <typename T>
struct Axpy {
  static void run(double alpha, TensorView x, TensorView y) {
    SymbolicSize n{"vector length"};
    SymbolicDevice device;
    TensorMatcher({n}).with_device<kDLCUDA>(device).with_dtype<T>().verify(x, "x").verify(y, "y");
    if (n.unwrap() == 0) return;
    constexpr int kThreads = 256;
    LaunchKernel(div_ceil(n.unwrap(), kThreads), kThreads, device.unwrap())
        .launch<axpy_kernel<T>>(static_cast<float>(alpha), static_cast<const T*>(x.data_ptr()),
                                static_cast<T*>(y.data_ptr()), n.unwrap());
  }
};
#endif

}  // namespace nvrtc_axpy
