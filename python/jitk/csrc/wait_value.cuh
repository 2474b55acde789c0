// Stream-ordered flags. wait: a one-thread kernel that holds its stream until a 32-bit flag
// equals a value, reading it with acquire semantics. write: a one-thread kernel that sets the
// flag with release semantics. Both work at system scope, so the flag may live in GPU memory
// or in pinned host memory, and the other side may be another stream, another GPU or a host
// thread. Everything written before a release is visible to work that follows the wait.
#pragma once

#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace jitk::wait_value {

// The waiter sleeps between polls, doubling from the first length to the cap: a flag that is
// already set costs one load, and a release is noticed at most about the cap late while a
// long wait costs one load per cap (a PCIe read each, for a host flag).
inline constexpr unsigned kFirstSleepNs = 32;
inline constexpr unsigned kMaxSleepNs = 512;

// volatile would only stop the compiler caching the flag; the acquire also orders every later
// read of this thread (and of the kernels after it on the stream) after the flag's value.
__device__ __forceinline__ int32_t load_acquire_system(const int32_t* flag) {
  int32_t value;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// Publishes everything that happened before it on the stream before the flag changes.
__device__ __forceinline__ void store_release_system(int32_t* flag, int32_t value) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__global__ void wait_kernel(const int32_t* flag, int32_t value) {
  unsigned sleep_ns = kFirstSleepNs;
  while (load_acquire_system(flag) != value) {
    __nanosleep(sleep_ns);
    sleep_ns = min(2 * sleep_ns, kMaxSleepNs);
  }
}

__global__ void write_kernel(int32_t* flag, int32_t value) { store_release_system(flag, value); }

// ---------------------------------------------------------------------------------------
// Host side.

inline int32_t flag_value(int64_t value) {
  RuntimeCheck(value >= std::numeric_limits<int32_t>::min() &&
                   value <= std::numeric_limits<int32_t>::max(),
               "value must fit in the int32 flag, got ", value);
  return static_cast<int32_t>(value);
}

// Checks that `flag` is a 1-d int32 tensor of at least one element on one of kDevices and
// returns the address of its first element, the one the kernels use.
template <DLDeviceType... kDevices>
int32_t* first_element(const TensorView& flag, SymbolicDevice& device) {
  SymbolicSize length{"flag length"};
  TensorMatcher({length})
      .with_strides({-1})  // only the first element is read
      .with_dtype<int32_t>()
      .with_device<kDevices...>(device)
      .verify(flag, "flag");
  RuntimeCheck(length.unwrap() >= 1,
               "'flag' must hold at least one int32 (the first is the flag), got an empty tensor");
  auto* address = static_cast<int32_t*>(pointer::offset(flag.data_ptr(), flag.byte_offset()));
  // A misaligned access would kill the CUDA context, not raise.
  RuntimeCheck(reinterpret_cast<std::uintptr_t>(address) % alignof(int32_t) == 0,
               "'flag' must be 4-byte aligned, got address ", static_cast<void*>(address));
  return address;
}

// The attribute queries below are no stream work, but a stream capture in global mode
// (PyTorch's default) may refuse them and be ended by them. For its scope this thread captures
// in relaxed mode, which permits them.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() : changed_(cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess) {}
  ~RelaxedCaptureMode() {
    if (changed_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool changed_;
};

// A kernel may only touch host memory that is pinned (page-locked and mapped into the GPU's
// address space); pageable memory faults. Returns the address the GPU sees.
inline int32_t* device_address_of_host_flag(int32_t* host, DLDevice device) {
  cudaPointerAttributes attributes{};
  const cudaError_t error = [&] {
    const RelaxedCaptureMode relaxed;
    return cudaPointerGetAttributes(&attributes, host);
  }();
  if (error != cudaSuccess) {
    cudaGetLastError();  // the query's failure must not be blamed on a later launch
    Panic("flag must be a cuda tensor or pinned host memory, got ", device,
          " memory, and CUDA could not tell whether it is pinned (", cudaGetErrorName(error),
          ": ", cudaGetErrorString(error), ")");
  }
  RuntimeCheck(attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr,
               "flag must be a cuda tensor or pinned host memory, got ", device,
               " memory that is not pinned (a kernel reading pageable memory faults); "
               "allocate it with pin_memory=True");
  return static_cast<int32_t*>(attributes.devicePointer);
}

// Makes `device` current for a launch and gives the caller its own device back afterwards.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) : device_(device) {
    RuntimeDeviceCheck(cudaGetDevice(&previous_));
    if (previous_ != device_) RuntimeDeviceCheck(cudaSetDevice(device_));
  }
  ~ScopedDevice() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// CUDA loads a kernel at its first launch on a device (lazy loading, PyTorch's default), and
// loading may wait for the device to go idle: the first write, launched while a wait spins,
// would never start. So the first launch on a device loads both kernels there.
//
// Atomics on the host are the compiler's builtins (gcc and clang, nvcc's host compilers):
// <atomic> would add about 0.8 s to every build of this module, for three operations.
inline void load_kernels_once(int device) {
  static uint64_t loaded_devices = 0;  // bit d: loaded on device d
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (__atomic_load_n(&loaded_devices, __ATOMIC_RELAXED) & bit) return;
  const ScopedDevice on(device);
  const RelaxedCaptureMode relaxed;
  cudaFuncAttributes attributes;
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, wait_kernel));
  RuntimeDeviceCheck(cudaFuncGetAttributes(&attributes, write_kernel));
  __atomic_fetch_or(&loaded_devices, bit, __ATOMIC_RELAXED);
}

