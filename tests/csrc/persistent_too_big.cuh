// An op whose Args cannot fit an item: the worker must refuse it at compile time.
#pragma once

#include <jitk/persistent.cuh>

#include <cstdint>

struct TooBig {
  struct Args {
    int64_t words[13];
  };
  static __device__ void run(const Args&, jitk::persistent::BlockContext&) {}
};
