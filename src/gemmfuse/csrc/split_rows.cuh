// Pre-pass: split an fp32 matrix [rows, k] into two fp16 matrices hi, lo [rows, k_padded] such
// that x[r][k] == (hi[r][k] + lo[r][k]) * inv_scale[r] to about 22 significant bits.
//
// Each row is first multiplied by a power of two that brings its largest magnitude into
// [2^14, 2^15): hi then uses fp16's full 11-bit significand without overflowing (hi*hi products
// stay below 2^30), and lo = x*scale - hi keeps the next 11 bits. Powers of two are exact, so the
// scaling costs no accuracy and is undone exactly in the GEMM epilogue. Columns k..k_padded-1
// are written as zeros so the GEMM main loop needs no K predicate.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>

namespace gemmfuse {

constexpr int kSplitThreads = 256;

__global__ void __launch_bounds__(kSplitThreads) split_rows_kernel(
    const float* __restrict__ x, int64_t row_stride, int rows, int k, int k_padded,
    __half* __restrict__ hi, __half* __restrict__ lo, float* __restrict__ inv_scale) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const float* xr = x + row * row_stride;

  // Pass 1: the row's largest magnitude (NaN-propagating so a NaN row stays NaN).
  float amax = 0.f;
  for (int i = threadIdx.x; i < k; i += kSplitThreads) {
    const float a = fabsf(__ldg(xr + i));
    amax = (a > amax || a != a) ? a : amax;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, amax, off);
    amax = (o > amax || o != o) ? o : amax;
  }
  __shared__ float warp_max[kSplitThreads / 32];
  __shared__ int row_exp;
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    for (int w = 0; w < kSplitThreads / 32; ++w) m = (warp_max[w] > m || warp_max[w] != warp_max[w]) ? warp_max[w] : m;
    int e = 0;
    // Zero, inf or NaN rows are left unscaled: zeros stay exact, inf/NaN propagate as in fp32.
    if (m > 0.f && m <= 3.402823466e38f) {
      frexpf(m, &e);  // m = f * 2^e, f in [0.5, 1)
      e = 15 - e;     // m * 2^e in [2^14, 2^15)
    }
    row_exp = e;
    inv_scale[row] = ldexpf(1.f, -e);
  }
  __syncthreads();
  const int e = row_exp;

  // Pass 2: split. The row was just read, so this pass is served from cache.
  // Two columns per thread so the fp16 stores are 4 bytes wide; k_padded is even.
  __half2* hr = reinterpret_cast<__half2*>(hi + static_cast<int64_t>(row) * k_padded);
  __half2* lr = reinterpret_cast<__half2*>(lo + static_cast<int64_t>(row) * k_padded);
  for (int j = threadIdx.x; j < k_padded / 2; j += kSplitThreads) {
    const int i = 2 * j;
    const float v0 = i < k ? ldexpf(__ldg(xr + i), e) : 0.f;
    const float v1 = i + 1 < k ? ldexpf(__ldg(xr + i + 1), e) : 0.f;
    const __half2 h = __floats2half2_rn(v0, v1);
    const float2 hf = __half22float2(h);
    hr[j] = h;
    lr[j] = __floats2half2_rn(v0 - hf.x, v1 - hf.y);  // v - h is exact in fp32
  }
}

inline cudaError_t launch_split_rows(const float* x, int64_t row_stride, int rows, int k,
                                     int k_padded, __half* hi, __half* lo, float* inv_scale,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  split_rows_kernel<<<rows, kSplitThreads, 0, stream>>>(x, row_stride, rows, k, k_padded, hi, lo,
                                                        inv_scale);
  return cudaGetLastError();
}

}  // namespace gemmfuse
