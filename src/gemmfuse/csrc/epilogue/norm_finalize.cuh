// The second pass for GroupNorm groups that straddle output tiles (args.norm_wide), and the
// epilogue path's kernel.
// - Second pass: the first (a GEMM kernel's epilogue, or the epilogue path's
//   tile_epilogue_kernel) stored the pre-norm values as fp32 in args.out and, per (row, tile,
//   group segment), the segment's mean and centred sum of squares in args.norm_stats.
//   finish_row merges each group's segments with Chan's formula (exact for counts, no
//   E[x^2] - E[x]^2 cancellation; a softmax's maxima and sums with merge_softmax), then
//   normalises, applies the affine part and the generated `post` ops, and stores the result in
//   place (or a 16-bit model's to args.out16), or reduces the row
//   into args.row_out. Merges and reductions run in a fixed order. A block takes a
//   kFinalizeChunk-column piece of a row, or (when the chain reduces) the whole row.
// - The epilogue path: PyTorch's own GEMM left x @ W^T + b in args.out (or, a 16-bit model's,
//   in args.epilogue_in16), or the split GEMM left it there for a chain run apart
//   (dispatch.chain_apart: large float32 calls on sm_90), and one kernel applies the whole
//   chain to it (float32 problems too small for the fused GEMM to pay off; 16-bit chains that
//   norm or reduce in tiles at every size above them): launch_tile_epilogue says which
//   (pointwise_epilogue_kernel, group_rows_kernel, wide_rows_kernel, row_epilogue_kernel,
//   tile_epilogue_kernel, the last followed by norm_finalize_kernel for groups wider than a
//   tile that no other serves).
#pragma once
#include <algorithm>
#include <cstdint>

#include "fused_args.h"
#include "group_rows.cuh"
#include "group_tiles.cuh"
#include "moments_merge.cuh"
#include "row_reduce.cuh"
#include "smem_limit.h"
#include "tile_epilogue.cuh"
#include "wide_rows.cuh"

namespace gemmfuse {

constexpr int kFinalizeThreads = 256;
constexpr int kFinalizeChunk = 1024;       // columns per step
constexpr int kFinalizeGroups = kFinalizeChunk + 1;  // groups a chunk can meet (size 1 up)

// `src` holds pre(x @ W^T + b) for output row r (the row itself, or row_epilogue_kernel's copy
// in shared memory) and `stats` its per-segment moments; columns [c_first, c_last) are finished
// into `row` (or args.out16), or, when the chain reduces (then the whole row), reduced into
// args.row_out.
template <class Epi>
__device__ __forceinline__ void finish_row(const float4* stats, const float* src, float* row,
                                           int r, int c_first, int c_last,
                                           const FusedArgs& args) {
  constexpr int kind = Epi::kReduce;
  constexpr int kGroupSlots = Epi::kNorm ? kFinalizeGroups : 1;
  __shared__ float s_mean[kGroupSlots], s_mean_lo[kGroupSlots], s_rstd[kGroupSlots];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gs = args.group_size, N = args.N;
  // Groups spanning few tiles: a thread merges a group; wide ones: a warp, lanes over tiles.
  const bool warp_per_group = gs > 4 * kTile;
  RowAcc acc = row_acc_empty<kind == 0 ? 3 : kind>();

  for (int c0 = c_first; c0 < c_last; c0 += kFinalizeChunk) {
    const int c1 = min(c_last, c0 + kFinalizeChunk);
    const int g0 = c0 / gs;
    if constexpr (Epi::kNorm) {
      const int groups = (c1 - 1) / gs - g0 + 1;
      if (warp_per_group) {
        for (int i = warp; i < groups; i += kFinalizeThreads / 32) {
          const Moments m = group_moments_warp<Epi>(stats, g0 + i, lane, args);
          if (lane == 0) store_group_params<Epi>(m, i, s_mean, s_mean_lo, s_rstd, args);
        }
      } else {
        for (int i = tid; i < groups; i += kFinalizeThreads) {
          const Moments m = group_moments<Epi>(stats, g0 + i, 0, 1, args);
          store_group_params<Epi>(m, i, s_mean, s_mean_lo, s_rstd, args);
        }
      }
      __syncthreads();
    }
    for (int c = c0 + tid; c < c1; c += kFinalizeThreads) {
      float y = src[c];
      if constexpr (Epi::kNorm) {
        const int i = c / gs - g0;
        y = normalize<Epi>(y, s_mean[i], s_mean_lo[i], s_rstd[i], r, c, args);
      }
      if constexpr (kind == 0) {
        if (Epi::kModelDtype != kFloat32Model && args.out16 != nullptr)
          args.out16[static_cast<int64_t>(r) * N + c] =
              to_model16(y, model_dtype<Epi::kModelDtype>(args.params.model16));
        else
          row[c] = y;
      } else {
        row_acc_push<kind>(acc, y);
      }
    }
    if constexpr (Epi::kNorm) __syncthreads();  // the next chunk overwrites s_mean / s_rstd
  }

  if constexpr (kind != 0) row_acc_block_store<kind, kFinalizeThreads>(acc, args.row_out + r, N);
}

template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads) norm_finalize_kernel(FusedArgs args) {
  const int r = blockIdx.x;
  const int n_tiles = (args.N + kTile - 1) / kTile;
  // Without a reduction, a row's chunks are independent: spread over blocks (few rows would
  // otherwise leave one latency-bound block per row).
  const int c_first = Epi::kReduce == 0 ? blockIdx.y * kFinalizeChunk : 0;
  const int c_last = Epi::kReduce == 0 ? min(args.N, c_first + kFinalizeChunk) : args.N;
  float* row = args.out + static_cast<int64_t>(r) * args.N;
  finish_row<Epi>(args.norm_stats + static_cast<int64_t>(r) * n_tiles * args.stats_per_tile, row,
                  row, r, c_first, c_last, args);
}

