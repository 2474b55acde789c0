// Disjoint SM partitions of one GPU: CUDA green contexts made from one split of the device's
// SMs (cuDevSmResourceSplitByCount), a group of the SMs asked for and the rest, each with a
// stream. Contexts made one at a time (torch.cuda.green_contexts) each take their SMs from the
// whole device, so two of them may share SMs; a split's groups never do.
// Written in two halves (jitk/nvrtc.cuh): NVRTC may build its one kernel apart.
#pragma once

#include <jitk/nvrtc.cuh>

#if JITK_HOST_HALF
#include <jitk/driver.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>
#endif

namespace jitk::green {

#if JITK_HOST_HALF

struct Api {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_resource)(CUdevice, CUdevResource*, CUdevResourceType) = nullptr;
  CUresult (*split)(CUdevResource*, unsigned*, const CUdevResource*, CUdevResource*, unsigned,
                    unsigned) = nullptr;
  CUresult (*describe)(CUdevResourceDesc*, CUdevResource*, unsigned) = nullptr;
  CUresult (*create)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned) = nullptr;
  CUresult (*create_stream)(CUstream*, CUgreenCtx, unsigned, int) = nullptr;
  CUresult (*destroy)(CUgreenCtx) = nullptr;
  CUresult (*destroy_stream)(CUstream) = nullptr;
};

// Green contexts came with CUDA 12.4, their streams with 12.5; each symbol is taken as 12.8
// defined it, the version torch's green contexts ask for too.
inline constexpr int kVersion = 12080;
inline const Api& api() {
  static const Api found = [] {
    Api a;
    driver::find_symbol("cuDeviceGet", a.device_get, 12000);
    driver::find_symbol("cuDeviceGetDevResource", a.device_resource, kVersion);
    driver::find_symbol("cuDevSmResourceSplitByCount", a.split, kVersion);
    driver::find_symbol("cuDevResourceGenerateDesc", a.describe, kVersion);
    driver::find_symbol("cuGreenCtxCreate", a.create, kVersion);
    driver::find_symbol("cuGreenCtxStreamCreate", a.create_stream, kVersion);
    driver::find_symbol("cuGreenCtxDestroy", a.destroy, kVersion);
    driver::find_symbol("cuStreamDestroy", a.destroy_stream, 12000);
    return a;
  }();
  return found;
}

inline bool available() {
  const Api& a = api();
  return a.device_get && a.device_resource && a.split && a.describe && a.create &&
         a.create_stream && a.destroy && a.destroy_stream;
}

// The handles a split returns to Python, in this order in an int64 tensor on the CPU.
enum Handle : int64_t {
  kOwnStream,
  kRestStream,
  kOwnContext,
  kRestContext,
  kOwnSms,
  kRestSms,
  kHandles
};

inline int64_t* handles_of(const TensorView& handles) {
  SymbolicSize count{"handles", kHandles};
  TensorMatcher({count}).with_dtype<int64_t>().with_device<kDLCPU>().verify(handles, "handles");
  return static_cast<int64_t*>(pointer::offset(handles.data_ptr(), handles.byte_offset()));
}

