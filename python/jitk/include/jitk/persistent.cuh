// A persistent worker: thread blocks launched once that take work items from a queue until told
// to stop, and run each through a compile-time table of the user's ops.
//
//   struct Scale {                       // one op: an argument block and a block-wide run()
//     struct Args { const bf16_t* x; bf16_t* y; int64_t n; double factor; };
//     static __device__ void run(const Args& a, jitk::persistent::BlockContext& ctx);
//   };
//   using Table = jitk::persistent::Worker<Scale, Add>;   // op id = position in the list
//
// Two rings of fixed-size items (Item, 128 bytes: ticket, op id, dependency, 12 argument words):
// - the host ring, in pinned host memory: host threads write items, numbered by host tickets;
// - the device ring, in GPU memory: ops push follow-up work (TableContext::push).
// Each item's completion is a per-slot counter that holds the last ticket done in that slot, so
// "item t is done" reads done[t % capacity] >= t. The host ring's counters exist twice: in pinned
// memory for the host and jitk.stream_wait_value, in GPU memory for other blocks' dependency
// waits (polling GPU memory costs an L2 read, host memory a PCIe round trip).
//
// Memory model (PTX ISA, "Memory Consistency Model"). Every hand-off is a release store paired
// with an acquire load of the same word, at the narrowest scope that holds both sides:
// - host producer -> worker: the host writes an item's words, then its ticket word with release
//   (publish()); the worker's warp 0 reads tickets (relaxed), fences (fence.acq_rel.sys: an
//   acquire with those reads), then has the TMA unit copy the words (the async proxy, ordered
//   after the acquire by fence.proxy.async). sys, because the writer is a CPU thread. No
//   volatile or __ldg: the read-only path may keep a stale line forever, and volatile alone orders
//   nothing.
// - worker -> worker (dependencies, device ring): st.release.gpu, and a relaxed read then a
//   fence.acq_rel.gpu (an acquire), on GPU memory.
// - worker -> other blocks, later work on this GPU, and the host (completion): the block's
//   threads meet at __syncthreads() after the last item of a run, then threads run
//   fence.acq_rel.gpu and store the run's tickets (releases at GPU scope; see complete_run()).
//   PTX release is cumulative: the writes the barrier ordered before those threads (every
//   thread's part of every op's output) are published with them. Other blocks read the counter
//   relaxed and fence once it shows the ticket (an acquire), the host with an acquire load; what
//   the host then does through CUDA (a copy, a kernel, a stream waiting on the counter) reads the
//   GPU's memory after it.
// - claims (ticket counters in GPU memory) are relaxed atomics: they order nothing; the slot's
//   ticket word, acquired as above, says whether the item is there.
//
// Nothing waits without bound: a dependency or a full device ring is waited for at most
// Queue::budget_ns (then the item fails with an error code the host reads), so is the TMA copy
// of a run's items from the host ring (then the block stops: claim_host_run()), and an idle
// block waits for work only until the host's stop word says drain or abort.
#pragma once

#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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
static_assert(sizeof(Item) == kItemWords * 8 && std::is_trivially_copyable_v<Item>);
static_assert(offsetof(Item, ticket) == 0 && offsetof(Item, op) == 8 &&
              offsetof(Item, after) == 16 && offsetof(Item, args) == 24);

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

// ---------------------------------------------------------------------------------------
// Device side: loads and stores with explicit order and scope.

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

// Polls back off from kFirstSleepNs, doubling to a bound: an item already there costs one
// read, a new one is seen at most about the bound (plus a PCIe read) late. Dependency and
// ring waits use kMaxSleepNs; an idle block's search for work uses Queue::idle_sleep_ns,
// since each of its looks is a PCIe read that other kernels' memory traffic shares.
inline constexpr unsigned kFirstSleepNs = 32;
inline constexpr unsigned kMaxSleepNs = 256;
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

// ---------------------------------------------------------------------------------------
// What an op's run() is given.

class BlockContext {
 public:
  __device__ BlockContext(const Queue& q, int64_t ticket) : q_(q), ticket_(ticket) {}
  // This item's ticket (device-ring items carry kDeviceTicket).
  __device__ int64_t ticket() const { return ticket_; }
  // Marks the item failed with the op's own code; the host's wait() raises it. Any thread.
  __device__ void fail(int64_t code) const { record_error(q_, kOpFailed, ticket_, code); }

 protected:
  const Queue& q_;
  int64_t ticket_;
};

template <typename Op, typename... Ops>
inline constexpr int kIndexOf = [] {
  int i = 0, found = -1;
  ((std::is_same_v<Op, Ops> ? (found = i, ++i) : ++i), ...);
  return found;
}();

