// The epilogue path's kernel for a float32 GroupNorm (or LayerNorm, RMSNorm) whose groups are
// whole 128-channel tiles, on rows of up to kWideRowMaxN channels: a block per row holds the
// row in registers, four values a 16-byte load.
//
// Quad q of the row (channels 4q..4q+3) is thread q % 512's j-th, j = q / 512, so the 32 quads
// of tile t are warp t % 16's j = t / 16: a warp holds whole tiles, a lane four channels of each.
// A warp computes its tiles' moments as segment_moments_warp does (the tile's first value as
// shift, compensated sums, merged by the same xor tree), its up to kWideRowQuads tiles side by
// side; a warp a group merges the group's tiles with Chan's formula (group_moments_warp: each
// lane its tiles in order, then a fixed xor tree, as norm_finalize_kernel does for groups of
// more than four tiles), then the block normalises, applies the chain's `post` ops and stores
// the row, or reduces it, from the registers. One read of z and one write: the tile kernel and
// norm_finalize_kernel move the pre-norm row through global memory twice more, and
// row_epilogue_kernel's row in shared memory left one row's work latency-bound (124 us for
// #62's chain at 1024 x 8192 in a trial on such rows, H100, 2026-11-27). At 1024 x 8192
// (torch.profiler, median of 10, L2 cleared, H100, 2026-11-28, with 256 threads of 8 float4s):
// #62's chain in one group 46 us against 90 for the tile and finalize kernels, #75's 44 against
// 96; in 16 groups 48 against 87 and 48 against 97. At 16 rows #62's chain took 11.5 us against
// 10.2 (one block's latency a row); #75's 11.8 against 27.8.
//
// 512 threads of 4 float4s (first tried in 0dd7aa2, 2026-11-28): the heavy chains' pre and post
// ops (the random pool's chain 7: silu, softplus, mish, hardswish, then sigmoid, tanh, exp) are
// bound by instruction latency; with half as many values a thread the registers drop from 74 to
// 60 (58 since the moments share strided_moments_warp), so an SM runs 32 warps (two blocks)
// where it ran 24 (three blocks of 256). On a given z at
// 1024 x 8192 (same method, the two trees in turn, two runs each, H100): chain 7 173 -> 105 us in
// one group and 177 -> 110 in 16, the pool's chain 2 (a mean) 109 -> 85, chain 1 89 -> 78;
// #62's chain 46.4 -> 45.0, #75's 43.6 -> 44.5, #62's at 4096 rows 159 -> 160 and at 16 rows
// 11.5 -> 8.7; the outputs' errors against float64 unchanged to the digits shown. Also tried
// there: the 256 threads capped at 64 registers (spills; chain 7 154 us) and 1024 threads of 2
// float4s (48 registers, one block an SM: chain 7 125 us, #62's 59). DESIGN section 2 has the
// table and why 0dd7aa2 was first taken back.
#pragma once
#include <cstdint>

#include "fused_args.h"
#include "moments_merge.cuh"
#include "row_reduce.cuh"
#include "tile_epilogue.cuh"

