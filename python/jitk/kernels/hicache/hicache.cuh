// HiCache KV transfers by a kernel: dst[indices_dst[i]] = src[indices_src[i]] for the rows of
// a KV cache, between GPU memory and pinned host memory (either way) or within one GPU.
// Slots, pages and the shared checks are in hicache_layout.cuh; the copy-engine method is in
// hicache_copy.cuh.
//
// A transfer is a flat list of 16-byte vectors, ordered (layer, token, cache, vector of the
// row). Each thread loads kUnroll vectors, all of them before its first store, so that many
// requests are in flight: a kernel's read of host memory crosses PCIe and takes
// microseconds, and only many outstanding requests fill the link. Loads and stores stream
// (evict-first): every byte is touched once.
//
// The kernel reads the indices where they are (GPU memory, or pinned host memory), so a
// captured CUDA graph reads them again at every replay. It skips a page whose source or
// destination run is outside its cache (or straddles one of a paged cache's pages): neither
// side is touched, so a bad index never reaches memory outside the caches. The all-layer
// entry points take base pointers that cannot be checked: there the pointers (and, without
// slot counts, the upper bound of the indices) are trusted.
//
// Written in two halves (jitk/nvrtc.cuh): NVRTC may build the kernel apart.
#pragma once

#include <jitk/nvrtc.cuh>

#include "hicache_layout.cuh"

#include <jitk/device.cuh>

#if JITK_HOST_HALF
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>
#endif

