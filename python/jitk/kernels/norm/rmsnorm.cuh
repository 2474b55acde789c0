// RMSNorm over the last dimension, y = x / sqrt(mean(x^2) + eps) * weight (float32 inside,
// rounded to the dtype), and the fused form residual += input; input = rmsnorm(residual) * weight.
//
//   RMSNorm<kHidden, T>::run(input, weight, out, eps)
//   RMSNorm<kHidden, T>::run_fused_add(input, residual, weight, eps)
//
// Inputs of any rank are rows of the hidden size (jitk/rows.h) whose leading dimensions may
// take two strides (q/k-norm on heads cut from a fused QKV buffer). A row is read once, held in
// registers while its sum of squares is reduced (read twice past 1024 threads x 16 registers),
// by some lanes of a warp or a block, in the widest vectors (<= 16 B) pointers and strides allow.
#pragma once

#include <jitk/device.cuh>
#include <jitk/norm_order.cuh>
#include <jitk/packed.cuh>
#include <jitk/rows.h>
#include <jitk/tensor.h>
#include <jitk/utils.cuh>

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace jitk::norm {

// ---------------------------------------------------------------------------------------
// How a row is spread over threads: a pure function of the hidden size and vector width.

// The largest hidden size: a row's vectors are counted in int, with room to spare.
inline constexpr int kMaxHidden = 1 << 30;
inline constexpr int kShortRowsBlockThreads = 128;

// The launch knobs jitk.autotune and benchmarks/tune_rmsnorm.py sweep: registers a thread would
// rather give x (fewer spread a row over more threads); block 0 prefetching the weight; launch
// with PDL; the widest access in bytes (16, 8 or 4; narrower where the hidden size needs it);
// the register cap of 8 blocks an SM (kMinBlocks). Then the choices that shorten a short
// launch's critical path, each off by default: how a block adds its warps' sums (row_sum); the
// row's offsets worked out before pdl_wait (Row); the row loaded before the weight
// (normalize_in_registers); partial sums of squares (sum_of_squares); and the next kernel let
// launch only once this one's work is done rather than at its start (rmsnorm_kernel). Last, a
// register cap that fits as many blocks in an SM's 2048 threads as their rows leave registers
// for (kFillSm, in place of kRegisterCap's), for long launches of large blocks. And kOneTurn: a
// plain call's block takes its one turn without the loop (normalize_rows). kTwoVectors swaps
// the kernel of plain calls, at the widths it fits, for one of a block a row and two 16-byte
// vectors a thread (TwoVectors); only kPdl and kLateTrigger apply to it.
template <int kRowRegisters_, bool kPrefetchWeight_, bool kPdl_ = true, int kMaxVecBytes_ = 16,
          bool kRegisterCap_ = true, bool kBroadcastSum_ = false, bool kPinOffsets_ = false,
          bool kRowFirst_ = false, int kSumChains_ = 1, bool kLateTrigger_ = false,
          bool kFillSm_ = false, bool kOneTurn_ = false, bool kTwoVectors_ = false>
struct Tuning {
  static_assert(kRowRegisters_ >= 1 && kRowRegisters_ <= kMaxRowRegisters);
  static_assert(kMaxVecBytes_ == 4 || kMaxVecBytes_ == 8 || kMaxVecBytes_ == 16);
  static_assert(kSumChains_ == 1 || kSumChains_ == 2 || kSumChains_ == 4);
  static constexpr int kRowRegisters = kRowRegisters_;
  static constexpr bool kPrefetchWeight = kPrefetchWeight_;
  static constexpr bool kPdl = kPdl_;
  static constexpr int kMaxVecBytes = kMaxVecBytes_;
  static constexpr bool kRegisterCap = kRegisterCap_;
  static constexpr bool kBroadcastSum = kBroadcastSum_;
  static constexpr bool kPinOffsets = kPinOffsets_;
  static constexpr bool kRowFirst = kRowFirst_;
  static constexpr int kSumChains = kSumChains_;
  static constexpr bool kLateTrigger = kLateTrigger_;
  static constexpr bool kFillSm = kFillSm_;
  static constexpr bool kOneTurn = kOneTurn_;
  static constexpr bool kTwoVectors = kTwoVectors_;
  // The knobs in template order, as ints: what the rules module (rules_default_knob) reports.
  static constexpr std::array kKnobs{kRowRegisters_,     int{kPrefetchWeight_}, int{kPdl_},
                                     kMaxVecBytes_,      int{kRegisterCap_},    int{kBroadcastSum_},
                                     int{kPinOffsets_},  int{kRowFirst_},       kSumChains_,
                                     int{kLateTrigger_}, int{kFillSm_},         int{kOneTurn_},
                                     int{kTwoVectors_}};
  // kPdl is a launch attribute only: launches with and without PDL run one kernel.
  using Body = Tuning<kRowRegisters_, kPrefetchWeight_, true, kMaxVecBytes_, kRegisterCap_,
                      kBroadcastSum_, kPinOffsets_, kRowFirst_, kSumChains_, kLateTrigger_,
                      kFillSm_, kOneTurn_, kTwoVectors_>;
};

// default_row_registers (jitk/norm_order.cuh); the prefetch pays when the weight is out of L2
// (each layer has its own).
template <int kRowRegisters>
using DefaultTuningWith = Tuning<kRowRegisters, true>;
template <int kHidden, typename T>
using DefaultTuning = DefaultTuningWith<default_row_registers(kHidden, sizeof(T))>;

// The widest access (at most max_bytes) whose element count divides the hidden size.
constexpr int widest_vec_size(int hidden, int elem_bytes, int max_bytes) {
  int size = max_of(1, max_bytes / elem_bytes);
  while (hidden % size != 0) size /= 2;
  return size;
}
template <typename T>
constexpr int widest_vec_size(int hidden, int max_bytes = 16) {
  return widest_vec_size(hidden, static_cast<int>(sizeof(T)), max_bytes);
}

// Where kTwoVectors' kernel (TwoVectors) fits: a thread two 16-byte vectors, whole warps, at
// most a block's threads; that is, rows of a multiple of 1024 bytes up to 32 KiB.
constexpr bool two_vectors_fit(int hidden, int elem_bytes) {
  const int vec_size = 16 / elem_bytes;
  return hidden % (2 * vec_size * kWarpThreads) == 0 && hidden / (2 * vec_size) <= kMaxBlockThreads;
}

// Whether plain rows of whole vectors run a tuning's own kernel at a width: kTwoVectors where
// TwoVectors fits, the others where an access is more than one element. Elsewhere RMSNorm would
// run the defaults' kernel in its place, so it refuses to build such a tuning, and Python asks
// first (the rules module) rather than build or time a copy of the default.
constexpr bool tuning_applies(int hidden, int elem_bytes, int max_vec_bytes, bool two_vectors) {
  return two_vectors ? two_vectors_fit(hidden, elem_bytes)
                     : widest_vec_size(hidden, elem_bytes, max_vec_bytes) > 1;
}

// One access of a thread, as integer words until the arithmetic (jitk/packed.cuh): what
// combine needs of a layout.
template <typename T, int kVecSize>
struct Access {
  using Pack = device::Packed<T, kVecSize>;
  __device__ static auto unpack(const Pack& p) { return device::unpack<T, kVecSize>(p); }
  __device__ static Pack pack(const auto& f) { return device::pack<T, kVecSize>(f); }
};

template <int kHidden_, typename T_, int kVecSize_, typename Tune>
struct Tiling : Access<T_, kVecSize_> {
  static constexpr int kHidden = kHidden_;
  using T = T_;
  static constexpr int kVecSize = kVecSize_;
  static_assert(kHidden >= 1 && kHidden % kVecSize == 0);

  static constexpr int kVecBytes = kVecSize * static_cast<int>(sizeof(T));
  static constexpr int kVecsPerRow = kHidden / kVecSize;
  // A 16-bit element takes a register of its own; wider vectors one per 4 bytes.
  static constexpr int kVecRegisters = max_of(1, kVecBytes / 4);
  static constexpr int kMaxVecsInRegisters = kMaxRowRegisters / kVecRegisters;
  static constexpr int kThreadsPerRow =
      threads_per_row(kHidden, sizeof(T), kVecSize, Tune::kRowRegisters);
  // A row that a warp covers is reduced with shuffles alone; a longer one needs a block.
  static constexpr bool kSubWarp = kThreadsPerRow <= kWarpThreads;
  static constexpr int kBlockThreads = kSubWarp ? kShortRowsBlockThreads : kThreadsPerRow;
  static constexpr int kRowsPerBlock = kBlockThreads / kThreadsPerRow;
  static constexpr int kRowWarps = kSubWarp ? 1 : kThreadsPerRow / kWarpThreads;
  static constexpr int kVecsPerThread = div_ceil(kVecsPerRow, kThreadsPerRow);
  // Only when 1024 threads are not enough does a thread get more than it keeps in registers.
  static constexpr bool kInRegisters = kVecsPerThread <= kMaxVecsInRegisters;
  // Whether the last slot of some threads lies past the end of the row.
  static constexpr bool kRagged = kVecsPerRow % kThreadsPerRow != 0;
};

// ---------------------------------------------------------------------------------------
// Device side.
// A launch's parameters sit in constant bank 0 from byte 0x210 (sm_90 SASS), so the first 48
// bytes share a 64-byte line with what the driver puts there, and each further line a kernel
// reads is another constant-cache miss on the path of a launch nothing overlaps. Calls on
// plain rows (each tensor one run at one stride, fewer than 2^31 rows) read only those 48
// bytes, as SGLang's whole block is (an H100 run's single calls at or below SGLang's went from
// 3-10 to 14-21 of 30 shapes, with the in-place buckets); rows in two runs read the rest.
// A plain call's grid covers its rows: each block takes one turn (normalize_rows).
struct Params {
  void* x;  // the input; the fused form writes its result here too
  void* y;  // the output; the fused form's residual
  const void* weight;
  int64_t x_stride, y_stride;  // between rows, for plain rows
  uint32_t plain_rows;         // the row count for plain rows, else 0
  float eps;
  // Rows in two runs.
  RowSplit split;  // how rows are numbered, shared by x and y
  RowStrides x_rows, y_rows;
  int64_t rows;
};
static_assert(offsetof(Params, split) == 48, "a plain call's parameters fill one line");

// Slot k of a thread is vector lane + k * kThreadsPerRow of its row. A slot is live when
// its row exists and reaches that far; dead slots are neither read nor written.
template <typename Tiling>
__device__ __forceinline__ int slot_index(int lane, int k) {
  return lane + k * Tiling::kThreadsPerRow;
}
template <typename Tiling>
__device__ __forceinline__ bool slot_live(int lane, int k, bool row_valid) {
  return row_valid && k < Tiling::kVecsPerThread &&
         (k + 1 < Tiling::kVecsPerThread || !Tiling::kRagged ||
          slot_index<Tiling>(lane, k) < Tiling::kVecsPerRow);
}

// Loads slots first .. first + kCount - 1, all issued before any is used; dead ones read 0.
template <typename Tiling, int kCount, typename Pack>
__device__ __forceinline__ void load_slots(Pack (&v)[kCount], const Pack* row, int first, int lane,
                                           bool row_valid) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int k = first + i;
    v[i] = slot_live<Tiling>(lane, k, row_valid) ? row[slot_index<Tiling>(lane, k)] : Pack{};
  }
}

