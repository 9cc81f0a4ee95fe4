// The backward's products where dz is mostly zero (sparse_products.cu): chain-independent, so
// the host extension holds them and every chain shares them.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace gemmfuse {

// dx [M, K] = dz [M, N] @ w [N, K] and dw [N, K] = dz^T @ x (x [M, K]) from dz's nonzero
// entries alone (all row-major, contiguous; T float, __nv_bfloat16 or __half; each output a float sum
// in a fixed order, rounded once). dx or dw null: not computed. Scratch: sparse_scratch ints.
template <class T>
cudaError_t launch_sparse_products(const T* dz, const T* w, const T* x, T* dx, T* dw,
                                  int* scratch, int M, int N, int K, cudaStream_t stream);
constexpr int kSparseStrip = 16;  // dz columns per strip
constexpr int kSparseBatch = 16;  // rows of a strip per dx strip item
// [0] dx's batches, [1] and [2] dW's strips with rows and idle ones, [3] the next work
// item, [4] dW's strips with many rows, [5] the rows in several strips (sparse_products.cu)
constexpr int kSparseCounters = 6;
// The scratch's ints (an 8-byte aligned start: the batches are int pairs): each row's count of
// strips with a nonzero entry [M], the counters [kSparseCounters], each strip's count of rows
// [strips], the strips in two lists (those with rows from the front, the idle ones from the
// back) [strips], the strips with many rows [strips], the rows in several strips [M], each
// strip's rows [strips, M], one int to align, then dx's batches (pairs)
// [strips * ceil(M / kSparseBatch), 2].
inline int64_t sparse_scratch(int64_t M, int64_t N) {
  const int64_t strips = (N + kSparseStrip - 1) / kSparseStrip;
  return 2 * M + kSparseCounters + strips * (3 + M) + 1 +
         2 * strips * ((M + kSparseBatch - 1) / kSparseBatch);
}

// Columns of K per work item: dx's row items', dW's (a strip with rows; an idle strip's zeros
// take kSparseZeroChunk). K's bound keeps the kernels' int column indices clear of overflow.
constexpr int64_t kSparseInputChunk = 2048, kSparseWeightChunk = 512, kSparseZeroChunk = 2048;
constexpr int64_t kSparseMaxK = int64_t{1} << 30;

}  // namespace gemmfuse
