// HiCache KV transfers: dst[indices_dst[i]] = src[indices_src[i]] for rows of a KV cache,
// between GPU memory and pinned host memory (either way) or within one GPU.
//
// A transfer is a flat list of 16-byte vectors, ordered (layer, item, cache, vector of the
// row). Each thread loads kUnroll vectors, all of them before its first store, so that many
// requests are in flight: a kernel's read of host memory crosses PCIe and takes
// microseconds, and only many outstanding requests fill the link. Loads and stores stream
// (evict-first): every byte is touched once.
//
// Indices stay on the GPU (reading them on the host would synchronize). The kernel skips an
// item whose source or destination index is outside [0, rows): neither row is touched, so a
// bad index never reaches memory outside the caches. The all-layer entry points take base
// pointers that cannot be checked: there the pointers (and, without row counts, the upper
// bound of the indices) are trusted.
#pragma once

#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>
#include <limits>

namespace jitk::hicache {

inline constexpr int kVecBytes = 16;
// Threads per SM a kernel is built to keep resident (its launch bounds): enough for 4096
// vectors of unroll buffer, 64 KiB in flight per SM, more than HBM latency needs hidden, and
// at most 1024 (half an SM), so that every thread has 64 registers or more and the buffers
// never spill. The in-flight bytes live in registers: a deeper unroll only trades threads
// for depth.
template <int kUnroll>
inline constexpr int kResidentThreadsPerSM = min_of(1024, 4096 / kUnroll);
// Python's "not given" for block_quota (fill the GPU) and for the all-layer row counts.
inline constexpr int64_t kNotGiven = -1;

// Where one cache's rows are: a base address, or a GPU table of one base per layer.
struct CacheRows {
  const uint64_t* layer_bases;  // all-layer kernels only
  uint64_t base;                // one-layer kernels only
  int64_t row_stride_bytes;
};

template <typename Index, int kNumCaches>
struct TransferParams {
  CacheRows src[kNumCaches];
  CacheRows dst[kNumCaches];
  const Index* src_indices;
  const Index* dst_indices;
  int64_t num_items;
  int64_t num_layers;
  int64_t src_rows;  // items with an index outside [0, rows) are skipped
  int64_t dst_rows;
};

// ------------------------------------------------------------------------------- device
namespace kernel {

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

// One vector's source and destination; null when past the layer's end or when its item is
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
  const int64_t src_index = __ldg(p.src_indices + item);
  const int64_t dst_index = __ldg(p.dst_indices + item);
  const bool valid = in_layer && src_index >= 0 && src_index < p.src_rows && dst_index >= 0 &&
                     dst_index < p.dst_rows;
  // Selects rather than array indexing, so the bases stay in registers.
  constexpr int kLast = kNumCaches - 1;
  const bool last_cache = row % kNumCaches == kLast;
  const char* src_base = last_cache ? bases.src[kLast] : bases.src[0];
  char* dst_base = last_cache ? bases.dst[kLast] : bases.dst[0];
  const int64_t src_stride = last_cache ? p.src[kLast].row_stride_bytes : p.src[0].row_stride_bytes;
  const int64_t dst_stride = last_cache ? p.dst[kLast].row_stride_bytes : p.dst[0].row_stride_bytes;
  const char* src = src_base + src_index * src_stride + offset;
  char* dst = dst_base + dst_index * dst_stride + offset;
  return {valid ? src : nullptr, valid ? dst : nullptr};
}

// Grid: x spreads one layer's vectors, y strides over the layers.
template <int kElementBytes, int kUnroll, int kThreads, bool kAllLayers, typename Index,
          int kNumCaches>
__global__ void __launch_bounds__(kThreads, kResidentThreadsPerSM<kUnroll> / kThreads)
    transfer(const __grid_constant__ TransferParams<Index, kNumCaches> p) {
  constexpr int64_t kVecsPerItem = int64_t{kNumCaches} * (kElementBytes / kVecBytes);
  const int64_t vecs_per_layer = p.num_items * kVecsPerItem;
  const int64_t threads = int64_t{gridDim.x} * kThreads;
  const int64_t first_vec = int64_t{blockIdx.x} * kThreads + threadIdx.x;
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

}  // namespace kernel

// --------------------------------------------------------------------------------- host
namespace host {

// The caches of one side of a transfer (K and V, or the one MLA cache) and their names.
template <int kNumCaches>
struct Caches {
  TensorView tensors[kNumCaches];
  const char* names[kNumCaches];
};

// A cache seen as t.view(-1, element_dim): `rows` rows of element_dim contiguous elements,
// `row_stride` elements apart.
struct RowLayout {
  int64_t rows;
  int64_t row_stride;
};

// Innermost dimensions first must be contiguous until they cover whole rows; the outer ones
// must then step over rows evenly, so that one stride reaches every row.
inline RowLayout row_layout(const TensorView& t, int64_t element_dim, const char* name,
                            DebugInfo where = {}) {
  detail::check_at(element_dim > 0, where, "element_dim must be positive, got ", element_dim);
  const int64_t numel = t.numel();
  detail::check_at(numel % element_dim == 0, where, "'", name, "' ", PrintTensor{t}, " has ",
                   numel, " elements, not a whole number of rows of element_dim ",
                   element_dim);
  if (numel == 0) return {0, element_dim};

  int dim = t.ndim() - 1;
  int64_t covered = 1;  // elements spanned, contiguously, by the dimensions walked so far
  for (; covered % element_dim != 0; --dim) {
    if (t.size(dim) == 1) continue;
    detail::check_at(t.stride(dim) == covered, where, "'", name, "' ", PrintTensor{t},
                     ": a row of element_dim ", element_dim, " elements must be contiguous, ",
                     "but dimension ", dim, " has stride ", t.stride(dim), " where ", covered,
                     " was needed");
    covered *= t.size(dim);
  }
  // covered > element_dim: the rows split one contiguous run, element_dim apart.
  int64_t row_stride = covered > element_dim ? element_dim : -1;
  int64_t next_stride = covered > element_dim ? covered : -1;
  for (; dim >= 0; --dim) {
    if (t.size(dim) == 1) continue;
    if (row_stride < 0) {
      row_stride = t.stride(dim);
    } else {
      detail::check_at(t.stride(dim) == next_stride, where, "'", name, "' ", PrintTensor{t},
                       " is not rows of element_dim ", element_dim,
                       " with one row stride: dimension ", dim, " has stride ", t.stride(dim),
                       " where ", next_stride, " was needed");
    }
    next_stride = t.stride(dim) * t.size(dim);
  }
  const RowLayout layout{numel / element_dim, row_stride < 0 ? element_dim : row_stride};
  detail::check_at(layout.rows == 1 || layout.row_stride >= element_dim, where, "'", name,
                   "' ", PrintTensor{t}, ": rows of ", element_dim, " elements ",
                   layout.row_stride, " apart overlap");
  return layout;
}

// The layout as a 2-d tensor, so that a TensorMatcher can check (and name) its sizes.
inline void verify_rows(const TensorMatcher& matcher, const TensorView& t, RowLayout layout,
                        int64_t element_dim, const char* name) {
  int64_t shape[2] = {layout.rows, element_dim};
  int64_t strides[2] = {layout.row_stride, 1};
  DLTensor rows{t.data_ptr(), t.device(), 2, t.dtype(), shape, strides, t.byte_offset()};
  matcher.verify(TensorView(&rows), name);
}

inline int64_t dtype_bytes(DLDataType dtype, const char* name, DebugInfo where = {}) {
  detail::check_at(dtype.bits % 8 == 0 && dtype.lanes == 1, where, "'", name, "' has dtype ",
                   dtype, ", which is not a whole number of bytes");
  return dtype.bits / 8;
}

inline uint64_t address_of(const TensorView& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr()) + t.byte_offset();
}

inline void check_aligned(uint64_t address, int64_t row_stride_bytes, const char* name,
                          DebugInfo where = {}) {
  detail::check_at(address % kVecBytes == 0, where, "'", name, "' starts at ", hex(address),
                   ", which is not 16-byte aligned (rows move as 16-byte "
                   "vectors)");
  detail::check_at(row_stride_bytes % kVecBytes == 0, where, "'", name, "' has a row stride of ",
                   row_stride_bytes, " bytes, not a multiple of 16 (rows move as 16-byte "
                   "vectors)");
}

// Host memory a kernel may touch: pinned (cudaHostAlloc, torch pin_memory), registered
// (cudaHostRegister) or managed, mapped at the same address on the GPU. Pageable memory
// would fault in the kernel.
inline bool gpu_reachable(uint64_t address) {
  const void* ptr = reinterpret_cast<const void*>(address);
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();  // the query failed: clear it, the answer is "not reachable"
    return false;
  }
  const bool host_visible = attributes.type == cudaMemoryTypeHost ||
                            attributes.type == cudaMemoryTypeManaged;
  return host_visible && attributes.devicePointer == ptr;
}