template <class Epi>
cudaError_t launch_norm_finalize(const FusedArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (!serves_model<Epi>(args.params)) return cudaErrorInvalidValue;
  const dim3 grid(args.M, Epi::kReduce == 0 ? (args.N + kFinalizeChunk - 1) / kFinalizeChunk : 1);
  norm_finalize_kernel<Epi><<<grid, kFinalizeThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

// The epilogue path's input tile, `pre` applied, staged into shared memory 16 bytes a load:
// kPer values (8 of a 16-bit model's, 4 of float32), rows of N values that keep 16-byte
// alignment, up to 8 loads a thread in flight at once (a 16-bit tile in one batch). Loaded
// a value at a time, the address arithmetic and the waits dominated: #75's bf16 chain kernel
// took 44 us for its 16 MB (torch.profiler, H100, 2026-11-26), most stall samples there (ncu).
template <class Epi, int kPer, int kRows>
__device__ __forceinline__ void stage_vectors(float* tile, const void* src, int m0, int n0,
                                              int rows_here, int cols_here, int tid,
                                              const FusedArgs& args) {
  constexpr int kPerRow = kTile / kPer, kVectors = kRows * kPerRow;
  constexpr int kLoads = kVectors / kFinalizeThreads < 8 ? kVectors / kFinalizeThreads : 8;
  constexpr int kBatches = kVectors / (kFinalizeThreads * kLoads);
  static_assert(kBatches * kFinalizeThreads * kLoads == kVectors, "whole batches");
  const int model16 = model_dtype<Epi::kModelDtype>(args.params.model16);
#pragma unroll 1
  for (int batch = 0; batch < kBatches; ++batch) {
    uint4 raw[kLoads];
#pragma unroll
    for (int v = 0; v < kLoads; ++v) {
      const int idx = tid + (batch * kLoads + v) * kFinalizeThreads;
      const int r = idx / kPerRow, c = idx % kPerRow * kPer;
      const int64_t at = static_cast<int64_t>(m0 + r) * args.N + n0 + c;  // in values
      raw[v] = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows_here && c < cols_here) {
        if constexpr (kPer == 8)
          raw[v] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + at));
        else  // plain loads: `src` may be args.out, which the block writes after staging
          raw[v] = *reinterpret_cast<const uint4*>(static_cast<const float*>(src) + at);
      }
    }
