// y = alpha * x + y over two vectors of the same length and dtype, on the GPU. Written in two
// halves (jitk/nvrtc.cuh): NVRTC builds the kernel and the host compiler alone the checks and
// the launch, in a fraction of nvcc's time; nvcc still builds the whole file as one unit.
#include <jitk/nvrtc.cuh>  // JITK_DEVICE_HALF and JITK_HOST_HALF
#include <jitk/utils.cuh>  // LaunchKernel, fp16_t / bf16_t / fp32_t

#if JITK_DEVICE_HALF
#include <cuda_bf16.h>  // arithmetic on bf16_t and fp16_t: a kernel includes what it uses
#include <cuda_fp16.h>
#endif
#if JITK_HOST_HALF
#include <jitk/tensor.h>  // TensorMatcher, SymbolicSize, SymbolicDevice
#endif

namespace axpy {

// The host half sees the declaration, the device half the body.
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

// The dtype is a template parameter: Python picks it, load_jit compiles this instantiation.
template <typename T>
struct Axpy {
  static void run(double alpha, TensorView x, TensorView y) {
    SymbolicSize n{"vector length"};
    SymbolicDevice device;
    TensorMatcher({n})  // contiguous 1-d, both on the same GPU, dtype T
        .with_device<kDLCUDA>(device)
        .with_dtype<T>()  // last: after a dependent call, a member template needs `template`
        .verify(x, "x")
        .verify(y, "y");
    if (n.unwrap() == 0) return;
    constexpr int kThreads = 256;
    LaunchKernel(div_ceil(n.unwrap(), kThreads), kThreads, device.unwrap())
        .launch<axpy_kernel<T>>(static_cast<float>(alpha), static_cast<const T*>(x.data_ptr()),
                                static_cast<T*>(y.data_ptr()), n.unwrap());
  }
};
#endif

}  // namespace axpy
