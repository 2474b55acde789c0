// Experiment (issue #17, point 4): small HiCache pages beside compute through the copy
// engines, which keep their bandwidth beside a GEMM but need long contiguous runs. CPU
// threads turn scattered host pages into contiguous chunks and back; a GPU kernel does the
// same on the device side, reading and writing device memory only:
//   load-back:  CPU gather (host pool -> pinned chunk) -> H2D copy -> GPU scatter (-> pool)
//   write-back: GPU gather (pool -> device staging) -> D2H copy -> CPU scatter (-> host pool)
// chunk by chunk, so that the CPU works on one chunk while the copy engines move another.
// The GPU half runs per chunk or as one launch a call (beside a GEMM every launch waits for
// SMs). Per-thread streams: one hand-off to the CPU threads a call (not one a chunk), each
// thread moving its own chunks through its own slots on its own stream. Also what these
// pipelines live under: multi-threaded copies and gathers between pinned buffers (host
// memory bandwidth), and blocks held resident (the GEMM's time).
//
// Benchmark only: buffers are flat uint8 tensors, page indices int64 (first slot of each
// page), checked for size; the indices themselves are trusted.
#pragma once

#include <jitk/device.cuh>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <cuda_runtime.h>
#include <emmintrin.h>
#include <xmmintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace jitk::exp_pipeline {

using Clock = std::chrono::steady_clock;
// No wait here lasts longer: a pipeline stage that takes this long is a bug, not a result.
inline constexpr auto kWaitLimit = std::chrono::seconds(10);

// ------------------------------------------------------------------------- thread pool
// workers - 1 threads plus the caller run one job at a time: job(worker, workers). Threads
// spin (with pause) between jobs, the lowest hand-off latency; they sleep after 1 ms idle.
class Pool {
 public:
  explicit Pool(int workers) : workers_(workers) {
    for (int w = 1; w < workers; ++w) threads_.emplace_back([this, w] { loop(w); });
  }
  ~Pool() {
    stop_.store(true);
    for (auto& t : threads_) t.join();
  }
  int workers() const { return workers_; }

  void run(const std::function<void(int, int)>& job) {
    job_ = &job;
    done_.store(0);
    generation_.fetch_add(1, std::memory_order_release);
    job(0, workers_);
    const auto deadline = Clock::now() + kWaitLimit;
    while (done_.load(std::memory_order_acquire) != workers_ - 1) {
      _mm_pause();
      RuntimeCheck(Clock::now() < deadline, "thread pool: ", workers_ - 1 - done_.load(),
                   " workers did not finish a job within 10 s");
    }
  }

 private:
  void loop(int w) {
    uint64_t seen = 0;
    auto idle_since = Clock::now();
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now == seen) {
        if (Clock::now() - idle_since > std::chrono::milliseconds(1)) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {
          _mm_pause();
        }
        continue;
      }
      seen = now;
      (*job_)(w, workers_);
      done_.fetch_add(1, std::memory_order_acq_rel);
      idle_since = Clock::now();
    }
  }

  const int workers_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
};

inline Pool& pool(int workers) {
  static std::unique_ptr<Pool> current;
  RuntimeCheck(workers >= 1 && workers <= 256, "threads must be 1..256, got ", workers);
  if (!current || current->workers() != workers) {
    current.reset();
    current = std::make_unique<Pool>(workers);
  }
  return *current;
}

// Worker w's share [first, last) of n items.
inline void share(int64_t n, int w, int workers, int64_t& first, int64_t& last) {
  first = n * w / workers;
  last = n * (w + 1) / workers;
}

// ------------------------------------------------------------------------- host copies
// 16-byte aligned, a multiple of 64 bytes. Non-temporal stores skip the read-for-ownership
// of the destination and keep it out of the caches (the DMA or a later scatter reads it).
inline void copy_piece(char* to, const char* from, int64_t bytes, bool non_temporal) {
  if (!non_temporal) {
    std::memcpy(to, from, static_cast<size_t>(bytes));
    return;
  }
  for (int64_t i = 0; i < bytes; i += 64) {
    const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(from + i));
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(from + i + 16));
    const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(from + i + 32));
    const __m128i d = _mm_load_si128(reinterpret_cast<const __m128i*>(from + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
  }
}

