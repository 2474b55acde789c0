// Exercises every facility of jitk/utils.h and jitk/tensor.h from the host side. Built by
// the tests with g++ (cpp_files) and with nvcc (cuda_files); called with CPU tensors.
// The "// at:NAME" markers let the tests find the line an error must name.
#include <jitk/tensor.h>
#include <jitk/utils.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace probe {

using namespace jitk;

// A type of the kernel's own, printable in messages through its append_to.
struct Celsius {
  double degrees;
};
void append_to(Text& out, const Celsius& t) { append(out, t.degrees, " C"); }

enum class Mode { kFast = 3 };

// Rows of a fixed head dimension: [num_tokens, head_dim], float32, on the CPU.
int64_t rows_of(TensorView x, int64_t head_dim) {
  SymbolicSize N{"num_tokens"};
  SymbolicSize D{"head_dim", head_dim};
  TensorMatcher({N, D}).with_dtype<float>().with_device<kDLCPU>().verify(x, "x");  // at:rows
  return N.unwrap();
}

// Two tensors that must agree on every symbol; returns N * 1000 + D.
int64_t pair(TensorView a, TensorView b) {
  SymbolicSize N{"num_tokens"}, D{"head_dim"};
  SymbolicDType dtype{"cache dtype"};
  SymbolicDevice device{"cache device"};
  TensorMatcher({N, D})  // at:pair
      .with_dtype<float, double, int32_t>(dtype)
      .with_device<kDLCPU, kDLCUDA>(device)
      .verify(a, "a")
      .verify(b, "b");
  return N.unwrap() * 1000 + D.unwrap();
}

// A row-strided 2-d tensor with a contiguous last dimension; returns the row stride.
int64_t row_stride(TensorView x) {
  SymbolicSize S{"row stride"};
  TensorMatcher({-1, -1}).with_strides({S, 1}).verify(x, "x");  // at:strided
  return S.unwrap();
}

// Any shape of two dimensions, any dtype, any device: only ndim and contiguity are checked.
void contiguous_2d(TensorView x) { TensorMatcher({-1, -1}).verify(x, "x"); }  // at:contig

// Fixed sizes as literals.
void exactly_4x8(TensorView x) { TensorMatcher({4, 8}).verify(x); }  // at:fixed

void needs_cuda(TensorView x) {
  TensorMatcher({-1}).with_device<kDLCUDA>().verify(x, "x");  // at:cuda
}

// Memory a GPU kernel can reach directly.
void gpu_reachable(TensorView x) {
  TensorMatcher({-1}).with_device<kDLCUDA, kDLCUDAHost>().verify(x, "x");
}

// The same dtype symbol shared by two matchers of different rank.
int64_t shared_dtype_bits(TensorView a, TensorView b) {
  SymbolicDType dtype;
  TensorMatcher({-1}).with_dtype<float, double>(dtype).verify(a, "a");
  TensorMatcher({-1, -1}).with_dtype<float, double>(dtype).verify(b, "b");  // at:shared
  return dtype.unwrap().bits;
}

int64_t positive(int64_t n) {
  RuntimeCheck(n > 0, "n must be positive, got ", n);  // at:check
  return n;
}

void always_panics(int64_t code) { Panic("gave up with code ", code); }  // at:panic

// Helpers that check on behalf of their caller: the location comes first, the caller's.
void check_positive(int64_t n, DebugInfo where = {}) {
  RuntimeCheck(where, n > 0, "n must be positive, got ", n);
}
[[noreturn]] void give_up(int64_t code, DebugInfo where = {}) {
  Panic(where, "gave up for the caller with code ", code);
}

int64_t positive_via_helper(int64_t n) {
  check_positive(n);  // at:helper_check
  return n;
}

void panics_via_helper(int64_t code) { give_up(code); }  // at:helper_panic

// Every kind of message argument, in one message.
void print_values(int64_t n, double x, bool flag) {
  const std::string owned = "std::string";
  const std::string_view view = "string_view";
  const int8_t small = -5;
  const uint64_t big = 18446744073709551615ull;
  const DebugInfo here;  // at:values
  Panic(here, "n=", n, " x=", x, " flag=", flag, " c=", 'c', " small=", small, " big=", big,
        " hex=", hex(255), " ", owned, " ", view, " dtype=", dtype_v<uint16_t>,
        " device=", DLDevice{kDLCUDA, 3}, " mode=", Mode::kFast, " t=", Celsius{21.5},
        " at=", here);
}

int64_t read_unbound() {
  SymbolicSize never_bound{"never bound"};
  return never_bound.unwrap();  // at:unwrap
}

static_assert(min_of(3, 5) == 3 && min_of(int64_t{-2}, int64_t{-7}) == -7);
static_assert(max_of(3, 5) == 5 && max_of(int64_t{-2}, int64_t{-7}) == -2);

// irange, div_ceil and pointer::offset, folded into one checkable number.
int64_t helpers(int64_t n) {
  int64_t sum = 0;
  for (auto i : irange(n)) sum += i;
  for (auto i : irange(int64_t{2}, 5)) sum += 100 * i;
  for (auto i : irange(5, 2)) sum += 1000000000 * i;  // empty: an end before the begin
  char buffer[64];
  void* base = buffer;
  const auto moved = static_cast<char*>(pointer::offset(base, 16, int64_t{8})) - buffer;
  return sum + 10000 * div_ceil(n, int64_t{4}) + 1000000 * moved;
}

}  // namespace probe
