// A host-only kernel for tests/test_op.py: y += alpha * x over float32 vectors on the CPU,
// built from cpp_files by the host compiler, as a user's own kernel would be.
#include <jitk/tensor.h>

#include <cstdint>

namespace cpu_axpy {

using namespace jitk;

inline void axpy(double alpha, TensorView x, TensorView y) {
  SymbolicSize n{"length"};
  TensorMatcher({n}).with_dtype<float>().with_device<kDLCPU>().verify(x, "x").verify(y, "y");
  const auto* in = static_cast<const float*>(x.data_ptr());
  auto* out = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < n.unwrap(); ++i) out[i] += static_cast<float>(alpha) * in[i];
}

}  // namespace cpu_axpy