// Pieces [first, last) of a list: piece i goes from src + from[i] * stride to dst + i * piece
// (gather) or from src + i * piece to dst + to[i] * stride (scatter). The next piece's first
// lines are prefetched while this one moves.
inline void gather(char* dst, const char* src, const int64_t* from, int64_t stride, int64_t piece,
                   int64_t first, int64_t last, bool non_temporal) {
  for (int64_t i = first; i < last; ++i) {
    if (i + 1 < last) {
      const char* next = src + from[i + 1] * stride;
      for (int64_t b = 0; b < piece && b < 512; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    copy_piece(dst + i * piece, src + from[i] * stride, piece, non_temporal);
  }
  if (non_temporal) _mm_sfence();
}

inline void scatter(char* dst, const char* src, const int64_t* to, int64_t stride, int64_t piece,
                    int64_t first, int64_t last, bool non_temporal) {
  for (int64_t i = first; i < last; ++i) {
    copy_piece(dst + to[i] * stride, src + i * piece, piece, non_temporal);
  }
  if (non_temporal) _mm_sfence();
}

// ------------------------------------------------------------------------- GPU side
// The device half: pages between pools (pages at rows idx[p], `stride` bytes a row; pages of
// the first pool, then of the second) and a contiguous staging area, one 16-byte vector per
// thread and step.
struct PagesArgs {
  uint4* staging;
  char* pool[2];
  const int64_t* idx;
  int64_t stride, piece_vecs, pages, total_vecs;
};

template <bool kToStaging>
__global__ void device_pages(const __grid_constant__ PagesArgs a) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < a.total_vecs;
       v += step) {
    const int64_t piece = v / a.piece_vecs;
    const int cache = piece >= a.pages;
    const int64_t page = piece - cache * a.pages;
    uint4* row = reinterpret_cast<uint4*>(a.pool[cache] + a.idx[page] * a.stride) +
                 (v - piece * a.piece_vecs);
    if constexpr (kToStaging) {
      device::store_stream(a.staging + v, device::load_stream(row));
    } else {
      device::store_stream(row, device::load_stream(a.staging + v));
    }
  }
}

inline char* bytes_of(const TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

// `caches` pools (the second may be null for one) in one launch.
inline void launch_device_pages(bool to_staging, char* staging, char* pool0, char* pool1,
                                const int64_t* idx, int64_t stride, int64_t piece, int64_t pages,
                                int64_t blocks, cudaStream_t stream) {
  const PagesArgs a{
      reinterpret_cast<uint4*>(staging),   {pool0, pool1}, idx, stride, piece / 16, pages,
      (pool1 ? 2 : 1) * pages * piece / 16};
  if (a.total_vecs == 0) return;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(blocks, (a.total_vecs + 511) / 512));
  LaunchKernel(grid, 512, stream)(to_staging ? device_pages<true> : device_pages<false>, a);
}

// Holds `blocks` SMs' worth of blocks for `ns` nanoseconds: a stand-in for a resident
// transfer kernel. `heavy` takes 200 KB of shared memory (one block per SM, alone on it).
__global__ void resident(int64_t ns) {
  const int64_t until = jitk::device::now_ns() + ns;
  while (jitk::device::now_ns() < until) jitk::device::pause_ns(1000);
}

// Waits for an event by polling, at most kWaitLimit; gives up (throws) once `stop` is set.
inline void wait_event(cudaEvent_t event, const char* what,
                       const std::atomic<bool>* stop = nullptr) {
  const auto deadline = Clock::now() + kWaitLimit;
  for (;;) {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaSuccess) return;
    RuntimeCheck(state == cudaErrorNotReady, what, ": ", cudaGetErrorString(state));
    RuntimeCheck(Clock::now() < deadline, what, ": not done within 10 s");
    RuntimeCheck(stop == nullptr || !stop->load(std::memory_order_relaxed), what,
                 ": given up, another worker failed");
    _mm_pause();
  }
}

// One event per staging slot, and a side stream for the device half, made once.
struct Resources {
  std::vector<cudaEvent_t> events;
  cudaStream_t side = nullptr;
  cudaEvent_t copied = nullptr;
  cudaEvent_t side_done = nullptr;
  cudaStream_t copy = nullptr;    // load-back's H2D copies in one-launch mode
  cudaEvent_t half_done[2] = {};  // the scatter that last read each half of stage_dev
  int half = 0;

