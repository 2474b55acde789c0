// What HiCache's two transfer engines share (the kernel in hicache.cuh, the copy engines in
// hicache_copy.cuh): where each slot (a token's row) of a cache lives, which pages an index
// list names, and the checks both make before they touch memory.
//
// A cache is a set of slots of element_bytes each. A flat cache has its slots one row stride
// apart; a paged cache groups them into pages of page_rows slots, row_stride apart inside a
// page and page_stride apart between pages (SGLang's page_first_direct host layout, whose
// layer view is [page, page_size, ...]). A transfer moves runs of page_size consecutive slots:
// index i of a list names slots i .. i + page_size - 1, and only the first index of each page
// is read. SGLang's calls (every index a slot) come with page_size 1; Python passes a larger
// one only for index_granularity="page".
//
// Device code (NVRTC, jitk/nvrtc.cuh) sees the layouts; the checks are the host half's.
#pragma once

#include <jitk/utils.h>

#if JITK_HOST_HALF
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#endif

namespace jitk::hicache {

// Rows move as 16-byte vectors in the kernel; the copy engines keep the same rule so that a
// call is valid for every method or for none.
inline constexpr int kVecBytes = 16;
// The largest row a module is built for (offsets inside a row are int).
inline constexpr int64_t kMaxElementBytes = int64_t{1} << 20;
// Python's "not given" for optional integers.
inline constexpr int64_t kNotGiven = -1;
// Paged caches and page counts are divided with 32-bit arithmetic.
inline constexpr int64_t kMaxPagedSlots = (int64_t{1} << 31) - 1;  // INT32_MAX

// The template arguments Python may ask for; tests pin Python's copy of these rules to them.
constexpr bool element_bytes_supported(int64_t bytes) {
  return bytes > 0 && bytes % kVecBytes == 0 && bytes <= kMaxElementBytes;
}
constexpr bool unroll_supported(int64_t unroll) {
  return unroll == 1 || unroll == 2 || unroll == 4 || unroll == 8;
}

// n / divisor for n < 2^31 by a multiply and a shift (division by an invariant integer):
// the kernel divides by page sizes known only at run time, once per vector.
struct FastDiv {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  constexpr FastDiv() = default;
  explicit constexpr FastDiv(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d) / d + 1);
  }
  __host__ __device__ constexpr uint32_t quotient(uint32_t n) const {
    return (static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32) + n) >> shift;
  }
};
static_assert(FastDiv(1).quotient(12345) == 12345 && FastDiv(3).quotient(8) == 2 &&
              FastDiv(3).quotient(9) == 3 && FastDiv(64).quotient(127) == 1 &&
              FastDiv(7).quotient(0x7ffffffe) == 0x7ffffffe / 7 &&
              FastDiv(0x7fffffff).quotient(0x7ffffffe) == 0);

// Where the slots of one cache are, relative to its base address (bytes).
struct SlotLayout {
  int64_t slots = 0;        // an index may name slots [0, slots)
  int64_t row_stride = 0;   // between consecutive slots of a page
  int64_t page_stride = 0;  // between pages; paged layouts only
  FastDiv page_rows;        // slots per page; paged layouts only
  bool paged = false;

  // Whether `run` slots from `first` are all in the cache and inside one page.
  __host__ __device__ bool holds(int64_t first, int64_t run) const {
    const bool in_range = first >= 0 && first <= slots - run;
    if (!paged) return in_range;
    const uint32_t safe = in_range ? static_cast<uint32_t>(first) : 0;
    const uint32_t within = safe - page_rows.quotient(safe) * page_rows.divisor;
    return in_range && within + run <= page_rows.divisor;
  }
  // Bytes from the base to slot first + j, for a run that `holds`.
  __host__ __device__ int64_t offset(int64_t first, int64_t j) const {
    if (!paged) return (first + j) * row_stride;
    const uint32_t page = page_rows.quotient(static_cast<uint32_t>(first));
    const int64_t within = first - int64_t{page} * page_rows.divisor;
    return int64_t{page} * page_stride + (within + j) * row_stride;
  }
  // Whether slot `slot` is one row stride after slot - 1 (not across pages): runs of pages
  // merge into one copy only then.
  bool continues_at(int64_t slot) const { return !paged || slot % page_rows.divisor != 0; }
};

