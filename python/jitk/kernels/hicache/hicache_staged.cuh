// HiCache's staged write-back (SGLang's transfer_hicache_all_layer_staged_lf_pf): whole pages
// of every layer of a GPU pool (one cache per layer, "layer_first") to a host pool that keeps
// a token's layers together ("page_first", [token, layer, row]), through a GPU staging buffer
// the caller owns.
//
// A page of a page_first host pool is one contiguous block (page_size tokens x layers x row),
// so the write-back is two steps per chunk of pages that fits the staging buffer: a kernel
// gathers each page's rows from every layer into the staging buffer in the host's order, then
// the copy engines move each staged page to its host page, one copy per run of host pages
// that follow each other. The copy engines keep their bandwidth beside compute; the gather
// reads and writes GPU memory only.
//
// As in SGLang, a page is named by the first of its page_size indices: the source's (GPU)
// pages are read in the kernel, the host's (CPU int64 indices) during the call, where every
// host page is checked before anything runs. The source pointer tables are trusted (as in
// every all-layer call): their pages must lie inside the layers they point at.
//
// Written in two halves (jitk/nvrtc.cuh): NVRTC may build the gather kernel apart.
#pragma once

#include <jitk/nvrtc.cuh>

#include "hicache_copy.cuh"
#include "hicache_layout.cuh"

#include <jitk/device.cuh>

#if JITK_HOST_HALF
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cstdint>
#endif

namespace jitk::hicache {

template <typename Index, int kNumCaches>
struct GatherParams {
  const uint64_t* src_layers[kNumCaches];  // GPU tables: one base per layer
  uint4* staging[kNumCaches];              // [tokens, layers, row], contiguous
  const Index* src_indices;                // page p of the chunk starts at src_indices[p * page]
  int64_t row_vecs;                        // 16-byte vectors per row (the source row stride)
  int64_t layers;
  int64_t page_size;
  int64_t total_vecs;  // of one cache
};

namespace kernel {

// One 16-byte vector of one cache per thread and step, in the staging buffer's order, so
// that the writes are coalesced; reads are whole rows of a layer.
template <typename Index, int kNumCaches>
__global__ void gather_pages(const __grid_constant__ GatherParams<Index, kNumCaches> p)
#if JITK_DEVICE_HALF
{
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < p.total_vecs;
       v += step) {
    const int64_t row = v / p.row_vecs;  // token * layers + layer
    const int64_t vec = v - row * p.row_vecs;
    const int64_t token = row / p.layers;
    const int64_t layer = row - token * p.layers;
    const int64_t page = token / p.page_size;
    const int64_t slot =
        static_cast<int64_t>(p.src_indices[page * p.page_size]) + (token - page * p.page_size);
#pragma unroll
    for (int c = 0; c < kNumCaches; ++c) {
      const uint4* from =
          reinterpret_cast<const uint4*>(p.src_layers[c][layer]) + slot * p.row_vecs + vec;
      device::store_stream(p.staging[c] + v, device::load_stream(from));
    }
  }
}
#else
    ;
#endif

}  // namespace kernel

#if JITK_HOST_HALF

struct StagedWriteBack {
  static void lf_pf(TensorView k_ptr_src, TensorView v_ptr_src, TensorView src_indices,
                    TensorView dst_indices, TensorView staging_k, TensorView staging_v,
                    TensorView dst_k, TensorView dst_v, int64_t page_size, int64_t element_size,
                    int64_t block_quota) {
    run<2>({{k_ptr_src, v_ptr_src}, {"k_ptr_src", "v_ptr_src"}}, src_indices, dst_indices,
           {{staging_k, staging_v}, {"staging_k", "staging_v"}},
           {{dst_k, dst_v}, {"dst_k", "dst_v"}}, page_size, element_size, block_quota);
  }

  static void lf_pf_mla(TensorView ptr_src, TensorView src_indices, TensorView dst_indices,
                        TensorView staging, TensorView dst, int64_t page_size, int64_t element_size,
                        int64_t block_quota) {
    run<1>({{ptr_src}, {"ptr_src"}}, src_indices, dst_indices, {{staging}, {"staging"}},
           {{dst}, {"dst"}}, page_size, element_size, block_quota);
  }

 private:
  // Blocks of the gather unless block_quota says fewer: enough to fill the GPU's SMs.
  static constexpr int kThreads = 512;
  static constexpr int64_t kBlocksPerSm = 4;

