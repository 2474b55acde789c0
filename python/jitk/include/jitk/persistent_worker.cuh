// The persistent worker's device side (see persistent.cuh): what an op's run() is given, how a
// block claims items from the rings, and the worker kernel that runs them.

#pragma once

#include <jitk/persistent_queue.cuh>

#if JITK_HOST_HALF
#include <cstdint>
#include <type_traits>
#endif

namespace jitk::persistent {

#if JITK_DEVICE_HALF

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
// a GEMM beside an idle worker of 8 blocks ran several times slower on an H100 in some runs;
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

#else   // what an op file's host half names: the types its ops' run() declarations take
class BlockContext;
template <typename... Ops>
class TableContext;
#endif  // JITK_DEVICE_HALF

template <typename... Ops>
__global__ void __launch_bounds__(kBlockThreads) worker_kernel(const Queue q)
#if JITK_DEVICE_HALF
{
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
#else
    ;
#endif

}  // namespace jitk::persistent
