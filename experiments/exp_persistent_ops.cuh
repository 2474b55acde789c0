// An op for benchmarks/exp_persistent_costs.py: thread 0 stamps the SM clock and the global
// timer, so a chain of stamps between other items times each item on the GPU itself.
#pragma once

#include <jitk/persistent.cuh>

#include <cstdint>

namespace persistent_exp {

struct Stamp {
  struct Args {
    int64_t* out;  // [2 * n]: clock64, globaltimer of stamp `index`
    int64_t index;
  };
  static __device__ void run(const Args& a, jitk::persistent::BlockContext&) {
    if (threadIdx.x != 0) return;
    a.out[2 * a.index] = clock64();
    a.out[2 * a.index + 1] = jitk::persistent::now_ns();
  }
};

// Does nothing: stamps with these between them time the worker's own loop, without a store.
struct Pass {
  struct Args {
    int64_t unused;
  };
  static __device__ void run(const Args&, jitk::persistent::BlockContext&) {}
};

}  // namespace persistent_exp