// Caches must be on the indices' GPU or in host memory that GPU can reach. Checks the first
// and the last byte a transfer may touch.
inline void check_reachable(const TensorView& t, RowLayout layout, int64_t element_bytes,
                            int64_t item_bytes, const char* name, DLDevice gpu,
                            DebugInfo where = {}) {
  const DLDevice device = t.device();
  if (device.device_type == kDLCUDA) {
    detail::check_at(device == gpu, where, "'", name, "' is on ", device,
                     " but the indices are on ", gpu, "; a GPU cache must be on the indices' "
                     "device");
    return;
  }
  if (device.device_type == kDLCUDAHost || layout.rows == 0) return;
  const uint64_t first = address_of(t);
  const uint64_t last = first + (layout.rows - 1) * layout.row_stride * element_bytes +
                        item_bytes - 1;
  detail::check_at(gpu_reachable(first) && gpu_reachable(last), where, "'", name,
                   "' is in pageable host memory, which a kernel cannot touch; allocate it "
                   "pinned (torch: pin_memory=True or .pin_memory())");
}

// Both index lists: 1-d, contiguous, int32 or int64 alike, of equal length, on one GPU.
// The device comes last so that every other mistake is reported first, on CPU tensors too.
struct Indices {
  Indices(const TensorView& dst, const TensorView& src) {
    SymbolicSize length{"indices length"};
    TensorMatcher({length})
        .with_dtype<int32_t, int64_t>(dtype)
        .verify(dst, "indices_dst")
        .verify(src, "indices_src");
    TensorMatcher({length}).with_device<kDLCUDA>(gpu).verify(dst, "indices_dst").verify(
        src, "indices_src");
    size = length.unwrap();
  }
  SymbolicDType dtype{"index dtype"};
  SymbolicDevice gpu{"indices device"};
  int64_t size = 0;
};