// A context over `resource` and a stream on it (non-blocking: green-context streams must be).
inline void context_and_stream(const Api& a, CUdevResource resource, CUdevice device,
                               int64_t& context, int64_t& stream) {
  CUdevResourceDesc desc{};
  driver::check(a.describe(&desc, &resource, 1), "cuDevResourceGenerateDesc");
  CUgreenCtx made = nullptr;
  driver::check(a.create(&made, desc, device, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
  CUstream s = nullptr;
  const CUresult result = a.create_stream(&s, made, CU_STREAM_NON_BLOCKING, 0);
  if (result != CUDA_SUCCESS) a.destroy(made);
  driver::check(result, "cuGreenCtxStreamCreate");
  context = reinterpret_cast<int64_t>(made);
  stream = reinterpret_cast<int64_t>(s);
}

// Destroys what split() made; each handle is zeroed once destroyed, so a second call is a no-op.
inline void destroy_handles(int64_t* h) {
  if (!available()) return;
  const Api& a = api();
  for (const Handle stream : {kOwnStream, kRestStream}) {
    const auto s = reinterpret_cast<CUstream>(h[stream]);
    h[stream] = 0;
    if (s != nullptr) driver::check(a.destroy_stream(s), "cuStreamDestroy");
  }
  for (const Handle context : {kOwnContext, kRestContext}) {
    const auto c = reinterpret_cast<CUgreenCtx>(h[context]);
    h[context] = 0;
    if (c != nullptr) driver::check(a.destroy(c), "cuGreenCtxDestroy");
  }
}

inline void destroy(TensorView handles) { destroy_handles(handles_of(handles)); }

// Splits `device`'s SMs into a group of at least `sms` (the driver rounds up to its
// granularity: 8 on sm_90) and the rest; writes both contexts, streams and SM counts into
// `handles`. Refused when the rest would be empty.
inline void split(int64_t device, int64_t sms, TensorView handles) {
  int64_t* out = handles_of(handles);
  RuntimeCheck(available(),
               "this CUDA driver has no green-context streams (they need CUDA 12.5 or newer)");
  RuntimeCheck(sms >= 1, "sms must be >= 1, got ", sms);
  const Api& a = api();
  const DeviceGuard on(static_cast<int>(device));
  CUdevice handle = 0;
  driver::check(a.device_get(&handle, static_cast<int>(device)), "cuDeviceGet");
  CUdevResource whole{};
  driver::check(a.device_resource(handle, &whole, CU_DEV_RESOURCE_TYPE_SM),
                "cuDeviceGetDevResource");
  RuntimeCheck(sms < whole.sm.smCount, "sms must leave some of the device's ", whole.sm.smCount,
               " SMs to the rest, got ", sms);
  CUdevResource own{}, rest{};
  unsigned groups = 1;
  driver::check(a.split(&own, &groups, &whole, &rest, 0, static_cast<unsigned>(sms)),
                "cuDevSmResourceSplitByCount");
  RuntimeCheck(groups == 1 && rest.sm.smCount > 0, "splitting ", whole.sm.smCount,
               " SMs into a group of ", sms, " left ", rest.sm.smCount,
               " for the rest (the driver rounds a group up to its granularity)");
  try {
    context_and_stream(a, own, handle, out[kOwnContext], out[kOwnStream]);
    context_and_stream(a, rest, handle, out[kRestContext], out[kRestStream]);
  } catch (...) {
    destroy_handles(out);  // what was made before the failure
    throw;
  }
  out[kOwnSms] = own.sm.smCount;
  out[kRestSms] = rest.sm.smCount;
}

#endif  // JITK_HOST_HALF

// out[b] = the SM block b ran on; a block spins `cycles` first, so that the blocks of a launch
// larger than the partition spread over all of its SMs. For tests of a split.
__global__ void sm_ids_kernel(int32_t* out, int64_t cycles)
#if JITK_DEVICE_HALF
{
  if (threadIdx.x != 0) return;
  const int64_t until = static_cast<int64_t>(clock64()) + cycles;
  while (static_cast<int64_t>(clock64()) < until) {
  }
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  out[blockIdx.x] = static_cast<int32_t>(sm);
}
#else
    ;
#endif

#if JITK_HOST_HALF

inline void record_sm_ids(TensorView out, int64_t spin_cycles, int64_t stream) {
  RuntimeCheck(spin_cycles >= 0, "spin_cycles must be >= 0, got ", spin_cycles);
  SymbolicSize blocks{"blocks"};
  SymbolicDevice device;
  TensorMatcher({blocks}).with_dtype<int32_t>().with_device<kDLCUDA>(device).verify(out, "out");
  RuntimeCheck(blocks.unwrap() >= 1 && blocks.unwrap() <= INT32_MAX,
               "'out' holds a block's SM each: 1 to 2^31 - 1 elements, got ", blocks.unwrap());
  const DeviceGuard on(device.unwrap().device_id);
  LaunchKernel(static_cast<unsigned>(blocks.unwrap()), kWarpThreads,
               reinterpret_cast<cudaStream_t>(stream))
      .launch<sm_ids_kernel>(
          static_cast<int32_t*>(pointer::offset(out.data_ptr(), out.byte_offset())), spin_cycles);
}
#endif  // JITK_HOST_HALF

}  // namespace jitk::green
