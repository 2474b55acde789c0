// Stream-ordered flags on the CUDA driver's stream memory operations (cuStreamWaitValue32/64,
// cuStreamWriteValue32/64): the GPU's front end holds a stream until a 32- or 64-bit flag (in
// GPU or pinned host memory) passes a comparison, or writes the flag after the stream's earlier
// work; no kernel, no SM, and stream capture records them. The driver is reached through the
// runtime's entry-point lookup, never linked, so a machine without one builds and loads this.
// Where the driver or GPU lacks an operation, a one-thread spin kernel does it (the fallback).
// Written in two halves (jitk/nvrtc.cuh): NVRTC may build the spin kernels apart.
#pragma once

#include <jitk/nvrtc.cuh>

#include <jitk/device.cuh>

#if JITK_HOST_HALF
#include <jitk/driver.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#endif

namespace jitk::wait_value {

// Comparisons, numbered as the driver numbers them (CU_STREAM_WAIT_VALUE_*, which device code
// built by NVRTC cannot include; the host half checks the numbers), wait_value.py too:
//   geq: (signed)(flag - value) >= 0, a greater-or-equal that survives wrap-around
//   eq:  flag == value
//   and: (flag & value) != 0
//   nor: ~(flag | value) != 0, some bit is 0 in both
enum Compare : int { kGeq = 0, kEq = 1, kAnd = 2, kNor = 3 };
inline constexpr int kLastCompare = kNor;
inline constexpr int kWrite = -1;  // what enqueue() takes for "write", not "wait"

// How a call ran, returned to Python, which warns once for each reason to fall back.
enum Path : int32_t {
  kMemoryOperation = 0,
  kSpinNoDriverEntryPoints = 1,  // the driver has no stream memory operations (older than 12.0)
  kSpinNo64BitOperations = 2,    // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0
  kSpinNoNorWait = 3,            // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR is 0
  kSpinRefusedByDriver = 4,      // the operation returned CUDA_ERROR_NOT_SUPPORTED
  kSpinRequested = 5,            // the caller asked for the spin kernel
};

// ---------------------------------------------------------------------------------------
// The fallback: one thread that spins on the flag, and one that writes it.

// The waiter sleeps between polls, doubling up to the cap: a flag already set costs one load, a
// release is noticed about the cap late at most, a long wait costs a load (PCIe read) per cap.
inline constexpr unsigned kFirstSleepNs = 32;
inline constexpr unsigned kMaxSleepNs = 512;

#if JITK_DEVICE_HALF
// The acquire orders every later read of this thread (and of the kernels after it on the
// stream) after the flag's value; the release publishes everything before it on the stream.
template <typename T>
__device__ __forceinline__ T load_acquire_system(const T* flag) {
  T value;
  if constexpr (sizeof(T) == 8) {
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  }
  return value;
}
template <typename T>
__device__ __forceinline__ void store_release_system(T* flag, T value) {
  if constexpr (sizeof(T) == 8) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
  } else {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
  }
}

template <typename T>
__device__ __forceinline__ bool passes(T flag, T value, int compare) {
  // The flag's bits as unsigned (libcu++'s make_unsigned costs NVRTC a second a build).
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  switch (compare) {
    case kGeq: return static_cast<T>(static_cast<Bits>(flag) - static_cast<Bits>(value)) >= 0;
    case kEq: return flag == value;
    case kAnd: return (flag & value) != 0;
    default: return ~(flag | value) != 0;
  }
}

#endif  // JITK_DEVICE_HALF

template <typename T>
__global__ void wait_kernel(const T* flag, T value, int compare)
#if JITK_DEVICE_HALF
{
  unsigned sleep_ns = kFirstSleepNs;
  while (!passes(load_acquire_system(flag), value, compare)) {
    device::pause_ns(sleep_ns);
    sleep_ns = min(2 * sleep_ns, kMaxSleepNs);
  }
}
#else
    ;
#endif

template <typename T>
__global__ void write_kernel(T* flag, T value)
#if JITK_DEVICE_HALF
{
  store_release_system(flag, value);
}
#else
    ;