template <typename Tiling, int kCount, typename Pack>
__device__ __forceinline__ void store_slots(Pack* row, const Pack (&v)[kCount], int first, int lane,
                                            bool row_valid) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int k = first + i;
    if (slot_live<Tiling>(lane, k, row_valid)) row[slot_index<Tiling>(lane, k)] = v[i];
  }
}

// kChains running sums: one chain of 32 dependent FMAs (four 16-byte bf16 vectors) is 128
// cycles on the critical path of a short launch; four chains of 8 are a quarter of it.
template <typename Tiling, int kChains, int kCount>
__device__ __forceinline__ float sum_of_squares(const typename Tiling::Pack (&x)[kCount]) {
  float sums[kChains] = {};
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const auto f = Tiling::unpack(x[i]);
#pragma unroll
    for (int e = 0; e < Tiling::kVecSize; ++e) {
      float& sum = sums[(i * Tiling::kVecSize + e) % kChains];
      sum = fmaf(f[e], f[e], sum);
    }
  }
  if constexpr (kChains == 4) return (sums[0] + sums[1]) + (sums[2] + sums[3]);
  if constexpr (kChains == 2) return sums[0] + sums[1];
  return sums[0];
}

// x[i] = f(x[i], y[i]) element by element in float32, rounded to the dtype.
template <typename Tiling, int kCount, typename F>
__device__ __forceinline__ void combine(typename Tiling::Pack (&x)[kCount],
                                        const typename Tiling::Pack (&y)[kCount], F f) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    auto a = Tiling::unpack(x[i]);
    const auto b = Tiling::unpack(y[i]);