#if JITK_HOST_HALF
namespace host {

// The caches of one side of a transfer (K and V, or the one MLA cache) and their names.
template <int kNumCaches>
struct Caches {
  TensorView tensors[kNumCaches];
  const char* names[kNumCaches];
};

// A layout from its parts. Pages whose stride continues the row stride are one flat run.
inline SlotLayout make_layout(int64_t slots, int64_t row_stride, int64_t page_rows,
                              int64_t page_stride) {
  SlotLayout layout;
  layout.slots = slots;
  layout.row_stride = row_stride;
  if (page_rows > 1 && page_stride != page_rows * row_stride) {
    layout.paged = true;
    layout.page_rows = FastDiv(static_cast<uint32_t>(page_rows));
    layout.page_stride = page_stride;
  }
  return layout;
}

// `t` seen as rows of element_dim contiguous elements, the rows (in the order of
// t.view(-1, element_dim)) addressed by at most two strides: a flat cache or a paged one.
// Returns strides in elements; the caller scales them to bytes.
inline SlotLayout slot_layout(const TensorView& t, int64_t element_dim, const char* name,
                              DebugInfo where = {}) {
  const int64_t numel = t.numel();
  RuntimeCheck(where, numel % element_dim == 0, "'", name, "' ", PrintTensor{t}, " has ", numel,
               " elements, not a whole number of rows of element_dim ", element_dim);
  if (numel == 0) return {};

  int dim = t.ndim() - 1;
  int64_t covered = 1;  // elements spanned, contiguously, by the dimensions walked so far
  for (; covered % element_dim != 0; --dim) {
    if (t.size(dim) == 1) continue;
    RuntimeCheck(where, t.stride(dim) == covered, "'", name, "' ", PrintTensor{t},
                 ": a row of element_dim ", element_dim, " elements must be contiguous, ",
                 "but dimension ", dim, " has stride ", t.stride(dim), " where ", covered,
                 " was needed");
    covered *= t.size(dim);
  }
  // Groups of dimensions that step evenly over rows, innermost first: {count, stride}.
  int64_t count[2] = {1, 1};
  int64_t stride[2] = {element_dim, 0};
  int groups = 0;
  if (covered > element_dim) count[groups++] = covered / element_dim;  // rows split one run
  for (; dim >= 0; --dim) {
    if (t.size(dim) == 1) continue;
    const int64_t next = groups > 0 ? stride[groups - 1] * count[groups - 1] : -1;
    if (t.stride(dim) == next) {
      count[groups - 1] *= t.size(dim);
      continue;
    }
    RuntimeCheck(where, groups < 2, "'", name, "' ", PrintTensor{t}, " is not rows of ",
                 "element_dim ", element_dim, " under at most two strides (a row stride ",
                 "and a page stride): dimension ", dim, " has stride ", t.stride(dim), " where ",
                 next, " was needed");
    count[groups] = t.size(dim);
    stride[groups++] = t.stride(dim);
  }
  const int64_t slots = count[0] * count[1];
  // Rows must not overlap: the smaller stride steps over whole rows, the larger over
  // everything the smaller one spans.
  const int small = groups == 2 && stride[1] < stride[0] ? 1 : 0;
  const int large = 1 - small;
  const bool disjoint = (count[small] == 1 || stride[small] >= element_dim) &&
                        (groups < 2 || stride[large] >= count[small] * stride[small]);
  RuntimeCheck(where, disjoint, "'", name, "' ", PrintTensor{t}, ": rows of ", element_dim,
               " elements ", stride[small], " apart overlap");
  const SlotLayout layout = make_layout(slots, stride[0], groups == 2 ? count[0] : 0, stride[1]);
  RuntimeCheck(where, !layout.paged || slots <= kMaxPagedSlots, "'", name, "' is paged ",
               "and has ", slots, " slots; paged caches hold at most ", kMaxPagedSlots);
  return layout;
}

// A layout's slot count as a 2-d tensor, so that a TensorMatcher can check (and name) it.
inline void verify_slots(const TensorMatcher& matcher, const TensorView& t, int64_t slots,
                         int64_t element_dim, const char* name) {
  int64_t shape[2] = {slots, element_dim};
  int64_t strides[2] = {element_dim, 1};
  DLTensor rows{t.data_ptr(), t.device(), 2, t.dtype(), shape, strides, t.byte_offset()};
  matcher.verify(TensorView(&rows), name);
}

inline int64_t dtype_bytes(DLDataType dtype, const char* name, DebugInfo where = {}) {
  RuntimeCheck(where, dtype.bits % 8 == 0 && dtype.lanes == 1, "'", name, "' has dtype ", dtype,
               ", which is not a whole number of bytes");
  return dtype.bits / 8;
}

inline uint64_t address_of(const TensorView& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr()) + t.byte_offset();
}

