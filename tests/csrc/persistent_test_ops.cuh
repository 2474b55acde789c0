// Ops for tests/test_persistent.py: each leaves evidence of what ran, in what order, or fails
// on purpose. Thread 0 does the work; the rest of the block waits at the worker's barriers.
#pragma once

#include <jitk/persistent.cuh>

#include <cstdint>

namespace persistent_test {

using jitk::persistent::BlockContext;

// hits[value] += 1; order[count++] = value: every item runs once, and in which order.
struct Record {
  struct Args {
    int64_t* hits;
    int64_t* order;
    int64_t* count;
    int64_t value;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    if (threadIdx.x != 0) return;
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.hits[a.value]), 1ull);
    const auto at = atomicAdd(reinterpret_cast<unsigned long long*>(a.count), 1ull);
    a.order[at] = a.value;
  }
};

// A step of a chain: the cell must hold `expect` (the step before ran), then holds `next`.
struct Step {
  struct Args {
    int64_t* cell;
    int64_t expect;
    int64_t next;
  };
  static __device__ void run(const Args& a, BlockContext& ctx) {
    if (threadIdx.x != 0) return;
    if (*a.cell != a.expect) ctx.fail(*a.cell);
    *a.cell = a.next;
  }
};

// cell += 1, then the same op again with depth - 1, pushed from the GPU, after this item.
struct Spawn {
  struct Args {
    int64_t* cell;
    int64_t depth;
  };
  template <typename Context>
  static __device__ void run(const Args& a, Context& ctx) {
    if (threadIdx.x != 0) return;
    *a.cell += 1;
    if (a.depth > 0) ctx.template push<Spawn>({a.cell, a.depth - 1}, ctx.ticket());
  }
};

// Pushes a Record that waits for a device ticket nobody will push: a dependency timeout.
struct Orphan {
  struct Args {
    int64_t* hits;
    int64_t* order;
    int64_t* count;
  };
  template <typename Context>
  static __device__ void run(const Args& a, Context& ctx) {
    if (threadIdx.x != 0) return;
    ctx.template push<Record>({a.hits, a.order, a.count, 0},
                              jitk::persistent::kDeviceTicket | (int64_t{1} << 40));
  }
};

struct Fail {
  struct Args {
    int64_t code;
  };
  static __device__ void run(const Args& a, BlockContext& ctx) {
    if (threadIdx.x == 0) ctx.fail(a.code);
  }
};

// Stores through `address` (an invalid one faults the kernel).
struct Poke {
  struct Args {
    int64_t address;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    if (threadIdx.x == 0) *reinterpret_cast<volatile int64_t*>(a.address) = 1;
  }
};

// Keeps its block busy for `ns` nanoseconds.
struct Busy {
  struct Args {
    int64_t ns;
  };
  static __device__ void run(const Args& a, BlockContext&) {
    const int64_t end = jitk::persistent::now_ns() + a.ns;
    while (jitk::persistent::now_ns() < end) jitk::device::pause_ns(1000);
  }
};

// Does nothing: a chain of these times the worker's own cost an item.
struct Nothing {
  struct Args {
    int64_t unused;
  };
  static __device__ void run(const Args&, BlockContext&) {}
};

}  // namespace persistent_test