#pragma unroll
    for (int e = 0; e < Tiling::kVecSize; ++e) a[e] = f(a[e], b[e]);
    x[i] = Tiling::pack(a);
  }
}

// The scaling step, element by element (the residual sum is a plain add, in its own dtype).
__device__ __forceinline__ auto scale_by(float inv_rms) {
  return [inv_rms](float x, float w) { return x * inv_rms * w; };
}

// A row's sum over its threads, which every one of them gets. Consecutive calls must alternate
// between two scratch buffers (the next call's barrier orders the reuse). Across warps (a
// block a row), with kBroadcastSum every thread adds the warps' sums itself from shared
// memory (a few loads and adds), else each warp shuffles them (5 dependent shuffles, ~25
// cycles each, after the barrier).
template <typename Tiling, bool kBroadcastSum>
__device__ __forceinline__ float row_sum(float sum, float* scratch) {
  if constexpr (Tiling::kSubWarp) {  // a row's lanes are an aligned run of kThreadsPerRow
    return device::warp_sum<Tiling::kThreadsPerRow>(sum);
  } else {
    return device::block_sum<Tiling::kBlockThreads, false, kBroadcastSum>(sum, scratch);
  }
}

// One row's place in each tensor; `valid` is false past the last row (a block's last turn).
template <typename Tiling, bool kFusedAdd, bool kPinOffsets>
struct Row {
  using Pack = typename Tiling::Pack;
  const Pack* input;
  Pack* residual = nullptr;
  Pack* output;
  bool valid;