namespace gemmfuse {

constexpr int kWideRowThreads = 512;
constexpr int kWideRowQuads = 4;  // float4s a thread holds
constexpr int kWideRowMaxN = kWideRowThreads * kWideRowQuads * 4;  // 8192 channels
static_assert(kTile == 128 && kTile / 4 == 32, "a warp's 32 quads are one tile");

// Groups of whole tiles (so wider than or as wide as a tile) on a row of at most max_n channels,
// the row's output and the GroupNorm's weight and bias 16-byte aligned (the channel count, a
// multiple of the group size, keeps every row so); moments, not a softmax's statistics; no max
// pooling (Epi::kPool 1: epilogue.py never pairs one with a norm, as group_rows_serves checks
// too). finish_row_registers' terms, whatever brings the row into registers.
template <class Epi>
constexpr bool normalizes_in_registers() {
  return Epi::kModelDtype == kFloat32Model && Epi::kNorm && !Epi::kSoftmax && Epi::kPool == 1;
}

template <class Epi>
inline bool whole_tile_groups(const FusedArgs& args, int max_n) {
  if constexpr (!normalizes_in_registers<Epi>()) {
    return false;
  } else {
    const int gs = args.group_size;
    return args.norm_wide && gs > 0 && gs % kTile == 0 && args.N % gs == 0 && args.N <= max_n &&
           args.stats_per_tile <= 2 && reinterpret_cast<uintptr_t>(args.out) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(args.gn_weight) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(args.gn_bias) % 16 == 0;
  }
}

// wide_rows_kernel's: the rows fit its registers and its input is 16-byte aligned too.
template <class Epi>
inline bool wide_rows_serves(const FusedArgs& args) {
  return whole_tile_groups<Epi>(args, kWideRowMaxN) &&
         reinterpret_cast<uintptr_t>(epilogue_source(args)) % 16 == 0;
}

// The moments of the 128 values a warp holds (four a lane), as segment_moments_warp computes
// them for a run of shared memory: shifted by the tile's first value (lane 0's first).
__device__ __forceinline__ SegmentMoments tile_moments_warp(const float4& v) {
  const float x[4] = {v.x, v.y, v.z, v.w};
  return strided_moments_warp([&](int i) { return x[i]; }, 0, 4, 1,
                              __shfl_sync(0xffffffffu, v.x, 0), kTile);
}

// Row r's z (x @ W^T + b), kQuads float4s a thread in registers (quad q = tid + j * kThreads,
// so that warp w's j-th holds tile w + j * kThreads / 32), finished there: `pre`, each tile's
// moments, each group's, then normalised, `post` applied and stored into args.out's row r, or
// reduced into args.row_out[r]. The block's threads all call it (its barriers); a block that
// finishes a second row calls __syncthreads() first (the shared arrays and the reduction's).
template <class Epi, int kThreads, int kQuads>
__device__ __forceinline__ void finish_row_registers(float4 (&v)[kQuads], int r,
                                                     const FusedArgs& args) {
  constexpr int kWarps = kThreads / 32, kMaxTiles = kThreads * kQuads * 4 / kTile;
  __shared__ float4 stats[kMaxTiles * 2];  // [tile, segment] as norm_stats' layout
  __shared__ float s_mean[kMaxTiles], s_mean_lo[kMaxTiles], s_rstd[kMaxTiles];
  const int N = args.N, gs = args.group_size;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int quads = N / 4, n_tiles = N / kTile;

  auto pre = [&](float z, int c) { return epilogue_input<Epi>(z, 1.f, r, c, args); };
#pragma unroll
  for (int j = 0; j < kQuads; ++j) {
    const int c = (tid + j * kThreads) * 4;
    if (c < N)
      v[j] = make_float4(pre(v[j].x, c), pre(v[j].y, c + 1), pre(v[j].z, c + 2),
                         pre(v[j].w, c + 3));
  }
#pragma unroll
  for (int j = 0; j < kQuads; ++j) {
    const int t = warp + j * kWarps;  // the warp's j-th tile
    if (t < n_tiles) {                // uniform across the warp
      const SegmentMoments m = tile_moments_warp(v[j]);
      if (lane == 0) stats[t * args.stats_per_tile] = make_float4(m.mean, m.mean_lo, m.m2, 0.f);
    }
  }
  __syncthreads();
  for (int g = warp; g < N / gs; g += kWarps) {
    const Moments m = group_moments_warp<Epi>(stats, g, lane, args);
    if (lane == 0) store_group_params<Epi>(m, g, s_mean, s_mean_lo, s_rstd, args);
  }
  __syncthreads();

  constexpr int kind = Epi::kReduce;
  RowAcc acc = row_acc_empty<kind == 0 ? 3 : kind>();
  const bool affine = args.gn_weight != nullptr;
  float4* out = reinterpret_cast<float4*>(args.out + static_cast<int64_t>(r) * N);
#pragma unroll
  for (int j = 0; j < kQuads; ++j) {
    const int q = tid + j * kThreads, c = q * 4;
    if (q >= quads) continue;
    const int g = c / gs;  // the quad's four channels share a group (gs % 4 == 0)
    const float4 w = affine ? __ldg(reinterpret_cast<const float4*>(args.gn_weight) + q)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 b = affine ? __ldg(reinterpret_cast<const float4*>(args.gn_bias) + q)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
    auto norm = [&](float x, float wc, float bc, int col) {
      return normalize<Epi>(x, s_mean[g], s_mean_lo[g], s_rstd[g], wc, bc, r, col, args);
    };
    const float4 y = make_float4(norm(v[j].x, w.x, b.x, c), norm(v[j].y, w.y, b.y, c + 1),
                                 norm(v[j].z, w.z, b.z, c + 2), norm(v[j].w, w.w, b.w, c + 3));
    if constexpr (kind == 0) {
      out[q] = y;
    } else {
      row_acc_push<kind>(acc, y.x);
      row_acc_push<kind>(acc, y.y);
      row_acc_push<kind>(acc, y.z);
      row_acc_push<kind>(acc, y.w);
    }
  }
  if constexpr (kind != 0) row_acc_block_store<kind, kThreads>(acc, args.row_out + r, N);
}

template <class Epi>
__global__ void __launch_bounds__(kWideRowThreads) wide_rows_kernel(FusedArgs args) {
  const int r = blockIdx.x, quads = args.N / 4;
  const float4* in = reinterpret_cast<const float4*>(epilogue_source(args) +
                                                     static_cast<int64_t>(r) * args.N);
  float4 v[kWideRowQuads];
#pragma unroll
  for (int j = 0; j < kWideRowQuads; ++j) {
    const int q = threadIdx.x + j * kWideRowThreads;
    v[j] = q < quads ? in[q] : make_float4(0.f, 0.f, 0.f, 0.f);  // plain: in may be args.out
  }
  finish_row_registers<Epi, kWideRowThreads, kWideRowQuads>(v, r, args);
}

template <class Epi>
cudaError_t launch_wide_rows(const FusedArgs& args, cudaStream_t stream) {
  wide_rows_kernel<Epi><<<args.M, kWideRowThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace gemmfuse