inline void check_aligned(uint64_t address, const SlotLayout& layout, const char* name,
                          DebugInfo where = {}) {
  RuntimeCheck(where, address % kVecBytes == 0, "'", name, "' starts at ", hex(address),
               ", which is not 16-byte aligned (rows move as 16-byte vectors)");
  RuntimeCheck(where, layout.row_stride % kVecBytes == 0, "'", name, "' has a row ", "stride of ",
               layout.row_stride, " bytes, not a multiple of 16 (rows move ",
               "as 16-byte vectors)");
  RuntimeCheck(where, !layout.paged || layout.page_stride % kVecBytes == 0, "'", name,
               "' has a page stride of ", layout.page_stride, " bytes, not a multiple of ",
               "16 (rows move as 16-byte vectors)");
}

// Host memory the GPU may touch: pinned (cudaHostAlloc, torch pin_memory), registered
// (cudaHostRegister) or managed, mapped at the same address on the GPU. A kernel touching
// pageable memory would fault, and a copy engine would stage it through a synchronous copy.
// A failed query reads "not reachable".
inline bool gpu_reachable(uint64_t address) {
  const void* ptr = reinterpret_cast<const void*>(address);
  const HostMemory memory = query_host_memory(ptr);
  return memory.error == cudaSuccess && (memory.pinned || memory.managed) &&
         memory.device_address == ptr;
}

// Caches must be on `gpu` or in host memory the GPU can reach. Checks the first and the
// last byte a transfer may touch.
inline void check_reachable(const TensorView& t, const SlotLayout& layout, int64_t element_bytes,
                            const char* name, DLDevice gpu, DebugInfo where = {}) {
  const DLDevice device = t.device();
  if (device.device_type == kDLCUDA) {
    RuntimeCheck(where, device == gpu, "'", name, "' is on ", device, " but the transfer ",
                 "runs on ", gpu, "; a GPU cache must be on the transfer's device");
    return;
  }
  if (device.device_type == kDLCUDAHost || layout.slots == 0) return;
  const uint64_t first = address_of(t);
  const uint64_t last = first + layout.offset(layout.slots - 1, 0) + element_bytes - 1;
  RuntimeCheck(where, gpu_reachable(first) && gpu_reachable(last), "'", name,
               "' is in pageable host memory, which the GPU cannot reach; allocate it "
               "pinned (torch: pin_memory=True or .pin_memory())");
}

// Both index lists: 1-d, contiguous, int32 or int64 alike, of equal length, on one device,
// a whole number of pages.
struct Indices {
  Indices(const TensorView& dst, const TensorView& src, int64_t page_size, DebugInfo where = {})
      : dst(dst), src(src) {
    RuntimeCheck(where, page_size >= 1 && page_size <= kMaxPagedSlots, "page_size must be ",
                 "between 1 and ", kMaxPagedSlots, ", got ", page_size);
    SymbolicSize length{"indices length"};
    TensorMatcher({length})
        .with_dtype<int32_t, int64_t>(dtype)
        .with_device<kDLCUDA, kDLCPU, kDLCUDAHost>(device)
        .verify(dst, "indices_dst")
        .verify(src, "indices_src");
    size = length.unwrap();
    RuntimeCheck(where, size % page_size == 0, "'indices_dst' and 'indices_src' hold ", size,
                 " indices, not a whole number of pages of page_size ", page_size,
                 " (a page is page_size consecutive slots, named by its first index)");
    RuntimeCheck(where, size <= kMaxPagedSlots, "at most ", kMaxPagedSlots,
                 " indices fit in one call, got ", size);
    pages = size / page_size;
    on_gpu = device.unwrap().device_type == kDLCUDA;
  }
  const TensorView& dst;  // the entry point's arguments, which outlive this
  const TensorView& src;
  SymbolicDType dtype{"index dtype"};
  SymbolicDevice device{"indices device"};
  int64_t size = 0;
  int64_t pages = 0;
  bool on_gpu = false;
};