#pragma unroll
    for (int v = 0; v < kLoads; ++v) {
      const int idx = tid + (batch * kLoads + v) * kFinalizeThreads;
      const int r = idx / kPerRow, c = idx % kPerRow * kPer;
      if (r >= rows_here || c >= cols_here) continue;
      const uint32_t words[4] = {raw[v].x, raw[v].y, raw[v].z, raw[v].w};
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        float z;
        if constexpr (kPer == 8)
          z = from_model16(static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2))), model16);
        else
          z = __uint_as_float(words[j]);
        tile[r * kEpiStride + c + j] = staged_input<Epi>(z, m0 + r, n0 + c + j, args);
      }
    }
  }
}

// The same a value at a time, kBatch loads in flight per thread, for rows that are not
// 16-byte aligned. A 16-bit input's raw values go into registers of their own before they are
// converted: loaded and converted in one expression, each load waited in turn (ncu, #75's bf16
// chain, 2026-11-26: 46% of stalls on the conversions, 169 GB/s).
template <class Epi>
__device__ __forceinline__ void stage_values(float* tile, int m0, int n0, int rows_here,
                                             int cols_here, int tid, const FusedArgs& args) {
  const float* in = epilogue_source(args);
  // a 16-bit model's z, when not null (never for a float32 instance)
  const uint16_t* in16 = Epi::kModelDtype == kFloat32Model ? nullptr : args.epilogue_in16;
  constexpr int kBatch = 16;
  const int count = rows_here * kTile;
  auto place = [&](int idx, int64_t& at) {
    const int r = idx / kTile, c = idx % kTile;
    at = static_cast<int64_t>(m0 + r) * args.N + n0 + c;
    return idx < count && c < cols_here;
  };
  for (int first = tid; first < count; first += kFinalizeThreads * kBatch) {
    float z[kBatch];
    if (in16 != nullptr) {
      uint16_t raw[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int64_t at;
        raw[b] = place(first + b * kFinalizeThreads, at) ? __ldg(in16 + at) : uint16_t{0};
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        z[b] = from_model16(raw[b], model_dtype<Epi::kModelDtype>(args.params.model16));
    } else {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int64_t at;
        z[b] = place(first + b * kFinalizeThreads, at) ? in[at] : 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int idx = first + b * kFinalizeThreads, r = idx / kTile, c = idx % kTile;
      if (idx < count && c < cols_here)
        tile[r * kEpiStride + c] = staged_input<Epi>(z[b], m0 + r, n0 + c, args);
    }
  }
}

// The epilogue path: args.out holds x @ W^T + b from PyTorch's GEMM (args.bias is null). A
// block stages one tile of it (rows past M not even in shared memory), applies `pre`, and runs
// the GEMM kernels' own tile_epilogue on it: the same statistics, merges and reductions, so the
// two paths differ only in the GEMM. Tiles, not rows, are the unit of work so that a handful of
// rows still spreads over many blocks: one block per row was latency-bound (about 30 us for one
// row of 8192).
// A 16-bit model's instance differs in two ways. kTile x kTile tiles of fp32 (66 KB) and 80
// registers a thread left 3 blocks an SM, so #62's 512 tiles took two rounds, the second a
// lone block an SM (ncu, H100, 2026-11-26: 14% of DRAM bandwidth). Its tiles are
// kEpilogueRows16 rows and its registers capped at 64 (ptxas spills a few values, in the
// unaligned rows' staging and outside the loops), 4
// blocks an SM: 1024 tiles in 1.94 rounds of half the work. And its statistics are plain fp32
// sums, not the compensated ones (kExact, rstd in double), as the one-pass GEMM variants' and
// eager's own are: the values are 16-bit ones already (a bf16 GroupNorm takes eager's own
// statistics where the call asks, params.group_stats, eager_group_stats). Not adapted: a
// reduction without a norm (row_partials) maps threads to kTile rows, so half of them idle on
// these tiles. At 1024 x 8192 (torch.profiler, 20 calls, same
// machine): bf16 #62 30.4 -> 24.5 us, fp16 #62 32.6 -> 24.5, bf16 #75 26.7 -> 21.0, fp16 #75
// 33.6 -> 20.1. The float32 instance is as it was (minimum blocks 0: no bound; same SASS).
// Since 2026-11-27 most 16-bit calls whose GroupNorm groups are 8, 16 or 32 channels, and
// float32 ones whose groups are 8 or 16 (or 32 and 64 at few tasks), take group_rows_kernel (group_rows.cuh: no
// shared-memory tile; bf16 #62's chain 24.1-24.4 us here against 16.3 there, #75's 21.0-21.2
// against 15.6, timed in separate calls; float32 figures there), and float32 groups of whole
// 128-channel tiles on rows of up to 8192 take wide_rows_kernel (wide_rows.cuh); this kernel
// serves the rest: other group sizes, no norm, and what group_rows_serves and
// wide_rows_serves refuse (unaligned z or norm weights, a max pooling, a reduction over more
// than kGroupRowsMaxGroups groups, longer rows).
template <class Epi>
constexpr int kEpilogueRows = Epi::kModelDtype == kFloat32Model ? kTile : kEpilogueRows16;

template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads, Epi::kModelDtype == kFloat32Model ? 0 : 4)
    tile_epilogue_kernel(FusedArgs args) {
  constexpr int kRows = kEpilogueRows<Epi>;
  constexpr bool kExact = Epi::kModelDtype == kFloat32Model;
  extern __shared__ float tile[];
  const int m0 = blockIdx.x * kRows, n0 = blockIdx.y * kTile, tid = threadIdx.x;
  const int rows_here = min(kRows, args.M - m0), cols_here = min(kTile, args.N - n0);
  // N a multiple of the values in 16 bytes keeps every row (and n0, a multiple of kTile)
  // aligned. A 16-bit instance reads the model's z (args.epilogue_in16), a float32 one floats.
  if constexpr (Epi::kModelDtype == kFloat32Model) {
    const float* in = epilogue_source(args);
    if (args.N % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0)
      stage_vectors<Epi, 4, kRows>(tile, in, m0, n0, rows_here, cols_here, tid, args);
    else
      stage_values<Epi>(tile, m0, n0, rows_here, cols_here, tid, args);
  } else {
    const uint16_t* in16 = args.epilogue_in16;
    if (args.N % 8 == 0 && reinterpret_cast<uintptr_t>(in16) % 16 == 0)
      stage_vectors<Epi, 8, kRows>(tile, in16, m0, n0, rows_here, cols_here, tid, args);
    else
      stage_values<Epi>(tile, m0, n0, rows_here, cols_here, tid, args);
  }
  __syncthreads();
  const TileCoord coord{m0, n0, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                        static_cast<int>(gridDim.y)};
  tile_epilogue<Epi, kFinalizeThreads, kExact, true, true, kRows>(tile, args, coord, tid,
                                                                 [] { __syncthreads(); });
}

