// A tail op's outer broadcast (outer_binary.cu): chain-independent, so the host extension holds
// the kernel and every chain shares it.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace gemmfuse {

// The binary ops a tail's outer broadcast computes, x the reduction's value, y the operand's
// (gemmfuse/tail.py's OUTER_OPS, in this order).
enum OuterOp : int { kOuterAdd = 0, kOuterSub = 1, kOuterRsub = 2, kOuterMul = 3, kOuterDiv = 4 };

// out [outer, inner] from value and operand, each 1-D and contiguous, all of one dtype
// (ModelDtype: float32, bfloat16 or float16 bits): out[o][i] = op(value[i], operand[o]) where
// value_inner, else op(value[o], operand[i]), computed in float and rounded once to the dtype,
// as PyTorch's broadcasting binary ops compute it.
cudaError_t launch_outer_binary(const void* value, const void* operand, void* out, int64_t outer,
                                int64_t inner, bool value_inner, int op, int dtype,
                                cudaStream_t stream);

}  // namespace gemmfuse
