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

// NaN-propagating max, so a NaN row or column stays NaN.
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// The power of two 2^e that brings a largest magnitude m into [2^14, 2^15). Zero, inf or NaN
// rows are left unscaled (e = 0): zeros stay exact, inf/NaN propagate as in fp32.
__device__ __forceinline__ int split_exponent(float m) {
  int e = 0;
  if (m > 0.f && m <= 3.402823466e38f) {
    frexpf(m, &e);  // m = f * 2^e, f in [0.5, 1)
    e = 15 - e;
  }
  return e;
}

// The exponent split_exponent gives a row (its block's threads each holding the largest
// magnitude of their values: a NaN-propagating block reduction), thread 0 storing the row's
// inverse scale. Every thread of the block calls it.
__device__ __forceinline__ int row_exponent(float amax, int row, float* __restrict__ inv_scale) {
  for (int off = 16; off > 0; off >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  __shared__ float warp_max[kSplitThreads / 32];
  __shared__ int row_exp;
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    for (int w = 0; w < kSplitThreads / 32; ++w) m = nan_max(m, warp_max[w]);
    const int e = split_exponent(m);
    row_exp = e;
    inv_scale[row] = ldexpf(1.f, -e);
  }
  __syncthreads();
  return row_exp;
}

__global__ void __launch_bounds__(kSplitThreads) split_rows_kernel(
    const float* __restrict__ x, int64_t row_stride, int rows, int k, int k_padded,
    __half* __restrict__ hi, __half* __restrict__ lo, float* __restrict__ inv_scale) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const float* xr = x + row * row_stride;

  // Pass 1: the row's largest magnitude (NaN-propagating so a NaN row stays NaN).
  float amax = 0.f;
  for (int i = threadIdx.x; i < k; i += kSplitThreads) amax = nan_max(amax, fabsf(__ldg(xr + i)));
  const int e = row_exponent(amax, row, inv_scale);

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

// The same split with the row held in registers, kVec 16-byte words a thread: one read of x
// (split_rows_kernel reads it twice, the second time from L2, a word of 4 bytes a load) and
// 8-byte stores. For rows whose k_padded fits (at most 4 * kSplitThreads * 8 = 8192 columns),
// x 16-byte aligned with k and the row stride multiples of 4, hi and lo 8-byte aligned (the
// host's fresh allocations are); the outputs are split_rows_kernel's
// to the bit (the same scale, the same arithmetic per value). At #62's 1024 x 8192 (torch.profiler,
// median of 10, L2 cleared, H200, 2026-11-28): 26.1 us for split_rows_kernel, 18.3 for this one
// (the DRAM floor is some 14: 32 MB read, 32 MB written, at 4.8 TB/s).
template <int kVec>
__global__ void __launch_bounds__(kSplitThreads) split_rows_vec_kernel(
    const float* __restrict__ x, int64_t row_stride, int rows, int k, int k_padded,
    __half* __restrict__ hi, __half* __restrict__ lo, float* __restrict__ inv_scale) {
  const int row = blockIdx.x;  // the grid is `rows` blocks (the parameter keeps
                                // split_rows_kernel's signature: launch_split_rows picks either)
  const float4* xr = reinterpret_cast<const float4*>(x + row * row_stride);
  const int words = k / 4, out_words = k_padded / 4;
  float4 v[kVec];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int w = threadIdx.x + i * kSplitThreads;
    v[i] = w < words ? __ldg(xr + w) : make_float4(0.f, 0.f, 0.f, 0.f);
    amax = nan_max(nan_max(amax, fabsf(v[i].x)), fabsf(v[i].y));
    amax = nan_max(nan_max(amax, fabsf(v[i].z)), fabsf(v[i].w));
  }
  const int e = row_exponent(amax, row, inv_scale);
  uint2* hr = reinterpret_cast<uint2*>(hi + static_cast<int64_t>(row) * k_padded);
  uint2* lr = reinterpret_cast<uint2*>(lo + static_cast<int64_t>(row) * k_padded);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int w = threadIdx.x + i * kSplitThreads;
    if (w >= out_words) break;
    const float a[4] = {ldexpf(v[i].x, e), ldexpf(v[i].y, e), ldexpf(v[i].z, e), ldexpf(v[i].w, e)};
    __half2 h[2], l[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      h[j] = __floats2half2_rn(a[2 * j], a[2 * j + 1]);
      const float2 hf = __half22float2(h[j]);
      l[j] = __floats2half2_rn(a[2 * j] - hf.x, a[2 * j + 1] - hf.y);  // exact in fp32
    }
    hr[w] = make_uint2(*reinterpret_cast<const uint32_t*>(&h[0]), *reinterpret_cast<const uint32_t*>(&h[1]));
    lr[w] = make_uint2(*reinterpret_cast<const uint32_t*>(&l[0]), *reinterpret_cast<const uint32_t*>(&l[1]));
  }
}

// split_rows_vec_kernel's words a thread for a row of k_padded columns (0: too long a row).
inline int split_rows_vec_words(int k_padded) {
  const int words = (k_padded / 4 + kSplitThreads - 1) / kSplitThreads;
  for (int v : {1, 2, 4, 8})
    if (words <= v) return v;
  return 0;
}

