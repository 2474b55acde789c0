// Tensor validation: symbolic sizes, dtypes and devices, and the chainable TensorMatcher.
//
//   SymbolicSize N{"num tokens"}, D{"head dimension"};
//   SymbolicDType dtype;
//   SymbolicDevice device;
//   TensorMatcher({N, D}).with_dtype<fp16_t, bf16_t>(dtype).with_device<kDLCUDA>(device)
//       .verify(k, "k_cache").verify(v, "v_cache");
//
// A failure raises a Python RuntimeError that names the tensor, what it is, the caller's
// line and the first rule it broke.
#pragma once

#include <jitk/utils.h>

#include <dlpack/dlpack.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <string>
#include <stdexcept>
#include <string_view>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

// DLPack's dtype compared and printed ("float32", "bfloat16") as tvm-ffi does, for the
// translation units that do not include tvm-ffi's C++ headers (jitk kernels never do: they
// cost every build seconds of parsing).
#ifndef TVM_FFI_DTYPE_H_
inline bool operator==(const DLDataType& a, const DLDataType& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
inline bool operator!=(const DLDataType& a, const DLDataType& b) { return !(a == b); }
inline std::ostream& operator<<(std::ostream& os, const DLDataType& dtype) {
  if (dtype.code == kDLBool) return os << "bool";
  switch (dtype.code) {
    case kDLInt: os << "int"; break;
    case kDLUInt: os << "uint"; break;
    case kDLFloat: os << "float"; break;
    case kDLBfloat: os << "bfloat"; break;
    default: os << "dtype" << static_cast<int>(dtype.code) << '_';
  }
  os << static_cast<int>(dtype.bits);
  if (dtype.lanes != 1) os << 'x' << dtype.lanes;
  return os;
}
#endif

namespace jitk {

// A list of sizes or strides: a pointer and a length, as DLPack keeps them.
class ShapeView {
 public:
  constexpr ShapeView(const int64_t* data, size_t size) : data_(data), size_(size) {}
  constexpr size_t size() const { return size_; }
  constexpr const int64_t* data() const { return data_; }
  constexpr int64_t operator[](size_t i) const { return data_[i]; }
  constexpr const int64_t* begin() const { return data_; }
  constexpr const int64_t* end() const { return data_ + size_; }

 private:
  const int64_t* data_;
  size_t size_;
};

// A non-owning view of a DLPack tensor: what every jitk entry point receives. The tensor it
// views (and its shape and strides arrays) must outlive it, as for any view.
class TensorView {
 public:
  static constexpr int kMaxCompactDims = 8;

  explicit TensorView(const DLTensor* tensor) : tensor_(*tensor) {
    if (tensor_.strides == nullptr) use_compact_strides();
  }
  TensorView(const TensorView& other) { *this = other; }
  TensorView& operator=(const TensorView& other) {
    tensor_ = other.tensor_;
    compact_ = other.compact_;
    if (other.tensor_.strides == other.compact_.data()) tensor_.strides = compact_.data();
    return *this;
  }

  void* data_ptr() const { return tensor_.data; }
  uint64_t byte_offset() const { return tensor_.byte_offset; }
  DLDevice device() const { return tensor_.device; }
  DLDataType dtype() const { return tensor_.dtype; }
  int32_t ndim() const { return tensor_.ndim; }
  ShapeView shape() const { return {tensor_.shape, static_cast<size_t>(tensor_.ndim)}; }
  ShapeView strides() const { return {tensor_.strides, static_cast<size_t>(tensor_.ndim)}; }
  // Negative indices count from the end, as in Python.
  int64_t size(int64_t i) const { return tensor_.shape[i < 0 ? i + tensor_.ndim : i]; }
  int64_t stride(int64_t i) const { return tensor_.strides[i < 0 ? i + tensor_.ndim : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < tensor_.ndim; ++i) n *= tensor_.shape[i];
    return n;
  }
  // The same memory seen with another shape and strides (which must outlive the view).
  TensorView as_strided(ShapeView shape, ShapeView strides) const {
    DLTensor t = tensor_;
    t.ndim = static_cast<int32_t>(shape.size());
    t.shape = const_cast<int64_t*>(shape.data());
    t.strides = const_cast<int64_t*>(strides.data());
    return TensorView(&t);
  }

 private:
  // DLPack allows no strides for a compact tensor; the view then keeps its own, so that
  // stride(i) always answers.
  void use_compact_strides() {
    if (tensor_.ndim > kMaxCompactDims) {
      throw std::invalid_argument("a tensor of more than 8 dimensions must carry strides");
    }
    int64_t step = 1;
    for (int i = tensor_.ndim - 1; i >= 0; --i) {
      compact_[i] = step;
      step *= tensor_.shape[i];
    }
    tensor_.strides = compact_.data();
  }

  DLTensor tensor_;
  std::array<int64_t, kMaxCompactDims> compact_{};
};

// ---------------------------------------------------------------------------------------
// C++ type -> DLPack dtype.
template <typename T>
struct dtype_trait;

#define JITK_DEFINE_DTYPE(T, CODE, BITS) \
  template <>                            \
  struct dtype_trait<T> {                \
    static constexpr DLDataType value{static_cast<uint8_t>(CODE), BITS, 1}; \
  }

JITK_DEFINE_DTYPE(bool, kDLBool, 8);
JITK_DEFINE_DTYPE(int8_t, kDLInt, 8);
JITK_DEFINE_DTYPE(int16_t, kDLInt, 16);
JITK_DEFINE_DTYPE(int32_t, kDLInt, 32);
JITK_DEFINE_DTYPE(int64_t, kDLInt, 64);
JITK_DEFINE_DTYPE(uint8_t, kDLUInt, 8);
JITK_DEFINE_DTYPE(uint16_t, kDLUInt, 16);
JITK_DEFINE_DTYPE(uint32_t, kDLUInt, 32);
JITK_DEFINE_DTYPE(uint64_t, kDLUInt, 64);
JITK_DEFINE_DTYPE(float, kDLFloat, 32);
JITK_DEFINE_DTYPE(double, kDLFloat, 64);
#ifdef __CUDACC__
JITK_DEFINE_DTYPE(__half, kDLFloat, 16);
JITK_DEFINE_DTYPE(__nv_bfloat16, kDLBfloat, 16);
#endif
#undef JITK_DEFINE_DTYPE

template <typename T>
inline constexpr DLDataType dtype_v = dtype_trait<T>::value;

// DLPack device type -> the name PyTorch users know it by.
template <DLDeviceType D>
struct device_trait {
  static constexpr DLDeviceType value = D;
  static constexpr const char* name = D == kDLCPU        ? "cpu"
                                      : D == kDLCUDA     ? "cuda"
                                      : D == kDLCUDAHost ? "cuda_host"
                                      : D == kDLCUDAManaged ? "cuda_managed"
                                      : D == kDLROCM     ? "rocm"
                                                         : "device";
};

inline const char* device_type_name(DLDeviceType type) {
  switch (type) {
    case kDLCPU: return device_trait<kDLCPU>::name;
    case kDLCUDA: return device_trait<kDLCUDA>::name;
    case kDLCUDAHost: return device_trait<kDLCUDAHost>::name;
    case kDLCUDAManaged: return device_trait<kDLCUDAManaged>::name;
    case kDLROCM: return device_trait<kDLROCM>::name;
    default: return "device";
  }
}

constexpr bool operator==(const DLDevice& a, const DLDevice& b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

}  // namespace jitk

// Printing lives in the global namespace next to DLPack's types so that argument-dependent
// lookup finds it from any namespace. tvm-ffi already prints DLDataType.
inline std::ostream& operator<<(std::ostream& os, const DLDevice& device) {
  os << jitk::device_type_name(device.device_type);
  if (device.device_type != kDLCPU) os << ':' << device.device_id;
  return os;
}

namespace jitk {

// "<100, 256>"
struct PrintDims {
  ShapeView dims;
};
inline std::ostream& operator<<(std::ostream& os, const PrintDims& p) {
  os << '<';
  for (size_t i = 0; i < p.dims.size(); ++i) os << (i ? ", " : "") << p.dims[i];
  return os << '>';
}

// "Tensor<100, 256>[strides=<256, 1>, dtype=float32, device=cuda:0]"
struct PrintTensor {
  const TensorView& t;
};
inline std::ostream& operator<<(std::ostream& os, const PrintTensor& p) {
  return os << "Tensor" << PrintDims{p.t.shape()} << "[strides=" << PrintDims{p.t.strides()}
            << ", dtype=" << p.t.dtype() << ", device=" << p.t.device() << ']';
}

// ---------------------------------------------------------------------------------------
// Symbols bind on first sight and check afterwards. They are not copyable: matchers keep
// references to them, so a copy would silently split one symbol into two.
template <typename T>
class Symbol {
 public:
  explicit Symbol(std::string_view name = {}) : name_(name) {}
  Symbol(std::string_view name, T value) : name_(name), value_(value) {}
  Symbol(const Symbol&) = delete;
  Symbol& operator=(const Symbol&) = delete;

  std::string_view name() const { return name_; }
  bool has_value() const { return value_.has_value(); }
  T unwrap(DebugInfo where = {}) const {
    if (!value_) [[unlikely]] {
      detail::panic_at(where, "symbol '", name_, "' was read before any tensor bound it");
    }
    return *value_;
  }
  // Binds an unbound symbol; a bound one only agrees or not.
  bool bind_or_match(const T& got) {
    if (!value_) {
      value_ = got;
      return true;
    }
    return *value_ == got;
  }

 private:
  std::string_view name_;
  std::optional<T> value_;
};

using SymbolicSize = Symbol<int64_t>;
using SymbolicDType = Symbol<DLDataType>;
using SymbolicDevice = Symbol<DLDevice>;

// One entry of a matcher's shape or stride list: a symbol, a fixed number, or -1 (any).
class SizeSpec {
 public:
  static constexpr int64_t kAny = -1;
  template <std::integral T>
  SizeSpec(T fixed) : fixed_(static_cast<int64_t>(fixed)) {}  // NOLINT: literals are common
  SizeSpec(SymbolicSize& symbol) : symbol_(&symbol) {}  // NOLINT
  SizeSpec() = default;

  SymbolicSize* symbol() const { return symbol_; }
  int64_t fixed() const { return fixed_; }

 private:
  SymbolicSize* symbol_ = nullptr;
  int64_t fixed_ = kAny;
};

class TensorMatcher {
 public:
  static constexpr int kMaxDims = 8;

  TensorMatcher(std::initializer_list<SizeSpec> dims, DebugInfo where = {})
      : ndim_(static_cast<int>(dims.size())) {
    detail::check_at(dims.size() <= kMaxDims, where, "TensorMatcher supports at most ",
                     kMaxDims, " dimensions, got ", dims.size());
    std::copy(dims.begin(), dims.end(), dims_.begin());
  }

  // Without with_strides the tensor must be contiguous.
  TensorMatcher& with_strides(std::initializer_list<SizeSpec> strides, DebugInfo where = {}) {
    detail::check_at(static_cast<int>(strides.size()) == ndim_, where, "with_strides got ",
                     strides.size(), " entries for a ", ndim_, "-d matcher");
    std::copy(strides.begin(), strides.end(), strides_.begin());
    has_strides_ = true;
    return *this;
  }

  template <typename... Ts>
  TensorMatcher& with_dtype(SymbolicDType& symbol) {
    static_assert(sizeof...(Ts) <= kMaxDims, "too many dtypes");
    allowed_dtypes_count_ = 0;
    ((allowed_dtypes_[allowed_dtypes_count_++] = dtype_v<Ts>), ...);
    dtype_ = &symbol;
    return *this;
  }
  template <typename... Ts>
    requires(sizeof...(Ts) > 0)
  TensorMatcher& with_dtype() {
    return with_dtype<Ts...>(own_dtype_);
  }

  template <DLDeviceType... Ds>
  TensorMatcher& with_device(SymbolicDevice& symbol) {
    static_assert(sizeof...(Ds) <= kMaxDims, "too many device types");
    allowed_devices_count_ = 0;
    ((allowed_devices_[allowed_devices_count_++] = Ds), ...);
    device_ = &symbol;
    return *this;
  }
  template <DLDeviceType... Ds>
    requires(sizeof...(Ds) > 0)
  TensorMatcher& with_device() {
    return with_device<Ds...>(own_device_);
  }

  // Checks `t` and binds the symbols it is the first to see. `name` is how the error
  // refers to the tensor (the Python argument's name, say).
  const TensorMatcher& verify(const TensorView& t, std::string_view name = {},
                              DebugInfo where = {}) const {
    if (const auto cause = mismatch(t)) [[unlikely]] {
      fail(t, name, *cause, where);
    }
    return *this;
  }

 private:
  [[noreturn]] static void fail(const TensorView& t, std::string_view name,
                                const std::string& cause, const DebugInfo& where) {
    std::ostringstream os;
    os << "Tensor match failed for ";
    if (!name.empty()) os << '\'' << name << "' ";
    os << PrintTensor{t} << " at " << where << " - Root cause: " << cause;
    detail::raise("RuntimeError", os.str());
  }

  static std::string describe(const char* what, int index, const SymbolicSize* symbol) {
    std::string s = detail::concat(what, '#', index);
    if (symbol && !symbol->name().empty()) s += detail::concat("('", symbol->name(), "')");
    return s;
  }

  // Checks one size or stride entry; returns the root cause when it does not fit.
  static std::optional<std::string> check_entry(const SizeSpec& spec, int64_t got,
                                                const char* kind, const char* what, int index) {
    if (SymbolicSize* symbol = spec.symbol()) {
      if (symbol->bind_or_match(got)) return std::nullopt;
      return detail::concat(kind, " mismatch for ", describe(what, index, symbol), ": expected ",
                            symbol->unwrap(), " but got ", got);
    }
    if (spec.fixed() == SizeSpec::kAny || spec.fixed() == got) return std::nullopt;
    return detail::concat(kind, " mismatch for ", describe(what, index, nullptr), ": expected ",
                          spec.fixed(), " but got ", got);
  }

  std::optional<std::string> mismatch(const TensorView& t) const {
    if (t.ndim() != ndim_) {
      return detail::concat("Dimension mismatch: expected ", ndim_, " dims but got ", t.ndim());
    }
    for (int i = 0; i < ndim_; ++i) {
      if (auto cause = check_entry(dims_[i], t.size(i), "Size", "shape", i)) return cause;
    }
    if (auto cause = mismatch_strides(t)) return cause;
    if (dtype_ != nullptr) {
      if (auto cause = mismatch_dtype(t.dtype())) return cause;
    }
    if (device_ != nullptr) {
      if (auto cause = mismatch_device(t.device())) return cause;
    }
    return std::nullopt;
  }

  std::optional<std::string> mismatch_strides(const TensorView& t) const {
    if (t.numel() == 0) return std::nullopt;  // nothing is ever read through the strides
    int64_t contiguous = 1;
    for (int i = ndim_ - 1; i >= 0; --i) {
      const int64_t size = t.size(i);
      if (size != 1) {  // a size-1 dimension is never stepped over
        if (has_strides_) {
          if (auto cause = check_entry(strides_[i], t.stride(i), "Stride", "stride", i)) {
            return cause;
          }
        } else if (t.stride(i) != contiguous) {
          return detail::concat("Stride mismatch for stride#", i, ": expected ", contiguous,
                                " (contiguous) but got ", t.stride(i));
        }
      }
      contiguous *= size;
    }
    return std::nullopt;
  }

  std::optional<std::string> mismatch_dtype(DLDataType got) const {
    bool allowed = false;
    for (int i = 0; i < allowed_dtypes_count_; ++i) allowed |= allowed_dtypes_[i] == got;
    if (!allowed) {
      std::ostringstream os;
      os << "DType mismatch: expected ";
      if (allowed_dtypes_count_ > 1) os << "one of [";
      for (int i = 0; i < allowed_dtypes_count_; ++i) os << (i ? ", " : "") << allowed_dtypes_[i];
      if (allowed_dtypes_count_ > 1) os << ']';
      os << " but got " << got;
      return os.str();
    }
    if (dtype_->bind_or_match(got)) return std::nullopt;
    return detail::concat("DType mismatch", symbol_suffix(*dtype_), ": expected ",
                          dtype_->unwrap(), " (as an earlier tensor) but got ", got);
  }

  std::optional<std::string> mismatch_device(DLDevice got) const {
    bool allowed = false;
    for (int i = 0; i < allowed_devices_count_; ++i) {
      allowed |= allowed_devices_[i] == got.device_type;
    }
    if (!allowed) {
      std::ostringstream os;
      os << "Device mismatch: expected ";
      if (allowed_devices_count_ > 1) os << "one of [";
      for (int i = 0; i < allowed_devices_count_; ++i) {
        os << (i ? ", " : "") << device_type_name(allowed_devices_[i]);
      }
      if (allowed_devices_count_ > 1) os << ']';
      os << " but got " << got;
      return os.str();
    }
    if (device_->bind_or_match(got)) return std::nullopt;
    return detail::concat("Device mismatch", symbol_suffix(*device_), ": expected ",
                          device_->unwrap(), " (as an earlier tensor) but got ", got);
  }

  template <typename T>
  static std::string symbol_suffix(const Symbol<T>& symbol) {
    return symbol.name().empty() ? std::string{} : detail::concat(" for '", symbol.name(), "'");
  }

  int ndim_;
  std::array<SizeSpec, kMaxDims> dims_{};
  std::array<SizeSpec, kMaxDims> strides_{};
  bool has_strides_ = false;

  std::array<DLDataType, kMaxDims> allowed_dtypes_{};
  int allowed_dtypes_count_ = 0;
  SymbolicDType* dtype_ = nullptr;
  SymbolicDType own_dtype_;

  std::array<DLDeviceType, kMaxDims> allowed_devices_{};
  int allowed_devices_count_ = 0;
  SymbolicDevice* device_ = nullptr;
  SymbolicDevice own_device_;
};

}  // namespace jitk
