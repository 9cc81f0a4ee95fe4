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
// kRows x 128 tile and runs tile_epilogue on it. GroupNorm groups of whole tiles on rows of
// at most kGemvWholeRowMaxN channels, over at most kGemvWholeRowMaxSlices slices of at most
// kGemvShortSlice, take gemv_whole_rows_kernel instead: windows of 64 of W's rows, one arrival
// counter for the grid, whose last block folds the whole rows into registers and finishes them
// there.
#pragma once
#include <algorithm>
#include <cstdint>

#include "fused_args.h"
#include "last_block.cuh"
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

// (s, c) += (value, error): the value added to the sum with its rounding error (TwoSum), that
// and the value's own error to the compensation.
__device__ __forceinline__ void add_compensated(float& s, float& c, float value, float error) {
  float err;
  s = two_sum_finite(s, value, err);
  c += error + err;
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

// x's slice of K (block row blockIdx.y) staged in shared memory `xs`, then W's rows
// [n0, n_end) streamed over it: each row's compensated sums for every row of x, into g.partial.
template <int kRows, int kRowBatch>
__device__ __forceinline__ void gemv_partials(float* xs, const FusedArgs& args, const GemvArgs& g,
                                              int n0, int n_end) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, M = args.M, N = args.N;
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
          add_compensated(s[q][m], c[q][m], so, co);
        }
        if (lane == 0 && m < M && live[q])
          g.partial[(static_cast<int64_t>(blockIdx.y) * M + m) * N + nb + q * kWarps] =
              make_float2(s[q][m], c[q][m]);
      }
    }
  }
}

