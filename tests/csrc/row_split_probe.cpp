// jitk::RowSplit (rows.h) on the host: each row's (outer, inner) against a plain 64-bit
// division. Built by tests/test_rmsnorm.py with g++.
#include <jitk/rows.h>

#include <cstdint>

namespace row_split_probe {

// The first of up to `count` rows, `step` apart from `first` on and below `rows`, that
// RowSplit(inner_rows, rows) numbers wrongly; -1 when there is none.
int64_t first_wrong_row(int64_t inner_rows, int64_t rows, int64_t first, int64_t count,
                        int64_t step) {
  const jitk::RowSplit split(inner_rows, rows);
  for (int64_t row = first; count > 0 && row < rows; --count, row += step) {
    const jitk::RowIndex at = split.index(row);
    if (at.outer != row / inner_rows || at.inner != row % inner_rows) return row;
  }
  return -1;
}

}  // namespace row_split_probe
