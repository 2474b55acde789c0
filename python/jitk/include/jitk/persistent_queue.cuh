// The persistent worker's queue (see persistent.cuh): the item and queue layout the host and
// the GPU share, and the device side's loads, stores, waits and back-off with explicit order
// and scope.

#pragma once

#include <jitk/device.cuh>

#if JITK_HOST_HALF
#include <jitk/utils.cuh>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#endif

namespace jitk::persistent {

inline constexpr int kBlockThreads = 256;  // every op runs on blocks of this many threads
inline constexpr int kArgWords = 12;
inline constexpr int kItemWords = 16;
inline constexpr int64_t kNoDependency = -1;
// Tickets of the device ring carry this bit in a dependency (TableContext::push returns them so).
inline constexpr int64_t kDeviceTicket = int64_t{1} << 62;

struct alignas(128) Item {
  int64_t ticket;  // the item's ticket, written last; -1 in a slot never used
  int64_t op;      // index into the worker's op table
  int64_t after;   // the ticket this item waits for, or kNoDependency
  uint64_t args[kArgWords];
  int64_t unused;
};
static_assert(sizeof(Item) == kItemWords * 8);
#if JITK_HOST_HALF  // the layout persistent.py packs items in (layout())
static_assert(std::is_trivially_copyable_v<Item>);
static_assert(offsetof(Item, ticket) == 0 && offsetof(Item, op) == 8 &&
              offsetof(Item, after) == 16 && offsetof(Item, args) == 24);
#endif

// Words of the pinned host block (host_words): the host writes kStop, the worker the rest.
enum HostWord : int { kStop = 0, kError = 1, kErrorTicket = 2, kErrorDetail = 3, kHostWords = 8 };
enum Stop : int64_t { kRun = 0, kDrain = 1, kAbort = 2 };
// Error codes (kError); persistent.py has their messages.
enum Error : int64_t {
  kOk = 0,
  kUnknownOp = 1,          // detail: the op id
  kDependencyTimeout = 2,  // detail: the ticket waited for
  kDeviceRingFull = 3,     // detail: the device ticket that found no room
  kOpFailed = 4,           // detail: the op's own code (BlockContext::fail)
  kHostCopyTimeout = 5,    // ticket: the run's first; detail: its items (claim_host_run)
};
// Words of the GPU state block, before its arrays: claim counters and the error latch.
enum StateWord : int {
  kHostHead = 0,
  kDeviceTail = 1,
  kDeviceHead = 2,
  kErrorLatch = 3,
  kHostPoller = 4,  // 1 while an idle block holds the host ring (next_run())
};
inline constexpr int kStateHeaderWords = 16;  // keeps the arrays after it 128-byte aligned

// What the kernel is given: addresses as the GPU sees them.
struct Queue {
  const Item* host_items;  // pinned
  int64_t* host_done;      // pinned, per slot
  int64_t* host_words;     // pinned, HostWord
  int64_t* state;          // GPU: StateWord header
  int64_t* host_done_gpu;  // GPU: the host ring's completions, for dependency waits
  int64_t* device_done;    // GPU: the device ring's completions
  Item* device_items;      // GPU
  int64_t mask;            // capacity - 1 (a power of two)
  int64_t budget_ns;       // the longest any wait inside the worker may take
  int64_t idle_sleep_ns;   // the longest sleep between an idle block's looks for work
};

// Polls back off from kFirstSleepNs, doubling to a bound: an item already there costs one
// read, a new one is seen at most about the bound (plus a PCIe read) late. Dependency and
// ring waits use kMaxSleepNs; an idle block's search for work uses Queue::idle_sleep_ns,
// since each of its looks is a PCIe read that other kernels' memory traffic shares.
inline constexpr unsigned kFirstSleepNs = 32;
inline constexpr unsigned kMaxSleepNs = 256;

// ---------------------------------------------------------------------------------------
// Device side: loads and stores with explicit order and scope. (A host half built by the
// host compiler alone, jitk/nvrtc.cuh, sees only the layout above.)
#if JITK_DEVICE_HALF

// Polls are relaxed loads, acquired with a fence only once a poll sees what it waits for (a
// relaxed read, then fence.acq_rel, is an acquire pattern in PTX; a fence before a strong
// store is a release): an idle worker polls all the time, and needs the ordering only when it
// finds something.
__device__ __forceinline__ int64_t load_relaxed_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
__device__ __forceinline__ int64_t load_relaxed_gpu(const int64_t* p) {
  int64_t v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_release_gpu(int64_t* p, int64_t v) {
  asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_relaxed(int64_t* p, int64_t v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int64_t atomic_add_gpu(int64_t* p, int64_t v) {
  return static_cast<int64_t>(
      atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
}
__device__ __forceinline__ bool atomic_cas_gpu(int64_t* p, int64_t expected, int64_t desired) {
  return atomicCAS(
             reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(expected),
             static_cast<unsigned long long>(desired)) == static_cast<unsigned long long>(expected);
}
// Copies of items' words from the host ring into shared memory by the TMA unit
// (cp.async.bulk): one request per contiguous range, all of a run's words in one PCIe round
// trip, the unit splitting them into large reads. 16-byte copies from every lane (1,440 for a
// run of 180) took longer. Completion is signalled on an mbarrier in shared memory; warp 0,
// the only user, waits on its phases in turn.
struct BulkArrival {
  uint32_t barrier;  // shared-memory address of the mbarrier
  uint32_t phase = 0;

  // Lane 0, once, before any copy.
  __device__ void init() const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(barrier) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the TMA unit sees it
  }
  // Lane 0: the next phase completes once `bytes` have landed.
  __device__ void expect(uint32_t bytes) const {
    uint64_t state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                 : "=l"(state)
                 : "r"(barrier), "r"(bytes)
                 : "memory");
  }
  // Lane 0: `bytes` (a multiple of 16, both ends 16-byte aligned) from `from` to `to`.
  __device__ void copy(void* to, const void* from, uint32_t bytes) const {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(static_cast<uint32_t>(__cvta_generic_to_shared(to))),
        "l"(from), "r"(bytes), "r"(barrier)
        : "memory");
  }
  // One look: whether the current phase has completed. try_wait may hold the thread for a
  // while (a limit the hardware sets) before it answers no.
  __device__ bool try_wait() const {
    uint32_t done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(barrier), "r"(phase)
        : "memory");
    return done != 0;
  }
  // Every lane: true once the current phase has completed (its copies are visible), false if
  // it has not within budget_ns; the phase is then still pending, and a copy may yet land. The
  // clock is read only once the first look finds the phase incomplete.
  __device__ bool wait(int64_t budget_ns) {
    if (!try_wait()) {
      const int64_t deadline = device::now_ns() + budget_ns;
      while (!try_wait()) {
        if (device::now_ns() > deadline) return false;
      }
    }
    phase ^= 1;
    return true;
  }
};

using device::now_ns;

struct Backoff {
  unsigned ns = kFirstSleepNs;
  unsigned bound = kMaxSleepNs;
  __device__ void sleep() {
    device::pause_ns(ns);
    ns = min(2 * ns, bound);
  }
};

// The first error wins the latch; its code is stored last, with release, so a host that sees
// it also sees its ticket and detail.
__device__ __forceinline__ void record_error(const Queue& q, int64_t code, int64_t ticket,
                                             int64_t detail) {
  if (!atomic_cas_gpu(&q.state[kErrorLatch], 0, 1)) return;
  q.host_words[kErrorTicket] = ticket;
  q.host_words[kErrorDetail] = detail;
  store_release_sys(&q.host_words[kError], code);
}

// The host's stop order, acquired once it is other than kRun (a drain must see the items
// pushed before it).
__device__ __forceinline__ int64_t stop_word(const Queue& q) {
  const int64_t stop = load_relaxed_sys(&q.host_words[kStop]);
  if (stop != kRun) fence_acq_rel_sys();
  return stop;
}

// Whether `ticket` (host, or device with kDeviceTicket) is done, waiting at most the budget.
// A dependency never pushed, or stuck behind this very block, times out instead of hanging.
__device__ inline bool wait_for(const Queue& q, int64_t ticket) {
  const bool device = (ticket & kDeviceTicket) != 0;
  const int64_t t = ticket & ~kDeviceTicket;
  const int64_t* done = (device ? q.device_done : q.host_done_gpu) + (t & q.mask);
  const int64_t deadline = now_ns() + q.budget_ns;
  Backoff backoff;
  for (unsigned polls = 0; load_relaxed_gpu(done) < t; ++polls) {
    // The stop word is a PCIe read, kept off most polls as in next_run().
    if (now_ns() > deadline || (polls % 16 == 15 && stop_word(q) == kAbort)) return false;
    backoff.sleep();
  }
  fence_acq_rel_gpu();  // an acquire, with the read that saw the ticket done
  return true;
}

#endif  // JITK_DEVICE_HALF

}  // namespace jitk::persistent
