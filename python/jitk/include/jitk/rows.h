// Rows of a tensor, addressed by up to two strides. The last dimension holds a row's
// elements; the leading dimensions, read in order, number the rows. Leading dimensions
// that continue one another merge into one run of rows at one stride, and two runs are
// allowed: that covers any slice of rows, heads cut from a fused QKV buffer
// ([tokens, heads, head_dim] with strides (qkv_width, head_dim, 1)) and the pages of a paged
// cache ([pages, page_size, dim]).
//
//   Host:   const RowView x(input, "input"), y(out, "out");   // raises past two runs
//           const RowSplit split = shared_split({&x, &y});       // one numbering for both
//           kernel params: split, x.data(), x.strides_in(split), y.data(), ...
//   Device: const RowIndex at = split.index(row);
//           const T* row_x = static_cast<const T*>(x_data) + x_strides.offset(at);
//
// Checking the row size, the dtype, the device and a contiguous last dimension is left to
// TensorMatcher, on view.matrix().
// A device half compiled by NVRTC (jitk/nvrtc.cuh) reads RowIndex, RowSplit's index and
// RowStrides.
#pragma once

#include <jitk/utils.h>

#if JITK_HOST_HALF  // NVRTC: the pieces jitk/utils.h includes
#include <jitk/tensor.h>

#include <cstdint>
#include <initializer_list>
#endif

namespace jitk {

// Row `outer * inner_rows + inner` of a split.
struct RowIndex {
  int64_t outer;
  int64_t inner;
};

// How a kernel numbers rows: runs of `inner_rows` rows, one after another. Trivially
// copyable, so it travels in kernel parameters.
class RowSplit {
 public:
  // One run: a row's index is the row itself, with nothing to divide.
  RowSplit() = default;
#if JITK_HOST_HALF
  RowSplit(int64_t inner_rows, int64_t rows)
      : inner_rows_(inner_rows), narrow_(rows <= int64_t{UINT32_MAX}) {
    if (!narrow_ || inner_rows <= 0) return;
    // Division by a run-time constant as a multiply-high and a shift (Granlund and
    // Montgomery): with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, every 32-bit
    // n / d is (n + mulhi(n, m)) >> l. (2^l - d) < 2^31, so the product fits in 64 bits.
    const auto d = static_cast<uint64_t>(inner_rows);
    while ((uint64_t{1} << shift_) < d) ++shift_;
    magic_ = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift_) - d) / d + 1);
  }
#endif

  JITK_HOST_DEVICE int64_t inner_rows() const { return inner_rows_; }

  // `row` must be below the row count the split was made for.
  JITK_HOST_DEVICE RowIndex index(int64_t row) const {
    if (inner_rows_ == 0) return {0, row};
    if (narrow_) {  // a multiply-high in place of a 32-bit division (tens of instructions)
      const auto n = static_cast<uint32_t>(row);
      const auto high = static_cast<uint32_t>((uint64_t{n} * magic_) >> 32);
      const auto outer = static_cast<uint32_t>((uint64_t{high} + n) >> shift_);
      return {outer, n - outer * static_cast<uint32_t>(inner_rows_)};
    }
    return {row / inner_rows_, row % inner_rows_};
  }

 private:
  int64_t inner_rows_ = 0;  // 0: one run
  bool narrow_ = true;      // every row fits in 32 bits
  uint32_t magic_ = 0, shift_ = 0;
};

// Where one tensor's rows start, in elements, for the split it was made for.
struct RowStrides {
  int64_t outer;
  int64_t inner;
  JITK_HOST_DEVICE int64_t offset(RowIndex at) const { return at.outer * outer + at.inner * inner; }
  // Whether every row starts a multiple of `elements` after the first.
  JITK_HOST_DEVICE bool steps_by(int64_t elements) const {
    return outer % elements == 0 && inner % elements == 0;
  }
};

#if JITK_HOST_HALF
// A tensor seen as rows of its last dimension. It refers to the tensor's shape and strides,
// which must outlive it, as for any view.
class RowView {
 public:
  RowView(const TensorView& t, const char* name, DebugInfo where = {});

  const char* name() const { return name_; }
  int64_t rows() const { return rows_; }
  int64_t row_size() const { return matrix_shape_[1]; }
  // Rows in one run at the inner stride: all of them when one stride reaches every row.
  int64_t inner_rows() const { return inner_rows_; }
  int64_t inner_stride() const { return inner_stride_; }
  int64_t outer_stride() const { return outer_stride_; }
  bool two_runs() const { return outer_rows_ > 1 && rows_ > 0; }
  // The first element, the tensor's byte offset included.
  void* data() const { return pointer::offset(tensor_.data_ptr(), tensor_.byte_offset()); }