namespace jitk::hicache {

// Threads per block: enough for 4096 vectors of unroll buffer, 64 KiB in flight per SM, and
// at most 1024 (half an SM), so that every thread has 64 registers or more and the buffers
// never spill. The in-flight bytes live in registers: a deeper unroll trades threads for
// depth.
template <int kUnroll>
inline constexpr int kThreads = min_of(1024, 4096 / kUnroll);

// Blocks (one SM each) a transfer that crosses PCIe takes unless told otherwise: the fewest
// that reach nearly the bandwidth the whole GPU gets (measured on an H100, see the README).
// More buy no bandwidth, and each one is an SM taken from compute running beside.
inline constexpr int64_t kDefaultBlockQuota = 6;

// One cache of one side: a base address, or a GPU-readable table of one base per layer.
struct CacheRows {
  const uint64_t* layer_bases;  // all-layer kernels only
  uint64_t base;                // one-layer kernels only
  SlotLayout layout;
};

template <typename Index, int kNumCaches>
struct TransferParams {
  CacheRows src[kNumCaches];
  CacheRows dst[kNumCaches];
  const Index* src_indices;
  const Index* dst_indices;
  FastDiv page_size;
  int64_t num_items;
  int64_t num_layers;
};

// ------------------------------------------------------------------------------- device
namespace kernel {

#if JITK_DEVICE_HALF

template <int kNumCaches>
struct LayerBases {
  const char* src[kNumCaches];
  char* dst[kNumCaches];
};

template <bool kAllLayers, typename Index, int kNumCaches>
__device__ __forceinline__ LayerBases<kNumCaches> layer_bases(
    const TransferParams<Index, kNumCaches>& p, int64_t layer) {
  LayerBases<kNumCaches> bases;
#pragma unroll
  for (int c = 0; c < kNumCaches; ++c) {
    if constexpr (kAllLayers) {
      bases.src[c] = reinterpret_cast<const char*>(p.src[c].layer_bases[layer]);
      bases.dst[c] = reinterpret_cast<char*>(p.dst[c].layer_bases[layer]);
    } else {
      bases.src[c] = reinterpret_cast<const char*>(p.src[c].base);
      bases.dst[c] = reinterpret_cast<char*>(p.dst[c].base);
    }
  }
  return bases;
}

// One vector's source and destination; null when past the layer's end or when its page is
// skipped.
struct VectorMove {
  const char* src = nullptr;
  char* dst = nullptr;
};

// Free of branches, so that the index reads of all unrolled vectors issue back to back
// instead of each waiting for the previous one's range check.
template <int kElementBytes, typename Index, int kNumCaches>
__device__ __forceinline__ VectorMove locate(const TransferParams<Index, kNumCaches>& p,
                                             const LayerBases<kNumCaches>& bases, int64_t vec,
                                             int64_t vecs_per_layer) {
  constexpr int kVecsPerRow = kElementBytes / kVecBytes;
  const bool in_layer = vec < vecs_per_layer;
  const int64_t v = in_layer ? vec : 0;  // past the end: read vector 0's indices, move nothing
  const int64_t row = v / kVecsPerRow;
  const int offset = static_cast<int>(v - row * kVecsPerRow) * kVecBytes;
  const int64_t item = row / kNumCaches;
  // One index per page: the page's first; the token is `j` slots into it.
  const int64_t first =
      int64_t{p.page_size.quotient(static_cast<uint32_t>(item))} * p.page_size.divisor;
  const int64_t j = item - first;
  const int64_t src_first = __ldg(p.src_indices + first);
  const int64_t dst_first = __ldg(p.dst_indices + first);
  // Selects rather than array indexing, so the bases stay in registers.
  constexpr int kLast = kNumCaches - 1;
  const bool last_cache = row % kNumCaches == kLast;
  const SlotLayout& src_layout = last_cache ? p.src[kLast].layout : p.src[0].layout;
  const SlotLayout& dst_layout = last_cache ? p.dst[kLast].layout : p.dst[0].layout;
  const int64_t run = p.page_size.divisor;
  const bool valid =
      in_layer && src_layout.holds(src_first, run) && dst_layout.holds(dst_first, run);
  const char* src_base = last_cache ? bases.src[kLast] : bases.src[0];
  char* dst_base = last_cache ? bases.dst[kLast] : bases.dst[0];
  const char* src = src_base + src_layout.offset(valid ? src_first : 0, j) + offset;
  char* dst = dst_base + dst_layout.offset(valid ? dst_first : 0, j) + offset;
  return {valid ? src : nullptr, valid ? dst : nullptr};
}

#endif  // JITK_DEVICE_HALF

// Grid: x spreads one layer's vectors, y strides over the layers.
template <int kElementBytes, int kUnroll, bool kAllLayers, typename Index, int kNumCaches>
__global__ void __launch_bounds__(kThreads<kUnroll>)
    transfer(const __grid_constant__ TransferParams<Index, kNumCaches> p)
#if JITK_DEVICE_HALF
{
  constexpr int64_t kVecsPerItem = int64_t{kNumCaches} * (kElementBytes / kVecBytes);
  const int64_t vecs_per_layer = p.num_items * kVecsPerItem;
  const int64_t threads = int64_t{gridDim.x} * kThreads<kUnroll>;
  const int64_t first_vec = int64_t{blockIdx.x} * kThreads<kUnroll> + threadIdx.x;
  for (int64_t layer = blockIdx.y; layer < p.num_layers; layer += gridDim.y) {
    const LayerBases<kNumCaches> bases = layer_bases<kAllLayers>(p, layer);
    for (int64_t vec = first_vec; vec < vecs_per_layer; vec += threads * kUnroll) {
      // Index reads first, then every data read, then the writes: kUnroll reads in flight.
      VectorMove moves[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        moves[j] = locate<kElementBytes>(p, bases, vec + j * threads, vecs_per_layer);
      }
      uint4 data[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (moves[j].src != nullptr) data[j] = device::load_stream(moves[j].src);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (moves[j].dst != nullptr) device::store_stream(moves[j].dst, data[j]);
      }
    }
  }
}
#else
        ;
#endif

}  // namespace kernel

// --------------------------------------------------------------------------------- host
#if JITK_HOST_HALF
namespace host {

// The kernel reads the indices: on the GPU, or in host memory the GPU can reach.
inline void check_kernel_reads(const Indices& indices, DebugInfo where = {}) {
  if (indices.on_gpu || indices.size == 0) return;
  for (const TensorView* t : {&indices.dst, &indices.src}) {
    RuntimeCheck(where, gpu_reachable(address_of(*t)), "'",
                 t == &indices.dst ? "indices_dst" : "indices_src", "' is in pageable ",
                 "host memory, which the kernel cannot read; pass the indices on the GPU ",
                 "or pinned, or use method='copy_engine'");
  }
}

}  // namespace host

// The kernel entry points, for one element size (bytes per row of a cache) and unroll.
template <int kElementBytes, int kUnroll>
struct HiCache {
  static_assert(element_bytes_supported(kElementBytes),
                "rows move as 16-byte vectors: the element size must be a multiple of 16");
  static_assert(unroll_supported(kUnroll));

  static void one_layer(TensorView k_cache_dst, TensorView v_cache_dst, TensorView indices_dst,
                        TensorView k_cache_src, TensorView v_cache_src, TensorView indices_src,
                        int64_t element_dim, int64_t page_size, int64_t block_quota) {
    one_layer_impl<2>({{k_cache_dst, v_cache_dst}, {"k_cache_dst", "v_cache_dst"}}, indices_dst,
                      {{k_cache_src, v_cache_src}, {"k_cache_src", "v_cache_src"}}, indices_src,
                      element_dim, page_size, block_quota);
  }