#endif

// Under CUDA_MODULE_LOADING=EAGER, code loaded at start is readied by the first kernel launch,
// which waits for the GPU's work: behind a pending wait it never ran (H100, driver 580). So
// there, a device's first memory operation, before any wait of jitk's is pending, launches a
// kernel that does nothing (a spin kernel is such a launch itself); a captured call leaves it
// to a later one. Under lazy loading nothing is launched, so nothing needs loading.
__global__ void settle_kernel()
#if JITK_DEVICE_HALF
    {}
#else
    ;
#endif

#if JITK_HOST_HALF
static_assert(int{kGeq} == CU_STREAM_WAIT_VALUE_GEQ && int{kEq} == CU_STREAM_WAIT_VALUE_EQ &&
              int{kAnd} == CU_STREAM_WAIT_VALUE_AND && int{kNor} == CU_STREAM_WAIT_VALUE_NOR);

// ---------------------------------------------------------------------------------------
// Host side: the flag.

template <typename T>
T flag_value(int64_t value) {
  if constexpr (sizeof(T) < sizeof(int64_t)) {
    RuntimeCheck(value >= std::numeric_limits<T>::min() && value <= std::numeric_limits<T>::max(),
                 "value must fit in the int", 8 * sizeof(T), " flag, got ", value);
  }
  return static_cast<T>(value);
}

// Checks that `flag` is a 1-d int32 or int64 tensor of at least one element on one of
// kDevices, and calls use(address) with a typed pointer to its first element, the flag.
template <DLDeviceType... kDevices, typename Use>
decltype(auto) with_flag(const TensorView& flag, SymbolicDevice& device, Use&& use) {
  SymbolicSize length{"flag length"};
  SymbolicDType dtype;
  TensorMatcher({length})
      .with_strides({-1})  // only the first element is read
      .with_dtype<int32_t, int64_t>(dtype)
      .with_device<kDevices...>(device)
      .verify(flag, "flag");
  RuntimeCheck(length.unwrap() >= 1,
               "'flag' must hold at least one element (the first is the flag), got an empty "
               "tensor");
  void* address = pointer::offset(flag.data_ptr(), flag.byte_offset());
  // A misaligned access kills the CUDA context (or the driver refuses it) instead of raising.
  const auto aligned = [&]<typename T>() {
    RuntimeCheck(reinterpret_cast<std::uintptr_t>(address) % alignof(T) == 0, "'flag' must be ",
                 alignof(T), "-byte aligned for its dtype, got address ", address);
    return static_cast<T*>(address);
  };
  if (dtype.unwrap() == dtype_v<int64_t>) return use(aligned.template operator()<int64_t>());
  return use(aligned.template operator()<int32_t>());
}

// The GPU may only touch host memory that is pinned (page-locked and mapped into its address
// space); the driver wants the address the GPU sees, which this returns.
inline void* device_address_of_host_flag(void* host, DLDevice device) {
  const HostMemory memory = query_host_memory(host);
  if (memory.error != cudaSuccess) {
    Panic("flag must be a cuda tensor or pinned host memory, got ", device,
          " memory, and CUDA could not tell whether it is pinned (", cudaGetErrorName(memory.error),
          ": ", cudaGetErrorString(memory.error), ")");
  }
  RuntimeCheck(memory.pinned && memory.device_address != nullptr,
               "flag must be a cuda tensor or pinned host memory, got ", device,
               " memory that is not pinned (the GPU cannot reach pageable memory); "
               "allocate it with pin_memory=True");
  return memory.device_address;
}

// ---------------------------------------------------------------------------------------
// Host side: the driver, found once through the runtime.

struct Driver {
  CUresult (*wait32)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*wait64)(CUstream, CUdeviceptr, cuuint64_t, unsigned) = nullptr;
  CUresult (*write32)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*write64)(CUstream, CUdeviceptr, cuuint64_t, unsigned) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*loading_mode)(CUmoduleLoadingMode*) = nullptr;  // optional: see settle_once
  bool complete = false;
};

