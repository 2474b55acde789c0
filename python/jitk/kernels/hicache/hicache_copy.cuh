// HiCache KV transfers by the GPU's copy engines: the same calls as hicache.cuh's kernel, but
// no SM moves a byte, so a transfer keeps its bandwidth while compute fills the GPU.
//
// The copy engines take addresses from the host, so this method reads the indices (and the
// all-layer pointer tables) on the host, during the call: they must be CPU tensors. Pages
// that follow each other on both sides merge into one copy; each run is one copy per layer
// and cache: contiguous bytes when both sides' rows are packed, else a 2-d copy (one row per
// slot). A whole call is one cudaMemcpyBatchAsync (plus one cudaMemcpy3DBatchAsync for 2-d
// copies), which costs the host far less per copy than a cudaMemcpyAsync each.
//
// Unlike the kernel, which skips a page it cannot move, this method refuses the call: it sees
// every index before it submits anything.
//
// The batch calls refuse the legacy default stream: there the batches run on a stream of
// jitk's own (one per device) that waits for the legacy stream's work, and the legacy stream
// waits for them. Under CUDA graph capture (where the batch calls cannot be captured) each
// copy is issued on its own, and a captured graph replays the copies of the indices as they
// were at capture.
//
// A batch's copies run in no defined order (nor do the kernel's threads), so a call whose
// destinations overlap its sources (moves chained inside one cache) is refused before any
// copy is issued: no order of its copies is the right one.
//
// Host code only: device code built apart (NVRTC, jitk/nvrtc.cuh) sees none of it.
#pragma once

#include <jitk/utils.h>

#if JITK_HOST_HALF
#include "hicache_copy_list.cuh"
#include "hicache_layout.cuh"

#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>

#include <cstdint>

namespace jitk::hicache {

// The copy-engine entry points. `stream` is the handle of the stream the copies join
// (PyTorch's current stream, passed from Python: the arguments may all be host tensors).
struct CopyEngine {
  static void one_layer(TensorView k_cache_dst, TensorView v_cache_dst, TensorView indices_dst,
                        TensorView k_cache_src, TensorView v_cache_src, TensorView indices_src,
                        int64_t element_dim, int64_t page_size, int64_t stream) {
    one_layer_impl<2>({{k_cache_dst, v_cache_dst}, {"k_cache_dst", "v_cache_dst"}}, indices_dst,
                      {{k_cache_src, v_cache_src}, {"k_cache_src", "v_cache_src"}}, indices_src,
                      element_dim, page_size, stream);
  }

  static void one_layer_mla(TensorView cache_dst, TensorView indices_dst, TensorView cache_src,
                            TensorView indices_src, int64_t element_dim, int64_t page_size,
                            int64_t stream) {
    one_layer_impl<1>({{cache_dst}, {"cache_dst"}}, indices_dst, {{cache_src}, {"cache_src"}},
                      indices_src, element_dim, page_size, stream);
  }

  static void all_layer(TensorView k_ptr_dst, TensorView v_ptr_dst, TensorView indices_dst,
                        TensorView k_ptr_src, TensorView v_ptr_src, TensorView indices_src,
                        int64_t src_stride, int64_t dst_stride, int64_t element_size,
                        int64_t page_size, int64_t page_rows, int64_t src_page_stride,
                        int64_t dst_page_stride, int64_t src_slots, int64_t dst_slots,
                        int64_t stream) {
    all_layer_impl<2>({{k_ptr_dst, v_ptr_dst}, {"k_ptr_dst", "v_ptr_dst"}}, indices_dst,
                      {{k_ptr_src, v_ptr_src}, {"k_ptr_src", "v_ptr_src"}}, indices_src, src_stride,
                      dst_stride, element_size, page_size, page_rows, src_page_stride,
                      dst_page_stride, src_slots, dst_slots, stream);
  }

  static void all_layer_mla(TensorView ptr_dst, TensorView indices_dst, TensorView ptr_src,
                            TensorView indices_src, int64_t src_stride, int64_t dst_stride,
                            int64_t element_size, int64_t page_size, int64_t page_rows,
                            int64_t src_page_stride, int64_t dst_page_stride, int64_t src_slots,
                            int64_t dst_slots, int64_t stream) {
    all_layer_impl<1>({{ptr_dst}, {"ptr_dst"}}, indices_dst, {{ptr_src}, {"ptr_src"}}, indices_src,
                      src_stride, dst_stride, element_size, page_size, page_rows, src_page_stride,
                      dst_page_stride, src_slots, dst_slots, stream);
  }