// One side of a one-layer transfer, checked: all caches the same rows and dtype, on the
// same device, rows 16-byte aligned.
template <int kNumCaches>
struct OneLayerSide {
  OneLayerSide(const Caches<kNumCaches>& caches, int64_t element_dim, DLDataType dtype,
               const char* dtype_owner, const char* tokens_name, DebugInfo where = {})
      : caches_(caches), tokens_(tokens_name), element_bytes_(dtype.bits / 8) {
    SymbolicSize element{"element dim", element_dim};
    SymbolicDevice device{"cache device"};
    TensorMatcher matcher({tokens_, element});
    matcher.with_strides({-1, 1}).with_device<kDLCUDA, kDLCUDAHost, kDLCPU>(device);
    for (int c = 0; c < kNumCaches; ++c) {
      const TensorView& t = caches.tensors[c];
      const char* const name = caches.names[c];
      detail::check_at(t.dtype() == dtype, where, "'", name, "' has dtype ", t.dtype(),
                       " but '", dtype_owner, "' has ", dtype, "; all caches must share one");
      layouts_[c] = row_layout(t, element_dim, name);
      verify_rows(matcher, t, layouts_[c], element_dim, name);
      check_aligned(address_of(t), layouts_[c].row_stride * element_bytes_, name);
    }
    rows = tokens_.unwrap();
  }