inline const Driver& driver() {
  static const Driver found = [] {
    const RelaxedCaptureMode relaxed;
    Driver d;
    driver::find_symbol("cuStreamWaitValue32", d.wait32, 12000);
    driver::find_symbol("cuStreamWaitValue64", d.wait64, 12000);
    driver::find_symbol("cuStreamWriteValue32", d.write32, 12000);
    driver::find_symbol("cuStreamWriteValue64", d.write64, 12000);
    driver::find_symbol("cuDeviceGet", d.device_get, 12000);
    driver::find_symbol("cuDeviceGetAttribute", d.device_attribute, 12000);
    driver::find_symbol("cuModuleGetLoadingMode", d.loading_mode, 12000);
    d.complete =
        d.wait32 && d.wait64 && d.write32 && d.write64 && d.device_get && d.device_attribute;
    return d;
  }();
  return found;
}

// What a device's front end can do, queried once per device. Host atomics are the compiler's
// builtins (gcc, clang): <atomic> would add about 0.8 s to every build of this module.
enum Capability : uint32_t {
  kQueried = 1,
  kMemoryOperations = 2,
  k64BitOperations = 4,
  kNorWait = 8,
  kFlushRemoteWrites = 16,
  kRefusedByDriver = 32,  // an operation returned CUDA_ERROR_NOT_SUPPORTED: spin from then on
};
inline constexpr int kCachedDevices = 64;
inline uint32_t device_capabilities[kCachedDevices];

inline uint32_t query_capabilities(int device) {
  const Driver& d = driver();
  if (!d.complete) return kQueried;
  const RelaxedCaptureMode relaxed;
  CUdevice handle = 0;
  driver::check(d.device_get(&handle, device), "cuDeviceGet");
  const auto has = [&](CUdevice_attribute attribute, uint32_t capability) -> uint32_t {
    int value = 0;
    driver::check(d.device_attribute(&value, attribute, handle), "cuDeviceGetAttribute");
    return value != 0 ? capability : 0;
  };
  return kQueried | kMemoryOperations |
         has(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, k64BitOperations) |
         has(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, kNorWait) |
         has(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, kFlushRemoteWrites);
}

inline uint32_t capabilities(int device) {
  if (device < 0 || device >= kCachedDevices) return query_capabilities(device);
  uint32_t known = __atomic_load_n(&device_capabilities[device], __ATOMIC_ACQUIRE);
  if (known == 0) {  // two threads may both query; they store the same answer
    known = query_capabilities(device);
    __atomic_store_n(&device_capabilities[device], known, __ATOMIC_RELEASE);
  }
  return known;
}

inline void note_refusal(int device) {
  if (device >= 0 && device < kCachedDevices) {
    __atomic_fetch_or(&device_capabilities[device], uint32_t{kRefusedByDriver}, __ATOMIC_RELAXED);
  }
}

// ---------------------------------------------------------------------------------------
// Host side: enqueueing a wait or a write.

// Work done once a process for each device (past device 63 it is done every time).
class OncePerDevice {
 public:
  bool done(int device) { return __atomic_load_n(&done_, __ATOMIC_RELAXED) & bit(device); }
  void mark(int device) { __atomic_fetch_or(&done_, bit(device), __ATOMIC_RELAXED); }

 private:
  static uint64_t bit(int device) { return device >= 0 && device < 64 ? 1ull << device : 0; }
  uint64_t done_ = 0;
};

// CUDA loads a kernel at its first launch (lazily), which may wait for the GPU to go idle, which
// a spinning wait never lets it: the first spin launch on a device loads all four kernels.
inline void load_spin_kernels_once(int device) {
  static OncePerDevice loaded;
  if (loaded.done(device)) return;
  const RelaxedCaptureMode relaxed;
  cudaFuncAttributes attributes;
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, kernel_handle<wait_kernel<int32_t>>()));
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, kernel_handle<wait_kernel<int64_t>>()));
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, kernel_handle<write_kernel<int32_t>>()));
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, kernel_handle<write_kernel<int64_t>>()));
  loaded.mark(device);
}