// body(static_cast<Index*>(nullptr)) for an index type (int32 or int64).
template <typename F>
void dispatch_index_type(DLDataType dtype, F&& body) {
  if (dtype == dtype_v<int32_t>) {
    body(static_cast<int32_t*>(nullptr));
  } else {
    body(static_cast<int64_t*>(nullptr));
  }
}

// The same for the type of a transfer's indices.
template <typename F>
void dispatch_index(const Indices& indices, F&& body) {
  dispatch_index_type(indices.dtype.unwrap(), body);
}

// One side of a one-layer transfer, checked: all caches the same slots and dtype, rows
// 16-byte aligned, the layout's pages made of whole transfer pages.
template <int kNumCaches>
struct OneLayerSide {
  OneLayerSide(const Caches<kNumCaches>& caches, int64_t element_dim, int64_t page_size,
               DLDataType dtype, const char* dtype_owner, const char* slots_name,
               DebugInfo where = {})
      : caches_(caches), element_bytes_(dtype.bits / 8 * element_dim) {
    SymbolicSize slots{slots_name};
    SymbolicSize element{"element dim", element_dim};
    TensorMatcher matcher({slots, element});
    matcher.with_strides({-1, 1}).with_device<kDLCUDA, kDLCUDAHost, kDLCPU>();
    const int64_t dtype_size = dtype.bits / 8;
    for (int c = 0; c < kNumCaches; ++c) {
      const TensorView& t = caches.tensors[c];
      const char* const name = caches.names[c];
      RuntimeCheck(where, t.dtype() == dtype, "'", name, "' has dtype ", t.dtype(), " but '",
                   dtype_owner, "' has ", dtype, "; all caches must share one");
      SlotLayout layout = slot_layout(t, element_dim, name);
      verify_slots(matcher, t, layout.slots, element_dim, name);
      layout.row_stride *= dtype_size;
      layout.page_stride *= dtype_size;
      check_aligned(address_of(t), layout, name);
      if (layout.paged) {
        RuntimeCheck(where, layout.page_rows.divisor % page_size == 0, "'", name, "' ",
                     PrintTensor{t}, " has pages of ", layout.page_rows.divisor,
                     " slots, which page_size ", page_size, " does not divide: a ",
                     "transfer page must not straddle two pages of the cache");
      }
      layouts[c] = layout;
    }
  }

  void check_reachable(DLDevice gpu) const {
    for (int c = 0; c < kNumCaches; ++c) {
      host::check_reachable(caches_.tensors[c], layouts[c], element_bytes_, caches_.names[c], gpu);
    }
  }
  uint64_t base(int c) const { return address_of(caches_.tensors[c]); }
  // The GPU of the first cache on one, if any.
  bool find_gpu(DLDevice& gpu) const {
    for (int c = 0; c < kNumCaches; ++c) {
      if (caches_.tensors[c].device().device_type == kDLCUDA) {
        gpu = caches_.tensors[c].device();
        return true;
      }
    }
    return false;
  }

  SlotLayout layouts[kNumCaches]{};

 private:
  const Caches<kNumCaches>& caches_;
  int64_t element_bytes_;
};

// Per-layer base pointer tables: 1-d, contiguous, one entry per layer, uint64 or int64, all
// on one device. Returns the number of layers.
template <int kNumCaches>
int64_t verify_pointer_tables(const Caches<kNumCaches>& dst, const Caches<kNumCaches>& src,
                              SymbolicDevice& device) {
  SymbolicSize layers{"num layers"};
  for (const Caches<kNumCaches>* side : {&dst, &src}) {
    for (int c = 0; c < kNumCaches; ++c) {
      TensorMatcher({layers})
          .with_dtype<uint64_t, int64_t>()
          .with_device<kDLCUDA, kDLCPU, kDLCUDAHost>(device)
          .verify(side->tensors[c], side->names[c]);
    }
  }
  return layers.unwrap();
}

// Python's names for the all-layer strides, which differ between K/V and MLA.
template <int kNumCaches>
struct StrideNames {
  static constexpr const char* src =
      kNumCaches == 2 ? "kv_cache_src_stride_bytes" : "cache_src_stride_bytes";
  static constexpr const char* dst =
      kNumCaches == 2 ? "kv_cache_dst_stride_bytes" : "cache_dst_stride_bytes";
  static constexpr const char* src_page =
      kNumCaches == 2 ? "kv_cache_src_page_stride_bytes" : "cache_src_page_stride_bytes";
  static constexpr const char* dst_page =
      kNumCaches == 2 ? "kv_cache_dst_page_stride_bytes" : "cache_dst_page_stride_bytes";
};

