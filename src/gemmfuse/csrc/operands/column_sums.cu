// The chain backward's column sums over its row blocks (column_sums.h). One launch where PyTorch
// took two (a float64 sum over the blocks, then the conversion to the gradients' dtype), each
// with its host time on the backward's thread: some 60 us of #75's bf16 step (torch.profiler,
// H100, 2026-11-25).
#include "column_sums.h"

namespace gemmfuse {
// A named namespace: a standalone export compiles this file in one translation unit with the
// other kernels (sparse_products.cu says why an anonymous one would not do).
namespace column {

constexpr int kThreads = 256;

__device__ __forceinline__ void store_rounded(float* p, double v) { *p = static_cast<float>(v); }
__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, double v) {
  *p = __double2bfloat16(v);
}
__device__ __forceinline__ void store_rounded(__half* p, double v) { *p = __double2half(v); }

template <class T>
__global__ void __launch_bounds__(kThreads)
    column_sums_kernel(const float* __restrict__ partial, int64_t blocks, int64_t count,
                       double* __restrict__ sums, T* __restrict__ rounded) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  double sum = 0.0;
  for (int64_t b = 0; b < blocks; ++b) sum += static_cast<double>(partial[b * count + i]);
  sums[i] = sum;
  store_rounded(rounded + i, sum);
}

}  // namespace column

template <class T>
cudaError_t launch_column_sums(const float* partial, int64_t blocks, int64_t count, double* sums,
                               T* rounded, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t grid = (count + column::kThreads - 1) / column::kThreads;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  column::column_sums_kernel<T><<<static_cast<unsigned>(grid), column::kThreads, 0, stream>>>(
      partial, blocks, count, sums, rounded);
  return cudaGetLastError();
}

template cudaError_t launch_column_sums<float>(const float*, int64_t, int64_t, double*, float*,
                                               cudaStream_t);
template cudaError_t launch_column_sums<__nv_bfloat16>(const float*, int64_t, int64_t, double*,
                                                       __nv_bfloat16*, cudaStream_t);
template cudaError_t launch_column_sums<__half>(const float*, int64_t, int64_t, double*, __half*,
                                                cudaStream_t);

}  // namespace gemmfuse