inline bool modules_load_eagerly() {
  static const bool eager = [] {
    const RelaxedCaptureMode relaxed;
    CUmoduleLoadingMode mode = CU_MODULE_LAZY_LOADING;
    const auto query = driver().loading_mode;
    return query != nullptr && query(&mode) == CUDA_SUCCESS && mode == CU_MODULE_EAGER_LOADING;
  }();
  return eager;
}

inline void settle_once(int device, cudaStream_t stream) {
  static OncePerDevice settled;
  if (settled.done(device) || !modules_load_eagerly() || is_capturing(stream)) return;
  LaunchKernel(1, 1, stream).launch<settle_kernel>();
  settled.mark(device);
}

// Which way a wait (compare >= 0) or a write (kWrite) of a T flag goes on `device`.
template <typename T>
Path choose_path(int device, int compare, bool spin) {
  if (spin) return kSpinRequested;
  const uint32_t can = capabilities(device);
  if (!(can & kMemoryOperations)) return kSpinNoDriverEntryPoints;
  if (can & kRefusedByDriver) return kSpinRefusedByDriver;
  if (sizeof(T) == 8 && !(can & k64BitOperations)) return kSpinNo64BitOperations;
  if (compare == kNor && !(can & kNorWait)) return kSpinNoNorWait;
  return kMemoryOperation;
}

// A wait adds the flush where the GPU offers it: it orders the writes that other devices (an
// RDMA NIC, say) put in this GPU's memory before the flag, for the work after the wait. A write
// has a system-scope memory barrier before it: a release. It cannot be narrowed to the GPU: the
// v2 API refuses CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (CUDA_ERROR_INVALID_VALUE), and a
// GPU-scope barrier operation batched before the write only adds to it (H100, driver 580).
template <typename T>
CUresult enqueue_memory_operation(cudaStream_t stream, T* flag, T value, int compare,
                                  uint32_t can) {
  const auto address = reinterpret_cast<CUdeviceptr>(flag);
  const auto bits = static_cast<std::make_unsigned_t<T>>(value);
  const unsigned wait_flags = compare | (can & kFlushRemoteWrites ? CU_STREAM_WAIT_VALUE_FLUSH : 0);
  const Driver& d = driver();
  if constexpr (sizeof(T) == 8) {
    return compare == kWrite ? d.write64(stream, address, bits, CU_STREAM_WRITE_VALUE_DEFAULT)
                             : d.wait64(stream, address, bits, wait_flags);
  } else {
    return compare == kWrite ? d.write32(stream, address, bits, CU_STREAM_WRITE_VALUE_DEFAULT)
                             : d.wait32(stream, address, bits, wait_flags);
  }
}

// Holds (compare >= 0) or writes (kWrite) `flag`, the address the GPU sees, on `stream` of
// `device`, which is current. Returns the path it took.
template <typename T>
int32_t enqueue(int device, cudaStream_t stream, T* flag, T target, int compare, bool spin) {
  Path path = choose_path<T>(device, compare, spin);
  if (path == kMemoryOperation) {
    settle_once(device, stream);
    const CUresult result =
        enqueue_memory_operation(stream, flag, target, compare, capabilities(device));
    if (result != CUDA_ERROR_NOT_SUPPORTED) {
      driver::check(result, compare >= 0 ? "cuStreamWaitValue" : "cuStreamWriteValue");
      return path;
    }
    note_refusal(device);
    path = kSpinRefusedByDriver;
  }
  load_spin_kernels_once(device);
  if (compare >= 0) {
    LaunchKernel(1, 1, stream).launch<wait_kernel<T>>(flag, target, compare);
  } else {
    LaunchKernel(1, 1, stream).launch<write_kernel<T>>(flag, target);
  }
  return path;
}

inline int checked_compare(int32_t compare, DebugInfo where = {}) {
  RuntimeCheck(where, compare >= 0 && compare <= kLastCompare,
               "op must be a comparison code from 0 to ", kLastCompare, ", got ", compare);
  return compare;
}