  // The GPU whose memory `address` is in, or -1 for host memory or an unknown address: the
  // all-layer copies join that GPU's current stream (their pointer tables are host tensors).
  static int64_t pointer_device(int64_t address) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(address)) !=
        cudaSuccess) {
      cudaGetLastError();  // an address the driver does not know: not a GPU's
      return -1;
    }
    const bool on_gpu = attributes.type == cudaMemoryTypeDevice;
    return on_gpu ? attributes.device : -1;
  }

  // The rules Python applies before it builds a kernel module; a test pins the two copies.
  static int64_t vector_bytes() { return kVecBytes; }
  static bool element_size_supported(int64_t bytes) { return element_bytes_supported(bytes); }
  static bool unroll_supported(int64_t unroll) { return hicache::unroll_supported(unroll); }

 private:
  template <int kNumCaches>
  static void one_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t element_dim, int64_t page_size, int64_t stream) {
    const DLDataType dtype = dst.tensors[0].dtype();
    const int64_t element_bytes = element_dim * host::dtype_bytes(dtype, dst.names[0]);
    RuntimeCheck(element_dim > 0 && element_bytes_supported(element_bytes), "element_dim ",
                 element_dim, " of ", dtype, " is ", element_bytes, " bytes; rows must be a ",
                 "positive multiple of 16 bytes, at most ", kMaxElementBytes);
    const host::Indices indices(indices_dst, indices_src, page_size);
    const host::OneLayerSide<kNumCaches> dst_side(dst, element_dim, page_size, dtype, dst.names[0],
                                                  "dst tokens");
    const host::OneLayerSide<kNumCaches> src_side(src, element_dim, page_size, dtype, dst.names[0],
                                                  "src tokens");
    host::check_host_readable(indices_dst, "indices_dst");
    host::check_host_readable(indices_src, "indices_src");
    DLDevice gpu{kDLCUDA, 0};
    if (!dst_side.find_gpu(gpu)) src_side.find_gpu(gpu);
    dst_side.check_reachable(gpu);
    src_side.check_reachable(gpu);
    if (indices.size == 0) return;

    host::CopyList& copies = host::copy_list();
    host::dispatch_index(indices, [&]<typename Index>(Index*) {
      copies.collect_runs<Index, kNumCaches>(indices, page_size, src_side.layouts, dst_side.layouts,
                                             src.names, dst.names);
    });
    for (int c = 0; c < kNumCaches; ++c) {
      copies.add_runs(src_side.base(c), src_side.layouts[c], dst_side.base(c), dst_side.layouts[c],
                      element_bytes);
    }
    copies.submit(reinterpret_cast<cudaStream_t>(stream));
  }

  template <int kNumCaches>
  static void all_layer_impl(const host::Caches<kNumCaches>& dst, const TensorView& indices_dst,
                             const host::Caches<kNumCaches>& src, const TensorView& indices_src,
                             int64_t src_stride, int64_t dst_stride, int64_t element_size,
                             int64_t page_size, int64_t page_rows, int64_t src_page_stride,
                             int64_t dst_page_stride, int64_t src_slots, int64_t dst_slots,
                             int64_t stream) {
    RuntimeCheck(element_bytes_supported(element_size), "element_size is ", element_size,
                 " bytes; rows must be a positive multiple of 16 bytes, at most ",
                 kMaxElementBytes);
    const host::AllLayerArgs<kNumCaches> args(
        dst, indices_dst, src, indices_src, src_stride, dst_stride, element_size, page_size,
        page_rows, src_page_stride, dst_page_stride, src_slots, dst_slots);
    for (const host::Caches<kNumCaches>* side : {&dst, &src}) {
      for (int c = 0; c < kNumCaches; ++c) {
        host::check_host_readable(side->tensors[c], side->names[c]);
      }
    }
    host::check_host_readable(indices_dst, "indices_dst");
    host::check_host_readable(indices_src, "indices_src");
    if (args.indices.size == 0 || args.layers == 0) return;

    host::CopyList& copies = host::copy_list();
    // Every layer and cache of a side shares one layout: check and merge pages once.
    const SlotLayout src_layout[1] = {args.src_layout};
    const SlotLayout dst_layout[1] = {args.dst_layout};
    const char* const src_name[1] = {"(the source layers, num_tokens_src)"};
    const char* const dst_name[1] = {"(the destination layers, num_tokens_dst)"};
    host::dispatch_index(args.indices, [&]<typename Index>(Index*) {
      copies.collect_runs<Index, 1>(args.indices, page_size, src_layout, dst_layout, src_name,
                                    dst_name);
    });
    for (int64_t layer = 0; layer < args.layers; ++layer) {
      for (int c = 0; c < kNumCaches; ++c) {
        copies.add_runs(args.table(src.tensors[c])[layer], args.src_layout,
                        args.table(dst.tensors[c])[layer], args.dst_layout, element_size);
      }
    }
    copies.submit(reinterpret_cast<cudaStream_t>(stream));
  }
};

}  // namespace jitk::hicache
#endif  // JITK_HOST_HALF
