// The chain backward's column sums (column_sums.cu): chain-independent, so the host extension
// holds the kernel and every chain shares it.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace gemmfuse {

// partial [blocks, count] float32 (the chain backward's row blocks' sums) -> sums [count]
// float64, each the sum over the blocks in block order, and rounded [count] of T (float,
// __nv_bfloat16 or __half): each sum rounded once.
template <class T>
cudaError_t launch_column_sums(const float* partial, int64_t blocks, int64_t count, double* sums,
                               T* rounded, cudaStream_t stream);

}  // namespace gemmfuse