  // kPinOffsets: the offsets are worked out here, where the row is made; left alone, the
  // compiler may move their 64-bit multiplies into the loop, after pdl_wait, onto the critical
  // path of a short launch. (Pinning the pointers instead would hide that they are global.)
  template <bool kPlain>
  __device__ __forceinline__ Row(const Params& p, int64_t row, bool row_valid,
                                 std::bool_constant<kPlain>)
      : valid(row_valid) {
    if (!valid) row = 0;
    int64_t x_at, y_at;
    if constexpr (kPlain) {
      x_at = row * p.x_stride;
      y_at = row * p.y_stride;
    } else {
      const RowIndex at = p.split.index(row);
      x_at = p.x_rows.offset(at);
      y_at = p.y_rows.offset(at);
    }
    if constexpr (kPinOffsets) {
      device::compute_now(x_at);
      device::compute_now(y_at);
    }
    using T = typename Tiling::T;
    const auto x = reinterpret_cast<Pack*>(static_cast<T*>(p.x) + x_at);
    const auto y = reinterpret_cast<Pack*>(static_cast<T*>(p.y) + y_at);
    input = x;
    output = kFusedAdd ? x : y;
    if constexpr (kFusedAdd) residual = y;
  }
};

// The row stays in registers: read once, reduce, scale by `w` (this thread's slots), write.
// With kRowFirst the weight is loaded here on the first turn, after the row (it waits for the
// reduction anyway, while the row's loads, queued behind it, would delay the reduction);
// otherwise the kernel loaded it before its first turn.
template <typename Tiling, typename Tuning, bool kFusedAdd>
__device__ __forceinline__ void normalize_in_registers(
    const Row<Tiling, kFusedAdd, Tuning::kPinOffsets>& row, const typename Tiling::Pack* weight,
    typename Tiling::Pack (&w)[Tiling::kVecsPerThread], bool first_turn, int lane, float eps,
    float* scratch) {
  typename Tiling::Pack x[Tiling::kVecsPerThread], r[kFusedAdd ? Tiling::kVecsPerThread : 1];
  load_slots<Tiling>(x, row.input, 0, lane, row.valid);
  if constexpr (kFusedAdd) load_slots<Tiling>(r, row.residual, 0, lane, row.valid);
  if (Tuning::kRowFirst && first_turn) load_slots<Tiling>(w, weight, 0, lane, true);
  if constexpr (kFusedAdd) {
    combine<Tiling>(x, r, [](float a, float b) { return a + b; });
    store_slots<Tiling>(row.residual, x, 0, lane, row.valid);
  }
  const float sum = row_sum<Tiling, Tuning::kBroadcastSum>(
      sum_of_squares<Tiling, Tuning::kSumChains>(x), scratch);
  device::keep_packed(w);
  device::keep_packed(x);
  // A division, not a multiply by 1 / kHidden: at widths that are no power of two its slow
  // path's branch keeps ptxas from unpacking x and w for the scaling before the reduction,
  // which the multiply let it do (sm_90: the weight spilled under 5120's 48-register cap).
  combine<Tiling>(x, w, scale_by(rsqrtf(sum / Tiling::kHidden + eps)));
  store_slots<Tiling>(row.output, x, 0, lane, row.valid);
}

// Rows too long for registers: a pass for the sum of squares (storing the residual sum), then
// one that reads the row again, mostly from L2, to scale it; a chunk's loads fly together.
template <typename Tiling, typename Tuning, bool kFusedAdd>
__device__ __forceinline__ void normalize_in_two_passes(
    const Row<Tiling, kFusedAdd, Tuning::kPinOffsets>& row, const typename Tiling::Pack* weight,
    int lane, float eps, float* scratch) {
  constexpr int kChunk = Tiling::kMaxVecsInRegisters;
  float sum_sq = 0.0f;
#pragma unroll 1
  for (int first = 0; first < Tiling::kVecsPerThread; first += kChunk) {
    typename Tiling::Pack x[kChunk];
    load_slots<Tiling>(x, row.input, first, lane, row.valid);
    if constexpr (kFusedAdd) {
      typename Tiling::Pack r[kChunk];
      load_slots<Tiling>(r, row.residual, first, lane, row.valid);
      combine<Tiling>(x, r, [](float a, float b) { return a + b; });
      store_slots<Tiling>(row.residual, x, first, lane, row.valid);
    }
    sum_sq += sum_of_squares<Tiling, Tuning::kSumChains>(x);
  }
  const float inv_rms =
      rsqrtf(row_sum<Tiling, Tuning::kBroadcastSum>(sum_sq, scratch) / Tiling::kHidden + eps);
  // The fused form normalises the sum as stored, which this thread wrote itself.
  const typename Tiling::Pack* source = kFusedAdd ? row.residual : row.input;
#pragma unroll 1
  for (int first = 0; first < Tiling::kVecsPerThread; first += kChunk) {
    typename Tiling::Pack x[kChunk], w[kChunk];
    load_slots<Tiling>(x, source, first, lane, row.valid);
    load_slots<Tiling>(w, weight, first, lane, row.valid);
    combine<Tiling>(x, w, scale_by(inv_rms));
    store_slots<Tiling>(row.output, x, first, lane, row.valid);
  }
}