// Rows of at most kShortRow channels with groups wider than (or straddling) a tile are finished
// in one launch: the epilogue path's row_epilogue_kernel (float32 groups of whole tiles in
// aligned rows take wide_rows_kernel first, at any row length up to 8192), and the few-rows
// kernel's last block. row_epilogue_kernel on longer rows (a trial, not kept) was slower than
// the tile kernel and norm_finalize_kernel from 1024 rows up: #62's chain 124 us against 90 at
// 1024 x 8192 (H100, 2026-11-27, torch.profiler, median of 10, L2 cleared).
constexpr int kShortRow = 2048;

// The row's values, `pre` applied, into shared memory: four a 16-byte load (up to kBatch loads
// in flight a thread) where the rows keep 16-byte alignment, else one at a time. Plain loads:
// `in` may be args.out, which the block writes after staging.
template <class Epi>
__device__ __forceinline__ void stage_row(float* values, const float* in, int r,
                                          const FusedArgs& args) {
  constexpr int kBatch = 8;
  const int N = args.N, tid = threadIdx.x;
  auto value = [&](float z, int c) { return epilogue_input<Epi>(z, 1.f, r, c, args); };
  if (N % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0) {
    const float4* quads = reinterpret_cast<const float4*>(in);
    for (int first = tid; first < N / 4; first += kFinalizeThreads * kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int q = first + b * kFinalizeThreads;
        v[b] = q < N / 4 ? quads[q] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = (first + b * kFinalizeThreads) * 4;
        if (c < N)
          reinterpret_cast<float4*>(values)[c / 4] = make_float4(
              value(v[b].x, c), value(v[b].y, c + 1), value(v[b].z, c + 2), value(v[b].w, c + 3));
      }
    }
  } else {
    for (int c = tid; c < N; c += kFinalizeThreads) values[c] = value(in[c], c);
  }
}

