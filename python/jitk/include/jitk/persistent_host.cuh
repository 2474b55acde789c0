// The persistent worker's host side (see persistent.cuh): publishing items, polling completions
// and launching the worker.

#pragma once

#include <jitk/persistent_worker.cuh>

#if JITK_HOST_HALF
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <ctime>

namespace jitk::persistent {

// ---------------------------------------------------------------------------------------
// Host side.

template <typename T>
T* device_address(const TensorView& t, const char* name, bool pinned) {
  void* p = pointer::offset(t.data_ptr(), t.byte_offset());
  if (!pinned) {
    RuntimeCheck(t.device().device_type == kDLCUDA, "'", name, "' must be a cuda tensor, got ",
                 t.device());
    return static_cast<T*>(p);
  }
  const HostMemory memory = query_host_memory(p);
  RuntimeCheck(memory.error == cudaSuccess && memory.pinned && memory.device_address != nullptr,
               "'", name, "' must be in pinned host memory (pin_memory=True), got ", t.device(),
               " memory that is not");
  return static_cast<T*>(memory.device_address);
}

inline int64_t* host_words_of(const TensorView& words, int64_t at_least, const char* name) {
  RuntimeCheck(words.dtype() == dtype_v<int64_t> && words.ndim() == 1 &&
                   words.size(0) >= at_least && words.stride(0) == 1,
               "'", name, "' must be a contiguous 1-d int64 tensor of at least ", at_least,
               " elements");
  return static_cast<int64_t*>(pointer::offset(words.data_ptr(), words.byte_offset()));
}

// The layout the Python side packs items in: (slot bytes, ticket, op, after, args offsets,
// argument bytes, threads per block).
inline int64_t layout(int64_t field) {
  const int64_t values[] = {sizeof(Item),          offsetof(Item, ticket), offsetof(Item, op),
                            offsetof(Item, after), offsetof(Item, args),   sizeof(Item::args),
                            kBlockThreads};
  constexpr int64_t kFields = sizeof(values) / sizeof(values[0]);
  RuntimeCheck(field >= 0 && field < kFields, "layout field must be 0 to ", kFields - 1, ", got ",
               field);
  return values[field];
}

// The host ring, its counters and a batch's words are persistent.py's own tensors; the calls
// on every push and poll take their addresses (ints) rather than the tensors, which cost a
// DLPack conversion each (about a microsecond on an H100's host).
template <typename T>
T* host_address(int64_t address, const char* name) {
  RuntimeCheck(address != 0 && address % alignof(T) == 0, "'", name,
               "' must be a non-null, aligned host address, got ", address);
  return reinterpret_cast<T*>(address);
}

// Copies n items (int64 [n * kItemWords] at host address `items`, relative dependencies:
// after >= 0 is an index into the batch, -1 none) into the host ring (capacity slots at `ring`,
// completion counters at `done`) as tickets first.. first+n-1, item 0 after `first_after`.
// Returns 0 and writes nothing while any of the n slots still holds an unfinished item; 1 once
// published. One release fence covers every item's words; the tickets are then stored in order.
// Addresses, not tensors: a tensor argument costs a DLPack conversion on every push.
inline int64_t publish(int64_t ring, int64_t done, int64_t capacity, int64_t items, int64_t n,
                       int64_t first, int64_t first_after) {
  auto* slots = host_address<Item>(ring, "ring");
  const int64_t* completed = host_address<const int64_t>(done, "done");
  const auto* words = host_address<const int64_t>(items, "items");
  RuntimeCheck(capacity >= 1 && n >= 1 && n <= capacity, "a batch of ", n,
               " items does not fit a ring of ", capacity);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = first + i;
    if (__atomic_load_n(&completed[t % capacity], __ATOMIC_ACQUIRE) < t - capacity) return 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    Item& slot = slots[(first + i) % capacity];
    const int64_t* src = words + i * kItemWords;  // 8-byte aligned only: read as words
    const int64_t after = src[offsetof(Item, after) / 8];
    slot.op = src[offsetof(Item, op) / 8];
    slot.after = after >= 0 ? first + after : (i == 0 ? first_after : kNoDependency);
    std::memcpy(slot.args, src + offsetof(Item, args) / 8, sizeof(slot.args));
  }
  __atomic_thread_fence(__ATOMIC_RELEASE);
  for (int64_t i = 0; i < n; ++i) {
    __atomic_store_n(&slots[(first + i) % capacity].ticket, first + i, __ATOMIC_RELAXED);
  }
  return 1;
}

// An acquire load of the int64 at a host address (a completion counter, the error word).
inline int64_t load_word(int64_t address) {
  return __atomic_load_n(host_address<const int64_t>(address, "address"), __ATOMIC_ACQUIRE);
}

// Spins at most spin_ns on item `ticket`'s completion counter (host address `counter`):
// 1 once the counter reaches the ticket and the error word (host address `error`) is clear, -1
// once the error word is set, 0 when spin_ns passed first. Acquire loads, so what the item
// wrote is visible once it returns 1.
// Nanoseconds on the monotonic clock, as std::chrono::steady_clock reads it on Linux
// (<chrono> costs the host compiler more to read than the rest of this header).
inline int64_t monotonic_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