  void check_reachable(int64_t item_bytes, DLDevice gpu) const {
    for (int c = 0; c < kNumCaches; ++c) {
      host::check_reachable(caches_.tensors[c], layouts_[c], element_bytes_, item_bytes,
                            caches_.names[c], gpu);
    }
  }

  CacheRows rows_of(int c) const {
    return {nullptr, address_of(caches_.tensors[c]), layouts_[c].row_stride * element_bytes_};
  }

  int64_t rows = 0;

 private:
  const Caches<kNumCaches>& caches_;
  SymbolicSize tokens_;
  int64_t element_bytes_;
  RowLayout layouts_[kNumCaches]{};
};

// Per-layer base pointer tables: 1-d, one entry per layer, uint64 or int64. Returns the
// number of layers.
template <int kNumCaches>
int64_t verify_pointer_tables(const Caches<kNumCaches>& dst, const Caches<kNumCaches>& src) {
  SymbolicSize layers{"num layers"};
  for (const Caches<kNumCaches>* side : {&dst, &src}) {
    for (int c = 0; c < kNumCaches; ++c) {
      TensorMatcher({layers}).with_dtype<uint64_t, int64_t>().verify(side->tensors[c],
                                                                     side->names[c]);
    }
  }
  return layers.unwrap();
}

// The kernel reads the tables: they must be on the indices' GPU.
template <int kNumCaches>
void check_tables_on(SymbolicDevice& gpu, const Caches<kNumCaches>& dst,
                     const Caches<kNumCaches>& src) {
  for (const Caches<kNumCaches>* side : {&dst, &src}) {
    for (int c = 0; c < kNumCaches; ++c) {
      TensorMatcher({-1}).with_device<kDLCUDA>(gpu).verify(side->tensors[c], side->names[c]);
    }
  }
}

inline void check_stride_bytes(int64_t stride_bytes, int64_t element_bytes, const char* name,
                               DebugInfo where = {}) {
  detail::check_at(stride_bytes % kVecBytes == 0 && stride_bytes >= element_bytes, where, name,
                   " must be a multiple of 16 and at least the element size (", element_bytes,
                   " bytes), got ", stride_bytes);
}

// A row count given from Python, or "not given": then only negative indices are skipped.
inline int64_t row_bound(int64_t rows, const char* name, DebugInfo where = {}) {
  detail::check_at(rows >= kNotGiven, where, name, " must not be negative, got ", rows);
  return rows == kNotGiven ? std::numeric_limits<int64_t>::max() : rows;
}

}  // namespace host

// The entry points, for one element size (bytes per row of a cache) and launch shape.
template <int kElementBytes, int kUnroll, int kThreads>
struct HiCache {
  static_assert(kElementBytes > 0 && kElementBytes % kVecBytes == 0,
                "rows move as 16-byte vectors: the element size must be a multiple of 16");
  static_assert(kUnroll >= 1 && kUnroll <= 8);
  static_assert(kThreads % kWarpThreads == 0 && kResidentThreadsPerSM<kUnroll> % kThreads == 0,
                "blocks must tile the resident threads of an SM");

  static void one_layer(TensorView k_cache_dst, TensorView v_cache_dst, TensorView indices_dst,
                        TensorView k_cache_src, TensorView v_cache_src, TensorView indices_src,
                        int64_t element_dim, int64_t block_quota) {
    one_layer_impl<2>({{k_cache_dst, v_cache_dst}, {"k_cache_dst", "v_cache_dst"}}, indices_dst,
                      {{k_cache_src, v_cache_src}, {"k_cache_src", "v_cache_src"}}, indices_src,
                      element_dim, block_quota);
  }