// The epilogue path for such rows: a block per row stages the whole row in shared memory,
// computes the moments of each (tile, group segment) of it as tile_epilogue's wide mode does,
// into shared memory in norm_stats' layout, and finishes the row from shared memory
// (finish_row): one read of z and one write of the result. Where tile_epilogue_kernel and
// norm_finalize_kernel take two launches, each with its latency (M = 16, N = 1024 measured 5.8
// and 5.0 us), and move the pre-norm row through global memory twice more.
template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads) row_epilogue_kernel(FusedArgs args) {
  extern __shared__ float4 row_smem[];
  const int N = args.N, gs = args.group_size, spt = args.stats_per_tile;
  const int tid = threadIdx.x, lane = tid % 32;
  const int n_tiles = (N + kTile - 1) / kTile;
  float4* stats = row_smem;                                            // [n_tiles, spt]
  float* values = reinterpret_cast<float*>(row_smem + n_tiles * spt);  // [N], 16-byte aligned
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * N;
  stage_row<Epi>(values, epilogue_source(args) + offset, blockIdx.x, args);
  __syncthreads();
  // Task: segment `seg` of tile t, a warp or a thread each (warp_per_task).
  const bool by_warp = warp_per_task(gs, n_tiles * spt, kFinalizeThreads);
  const int first = by_warp ? tid / 32 : tid;
  const int step = by_warp ? kFinalizeThreads / 32 : kFinalizeThreads;
  for (int task = first; task < n_tiles * spt; task += step) {
    const int n0 = (task / spt) * kTile, g = n0 / gs + task % spt;
    const int c0 = max(g * gs, n0), c1 = min((g + 1) * gs, min(n0 + kTile, N));
    if (c0 >= c1) continue;  // the tile has fewer segments (uniform across a warp)
    const SegmentMoments m = by_warp ? segment_stats_warp<Epi>(values + c0, c1 - c0, lane)
                                     : segment_stats<Epi, true>(values + c0, c1 - c0);
    if (!by_warp || lane == 0) stats[task] = make_float4(m.mean, m.mean_lo, m.m2, 0.f);
  }
  __syncthreads();
  finish_row<Epi>(stats, values, args.out + offset, blockIdx.x, 0, N, args);
}

// The epilogue path of a chain with no norm and no reduction: each value on its own (`pre`, as
// tile_epilogue_kernel stages it; nothing else touches it), so one sweep over the values, four
// at a time where rows allow, in place of staging 128 x 128 tiles through shared memory (that
// kernel moved 1.1 TB/s on 16384 x 4096 values, a BatchNorm1d's rest of #39's chain).
template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads) pointwise_epilogue_kernel(FusedArgs args) {
  const float* in = epilogue_source(args);
  const int64_t n = args.N, total = static_cast<int64_t>(args.M) * n;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto value = [&](float v, int row, int col) {
    return epilogue_input<Epi>(v, 1.f, row, col, args);
  };
  const bool quads = n % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(args.out) % 16 == 0;
  if (quads) {  // four values of one row (n % 4 == 0): one division for the four
    for (int64_t q = first; q < total / 4; q += step) {
      const float4 v = reinterpret_cast<const float4*>(in)[q];
      const int row = static_cast<int>(q * 4 / n), col = static_cast<int>(q * 4 % n);
      reinterpret_cast<float4*>(args.out)[q] = make_float4(
          value(v.x, row, col), value(v.y, row, col + 1), value(v.z, row, col + 2),
          value(v.w, row, col + 3));
    }
  } else {
    for (int64_t i = first; i < total; i += step)
      args.out[i] = value(in[i], static_cast<int>(i / n), static_cast<int>(i % n));
  }
}