// The registers a thread plans for: x, the weight and the fused form's residual, row_registers
// each, and 16.
constexpr int register_plan(bool fused_add, int row_registers) {
  return (fused_add ? 3 : 2) * row_registers + 16;
}
// 8 blocks an SM (the register cap that sets) where that leaves a thread its plan at
// kMaxRowRegisters, so 1056 rows fill a wave of an H100 and 1024 rows of 4096 or 5120 in L2
// take one wave, not two as uncapped.
template <typename Tiling, bool kFusedAdd>
inline constexpr int kMinBlocks =
    8 * Tiling::kBlockThreads * register_plan(kFusedAdd, kMaxRowRegisters) <= 65536 ? 8 : 1;
// With kFillSm, as many blocks as an SM's 2048 threads hold while each thread keeps its plan
// for the registers its rows take, counted in the 8 a thread is given at a time: SGLang's
// block of hidden / 16 threads at 12288 holds two blocks an SM where an uncapped one of jitk
// held one; jitk's 384 threads there hold three. Offsets pinned before the wait plan 8 more
// (16 with the row loop), and the fused form's row loop 8: held to the plan without them,
// such bodies spilled 8-164 bytes (sm_90, 4096-12288). No more: 16 for the single turn too
// would cost the short path a block an SM at 12288, and time at 1024 rows in place.
template <typename Tiling, typename Tuning, bool kFusedAdd>
constexpr int fill_sm_blocks() {
  constexpr int kPlan =
      register_plan(kFusedAdd, min_of(Tiling::kVecsPerThread, Tiling::kMaxVecsInRegisters) *
                                   Tiling::kVecRegisters) +
      (Tuning::kPinOffsets ? (Tuning::kOneTurn ? 8 : 16) : 0) +
      (kFusedAdd && !Tuning::kOneTurn ? 8 : 0);
  constexpr int kThreads = Tiling::kBlockThreads;  // whole warps
  int blocks = max_of(1, 2048 / kThreads);
  while (blocks > 1 && 65536 / (blocks * kThreads) / 8 * 8 < kPlan) --blocks;
  return blocks;
}
template <typename Tiling, typename Tuning, bool kFusedAdd>
inline constexpr int kMinBlocksOf = Tuning::kFillSm ? fill_sm_blocks<Tiling, Tuning, kFusedAdd>()
                                    : Tuning::kRegisterCap ? kMinBlocks<Tiling, kFusedAdd>
                                                           : 1;

// A plain call's grid has a block per kRowsPerBlock rows (fewer than 2^31 rows), so a block
// takes one turn, and a block of one row knows its row is there; its offset comes from
// blockIdx.x alone (uniform registers), as in SGLang's. With kOneTurn there is no loop either
// (straight-line code, where ptxas may issue the weight's loads after the sum of squares,
// unless kRowFirst loads them beside the row's; the loop keeps them before the row's).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kPlain>
__device__ __forceinline__ void normalize_rows(const Params& p, int64_t rows) {
  constexpr bool kOneTurn = kPlain && Tuning::kOneTurn;
  constexpr bool kRowPerBlock = Tiling::kRowsPerBlock == 1;
  // Turns alternate; row_sum reads the broadcast sums 16 bytes at a time.
  __shared__ alignas(Tuning::kBroadcastSum ? 16 : 4) float scratch[2][Tiling::kRowWarps];
  const int lane = kRowPerBlock ? static_cast<int>(threadIdx.x)
                                : static_cast<int>(threadIdx.x % Tiling::kThreadsPerRow);
  const int64_t step = int64_t{gridDim.x} * Tiling::kRowsPerBlock;
  const auto* weight = static_cast<const typename Tiling::Pack*>(p.weight);
  const int64_t group = kRowPerBlock ? 0 : threadIdx.x / Tiling::kThreadsPerRow;
  int64_t first = blockIdx.x * int64_t{Tiling::kRowsPerBlock};  // below p.rows: the grid fits
  const auto exists = [&](int64_t r) { return (kPlain && kRowPerBlock) || r < rows; };
  // Addresses and the prefetch (a hint: no value a load returns changes) need no data, so
  // they come before the wait and overlap the previous kernel. One block's prefetch serves all;
  // the others skip it by predicate, not a branch (device::prefetch_l2_if).
  Row<Tiling, kFusedAdd, Tuning::kPinOffsets> row(p, first + group, exists(first + group),
                                                  std::bool_constant<kPlain>{});
  if constexpr (Tuning::kPrefetchWeight) {
#pragma unroll
    for (int k = 0; k < Tiling::kVecsPerThread; ++k) {  // a prefetch per 128-byte line
      const int index = slot_index<Tiling>(lane, k);
      const bool line_start = index * Tiling::kVecBytes % 128 == 0;
      device::prefetch_l2_if(blockIdx.x == 0 && slot_live<Tiling>(lane, k, true) && line_start,
                             weight + index);
    }
  }
  // Launched with PDL, this kernel may start before the previous one is done: wait for it
  // before reading or writing anything. The next may launch now (or, with kLateTrigger, once
  // this block's work is done); either way it waits in turn for this one to finish.
  device::pdl_wait();
  if constexpr (!Tuning::kLateTrigger) device::pdl_launch_dependents();

  // Every thread of a block takes as many turns (on its first row): shuffles, barriers match.
  typename Tiling::Pack w[Tiling::kInRegisters ? Tiling::kVecsPerThread : 1];
  if constexpr (Tiling::kInRegisters && !Tuning::kRowFirst) {
    load_slots<Tiling>(w, weight, 0, lane, true);
  }
  for (int turn = 0, first_turn = 1;; turn ^= 1, first_turn = 0) {
    if constexpr (Tiling::kInRegisters) {
      normalize_in_registers<Tiling, Tuning>(row, weight, w, first_turn, lane, p.eps,
                                             scratch[turn]);
    } else {
      normalize_in_two_passes<Tiling, Tuning>(row, weight, lane, p.eps, scratch[turn]);
    }
    if (kOneTurn || (first += step) >= rows) break;
    row = Row<Tiling, kFusedAdd, Tuning::kPinOffsets>(p, first + group, exists(first + group),
                                                      std::bool_constant<kPlain>{});
  }
  if constexpr (Tuning::kLateTrigger) device::pdl_launch_dependents();
}