inline int32_t on_device_flag(const TensorView& flag, int64_t value, int compare, bool spin) {
  SymbolicDevice device;
  return with_flag<kDLCUDA>(flag, device, [&](auto* address) {
    const auto target = flag_value<std::remove_pointer_t<decltype(address)>>(value);
    const int id = device.unwrap().device_id;
    const DeviceGuard on(id);
    return enqueue(id, current_stream(device.unwrap()), address, target, compare, spin);
  });
}

// tvm-ffi records PyTorch's current stream only when a cuda tensor is an argument, so for a
// host flag the caller names the stream and its device.
inline int32_t on_host_flag(const TensorView& flag, int64_t value, int compare, int64_t device_id,
                            int64_t stream, bool spin) {
  SymbolicDevice device;
  return with_flag<kDLCPU, kDLCUDAHost>(flag, device, [&](auto* host) {
    const auto target = flag_value<std::remove_pointer_t<decltype(host)>>(value);
    auto* address = static_cast<decltype(host)>(device_address_of_host_flag(host, device.unwrap()));
    RuntimeCheck(device_id >= 0 && device_id <= std::numeric_limits<int>::max(),
                 "a host flag is waited on or written from a cuda stream, but there is no "
                 "current cuda device (got device ",
                 device_id, ")");
    const int id = static_cast<int>(device_id);
    const DeviceGuard on(id);
    return enqueue(id, reinterpret_cast<cudaStream_t>(stream), address, target, compare, spin);
  });
}

// ---------------------------------------------------------------------------------------
// Exported entry points. The flag: a 1-d int32 or int64 tensor's first element. `compare`: a
// comparison code (above); `spin` asks for the spin kernel. Each returns the Path it took.

// Holds the current stream of the flag's GPU until the flag passes the comparison with `value`.
int32_t wait_device_flag(TensorView flag, int64_t value, int32_t compare, bool spin) {
  return on_device_flag(flag, value, checked_compare(compare), spin);
}

// Sets the flag to `value` once everything before it on the current stream is done.
int32_t write_device_flag(TensorView flag, int64_t value, bool spin) {
  return on_device_flag(flag, value, kWrite, spin);
}

// The same for a flag in pinned host memory, on `stream` (a cudaStream_t) of `device_id`.
int32_t wait_host_flag(TensorView flag, int64_t value, int32_t compare, int64_t device_id,
                       int64_t stream, bool spin) {
  return on_host_flag(flag, value, checked_compare(compare), device_id, stream, spin);
}

int32_t write_host_flag(TensorView flag, int64_t value, int64_t device_id, int64_t stream,
                        bool spin) {
  return on_host_flag(flag, value, kWrite, device_id, stream, spin);
}

// Host-side access to a host flag, for a host thread on either side of a wait or a write. The
// release store publishes the thread's earlier writes also on hosts whose stores may be
// reordered (Arm), and the acquire load pairs with the GPU's release.
void set_host_flag(TensorView flag, int64_t value) {
  SymbolicDevice device;
  with_flag<kDLCPU, kDLCUDAHost>(flag, device, [&](auto* address) {
    using T = std::remove_pointer_t<decltype(address)>;
    __atomic_store_n(address, flag_value<T>(value), __ATOMIC_RELEASE);
    return 0;
  });
}

int64_t read_host_flag(TensorView flag) {
  SymbolicDevice device;
  return with_flag<kDLCPU, kDLCUDAHost>(flag, device, [&](auto* address) -> int64_t {
    return __atomic_load_n(address, __ATOMIC_ACQUIRE);
  });
}

// The Capability bits of `device` (for tests and reports): which operations its front end runs.
int64_t stream_memory_operations(int64_t device) {
  RuntimeCheck(device >= 0 && device <= std::numeric_limits<int>::max(),
               "device must be a cuda device index, got ", device);
  return capabilities(static_cast<int>(device));
}

#endif  // JITK_HOST_HALF

}  // namespace jitk::wait_value