// The context an op sees when it takes `auto& ctx` (or TableContext<...>&): it can also push.
template <typename... Ops>
class TableContext : public BlockContext {
 public:
  using BlockContext::BlockContext;

  // Enqueues Op(args) on the device ring, to run after `after` (a ticket, or kNoDependency),
  // and returns its ticket. One thread calls it, after a __syncthreads() if the new item reads
  // what the block wrote: the release below publishes what that thread has seen. A full ring is
  // waited on for at most the budget; then nothing is pushed and kNoDependency comes back.
  template <typename Op>
  __device__ int64_t push(const typename Op::Args& args, int64_t after = kNoDependency) const {
    static_assert(kIndexOf<Op, Ops...> >= 0, "push<Op>: Op is not in this worker's table");
    static_assert(sizeof(args) <= sizeof(Item::args) && alignof(decltype(args)) <= 8);
    const int64_t t = atomic_add_gpu(&q_.state[kDeviceTail], 1);
    // The slot is free once the item capacity tickets back is done (its words were read).
    const int64_t deadline = now_ns() + q_.budget_ns;
    Backoff backoff;
    while (load_relaxed_gpu(&q_.device_done[t & q_.mask]) < t - (q_.mask + 1)) {
      if (now_ns() > deadline) {
        record_error(q_, kDeviceRingFull, ticket_, t);
        return kNoDependency;
      }
      backoff.sleep();
    }
    fence_acq_rel_gpu();  // the slot's last reader is done before it is rewritten
    Item* slot = &q_.device_items[t & q_.mask];
    slot->op = kIndexOf<Op, Ops...>;
    slot->after = after;
    memcpy(slot->args, &args, sizeof(args));
    store_release_gpu(&slot->ticket, t);
    return t | kDeviceTicket;
  }
};

// ---------------------------------------------------------------------------------------
// The worker kernel.

// Host items one block claims at once: a run of items each of which waits for the one before
// (a chain) goes to one block, which runs them in order with no hand-off between SMs. Warp 0
// looks at kSlotsPerLane slots a lane, all in flight at once.
inline constexpr int kSlotsPerLane = 8;
inline constexpr int kMaxRun = kSlotsPerLane * kWarpThreads;
inline constexpr unsigned kAllLanes = 0xffffffffu;
// claim_host_run(): the copy of the run's items did not complete in time; the block stops.
inline constexpr int kCopyTimedOut = -2;

// A device-ring item (lane 0 of warp 0), claimed only once published.
__device__ inline bool try_device_item(const Queue& q, Item& out) {
  const int64_t h = load_relaxed_gpu(&q.state[kDeviceHead]);
  const Item* slot = &q.device_items[h & q.mask];
  if (load_relaxed_gpu(&slot->ticket) != h) return false;
  if (!atomic_cas_gpu(&q.state[kDeviceHead], h, h + 1)) return false;
  fence_acq_rel_gpu();  // an acquire, with the read of the ticket
  out = *slot;          // the slot is not reused until out completes
  out.ticket = h | kDeviceTicket;
  return true;
}