// tile_epilogue_kernel over the grid of tiles (its shared-memory limit raised where a tile needs
// more than the default).
template <class Epi>
cudaError_t launch_tile_kernel(const FusedArgs& args, cudaStream_t stream) {
  constexpr int kRows = kEpilogueRows<Epi>;
  const dim3 grid((args.M + kRows - 1) / kRows, (args.N + kTile - 1) / kTile);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  const int smem = min(args.M, kRows) * kEpiStride * static_cast<int>(sizeof(float));
  if (smem > 48 * 1024) {
    const cudaError_t err =
        raise_smem_once(reinterpret_cast<const void*>(tile_epilogue_kernel<Epi>),
                        kRows * kEpiStride * static_cast<int>(sizeof(float)));
    if (err != cudaSuccess) return err;
  }
  tile_epilogue_kernel<Epi><<<grid, kFinalizeThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// The epilogue path's launch for an instance of one model dtype: a float32 one takes a float32
// z; a 16-bit one (bf16 or fp16) takes that model's z (args.epilogue_in16), for chains that
// norm or reduce in tiles, into one kernel: group_rows_kernel where group_rows_serves says so,
// else tile_epilogue_kernel. A float32 z, in order: a chain with no norm and no reduction
// pointwise_epilogue_kernel; group_rows_kernel; wide_rows_kernel (wide_rows_serves); groups
// wider than a tile on rows of up to kShortRow row_epilogue_kernel; else tile_epilogue_kernel,
// then norm_finalize_kernel for groups wider than a tile.
template <class Epi>
cudaError_t launch_tile_epilogue(const FusedArgs& args, cudaStream_t stream) {
  static_assert(Epi::kModelDtype != kAnyModel, "an instance of one model dtype");
  constexpr bool k16 = Epi::kModelDtype != kFloat32Model;
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (args.tile_flags != nullptr) {  // behind the plain GEMM, following its tiles (group_tiles.cuh)
    const cudaError_t err = launch_group_tiles<Epi>(args, stream);
    if (err != cudaErrorNotSupported) return err;
    FusedArgs after = args;  // it cannot follow: the chain kernel after the GEMM
    after.tile_flags = nullptr;
    return launch_tile_epilogue<Epi>(after, stream);
  }
  if (args.bias != nullptr || args.a_inv_scale != nullptr || args.b_inv_scale != nullptr)
    return cudaErrorInvalidValue;  // PyTorch's GEMM already applied the bias
  if ((args.epilogue_in16 != nullptr) != k16 || !serves_model<Epi>(args.params))
    return cudaErrorInvalidValue;
  if constexpr (k16) {
    if constexpr (!Epi::kNorm && Epi::kReduce == 0) {
      return cudaErrorInvalidValue;
    } else {
      if (args.norm_wide) return cudaErrorInvalidValue;
      if (group_rows_serves<Epi>(args)) return launch_group_rows<Epi>(args, stream);
      return launch_tile_kernel<Epi>(args, stream);
    }
  } else {
    if constexpr (!Epi::kNorm && Epi::kReduce == 0) {
      const int64_t work = (static_cast<int64_t>(args.M) * args.N + 3) / 4;
      const int blocks = static_cast<int>(
          std::min<int64_t>((work + kFinalizeThreads - 1) / kFinalizeThreads, 8192));
      pointwise_epilogue_kernel<Epi><<<blocks, kFinalizeThreads, 0, stream>>>(args);
      return cudaGetLastError();
    }
    if (group_rows_serves<Epi>(args)) return launch_group_rows<Epi>(args, stream);
    if (wide_rows_serves<Epi>(args)) return launch_wide_rows<Epi>(args, stream);
    if (args.norm_wide && args.N <= kShortRow) {
      const int n_tiles = (args.N + kTile - 1) / kTile;
      const int smem = n_tiles * args.stats_per_tile * static_cast<int>(sizeof(float4)) +
                       args.N * static_cast<int>(sizeof(float));
      if (smem > 48 * 1024) return cudaErrorInvalidConfiguration;  // kShortRow keeps it below
      row_epilogue_kernel<Epi><<<args.M, kFinalizeThreads, smem, stream>>>(args);
      return cudaGetLastError();
    }
    const cudaError_t err = launch_tile_kernel<Epi>(args, stream);
    if (err != cudaSuccess || !args.norm_wide) return err;
    return launch_norm_finalize<Epi>(args, stream);
  }
}

}  // namespace gemmfuse
