// A tail op's outer broadcast (outer_binary.h): #75's (M, 1) + (1, C, 1, 1) -> (1, C, M, 1).
// PyTorch runs it as a broadcasting elementwise kernel, one value a thread through an offset
// calculator: 22 us for #75's float32 output of 32 MB (H200, torch.profiler, 2026-11-26), this
// kernel 11 us. Here every thread stores 16 bytes along the inner operand and reads one value
// of the outer one. Float32 (dispatch.OUTER_DTYPES says why not the 16-bit models).
#include "outer_binary.h"

#include <algorithm>

namespace gemmfuse {
// A named namespace: a standalone export compiles this file in one translation unit with the
// other kernels (sparse_products.cu says why an anonymous one would not do).
namespace outer {

constexpr int kThreads = 256;

// x the reduction's value, y the operand's: the tail op's `v op a`.
__device__ __forceinline__ float apply(int op, float x, float y) {
  switch (op) {
    case kOuterAdd: return x + y;
    case kOuterSub: return x - y;
    case kOuterRsub: return y - x;
    case kOuterMul: return x * y;
    default: return x / y;
  }
}

// kVec floats a thread (16 bytes where the inner length allows, else one).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    outer_binary_kernel(const float* __restrict__ value, const float* __restrict__ operand,
                        float* __restrict__ out, int64_t outer, int64_t inner, bool value_inner,
                        int op) {
  const float* inner_src = value_inner ? value : operand;
  const float* outer_src = value_inner ? operand : value;
  const int64_t row_vectors = inner / kVec;
  const int64_t vectors = outer * row_vectors;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < vectors;
       t += stride) {
    const int64_t o = t / row_vectors;
    const int64_t i = (t - o * row_vectors) * kVec;
    const float a = outer_src[o];
    struct alignas(sizeof(float) * kVec) Pack { float v[kVec]; };
    const Pack in = *reinterpret_cast<const Pack*>(inner_src + i);
    Pack r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float b = in.v[j];
      r.v[j] = value_inner ? apply(op, b, a) : apply(op, a, b);
    }
    *reinterpret_cast<Pack*>(out + o * inner + i) = r;
  }
}

template <int kVec>
cudaError_t launch(const float* value, const float* operand, float* out, int64_t outer,
                   int64_t inner, bool value_inner, int op, cudaStream_t stream) {
  const int64_t vectors = outer * (inner / kVec);
  // Enough blocks to fill the GPU several times over; the loop strides over the rest.
  const int64_t grid = std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t{1} << 16);
  outer_binary_kernel<kVec><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      value, operand, out, outer, inner, value_inner, op);
  return cudaGetLastError();
}

}  // namespace outer

cudaError_t launch_outer_binary(const float* value, const float* operand, float* out,
                                int64_t outer, int64_t inner, bool value_inner, int op,
                                cudaStream_t stream) {
  if (outer == 0 || inner == 0) return cudaSuccess;
  if (op < kOuterAdd || op > kOuterDiv) return cudaErrorInvalidValue;
  constexpr int kVec = 16 / sizeof(float);
  const float* inner_src = value_inner ? value : operand;
  const bool aligned = inner % kVec == 0 && reinterpret_cast<uintptr_t>(inner_src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
  return aligned
             ? outer::launch<kVec>(value, operand, out, outer, inner, value_inner, op, stream)
             : outer::launch<1>(value, operand, out, outer, inner, value_inner, op, stream);
}

}  // namespace gemmfuse