inline cudaError_t launch_split_rows(const float* x, int64_t row_stride, int rows, int k,
                                     int k_padded, __half* hi, __half* lo, float* inv_scale,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  const bool vec = aligned(x, 16) && row_stride % 4 == 0 && k % 4 == 0 && k_padded % 4 == 0 &&
                   aligned(hi, 8) && aligned(lo, 8);  // 16-byte loads, 8-byte stores
  // the same arguments for every kernel: pick one, launch it once
  auto kernel = split_rows_kernel;
  switch (vec ? split_rows_vec_words(k_padded) : 0) {
    case 1: kernel = split_rows_vec_kernel<1>; break;
    case 2: kernel = split_rows_vec_kernel<2>; break;
    case 4: kernel = split_rows_vec_kernel<4>; break;
    case 8: kernel = split_rows_vec_kernel<8>; break;
    default: break;  // split_rows_kernel
  }
  kernel<<<rows, kSplitThreads, 0, stream>>>(x, row_stride, rows, k, k_padded, hi, lo, inv_scale);
  return cudaGetLastError();
}

// The transposed split, for the backward's products (whose operands are x, W and the output
// gradient read down their columns): x [rows, cols] -> hi, lo [cols, rows_padded] and
// inv_scale [cols], column c of x split as split_rows splits a row, rows..rows_padded-1 zero.
// Pass 1 (col_max_kernel): each column's largest magnitude over chunks of kColChunkRows rows,
// a warp's lanes on 32 adjacent columns (128-byte loads). Pass 2 (split_cols_kernel): 64-row x
// 32-column tiles through shared memory, each thread writing 8 consecutive hi and lo values of
// one output row (16-byte stores).
constexpr int kColChunkRows = 512;
constexpr int kColTile = 32, kRowTile = 64;

inline int col_max_chunks(int rows) { return (rows + kColChunkRows - 1) / kColChunkRows; }

__global__ void __launch_bounds__(kSplitThreads) col_max_kernel(
    const float* __restrict__ x, int64_t row_stride, int rows, int cols, float* __restrict__ col_max) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = blockIdx.y * kColTile + lane;
  const int r_end = min(rows, (blockIdx.x + 1) * kColChunkRows);
  float amax = 0.f;
  if (c < cols) {
#pragma unroll 8
    for (int r = blockIdx.x * kColChunkRows + warp; r < r_end; r += kSplitThreads / 32)
      amax = nan_max(amax, fabsf(__ldg(x + r * row_stride + c)));
  }
  __shared__ float part[kSplitThreads / 32][kColTile];
  part[warp][lane] = amax;
  __syncthreads();
  if (warp == 0 && c < cols) {
    for (int w = 1; w < kSplitThreads / 32; ++w) amax = nan_max(amax, part[w][lane]);
    col_max[static_cast<int64_t>(blockIdx.x) * cols + c] = amax;
  }
}

__global__ void __launch_bounds__(kSplitThreads) split_cols_kernel(
    const float* __restrict__ x, int64_t row_stride, int rows, int cols, int rows_padded,
    int chunks, const float* __restrict__ col_max, __half* __restrict__ hi,
    __half* __restrict__ lo, float* __restrict__ inv_scale) {
  __shared__ float tile[kRowTile][kColTile + 1];
  __shared__ int col_exp[kColTile];
  const int r0 = blockIdx.x * kRowTile, c0 = blockIdx.y * kColTile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp == 0) {
    int e = 0;
    if (c0 + lane < cols) {
      float m = 0.f;
      for (int k = 0; k < chunks; ++k) m = nan_max(m, col_max[static_cast<int64_t>(k) * cols + c0 + lane]);
      e = split_exponent(m);
      if (blockIdx.x == 0) inv_scale[c0 + lane] = ldexpf(1.f, -e);
    }
    col_exp[lane] = e;
  }
#pragma unroll
  for (int i = 0; i < kRowTile / 8; ++i) {
    const int r = r0 + warp + 8 * i, c = c0 + lane;
    tile[warp + 8 * i][lane] = (r < rows && c < cols) ? __ldg(x + r * row_stride + c) : 0.f;
  }
  __syncthreads();
  const int oc = threadIdx.x / 8, seg = (threadIdx.x % 8) * 8;  // output row c0 + oc, 8 values
  if (c0 + oc >= cols) return;
  const int e = col_exp[oc];
  __align__(16) __half2 h[4], l[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float v0 = ldexpf(tile[seg + 2 * j][oc], e), v1 = ldexpf(tile[seg + 2 * j + 1][oc], e);
    h[j] = __floats2half2_rn(v0, v1);
    const float2 hf = __half22float2(h[j]);
    l[j] = __floats2half2_rn(v0 - hf.x, v1 - hf.y);  // v - h is exact in fp32
  }
  const int64_t o = static_cast<int64_t>(c0 + oc) * rows_padded + r0 + seg;
  *reinterpret_cast<uint4*>(hi + o) = *reinterpret_cast<const uint4*>(h);
  *reinterpret_cast<uint4*>(lo + o) = *reinterpret_cast<const uint4*>(l);
}

inline cudaError_t launch_split_cols(const float* x, int64_t row_stride, int rows, int cols,
                                     int rows_padded, __half* hi, __half* lo, float* inv_scale,
                                     float* col_max, cudaStream_t stream) {
  if (rows_padded % kRowTile != 0 || rows_padded < rows) return cudaErrorInvalidValue;
  if (cols == 0 || rows_padded == 0) return cudaSuccess;
  const int chunks = col_max_chunks(rows), col_tiles = (cols + kColTile - 1) / kColTile;
  if (col_tiles > 65535) return cudaErrorInvalidConfiguration;
  if (chunks > 0) {
    col_max_kernel<<<dim3(chunks, col_tiles), kSplitThreads, 0, stream>>>(x, row_stride, rows, cols, col_max);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  split_cols_kernel<<<dim3(rows_padded / kRowTile, col_tiles), kSplitThreads, 0, stream>>>(
      x, row_stride, rows, cols, rows_padded, chunks, col_max, hi, lo, inv_scale);
  return cudaGetLastError();
}

}  // namespace gemmfuse
