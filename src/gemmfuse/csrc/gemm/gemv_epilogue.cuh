// The epilogue path's kernel for one or two rows (M <= kGemvMaxRows, float32): the matrix-vector
// product and the whole chain in one launch (plus norm_finalize.cuh's second pass for groups
// wider than a tile on rows of more than kShortRow channels).
//
// At a few rows the GEMM is a stream through W (M = 1, N = K = 8192: 268 MB, about 80 us at the
// H100's bandwidth) and the rest is latency: PyTorch's matrix-vector product followed by the
// tile kernel lost to eager at M = 1. Here block (t, s) reads W rows [128 t, 128 t + 128) over
// the s-th slice of K, each warp a row at a time with four 16-byte loads in flight per lane
// (eight rows at a time over short slices), x's slice staged in shared memory. Every product and
// sum is compensated (Ogita-Rump-Oishi Dot2: the product's rounding error from an fma, the
// sum's from TwoSum), so the result is about as accurate as a float64 dot product rounded once:
// never less accurate than PyTorch's. The slices' partial sums (value, error) go to global
// memory; the last block of a column window to finish (an arrival counter, as
// tile_epilogue.cuh's reductions do) folds them in slice order, stages the window as a
// kRows x 128 tile and runs tile_epilogue on it.
#pragma once
#include <algorithm>

#include "fused_args.h"
#include "norm_finalize.cuh"
#include "row_reduce.cuh"
#include "smem_limit.h"
#include "tile_epilogue.cuh"

namespace gemmfuse {

constexpr int kGemvThreads = 256;
// kGemvMaxRows (fused_args.h): the compensated sums cost about ten flops per product: at one or
// two rows the kernel streams W
// at memory speed, at eight it was compute-bound (0.32 ms against eager's 0.22 ms at N = K =
// 8192, commit c09be89), so more rows take PyTorch's GEMM and the tile kernel.
constexpr int kGemvMaxSlice = 2048;  // K per block at most: x's slice fits shared memory
// A warp streams W a row at a time with kGemvRowLoads 16-byte loads per lane in flight, or, over
// slices of at most kGemvShortSlice of K, kGemvShortRows rows at a time with one load each.
constexpr int kGemvRowLoads = 4;
constexpr int kGemvShortSlice = 256;
constexpr int kGemvShortRows = 8;

// a + b = sum + err exactly, for finite sums (the caller keeps the sum alone when it is not).
__device__ __forceinline__ float two_sum_finite(float a, float b, float& err) {
  const float sum = a + b, bb = sum - a;
  err = (a - (sum - bb)) + (b - bb);
  return sum;
}

// A compensated sum's value: an infinite or NaN sum stands alone, as PyTorch's would.
__device__ __forceinline__ float compensated_value(float s, float c) {
  return isfinite(s) ? s + c : s;
}

// Blocks per SM to fit: one row of x taking W a row at a time stays at 64 registers, so that all
// of N = K = 8192's blocks (eight K slices of 64 column windows) are resident at once; the other
// variants need more registers (ptxas spilled at fewer than 128).
template <int kRows, int kRowBatch>
constexpr int gemv_min_blocks() {
  return kRows == 1 && kRowBatch == 1 ? 4 : 2;
}

template <class Epi, int kRows, int kRowBatch>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_blocks<kRows, kRowBatch>())
    gemv_epilogue_kernel(FusedArgs args, GemvArgs g) {
  extern __shared__ float4 smem_gemv[];
  float* xs = reinterpret_cast<float*>(smem_gemv);  // [kRows, slice], then the epilogue tile
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n0 = blockIdx.x * kTile, M = args.M, N = args.N;
  const int k0 = blockIdx.y * g.slice, k_len = min(g.slice, g.K - k0);

  for (int i = tid; i < kRows * (g.slice / 4); i += kGemvThreads) {
    const int m = i / (g.slice / 4), k = (i % (g.slice / 4)) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < M && k < k_len) v = __ldg(reinterpret_cast<const float4*>(g.x + m * g.x_stride + k0 + k));
    reinterpret_cast<float4*>(xs)[i] = v;
  }
  __syncthreads();

  // A warp takes kRowBatch of its rows at once, kLoads 16-byte loads of each per lane in flight:
  // long slices a row at a time, short ones (a load or two per lane and row, where rows one
  // after another were a chain of memory round trips) several rows at once. Either way each
  // lane sums its products in the same order (k ascending).
  constexpr int kWarps = kGemvThreads / 32, kLoads = kRowBatch == 1 ? kGemvRowLoads : 1;
  const int n_end = min(n0 + kTile, N);
  for (int nb = n0 + warp; nb < n_end; nb += kRowBatch * kWarps) {
    const float* wrow[kRowBatch];
    bool live[kRowBatch];
    float s[kRowBatch][kRows], c[kRowBatch][kRows];
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) {
      live[q] = nb + q * kWarps < n_end;  // uniform across the warp
      wrow[q] = g.w + static_cast<int64_t>(live[q] ? nb + q * kWarps : nb) * g.K + k0;
#pragma unroll
      for (int m = 0; m < kRows; ++m) s[q][m] = c[q][m] = 0.f;
    }
    for (int kb = lane * 4; kb < k_len; kb += kLoads * 128) {
      float4 wv[kRowBatch][kLoads];
#pragma unroll
      for (int q = 0; q < kRowBatch; ++q) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {  // every load issued before any is used
          const int k = kb + u * 128;
          wv[q][u] = live[q] && k < k_len ? __ldg(reinterpret_cast<const float4*>(wrow[q] + k))
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int k = kb + u * 128;
        if (k >= k_len) continue;  // past the slice there is nothing in shared memory
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + m * g.slice + k);
          const float xk[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
          for (int q = 0; q < kRowBatch; ++q) {
            const float wk[4] = {wv[q][u].x, wv[q][u].y, wv[q][u].z, wv[q][u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float p = xk[e] * wk[e];
              float err;
              s[q][m] = two_sum_finite(s[q][m], p, err);
              c[q][m] += err + fmaf(xk[e], wk[e], -p);
            }
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) {
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {  // a fixed xor tree: the same order every run
          const float so = __shfl_xor_sync(0xffffffffu, s[q][m], off);
          const float co = __shfl_xor_sync(0xffffffffu, c[q][m], off);
          float err;
          s[q][m] = two_sum_finite(s[q][m], so, err);
          c[q][m] += co + err;
        }
        if (lane == 0 && m < M && live[q])
          g.partial[(static_cast<int64_t>(blockIdx.y) * M + m) * N + nb + q * kWarps] =
              make_float2(s[q][m], c[q][m]);
      }
    }
  }

  // The last slice of this column window to finish folds all of them and runs the epilogue.
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(g.counter + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int cols_here = min(kTile, N - n0);
  float* tile = xs;  // x's slice is no longer needed
  for (int i = tid; i < M * kTile; i += kGemvThreads) {
    const int m = i / kTile, col = i % kTile;
    if (col >= cols_here) continue;
    float s = 0.f, c = 0.f;
    for (int sl = 0; sl < static_cast<int>(gridDim.y); ++sl) {
      const float2 part = __ldcg(g.partial + (static_cast<int64_t>(sl) * M + m) * N + n0 + col);
      float err;
      s = two_sum_finite(s, part.x, err);
      c += part.y + err;
    }
    tile[m * kEpiStride + col] =
        epilogue_input<Epi>(compensated_value(s, c), 1.f, m, n0 + col, args);
  }
  if (tid == 0) g.counter[blockIdx.x] = 0;  // ready for the next launch
  __syncthreads();
  const TileCoord coord{0, n0, 0, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)};
  tile_epilogue<Epi, kGemvThreads, true, false>(tile, args, coord, tid, [] { __syncthreads(); });
  if (!args.norm_wide || N > kShortRow) return;

  // Groups wider than a tile on short rows: the last window to finish completes the rows
  // (norm_finalize_kernel's work, without its launch). The rows and moments it reads were
  // written by the other windows' blocks before their arrival and never read by this block.
  __shared__ bool rows_last;
  __threadfence();
  __syncthreads();
  if (tid == 0)
    rows_last = atomicAdd(g.counter + gridDim.x, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!rows_last) return;
  __threadfence();
  for (int m = 0; m < M; ++m) {
    float* row = args.out + static_cast<int64_t>(m) * N;
    finish_row<Epi>(args.norm_stats + static_cast<int64_t>(m) * gridDim.x * args.stats_per_tile,
                    row, row, m, 0, N, args);
  }
  if (tid == 0) g.counter[gridDim.x] = 0;  // ready for the next launch
}

