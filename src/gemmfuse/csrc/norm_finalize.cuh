// Row-wise finishing of the chain, one block per output row, for two callers:
// - the second pass for GroupNorm groups that straddle output tiles (args.norm_wide): the GEMM
//   kernel stored the pre-norm values as fp32 in args.out and, per (row, tile, group segment),
//   the segment's mean and centred sum of squares in args.norm_stats;
// - the epilogue path (row_epilogue_kernel): PyTorch's own fp32 GEMM left x @ W^T + b in
//   args.out, and this kernel applies the whole chain to it (problems too small for the fused
//   GEMM to pay off: one launch after the GEMM instead of one per op).
// finish_row walks a row in chunks: it merges each group's segments with Chan's formula (exact
// for counts, no E[x^2] - E[x]^2 cancellation), then normalises, applies the affine part and
// the generated `post` ops, and stores the result in place (or bf16 to args.out_bf16), or
// reduces the row into args.row_out. Merges and reductions run in a fixed order.
#pragma once
#include "fused_args.h"
#include "row_reduce.cuh"
#include "tile_epilogue.cuh"

namespace gemmfuse {

constexpr int kFinalizeThreads = 256;
constexpr int kFinalizeChunk = 1024;       // columns per step
constexpr int kFinalizeGroups = kFinalizeChunk + 1;  // groups a chunk can meet (size 1 up)

struct Moments {
  float n, mean, m2;  // count, mean, centred sum of squares
};

__device__ __forceinline__ Moments merge_moments(Moments a, Moments b) {
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float n = a.n + b.n, d = b.mean - a.mean, wb = b.n / n;
  return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
}

// The moments of group g from tiles t0, t0 + step, ... of its span (in tile order).
__device__ __forceinline__ Moments group_moments(const float2* stats, int g, int t0, int step,
                                                 const FusedArgs& args) {
  const int gs = args.group_size;
  const int c_begin = g * gs, c_end = (g + 1) * gs;
  Moments acc{0.f, 0.f, 0.f};
  for (int t = c_begin / kTile + t0; t <= (c_end - 1) / kTile; t += step) {
    const int seg = g - (t * kTile) / gs;
    const int n = min(c_end, (t + 1) * kTile) - max(c_begin, t * kTile);
    const float2 s = stats[t * args.stats_per_tile + seg];
    acc = merge_moments(acc, {static_cast<float>(n), s.x, s.y});
  }
  return acc;
}

// `in` holds pre(x @ W^T + b) for output row r and `stats` its per-segment moments (kNorm);
// the finished row goes to `out` (which may be `in`), or its reduction to args.row_out.
template <class Epi>
__device__ __forceinline__ void finish_row(const float2* stats, const float* in, float* out,
                                           int r, const FusedArgs& args) {
  constexpr int kind = Epi::kReduce;
  __shared__ float s_mean[Epi::kNorm ? kFinalizeGroups : 1], s_rstd[Epi::kNorm ? kFinalizeGroups : 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gs = args.group_size, N = args.N;
  // Groups spanning few tiles: a thread merges a group; wide ones: a warp, lanes over tiles.
  const bool warp_per_group = gs > 4 * kTile;
  RowAcc acc = row_acc_empty<kind == 0 ? 3 : kind>();

  for (int c0 = 0; c0 < N; c0 += kFinalizeChunk) {
    const int c1 = min(N, c0 + kFinalizeChunk);
    const int g0 = c0 / gs;
    if constexpr (Epi::kNorm) {
      const int groups = (c1 - 1) / gs - g0 + 1;
      if (warp_per_group) {
        for (int i = warp; i < groups; i += kFinalizeThreads / 32) {
          Moments m = group_moments(stats, g0 + i, lane, 32, args);
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) {
            const Moments o{__shfl_xor_sync(0xffffffffu, m.n, off),
                            __shfl_xor_sync(0xffffffffu, m.mean, off),
                            __shfl_xor_sync(0xffffffffu, m.m2, off)};
            // Lower lanes' tiles come first: every lane merges in the same order.
            m = (lane & off) ? merge_moments(o, m) : merge_moments(m, o);
          }
          if (lane == 0) {
            s_mean[i] = m.mean;
            s_rstd[i] = group_rstd(m.m2, gs, args.eps);
          }
        }
      } else {
        for (int i = tid; i < groups; i += kFinalizeThreads) {
          const Moments m = group_moments(stats, g0 + i, 0, 1, args);
          s_mean[i] = m.mean;
          s_rstd[i] = group_rstd(m.m2, gs, args.eps);
        }
      }
      __syncthreads();
    }
    for (int c = c0 + tid; c < c1; c += kFinalizeThreads) {
      float y = in[c];
      if constexpr (Epi::kNorm) y = normalize<Epi>(y, s_mean[c / gs - g0], s_rstd[c / gs - g0], c, args);
      if constexpr (kind == 0) {
        if (args.out_bf16 != nullptr)
          args.out_bf16[static_cast<int64_t>(r) * N + c] = __float2bfloat16_rn(y);
        else
          out[c] = y;
      } else {
        row_acc_push<kind>(acc, y);
      }
    }
    if constexpr (Epi::kNorm) __syncthreads();  // the next chunk overwrites s_mean / s_rstd
  }

  if constexpr (kind != 0) {
    __shared__ RowAcc s_acc[kFinalizeThreads / 32];
    acc = row_acc_warp<kind>(acc);
    if (lane == 0) s_acc[warp] = acc;
    __syncthreads();
    if (tid == 0) {
      RowAcc total = s_acc[0];
      for (int w = 1; w < kFinalizeThreads / 32; ++w) total = row_acc_merge<kind>(total, s_acc[w]);
      args.row_out[r] = row_acc_finish<kind>(total, N);
    }
  }
}

template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads) norm_finalize_kernel(FusedArgs args) {
  const int r = blockIdx.x;
  const int n_tiles = (args.N + kTile - 1) / kTile;
  float* row = args.out + static_cast<int64_t>(r) * args.N;
  finish_row<Epi>(args.norm_stats + static_cast<int64_t>(r) * n_tiles * args.stats_per_tile, row,
                  row, r, args);
}

