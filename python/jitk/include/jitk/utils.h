// Host-side foundations shared by every jitk kernel: source locations, the checks that
// turn into Python exceptions, and a few small helpers. Compiles with g++ and nvcc (C++20).
//
// Only C headers and light C++ ones: nvcc parses a translation unit three times, and
// <string>, <sstream> and <string_view> alone cost about 0.9 s of every kernel build
// (measured on the CI machine), so messages are built in jitk::Text instead.
//
// NVRTC (a kernel file's device half, jitk/nvrtc.cuh) reads only the small helpers at the
// end; the rest is host code, which NVRTC does not compile.
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC has no standard library: the pieces of libcu++ that jitk's device code uses, one
// header each, found as std:: (its whole <type_traits> or <bit> costs NVRTC a second a build;
// jitk's headers include the standard headers only where a host compiler reads them).
#include <cuda/std/__bit/bit_cast.h>
#include <cuda/std/__concepts/arithmetic.h>
#include <cuda/std/__type_traits/common_type.h>
#include <cuda/std/__type_traits/conditional.h>
#include <cuda/std/__type_traits/integral_constant.h>
#include <cuda/std/__type_traits/is_same.h>
#include <cuda/std/__type_traits/is_void.h>
#include <cuda/std/__utility/forward.h>
#include <cuda/std/cstddef>
#include <cuda/std/cstdint>
namespace std {
using namespace cuda::std;
}
#else
#include <concepts>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <type_traits>
#include <utility>
#if __has_include(<source_location>)
#include <source_location>
#endif
#endif

// Which half of a kernel file a compiler is reading (jitk/nvrtc.cuh): nvcc reads both, NVRTC
// the device half, and the host compiler alone the host half of a file written in two halves.
#if defined(__CUDACC_RTC__)
#define JITK_DEVICE_HALF 1
#define JITK_HOST_HALF 0
#elif defined(__CUDACC__)
#define JITK_DEVICE_HALF 1
#define JITK_HOST_HALF 1
#else
#define JITK_DEVICE_HALF 0
#define JITK_HOST_HALF 1
#endif

// Small functions that host and device code share (a plain inline function to a host
// compiler).
#if defined(__CUDACC__)
#define JITK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JITK_HOST_DEVICE inline
#endif

// jitk's host runtime: the host functions of jitk's headers that every module would otherwise
// compile anew (argument checks, NVRTC loading), marked JITK_RUNTIME. A header defines them
// inline, as usual, except in a host half built with the precompiled prelude, which defines
// JITK_RUNTIME_LINKED (jitk/build/pch.py): there they are only declared, and the runtime
// object built beside the prelude (JITK_RUNTIME_DEFINE) defines them once for every library
// that links it. Only headers that jitk/host_prelude.h includes may use it.
#if defined(JITK_RUNTIME_LINKED) && !defined(JITK_RUNTIME_DEFINE)
#define JITK_RUNTIME_BODY 0
#else
#define JITK_RUNTIME_BODY 1
#endif
#if defined(JITK_RUNTIME_LINKED)
#define JITK_RUNTIME
#else
#define JITK_RUNTIME inline
#endif

