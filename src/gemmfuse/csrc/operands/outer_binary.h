// A tail op's outer broadcast (outer_binary.cu): chain-independent, so the host extension holds
// the kernel and every chain shares it.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace gemmfuse {

// The binary ops a tail's outer broadcast computes, x the reduction's value, y the operand's
// (gemmfuse/tail.py's OUTER_OPS, in this order).
enum OuterOp : int { kOuterAdd = 0, kOuterSub = 1, kOuterRsub = 2, kOuterMul = 3, kOuterDiv = 4 };

// out [outer, inner] float32 from value and operand, each 1-D and contiguous:
// out[o][i] = op(value[i], operand[o]) where value_inner, else op(value[o], operand[i]), as
// PyTorch's broadcasting binary ops compute it.
cudaError_t launch_outer_binary(const float* value, const float* operand, float* out,
                                int64_t outer, int64_t inner, bool value_inner, int op,
                                cudaStream_t stream);

}  // namespace gemmfuse
