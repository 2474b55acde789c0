// An experiment, not product code: ways for SMs to read KV rows from pinned host memory
// (HiCache's load-back, host->GPU), to find which, if any, reaches the pinned copy_'s
// bandwidth at page size 1 (one random 1 KiB row at a time). benchmarks/exp_hicache_h2d.py
// times them beside the product kernel and a pinned copy_ of the same bytes.
//
// The question: SM loads of host memory cross PCIe as reads of a cache line or less, whose
// completions carry more header per byte than a copy engine's larger reads. Do other ways of
// reading (an L2 prefetch-size hint, the bulk copy engine of the SM, an L2 bulk prefetch)
// change that?
//
// Caches: K and V, flat [slots, kRowBytes], src on the host, dst on the GPU; int64 indices on
// the GPU; dst[idx_dst[i]] = src[idx_src[i]]. No bounds checks: the script's indices are valid.
#pragma once

#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>
#include <utility>

namespace jitk::exp_h2d {

struct Args {
  const char* src[2];
  char* dst[2];
  const int64_t* idx_src;
  const int64_t* idx_dst;
  int64_t items;
};

// ------------------------------------------------------------------------------ register
// The product kernel's scheme (16-byte vectors, kUnroll loads in flight per thread, then
// the stores), with the load instruction as the variable:
//   0: ld.global.cs (the product's)
//   1: ld.global.cs.L2::256B (asks L2 to fetch 256 bytes around the line)
//   2: ld.global.nc.L1::no_allocate.L2::256B
//   3: as 0, plus cp.async.bulk.prefetch.L2 of each row one round ahead
enum Load : int { kCs = 0, kCs256 = 1, kNc256 = 2, kCsBulkPrefetch = 3 };

template <int kUnroll>
inline constexpr int kRegThreads = 4096 / kUnroll < 1024 ? 4096 / kUnroll : 1024;

template <int kLoad>
__device__ __forceinline__ uint4 load_row_vector(const void* ptr) {
  uint4 v;
  if constexpr (kLoad == kCs256) {
    asm volatile("ld.global.cs.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  } else if constexpr (kLoad == kNc256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  } else {
    v = device::load_stream(ptr);
  }
  return v;
}

__device__ __forceinline__ void bulk_prefetch_l2(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

template <int kRowBytes, int kUnroll, int kLoad>
__global__ void __launch_bounds__(kRegThreads<kUnroll>) reg_kernel(const __grid_constant__ Args a) {
  constexpr int kThreads = kRegThreads<kUnroll>;
  constexpr int kVecsPerRow = kRowBytes / 16;
  const int64_t total = a.items * 2 * kVecsPerRow;
  const int64_t threads = int64_t{gridDim.x} * kThreads;
  const int64_t step = threads * kUnroll;
  for (int64_t vec = int64_t{blockIdx.x} * kThreads + threadIdx.x; vec < total; vec += step) {
    if constexpr (kLoad == kCsBulkPrefetch) {
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t v = vec + step + j * threads;
        if (v < total && v % kVecsPerRow == 0) {
          const int64_t row = v / kVecsPerRow;
          bulk_prefetch_l2(a.src[row & 1] + __ldg(a.idx_src + (row >> 1)) * kRowBytes, kRowBytes);
        }
      }
    }
    const char* src[kUnroll];
    char* dst[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t v = vec + j * threads;
      const bool ok = v < total;
      const int64_t vv = ok ? v : 0;
      const int64_t row = vv / kVecsPerRow;
      const int offset = static_cast<int>(vv - row * kVecsPerRow) * 16;
      const int64_t s = __ldg(a.idx_src + (row >> 1));
      const int64_t d = __ldg(a.idx_dst + (row >> 1));
      src[j] = ok ? a.src[row & 1] + s * kRowBytes + offset : nullptr;
      dst[j] = ok ? a.dst[row & 1] + d * kRowBytes + offset : nullptr;
    }
    uint4 data[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (src[j] != nullptr) data[j] = load_row_vector<kLoad>(src[j]);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (dst[j] != nullptr) device::store_stream(dst[j], data[j]);
    }
  }
}

// ---------------------------------------------------------------------------------- bulk
// Each thread is its own pipeline of kDepth shared-memory slots of one row: a bulk copy
// (cp.async.bulk, the SM's copy engine) reads a whole row from the host into a slot,
// completing on the slot's mbarrier; a bulk store writes the slot to the GPU row. A slot is
// refilled once its store has read it; kLag stores may still be reading while the loads of
// the other kDepth - kLag slots are in flight.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_load(uint32_t slot, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(slot),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, uint32_t slot, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(slot),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wait_stores_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

template <int kRowBytes, int kDepth>
inline constexpr int kBulkSmemPerThread = kDepth * kRowBytes + kDepth * 8;

template <int kRowBytes, int kDepth, int kLag, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) bulk_kernel(const __grid_constant__ Args a) {
  static_assert(kLag >= 0 && kLag < kDepth);
  constexpr int kThreads = kWarps * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  const int t = threadIdx.x;
  const uint32_t slots = smem_address(smem + t * kDepth * kRowBytes);
  const uint32_t bars = smem_address(smem + kThreads * kDepth * kRowBytes) + t * kDepth * 8;
#pragma unroll
  for (int s = 0; s < kDepth; ++s) bar_init(bars + 8 * s);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

  // This thread's rows: g, g + lanes, ... (row r: cache r & 1 of item r >> 1).
  const int64_t lanes = int64_t{gridDim.x} * kThreads;
  const int64_t g = int64_t{blockIdx.x} * kThreads + t;
  const int64_t rows = a.items * 2;
  const int64_t count = rows > g ? (rows - g + lanes - 1) / lanes : 0;
  auto row_of = [&](int64_t i) { return g + i * lanes; };

  char* dst[kDepth];
  // The next row to load, its indices read one load ahead so that their latency hides.
  int64_t next = 0;
  int64_t next_s = 0, next_d = 0;
  auto read_indices = [&](int64_t i) {
    if (i < count) {
      const int64_t r = row_of(i);
      next_s = __ldg(a.idx_src + (r >> 1));
      next_d = __ldg(a.idx_dst + (r >> 1));
    }
  };
  read_indices(0);
  // Row `next` into slot `s` (compile-time, so that dst[] stays in registers).
  auto load_next = [&](auto slot_constant) {
    constexpr int s = decltype(slot_constant)::value;
    if (next < count) {
      const int64_t r = row_of(next);
      dst[s] = a.dst[r & 1] + next_d * kRowBytes;
      bulk_load(slots + s * kRowBytes, a.src[r & 1] + next_s * kRowBytes, kRowBytes, bars + 8 * s);
      ++next;
      read_indices(next);
    }
  };
  [&]<int... s>(std::integer_sequence<int, s...>) {
    (load_next(std::integral_constant<int, s>{}), ...);
  }(std::make_integer_sequence<int, kDepth - kLag>{});

  for (int64_t base = 0; base < count; base += kDepth) {
    const uint32_t parity = static_cast<uint32_t>(base / kDepth) & 1;
    [&]<int... s>(std::integer_sequence<int, s...>) {
      (
          [&] {
            if (base + s < count) {
              bar_wait(bars + 8 * s, parity);
              bulk_store(dst[s], slots + s * kRowBytes, kRowBytes);
              wait_stores_read<kLag>();
              load_next(std::integral_constant<int, (s + kDepth - kLag) % kDepth>{});
            }
          }(),
          ...);
    }(std::make_integer_sequence<int, kDepth>{});
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---------------------------------------------------------------------------------- host
inline Args make_args(const TensorView& k_dst, const TensorView& v_dst, const TensorView& idx_dst,
                      const TensorView& k_src, const TensorView& v_src, const TensorView& idx_src) {
  auto at = [](const TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); };
  Args a{};
  a.src[0] = at(k_src);
  a.src[1] = at(v_src);
  a.dst[0] = at(k_dst);
  a.dst[1] = at(v_dst);
  a.idx_src = reinterpret_cast<const int64_t*>(at(idx_src));
  a.idx_dst = reinterpret_cast<const int64_t*>(at(idx_dst));
  a.items = idx_dst.size(0);
  return a;
}

template <int kRowBytes, int kUnroll, int kLoad>
struct Reg {
  static void run(TensorView k_dst, TensorView v_dst, TensorView idx_dst, TensorView k_src,
                  TensorView v_src, TensorView idx_src, int64_t blocks) {
    const Args a = make_args(k_dst, v_dst, idx_dst, k_src, v_src, idx_src);
    LaunchKernel(dim3(static_cast<unsigned>(blocks)), kRegThreads<kUnroll>, idx_dst.device())(
        reg_kernel<kRowBytes, kUnroll, kLoad>, a);
  }
};

template <int kRowBytes, int kDepth, int kLag, int kWarps>
struct Bulk {
  static void run(TensorView k_dst, TensorView v_dst, TensorView idx_dst, TensorView k_src,
                  TensorView v_src, TensorView idx_src, int64_t blocks) {
    const Args a = make_args(k_dst, v_dst, idx_dst, k_src, v_src, idx_src);
    constexpr int kSmem = kWarps * 32 * kBulkSmemPerThread<kRowBytes, kDepth>;
    static_assert(kSmem <= 227 * 1024);
    auto kernel = bulk_kernel<kRowBytes, kDepth, kLag, kWarps>;
    static const bool raised = [&] {
      RuntimeDeviceCheck(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      return true;
    }();
    (void)raised;
    LaunchKernel(dim3(static_cast<unsigned>(blocks)), kWarps * 32, idx_dst.device(), kSmem)(kernel,
                                                                                            a);
  }
};

}  // namespace jitk::exp_h2d