  static Resources& get(int slots) {
    static Resources r;
    while (static_cast<int>(r.events.size()) < slots) {
      cudaEvent_t e;
      RuntimeDeviceCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      r.events.push_back(e);
    }
    if (r.side == nullptr) {
      int least = 0, greatest = 0;
      RuntimeDeviceCheck(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      RuntimeDeviceCheck(cudaStreamCreateWithPriority(&r.side, cudaStreamNonBlocking, greatest));
      RuntimeDeviceCheck(cudaEventCreateWithFlags(&r.copied, cudaEventDisableTiming));
      RuntimeDeviceCheck(cudaEventCreateWithFlags(&r.side_done, cudaEventDisableTiming));
      RuntimeDeviceCheck(cudaStreamCreateWithFlags(&r.copy, cudaStreamNonBlocking));
      for (cudaEvent_t& e : r.half_done) {
        RuntimeDeviceCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    }
    return r;
  }
};

// The buffers one pipeline call uses. K and V (caches = 2) or one cache.
struct Call {
  char* host[2];
  char* gpu[2];
  const int64_t* host_idx;  // CPU, first host row of each page
  const int64_t* gpu_idx;   // GPU, first GPU row of each page
  char* stage_host;         // pinned: slots x caches x chunk_pages x piece
  char* stage_dev;          // GPU: caches x pages x piece
  int64_t caches, pages, piece, row_bytes, chunk_pages, slots, blocks;
  bool non_temporal;

  int64_t slot_bytes() const { return caches * chunk_pages * piece; }  // a chunk's K and V
  int64_t chunks() const { return (pages + chunk_pages - 1) / chunk_pages; }
};

inline Call make_call(TensorView host_k, TensorView host_v, TensorView host_idx, TensorView gpu_k,
                      TensorView gpu_v, TensorView gpu_idx, TensorView stage_host,
                      TensorView stage_dev, int64_t caches, int64_t row_bytes, int64_t page_size,
                      int64_t chunk_pages, int64_t slots, int64_t blocks, bool non_temporal,
                      bool two_halves) {
  Call c{{bytes_of(host_k), bytes_of(host_v)},
         {bytes_of(gpu_k), bytes_of(gpu_v)},
         static_cast<const int64_t*>(static_cast<void*>(bytes_of(host_idx))),
         static_cast<const int64_t*>(static_cast<void*>(bytes_of(gpu_idx))),
         bytes_of(stage_host),
         bytes_of(stage_dev),
         caches,
         host_idx.size(0),
         page_size * row_bytes,
         row_bytes,
         chunk_pages,
         slots,
         blocks,
         non_temporal};
  RuntimeCheck(host_idx.device().device_type != kDLCUDA, "host_idx must be on the CPU");
  RuntimeCheck(gpu_idx.device().device_type == kDLCUDA, "gpu_idx must be on the GPU");
  RuntimeCheck(gpu_idx.size(0) == c.pages, "gpu_idx has ", gpu_idx.size(0), " pages, host_idx ",
               c.pages);
  RuntimeCheck(c.piece % 64 == 0, "a page must be a multiple of 64 bytes, got ", c.piece);
  RuntimeCheck(chunk_pages >= 1 && slots >= 1, "chunk_pages and slots must be >= 1");
  RuntimeCheck(stage_host.numel() >= slots * c.slot_bytes(), "stage_host holds ",
               stage_host.numel(), " bytes, needs ", slots * c.slot_bytes());
  const int64_t dev_bytes = (two_halves ? 2 : 1) * caches * c.pages * c.piece;
  RuntimeCheck(stage_dev.numel() >= dev_bytes, "stage_dev holds ", stage_dev.numel(),
               " bytes, needs ", dev_bytes);
  return c;
}

// Pieces of chunk [first, first + count) of every cache, shared out among the workers:
// move(cache, lo, hi) runs pieces lo..hi of one cache.
template <typename Move>
inline void run_chunk(Pool& workers, int64_t caches, int64_t count, const Move& move) {
  workers.run([&](int w, int n) {
    int64_t a, b;
    share(caches * count, w, n, a, b);  // pieces of K, then of V
    for (int64_t k = 0; k < caches; ++k) {
      const int64_t lo = std::max(a - k * count, int64_t{0});
      const int64_t hi = std::min(b - k * count, count);
      if (lo < hi) move(k, lo, hi);
    }
  });
}

// ------------------------------------------------------------------------- per-thread streams
// The pipelines without a fork-join per chunk: one pool run a call, in which worker w of T
// moves chunks w, w + T, w + 2T, ... alone, through a ring of `slots` pinned slots of its own
// (stage_host + (w x slots + s) x slot bytes; a slot holds the chunk's K pieces, then its V
// pieces, as the shared slots do) and a CUDA stream of its own.

// A worker's stream (non-blocking) and events: slot[s], the last copy into or out of its slot
// s; done, the end of its copies of a load-back call. Made by the calling thread before the
// run (never by a worker), once, and kept.
struct Lane {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> slot;
  cudaEvent_t done = nullptr;
};

class Lanes {
 public:
  // Lanes of `slots` slots for `workers` workers on `device` (current), whose rings start at
  // `stage`, `slot_bytes` a slot. A call of another layout first waits for every copy earlier
  // calls left in flight: its slots may overlap another worker's slot of the old layout.
  static std::vector<Lane>& get(int workers, int64_t slots, int device, const char* stage,
                                int64_t slot_bytes) {
    static Lanes l;
    RuntimeCheck(l.device_ < 0 || l.device_ == device, "per-thread streams: made on device ",
                 l.device_, ", called on device ", device);
    l.device_ = device;
    while (static_cast<int>(l.lanes_.size()) < workers) {
      Lane lane;
      RuntimeDeviceCheck(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
      RuntimeDeviceCheck(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming));
      l.lanes_.push_back(lane);
    }
    for (Lane& lane : l.lanes_) {
      while (static_cast<int64_t>(lane.slot.size()) < slots) {
        cudaEvent_t e;
        RuntimeDeviceCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        lane.slot.push_back(e);
      }
    }
    if (stage != l.stage_ || slots != l.slots_ || slot_bytes != l.slot_bytes_) {
      for (const Lane& lane : l.lanes_) {
        for (cudaEvent_t e : lane.slot) {
          wait_event(e, "per-thread streams: an earlier call's copy, before the layout changes");
        }
      }
      l.stage_ = stage;
      l.slots_ = slots;
      l.slot_bytes_ = slot_bytes;
    }
    return l.lanes_;
  }

 private:
  std::vector<Lane> lanes_;
  int device_ = -1;
  const char* stage_ = nullptr;
  int64_t slots_ = 0, slot_bytes_ = 0;
};

// The first exception the workers of one pool run throw. The pool carries none (a throw on
// a pool thread would end the process; one on the caller's would leave the others running
// the job), so each job catches its own and the caller rethrows the first after the run;
// `failed` makes the other workers give up at their next chunk or wait.
struct FirstError {
  std::atomic<bool> failed{false};
  std::exception_ptr error;

  template <typename Job>
  void guard(const Job& job) noexcept {
    try {
      job();
    } catch (...) {
      bool expected = false;
      if (failed.compare_exchange_strong(expected, true)) error = std::current_exception();
    }
  }
  // After the run (the pool's hand-back orders the workers' writes before this).
  void rethrow() const {
    if (failed.load()) std::rethrow_exception(error);
  }
};

// The per-thread streams' checks and set-up shared by both directions.
inline std::vector<Lane>& lanes_for(const Call& c, const TensorView& stage_host, Pool& workers,
                                    int device, Resources& r) {
  const int64_t slot_bytes = c.slot_bytes();
  const int64_t need = workers.workers() * c.slots * slot_bytes;
  RuntimeCheck(stage_host.numel() >= need, "stage_host holds ", stage_host.numel(),
               " bytes, per-thread streams need ", need, " (", workers.workers(), " rings of ",
               c.slots, " slots of ", slot_bytes, " bytes)");
  // The shared slots overlap the rings: copies the other pipelines left in flight end first.
  for (cudaEvent_t e : r.events) wait_event(e, "per-thread streams: a shared slot's copy");
  return Lanes::get(workers.workers(), c.slots, device, c.stage_host, slot_bytes);
}

// The copies of chunk [first, first + count) between a worker's slot `staged` (K's pieces,
// then V's) and its place in stage_dev, on `stream`, then `event` recorded after them. Also
// when a copy fails (the error is raised after the record): the next user of the slot waits
// for the event alone, which must cover every copy that was issued.
inline void copy_chunk(const Call& c, char* staged, int64_t first, int64_t count, bool to_device,
                       cudaStream_t stream, cudaEvent_t event) {
  cudaError_t error = cudaSuccess;
  for (int64_t k = 0; k < c.caches; ++k) {
    char* const host = staged + k * count * c.piece;
    char* const dev = c.stage_dev + (k * c.pages + first) * c.piece;
    const cudaError_t e = cudaMemcpyAsync(
        to_device ? dev : host, to_device ? host : dev, static_cast<size_t>(count * c.piece),
        to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = e;
  }
  RuntimeDeviceCheck(cudaEventRecord(event, stream));
  RuntimeDeviceCheck(error);
}

// After a pool run: the side stream waits for the copies of the lanes that had chunks.
inline void side_waits_for(Resources& r, const std::vector<Lane>& lanes, int64_t used) {
  for (int64_t w = 0; w < used; ++w) {
    RuntimeDeviceCheck(cudaEventRecord(lanes[w].done, lanes[w].stream));
    RuntimeDeviceCheck(cudaStreamWaitEvent(r.side, lanes[w].done, 0));
  }
}

// Every page of a call between the device staging area and the GPU pools, in one launch on
// the side stream.
inline void launch_all_pages(bool to_staging, const Call& c, cudaStream_t side) {
  launch_device_pages(to_staging, c.stage_dev, c.gpu[0], c.caches == 2 ? c.gpu[1] : nullptr,
                      c.gpu_idx, c.row_bytes, c.piece, c.pages, c.blocks, side);
}

// The stream's later work waits for what the side stream has queued so far.
inline void join_side(Resources& r, cudaStream_t stream) {
  RuntimeDeviceCheck(cudaEventRecord(r.side_done, r.side));
  RuntimeDeviceCheck(cudaStreamWaitEvent(stream, r.side_done, 0));
}

struct Pipeline {
  // Host pool -> GPU pool. Returns when the last chunk is submitted. Per chunk (one_launch
  // false): the H2D copy on the current stream, the GPU scatter on a high-priority side
  // stream that the current stream waits for at the end. One launch: the copies on a stream
  // of their own (into one of two halves of stage_dev, alternately), one scatter of every
  // page on the side stream after the last copy; the current stream waits for it, the next
  // call's copies do not.
  static void load_back(TensorView host_k, TensorView host_v, TensorView host_idx, TensorView gpu_k,
                        TensorView gpu_v, TensorView gpu_idx, TensorView stage_host,
                        TensorView stage_dev, int64_t caches, int64_t row_bytes, int64_t page_size,
                        int64_t chunk_pages, int64_t slots, int64_t threads, int64_t blocks,
                        bool non_temporal, bool one_launch) {
    Call c =
        make_call(host_k, host_v, host_idx, gpu_k, gpu_v, gpu_idx, stage_host, stage_dev, caches,
                  row_bytes, page_size, chunk_pages, slots, blocks, non_temporal, one_launch);
    const cudaStream_t stream = current_stream(gpu_k.device());
    Resources& r = Resources::get(static_cast<int>(slots));
    Pool& workers = pool(static_cast<int>(threads));
    const cudaStream_t copies = one_launch ? r.copy : stream;
    if (one_launch) {
      r.half ^= 1;
      c.stage_dev += r.half * c.caches * c.pages * c.piece;
      RuntimeDeviceCheck(cudaStreamWaitEvent(r.copy, r.half_done[r.half], 0));
    }
    const int64_t slot_bytes = c.slot_bytes();
    for (int64_t first = 0, chunk = 0; first < c.pages; first += c.chunk_pages, ++chunk) {
      const int64_t count = std::min(c.chunk_pages, c.pages - first);
      const int64_t slot = chunk % c.slots;
      char* staged = c.stage_host + slot * slot_bytes;
      // Also a slot whose copy an earlier call left in flight (a fresh event reads done).
      wait_event(r.events[slot], "load-back: a staging slot's copy");
      run_chunk(workers, c.caches, count, [&](int64_t k, int64_t lo, int64_t hi) {
        gather(staged + k * count * c.piece, c.host[k], c.host_idx + first, c.row_bytes, c.piece,
               lo, hi, c.non_temporal);
      });
      for (int64_t k = 0; k < c.caches; ++k) {
        RuntimeDeviceCheck(cudaMemcpyAsync(
            c.stage_dev + (k * c.pages + first) * c.piece, staged + k * count * c.piece,
            static_cast<size_t>(count * c.piece), cudaMemcpyHostToDevice, copies));
      }
      RuntimeDeviceCheck(cudaEventRecord(r.events[slot], copies));
      if (one_launch) continue;
      RuntimeDeviceCheck(cudaEventRecord(r.copied, stream));
      RuntimeDeviceCheck(cudaStreamWaitEvent(r.side, r.copied, 0));
      for (int64_t k = 0; k < c.caches; ++k) {
        launch_device_pages(false, c.stage_dev + (k * c.pages + first) * c.piece, c.gpu[k], nullptr,
                            c.gpu_idx + first, c.row_bytes, c.piece, count, c.blocks, r.side);
      }
    }
    if (one_launch) {
      RuntimeDeviceCheck(cudaEventRecord(r.copied, r.copy));
      RuntimeDeviceCheck(cudaStreamWaitEvent(r.side, r.copied, 0));
      launch_all_pages(false, c, r.side);
      RuntimeDeviceCheck(cudaEventRecord(r.half_done[r.half], r.side));
    }
    join_side(r, stream);
  }

  // GPU pool -> host pool. Returns when every page is in the host pool; the GPU gather runs
  // on the high-priority side stream: per chunk, or (one_launch) every page at once first.
  static void write_back(TensorView host_k, TensorView host_v, TensorView host_idx,
                         TensorView gpu_k, TensorView gpu_v, TensorView gpu_idx,
                         TensorView stage_host, TensorView stage_dev, int64_t caches,
                         int64_t row_bytes, int64_t page_size, int64_t chunk_pages, int64_t slots,
                         int64_t threads, int64_t blocks, bool non_temporal, bool one_launch) {
    const Call c =
        make_call(host_k, host_v, host_idx, gpu_k, gpu_v, gpu_idx, stage_host, stage_dev, caches,
                  row_bytes, page_size, chunk_pages, slots, blocks, non_temporal, false);
    const cudaStream_t stream = current_stream(gpu_k.device());
    Resources& r = Resources::get(static_cast<int>(slots));
    Pool& workers = pool(static_cast<int>(threads));
    const int64_t slot_bytes = c.slot_bytes();
    const int64_t chunks = c.chunks();
    auto gather_on_gpu = [&](int64_t first, int64_t count) {
      RuntimeDeviceCheck(cudaEventRecord(r.copied, stream));  // after the stream's earlier work
      RuntimeDeviceCheck(cudaStreamWaitEvent(r.side, r.copied, 0));
      if (count == c.pages) {
        launch_all_pages(true, c, r.side);
      } else {
        for (int64_t k = 0; k < c.caches; ++k) {
          launch_device_pages(true, c.stage_dev + (k * c.pages + first) * c.piece, c.gpu[k],
                              nullptr, c.gpu_idx + first, c.row_bytes, c.piece, count, c.blocks,
                              r.side);
        }
      }
      join_side(r, stream);
    };
    auto issue = [&](int64_t chunk) {  // (the gather and) the D2H copy of one chunk
      const int64_t first = chunk * c.chunk_pages;
      const int64_t count = std::min(c.chunk_pages, c.pages - first);
      char* staged = c.stage_host + (chunk % c.slots) * slot_bytes;
      if (!one_launch) gather_on_gpu(first, count);
      for (int64_t k = 0; k < c.caches; ++k) {
        RuntimeDeviceCheck(cudaMemcpyAsync(
            staged + k * count * c.piece, c.stage_dev + (k * c.pages + first) * c.piece,
            static_cast<size_t>(count * c.piece), cudaMemcpyDeviceToHost, stream));
      }
      RuntimeDeviceCheck(cudaEventRecord(r.events[chunk % c.slots], stream));
    };
    if (one_launch) gather_on_gpu(0, c.pages);
    for (int64_t chunk = 0; chunk < std::min(chunks, c.slots); ++chunk) issue(chunk);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t first = chunk * c.chunk_pages;
      const int64_t count = std::min(c.chunk_pages, c.pages - first);
      const char* staged = c.stage_host + (chunk % c.slots) * slot_bytes;
      wait_event(r.events[chunk % c.slots], "write-back: a chunk's copy to the host");
      run_chunk(workers, c.caches, count, [&](int64_t k, int64_t lo, int64_t hi) {
        scatter(c.host[k], staged + k * count * c.piece, c.host_idx + first, c.row_bytes, c.piece,
                lo, hi, c.non_temporal);
      });
      if (chunk + c.slots < chunks) issue(chunk + c.slots);
    }
  }

  // Load-back without a fork-join per chunk: one pool run, in which worker w gathers its
  // chunks into its own ring and copies each on its own stream to the chunk's place in one
  // half of stage_dev (alternately, as one_launch; each worker stream first waits for the
  // previous scatter of that half); then the one scatter of every page on the side stream,
  // after every worker stream's copies. The current stream waits for the scatter.
  static void load_back_streams(TensorView host_k, TensorView host_v, TensorView host_idx,
                                TensorView gpu_k, TensorView gpu_v, TensorView gpu_idx,
                                TensorView stage_host, TensorView stage_dev, int64_t caches,
                                int64_t row_bytes, int64_t page_size, int64_t chunk_pages,
                                int64_t slots, int64_t threads, int64_t blocks, bool non_temporal) {
    const int device = gpu_k.device().device_id;
    const DeviceGuard on(device);
    Call c =
        make_call(host_k, host_v, host_idx, gpu_k, gpu_v, gpu_idx, stage_host, stage_dev, caches,
                  row_bytes, page_size, chunk_pages, slots, blocks, non_temporal, true);
    const cudaStream_t stream = current_stream(gpu_k.device());
    Resources& r = Resources::get(static_cast<int>(slots));
    Pool& workers = pool(static_cast<int>(threads));
    const std::vector<Lane>& lanes = lanes_for(c, stage_host, workers, device, r);
    const int64_t slot_bytes = c.slot_bytes();
    const int64_t chunks = c.chunks();
    const int64_t used = std::min<int64_t>(workers.workers(), chunks);  // lanes with a chunk
    r.half ^= 1;
    c.stage_dev += r.half * c.caches * c.pages * c.piece;
    for (int64_t w = 0; w < used; ++w) {
      RuntimeDeviceCheck(cudaStreamWaitEvent(lanes[w].stream, r.half_done[r.half], 0));
    }
    FirstError failure;
    workers.run([&](int w, int n) {
      failure.guard([&] {
        if (w >= chunks) return;
        RuntimeDeviceCheck(cudaSetDevice(device));
        const Lane& lane = lanes[w];
        char* const ring = c.stage_host + w * c.slots * slot_bytes;
        for (int64_t chunk = w, mine = 0; chunk < chunks; chunk += n, ++mine) {
          RuntimeCheck(!failure.failed.load(std::memory_order_relaxed),
                       "load-back, per-thread streams: given up, another worker failed");
          const int64_t first = chunk * c.chunk_pages;
          const int64_t count = std::min(c.chunk_pages, c.pages - first);
          const int64_t slot = mine % c.slots;
          char* const staged = ring + slot * slot_bytes;
          // Also a copy an earlier call left in flight from this slot (a fresh event is done).
          wait_event(lane.slot[slot], "load-back, per-thread streams: a staging slot's copy",
                     &failure.failed);
          for (int64_t k = 0; k < c.caches; ++k) {
            gather(staged + k * count * c.piece, c.host[k], c.host_idx + first, c.row_bytes,
                   c.piece, 0, count, c.non_temporal);
          }
          copy_chunk(c, staged, first, count, true, lane.stream, lane.slot[slot]);
        }
      });
    });
    side_waits_for(r, lanes, used);
    if (failure.failed.load()) {
      // The copies issued still land in this half: a later call's copies into it wait.
      RuntimeDeviceCheck(cudaEventRecord(r.half_done[r.half], r.side));
      failure.rethrow();
    }
    launch_all_pages(false, c, r.side);
    RuntimeDeviceCheck(cudaEventRecord(r.half_done[r.half], r.side));
    join_side(r, stream);
  }

  // Write-back without a fork-join per chunk: the gather of every page on the side stream
  // (after the current stream's earlier work; its later work waits for the gather), then one
  // pool run, in which worker w copies its chunks on its own stream into its own ring, up to
  // `slots` ahead, and scatters each into the host pool when its copy is done. Returns when
  // every page is in the host pool.
  static void write_back_streams(TensorView host_k, TensorView host_v, TensorView host_idx,
                                 TensorView gpu_k, TensorView gpu_v, TensorView gpu_idx,
                                 TensorView stage_host, TensorView stage_dev, int64_t caches,
                                 int64_t row_bytes, int64_t page_size, int64_t chunk_pages,
                                 int64_t slots, int64_t threads, int64_t blocks,
                                 bool non_temporal) {
    const int device = gpu_k.device().device_id;
    const DeviceGuard on(device);
    const Call c =
        make_call(host_k, host_v, host_idx, gpu_k, gpu_v, gpu_idx, stage_host, stage_dev, caches,
                  row_bytes, page_size, chunk_pages, slots, blocks, non_temporal, false);
    const cudaStream_t stream = current_stream(gpu_k.device());
    Resources& r = Resources::get(static_cast<int>(slots));
    Pool& workers = pool(static_cast<int>(threads));
    const std::vector<Lane>& lanes = lanes_for(c, stage_host, workers, device, r);
    const int64_t slot_bytes = c.slot_bytes();
    const int64_t chunks = c.chunks();
    const int64_t used = std::min<int64_t>(workers.workers(), chunks);
    RuntimeDeviceCheck(cudaEventRecord(r.copied, stream));  // after the stream's earlier work
    RuntimeDeviceCheck(cudaStreamWaitEvent(r.side, r.copied, 0));
    launch_all_pages(true, c, r.side);
    join_side(r, stream);
    for (int64_t w = 0; w < used; ++w) {
      RuntimeDeviceCheck(cudaStreamWaitEvent(lanes[w].stream, r.side_done, 0));
    }
    FirstError failure;
    workers.run([&](int w, int n) {
      failure.guard([&] {
        if (w >= chunks) return;
        RuntimeDeviceCheck(cudaSetDevice(device));
        const Lane& lane = lanes[w];
        char* const ring = c.stage_host + w * c.slots * slot_bytes;
        const int64_t mine = (chunks - w + n - 1) / n;  // chunks w, w + n, ...
        auto place = [&](int64_t j, int64_t& first, int64_t& count) {
          first = (w + j * n) * c.chunk_pages;
          count = std::min(c.chunk_pages, c.pages - first);
          return ring + (j % c.slots) * slot_bytes;
        };
        auto issue = [&](int64_t j) {  // the D2H copy of my j-th chunk into its slot
          int64_t first, count;
          char* const staged = place(j, first, count);
          copy_chunk(c, staged, first, count, false, lane.stream, lane.slot[j % c.slots]);
        };
        for (int64_t j = 0; j < std::min(mine, c.slots); ++j) issue(j);
        for (int64_t j = 0; j < mine; ++j) {
          int64_t first, count;
          const char* const staged = place(j, first, count);
          wait_event(lane.slot[j % c.slots], "write-back, per-thread streams: a chunk's copy",
                     &failure.failed);
          for (int64_t k = 0; k < c.caches; ++k) {
            scatter(c.host[k], staged + k * count * c.piece, c.host_idx + first, c.row_bytes,
                    c.piece, 0, count, c.non_temporal);
          }
          if (j + c.slots < mine) issue(j + c.slots);
        }
      });
    });
    if (failure.failed.load()) {
      // The gather and copies left running read and write stage_dev: a later load-back's
      // copies into either half wait for them.
      side_waits_for(r, lanes, used);
      for (cudaEvent_t e : r.half_done) RuntimeDeviceCheck(cudaEventRecord(e, r.side));
      failure.rethrow();
    }
  }

  // The device half alone: pages of two GPU pools to (to_staging) or from a contiguous
  // buffer, in one launch.
  static void device_half(TensorView staging, TensorView gpu_k, TensorView gpu_v,
                          TensorView gpu_idx, int64_t row_bytes, int64_t page_size, int64_t blocks,
                          bool to_staging) {
    const int64_t piece = page_size * row_bytes;
    RuntimeCheck(staging.numel() >= 2 * gpu_idx.size(0) * piece, "staging too small");
    launch_device_pages(to_staging, bytes_of(staging), bytes_of(gpu_k), bytes_of(gpu_v),
                        static_cast<const int64_t*>(static_cast<void*>(bytes_of(gpu_idx))),
                        row_bytes, piece, gpu_idx.size(0), blocks, current_stream(gpu_k.device()));
  }

  // `blocks` blocks that stay resident for `ns` nanoseconds on the current stream; `heavy`:
  // 200 KB of shared memory each, so one block fills an SM.
  static void hold_sms(TensorView on, int64_t blocks, int64_t ns, bool heavy) {
    const int smem = heavy ? 200 * 1024 : 0;
    static const bool raised = [] {
      RuntimeDeviceCheck(
          cudaFuncSetAttribute(resident, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
      return true;
    }();
    (void)raised;
    LaunchKernel(static_cast<unsigned>(blocks), 32, on.device(), smem)(resident, ns);
  }

  // A contiguous copy between host buffers by `threads` threads, `repeats` times; GB/s.
  static double host_copy_gbps(TensorView dst, TensorView src, int64_t threads, int64_t repeats,
                               bool non_temporal) {
    const int64_t bytes = std::min(dst.numel(), src.numel()) / 4096 * 4096;
    Pool& workers = pool(static_cast<int>(threads));
    const auto start = Clock::now();
    for (int64_t r = 0; r < repeats; ++r) {
      workers.run([&](int w, int n) {
        int64_t a, b;
        share(bytes / 4096, w, n, a, b);
        copy_piece(bytes_of(dst) + a * 4096, bytes_of(src) + a * 4096, (b - a) * 4096,
                   non_temporal);
        if (non_temporal) _mm_sfence();
      });
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return static_cast<double>(bytes) * repeats / seconds / 1e9;
  }

  // A gather of pieces of `piece` bytes at rows idx (CPU int64) of src into contiguous dst
  // by `threads` threads, `repeats` times; GB/s.
  static double host_gather_gbps(TensorView dst, TensorView src, TensorView idx, int64_t piece,
                                 int64_t row_bytes, int64_t threads, int64_t repeats,
                                 bool non_temporal) {
    const int64_t n = idx.size(0);
    RuntimeCheck(dst.numel() >= n * piece, "dst too small");
    const int64_t* rows = static_cast<const int64_t*>(static_cast<void*>(bytes_of(idx)));
    Pool& workers = pool(static_cast<int>(threads));
    const auto start = Clock::now();
    for (int64_t r = 0; r < repeats; ++r) {
      workers.run([&](int w, int m) {
        int64_t a, b;
        share(n, w, m, a, b);
        gather(bytes_of(dst), bytes_of(src), rows, row_bytes, piece, a, b, non_temporal);
      });
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return static_cast<double>(n * piece) * repeats / seconds / 1e9;
  }
};

}  // namespace jitk::exp_pipeline
