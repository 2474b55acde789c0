// The copy engine's host side (see hicache_copy.cuh): a call's list of copies, its runs of
// pages merged, checked for chained moves, and submitted in batches or one at a time.
// Host code only, as hicache_copy.cuh.

#pragma once

#include <jitk/utils.h>

#if JITK_HOST_HALF
#include "hicache_layout.cuh"

#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace jitk::hicache {
namespace host {

// An array that grows to the largest size asked of it and is reused: a submission's copy
// lists live in one per thread, so calls allocate nothing once warm.
template <typename T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }

  T* data() { return data_; }
  T& push(const T& value) {
    if (size_ == capacity_) grow();
    data_[size_] = value;
    return data_[size_++];
  }
  T& back() { return data_[size_ - 1]; }
  size_t size() const { return size_; }
  void clear() { size_ = 0; }

 private:
  void grow() {
    const size_t capacity = capacity_ > 0 ? 2 * capacity_ : 256;
    T* grown = static_cast<T*>(std::realloc(data_, capacity * sizeof(T)));
    if (grown == nullptr) throw std::bad_alloc();
    data_ = grown;
    capacity_ = capacity;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// Consecutive slots on both sides: `slots` of them from `src` and `dst`.
struct Run {
  int64_t src;
  int64_t dst;
  int64_t slots;
};

// The copies of one call, built on the host and submitted at once.
class CopyList {
 public:
  void clear() {
    runs_.clear();
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    ops_.clear();
    is_op_.clear();
  }

  // Reads one index per page, checks that every page fits every cache of its side, and
  // merges pages that continue each other on both sides into runs.
  template <typename Index, int kNumCaches>
  void collect_runs(const Indices& indices, int64_t page_size, const SlotLayout (&src)[kNumCaches],
                    const SlotLayout (&dst)[kNumCaches], const char* const (&src_names)[kNumCaches],
                    const char* const (&dst_names)[kNumCaches]) {
    const Index* src_indices = reinterpret_cast<const Index*>(address_of(indices.src));
    const Index* dst_indices = reinterpret_cast<const Index*>(address_of(indices.dst));
    for (int64_t i = 0; i < indices.size; i += page_size) {
      const int64_t s = src_indices[i];
      const int64_t d = dst_indices[i];
      bool continues = runs_.size() > 0 && runs_.back().src + runs_.back().slots == s &&
                       runs_.back().dst + runs_.back().slots == d;
      for (int c = 0; c < kNumCaches; ++c) {
        check_page(src[c], s, page_size, "indices_src", i, src_names[c]);
        check_page(dst[c], d, page_size, "indices_dst", i, dst_names[c]);
        continues = continues && src[c].continues_at(s) && dst[c].continues_at(d);
      }
      if (continues) {
        runs_.back().slots += page_size;
      } else {
        runs_.push({s, d, page_size});
      }
    }
  }

  // Every run between the caches at these bases: packed runs as contiguous copies, others
  // as 2-d copies of one row per slot.
  void add_runs(uint64_t src_base, const SlotLayout& src, uint64_t dst_base, const SlotLayout& dst,
                int64_t element_bytes) {
    const bool packed = src.row_stride == element_bytes && dst.row_stride == element_bytes;
    for (size_t r = 0; r < runs_.size(); ++r) {
      const Run& run = runs_.data()[r];
      char* to = reinterpret_cast<char*>(dst_base + dst.offset(run.dst, 0));
      const char* from = reinterpret_cast<const char*>(src_base + src.offset(run.src, 0));
      if (packed || run.slots == 1) {
        push_copy(to, from, static_cast<size_t>(run.slots * element_bytes));
      } else {
        cudaMemcpy3DBatchOp op{};
        op.src.type = cudaMemcpyOperandTypePointer;
        op.src.op.ptr.ptr = const_cast<char*>(from);
        op.src.op.ptr.rowLength = static_cast<size_t>(src.row_stride);
        op.dst.type = cudaMemcpyOperandTypePointer;
        op.dst.op.ptr.ptr = to;
        op.dst.op.ptr.rowLength = static_cast<size_t>(dst.row_stride);
        op.extent =
            make_cudaExtent(static_cast<size_t>(element_bytes), static_cast<size_t>(run.slots), 1);
        op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        op.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        ops_.push(op);
        is_op_.push(true);
      }
    }
  }

  // One contiguous copy, merged into the previous one where it continues it on both sides.
  void add_copy(void* to, const void* from, size_t bytes) {
    if (is_op_.size() > 0 && !is_op_.back() &&
        static_cast<char*>(dsts_.back()) + sizes_.back() == to &&
        static_cast<const char*>(srcs_.back()) + sizes_.back() == from) {
      sizes_.back() += bytes;
      return;
    }
    push_copy(to, from, bytes);
  }

  void submit(cudaStream_t stream, DebugInfo where = {}) {
    RuntimeCheck(where, !chained(), "a destination row of this call is also one of its ",
                 "source rows (moves chained inside one cache): its copies run in no defined ",
                 "order, so no result would be the right one; split the call");
    if (is_capturing(stream, where) || !batch_supported()) {
      submit_in_order(stream, where);
    } else if (stream == nullptr || stream == cudaStreamLegacy) {
      submit_beside_legacy(where);
    } else {
      submit_batches(stream, where);
    }
  }

 private:
  // `cache` names a tensor (quoted in the message) or, in braces, a description.
  static void check_page(const SlotLayout& layout, int64_t first, int64_t page_size,
                         const char* list, int64_t position, const char* cache,
                         DebugInfo where = {}) {
    const char* quote = cache[0] == '(' ? "" : "'";
    RuntimeCheck(where, first >= 0 && first <= layout.slots - page_size, "'", list, "'[", position,
                 "] = ", first, ": a page of ", page_size, " slots from there ", "is outside ",
                 quote, cache, quote, " (", layout.slots, " slots); the ",
                 "copy engine refuses indices it cannot move");
    RuntimeCheck(where, layout.holds(first, page_size), "'", list, "'[", position, "] = ", first,
                 ": a page of ", page_size, " slots from there straddles two ", "pages of ", quote,
                 cache, quote, " (", layout.page_rows.divisor, " slots each)");
  }

  void push_copy(void* to, const void* from, size_t bytes) {
    dsts_.push(to);
    srcs_.push(from);
    sizes_.push(bytes);
    is_op_.push(false);
  }

  // Every copy on its own, in the order they were added.
  void submit_in_order(cudaStream_t stream, DebugInfo where) {
    size_t copy = 0, op = 0;
    for (size_t i = 0; i < is_op_.size(); ++i) {
      if (!is_op_.data()[i]) {
        RuntimeDeviceCheck(cudaMemcpyAsync(dsts_.data()[copy], srcs_.data()[copy],
                                           sizes_.data()[copy], cudaMemcpyDefault, stream),
                           where);
        ++copy;
        continue;
      }
      const cudaMemcpy3DBatchOp& o = ops_.data()[op++];
      RuntimeDeviceCheck(cudaMemcpy2DAsync(o.dst.op.ptr.ptr, o.dst.op.ptr.rowLength,
                                           o.src.op.ptr.ptr, o.src.op.ptr.rowLength, o.extent.width,
                                           o.extent.height, cudaMemcpyDefault, stream),
                         where);
    }
  }

  // Whether a destination overlaps a source: first by the spans the copies cover, then copy
  // by copy (any 2-d copy among overlapping spans counts as overlapping).
  bool chained() {
    Span dst_span, src_span;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      dst_span.cover(dsts_.data()[i], sizes_.data()[i]);
      src_span.cover(srcs_.data()[i], sizes_.data()[i]);
    }
    for (size_t i = 0; i < ops_.size(); ++i) {
      const cudaMemcpy3DBatchOp& o = ops_.data()[i];
      const size_t height = o.extent.height;
      dst_span.cover(o.dst.op.ptr.ptr, (height - 1) * o.dst.op.ptr.rowLength + o.extent.width);
      src_span.cover(o.src.op.ptr.ptr, (height - 1) * o.src.op.ptr.rowLength + o.extent.width);
    }
    if (!dst_span.overlaps(src_span)) return false;
    if (ops_.size() > 0) return true;
    sorted_.clear();
    for (size_t i = 0; i < sizes_.size(); ++i) {
      const uint64_t first = reinterpret_cast<uint64_t>(srcs_.data()[i]);
      sorted_.push({first, first + sizes_.data()[i]});
    }
    std::sort(sorted_.data(), sorted_.data() + sorted_.size());
    uint64_t reach = 0;  // sources as disjoint-or-merged spans: running maximum of the ends
    for (size_t i = 0; i < sorted_.size(); ++i) {
      reach = std::max(reach, sorted_.data()[i].end);
      sorted_.data()[i].end = reach;
    }
    for (size_t i = 0; i < sizes_.size(); ++i) {
      const uint64_t first = reinterpret_cast<uint64_t>(dsts_.data()[i]);
      const uint64_t end = first + sizes_.data()[i];
      // The last source starting before `end` reaches past `first` iff some source overlaps.
      const Interval* after =
          std::lower_bound(sorted_.data(), sorted_.data() + sorted_.size(), Interval{end, 0});
      if (after != sorted_.data() && (after - 1)->end > first) return true;
    }
    return false;
  }

  // The batches on jitk's stream for this device, between two events that order it after the
  // legacy stream's work so far and the legacy stream's later work after it.
  void submit_beside_legacy(DebugInfo where) {
    int device = 0;
    RuntimeDeviceCheck(cudaGetDevice(&device), where);
    const cudaStream_t side = batch_stream(device, where);
    cudaEvent_t before = nullptr, after = nullptr;
    RuntimeDeviceCheck(cudaEventCreateWithFlags(&before, cudaEventDisableTiming), where);
    RuntimeDeviceCheck(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), where);
    RuntimeDeviceCheck(cudaEventRecord(before, cudaStreamLegacy), where);
    RuntimeDeviceCheck(cudaStreamWaitEvent(side, before, 0), where);
    submit_batches(side, where);
    RuntimeDeviceCheck(cudaEventRecord(after, side), where);
    RuntimeDeviceCheck(cudaStreamWaitEvent(cudaStreamLegacy, after, 0), where);
    cudaEventDestroy(before);  // released once their work completes
    cudaEventDestroy(after);
  }

  // One non-blocking stream per device, made at its first use and kept for the process.
  static cudaStream_t batch_stream(int device, DebugInfo where) {
    constexpr int kMaxDevices = 64;
    // Read and set with the compiler's atomic builtins: <atomic> is among the costliest
    // headers for the host compiler to read.
    static cudaStream_t streams[kMaxDevices];
    RuntimeCheck(where, device >= 0 && device < kMaxDevices, "device ", device, " is past the ",
                 kMaxDevices, " devices the copy engines keep a stream for");
    cudaStream_t stream = __atomic_load_n(&streams[device], __ATOMIC_ACQUIRE);
    if (stream != nullptr) return stream;
    cudaStream_t made = nullptr;
    RuntimeDeviceCheck(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking), where);
    if (__atomic_compare_exchange_n(&streams[device], &stream, made, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      return made;
    }
    cudaStreamDestroy(made);  // another thread's stream came first
    return stream;
  }

  struct Span {
    uint64_t first = ~uint64_t{0}, end = 0;
    void cover(const void* at, size_t bytes) {
      const uint64_t from = reinterpret_cast<uint64_t>(at);
      first = std::min(first, from);
      end = std::max(end, from + bytes);
    }
    bool overlaps(const Span& other) const { return first < other.end && other.first < end; }
  };
  struct Interval {
    uint64_t first, end;
    bool operator<(const Interval& other) const { return first < other.first; }
  };

  static constexpr bool batch_supported() { return CUDART_VERSION >= 12080; }
  // Copies per batch call: the driver's host time per host-to-device copy grows with the
  // batch (several times over from batches of 256 to 8192 under CUDA 13), while each call
  // costs its own overhead.
  static constexpr size_t kBatchCopies = 256;

  void submit_batches(cudaStream_t stream, DebugInfo where) {
#if CUDART_VERSION >= 12080
    for (size_t at = 0; at < sizes_.size(); at += kBatchCopies) {
      const size_t count = min_of(sizes_.size() - at, kBatchCopies);
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t first = 0;
#if CUDART_VERSION >= 13000
      RuntimeDeviceCheck(
          cudaMemcpyBatchAsync(dsts_.data() + at, srcs_.data() + at, sizes_.data() + at, count,
                               &attributes, &first, 1, stream),
          where);
#else
      size_t failed = 0;
      RuntimeDeviceCheck(
          cudaMemcpyBatchAsync(dsts_.data() + at, const_cast<void**>(srcs_.data() + at),
                               sizes_.data() + at, count, &attributes, &first, 1, &failed, stream),
          where);
#endif
    }
    for (size_t at = 0; at < ops_.size(); at += kBatchCopies) {
      const size_t count = min_of(ops_.size() - at, kBatchCopies);
#if CUDART_VERSION >= 13000
      RuntimeDeviceCheck(cudaMemcpy3DBatchAsync(count, ops_.data() + at, 0, stream), where);
#else
      size_t failed = 0;
      RuntimeDeviceCheck(cudaMemcpy3DBatchAsync(count, ops_.data() + at, &failed, 0, stream),
                         where);
#endif
    }
#else
    (void)stream;
    (void)where;
#endif
  }

  Scratch<Run> runs_;
  Scratch<void*> dsts_;
  Scratch<const void*> srcs_;
  Scratch<size_t> sizes_;
  Scratch<cudaMemcpy3DBatchOp> ops_;
  Scratch<bool> is_op_;       // the kind of each copy, in the order they were added
  Scratch<Interval> sorted_;  // chained()'s sources
};

// The calling thread's copy list, emptied.
inline CopyList& copy_list() {
  thread_local CopyList list;
  list.clear();
  return list;
}

// The copy engine reads the indices (and pointer tables) on the host.
inline void check_host_readable(const TensorView& t, const char* name, DebugInfo where = {}) {
  RuntimeCheck(where, t.device().device_type != kDLCUDA, "'", name, "' is on ", t.device(),
               ", but the copy engine reads it on the host, during the call: ",
               "pass a CPU tensor, or use method='kernel'");
}

}  // namespace host
}  // namespace jitk::hicache
#endif  // JITK_HOST_HALF
