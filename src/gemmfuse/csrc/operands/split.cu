// The host extension's kernels: the operand splits (split_rows.cuh), which no chain changes.
#include "split.h"
#include "split_rows.cuh"

namespace gemmfuse {

cudaError_t launch_split_rows_f32(const float* x, int64_t row_stride, int rows, int k,
                                  int k_padded, __half* hi, __half* lo, float* inv_scale,
                                  cudaStream_t stream) {
  return launch_split_rows(x, row_stride, rows, k, k_padded, hi, lo, inv_scale, stream);
}

cudaError_t launch_split_cols_f32(const float* x, int64_t row_stride, int rows, int cols,
                                  int rows_padded, __half* hi, __half* lo, float* inv_scale,
                                  float* col_max, cudaStream_t stream) {
  return launch_split_cols(x, row_stride, rows, cols, rows_padded, hi, lo, inv_scale, col_max,
                           stream);
}

int split_cols_chunks(int rows) { return col_max_chunks(rows); }

}  // namespace gemmfuse