// Slices of K: enough blocks to keep every SM streaming W (kGemvBlocksPerSm each, as many as fit
// at 64 registers: M = 1, N = K = 8192 took 108-114 us against 113-120 us at two per SM), at
// most kGemvMaxSlice of K each, a multiple of 128 (a warp's four 16-byte loads per lane).
constexpr int kGemvBlocksPerSm = 4;
inline int gemv_slice(int K, int N, int sms) {
  const int windows = (N + kTile - 1) / kTile;
  const int by_sms = (kGemvBlocksPerSm * sms + windows - 1) / windows;
  const int slices = std::max((K + kGemvMaxSlice - 1) / kGemvMaxSlice,
                              std::min((K + 127) / 128, by_sms));
  return ((K + slices - 1) / slices + 127) / 128 * 128;
}

template <class Epi, int kRows, int kRowBatch>
cudaError_t launch_gemv_rows(const FusedArgs& args, const GemvArgs& g, cudaStream_t stream) {
  auto kernel = gemv_epilogue_kernel<Epi, kRows, kRowBatch>;
  const dim3 grid((args.N + kTile - 1) / kTile, (g.K + g.slice - 1) / g.slice);
  const int smem = kRows * std::max(g.slice, kEpiStride) * static_cast<int>(sizeof(float));
  if (smem > 48 * 1024) {
    const cudaError_t err = raise_smem_once(reinterpret_cast<const void*>(kernel),
                                            kRows * kGemvMaxSlice * static_cast<int>(sizeof(float)));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kGemvThreads, smem, stream>>>(args, g);
  return cudaGetLastError();
}

template <class Epi, int kRows>
cudaError_t launch_gemv_rows(const FusedArgs& args, const GemvArgs& g, cudaStream_t stream) {
  return g.slice <= kGemvShortSlice ? launch_gemv_rows<Epi, kRows, kGemvShortRows>(args, g, stream)
                                    : launch_gemv_rows<Epi, kRows, 1>(args, g, stream);
}

template <class Epi>
cudaError_t launch_gemv(const FusedArgs& args, const GemvArgs& g, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (!serves_model<Epi>(args.params) || args.M > kGemvMaxRows || g.slice % 128 != 0 || g.slice > kGemvMaxSlice || g.K % 4 != 0 ||
      g.x_stride % 4 != 0)
    return cudaErrorInvalidValue;
  if ((g.K + g.slice - 1) / g.slice > 65535) return cudaErrorInvalidConfiguration;
  const cudaError_t err = args.M == 1 ? launch_gemv_rows<Epi, 1>(args, g, stream)
                                      : launch_gemv_rows<Epi, 2>(args, g, stream);
  if (err != cudaSuccess || !args.norm_wide || args.N <= kShortRow) return err;
  return launch_norm_finalize<Epi>(args, stream);
}

}  // namespace gemmfuse
