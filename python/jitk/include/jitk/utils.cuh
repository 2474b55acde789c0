// CUDA-side foundations: error checks that name the caller's line, the host-side guards and
// queries every kernel shares (the current device, relaxed capture, pinned host memory), and
// LaunchKernel, which launches on the stream PyTorch was using when the call was made.
// A device half compiled by NVRTC (jitk/nvrtc.cuh) reads only the warp size and the dtype
// names.
#pragma once

#include <jitk/utils.h>

#if JITK_HOST_HALF
#include <jitk/tensor.h>

#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstddef>
#include <utility>
#else
struct __half;
struct __nv_bfloat16;
#endif

namespace jitk {

inline constexpr int kWarpThreads = 32;

// The names make_cpp_args gives dtypes. Only declared here (jitk/tensor.h): a kernel that
// computes on fp16_t or bf16_t includes <cuda_fp16.h> or <cuda_bf16.h> itself.
using fp16_t = __half;
using bf16_t = __nv_bfloat16;
using fp32_t = float;

// An element's bytes: sizeof(T), which a host half built without nvcc (jitk/nvrtc.cuh) cannot
// take of fp16_t and bf16_t, left incomplete there rather than pay for their headers.
template <typename T>
inline constexpr int kElemBytes = static_cast<int>(sizeof(T));
template <>
inline constexpr int kElemBytes<fp16_t> = 2;
template <>
inline constexpr int kElemBytes<bf16_t> = 2;

#if JITK_HOST_HALF

inline void RuntimeDeviceCheck(cudaError_t error, DebugInfo where = {}) {
  if (error != cudaSuccess) [[unlikely]] {
    detail::raise("RuntimeError",
                  detail::concat("CUDA error at ", where, ": ", cudaGetErrorName(error), " (",
                                 cudaGetErrorString(error), ")"));
  }
}
// Checks (and clears) the last error of the calling thread.
inline void RuntimeDeviceCheck(DebugInfo where = {}) {
  RuntimeDeviceCheck(cudaGetLastError(), where);
}

// The stream the Python caller's framework is using on `device`. tvm-ffi records it for
// each call from PyTorch's current stream, so this is also the stream a CUDA graph
// capture is recording.
inline cudaStream_t current_stream(DLDevice device, DebugInfo where = {}) {
  RuntimeCheck(where, device.device_type == kDLCUDA, "kernels launch on a cuda device, got ",
               device);
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device.device_id));
}

// Makes `device` current for its scope and gives the caller its own device back afterwards;
// a negative `device` leaves the current one alone. A failure to switch names `where`.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device, DebugInfo where = {}) {
    if (device < 0) return;
    int current = 0;
    RuntimeDeviceCheck(cudaGetDevice(&current), where);
    if (current == device) return;
    RuntimeDeviceCheck(cudaSetDevice(device), where);
    previous_ = current;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // the device to restore, or -1 when nothing changed
};

// For its scope, this thread captures in relaxed mode. Queries that are no stream work
// (pointer attributes, driver entry points, device attributes) may still be refused by a
// capture in global mode (PyTorch's default), which then ends; relaxed mode allows them.
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

// Whether `stream` is being captured into a CUDA graph.
inline bool is_capturing(cudaStream_t stream, DebugInfo where = {}) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  RuntimeDeviceCheck(cudaStreamIsCapturing(stream, &status), where);
  return status != cudaStreamCaptureStatusNone;
}

// What CUDA knows of the host memory at `ptr`, asked in a way that is safe while a graph is
// being captured. The GPU may touch host memory only if it is pinned (cudaHostAlloc, torch's
// pin_memory, cudaHostRegister) or managed, and then through `device_address`. Each kernel
// decides what it accepts and says why in its own words.
struct HostMemory {
  cudaError_t error = cudaSuccess;  // else the query failed (error cleared), the rest unset
  bool pinned = false;
  bool managed = false;
  void* device_address = nullptr;  // where the GPU sees `ptr`; null where it cannot
};

inline HostMemory query_host_memory(const void* ptr) {
  cudaPointerAttributes attributes{};
  HostMemory memory;
  {
    const RelaxedCaptureMode relaxed;
    memory.error = cudaPointerGetAttributes(&attributes, ptr);
  }
  if (memory.error != cudaSuccess) {
    cudaGetLastError();  // the query's failure must not be blamed on a later launch
    return memory;
  }
  memory.pinned = attributes.type == cudaMemoryTypeHost;
  memory.managed = attributes.type == cudaMemoryTypeManaged;
  memory.device_address = attributes.devicePointer;
  return memory;
}