inline int64_t poll_done(int64_t counter, int64_t ticket, int64_t error, int64_t spin_ns) {
  const int64_t* done = host_address<const int64_t>(counter, "counter");
  const int64_t* failed = host_address<const int64_t>(error, "error");
  RuntimeCheck(spin_ns >= 0 && spin_ns <= 1'000'000'000, "spin_ns must be 0 to 1e9, got ", spin_ns);
  const int64_t deadline = monotonic_ns() + spin_ns;
  for (unsigned looks = 0;; ++looks) {
    if (__atomic_load_n(failed, __ATOMIC_ACQUIRE) != 0) return -1;
    if (__atomic_load_n(done, __ATOMIC_ACQUIRE) >= ticket) return 1;
    if (looks % 16 == 15 && monotonic_ns() > deadline) return 0;
  }
}

inline void store_word(TensorView words, int64_t index, int64_t value) {
  int64_t* w = host_words_of(words, index + 1, "words");
  RuntimeCheck(index >= 0, "index must be >= 0, got ", index);
  __atomic_store_n(&w[index], value, __ATOMIC_RELEASE);
}

// The stream a worker started without one runs on: made here, not taken from torch's pool,
// which hands its streams out in turn, so no other code can be given it and queue work behind
// a kernel that does not end. Non-blocking: the legacy default stream does not wait for it.
inline int64_t create_stream(int64_t device) {
  RuntimeCheck(device >= 0, "device must be >= 0, got ", device);
  const DeviceGuard on(static_cast<int>(device));
  cudaStream_t stream = nullptr;
  RuntimeDeviceCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return reinterpret_cast<int64_t>(stream);
}

// Destroys a stream create_stream made; persistent.py calls it once the worker's kernel ended.
inline void destroy_stream(int64_t stream) {
  RuntimeCheck(stream != 0, "stream must be one create_stream made, got 0");
  RuntimeDeviceCheck(cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream)));
}

// A worker over the op table Ops...: its exports for persistent.py.
template <typename... Ops>
struct Worker {
  static_assert(sizeof...(Ops) >= 1, "a worker needs at least one op");
  static_assert(((sizeof(typename Ops::Args) <= sizeof(Item::args)) && ...),
                "an op's Args must fit the item's 96 argument bytes");
  static_assert(((alignof(typename Ops::Args) <= 8) && ...),
                "an op's Args may need at most 8-byte alignment");
  static_assert((std::is_trivially_copyable_v<typename Ops::Args> && ...),
                "an op's Args must be trivially copyable (pointers, integers, doubles)");

  static int64_t arg_bytes(int64_t op) {
    const int64_t sizes[] = {sizeof(typename Ops::Args)...};
    RuntimeCheck(op >= 0 && op < static_cast<int64_t>(sizeof...(Ops)), "op must be 0 to ",
                 sizeof...(Ops) - 1, ", got ", op);
    return sizes[op];
  }

  // How many worker blocks `device` can hold at once (with nothing else running), loading the
  // kernel on the way: it must be loaded before anything waits on it.
  static int64_t max_blocks(int64_t device) {
    const DeviceGuard on(static_cast<int>(device));
    int per_sm = 0, sms = 0;
    RuntimeDeviceCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, kernel_handle<worker_kernel<Ops...>>(), kBlockThreads, 0));
    RuntimeDeviceCheck(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device)));
    return static_cast<int64_t>(per_sm) * sms;
  }

  static void launch(TensorView ring, TensorView done, TensorView host_words, TensorView state,
                     int64_t blocks, int64_t budget_ns, int64_t idle_sleep_ns, int64_t stream) {
    const int64_t capacity = ring.numel() / kItemWords;
    RuntimeCheck(capacity >= 16 && (capacity & (capacity - 1)) == 0,
                 "the ring's capacity must be a power of two >= 16, got ", capacity);
    RuntimeCheck(state.dtype() == dtype_v<int64_t> && state.ndim() == 1 && state.stride(0) == 1 &&
                     state.numel() == kStateHeaderWords + (2 + kItemWords) * capacity,
                 "'state' must be a contiguous int64 tensor of ",
                 kStateHeaderWords + (2 + kItemWords) * capacity, " elements");
    RuntimeCheck(idle_sleep_ns >= kFirstSleepNs && idle_sleep_ns <= 1'000'000,
                 "idle_sleep_ns must be ", kFirstSleepNs, " to 1000000, got ", idle_sleep_ns);
    RuntimeCheck(blocks >= 1 && blocks <= max_blocks(state.device().device_id),
                 "blocks must be 1 to ", max_blocks(state.device().device_id), ", got ", blocks);
    host_words_of(done, capacity, "done");
    host_words_of(host_words, kHostWords, "host_words");
    int64_t* gpu = device_address<int64_t>(state, "state", false);
    const Queue q{device_address<const Item>(ring, "ring", true),
                  device_address<int64_t>(done, "done", true),
                  device_address<int64_t>(host_words, "host_words", true),
                  gpu,
                  gpu + kStateHeaderWords,
                  gpu + kStateHeaderWords + capacity,
                  reinterpret_cast<Item*>(gpu + kStateHeaderWords + 2 * capacity),
                  capacity - 1,
                  budget_ns,
                  idle_sleep_ns};
    const DeviceGuard on(state.device().device_id);
    LaunchKernel(static_cast<unsigned>(blocks), kBlockThreads,
                 reinterpret_cast<cudaStream_t>(stream))
        .template launch<worker_kernel<Ops...>>(q);
  }
};

}  // namespace jitk::persistent
#endif  // JITK_HOST_HALF