namespace jitk {

#if JITK_HOST_HALF
// The place in the source that asked for a check. It is always taken as a defaulted
// argument, so it names the caller's line, not this header's.
struct DebugInfo {
#if defined(__cpp_lib_source_location)
  constexpr DebugInfo(std::source_location loc = std::source_location::current())
      : file_(loc.file_name()), line_(static_cast<int>(loc.line())) {}
#else
  // nvcc releases whose front end lacks __builtin_source_location ship no usable
  // std::source_location; the older intrinsics give the same answer there.
  constexpr DebugInfo(const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : file_(file), line_(line) {}
#endif

  constexpr const char* file() const { return file_; }
  constexpr int line() const { return line_; }
  // The file name without its directories: kernels are included by absolute path, and
  // "rmsnorm.cuh:42" reads better in an error than the whole path.
  constexpr const char* file_name() const {
    const char* name = file_;
    for (const char* c = file_; *c != '\0'; ++c) {
      if (*c == '/') name = c + 1;
    }
    return name;
  }

 private:
  const char* file_;
  int line_;
};

// A growable text on the heap: what error messages are built in.
class Text {
 public:
  Text() = default;
  // Exceptions are copied in flight, so a copy must not throw: one that cannot allocate
  // is empty.
  Text(const Text& other) noexcept {
    if (other.size_ > 0 && reserve(other.size_)) {
      std::memcpy(data_, other.data_, other.size_ + 1);
      size_ = other.size_;
    }
  }
  Text(Text&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  Text& operator=(Text other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(capacity_, other.capacity_);
    return *this;
  }
  ~Text() { std::free(data_); }

  const char* c_str() const { return data_ != nullptr ? data_ : ""; }
  const char* data() const { return c_str(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  void append(const char* chars, size_t count) {
    if (count == 0) return;
    if (!reserve(size_ + count)) throw std::bad_alloc();
    std::memcpy(data_ + size_, chars, count);
    size_ += count;
    data_[size_] = '\0';
  }

 private:
  // Room for `size` characters and the terminating zero; false when out of memory.
  bool reserve(size_t size) noexcept {
    if (size < capacity_) return true;
    size_t capacity = capacity_ > 0 ? capacity_ : 128;
    while (capacity <= size) capacity *= 2;
    char* grown = static_cast<char*>(std::realloc(data_, capacity));
    if (grown == nullptr) return false;
    data_ = grown;
    capacity_ = capacity;
    return true;
  }

  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// ---------------------------------------------------------------------------------------
// append_to(text, value): how a value reads in a message. Messages take C strings, chars,
// bools, numbers, anything with data() and size() (std::string, std::string_view), hex(n),
// DebugInfo, and jitk's tensor types. To print a type of your own, define
//   void append_to(jitk::Text& out, const YourType& value);
// next to it (found by argument-dependent lookup).
namespace detail {
// A printf conversion of a number, appended (the attribute checks each format against its
// argument).
[[gnu::format(printf, 2, 3)]] inline void append_printf(Text& out, const char* format, ...) {
  char digits[32];
  std::va_list args;
  va_start(args, format);
  const int count = std::vsnprintf(digits, sizeof(digits), format, args);
  va_end(args);
  out.append(digits, static_cast<size_t>(count));
}
}  // namespace detail

inline void append_to(Text& out, const char* chars) {
  if (chars == nullptr) chars = "(null)";
  out.append(chars, std::strlen(chars));
}
inline void append_to(Text& out, char c) { out.append(&c, 1); }
inline void append_to(Text& out, bool value) { append_to(out, value ? "true" : "false"); }

template <std::integral T>
  requires(!std::same_as<T, bool> && !std::same_as<T, char>)
void append_to(Text& out, T value) {
  if constexpr (std::is_signed_v<T>) {
    detail::append_printf(out, "%lld", static_cast<long long>(value));
  } else {
    detail::append_printf(out, "%llu", static_cast<unsigned long long>(value));
  }
}

template <std::floating_point T>
void append_to(Text& out, T value) {
  detail::append_printf(out, "%g", static_cast<double>(value));
}

template <typename T>
  requires requires(const T& s) {
    { s.data() } -> std::convertible_to<const char*>;
    { s.size() } -> std::convertible_to<size_t>;
  }
void append_to(Text& out, const T& chars) {
  out.append(chars.data(), static_cast<size_t>(chars.size()));
}

template <typename T>
  requires std::is_enum_v<T>
void append_to(Text& out, T value) {
  append_to(out, static_cast<long long>(value));
}

inline void append_to(Text& out, const void* pointer) { detail::append_printf(out, "%p", pointer); }

// hex(address) reads "0x7f00c0000010".
struct Hex {
  uint64_t value;
};
constexpr Hex hex(uint64_t value) { return {value}; }
inline void append_to(Text& out, Hex number) {
  detail::append_printf(out, "0x%llx", static_cast<unsigned long long>(number.value));
}

// "rmsnorm.cuh:42"
inline void append_to(Text& out, const DebugInfo& where) {
  append_to(out, where.file_name());
  append_to(out, ':');
  append_to(out, where.line());
}

template <typename T>
concept Printable = requires(Text& out, const T& value) { append_to(out, value); };

// What every jitk check throws. At the boundary to Python (jitk/export.h) it becomes the
// Python exception named by `kind()`, with the message as it is.
class Error : public std::exception {
 public:
  Error(const char* kind, Text message) : kind_(kind), message_(std::move(message)) {}
  const char* kind() const noexcept { return kind_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  const char* kind_;
  Text message_;
};

namespace detail {

// A message argument with its type erased: messages are built on the error path only, so
// each call site passes an array of these to one function rather than instantiating a
// formatter for its own list of argument types (which cost the host compiler seconds).
struct Piece {
  void (*append)(Text& out, const void* value);
  const void* value;
};

template <typename T>
void append_erased(Text& out, const void* value) {
  append_to(out, *static_cast<const T*>(value));
}
inline void append_chars(Text& out, const void* chars) {
  append_to(out, static_cast<const char*>(chars));
}

template <typename T>
Piece piece(const T& value) {
  if constexpr (std::is_array_v<T>) {
    static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>,
                  "jitk: the only arrays a message takes are strings");
    return {&append_chars, value};
  } else {
    return {&append_erased<T>, &value};
  }
}

[[gnu::cold, gnu::noinline]] inline void append_pieces(Text& out, const Piece* pieces,
                                                       size_t count) {
  for (size_t i = 0; i < count; ++i) pieces[i].append(out, pieces[i].value);
}

}  // namespace detail

// append(out, "Tensor", dims, ']'): several values at once, e.g. inside an append_to.
template <typename... Args>
void append(Text& out, const Args&... args) {
  static_assert((Printable<Args> && ...),
                "jitk: a message argument has a type jitk cannot print; define "
                "void append_to(jitk::Text&, const YourType&) next to the type");
  if constexpr (sizeof...(Args) > 0) {
    const detail::Piece pieces[] = {detail::piece(args)...};
    detail::append_pieces(out, pieces, sizeof...(Args));
  }
}

namespace detail {

template <typename... Args>
Text concat(const Args&... args) {
  Text out;
  append(out, args...);
  return out;
}

// Raise a Python exception of type `kind` (through jitk/export.h).
[[noreturn, gnu::cold]] inline void raise(const char* kind, Text message) {
  throw Error(kind, std::move(message));
}

// What Panic and RuntimeCheck do. Kernel code calls those, with the location first when it
// checks on behalf of its caller.
template <typename... Args>
[[noreturn]] void panic_at(const DebugInfo& where, const Args&... args) {
  raise("RuntimeError", concat("Panic at ", where, ": ", args...));
}
template <typename... Args>
void check_at(bool condition, const DebugInfo& where, const Args&... args) {
  if (!condition) [[unlikely]] {
    raise("RuntimeError", concat("Runtime check failed at ", where, ": ", args...));
  }
}

}  // namespace detail

// Panic("what went wrong: ", value) raises RuntimeError("Panic at file.cuh:12: what went
// wrong: 7"). A helper that checks on behalf of its caller passes the caller's location
// first: Panic(where, "...") (see RuntimeCheck). A class template only so that a defaulted
// DebugInfo can follow the pack.
template <typename... Args>
struct Panic {
  [[noreturn]] explicit Panic(Args&&... args, DebugInfo where = {}) {
    detail::panic_at(where, args...);
  }
  // Without message arguments the constructor above already takes a location.
  [[noreturn]] explicit Panic(DebugInfo where, Args&&... args)
    requires(sizeof...(Args) > 0)
  {
    detail::panic_at(where, args...);
  }
};
template <typename... Args>
Panic(Args&&...) -> Panic<Args...>;
template <typename... Args>
Panic(DebugInfo, Args&&...) -> Panic<Args...>;

// RuntimeCheck(n > 0, "n must be positive, got ", n) raises
// RuntimeError("Runtime check failed at file.cuh:12: n must be positive, got 0").
// RuntimeCheck(where, n > 0, ...) names `where` instead: for a helper that checks on behalf
// of its caller, taking `DebugInfo where = {}` as its last parameter.
template <typename... Args>
struct RuntimeCheck {
  explicit RuntimeCheck(bool condition, Args&&... args, DebugInfo where = {}) {
    detail::check_at(condition, where, args...);
  }
  explicit RuntimeCheck(DebugInfo where, bool condition, Args&&... args) {
    detail::check_at(condition, where, args...);
  }
};
template <typename... Args>
RuntimeCheck(bool, Args&&...) -> RuntimeCheck<Args...>;
template <typename... Args>
RuntimeCheck(DebugInfo, bool, Args&&...) -> RuntimeCheck<Args...>;
#endif  // JITK_HOST_HALF

// for (auto i : irange(n)) / irange(begin, end): integer ranges without sign mix-ups.
// Written out rather than std::views::iota: <ranges> adds close to a second to every
// kernel's nvcc build (7.8 s -> 7.0 s for a small module, measured on the CI machine).
template <std::integral T>
class IntegerRange {
 public:
  struct Iterator {
    T value;
    constexpr T operator*() const { return value; }
    constexpr Iterator& operator++() {
      ++value;
      return *this;
    }
    constexpr bool operator!=(const Iterator& other) const { return value != other.value; }
  };
  constexpr IntegerRange(T begin, T end) : begin_(begin), end_(end < begin ? begin : end) {}
  constexpr Iterator begin() const { return {begin_}; }
  constexpr Iterator end() const { return {end_}; }

 private:
  T begin_, end_;
};

template <std::integral T>
constexpr IntegerRange<T> irange(T end) {
  return {T{0}, end};
}
template <std::integral T, std::integral U>
constexpr auto irange(T begin, U end) {
  using V = std::common_type_t<T, U>;
  return IntegerRange<V>(static_cast<V>(begin), static_cast<V>(end));
}

template <std::integral T, std::integral U>
constexpr auto div_ceil(T a, U b) {
  return (a + b - 1) / b;
}

// Integer min and max, host and device, in constant expressions too: std::min and std::max
// live in <algorithm>, which costs every build about 0.3 s.
template <std::integral T>
constexpr T min_of(T a, T b) {
  return b < a ? b : a;
}
template <std::integral T>
constexpr T max_of(T a, T b) {
  return a < b ? b : a;
}

// The least power of two at or above `value` (>= 1): std::bit_ceil, whose libcu++ header
// NVRTC takes a second to read.
constexpr unsigned pow2_ceil(unsigned value) {
  unsigned power = 1;
  while (power < value) power *= 2;
  return power;
}

#if JITK_HOST_HALF
namespace pointer {

// Byte offsets on untyped pointers. Typed pointers are refused so that nobody mistakes a
// byte count for an element count.
template <std::integral... Offsets>
inline void* offset(void* ptr, Offsets... bytes) {
  return static_cast<char*>(ptr) + (static_cast<std::ptrdiff_t>(bytes) + ... + 0);
}
template <std::integral... Offsets>
inline const void* offset(const void* ptr, Offsets... bytes) {
  return static_cast<const char*>(ptr) + (static_cast<std::ptrdiff_t>(bytes) + ... + 0);
}
template <typename T, std::integral... Offsets>
  requires(!std::is_void_v<T>)
void* offset(T* ptr, Offsets... bytes) = delete;

}  // namespace pointer
#endif

}  // namespace jitk
