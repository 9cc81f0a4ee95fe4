// The operand splits (split_rows.cuh): chain-independent, so the host extension holds them
// (split.cu) and every chain shares them.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace gemmfuse {

// x [rows, k] float32 (row stride in elements) -> fp16 hi, lo [rows, k_padded] and the per-row
// inverse power-of-two scale [rows].
cudaError_t launch_split_rows_f32(const float* x, int64_t row_stride, int rows, int k,
                                  int k_padded, __half* hi, __half* lo, float* inv_scale,
                                  cudaStream_t stream);
// The transposed split: x [rows, cols] (row stride in elements) -> hi, lo [cols, rows_padded]
// and inv_scale [cols], each column of x scaled as split_rows scales a row. col_max is scratch of
// split_cols_chunks(rows) * cols floats.
cudaError_t launch_split_cols_f32(const float* x, int64_t row_stride, int rows, int cols,
                                  int rows_padded, __half* hi, __half* lo, float* inv_scale,
                                  float* col_max, cudaStream_t stream);
int split_cols_chunks(int rows);
// The split operands' padding of their contraction dimension (K in the forward, the backward's
// N or M): the Hopper kernel's k-tile, kBlockK (dispatch.K_ALIGN).
constexpr int kKAlign = 64;
// The most columns split_cols takes (its grid's bound; autograd.SPLIT_COLS_MAX).
constexpr int64_t kSplitColsMax = int64_t{65535} * 32;

}  // namespace gemmfuse
