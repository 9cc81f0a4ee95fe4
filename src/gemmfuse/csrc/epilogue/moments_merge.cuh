// Merging a GroupNorm group's statistics from the moments of its pieces (per tile segment):
// Chan's formula for the mean and centred sum of squares, a softmax's maxima and sums. Shared by
// norm_finalize_kernel's second pass, row_epilogue_kernel, the few-rows kernel's last block
// (gemv_epilogue.cuh) and wide_rows_kernel.
#pragma once
#include "fused_args.h"
#include "tile_epilogue.cuh"

namespace gemmfuse {

struct Moments {
  float n, mean, mean_lo, m2;  // count, mean (mean + mean_lo), centred sum of squares
};

// Chan's merge, the mean kept as mean + mean_lo: the step d * wb is added with TwoSum, its
// rounding (and that of d) go to mean_lo.
__device__ __forceinline__ Moments merge_moments(Moments a, Moments b) {
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float n = a.n + b.n, wb = b.n / n;
  float d_err, m_err;
  const float d_hi = two_sum(b.mean, -a.mean, d_err);
  const float d = d_hi + (d_err + (b.mean_lo - a.mean_lo));
  const float step = d * wb;
  const float mean = two_sum(a.mean, step, m_err);
  const float step_err = isfinite(step) ? fmaf(d, wb, -step) : 0.f;
  return {n, mean, a.mean_lo + (m_err + step_err), a.m2 + b.m2 + d * d * a.n * wb};
}

// Two runs' softmax statistics (segment_softmax's, in Moments' fields: mean the largest value,
// m2 + mean_lo the sum of exp(v - max)) as one: each sum rescaled to the larger maximum, the
// products' and the addition's rounding errors kept in mean_lo.
__device__ __forceinline__ Moments merge_softmax(Moments a, Moments b) {
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float top = max_nan(a.mean, b.mean);
  const float fa = expf(a.mean - top), fb = expf(b.mean - top);
  const float pa = a.m2 * fa, pb = b.m2 * fb;
  float err;
  const float sum = two_sum(pa, pb, err);
  const float lo = err + fmaf(a.m2, fa, -pa) + fmaf(b.m2, fb, -pb) +
                   fmaf(a.mean_lo, fa, b.mean_lo * fb);
  return {a.n + b.n, top, lo, sum};
}

template <class Epi>
__device__ __forceinline__ Moments merge_stats(Moments a, Moments b) {
  if constexpr (Epi::kSoftmax)
    return merge_softmax(a, b);
  else
    return merge_moments(a, b);
}

// The moments of group g from tiles t0, t0 + step, ... of its span (in tile order).
template <class Epi>
__device__ __forceinline__ Moments group_moments(const float4* stats, int g, int t0, int step,
                                                 const FusedArgs& args) {
  const int gs = args.group_size;
  const int c_begin = g * gs, c_end = (g + 1) * gs;
  Moments acc{0.f, 0.f, 0.f, 0.f};
  for (int t = c_begin / kTile + t0; t <= (c_end - 1) / kTile; t += step) {
    const int seg = g - (t * kTile) / gs;
    const int n = min(c_end, (t + 1) * kTile) - max(c_begin, t * kTile);
    const float4 s = stats[t * args.stats_per_tile + seg];
    acc = merge_stats<Epi>(acc, {static_cast<float>(n), s.x, s.y, s.z});
  }
  return acc;
}

// group_moments with a warp: lanes over the group's tiles, merged by a fixed xor tree (lower
// lanes' tiles first, so every lane merges in the same order); every lane gets the result.
template <class Epi>
__device__ __forceinline__ Moments group_moments_warp(const float4* stats, int g, int lane,
                                                      const FusedArgs& args) {
  Moments m = group_moments<Epi>(stats, g, lane, 32, args);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Moments o{__shfl_xor_sync(0xffffffffu, m.n, off),
                    __shfl_xor_sync(0xffffffffu, m.mean, off),
                    __shfl_xor_sync(0xffffffffu, m.mean_lo, off),
                    __shfl_xor_sync(0xffffffffu, m.m2, off)};
    m = (lane & off) ? merge_stats<Epi>(o, m) : merge_stats<Epi>(m, o);
  }
  return m;
}

// A group's normalisation parameters from its merged moments, into slot i of a block's arrays
// (finish_row's, finish_row_registers's).
template <class Epi>
__device__ __forceinline__ void store_group_params(const Moments& m, int i, float* mean,
                                                   float* mean_lo, float* rstd,
                                                   const FusedArgs& args) {
  mean[i] = m.mean;
  mean_lo[i] = m.mean_lo;
  rstd[i] = norm_rstd<Epi, true>(m.m2, m.mean, m.mean_lo, args.group_size, args.eps);
}

}  // namespace gemmfuse