template <class Epi, int kRows, int kRowBatch>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_blocks<kRows, kRowBatch>())
    gemv_epilogue_kernel(FusedArgs args, GemvArgs g) {
  extern __shared__ float4 smem_gemv[];
  float* xs = reinterpret_cast<float*>(smem_gemv);  // [kRows, slice], then the epilogue tile
  const int tid = threadIdx.x, n0 = blockIdx.x * kTile, M = args.M, N = args.N;
  gemv_partials<kRows, kRowBatch>(xs, args, g, n0, min(n0 + kTile, N));

  // The last slice of this column window to finish folds all of them and runs the epilogue.
  if (!last_to_arrive(g.counter + blockIdx.x, gridDim.y, tid)) return;
  const int cols_here = min(kTile, N - n0);
  float* tile = xs;  // x's slice is no longer needed
  for (int i = tid; i < M * kTile; i += kGemvThreads) {
    const int m = i / kTile, col = i % kTile;
    if (col >= cols_here) continue;
    float s = 0.f, c = 0.f;
    for (int sl = 0; sl < static_cast<int>(gridDim.y); ++sl) {
      const float2 part = __ldcg(g.partial + (static_cast<int64_t>(sl) * M + m) * N + n0 + col);
      add_compensated(s, c, part.x, part.y);
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
  if (!last_to_arrive(g.counter + gridDim.x, gridDim.x, tid)) return;
  for (int m = 0; m < M; ++m) {
    float* row = args.out + static_cast<int64_t>(m) * N;
    finish_row<Epi>(args.norm_stats + static_cast<int64_t>(m) * gridDim.x * args.stats_per_tile,
                    row, row, m, 0, N, args);
  }
  if (tid == 0) g.counter[gridDim.x] = 0;  // ready for the next launch
}

// Rows of at most kGemvWholeRowMaxN channels whose GroupNorm groups are whole tiles, over few
// K slices (#62's chain at M = 1, N = K = 1024 in groups of 512: 8 slices of 128): the last
// block of the grid folds every slice's partials into registers, a quad of channels a thread,
// and finishes each row there (wide_rows.cuh's finish_row_registers). gemv_epilogue_kernel
// takes three steps for these rows (each window's fold and tile_epilogue, a second arrival,
// then finish_row through global memory: 5.3 of its 15.9 us in session 46's stamps). With no
// window-wide epilogue a block takes 64 of W's rows, one pass of its warps' 8 rows: twice the
// blocks to stream W.
constexpr int kGemvWholeRowWindow = kGemvShortRows * (kGemvThreads / 32);
constexpr int kGemvWholeRowMaxN = kGemvThreads * 4;  // a quad a thread
constexpr int kGemvWholeRowMaxSlices = 16;           // the fold's loads: up to 128 KB a row
constexpr int kGemvFoldBatch = 4;                    // slices' loads in flight a thread

// Channels 4q..4q+3 of x's row m, every slice's compensated sums folded in slice order (as
// gemv_epilogue_kernel folds a column), kGemvFoldBatch slices' loads issued at once.
__device__ __forceinline__ float4 fold_quad(const GemvArgs& g, int slices, int m, int M, int N,
                                            int q) {
  float s[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int first = 0; first < slices; first += kGemvFoldBatch) {
    float4 part[kGemvFoldBatch][2];  // (value, error) of channels 4q, 4q + 1; then 4q + 2, 4q + 3
#pragma unroll
    for (int b = 0; b < kGemvFoldBatch; ++b) {
      const int sl = first + b;
      const float4* at = reinterpret_cast<const float4*>(
          g.partial + (static_cast<int64_t>(sl) * M + m) * N + 4 * q);
      part[b][0] = sl < slices ? __ldcg(at) : make_float4(0.f, 0.f, 0.f, 0.f);
      part[b][1] = sl < slices ? __ldcg(at + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kGemvFoldBatch; ++b) {
      if (first + b >= slices) break;
      const float v[4] = {part[b][0].x, part[b][0].z, part[b][1].x, part[b][1].z};
      const float e[4] = {part[b][0].y, part[b][0].w, part[b][1].y, part[b][1].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) add_compensated(s[i], c[i], v[i], e[i]);
    }
  }
  return make_float4(compensated_value(s[0], c[0]), compensated_value(s[1], c[1]),
                     compensated_value(s[2], c[2]), compensated_value(s[3], c[3]));
}

template <class Epi, int kRows>
__global__ void __launch_bounds__(kGemvThreads, 2) gemv_whole_rows_kernel(FusedArgs args,
                                                                         GemvArgs g) {
  extern __shared__ float4 smem_gemv[];
  float* xs = reinterpret_cast<float*>(smem_gemv);  // [kRows, slice]
  const int n0 = blockIdx.x * kGemvWholeRowWindow, M = args.M, N = args.N;
  gemv_partials<kRows, kGemvShortRows>(xs, args, g, n0, min(n0 + kGemvWholeRowWindow, N));
  const int q = threadIdx.x;
  if (!last_to_arrive(g.counter, gridDim.x * gridDim.y, q)) return;
  for (int m = 0; m < M; ++m) {
    if (m > 0) __syncthreads();  // the finish's shared memory, read for the row before
    float4 v[1] = {q < N / 4 ? fold_quad(g, gridDim.y, m, M, N, q)
                             : make_float4(0.f, 0.f, 0.f, 0.f)};
    finish_row_registers<Epi, kGemvThreads, 1>(v, m, args);
  }
  if (q == 0) *g.counter = 0;  // ready for the next launch
}

// gemv_whole_rows_kernel's rows (whole_tile_groups) and slices: short ones (a warp's 8 rows at
// a time) and few enough for one block's fold; the partials 16-byte aligned (fold_quad's loads;
// the caching allocator's blocks are).
template <class Epi>
inline bool gemv_whole_rows_serves(const FusedArgs& args, const GemvArgs& g) {
  return whole_tile_groups<Epi>(args, kGemvWholeRowMaxN) && g.slice <= kGemvShortSlice &&
         (g.K + g.slice - 1) / g.slice <= kGemvWholeRowMaxSlices &&
         reinterpret_cast<uintptr_t>(g.partial) % 16 == 0;
}

template <class Epi, int kRows>
cudaError_t launch_gemv_whole_rows(const FusedArgs& args, const GemvArgs& g, cudaStream_t stream) {
  const dim3 grid((args.N + kGemvWholeRowWindow - 1) / kGemvWholeRowWindow,
                  (g.K + g.slice - 1) / g.slice);
  const int smem = kRows * g.slice * static_cast<int>(sizeof(float));
  gemv_whole_rows_kernel<Epi, kRows><<<grid, kGemvThreads, smem, stream>>>(args, g);
  return cudaGetLastError();
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
  if constexpr (normalizes_in_registers<Epi>()) {
    if (gemv_whole_rows_serves<Epi>(args, g))
      return args.M == 1 ? launch_gemv_whole_rows<Epi, 1>(args, g, stream)
                         : launch_gemv_whole_rows<Epi, 2>(args, g, stream);
  }
  const cudaError_t err = args.M == 1 ? launch_gemv_rows<Epi, 1>(args, g, stream)
                                      : launch_gemv_rows<Epi, 2>(args, g, stream);
  if (err != cudaSuccess || !args.norm_wide || args.N <= kShortRow) return err;
  return launch_norm_finalize<Epi>(args, stream);
}

}  // namespace gemmfuse