template <typename Flag>
void launch_on_device_flag(void (*kernel)(Flag*, int32_t), const TensorView& flag,
                           int64_t value) {
  const int32_t target = flag_value(value);
  SymbolicDevice device;
  int32_t* address = first_element<kDLCUDA>(flag, device);
  load_kernels_once(device.unwrap().device_id);
  LaunchKernel(1, 1, device.unwrap())(kernel, address, target);
}

// tvm-ffi records PyTorch's current stream only when a cuda tensor is an argument, so for a
// host flag the caller names the stream and its device.
template <typename Flag>
void launch_on_host_flag(void (*kernel)(Flag*, int32_t), const TensorView& flag,
                         int64_t value, int64_t device_id, int64_t stream) {
  const int32_t target = flag_value(value);
  SymbolicDevice device;
  int32_t* host = first_element<kDLCPU, kDLCUDAHost>(flag, device);
  int32_t* address = device_address_of_host_flag(host, device.unwrap());
  RuntimeCheck(device_id >= 0 && device_id <= std::numeric_limits<int>::max(),
               "a host flag is waited on or written from a cuda stream, but there is no "
               "current cuda device (got device ", device_id, ")");
  const ScopedDevice on(static_cast<int>(device_id));
  load_kernels_once(static_cast<int>(device_id));
  LaunchKernel(1, 1, reinterpret_cast<cudaStream_t>(stream))(kernel, address, target);
}

// Exported entry points. The flag is a 1-d int32 tensor; its first element is the flag.

// Holds the current stream of the flag's GPU until the flag equals `value`.
void wait_device_flag(TensorView flag, int64_t value) {
  launch_on_device_flag(wait_kernel, flag, value);
}

// Sets the flag to `value` once everything before it on the current stream is done.
void write_device_flag(TensorView flag, int64_t value) {
  launch_on_device_flag(write_kernel, flag, value);
}

// The same for a flag in pinned host memory, on `stream` (a cudaStream_t) of `device_id`.
void wait_host_flag(TensorView flag, int64_t value, int64_t device_id, int64_t stream) {
  launch_on_host_flag(wait_kernel, flag, value, device_id, stream);
}

void write_host_flag(TensorView flag, int64_t value, int64_t device_id, int64_t stream) {
  launch_on_host_flag(write_kernel, flag, value, device_id, stream);
}

// Host-side access to a host flag, for a host thread on either side of a wait or a write. The
// release store publishes the thread's earlier writes also on hosts whose stores may be
// reordered (Arm), and the acquire load pairs with the GPU's release.
void set_host_flag(TensorView flag, int64_t value) {
  const int32_t target = flag_value(value);
  SymbolicDevice device;
  __atomic_store_n(first_element<kDLCPU, kDLCUDAHost>(flag, device), target, __ATOMIC_RELEASE);
}

int64_t read_host_flag(TensorView flag) {
  SymbolicDevice device;
  return __atomic_load_n(first_element<kDLCPU, kDLCUDAHost>(flag, device), __ATOMIC_ACQUIRE);
}

}  // namespace jitk::wait_value
