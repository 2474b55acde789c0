// A kernel written the way tvm-ffi users write them: tvm-ffi's headers, types and errors,
// no jitk type in most signatures. Built by the tests with g++ (cpp_files) and with nvcc
// (cuda_files); load_jit exports it unchanged. The "// at:NAME" markers let the tests find
// the line an error must name.
#include <jitk/tensor.h>
#include <jitk/utils.h>
#ifdef __CUDACC__
#include <jitk/utils.cuh>
#endif

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <cstdint>

namespace tvm_ffi_probe {

// The sum of a float32 vector on the CPU.
double sum(tvm::ffi::TensorView x) {
  if (x.ndim() != 1 || x.dtype().code != kDLFloat || x.dtype().bits != 32) {
    TVM_FFI_THROW(TypeError) << "sum takes a 1-d float32 tensor";
  }
  const float* data = static_cast<const float*>(x.data_ptr());
  double total = 0;
  for (int64_t i = 0; i < x.size(0); ++i) total += data[i * x.stride(0)];
  return total;
}

int64_t numel_or(tvm::ffi::Optional<tvm::ffi::Tensor> t, int64_t fallback) {
  return t.has_value() ? t.value().numel() : fallback;
}

// A tvm-ffi value returned to Python.
tvm::ffi::String describe(tvm::ffi::TensorView t) {
  return tvm::ffi::String(std::to_string(t.ndim()) + "-d on device type " +
                          std::to_string(static_cast<int>(t.device().device_type)));
}

void refuse(int64_t code) { TVM_FFI_THROW(ValueError) << "refused code " << code; }

// jitk's and tvm-ffi's types side by side, and jitk's matcher on tvm-ffi's as they are.
int64_t rows_of_both(jitk::TensorView a, tvm::ffi::Tensor b) {
  jitk::SymbolicSize rows{"rows"};
  jitk::TensorMatcher({rows, -1}).with_dtype<float>().verify(a, "a");
  jitk::TensorMatcher({rows, -1}).with_dtype<float>().verify(b, "b");  // at:b
  return rows.unwrap();
}

// A check written as SGLang's kernels write it: symbols, a tvm::ffi::TensorView, no name.
int64_t sglang_style(tvm::ffi::TensorView in, tvm::ffi::TensorView out) {
  jitk::SymbolicSize rows{"rows"}, cols{"cols"};
  jitk::TensorMatcher({rows, cols}).with_dtype<float>().verify(in);  // at:sglang
  jitk::TensorMatcher({rows, cols}).with_dtype<float>().verify(out);
  return rows.unwrap() * cols.unwrap();
}

#ifdef __CUDACC__
__global__ void add_one_kernel(float* out, const float* in, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) out[i] = in[i] + 1.0f;
}

// out = in + 1 over float32 vectors on one GPU, as a tvm-ffi kernel is written.
struct AddOne {
  static void run(tvm::ffi::TensorView out, tvm::ffi::TensorView in) {
    jitk::SymbolicSize n{"length"};
    jitk::SymbolicDevice device;
    // nvcc names the first line of a statement.
    jitk::TensorMatcher({n})  // at:add_one
        .with_dtype<float>()
        .with_device<kDLCUDA>(device)
        .verify(in, "in")
        .verify(out, "out");
    if (n.unwrap() == 0) return;
    constexpr int kThreads = 256;
    jitk::LaunchKernel(jitk::div_ceil(n.unwrap(), kThreads), kThreads, device.unwrap())(
        add_one_kernel, static_cast<float*>(out.data_ptr()),
        static_cast<const float*>(in.data_ptr()), n.unwrap());
  }
};
#endif

}  // namespace tvm_ffi_probe