  static void one_layer_mla(TensorView cache_dst, TensorView indices_dst, TensorView cache_src,
                            TensorView indices_src, int64_t element_dim, int64_t page_size,
                            int64_t block_quota) {
    one_layer_impl<1>({{cache_dst}, {"cache_dst"}}, indices_dst, {{cache_src}, {"cache_src"}},
                      indices_src, element_dim, page_size, block_quota);
  }

  static void all_layer(TensorView k_ptr_dst, TensorView v_ptr_dst, TensorView indices_dst,
                        TensorView k_ptr_src, TensorView v_ptr_src, TensorView indices_src,
                        int64_t src_stride, int64_t dst_stride, int64_t element_size,
                        int64_t page_size, int64_t page_rows, int64_t src_page_stride,
                        int64_t dst_page_stride, int64_t src_slots, int64_t dst_slots,
                        int64_t block_quota) {
    all_layer_impl<2>({{k_ptr_dst, v_ptr_dst}, {"k_ptr_dst", "v_ptr_dst"}}, indices_dst,
                      {{k_ptr_src, v_ptr_src}, {"k_ptr_src", "v_ptr_src"}}, indices_src, src_stride,
                      dst_stride, element_size, page_size, page_rows, src_page_stride,
                      dst_page_stride, src_slots, dst_slots, block_quota);
  }

  static void all_layer_mla(TensorView ptr_dst, TensorView indices_dst, TensorView ptr_src,
                            TensorView indices_src, int64_t src_stride, int64_t dst_stride,
                            int64_t element_size, int64_t page_size, int64_t page_rows,
                            int64_t src_page_stride, int64_t dst_page_stride, int64_t src_slots,
                            int64_t dst_slots, int64_t block_quota) {
    all_layer_impl<1>({{ptr_dst}, {"ptr_dst"}}, indices_dst, {{ptr_src}, {"ptr_src"}}, indices_src,
                      src_stride, dst_stride, element_size, page_size, page_rows, src_page_stride,
                      dst_page_stride, src_slots, dst_slots, block_quota);
  }

 private:
  template <int kNumCaches>
  static void one_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t element_dim, int64_t page_size, int64_t block_quota) {
    check_block_quota(block_quota);
    const DLDataType dtype = dst.tensors[0].dtype();
    const int64_t element_bytes = element_dim * host::dtype_bytes(dtype, dst.names[0]);
    RuntimeCheck(element_dim > 0 && element_bytes == kElementBytes, "element_dim ", element_dim,
                 " of ", dtype, " is ", element_bytes, " bytes, but this kernel moves ",
                 kElementBytes);
    const host::Indices indices(indices_dst, indices_src, page_size);
    const host::OneLayerSide<kNumCaches> dst_side(dst, element_dim, page_size, dtype, dst.names[0],
                                                  "dst tokens");
    const host::OneLayerSide<kNumCaches> src_side(src, element_dim, page_size, dtype, dst.names[0],
                                                  "src tokens");
    host::check_kernel_reads(indices);
    DLDevice gpu = indices.device.unwrap();
    if (!indices.on_gpu) {
      RuntimeCheck(dst_side.find_gpu(gpu) || src_side.find_gpu(gpu),
                   "the indices and every cache are in host memory: the kernel needs a GPU ",
                   "tensor among its arguments to know its GPU; use method='copy_engine'");
    }
    dst_side.check_reachable(gpu);
    src_side.check_reachable(gpu);
    if (indices.size == 0) return;

    host::dispatch_index(indices, [&]<typename Index>(Index*) {
      TransferParams<Index, kNumCaches> params{};
      for (int c = 0; c < kNumCaches; ++c) {
        params.dst[c] = {nullptr, dst_side.base(c), dst_side.layouts[c]};
        params.src[c] = {nullptr, src_side.base(c), src_side.layouts[c]};
      }
      fill_common(params, indices, page_size, 1);
      const bool crosses_pcie = dst.tensors[0].device().device_type != kDLCUDA ||
                                src.tensors[0].device().device_type != kDLCUDA;
      launch<false>(params, gpu, block_quota, crosses_pcie);
    });
  }

