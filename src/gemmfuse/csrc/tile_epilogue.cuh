// The epilogue both GEMM kernels share, from an fp32 output tile staged in shared memory.
//
// On entry `tile` holds kTile x kTile values of pre(x @ W^T + b) (row stride kTile + 1, so
// walks down a column hit distinct banks). GroupNorm statistics are computed per (row, group)
// with two passes over shared memory (a shifted mean, then the centred sum of squares) (the host only takes this path when the group size
// divides kTile, so groups never straddle tiles), then the affine transform and the generated
// `post` ops are applied in place. Finally the tile is stored, or reduced across its columns
// into one partial per row; the last column tile of a row band to finish folds the partials of
// all column tiles, in tile order, so the result does not depend on arrival order.
#pragma once
#include <cstdint>

#include "fused_args.h"

namespace gemmfuse {

constexpr int kTile = 128;           // output tile side, both kernels
constexpr int kEpiStride = kTile + 1;

__device__ __forceinline__ float reduce_op(int kind, float a, float b) {
  // NaN-propagating like torch.min / torch.max.
  if (kind == 1) return (a < b || a != a) ? a : b;
  if (kind == 2) return (a > b || a != a) ? a : b;
  return a + b;
}

// A GEMM result as the epilogue's input: unscaled (row and column powers of two), biased,
// rounded where the model's dtype would round, and passed through the generated `pre` ops.
template <class Epi>
__device__ __forceinline__ float epilogue_input(float acc, float a_inv, int gcol,
                                                const FusedArgs& args) {
  float v = acc * a_inv;
  if (args.b_inv_scale != nullptr) v *= __ldg(args.b_inv_scale + gcol);
  if (args.bias != nullptr) v += __ldg(args.bias + gcol);
  return Epi::pre(round_like_model(v, args.params), gcol, args.params);
}

// Where a tile sits: its origin and its index in the grid of tiles.
struct TileCoord {
  int m0, n0;      // first row and column
  int m_idx, n_idx;  // tile indices
  int n_tiles;     // column tiles in the grid
};

// `tid` runs over kThreads threads that all call this; `sync()` is a barrier among exactly them.
template <class Epi, int kThreads, class Sync>
__device__ __forceinline__ void tile_epilogue(float* tile, const FusedArgs& args, TileCoord tc,
                                              int tid, Sync sync) {
  const int lane = tid & 31, warp = tid >> 5;
  const int rows_here = min(kTile, args.M - tc.m0);
  const int cols_here = min(kTile, args.N - tc.n0);

  if constexpr (Epi::kNorm) {
    const int gs = args.group_size;
    const int groups_here = cols_here / gs;  // N and kTile are multiples of gs
    const float inv_gs = 1.f / static_cast<float>(gs);
    for (int task = tid; task < kTile * groups_here; task += kThreads) {
      const int r = task % kTile;  // consecutive threads walk rows: distinct banks
      if (r >= rows_here) continue;
      const int c0 = (task / kTile) * gs;
      float* v = tile + r * kEpiStride + c0;
      // Shifted by the group's first value: a group of equal values gets exactly that value as
      // its mean (variance exactly 0, as PyTorch's Welford gives), and large common offsets
      // do not cost the sum its precision.
      const float shift = v[0];
      float sum = 0.f;
      for (int j = 1; j < gs; ++j) sum += v[j] - shift;
      const float mean = shift + sum * inv_gs;
      float sq = 0.f;
      for (int j = 0; j < gs; ++j) {
        const float d = v[j] - mean;
        sq += d * d;
      }
      const float rstd = 1.f / sqrtf(sq * inv_gs + args.eps);
      for (int j = 0; j < gs; ++j) {
        const int gcol = tc.n0 + c0 + j;
        float y = (v[j] - mean) * rstd;
        if (args.gn_weight != nullptr)
          y = y * __ldg(args.gn_weight + gcol) + __ldg(args.gn_bias + gcol);
        v[j] = Epi::post(round_like_model(y, args.params), gcol, args.params);
      }
    }
    sync();
  }

  if constexpr (Epi::kReduce == 0) {
    for (int idx = tid; idx < kTile * kTile; idx += kThreads) {
      const int r = idx / kTile, c = idx % kTile;
      if (r < rows_here && c < cols_here) {
        const int64_t at = static_cast<int64_t>(tc.m0 + r) * args.N + tc.n0 + c;
        if (args.out_bf16 != nullptr)
          args.out_bf16[at] = __float2bfloat16_rn(tile[r * kEpiStride + c]);
        else
          args.out[at] = tile[r * kEpiStride + c];
      }
    }
  } else {
    constexpr int kind = Epi::kReduce;
    for (int r = warp; r < rows_here; r += kThreads / 32) {
      float red = 0.f;
      bool have = false;
      for (int c = lane; c < cols_here; c += 32) {
        const float v = tile[r * kEpiStride + c];
        red = have ? reduce_op(kind, red, v) : v;
        have = true;
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, red, off);
        const bool o_have = __shfl_xor_sync(0xffffffffu, have, off);
        if (o_have) red = have ? reduce_op(kind, red, o) : o;
        have = have || o_have;
      }
      if (lane == 0) args.row_partial[static_cast<int64_t>(tc.n_idx) * args.M + tc.m0 + r] = red;
    }
    __shared__ bool is_last;
    __threadfence();
    sync();
    if (tid == 0) {
      const int arrived = atomicAdd(args.row_counter + tc.m_idx, 1);
      is_last = arrived == tc.n_tiles - 1;
    }
    sync();
    if (is_last) {
      __threadfence();
      for (int r = tid; r < rows_here; r += kThreads) {
        float red = __ldcg(args.row_partial + tc.m0 + r);
        for (int tn = 1; tn < tc.n_tiles; ++tn)
          red = reduce_op(kind, red,
                          __ldcg(args.row_partial + static_cast<int64_t>(tn) * args.M + tc.m0 + r));
        args.row_out[tc.m0 + r] = red;
      }
      if (tid == 0) args.row_counter[tc.m_idx] = 0;  // ready for the next launch
    }
  }
}

}  // namespace gemmfuse