  static void one_layer_mla(TensorView cache_dst, TensorView indices_dst, TensorView cache_src,
                            TensorView indices_src, int64_t element_dim, int64_t block_quota) {
    one_layer_impl<1>({{cache_dst}, {"cache_dst"}}, indices_dst, {{cache_src}, {"cache_src"}},
                      indices_src, element_dim, block_quota);
  }

  static void all_layer(TensorView k_ptrs_dst, TensorView v_ptrs_dst, TensorView indices_dst,
                        TensorView k_ptrs_src, TensorView v_ptrs_src, TensorView indices_src,
                        int64_t src_stride_bytes, int64_t dst_stride_bytes,
                        int64_t element_size, int64_t src_rows, int64_t dst_rows,
                        int64_t block_quota) {
    all_layer_impl<2>({{k_ptrs_dst, v_ptrs_dst}, {"k_ptrs_dst", "v_ptrs_dst"}}, indices_dst,
                      {{k_ptrs_src, v_ptrs_src}, {"k_ptrs_src", "v_ptrs_src"}}, indices_src,
                      src_stride_bytes, dst_stride_bytes, element_size, src_rows, dst_rows,
                      block_quota);
  }

  static void all_layer_mla(TensorView ptrs_dst, TensorView indices_dst, TensorView ptrs_src,
                            TensorView indices_src, int64_t src_stride_bytes,
                            int64_t dst_stride_bytes, int64_t element_size, int64_t src_rows,
                            int64_t dst_rows, int64_t block_quota) {
    all_layer_impl<1>({{ptrs_dst}, {"ptrs_dst"}}, indices_dst, {{ptrs_src}, {"ptrs_src"}},
                      indices_src, src_stride_bytes, dst_stride_bytes, element_size, src_rows,
                      dst_rows, block_quota);
  }

