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

#include <jitk/dlpack.h>
#include <jitk/utils.h>

#include <dlpack/dlpack.h>

#include <concepts>
#include <cstdint>
#include <initializer_list>

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

// Another library's tensor or view with DLPack's accessors: tvm::ffi::TensorView or Tensor,
// where a kernel includes tvm-ffi's headers. jitk's checks take them as they are. A
// constraint, not an include: kernels without tvm-ffi's headers parse none of them.
template <typename View>
concept DLPackViewLike = requires(const View& v) {
  { v.data_ptr() } -> std::convertible_to<void*>;
  { v.shape().data() } -> std::convertible_to<const int64_t*>;
  { v.strides().data() } -> std::convertible_to<const int64_t*>;
  { v.byte_offset() } -> std::convertible_to<uint64_t>;
  { v.device() } -> std::convertible_to<DLDevice>;
  { v.dtype() } -> std::convertible_to<DLDataType>;
};

// A non-owning view of a DLPack tensor: what every jitk entry point receives. The tensor it
// views (and its shape and strides arrays) must outlive it, as for any view.
class TensorView {
 public:
  static constexpr int kMaxCompactDims = 8;

  explicit TensorView(const DLTensor* tensor) : tensor_(*tensor) {
    if (tensor_.strides == nullptr) use_compact_strides();
  }
  // Refers to the other view's shape and strides.
  template <DLPackViewLike View>
    requires(!std::same_as<View, TensorView>)
  explicit TensorView(const View& view) : TensorView(as_dl_tensor(view)) {}
  TensorView(const TensorView& other) { *this = other; }
  TensorView& operator=(const TensorView& other) {
    tensor_ = other.tensor_;
    for (int i = 0; i < kMaxCompactDims; ++i) compact_[i] = other.compact_[i];
    if (other.tensor_.strides == other.compact_) tensor_.strides = compact_;
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
      detail::raise("ValueError", detail::concat("a tensor of ", tensor_.ndim,
                                                 " dimensions "
                                                 "must carry strides (at most ",
                                                 kMaxCompactDims, " without)"));
    }
    int64_t step = 1;
    for (int i = tensor_.ndim - 1; i >= 0; --i) {
      compact_[i] = step;
      step *= tensor_.shape[i];
    }
    tensor_.strides = compact_;
  }

  explicit TensorView(const DLTensor& tensor) : TensorView(&tensor) {}
  template <typename View>
  static DLTensor as_dl_tensor(const View& v) {
    return {v.data_ptr(),
            v.device(),
            static_cast<int32_t>(v.shape().size()),
            v.dtype(),
            const_cast<int64_t*>(v.shape().data()),
            const_cast<int64_t*>(v.strides().data()),
            v.byte_offset()};
  }

  DLTensor tensor_;
  int64_t compact_[kMaxCompactDims]{};
};

// ---------------------------------------------------------------------------------------
// How messages print shapes and tensors.

// "<100, 256>"
struct PrintDims {
  ShapeView dims;
};
inline void append_to(Text& out, const PrintDims& p) {
  append_to(out, '<');
  for (size_t i = 0; i < p.dims.size(); ++i) append(out, i ? ", " : "", p.dims[i]);
  append_to(out, '>');
}

// "Tensor<100, 256>[strides=<256, 1>, dtype=float32, device=cuda:0]"
struct PrintTensor {
  const TensorView& t;
};
inline void append_to(Text& out, const PrintTensor& p) {
  append(out, "Tensor", PrintDims{p.t.shape()}, "[strides=", PrintDims{p.t.strides()},
         ", dtype=", p.t.dtype(), ", device=", p.t.device(), ']');
}

// ---------------------------------------------------------------------------------------
// Symbols bind on first sight and check afterwards. They are not copyable: matchers keep
// references to them, so a copy would silently split one symbol into two.
template <typename T>
class Symbol {
 public:
  explicit Symbol(const char* name = "") : name_(name) {}
  Symbol(const char* name, T value) : name_(name), value_(value), bound_(true) {}
  Symbol(const Symbol&) = delete;
  Symbol& operator=(const Symbol&) = delete;

  const char* name() const { return name_; }
  bool has_value() const { return bound_; }
  T unwrap(DebugInfo where = {}) const {
    if (!bound_) [[unlikely]] {
      Panic(where, "symbol '", name_, "' was read before any tensor bound it");
    }
    return value_;
  }
  // Binds an unbound symbol; a bound one only agrees or not.
  bool bind_or_match(const T& got) {
    if (!bound_) {
      value_ = got;
      bound_ = true;
      return true;
    }
    return value_ == got;
  }

