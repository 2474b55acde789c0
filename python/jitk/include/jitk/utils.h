// Host-side foundations shared by every jitk kernel: source locations, the checks that
// turn into Python exceptions, and a few small helpers. Compiles with g++ and nvcc (C++20).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#if __has_include(<source_location>)
#include <source_location>
#endif

namespace jitk {

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
  constexpr std::string_view file_name() const {
    const std::string_view path{file_};
    const auto slash = path.find_last_of('/');
    return slash == std::string_view::npos ? path : path.substr(slash + 1);
  }

 private:
  const char* file_;
  int line_;
};

inline std::ostream& operator<<(std::ostream& os, const DebugInfo& where) {
  return os << where.file_name() << ':' << where.line();
}

// What every jitk check throws. At the boundary to Python (jitk/export.h) it becomes the
// Python exception named by `kind()`, with the message as it is.
class Error : public std::runtime_error {
 public:
  Error(const char* kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  const char* kind() const { return kind_; }

 private:
  const char* kind_;
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// Raise a Python exception of type `kind` (through jitk/export.h).
[[noreturn]] inline void raise(const char* kind, const std::string& message) {
  throw Error(kind, message);
}

// For code that already holds the location to blame (a header checking on behalf of its
// caller): Panic and RuntimeCheck would take a DebugInfo argument as part of the message.
template <typename... Args>
[[noreturn]] void panic_at(const DebugInfo& where, Args&&... args) {
  raise("RuntimeError", concat("Panic at ", where, ": ", std::forward<Args>(args)...));
}
template <typename... Args>
void check_at(bool condition, const DebugInfo& where, Args&&... args) {
  if (!condition) [[unlikely]] {
    raise("RuntimeError",
          concat("Runtime check failed at ", where, ": ", std::forward<Args>(args)...));
  }
}

}  // namespace detail

// Panic("what went wrong: ", value) raises RuntimeError("Panic at file.cuh:12: what went
// wrong: 7"). A class template only so that a defaulted DebugInfo can follow the pack.
template <typename... Args>
struct Panic {
  [[noreturn]] explicit Panic(Args&&... args, DebugInfo where = {}) {
    detail::panic_at(where, std::forward<Args>(args)...);
  }
};
template <typename... Args>
Panic(Args&&...) -> Panic<Args...>;

// RuntimeCheck(n > 0, "n must be positive, got ", n) raises
// RuntimeError("Runtime check failed at file.cuh:12: n must be positive, got 0").
template <typename... Args>
struct RuntimeCheck {
  explicit RuntimeCheck(bool condition, Args&&... args, DebugInfo where = {}) {
    detail::check_at(condition, where, std::forward<Args>(args)...);
  }
};
template <typename... Args>
RuntimeCheck(bool, Args&&...) -> RuntimeCheck<Args...>;

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

}  // namespace jitk