// Warp 0 claims the published host items from the head on that form a chain (item k + 1 waits
// for item k), at most kMaxRun, into items[]. Returns how many, 0 when the head item is not
// published, -1 when another block claimed first. Only lane 0 polls (one PCIe read). Then two
// more round trips for a whole run: every lane reads its slots' tickets, fences; then the TMA
// unit copies the words of the published slots from the head on into items[] (which nothing
// else reads while warp 0 searches); the words decide where the chain ends.
// The copy is waited for at most Queue::budget_ns (it takes a PCIe round trip). Past that, it
// records kHostCopyTimeout and returns kCopyTimedOut, having claimed nothing: the block must
// stop, since a copy that lands late would still write items[] and complete the mbarrier's
// phase (a copy cannot be cancelled). Other blocks may take the items up again.
__device__ inline int claim_host_run(const Queue& q, Item* items, BulkArrival& arrival) {
  const int lane = threadIdx.x;
  int64_t h = 0;
  bool published = false;
  if (lane == 0) {
    h = load_relaxed_gpu(&q.state[kHostHead]);
    published = load_relaxed_sys(&q.host_items[h & q.mask].ticket) == h;
  }
  if (!__shfl_sync(kAllLanes, published, 0)) return 0;
  h = __shfl_sync(kAllLanes, h, 0);
  bool ready[kSlotsPerLane];  // all loads in flight before any is looked at
#pragma unroll
  for (int k = 0; k < kSlotsPerLane; ++k) {
    const int64_t t = h + k * kWarpThreads + lane;
    ready[k] = load_relaxed_sys(&q.host_items[t & q.mask].ticket) == t;
  }
  int count = kMaxRun;  // published slots from the head on
#pragma unroll
  for (int k = 0; k < kSlotsPerLane; ++k) {
    const unsigned missing = __ballot_sync(kAllLanes, !ready[k]);
    if (missing != 0) count = min(count, k * kWarpThreads + __ffs(missing) - 1);
  }
  // The head slot was published at the first look; if its ticket is gone now, another block
  // claimed it (and the host reused the slot) meanwhile.
  if (count == 0) return -1;
  fence_acq_rel_sys();  // with the relaxed reads above: the published items' words come after
  if (lane == 0) {
    // The words are read by the async proxy: ordered after this thread's acquire, and
    // items[]'s writes after the generic reads of the last run (before the block's barrier).
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int64_t start = h & q.mask;
    const int head = static_cast<int>(min(static_cast<int64_t>(count), q.mask + 1 - start));
    arrival.expect(count * static_cast<uint32_t>(sizeof(Item)));
    arrival.copy(items, &q.host_items[start], head * static_cast<uint32_t>(sizeof(Item)));
    if (count > head) {
      arrival.copy(items + head, q.host_items,
                   (count - head) * static_cast<uint32_t>(sizeof(Item)));
    }
  }
  // One answer for the warp: a lane whose look came after the deadline may see the copy done.
  if (!__all_sync(kAllLanes, arrival.wait(q.budget_ns))) {
    if (lane == 0) record_error(q, kHostCopyTimeout, h, count);
    return kCopyTimedOut;
  }
  int run = count;
#pragma unroll
  for (int k = 0; k < kSlotsPerLane; ++k) {
    const int index = k * kWarpThreads + lane;
    const bool joins = index == 0 || (index < count && items[index].after == h + index - 1);
    const unsigned left_out = __ballot_sync(kAllLanes, !joins);
    if (left_out != 0) run = min(run, k * kWarpThreads + __ffs(left_out) - 1);
  }
  bool won = false;
  if (lane == 0) won = atomic_cas_gpu(&q.state[kHostHead], h, h + run);
  if (!__shfl_sync(kAllLanes, won, 0)) return -1;
  return run;
}

// Idle blocks take turns at the host ring: the block holding state[kHostPoller] (a flag in GPU
// memory) is the only one that polls the ring over PCIe and claims from it; the others look at
// the flag and at the device ring, both in GPU memory. With every idle block polling the ring,
// a GEMM beside an idle worker of 8 blocks ran up to 2.7x slower on an H100 (in some runs);
// one polling block cost it no more than any resident kernel does. Taking the flag is an
// acquire and giving it back a release, so the next holder reads the head its claims left.
__device__ inline bool try_to_poll(const Queue& q) {
  if (!atomic_cas_gpu(&q.state[kHostPoller], 0, 1)) return false;
  fence_acq_rel_gpu();
  return true;
}
__device__ inline void stop_polling(const Queue& q) {
  fence_acq_rel_gpu();
  store_relaxed(&q.state[kHostPoller], 0);
}

// Warp 0's search for work: follow-up items first (usually on the critical path), then the
// host ring, while this block holds it. Returns the number of items in items[], or 0 when the
// block should exit (a drain or abort order, or a copy from the host ring that timed out: the
// block lets go of the ring, so that the others still drain).
__device__ inline int next_run(const Queue& q, Item* items, BulkArrival& arrival) {
  const int lane = threadIdx.x;
  Backoff backoff{kFirstSleepNs, static_cast<unsigned>(q.idle_sleep_ns)};
  bool draining = false, polling = false;
  for (unsigned polls = 0;; ++polls) {
    int found = __shfl_sync(kAllLanes, lane == 0 && try_device_item(q, items[0]) ? 1 : 0, 0);
    if (found == 0 && !polling) polling = __shfl_sync(kAllLanes, lane == 0 && try_to_poll(q), 0);
    if (found == 0 && polling) {
      found = claim_host_run(q, items, arrival);
      if (found == -1) continue;  // another claim moved the head first: look again at once
      if (found == kCopyTimedOut) found = -1;  // the error is recorded: this block exits
      // After a drain order, the items pushed before it are visible (the host released them
      // first): a block leaves once a look of its own, made after the order, finds nothing.
      if (found == 0 && draining) found = -1;
    }
    if (found != 0) {
      if (polling && lane == 0) stop_polling(q);
      return found > 0 ? found : 0;
    }
    // The stop word is a PCIe read: looked at every 16th poll.
    if (polls % 16 == 15) {
      const int64_t stop = __shfl_sync(kAllLanes, lane == 0 ? stop_word(q) : 0, 0);
      if (stop == kAbort) {
        if (polling && lane == 0) stop_polling(q);
        return 0;
      }
      if (stop == kDrain && !draining) {
        draining = true;
        continue;
      }
    }
    backoff.sleep();
  }
}

