// A tail op's outer broadcast (outer_binary.h): #75's (M, 1) + (1, C, 1, 1) -> (1, C, M, 1).
// PyTorch runs it as a broadcasting elementwise kernel, one value a thread through an offset
// calculator: 22 us for #75's float32 output of 32 MB (H200, torch.profiler, 2026-11-26), this
// kernel 11 us. Here every thread stores 16 bytes along the inner operand and reads one value
// of the outer one.
#include "outer_binary.h"

#include <algorithm>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fused_args.h"

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

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return v;
}

// kVec values of T a thread (16 bytes where the inner length allows, else one).
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads)
    outer_binary_kernel(const T* __restrict__ value, const T* __restrict__ operand,
                        T* __restrict__ out, int64_t outer, int64_t inner, bool value_inner,
                        int op) {
  const T* inner_src = value_inner ? value : operand;
  const T* outer_src = value_inner ? operand : value;
  const int64_t row_vectors = inner / kVec;
  const int64_t vectors = outer * row_vectors;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < vectors;
       t += stride) {
    const int64_t o = t / row_vectors;
    const int64_t i = (t - o * row_vectors) * kVec;
    const float a = to_float(outer_src[o]);
    struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };
    const Pack in = *reinterpret_cast<const Pack*>(inner_src + i);
    Pack r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float b = to_float(in.v[j]);
      r.v[j] = from_float<T>(value_inner ? apply(op, b, a) : apply(op, a, b));
    }
    *reinterpret_cast<Pack*>(out + o * inner + i) = r;
  }
}

template <class T, int kVec>
cudaError_t launch_vec(const T* value, const T* operand, T* out, int64_t outer, int64_t inner,
                       bool value_inner, int op, cudaStream_t stream) {
  const int64_t vectors = outer * (inner / kVec);
  // Enough blocks to fill the GPU several times over; the loop strides over the rest.
  const int64_t grid = std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t{1} << 16);
  outer_binary_kernel<T, kVec><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      value, operand, out, outer, inner, value_inner, op);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch(const void* value, const void* operand, void* out, int64_t outer,
                   int64_t inner, bool value_inner, int op, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T *v = static_cast<const T*>(value), *a = static_cast<const T*>(operand);
  T* o = static_cast<T*>(out);
  const T* inner_src = value_inner ? v : a;
  const bool aligned = inner % kVec == 0 && reinterpret_cast<uintptr_t>(inner_src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(o) % 16 == 0;
  return aligned ? launch_vec<T, kVec>(v, a, o, outer, inner, value_inner, op, stream)
                 : launch_vec<T, 1>(v, a, o, outer, inner, value_inner, op, stream);
}

}  // namespace outer

cudaError_t launch_outer_binary(const void* value, const void* operand, void* out, int64_t outer,
                                int64_t inner, bool value_inner, int op, int dtype,
                                cudaStream_t stream) {
  if (outer == 0 || inner == 0) return cudaSuccess;
  if (op < kOuterAdd || op > kOuterDiv) return cudaErrorInvalidValue;
  switch (dtype) {
    case kFloat32Model:
      return outer::launch<float>(value, operand, out, outer, inner, value_inner, op, stream);
    case kBf16Model:
      return outer::launch<__nv_bfloat16>(value, operand, out, outer, inner, value_inner, op, stream);
    case kFp16Model:
      return outer::launch<__half>(value, operand, out, outer, inner, value_inner, op, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace gemmfuse