inline void check_stride_bytes(int64_t stride_bytes, int64_t element_bytes, const char* name,
                               DebugInfo where = {}) {
  RuntimeCheck(where, stride_bytes % kVecBytes == 0 && stride_bytes >= element_bytes, name,
               " must be a multiple of 16 and at least the element size (", element_bytes,
               " bytes), got ", stride_bytes);
}

// The layout of every layer of an all-layer side, from Python's byte strides: flat unless a
// page stride is given, then pages of page_size slots. Without a slot count (num_tokens_*)
// only negative indices are refused, and paged caches stop at kMaxPagedSlots.
inline SlotLayout all_layer_layout(int64_t stride_bytes, int64_t page_stride_bytes,
                                   int64_t page_size, int64_t slots, int64_t element_bytes,
                                   const char* stride_name, const char* page_stride_name,
                                   const char* slots_name, DebugInfo where = {}) {
  check_stride_bytes(stride_bytes, element_bytes, stride_name, where);
  RuntimeCheck(where, slots >= kNotGiven, slots_name, " must not be negative, got ", slots);
  RuntimeCheck(where, page_size >= 1 && page_size <= kMaxPagedSlots, "page_size must be ",
               "between 1 and ", kMaxPagedSlots, ", got ", page_size);
  int64_t page_bytes = 0;  // checked: a page stride's lower bound must not overflow
  const bool page_bytes_fit = !__builtin_mul_overflow(page_size, stride_bytes, &page_bytes);
  if (page_stride_bytes != kNotGiven) {
    RuntimeCheck(where, page_bytes_fit, "page_size * ", stride_name, " (", page_size, " * ",
                 stride_bytes, ") overflows 64 bits");
    RuntimeCheck(where, page_stride_bytes % kVecBytes == 0 && page_stride_bytes >= page_bytes,
                 page_stride_name, " must be a multiple of 16 and at least ", "page_size * ",
                 stride_name, " (", page_bytes, " bytes), got ", page_stride_bytes);
  }
  // Pages of one slot: the page stride is the row stride.
  if (page_size == 1 && page_stride_bytes != kNotGiven) stride_bytes = page_stride_bytes;
  const bool paged =
      page_size > 1 && page_stride_bytes != kNotGiven && page_stride_bytes != page_bytes;
  const int64_t unbounded = paged ? kMaxPagedSlots : std::numeric_limits<int64_t>::max();
  const int64_t bound = slots == kNotGiven ? unbounded : slots;
  RuntimeCheck(where, !paged || bound <= kMaxPagedSlots, slots_name, " is ", slots,
               "; paged caches hold at most ", kMaxPagedSlots, " slots");
  return make_layout(bound, stride_bytes, paged ? page_size : 0, paged ? page_stride_bytes : 0);
}

// The checked arguments of an all-layer transfer: pointer tables, indices and the layout
// every layer shares on each side.
template <int kNumCaches>
struct AllLayerArgs {
  AllLayerArgs(const Caches<kNumCaches>& dst, const TensorView& indices_dst,
               const Caches<kNumCaches>& src, const TensorView& indices_src, int64_t src_stride,
               int64_t dst_stride, int64_t element_size, int64_t page_size, int64_t page_rows,
               int64_t src_page_stride, int64_t dst_page_stride, int64_t src_slots,
               int64_t dst_slots)
      : indices(indices_dst, indices_src, page_size) {
    using Names = StrideNames<kNumCaches>;
    src_layout = all_layer_layout(src_stride, src_page_stride, page_rows, src_slots, element_size,
                                  Names::src, Names::src_page, "num_tokens_src");
    dst_layout = all_layer_layout(dst_stride, dst_page_stride, page_rows, dst_slots, element_size,
                                  Names::dst, Names::dst_page, "num_tokens_dst");
    layers = verify_pointer_tables(dst, src, tables_device);
  }
  const uint64_t* table(const TensorView& t) const {
    return reinterpret_cast<const uint64_t*>(address_of(t));
  }

  Indices indices;
  SymbolicDevice tables_device{"pointer tables device"};
  SlotLayout src_layout, dst_layout;
  int64_t layers = 0;
};

}  // namespace host
#endif  // JITK_HOST_HALF
}  // namespace jitk::hicache