template <typename... Ops>
__device__ inline bool dispatch(const Item& item, TableContext<Ops...>& ctx) {
  int index = 0;
  const bool known =
      ((item.op == index++
            ? (Ops::run(*reinterpret_cast<const typename Ops::Args*>(item.args), ctx), true)
            : false) ||
       ...);
  return known;
}

// A run's completions, published once the block has run all of it: tickets first..first+count-1
// (a run of host items is consecutive; a device item comes alone). Within a run nothing waits
// on these counters (the block runs a chain in order, separated by barriers), and a fence
// costs an L2 round trip, so one fence a run, not one an item: an item's counter is late by
// at most the rest of its run. Each counter is a GPU-scope release: a fence.acq_rel.gpu, then
// a relaxed store of the ticket (a fence before a strong store is a release in PTX),
// cumulative over the writes the last barrier ordered before it. Warp 0 stores the counters
// other blocks wait on, warp 1 the host's in pinned memory, so that those PCIe writes never
// hold up warp 0's next search (a later fence in warp 0 would wait for them).
// Not system scope: a fence.sys waits for earlier PCIe writes to land. An op whose results the
// host or another device reads in host memory ends with __syncthreads() and one thread's
// __threadfence_system().
__device__ inline void complete_run(const Queue& q, int64_t first, int count) {
  const int warp = threadIdx.x / kWarpThreads;
  const int lane = threadIdx.x % kWarpThreads;
  const bool device = (first & kDeviceTicket) != 0;
  if (warp > 1 || (warp == 1 && device)) return;
  int64_t* done = warp == 1 ? q.host_done : (device ? q.device_done : q.host_done_gpu);
  const int64_t t0 = first & ~kDeviceTicket;
  fence_acq_rel_gpu();
  for (int i = lane; i < count; i += kWarpThreads)
    store_relaxed(done + ((t0 + i) & q.mask), t0 + i);
}

template <typename... Ops>
__global__ void __launch_bounds__(kBlockThreads) worker_kernel(const Queue q) {
  __shared__ Item items[kMaxRun];
  __shared__ int count;
  __shared__ uint64_t arrived;
  BulkArrival arrival{static_cast<uint32_t>(__cvta_generic_to_shared(&arrived))};
  if (threadIdx.x == 0) arrival.init();
  __syncwarp();
  while (true) {
    if (threadIdx.x < kWarpThreads) {
      const int found = next_run(q, items, arrival);
      if (threadIdx.x == 0) count = found;
    }
    __syncthreads();
    const int found = count;  // read once: warp 0 rewrites it for the next run
    if (found == 0) return;
    // Read before the last barrier: once it is passed, warp 0 refills items[].
    const int64_t first = items[0].ticket;
    // A failed dependency fails the item too; it is still completed so nothing waits on it.
    // Only the first item of a run can wait: each later one waits for the item before it,
    // which this block has just run (the barrier after it orders its writes).
    if (threadIdx.x == 0 && items[0].after != kNoDependency && !wait_for(q, items[0].after)) {
      record_error(q, kDependencyTimeout, first, items[0].after);
      items[0].op = -1;
    }
    __syncthreads();
    for (int i = 0; i < found; ++i) {
      const Item& item = items[i];
      if (item.op >= 0) {
        TableContext<Ops...> ctx(q, item.ticket);
        const bool known = dispatch<Ops...>(item, ctx);
        if (!known && threadIdx.x == 0) record_error(q, kUnknownOp, item.ticket, item.op);
      }
      __syncthreads();  // every thread's writes: for the next item, then the run's releases
    }
    complete_run(q, first, found);
  }
}

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
inline int64_t poll_done(int64_t counter, int64_t ticket, int64_t error, int64_t spin_ns) {
  const int64_t* done = host_address<const int64_t>(counter, "counter");
  const int64_t* failed = host_address<const int64_t>(error, "error");
  RuntimeCheck(spin_ns >= 0 && spin_ns <= 1'000'000'000, "spin_ns must be 0 to 1e9, got ", spin_ns);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  for (unsigned looks = 0;; ++looks) {
    if (__atomic_load_n(failed, __ATOMIC_ACQUIRE) != 0) return -1;
    if (__atomic_load_n(done, __ATOMIC_ACQUIRE) >= ticket) return 1;
    if (looks % 16 == 15 && std::chrono::steady_clock::now() > deadline) return 0;
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

  static constexpr auto kernel = worker_kernel<Ops...>;

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
    RuntimeDeviceCheck(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, 0));
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
                 reinterpret_cast<cudaStream_t>(stream))(kernel, q);
  }
};

}  // namespace jitk::persistent