  template <int kNumCaches>
  static void all_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t src_stride, int64_t dst_stride, int64_t element_size,
                             int64_t page_size, int64_t page_rows, int64_t src_page_stride,
                             int64_t dst_page_stride, int64_t src_slots, int64_t dst_slots,
                             int64_t block_quota) {
    check_block_quota(block_quota);
    RuntimeCheck(element_size == kElementBytes, "element_size is ", element_size,
                 " bytes, but this kernel moves ", kElementBytes);
    const host::AllLayerArgs<kNumCaches> args(
        dst, indices_dst, src, indices_src, src_stride, dst_stride, element_size, page_size,
        page_rows, src_page_stride, dst_page_stride, src_slots, dst_slots);
    const DLDevice tables = args.tables_device.unwrap();
    RuntimeCheck(tables.device_type == kDLCUDA || args.indices.on_gpu,
                 "the pointer tables and the indices are in host memory: the kernel needs ",
                 "one of them on the GPU to know its GPU; use method='copy_engine'");
    const DLDevice gpu = tables.device_type == kDLCUDA ? tables : args.indices.device.unwrap();
    RuntimeCheck(!args.indices.on_gpu || args.indices.device.unwrap() == gpu, "the indices are on ",
                 args.indices.device.unwrap(), " but the pointer tables on ", gpu);
    host::check_kernel_reads(args.indices);
    if (tables.device_type != kDLCUDA) check_tables_reachable(dst, src);
    if (args.indices.size == 0 || args.layers == 0) return;

    host::dispatch_index(args.indices, [&]<typename Index>(Index*) {
      TransferParams<Index, kNumCaches> params{};
      for (int c = 0; c < kNumCaches; ++c) {
        params.dst[c] = {args.table(dst.tensors[c]), 0, args.dst_layout};
        params.src[c] = {args.table(src.tensors[c]), 0, args.src_layout};
      }
      fill_common(params, args.indices, page_size, args.layers);
      launch<true>(params, gpu, block_quota, true);
    });
  }

  template <int kNumCaches>
  static void check_tables_reachable(const host::Caches<kNumCaches>& dst,
                                     const host::Caches<kNumCaches>& src) {
    for (const host::Caches<kNumCaches>* side : {&dst, &src}) {
      for (int c = 0; c < kNumCaches; ++c) {
        RuntimeCheck(host::gpu_reachable(host::address_of(side->tensors[c])), "'", side->names[c],
                     "' is in pageable host memory, which the kernel cannot ",
                     "read; pass the pointer tables on the GPU or pinned, or use ",
                     "method='copy_engine'");
      }
    }
  }

  static void check_block_quota(int64_t block_quota, DebugInfo where = {}) {
    RuntimeCheck(where, block_quota == kNotGiven || block_quota >= 1,
                 "block_quota must be at least 1, got ", block_quota);
  }

  template <typename Index, int kNumCaches>
  static void fill_common(TransferParams<Index, kNumCaches>& params, const host::Indices& indices,
                          int64_t page_size, int64_t num_layers) {
    params.dst_indices = reinterpret_cast<const Index*>(host::address_of(indices.dst));
    params.src_indices = reinterpret_cast<const Index*>(host::address_of(indices.src));
    params.page_size = FastDiv(static_cast<uint32_t>(page_size));
    params.num_items = indices.size;
    params.num_layers = num_layers;
  }

  // Blocks: at most block_quota; by default kDefaultBlockQuota when the transfer crosses
  // PCIe, as many as are resident at once otherwise. Spread over the layers first, and never
  // more than it takes to give every thread one vector.
  template <bool kAllLayers, typename Index, int kNumCaches>
  static void launch(const TransferParams<Index, kNumCaches>& params, DLDevice gpu,
                     int64_t block_quota, bool crosses_pcie) {
    int64_t max_blocks = block_quota;
    if (block_quota == kNotGiven && crosses_pcie) {
      max_blocks = kDefaultBlockQuota;
    } else if (block_quota == kNotGiven) {
      int sms = 0;  // one block per SM: a block fills an SM's threads or its registers
      RuntimeDeviceCheck(
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu.device_id));
      max_blocks = sms;
    }
    constexpr int64_t kMaxGridY = 65535;
    const int64_t vecs_per_layer = params.num_items * kNumCaches * (kElementBytes / kVecBytes);
    const int64_t grid_y = min_of(min_of(params.num_layers, max_blocks), kMaxGridY);
    constexpr int64_t kMaxGridX = 0x7fffffff;
    const int64_t wanted = min_of(max_blocks / grid_y, kMaxGridX);
    const int64_t grid_x =
        max_of(min_of(wanted, div_ceil(vecs_per_layer, int64_t{kThreads<kUnroll>})), int64_t{1});
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
    LaunchKernel(grid, kThreads<kUnroll>, gpu)
        .template launch<kernel::transfer<kElementBytes, kUnroll, kAllLayers, Index, kNumCaches>>(
            params);
  }
};
#endif  // JITK_HOST_HALF

}  // namespace jitk::hicache
