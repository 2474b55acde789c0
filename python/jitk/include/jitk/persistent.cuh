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
//
// The parts, in the order they build on each other: persistent_queue.cuh (layout, ordered
// access), persistent_worker.cuh (claims and the worker kernel), persistent_host.cuh (the
// host's side). Including this header includes them all.
//
// An op file may be written in two halves (jitk/nvrtc.cuh), its ops' run() under
// JITK_DEVICE_HALF, as persistent_chain.cuh is: Worker(..., cuda_compiler="auto") then builds
// it with NVRTC. One that is not builds with nvcc, the default.

#pragma once

#include <jitk/nvrtc.cuh>

#include <jitk/persistent_host.cuh>
#include <jitk/persistent_queue.cuh>
#include <jitk/persistent_worker.cuh>