// Dynamic shared memory the epilogue path stages a row and its segment moments in: N floats,
// then (kNorm) the moments, 8-byte aligned. Rows that do not fit are worked on in place in
// global memory, their moments in args.norm_stats.
constexpr int kRowSmemLimit = 200 * 1024;

template <class Epi>
__host__ __device__ inline int64_t row_smem_bytes(int N, int stats_per_tile) {
  const int64_t n_tiles = (N + kTile - 1) / kTile;
  return (N + 1) / 2 * 8 + (Epi::kNorm ? n_tiles * stats_per_tile * 8 : 0);
}

// The epilogue path: args.out holds x @ W^T + b from PyTorch's GEMM (args.bias is null). Each
// block reads its row once (into shared memory when `staged`, else in place), applies `pre`,
// computes the moments of each (128-column window, group segment) exactly as the GEMM kernels'
// wide mode does, and finishes the row into args.out. Within a block, __syncthreads orders the
// writes and reads of the row and its moments.
template <class Epi>
__global__ void __launch_bounds__(kFinalizeThreads) row_epilogue_kernel(FusedArgs args,
                                                                        bool staged) {
  extern __shared__ float2 s_dyn[];
  const int r = blockIdx.x, tid = threadIdx.x, N = args.N;
  const int n_tiles = (N + kTile - 1) / kTile;
  float* row = args.out + static_cast<int64_t>(r) * N;
  float* work = staged ? reinterpret_cast<float*>(s_dyn) : row;
  // Loads in batches, all issued before any is used: at a few rows, a handful of blocks must
  // keep enough reads in flight to stream their rows.
  constexpr int kBatch = 8;
  for (int c0 = tid; c0 < N; c0 += kBatch * kFinalizeThreads) {
    float v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = c0 + i * kFinalizeThreads;
      v[i] = c < N ? row[c] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = c0 + i * kFinalizeThreads;
      if (c < N) work[c] = epilogue_input<Epi>(v[i], 1.f, c, args);
    }
  }
  __syncthreads();
  float2* stats = nullptr;
  if constexpr (Epi::kNorm) {
    const int gs = args.group_size, spt = args.stats_per_tile;
    stats = staged ? s_dyn + (N + 1) / 2 : args.norm_stats + static_cast<int64_t>(r) * n_tiles * spt;
    for (int task = tid; task < n_tiles * spt; task += kFinalizeThreads) {
      const int t = task / spt, g = (t * kTile) / gs + task % spt;
      const int c_begin = max(g * gs, t * kTile), c_end = min((g + 1) * gs, min((t + 1) * kTile, N));
      if (c_begin < c_end) stats[task] = segment_moments(work + c_begin, c_end - c_begin);
    }
    __syncthreads();
  }
  finish_row<Epi>(stats, work, row, r, args);
}

template <class Epi>
cudaError_t launch_norm_finalize(const FusedArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  norm_finalize_kernel<Epi><<<args.M, kFinalizeThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

template <class Epi>
cudaError_t launch_row_epilogue(const FusedArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (args.bias != nullptr || args.a_inv_scale != nullptr || args.b_inv_scale != nullptr)
    return cudaErrorInvalidValue;  // PyTorch's GEMM already applied the bias
  const int64_t smem = row_smem_bytes<Epi>(args.N, args.stats_per_tile);
  const bool staged = smem <= kRowSmemLimit;
  if (!staged && Epi::kNorm && args.norm_stats == nullptr) return cudaErrorInvalidValue;
  if (staged && smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        row_epilogue_kernel<Epi>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRowSmemLimit);
    if (err != cudaSuccess) return err;
  }
  row_epilogue_kernel<Epi><<<args.M, kFinalizeThreads, staged ? smem : 0, stream>>>(args, staged);
  return cudaGetLastError();
}

}  // namespace gemmfuse