// A kernel of its own for plain rows, which reads no parameter past the first line and needs
// only its own registers: as one kernel with both bodies, it took the two-run body's (47-56 a
// thread at 5120 x fp16 on 320 threads, 3 blocks an SM where SGLang's 32 fit 6).
template <typename Tiling, typename Tuning, bool kFusedAdd, bool kPlain>
__global__ void __launch_bounds__(Tiling::kBlockThreads, (kMinBlocksOf<Tiling, Tuning, kFusedAdd>))
    rmsnorm_kernel(const __grid_constant__ Params p) {
  normalize_rows<Tiling, Tuning, kFusedAdd, kPlain>(p, kPlain ? p.plain_rows : p.rows);
}

// ---------------------------------------------------------------------------------------
// kTwoVectors: a block a row, each thread two 16-byte vectors of it half a row apart (SGLang's
// layout for 16-bit rows of a multiple of 512). Warp 0 adds the warps' sums and works out 1/rms
// once, and a second barrier hands it out: every warp adding the sums itself after one barrier
// cost SGLang's kernel time at 1024 rows. At 7168 fp16, with the next kernel let launch at
// the start, ptxas issues the row's two loads and then the weight's, all before the sum of
// squares (with the late trigger, the weight's first), which put 1024 rows as single calls
// level with SGLang where the tuner's earlier choice trailed (verifying_and_tuning.md). Where a
// row is a multiple of 1024 bytes up to 32 KiB (kFits), for plain rows of whole vectors.
template <int kHidden, typename T>
struct TwoVectors : Access<T, 16 / static_cast<int>(sizeof(T))> {
  static constexpr int kVecSize = 16 / static_cast<int>(sizeof(T));
  static constexpr int kThreads = kHidden / (2 * kVecSize);
  static constexpr bool kFits = two_vectors_fit(kHidden, sizeof(T));
};

// `sum` plus the squares of a vector's elements, added a pair at a time.
template <int N>
__device__ __forceinline__ float add_squares(float sum, const device::Vec<float, N>& f) {
#pragma unroll
  for (int i = 0; i < N; i += 2) sum += f[i] * f[i] + f[i + 1] * f[i + 1];
  return sum;
}

template <int kHidden, typename T, bool kFusedAdd, bool kLateTrigger>
__global__ void __launch_bounds__(TwoVectors<kHidden, T>::kThreads)
    rmsnorm_two_vectors_kernel(const __grid_constant__ Params p) {
  using Layout = TwoVectors<kHidden, T>;
  using Pack = typename Layout::Pack;
  constexpr int kThreads = Layout::kThreads;
  constexpr int kWarps = kThreads / kWarpThreads;
  __shared__ float partial[kWarpThreads];  // each warp's sum, then warp 0's 1/rms per lane
  device::pdl_wait();
  if constexpr (!kLateTrigger) device::pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  auto* x = reinterpret_cast<Pack*>(static_cast<T*>(p.x) + row * p.x_stride);
  auto* y = reinterpret_cast<Pack*>(static_cast<T*>(p.y) + row * p.y_stride);
  const auto* weight = static_cast<const Pack*>(p.weight);
  const unsigned first = threadIdx.x, second = threadIdx.x + kThreads;
  Pack v[2] = {x[first], x[second]};
  const Pack w[2] = {weight[first], weight[second]};
  if constexpr (kFusedAdd) {  // y is the residual: the sum rounded, stored, normalised
    const Pack r[2] = {y[first], y[second]};
    combine<Layout>(v, r, [](float a, float b) { return a + b; });
    y[first] = v[0];
    y[second] = v[1];
  }
  float sum = add_squares(add_squares(0.0f, Layout::unpack(v[0])), Layout::unpack(v[1]));
  sum = device::warp_sum(sum);
  const unsigned warp = threadIdx.x / kWarpThreads;
  float inv_rms;
  if constexpr (kWarps == 1) {
    inv_rms = rsqrtf(sum / kHidden + p.eps);
  } else {
    partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
      const unsigned lane = threadIdx.x;
      sum = device::warp_sum(lane < unsigned{kWarps} ? partial[lane] : 0.0f);
      partial[lane] = rsqrtf(sum / kHidden + p.eps);
    }
    __syncthreads();
    inv_rms = partial[warp];
  }
  combine<Layout>(v, w, scale_by(inv_rms));
  Pack* out = kFusedAdd ? x : y;
  out[first] = v[0];
  out[second] = v[1];
  if constexpr (kLateTrigger) device::pdl_launch_dependents();
}

