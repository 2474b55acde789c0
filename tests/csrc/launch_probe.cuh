// A minimal CUDA kernel built on LaunchKernel: y = x + 1 over a float32 vector. CI builds it
// for sm_90 without a GPU and checks that CPU tensors are refused; on a GPU it runs.
#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

namespace launch_probe {

using namespace jitk;

__global__ void add_one_kernel(const float* x, float* y, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) y[i] = x[i] + 1.0f;
}

void add_one(TensorView x, TensorView y) {
  SymbolicSize N{"length"};
  SymbolicDevice device;
  TensorMatcher({N}).with_dtype<float>().with_device<kDLCUDA>(device).verify(x, "x").verify(y, "y");
  const int64_t n = N.unwrap();
  if (n == 0) return;
  constexpr int kThreads = 256;
  LaunchKernel(div_ceil(n, kThreads), kThreads, device.unwrap())(
      add_one_kernel, static_cast<const float*>(x.data_ptr()), static_cast<float*>(y.data_ptr()),
      n);
}

}  // namespace launch_probe