 private:
  template <int kNumCaches>
  static void one_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t element_dim, int64_t block_quota) {
    check_block_quota(block_quota);
    const DLDataType dtype = dst.tensors[0].dtype();
    const int64_t element_bytes = element_dim * host::dtype_bytes(dtype, dst.names[0]);
    RuntimeCheck(element_bytes == kElementBytes, "element_dim ", element_dim, " of ", dtype,
                 " is ", element_bytes, " bytes, but this kernel moves ", kElementBytes);
    const host::OneLayerSide<kNumCaches> dst_side(dst, element_dim, dtype, dst.names[0],
                                                  "dst tokens");
    const host::OneLayerSide<kNumCaches> src_side(src, element_dim, dtype, dst.names[0],
                                                  "src tokens");
    const host::Indices indices(indices_dst, indices_src);
    const DLDevice gpu = indices.gpu.unwrap();
    dst_side.check_reachable(kElementBytes, gpu);
    src_side.check_reachable(kElementBytes, gpu);
    if (indices.size == 0) return;

    dispatch_index(indices, [&]<typename Index>(Index*) {
      TransferParams<Index, kNumCaches> params{};
      for (int c = 0; c < kNumCaches; ++c) {
        params.dst[c] = dst_side.rows_of(c);
        params.src[c] = src_side.rows_of(c);
      }
      fill_common(params, indices_dst, indices_src, indices.size, 1, src_side.rows,
                  dst_side.rows);
      launch<false>(params, gpu, block_quota);
    });
  }

  template <int kNumCaches>
  static void all_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t src_stride_bytes, int64_t dst_stride_bytes,
                             int64_t element_size, int64_t src_rows, int64_t dst_rows,
                             int64_t block_quota) {
    check_block_quota(block_quota);
    RuntimeCheck(element_size == kElementBytes, "element_size is ", element_size,
                 " bytes, but this kernel moves ", kElementBytes);
    host::check_stride_bytes(src_stride_bytes, element_size, "kv_cache_src_stride_bytes");
    host::check_stride_bytes(dst_stride_bytes, element_size, "kv_cache_dst_stride_bytes");
    const int64_t src_bound = host::row_bound(src_rows, "num_tokens_src");
    const int64_t dst_bound = host::row_bound(dst_rows, "num_tokens_dst");
    const int64_t num_layers = host::verify_pointer_tables(dst, src);
    host::Indices indices(indices_dst, indices_src);
    host::check_tables_on(indices.gpu, dst, src);
    if (indices.size == 0 || num_layers == 0) return;

    dispatch_index(indices, [&]<typename Index>(Index*) {
      TransferParams<Index, kNumCaches> params{};
      for (int c = 0; c < kNumCaches; ++c) {
        params.dst[c] = {table_of(dst.tensors[c]), 0, dst_stride_bytes};
        params.src[c] = {table_of(src.tensors[c]), 0, src_stride_bytes};
      }
      fill_common(params, indices_dst, indices_src, indices.size, num_layers, src_bound,
                  dst_bound);
      launch<true>(params, indices.gpu.unwrap(), block_quota);
    });
  }

  static void check_block_quota(int64_t block_quota, DebugInfo where = {}) {
    detail::check_at(block_quota == kNotGiven || block_quota >= 1, where,
                     "block_quota must be at least 1, got ", block_quota);
  }

  static const uint64_t* table_of(const TensorView& t) {
    return reinterpret_cast<const uint64_t*>(host::address_of(t));
  }

  template <typename F>
  static void dispatch_index(const host::Indices& indices, F&& body) {
    if (indices.dtype.unwrap() == dtype_v<int32_t>) {
      body(static_cast<int32_t*>(nullptr));
    } else {
      body(static_cast<int64_t*>(nullptr));
    }
  }

  template <typename Index, int kNumCaches>
  static void fill_common(TransferParams<Index, kNumCaches>& params, const TensorView& indices_dst,
                          const TensorView& indices_src, int64_t num_items, int64_t num_layers,
                          int64_t src_rows, int64_t dst_rows) {
    params.dst_indices = reinterpret_cast<const Index*>(host::address_of(indices_dst));
    params.src_indices = reinterpret_cast<const Index*>(host::address_of(indices_src));
    params.num_items = num_items;
    params.num_layers = num_layers;
    params.src_rows = src_rows;
    params.dst_rows = dst_rows;
  }

  // Blocks: at most block_quota (by default as many as are resident at once on the GPU),
  // spread over the layers first, and never more than it takes to give every thread one
  // vector: a small transfer uses many SMs lightly rather than a few fully.
  template <bool kAllLayers, typename Index, int kNumCaches>
  static void launch(const TransferParams<Index, kNumCaches>& params, DLDevice gpu,
                     int64_t block_quota) {
    int64_t max_blocks = block_quota;
    if (block_quota == kNotGiven) {
      int sms = 0;
      RuntimeDeviceCheck(
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu.device_id));
      max_blocks = int64_t{sms} * (kResidentThreadsPerSM<kUnroll> / kThreads);
    }
    constexpr int64_t kMaxGridY = 65535;
    const int64_t vecs_per_layer = params.num_items * kNumCaches * (kElementBytes / kVecBytes);
    const int64_t grid_y = min_of(min_of(params.num_layers, max_blocks), kMaxGridY);
    // Never more blocks than vectors to move, never fewer than one.
    const int64_t grid_x =
        max_of(min_of(max_blocks / grid_y, div_ceil(vecs_per_layer, int64_t{kThreads})),
               int64_t{1});
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
    LaunchKernel(grid, kThreads, gpu)(
        kernel::transfer<kElementBytes, kUnroll, kThreads, kAllLayers, Index, kNumCaches>,
        params);
  }
};

}  // namespace jitk::hicache