// ---------------------------------------------------------------------------------------
// Host side.
// "row stride 64 < hidden size 128", or the strides of rows in two runs.
struct RowStridesOf {
  const RowView& v;
};
inline void append_to(Text& out, const RowStridesOf& s) {
  if (!s.v.two_runs())
    return append(out, "row stride ", s.v.inner_stride(), " < hidden size ", s.v.row_size());
  append(out, "rows of ", s.v.row_size(), " at strides ", s.v.outer_stride(), " and ",
         s.v.inner_stride(), ", in runs of ", s.v.inner_rows());
}

// Checks one operand; `written` ones must not have rows that overlap.
template <typename T>
RowView check_rows(const TensorView& t, const char* name, bool written, SymbolicSize& rows,
                   SymbolicSize& hidden, SymbolicDevice& device, DebugInfo where = {}) {
  RowView view(t, name, where);
  TensorMatcher({rows, hidden})
      .with_strides({-1, 1})
      .with_dtype<T>()
      .template with_device<kDLCUDA>(device)
      .verify(view.matrix(), name, where);
  RuntimeCheck(where, !written || view.rows_disjoint(), "rows of '", name, "' overlap in memory (",
               RowStridesOf{view}, "), so writing them would race");
  return view;
}

template <typename T>
const void* check_weight(const TensorView& weight, SymbolicSize& hidden, SymbolicDevice& device,
                         DebugInfo where = {}) {
  TensorMatcher({hidden}).with_dtype<T>().template with_device<kDLCUDA>(device).verify(
      weight, "weight", where);
  return pointer::offset(weight.data_ptr(), weight.byte_offset());
}

inline float check_eps(double eps, DebugInfo where = {}) {
  RuntimeCheck(where, std::isfinite(eps) && eps >= 0 && eps <= std::numeric_limits<float>::max(),
               "eps must be finite and >= 0 (as a float32), got ", eps);
  return static_cast<float>(eps);
}

// A tuning (jitk.autotune's choice) applies where it was timed: plain rows whose accesses are
// whole vectors. Rows in two runs, and misaligned ones, run the defaults' kernels, which all
// tunings of a width share: a module of many tunings builds them once.
template <int kHidden, typename T, typename Tune = DefaultTuning<kHidden, T>>
struct RMSNorm {
  static_assert(std::is_same_v<T, fp32_t> || std::is_same_v<T, fp16_t> || std::is_same_v<T, bf16_t>,
                "rmsnorm supports float32, float16 and bfloat16");
  static_assert(kHidden >= 1 && kHidden <= kMaxHidden);
  static_assert(std::is_same_v<Tune, DefaultTuning<kHidden, T>> ||
                    tuning_applies(kHidden, sizeof(T), Tune::kMaxVecBytes, Tune::kTwoVectors),
                "this tuning would run the defaults' kernel at this width (tuning_applies)");

  // out = rmsnorm(input) * weight; out may be input.
  static void run(TensorView input, TensorView weight, TensorView out, double eps) {
    SymbolicSize rows{"rows"}, hidden{"hidden size", kHidden};
    SymbolicDevice device;
    const RowView x = check_rows<T>(input, "input", false, rows, hidden, device);
    const RowView y = check_rows<T>(out, "out", true, rows, hidden, device);
    const void* w = check_weight<T>(weight, hidden, device);
    launch<false>(params(x, y, w, rows.unwrap(), eps), device.unwrap());
  }

  // residual += input; input = rmsnorm(residual) * weight, normalising the sum as stored.
  static void run_fused_add(TensorView input, TensorView residual, TensorView weight, double eps) {
    SymbolicSize rows{"rows"}, hidden{"hidden size", kHidden};
    SymbolicDevice device;
    const RowView x = check_rows<T>(input, "input", true, rows, hidden, device);
    const RowView r = check_rows<T>(residual, "residual", true, rows, hidden, device);
    const void* w = check_weight<T>(weight, hidden, device);
    launch<true>(params(x, r, w, rows.unwrap(), eps), device.unwrap());
  }

 private:
  using Default = DefaultTuning<kHidden, T>;
  template <typename Tuned>
  static constexpr int kVecSizeOf = widest_vec_size<T>(kHidden, Tuned::kMaxVecBytes);