  template <int kNumCaches>
  static void run(const host::Caches<kNumCaches>& src, const TensorView& src_indices,
                  const TensorView& dst_indices, const host::Caches<kNumCaches>& staging,
                  const host::Caches<kNumCaches>& dst, int64_t page_size, int64_t element_size,
                  int64_t block_quota) {
    RuntimeCheck(page_size >= 1 && page_size <= kMaxPagedSlots, "page_size must be between 1 ",
                 "and ", kMaxPagedSlots, ", got ", page_size);
    RuntimeCheck(block_quota == kNotGiven || block_quota >= 1,
                 "block_quota must be at least 1, got ", block_quota);
    SymbolicSize capacity{"staging tokens"}, layers{"num layers"}, row{"row elements"},
        slots{"host tokens"}, length{"indices length"};
    SymbolicDType index_dtype{"index dtype"};
    const DLDataType dtype = staging.tensors[0].dtype();
    SymbolicDevice gpu{"staging device"};
    for (int c = 0; c < kNumCaches; ++c) {
      TensorMatcher({capacity, layers, row})
          .with_device<kDLCUDA>(gpu)
          .verify(staging.tensors[c], staging.names[c]);
      TensorMatcher({slots, layers, row})
          .with_device<kDLCPU, kDLCUDAHost>()
          .verify(dst.tensors[c], dst.names[c]);
      for (const TensorView* t : {&staging.tensors[c], &dst.tensors[c]}) {
        RuntimeCheck(t->dtype() == dtype, "'",
                     t == &dst.tensors[c] ? dst.names[c] : staging.names[c], "' has dtype ",
                     t->dtype(), ", but '", staging.names[0], "' ", dtype);
      }
      TensorMatcher({layers}).with_dtype<uint64_t, int64_t>().with_device<kDLCUDA>(gpu).verify(
          src.tensors[c], src.names[c]);
    }
    TensorMatcher({length})
        .with_dtype<int32_t, int64_t>(index_dtype)
        .with_device<kDLCUDA>(gpu)
        .verify(src_indices, "src_indices");
    TensorMatcher({length}).with_dtype<int64_t>().with_device<kDLCPU>().verify(dst_indices,
                                                                               "dst_indices");

    const int64_t row_bytes = row.unwrap() * host::dtype_bytes(dtype, staging.names[0]);
    RuntimeCheck(element_size == row_bytes, "element_size is ", element_size, " bytes, but a ",
                 "row of '", staging.names[0], "' is ", row_bytes);
    RuntimeCheck(element_bytes_supported(row_bytes), "rows of ", row_bytes, " bytes cannot ",
                 "move as 16-byte vectors: the element size must be a multiple of 16");
    const int64_t num = length.unwrap();
    RuntimeCheck(num % page_size == 0, "'src_indices' and 'dst_indices' hold ", num,
                 " indices, not a whole number of pages of page_size ", page_size);
    const int64_t staged_pages = capacity.unwrap() / page_size;
    RuntimeCheck(staged_pages >= 1 || num == 0, "the staging buffers hold ", capacity.unwrap(),
                 " tokens, less than one page of ", page_size);
    const int64_t page_bytes = page_size * layers.unwrap() * row_bytes;
    const int64_t* host_pages = static_cast<const int64_t*>(dst_indices.data_ptr());
    for (int64_t i = 0; i < num; i += page_size) {
      RuntimeCheck(host_pages[i] >= 0 && host_pages[i] <= slots.unwrap() - page_size,
                   "'dst_indices'[", i, "] = ", host_pages[i], ": a page of ", page_size,
                   " tokens from there is outside the host pool (", slots.unwrap(), " tokens)");
    }
    for (int c = 0; c < kNumCaches; ++c) {
      check_staging_and_host(staging.tensors[c], staging.names[c], dst.tensors[c], dst.names[c],
                             slots.unwrap() * layers.unwrap() * row_bytes);
    }
    if (num == 0 || layers.unwrap() == 0) return;

    const DLDevice device = gpu.unwrap();
    const cudaStream_t stream = current_stream(device);
    int sms = 0;
    RuntimeDeviceCheck(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.device_id));
    const int64_t max_blocks = block_quota == kNotGiven ? sms * kBlocksPerSm : block_quota;
    const int64_t pages = num / page_size;
    for (int64_t first = 0; first < pages; first += staged_pages) {
      const int64_t count = min_of(staged_pages, pages - first);
      const int64_t offset = first * page_size;
      host::dispatch_index_type(index_dtype.unwrap(), [&]<typename Index>(Index*) {
        GatherParams<Index, kNumCaches> params{};
        for (int c = 0; c < kNumCaches; ++c) {
          params.src_layers[c] =
              reinterpret_cast<const uint64_t*>(host::address_of(src.tensors[c]));
          params.staging[c] = reinterpret_cast<uint4*>(host::address_of(staging.tensors[c]));
        }
        params.src_indices = reinterpret_cast<const Index*>(host::address_of(src_indices)) + offset;
        params.row_vecs = row_bytes / kVecBytes;
        params.layers = layers.unwrap();
        params.page_size = page_size;
        params.total_vecs = count * page_bytes / kVecBytes;
        const int64_t blocks = min_of(max_blocks, div_ceil(params.total_vecs, int64_t{kThreads}));
        LaunchKernel(static_cast<unsigned>(blocks), kThreads, stream)
            .template launch<kernel::gather_pages<Index, kNumCaches>>(params);
      });
      host::CopyList& copies = host::copy_list();
      for (int c = 0; c < kNumCaches; ++c) {
        const char* staged = reinterpret_cast<const char*>(host::address_of(staging.tensors[c]));
        char* host_pool = reinterpret_cast<char*>(host::address_of(dst.tensors[c]));
        for (int64_t p = 0; p < count; ++p) {
          const int64_t host_token = host_pages[offset + p * page_size];
          copies.add_copy(host_pool + host_token * layers.unwrap() * row_bytes,
                          staged + p * page_bytes, static_cast<size_t>(page_bytes));
        }
      }
      copies.submit(stream);
    }
  }

  // The staging buffers must be 16-byte aligned for the gather; the host pool must be memory
  // the copy engines reach without a synchronous bounce (pinned or registered).
  static void check_staging_and_host(const TensorView& staging, const char* staging_name,
                                     const TensorView& dst, const char* dst_name,
                                     int64_t dst_bytes) {
    RuntimeCheck(host::address_of(staging) % kVecBytes == 0, "'", staging_name,
                 "' is not 16-byte aligned");
    if (dst.device().device_type == kDLCUDAHost || dst_bytes == 0) return;
    const uint64_t first = host::address_of(dst);
    RuntimeCheck(host::gpu_reachable(first) && host::gpu_reachable(first + dst_bytes - 1), "'",
                 dst_name, "' is in pageable host memory; allocate the host pool pinned ",
                 "(torch: pin_memory=True) or register it (cudaHostRegister)");
  }
};
#endif  // JITK_HOST_HALF

}  // namespace jitk::hicache