  // [rows, row size] at the inner stride: what TensorMatcher checks (sizes, dtype, device and
  // the last dimension's stride; give the row stride as -1, the outer one is not in it).
  // Valid while this object lives.
  TensorView matrix() const {
    return tensor_.as_strided(ShapeView(matrix_shape_, 2), ShapeView(matrix_strides_, 2));
  }

  // Whether no two rows share an element, as a tensor that is written needs. Exact for one
  // run; for two, it asks that the runs nest (each step clears what the finer one covers),
  // which every layout that slicing and transposing make satisfies.
  bool rows_disjoint() const {
    if (rows_ <= 1) return true;
    struct Dim {
      int64_t count, step;
    } fine{inner_rows_, abs_of(inner_stride_)}, coarse{outer_rows_, abs_of(outer_stride_)};
    if (coarse.count == 1) return fine.step >= row_size();
    if (fine.count == 1 || coarse.step < fine.step) std::swap(fine, coarse);
    if (fine.count == 1) return coarse.step >= row_size();
    return fine.step >= row_size() && coarse.step >= (fine.count - 1) * fine.step + row_size();
  }

  // This view's row strides under `split`: its own split, or a single run (any split
  // divides a single run).
  RowStrides strides_in(const RowSplit& split, DebugInfo where = {}) const {
    if (!two_runs()) return {split.inner_rows() * inner_stride_, inner_stride_};
    RuntimeCheck(where, split.inner_rows() == inner_rows_, "'", name_, "' has runs of ",
                 inner_rows_, " rows, not ", split.inner_rows());
    return {outer_stride_, inner_stride_};
  }

 private:
  static int64_t abs_of(int64_t v) { return v < 0 ? -v : v; }

  TensorView tensor_;
  const char* name_;
  int64_t rows_ = 1;
  int64_t inner_rows_ = 1, outer_rows_ = 1;
  int64_t inner_stride_ = 0, outer_stride_ = 0;  // 0 where never stepped over
  int64_t matrix_shape_[2]{};
  int64_t matrix_strides_[2]{};
};

// The one split under which every view finds its rows: that of the views with two runs,
// which must agree, or a single run when none has two. The views must have as many rows.
JITK_RUNTIME RowSplit shared_split(std::initializer_list<const RowView*> views,
                                   DebugInfo where = {});

#if JITK_RUNTIME_BODY
JITK_RUNTIME RowView::RowView(const TensorView& t, const char* name, DebugInfo where)
    : tensor_(t), name_(name) {
  RuntimeCheck(where, t.ndim() >= 1, "'", name, "' must have at least one dimension (the ",
               "row's elements), got ", PrintTensor{t});
  const int last = t.ndim() - 1;
  matrix_shape_[1] = t.size(last);
  matrix_strides_[1] = t.stride(last);
  int runs = 0;            // runs found so far, innermost first
  int64_t continuing = 0;  // the stride at which the next dimension would continue the run
  int broken = -1;         // the dimension that would start a third run
  for (int i = last - 1; i >= 0; --i) {
    rows_ *= t.size(i);
    if (t.size(i) == 1) continue;  // never stepped over
    if (runs == 0 || t.stride(i) != continuing) {
      if (runs == 2) {
        if (broken < 0) broken = i;
        continue;
      }
      ++runs;
      (runs == 1 ? inner_stride_ : outer_stride_) = t.stride(i);
    }
    if (broken < 0) (runs == 1 ? inner_rows_ : outer_rows_) *= t.size(i);
    if (broken < 0) continuing = t.stride(i) * t.size(i);
  }
  RuntimeCheck(where, broken < 0 || rows_ == 0, "'", name, "' ", PrintTensor{t},
               " cannot be read as rows of its last dimension: its leading dimensions do not ",
               "collapse into two row strides (stride#", broken, " is ",
               broken < 0 ? 0 : t.stride(broken), ", not ", continuing, ")");
  matrix_shape_[0] = rows_;
  matrix_strides_[0] = inner_stride_;
}

JITK_RUNTIME RowSplit shared_split(std::initializer_list<const RowView*> views, DebugInfo where) {
  const RowView* owner = nullptr;
  for (const RowView* view : views) {
    if (!view->two_runs()) continue;
    if (owner == nullptr) {
      owner = view;
      continue;
    }
    RuntimeCheck(where, view->inner_rows() == owner->inner_rows(), "'", view->name(), "' and '",
                 owner->name(), "' group their rows differently (runs of ", view->inner_rows(),
                 " and of ", owner->inner_rows(), " rows), so no one numbering reaches both");
  }
  return owner == nullptr ? RowSplit() : RowSplit(owner->inner_rows(), owner->rows());
}
#endif  // JITK_RUNTIME_BODY

#endif  // JITK_HOST_HALF

}  // namespace jitk