  static Params params(const RowView& x, const RowView& y, const void* weight, int64_t rows,
                       double eps) {
    const RowSplit split = shared_split({&x, &y});
    const RowStrides x_rows = x.strides_in(split), y_rows = y.strides_in(split);
    // Fewer than 2^31 rows: launch_kernel's grid then covers them, one turn a block.
    const bool plain = split.inner_rows() == 0 && rows <= int64_t{INT32_MAX};
    return Params{x.data(),       y.data(),     weight,
                  x_rows.inner,   y_rows.inner, plain ? static_cast<uint32_t>(rows) : 0u,
                  check_eps(eps), split,        x_rows,
                  y_rows,         rows};
  }

  // Whether every access of a kernel of vec_size elements lands on a whole vector.
  static bool vectors_aligned(const Params& p, int vec_size) {
    const auto aligned = [vec_size](const void* ptr) {
      return reinterpret_cast<uintptr_t>(ptr) % (vec_size * sizeof(T)) == 0;
    };
    return vec_size > 1 && aligned(p.x) && aligned(p.y) && aligned(p.weight) &&
           p.x_rows.steps_by(vec_size) && p.y_rows.steps_by(vec_size);
  }

  template <bool kFusedAdd>
  static void launch(const Params& p, DLDevice device) {
    if (p.rows == 0) return;
    constexpr int kVec = kVecSizeOf<Tune>, kDefaultVec = kVecSizeOf<Default>;
    using Pair = TwoVectors<kHidden, T>;
    if constexpr (Tune::kTwoVectors) {
      if (p.plain_rows != 0 && vectors_aligned(p, Pair::kVecSize)) {
        // A block a row: fewer than 2^31 rows, within the grid's limit.
        return LaunchKernel(dim3(p.plain_rows), dim3(Pair::kThreads), device)
            .enable_pdl(Tune::kPdl && kPdlOnAllTargets)(
                rmsnorm_two_vectors_kernel<kHidden, T, kFusedAdd, Tune::kLateTrigger>, p);
      }
    } else if (p.plain_rows != 0 && vectors_aligned(p, kVec)) {
      return launch_kernel<Tiling<kHidden, T, kVec, typename Tune::Body>, Tune, kFusedAdd, true>(
          p, device);
    }
    if (vectors_aligned(p, kDefaultVec)) {
      return launch_default<Tiling<kHidden, T, kDefaultVec, Default>, kFusedAdd>(p, device);
    }
    launch_default<Tiling<kHidden, T, 1, Default>, kFusedAdd>(p, device);
  }

  template <typename Tiles, bool kFusedAdd>
  static void launch_default(const Params& p, DLDevice device) {
    if (p.plain_rows != 0) return launch_kernel<Tiles, Default, kFusedAdd, true>(p, device);
    launch_kernel<Tiles, Default, kFusedAdd, false>(p, device);
  }

  template <typename Tiles, typename Tuned, bool kFusedAdd, bool kPlain>
  static void launch_kernel(const Params& p, DLDevice device) {
    // A block per turn of rows; blocks loop, so a grid capped at the launch limit still covers
    // every row. (A grid of what the GPU holds at once measured slower.)
    const int64_t blocks = min_of(div_ceil(p.rows, int64_t{Tiles::kRowsPerBlock}),
                                  int64_t{std::numeric_limits<int32_t>::max()});
    LaunchKernel(dim3(static_cast<unsigned>(blocks)), dim3(Tiles::kBlockThreads), device)
        .enable_pdl(Tuned::kPdl && kPdlOnAllTargets)(
            rmsnorm_kernel<Tiles, typename Tuned::Body, kFusedAdd, kPlain>, p);
  }
};

// ---------------------------------------------------------------------------------------
// With tuning_applies, the rules jitk.kernels.norm keeps copies of: its rules module exports
// them, and its tests hold the copies to them at every width (hidden size, element bytes).

inline int rules_knob_count() { return static_cast<int>(Tuning<1, true>::kKnobs.size()); }

// The default tuning's knob `index` (Tuning's template order).
inline int rules_default_knob(int hidden, int elem_bytes, int index) {
  using Rest = DefaultTuningWith<kMaxRowRegisters>;
  static_assert(Rest::kKnobs[0] == kMaxRowRegisters, "knob 0 is kRowRegisters");
  RuntimeCheck(index >= 0 && index < rules_knob_count(), "knob index ", index, " is not in 0..",
               rules_knob_count() - 1);
  return index == 0 ? default_row_registers(hidden, elem_bytes) : Rest::kKnobs[index];
}

// The threads a row of a tuning's own kernel is spread over (threads_per_row at the access
// width tuning_applies finds), which with kSumChains and kTwoVectors fixes its summation order.
inline int rules_threads_per_row(int hidden, int elem_bytes, int max_vec_bytes, int row_registers) {
  RuntimeCheck(hidden >= 1 && hidden <= kMaxHidden, "hidden size ", hidden, " is not in 1..",
               kMaxHidden);
  return threads_per_row(hidden, elem_bytes, widest_vec_size(hidden, elem_bytes, max_vec_bytes),
                         row_registers);
}

}  // namespace jitk::norm
