// How jitk::norm::RMSNorm (rmsnorm.cuh) spreads a row over threads: the launch knobs (Tuning),
// the rules of a width, the tiling of a row into slots, the kernels' parameters, and a
// thread's loads and stores of its slots. Included by rmsnorm_kernels.cuh.
#pragma once

#include <jitk/device.cuh>
#include <jitk/norm_order.cuh>
#include <jitk/packed.cuh>
#include <jitk/rows.h>
#include <jitk/utils.cuh>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <array>
#include <cstddef>
#include <cstdint>
#endif

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
#if JITK_HOST_HALF
  // The knobs in template order, as ints: what the rules module (rules_default_knob) reports.
  static constexpr std::array kKnobs{kRowRegisters_,     int{kPrefetchWeight_}, int{kPdl_},
                                     kMaxVecBytes_,      int{kRegisterCap_},    int{kBroadcastSum_},
                                     int{kPinOffsets_},  int{kRowFirst_},       kSumChains_,
                                     int{kLateTrigger_}, int{kFillSm_},         int{kOneTurn_},
                                     int{kTwoVectors_}};
#endif
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
using DefaultTuning = DefaultTuningWith<default_row_registers(kHidden, kElemBytes<T>)>;

// The widest access (at most max_bytes) whose element count divides the hidden size.
constexpr int widest_vec_size(int hidden, int elem_bytes, int max_bytes) {
  int size = max_of(1, max_bytes / elem_bytes);
  while (hidden % size != 0) size /= 2;
  return size;
}
template <typename T>
constexpr int widest_vec_size(int hidden, int max_bytes = 16) {
  return widest_vec_size(hidden, kElemBytes<T>, max_bytes);
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
#if JITK_DEVICE_HALF
  __device__ static auto unpack(const Pack& p) { return device::unpack<T, kVecSize>(p); }
  __device__ static Pack pack(const auto& f) { return device::pack<T, kVecSize>(f); }
#endif
};

template <int kHidden_, typename T_, int kVecSize_, typename Tune>
struct Tiling : Access<T_, kVecSize_> {
  static constexpr int kHidden = kHidden_;
  using T = T_;
  static constexpr int kVecSize = kVecSize_;
  static_assert(kHidden >= 1 && kHidden % kVecSize == 0);

  static constexpr int kVecBytes = kVecSize * kElemBytes<T>;
  static constexpr int kVecsPerRow = kHidden / kVecSize;
  // A 16-bit element takes a register of its own; wider vectors one per 4 bytes.
  static constexpr int kVecRegisters = max_of(1, kVecBytes / 4);
  static constexpr int kMaxVecsInRegisters = kMaxRowRegisters / kVecRegisters;
  static constexpr int kThreadsPerRow =
      threads_per_row(kHidden, kElemBytes<T>, kVecSize, Tune::kRowRegisters);
  // Above 1, the default layout's threads spread this many times over (jitk/norm_order.cuh).
  static constexpr int kSpread = row_spread(kHidden, kElemBytes<T>, kVecSize, Tune::kRowRegisters);
  // A row that a warp covers is reduced with shuffles alone; a longer one needs a block.
  static constexpr bool kSubWarp = kThreadsPerRow <= kWarpThreads;
  static constexpr int kBlockThreads = kSubWarp ? kShortRowsBlockThreads : kThreadsPerRow;
  static constexpr int kRowsPerBlock = kBlockThreads / kThreadsPerRow;
  static constexpr int kRowWarps = kSubWarp ? 1 : kThreadsPerRow / kWarpThreads;
  static constexpr int kVecsPerThread = kSpread > 1 ? kBaseSlots / kSpread
                                                    : div_ceil(kVecsPerRow, kThreadsPerRow);
  // Only when 1024 threads are not enough does a thread get more than it keeps in registers.
  static constexpr bool kInRegisters = kVecsPerThread <= kMaxVecsInRegisters;
  // Whether some slots lie past the end of the row (the last ones, in the base layout).
  static constexpr bool kRagged = kVecsPerRow != kThreadsPerRow * kVecsPerThread;
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
#if JITK_HOST_HALF  // (NVRTC has no offsetof; the host half checks the layout both share)
static_assert(offsetof(Params, split) == 48, "a plain call's parameters fill one line");
#endif

#if JITK_DEVICE_HALF

// Slot k of a thread is vector lane + k * kThreadsPerRow of its row, or spread_slot's in a
// spread layout. A slot is live when its row exists and reaches that far; dead slots are
// neither read nor written.
template <typename Tiling>
__device__ __forceinline__ int slot_index(int lane, int k) {
  if constexpr (Tiling::kSpread > 1) {
    return spread_slot<Tiling::kThreadsPerRow / Tiling::kSpread, Tiling::kSpread>(lane, k);
  } else {
    return lane + k * Tiling::kThreadsPerRow;
  }
}
template <typename Tiling>
__device__ __forceinline__ bool slot_live(int lane, int k, bool row_valid) {
  const bool may_be_dead =
      Tiling::kRagged && (Tiling::kSpread > 1 || k + 1 == Tiling::kVecsPerThread);
  return row_valid && k < Tiling::kVecsPerThread &&
         (!may_be_dead || slot_index<Tiling>(lane, k) < Tiling::kVecsPerRow);
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
#endif  // JITK_DEVICE_HALF

}  // namespace jitk::norm