// Whether every architecture this module is built for has programmatic dependent launch
// (sm_90+). A module runs only on GPUs it holds code for, so then enable_pdl(kPdlOnAllTargets)
// is always accepted.
inline constexpr bool kPdlOnAllTargets = [] {
#ifdef __CUDA_ARCH_LIST__
  for (const int arch : {__CUDA_ARCH_LIST__}) {
    if (arch < 900) return false;
  }
  return true;
#else
  return false;
#endif
}();

// LaunchKernel(grid, block, device)(kernel, args...);
// LaunchKernel(grid, block, stream, dynamic_smem_bytes).enable_pdl()(kernel, args...);
// A failed launch raises an error that names the line that built the launch.
#ifndef __CUDACC__
// A kernel NVRTC built for this module, found by name (defined in jitk/nvrtc.cuh): what
// LaunchKernel::launch runs in a host half that the host compiler built alone.
template <auto kKernel>
cudaKernel_t nvrtc_kernel(DebugInfo where);
#endif

class LaunchKernel {
 public:
  LaunchKernel(dim3 grid, dim3 block, DLDevice device, std::size_t dynamic_smem = 0,
               DebugInfo where = {})
      : LaunchKernel(grid, block, current_stream(device, where), dynamic_smem, where) {
    device_id_ = device.device_id;
  }

  LaunchKernel(dim3 grid, dim3 block, cudaStream_t stream, std::size_t dynamic_smem = 0,
               DebugInfo where = {})
      : where_(where) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = dynamic_smem;
    config_.stream = stream;
    config_.attrs = attributes_;
    config_.numAttrs = 0;
  }

  LaunchKernel(const LaunchKernel&) = delete;
  LaunchKernel& operator=(const LaunchKernel&) = delete;

  // Programmatic dependent launch (sm_90+): the kernel may start while the previous one on
  // the stream finishes; it must call device::pdl_wait() before reading that one's output.
  LaunchKernel& enable_pdl(bool enable = true) {
    if (enable) {
      attributes_[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attributes_[0].val.programmaticStreamSerializationAllowed = 1;
      config_.numAttrs = 1;
    } else {
      config_.numAttrs = 0;
    }
    return *this;
  }

  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), Args&&... args) const {
    cudaError_t error;
    {
      // Launches must happen with the tensors' device current (-1: launched on a stream).
      const DeviceGuard on(device_id_, where_);
      error = cudaLaunchKernelEx(&config_, kernel, std::forward<Args>(args)...);
    }
    RuntimeDeviceCheck(error, where_);
  }

  // Launches kKernel with `args` converted to its parameters: (*this)(kKernel, args...) under
  // nvcc; in a kernel file's host half built by the host compiler alone (jitk/nvrtc.cuh,
  // load_jit(..., cuda_compiler="nvrtc")), the kernel NVRTC built, found by its name.
  template <auto kKernel, typename... Args>
  void launch(Args&&... args) const {
#ifdef __CUDACC__
    (*this)(kKernel, std::forward<Args>(args)...);
#else
    by_name<kKernel>(kKernel, std::forward<Args>(args)...);
#endif
  }

 private:
#ifndef __CUDACC__
  template <auto kKernel, typename... Params, typename... Args>
  void by_name(void (*)(Params...), Args&&... args) const {
    with_params<kKernel, Params...>(std::forward<Args>(args)...);
  }
  template <auto kKernel, typename... Params>
  void with_params(Params... values) const {
    void* params[sizeof...(Params) + 1] = {static_cast<void*>(&values)...};
    cudaError_t error;
    {
      const DeviceGuard on(device_id_, where_);
      const cudaKernel_t kernel = nvrtc_kernel<kKernel>(where_);  // loaded at the first launch
      error = cudaLaunchKernelExC(&config_, reinterpret_cast<const void*>(kernel), params);
    }
    RuntimeDeviceCheck(error, where_);
  }
#endif

  DebugInfo where_;
  cudaLaunchAttribute attributes_[1]{};
  cudaLaunchConfig_t config_{};
  int device_id_ = -1;
};

// What the runtime's kernel calls (cudaFuncGetAttributes, cudaFuncSetAttribute) take for
// kKernel: the kernel itself under nvcc, the kernel NVRTC built (loaded on first use) in a
// host half the host compiler built alone.
template <auto kKernel>
const void* kernel_handle(DebugInfo where = {}) {
#ifdef __CUDACC__
  (void)where;
  return reinterpret_cast<const void*>(kKernel);
#else
  return reinterpret_cast<const void*>(nvrtc_kernel<kKernel>(where));
#endif
}

#endif  // JITK_HOST_HALF

}  // namespace jitk