 private:
  const char* name_;
  T value_{};
  bool bound_ = false;
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
  SizeSpec(SymbolicSize& symbol) : symbol_(&symbol) {}        // NOLINT
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
    RuntimeCheck(where, dims.size() <= kMaxDims, "TensorMatcher supports at most ", kMaxDims,
                 " dimensions, got ", dims.size());
    int i = 0;
    for (const SizeSpec& dim : dims) dims_[i++] = dim;
  }

  // Without with_strides the tensor must be contiguous.
  TensorMatcher& with_strides(std::initializer_list<SizeSpec> strides, DebugInfo where = {}) {
    RuntimeCheck(where, static_cast<int>(strides.size()) == ndim_, "with_strides got ",
                 strides.size(), " entries for a ", ndim_, "-d matcher");
    int i = 0;
    for (const SizeSpec& stride : strides) strides_[i++] = stride;
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
  const TensorMatcher& verify(const TensorView& t, const char* name = "",
                              DebugInfo where = {}) const;
  // The same check of a tvm::ffi::TensorView or Tensor (SGLang's kernels pass those).
  template <DLPackViewLike View>
    requires(!std::same_as<View, TensorView>)
  const TensorMatcher& verify(const View& t, const char* name = "", DebugInfo where = {}) const {
    return verify(TensorView(t), name, where);
  }

 private:
  [[noreturn, gnu::cold, gnu::noinline]] static void fail(const TensorView& t, const char* name,
                                                          const Text& cause,
                                                          const DebugInfo& where) {
    Text message;
    append(message, "Tensor match failed for ");
    if (name[0] != '\0') append(message, '\'', name, "' ");
    append(message, PrintTensor{t}, " at ", where, " - Root cause: ", cause);
    detail::raise("RuntimeError", std::move(message));
  }

  // "shape#1('head_dim')"
  static void describe(Text& out, const char* what, int index, const SymbolicSize* symbol) {
    append(out, what, '#', index);
    if (symbol != nullptr && symbol->name()[0] != '\0') append(out, "('", symbol->name(), "')");
  }

  // Checks one size or stride entry; says why in `cause` when it does not fit.
  static bool entry_matches(const SizeSpec& spec, int64_t got, const char* kind, const char* what,
                            int index, Text& cause) {
    SymbolicSize* symbol = spec.symbol();
    if (symbol != nullptr ? symbol->bind_or_match(got)
                          : spec.fixed() == SizeSpec::kAny || spec.fixed() == got) {
      return true;
    }
    append(cause, kind, " mismatch for ");
    describe(cause, what, index, symbol);
    append(cause, ": expected ", symbol != nullptr ? symbol->unwrap() : spec.fixed(), " but got ",
           got);
    return false;
  }

  bool matches(const TensorView& t, Text& cause) const {
    if (t.ndim() != ndim_) {
      append(cause, "Dimension mismatch: expected ", ndim_, " dims but got ", t.ndim());
      return false;
    }
    for (int i = 0; i < ndim_; ++i) {
      if (!entry_matches(dims_[i], t.size(i), "Size", "shape", i, cause)) return false;
    }
    return strides_match(t, cause) && (dtype_ == nullptr || dtype_matches(t.dtype(), cause)) &&
           (device_ == nullptr || device_matches(t.device(), cause));
  }

  bool strides_match(const TensorView& t, Text& cause) const {
    if (t.numel() == 0) return true;  // nothing is ever read through the strides
    int64_t contiguous = 1;
    for (int i = ndim_ - 1; i >= 0; --i) {
      const int64_t size = t.size(i);
      if (size != 1) {  // a size-1 dimension is never stepped over
        if (has_strides_) {
          if (!entry_matches(strides_[i], t.stride(i), "Stride", "stride", i, cause)) {
            return false;
          }
        } else if (t.stride(i) != contiguous) {
          append(cause, "Stride mismatch for stride#", i, ": expected ", contiguous,
                 " (contiguous) but got ", t.stride(i));
          return false;
        }
      }
      contiguous *= size;
    }
    return true;
  }

  bool dtype_matches(DLDataType got, Text& cause) const {
    return kind_matches("DType", allowed_dtypes_, allowed_dtypes_count_, got, *dtype_, got, cause);
  }

  bool device_matches(DLDevice got, Text& cause) const {
    return kind_matches("Device", allowed_devices_, allowed_devices_count_, got.device_type,
                        *device_, got, cause);
  }

  // A dtype or device: first one of the allowed kinds, then the symbol's value once bound.
  template <typename Kind, typename T>
  static bool kind_matches(const char* what, const Kind* allowed, int count, Kind got_kind,
                           Symbol<T>& symbol, const T& got, Text& cause) {
    bool is_allowed = false;
    for (int i = 0; i < count; ++i) is_allowed |= allowed[i] == got_kind;
    if (!is_allowed) {
      append(cause, what, " mismatch: expected ");
      if (count > 1) append(cause, "one of [");
      for (int i = 0; i < count; ++i) append(cause, i ? ", " : "", allowed[i]);
      if (count > 1) append(cause, ']');
      append(cause, " but got ", got);
      return false;
    }
    if (symbol.bind_or_match(got)) return true;
    append(cause, what, " mismatch", SymbolSuffix{symbol.name()}, ": expected ", symbol.unwrap(),
           " (as an earlier tensor) but got ", got);
    return false;
  }

  // " for 'cache dtype'", or nothing for a symbol without a name.
  struct SymbolSuffix {
    const char* name;
    friend void append_to(Text& out, SymbolSuffix suffix) {
      if (suffix.name[0] != '\0') append(out, " for '", suffix.name, "'");
    }
  };

  int ndim_;
  SizeSpec dims_[kMaxDims]{};
  SizeSpec strides_[kMaxDims]{};
  bool has_strides_ = false;

  DLDataType allowed_dtypes_[kMaxDims]{};
  int allowed_dtypes_count_ = 0;
  SymbolicDType* dtype_ = nullptr;
  SymbolicDType own_dtype_;

  DLDeviceType allowed_devices_[kMaxDims]{};
  int allowed_devices_count_ = 0;
  SymbolicDevice* device_ = nullptr;
  SymbolicDevice own_device_;
};

#if JITK_RUNTIME_BODY
JITK_RUNTIME const TensorMatcher& TensorMatcher::verify(const TensorView& t, const char* name,
                                                        DebugInfo where) const {
  Text cause;
  if (!matches(t, cause)) [[unlikely]] {
    fail(t, name, cause, where);
  }
  return *this;
}
#endif

}  // namespace jitk
