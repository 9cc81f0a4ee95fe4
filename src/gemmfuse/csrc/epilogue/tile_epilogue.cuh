// The epilogue both GEMM kernels share, from an fp32 output tile staged in shared memory.
//
// On entry `tile` holds kRows x kTile values of pre(x @ W^T + b) (row stride kTile + 1, so
// walks down a column hit distinct banks). Then, by the GroupNorm's group size:
// - groups that divide kTile (they never straddle tiles): statistics per (row, group) with two
//   passes over shared memory (a shifted mean, then the centred sum of squares), then the affine
//   transform and the generated `post` ops; the tile is then stored, or reduced across its
//   columns into one partial per row (each group's task reducing its own outputs, the row then
//   merging its groups in order), and the last column tile of a row band to finish folds the
//   partials of all column tiles in tile order (the result does not depend on arrival order);
// - wider groups, or groups that straddle tiles (args.norm_wide): each (row, group segment in
//   this tile) gets its mean and centred sum of squares, written to args.norm_stats, and the
//   pre-norm tile is stored as fp32; norm_finalize.cuh merges the segments and finishes.
#pragma once
#include <cstdint>

#include "fused_args.h"
#include "last_block.cuh"
#include "row_reduce.cuh"

namespace gemmfuse {

constexpr int kEpiStride = kTile + 1;

// A GEMM result as the epilogue's input: unscaled (row and column powers of two), biased,
// rounded where the model's dtype would round, and passed through the generated `pre` ops.
// A column's inverse weight scale and bias, loaded once for all of a tile's rows.
struct ColumnTerms {
  float inv_scale, bias;
};
__device__ __forceinline__ ColumnTerms column_terms(int gcol, const FusedArgs& args) {
  return {args.b_inv_scale != nullptr ? __ldg(args.b_inv_scale + gcol) : 1.f,
          args.bias != nullptr ? __ldg(args.bias + gcol) : 0.f};
}

// The GEMM result z = x @ W^T + b itself: unscaled, biased, rounded as the model rounds.
template <class Epi>
__device__ __forceinline__ float gemm_value(float acc, float a_inv, ColumnTerms col,
                                            const FusedArgs& args) {
  float v = acc * a_inv;
  if (args.b_inv_scale != nullptr) v *= col.inv_scale;
  if (args.bias != nullptr) v += col.bias;
  return round_like_model<Epi::kModelDtype>(v, args.params);
}

// Stores z at (row, col) for the backward where the caller asked for it (args.z_out*); rows and
// columns past the output are the tile's padding and are dropped.
template <class Epi>
__device__ __forceinline__ void save_gemm_value(float z, int row, int col, const FusedArgs& args) {
  if (row >= args.M || col >= args.N) return;
  const int64_t i = static_cast<int64_t>(row) * args.N + col;
  if (args.z_out != nullptr) args.z_out[i] = z;
  if constexpr (Epi::kModelDtype != kFloat32Model) {
    if (args.z_out16 != nullptr)
      args.z_out16[i] = to_model16(z, model_dtype<Epi::kModelDtype>(args.params.model16));
  }
}

template <class Epi>
__device__ __forceinline__ float epilogue_input(float acc, float a_inv, ColumnTerms col, int grow,
                                                int gcol, const FusedArgs& args) {
  return Epi::pre(gemm_value<Epi>(acc, a_inv, col, args), grow, gcol, args.params);
}

template <class Epi>
__device__ __forceinline__ float epilogue_input(float acc, float a_inv, int grow, int gcol,
                                                const FusedArgs& args) {
  return epilogue_input<Epi>(acc, a_inv, column_terms(gcol, args), grow, gcol, args);
}

// The epilogue path's input: args.epilogue_in, or args.out itself (in place).
__device__ __host__ __forceinline__ const float* epilogue_source(const FusedArgs& args) {
  return args.epilogue_in != nullptr ? args.epilogue_in : args.out;
}

// The epilogue path's staged value: z through `pre`. gemm_value's unscaling, bias and rounding
// are identities here (launch_tile_epilogue refuses scales and a bias, and a 16-bit model's z is
// in its dtype already), so a 16-bit instance skips them: a conversion each value, at a quarter
// of the FP32 rate. A float32 instance keeps gemm_value, whose rounding is also a barrier to
// contraction (round_like_model).
template <class Epi>
__device__ __forceinline__ float staged_input(float z, int row, int col, const FusedArgs& args) {
  if constexpr (Epi::kModelDtype == kFloat32Model)
    return epilogue_input<Epi>(z, 1.f, row, col, args);
  else
    return Epi::pre(z, row, col, args.params);
}

// A GEMM kernel's accumulator at output place (row, col), which may be the tile's padding past
// the output, as its epilogue input: z saved for the backward where the call asks (not past the
// output), then `pre` at the place clamped into the output.
template <class Epi>
__device__ __forceinline__ float saved_epilogue_input(float acc, float a_inv, ColumnTerms terms,
                                                      int row, int col, const FusedArgs& args) {
  const float z = gemm_value<Epi>(acc, a_inv, terms, args);
  save_gemm_value<Epi>(z, row, col, args);
  return Epi::pre(z, min(row, args.M - 1), min(col, args.N - 1), args.params);
}

// Where a tile sits: its origin and its index in the grid of tiles.
struct TileCoord {
  int m0, n0;      // first row and column
  int m_idx, n_idx;  // tile indices
  int n_tiles;     // column tiles in the grid
};

// A run of values' moments: the mean as the unevaluated sum mean + mean_lo (about twice float's
// precision) and the centred sum of squares. Normalising with (v - mean) - mean_lo keeps the
// outputs' own sum at about 0 where the group's mean is large against its spread: with the mean
// rounded to a float, every output would be shifted by that rounding times rstd, which a later
// sum over channels (where a GroupNorm output cancels to about 0) shows in full.
struct SegmentMoments {
  float mean, mean_lo, m2;
};

// kWays compensated sums (TwoSum, the rounding errors gathered in comp) fed kWays values at a
// time by for_each_way, so that kWays independent chains are in flight; total() merges them by
// TwoSum too.
template <int kWays>
struct CompensatedSums {
  float sum[kWays] = {}, comp[kWays] = {};
  __device__ __forceinline__ void add(int way, float value, float extra = 0.f) {
    float err;
    sum[way] = two_sum(sum[way], value, err);
    comp[way] += err + extra;
  }
  __device__ __forceinline__ float total(float& comp_out) const {
    float s = sum[0], c = comp[0];
#pragma unroll
    for (int w = 1; w < kWays; ++w) {
      float err;
      s = two_sum(s, sum[w], err);
      c += comp[w] + err;
    }
    comp_out = c;
    return s;
  }
};

// f(j, way) for j in [first, n): kWays at a time with way = j - first's place among them (a
// constant once unrolled, so CompensatedSums' arrays stay in registers), the rest on way 0.
template <int kWays, int kUnroll, class F>
__device__ __forceinline__ void for_each_way(int first, int n, F f) {
  int j = first;
#pragma unroll kUnroll
  for (; j + kWays <= n; j += kWays) {
#pragma unroll
    for (int w = 0; w < kWays; ++w) f(j + w, w);
  }
  for (; j < n; ++j) f(j, 0);
}

// The mean of n values whose differences from `shift` sum to sum + comp (a compensated sum), as
// mean + mean_lo: mean - shift = (sum + comp) / n = d + d_lo, the division's remainder from an
// fma, and mean = shift + d with TwoSum's error going to mean_lo.
__device__ __forceinline__ float shifted_mean(float shift, float sum, float comp, int n,
                                              float& mean_lo) {
  const float nf = static_cast<float>(n);
  float s_err, m_err;
  const float s = two_sum(sum, comp, s_err);
  const float d = s / nf;
  const float d_lo = isfinite(d) ? (fmaf(-d, nf, s) + s_err) / nf : 0.f;
  const float mean = two_sum(shift, d, m_err);
  mean_lo = m_err + d_lo;
  return mean;
}

// Moments of v[0..n), two passes shifted by v[0]: a run of equal values gets exactly that mean
// and a sum of squares of exactly 0 (as PyTorch's Welford gives), and a large common offset
// does not cost the sum its precision.
// kExact (the fp32-accurate paths): both passes compensated (TwoSum, and each square's rounding
// error recovered with an fma), and the mean carried to mean_lo: an error in the mean shifts
// every normalised value of the group alike, one in the variance scales them all, and a later
// op or sum over channels shows either; uncompensated, a sequential sum of n terms loses about
// sqrt(n) ulps, more than PyTorch's tree reductions. Otherwise (the one-pass tf32 and bf16
// variants, whose GEMM error is thousands of times larger, and the epilogue path's 16-bit
// instances, whose z is rounded to 16 bits): plain sums, two chains at a time.
// kN > 0: n is kN, known at compile time (v may then be a register array: loops unroll fully).
template <bool kExact, int kN = 0, class Values>
__device__ __forceinline__ SegmentMoments segment_moments(const Values& v, int n_run_time) {
  constexpr int kUnroll = kN > 0 ? kN : 1;
  const int n = kN > 0 ? kN : n_run_time;
  const float shift = v[0];
  if constexpr (!kExact) {
    float s0 = 0.f, s1 = 0.f;
    int j = 0;
#pragma unroll kUnroll
    for (; j + 1 < n; j += 2) {
      s0 += v[j] - shift;
      s1 += v[j + 1] - shift;
    }
    if (j < n) s0 += v[j] - shift;
    const float mean = shift + (s0 + s1) / static_cast<float>(n);
    float q0 = 0.f, q1 = 0.f;
#pragma unroll kUnroll
    for (j = 0; j + 1 < n; j += 2) {
      const float d0 = v[j] - mean, d1 = v[j + 1] - mean;
      q0 = fmaf(d0, d0, q0);
      q1 = fmaf(d1, d1, q1);
    }
    if (j < n) q0 = fmaf(v[j] - mean, v[j] - mean, q0);
    return {mean, 0.f, q0 + q1};
  } else {
    // Four compensated sums side by side, each over every fourth value, merged exactly at the
    // end: one chain waits on each TwoSum (and, from shared memory, each load) in turn, which
    // left a thread per 64-value group latency-bound (ncu, #37's epilogue, 2026-11-24).
    constexpr int kWays = 4, kSteps = kN > 0 ? kN / kWays : 1;
    CompensatedSums<kWays> sums;
    for_each_way<kWays, kSteps>(1, n, [&](int j, int w) { sums.add(w, v[j] - shift); });
    float comp;
    const float sum = sums.total(comp);
    float mean_lo;
    const float mean = shifted_mean(shift, sum, comp, n, mean_lo);
    CompensatedSums<kWays> squares;
    for_each_way<kWays, kSteps>(0, n, [&](int j, int w) {
      const float dj = (v[j] - mean) - mean_lo, p = dj * dj;
      squares.add(w, p, fmaf(dj, dj, -p));
    });
    const float sq = squares.total(comp);
    return {mean, mean_lo, sq + comp};
  }
}

// segment_moments<true> with a warp on one run v[0..n) (each lane a strided part, merged by a
// fixed xor tree, lane 0's result taken by all): for long runs, where a thread per run leaves
// most of a block idle on a chain of shared-memory loads. `lane`: 0..31, the whole warp calls.
// A compensated sum (sum + comp) spread over a warp's lanes, merged by a fixed xor tree; lane
// 0's result taken by all.
__device__ __forceinline__ void warp_sum(float& sum, float& comp) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float so = __shfl_xor_sync(0xffffffffu, sum, off);
    const float co = __shfl_xor_sync(0xffffffffu, comp, off);
    float err;
    sum = two_sum(sum, so, err);
    comp += co + err;
  }
  sum = __shfl_sync(0xffffffffu, sum, 0);
  comp = __shfl_sync(0xffffffffu, comp, 0);
}

// The compensated moments of n values a warp holds, shifted by `shift`: a lane sums get(j) for
// j = first, first + step, ... below end, TwoSum sums merged by warp_sum's xor tree.
template <class Get>
__device__ __forceinline__ SegmentMoments strided_moments_warp(const Get& get, int first, int end,
                                                               int step, float shift, int n) {
  float sum = 0.f, comp = 0.f;
  for (int j = first; j < end; j += step) {
    float err;
    sum = two_sum(sum, get(j) - shift, err);
    comp += err;
  }
  warp_sum(sum, comp);
  float mean_lo;
  const float mean = shifted_mean(shift, sum, comp, n, mean_lo);
  float sq = 0.f;
  comp = 0.f;
  for (int j = first; j < end; j += step) {
    const float dj = (get(j) - mean) - mean_lo, p = dj * dj;
    float err;
    sq = two_sum(sq, p, err);
    comp += err + fmaf(dj, dj, -p);
  }
  warp_sum(sq, comp);
  return {mean, mean_lo, sq + comp};
}

// A run of n values in shared memory, lane l summing v[l], v[l + 32], ... (its first value the
// shift).
__device__ __forceinline__ SegmentMoments segment_moments_warp(const float* v, int n, int lane) {
  return strided_moments_warp([&](int j) { return v[j]; }, lane, n, 32, v[0], n);
}

// A run's softmax statistics (Epi::kSoftmax) in SegmentMoments' fields: `mean` its largest value
// (NaN where it holds one, as torch.amax gives it), `m2` + `mean_lo` the sum of exp(v - max),
// compensated (TwoSum). Runs of one row merge with merge_softmax (moments_merge.cuh).
template <int kN = 0, class Values>
__device__ __forceinline__ SegmentMoments segment_softmax(const Values& v, int n_run_time) {
  constexpr int kUnroll = kN > 0 ? kN : 1;
  const int n = kN > 0 ? kN : n_run_time;
  float top = v[0];
#pragma unroll kUnroll
  for (int j = 1; j < n; ++j) top = max_nan(top, v[j]);
  float sum = 0.f, comp = 0.f;
#pragma unroll kUnroll
  for (int j = 0; j < n; ++j) {
    float err;
    sum = two_sum(sum, expf(v[j] - top), err);
    comp += err;
  }
  return {top, comp, sum};
}

// segment_softmax with a warp on one run v[0..n) (lanes strided, merged by xor trees).
__device__ __forceinline__ SegmentMoments segment_softmax_warp(const float* v, int n, int lane) {
  float top = v[0];
  for (int j = lane; j < n; j += 32) top = max_nan(top, v[j]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    top = max_nan(top, __shfl_xor_sync(0xffffffffu, top, off));
  float sum = 0.f, comp = 0.f;
  for (int j = lane; j < n; j += 32) {
    float err;
    sum = two_sum(sum, expf(v[j] - top), err);
    comp += err;
  }
  warp_sum(sum, comp);
  return {top, comp, sum};
}

// The statistics the chain's norm needs of a run: a softmax's, or the moments.
template <class Epi, bool kExact, int kN = 0, class Values>
__device__ __forceinline__ SegmentMoments segment_stats(const Values& v, int n) {
  if constexpr (Epi::kSoftmax)
    return segment_softmax<kN>(v, n);
  else
    return segment_moments<kExact, kN>(v, n);
}

template <class Epi>
__device__ __forceinline__ SegmentMoments segment_stats_warp(const float* v, int n, int lane) {
  if constexpr (Epi::kSoftmax)
    return segment_softmax_warp(v, n, lane);
  else
    return segment_moments_warp(v, n, lane);
}

// Whether `tasks` runs of n values each take a warp (segment_moments_warp) or a thread among
// `threads`: a warp when the runs are long and too few to give most threads one (a thread per
// run then leaves the block idle on a chain of shared-memory loads: M = 16, N = 1024, groups of
// 64 took 14.6 us that way, 8.9 us a warp each). With a task per thread or more, a thread per
// run: a warp each was slower (groups of 64 at M = 128, N = K = 1024: 64 us against 41 us).
__device__ __forceinline__ bool warp_per_task(int n, int tasks, int threads) {
  return n >= 32 && 4 * tasks <= threads;
}

// 1 / sqrt(m2 / n + eps) of a group. kExact: in double (once per group), correctly rounded but
// for double's own, negligible, rounding, where the float chain rounds four times; the _rn
// intrinsics keep it inline (the operators' slow paths are calls, with a stack frame).
// Otherwise one rsqrt (about 2 ulps).
template <bool kExact>
__device__ __forceinline__ float group_rstd(float m2, int n, float eps) {
  if constexpr (!kExact) return rsqrtf(fmaf(m2, 1.f / static_cast<float>(n), eps));
  const double var = __dmul_rn(static_cast<double>(m2), __drcp_rn(static_cast<double>(n)));
  return static_cast<float>(__drcp_rn(__dsqrt_rn(__dadd_rn(var, static_cast<double>(eps)))));
}

// The group's rstd from its moments: 1 / sqrt(m2 / n + eps) for a GroupNorm or LayerNorm; for
// an RMSNorm (Epi::kRms) 1 / sqrt(mean(v^2) + eps), mean(v^2) = m2 / n + mean^2 with the mean as
// mean + mean_lo (kExact: in double, where the float products would round twice). A softmax's
// (segment_softmax's statistics): the sum of exp(v - max) that divides, a log_softmax's its log.
template <class Epi, bool kExact>
__device__ __forceinline__ float norm_rstd(float m2, float mean, float mean_lo, int n, float eps) {
  if constexpr (Epi::kSoftmax) {
    const float sum = m2 + mean_lo;
    return Epi::kLogSoftmax ? logf(sum) : sum;
  } else if constexpr (!Epi::kRms) {
    return group_rstd<kExact>(m2, n, eps);
  } else if constexpr (!kExact) {
    return rsqrtf(fmaf(m2, 1.f / static_cast<float>(n), fmaf(mean, mean, eps)));
  } else {
    const double mu = __dadd_rn(static_cast<double>(mean), static_cast<double>(mean_lo));
    const double var = __dmul_rn(static_cast<double>(m2), __drcp_rn(static_cast<double>(n)));
    const double ms = __dadd_rn(var, __dmul_rn(mu, mu));
    return static_cast<float>(__drcp_rn(__dsqrt_rn(__dadd_rn(ms, static_cast<double>(eps)))));
  }
}

// A bf16 model's GroupNorm statistics as eager bf16 computes them (params.group_stats != 0),
// so that a reduced value matches eager's to the bit: a one-ulp difference in #75's row
// minimum, which a later `+ bias` can cancel to about 0, is beyond bf16's 1e-2 tolerance, and
// statistics computed otherwise (even exactly) differ from eager's in one GroupNorm output of
// three (H100, torch 2.11, 2026-11-25). PyTorch's RowwiseMomentsCUDAKernel with a warp per
// group (groups under 512 values): lane l folds values l, l + 32, ... by Welford's update, the
// lanes merge by shfl_down at offsets 16 to 1 (Chan's formula), written with the fmas nvcc
// contracts PyTorch's expressions into; var = m2 / n and rstd = rsqrtf(var + eps), eps cast to
// bf16 as PyTorch casts it to the input's dtype. Mode 2 rounds mean and rstd to bf16 (the
// statistics that torch's GroupNorm output reads in versions that normalise with them).
struct Welford {
  float mean, m2, n;
};

__device__ __forceinline__ Welford welford_push(Welford a, float x) {
  const float n = a.n + 1.f, delta = x - a.mean;
  const float mean = a.mean + delta / n;
  return {mean, fmaf(delta, x - mean, a.m2), n};
}

__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
  if (a.n == 0.f) return b;
  if (b.n == 0.f) return a;
  const float delta = b.mean - a.mean, count = a.n + b.n, nb = b.n / count;
  return {fmaf(delta, nb, a.mean), fmaf(delta * delta * a.n, nb, a.m2 + b.m2), count};
}

__device__ __forceinline__ float to_bf16_and_back(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// The statistics from the merged Welford state of a group of `count` values.
__device__ __forceinline__ SegmentMoments eager_group_finish(float mean, float m2, float count,
                                                             int mode, float eps, float& rstd) {
  rstd = rsqrtf(m2 / count + to_bf16_and_back(eps));
  if (mode == 2) {
    mean = to_bf16_and_back(mean);
    rstd = to_bf16_and_back(rstd);
  }
  return {mean, 0.f, m2};
}

// The state of the lanes l, l + kOff, l + 2 kOff, ... of a group of kN values, one per lane,
// as PyTorch's shfl_down tree merges them: at offset kOff, lane l takes lane l + kOff's state,
// itself the merge at offset 2 kOff; at kOff = kN each lane holds its own value (lanes past kN
// are empty and change nothing). Evaluated depth first, so a handful of states are live: a
// first version's 32-lane state array took the epilogue path's kernel to 209 us on #75's bf16
// chain at 1024 x 8192, this form to 54 us (torch.profiler, H100, 2026-11-25).
template <int kN, int kOff, int kL, class Values>
__device__ __forceinline__ Welford eager_lanes(const Values& v) {
  if constexpr (kOff == kN)
    return welford_push({0.f, 0.f, 0.f}, v[kL]);
  else
    return welford_merge(eager_lanes<kN, 2 * kOff, kL>(v),
                         eager_lanes<kN, 2 * kOff, kL + kOff>(v));
}

// A group of kN values in a thread's registers, kN a power of two up to 32.
template <int kN, class Values>
__device__ __forceinline__ SegmentMoments eager_group_stats(const Values& v, int mode, float eps,
                                                            float& rstd) {
  static_assert(kN >= 1 && kN <= 32 && (kN & (kN - 1)) == 0, "one value per lane");
  const Welford w = eager_lanes<kN, 1, 0>(v);
  return eager_group_finish(w.mean, w.m2, w.n, mode, eps, rstd);
}

// Any group size under 512 with a warp on the group, PyTorch's own code path: lane l folds
// values l, l + 32, ..., then shfl_down merges (a lane past the warp's end merges its own
// state, as in PyTorch; lane 0's tree never reads those); lane 0's result taken by all.
__device__ __forceinline__ SegmentMoments eager_group_stats_warp(const float* v, int n, int lane,
                                                                 int mode, float eps,
                                                                 float& rstd) {
  Welford w{0.f, 0.f, 0.f};
  for (int j = lane; j < n; j += 32) w = welford_push(w, v[j]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Welford other{__shfl_down_sync(0xffffffffu, w.mean, off),
                        __shfl_down_sync(0xffffffffu, w.m2, off),
                        __shfl_down_sync(0xffffffffu, w.n, off)};
    w = welford_merge(w, other);
  }
  return eager_group_finish(__shfl_sync(0xffffffffu, w.mean, 0), __shfl_sync(0xffffffffu, w.m2, 0),
                            __shfl_sync(0xffffffffu, w.n, 0), mode, eps, rstd);
}

// Whether a call's norm takes eager bf16's GroupNorm statistics: kEager (the epilogue path's
// kernel), a GroupNorm's moments, and the call asks (params.group_stats; dispatch.py's
// group_stats_mode asks for a bf16 GroupNorm only, never a LayerNorm).
template <class Epi, bool kEager>
__device__ __forceinline__ bool eager_stats(const FusedArgs& args) {
  if constexpr (kEager && !Epi::kSoftmax && !Epi::kRms)
    return args.params.group_stats != 0;
  else
    return false;
}

// A run's statistics for its norm and its rstd (norm_rstd's): eager bf16's GroupNorm statistics
// where eager_stats says so (kN known: the register groups), else segment_stats'.
template <class Epi, bool kExact, bool kEager, int kN = 0, class Values>
__device__ __forceinline__ SegmentMoments group_statistics(const Values& v, int n,
                                                           const FusedArgs& args, float& rstd) {
  if constexpr (kN > 0 && kEager) {
    if (eager_stats<Epi, kEager>(args))
      return eager_group_stats<kN>(v, args.params.group_stats, args.eps, rstd);
  }
  const SegmentMoments mom = segment_stats<Epi, kExact, kN>(v, n);
  rstd = norm_rstd<Epi, kExact>(mom.m2, mom.mean, mom.mean_lo, n, args.eps);
  return mom;
}

// GroupNorm of one value given its group's mean (mean + mean_lo) and rstd (an RMSNorm's: the
// value scaled, no mean subtracted), then the affine part (the channel's weight w and bias b,
// when the norm has them) and `post`. A softmax's `mean` is the row's largest value and `rstd`
// norm_rstd's sum (or its log): PyTorch's CUDA formulas, exp(v - max) / sum and
// (v - max) - log(sum).
template <class Epi>
__device__ __forceinline__ float normalize(float v, float mean, float mean_lo, float rstd,
                                           float w, float b, int grow, int gcol,
                                           const FusedArgs& args) {
  float y;
  if constexpr (Epi::kSoftmax)
    y = Epi::kLogSoftmax ? (v - mean) - rstd : expf(v - mean) / rstd;
  else if constexpr (Epi::kRms)
    y = v * rstd;
  else
    y = ((v - mean) - mean_lo) * rstd;
  if (args.gn_weight != nullptr) y = y * w + b;
  return Epi::post(round_like_model<Epi::kModelDtype>(y, args.params), grow, gcol, args.params);
}

template <class Epi>
__device__ __forceinline__ float normalize(float v, float mean, float mean_lo, float rstd,
                                           int grow, int gcol, const FusedArgs& args) {
  const bool affine = args.gn_weight != nullptr;
  return normalize<Epi>(v, mean, mean_lo, rstd, affine ? __ldg(args.gn_weight + gcol) : 0.f,
                        affine ? __ldg(args.gn_bias + gcol) : 0.f, grow, gcol, args);
}

// Writes n finished values of one output row, starting at element `at` of the output: 16 bytes
// at a time where the address allows.
template <class Epi, int kN>
__device__ __forceinline__ void store_run(const float (&y)[kN], int64_t at, const FusedArgs& args) {
  if (Epi::kModelDtype != kFloat32Model && args.out16 != nullptr) {
    uint16_t* dst = args.out16 + at;
    const int model16 = model_dtype<Epi::kModelDtype>(args.params.model16);
    if (kN % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
#pragma unroll
      for (int j = 0; j < kN; j += 8)
        *reinterpret_cast<uint4*>(dst + j) = make_uint4(
            pack_model16(y[j], y[j + 1], model16), pack_model16(y[j + 2], y[j + 3], model16),
            pack_model16(y[j + 4], y[j + 5], model16), pack_model16(y[j + 6], y[j + 7], model16));
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j) dst[j] = to_model16(y[j], model16);
    }
  } else {
    float* dst = args.out + at;
    if (kN % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
#pragma unroll
      for (int j = 0; j < kN; j += 4)
        *reinterpret_cast<float4*>(dst + j) = make_float4(y[j], y[j + 1], y[j + 2], y[j + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j) dst[j] = y[j];
    }
  }
}

// The in-tile GroupNorm of one (row r, group at tile column c0) whose size kGs is known at
// compile time: the group's values are loaded into registers at once (a run-time size walks
// shared memory a value at a time, a chain of load latencies), normalised there, and either
// reduced (the partial left in the group's first two slots, as in tile_epilogue) or, without a
// reduction, stored straight to the output. w, b: the tile's GroupNorm weights and biases.
template <class Epi, bool kExact, bool kEager, int kGs>
__device__ __forceinline__ void group_task(float* tile, const float* w, const float* b, int r,
                                           int c0, TileCoord tc, const FusedArgs& args) {
  float* v = tile + r * kEpiStride + c0;
  float y[kGs];
#pragma unroll
  for (int j = 0; j < kGs; ++j) y[j] = v[j];
  float rstd;
  const SegmentMoments mom = group_statistics<Epi, kExact, kEager, kGs>(y, kGs, args, rstd);
#pragma unroll
  for (int j = 0; j < kGs; ++j)
    y[j] = normalize<Epi>(y[j], mom.mean, mom.mean_lo, rstd, w[c0 + j], b[c0 + j], tc.m0 + r,
                          tc.n0 + c0 + j, args);
  if constexpr (Epi::kReduce != 0) {
    RowAcc acc = row_acc_empty<Epi::kReduce>();
#pragma unroll
    for (int j = 0; j < kGs; ++j) row_acc_push<Epi::kReduce>(acc, y[j]);
    v[0] = acc.m;
    v[1] = acc.s;
  } else {
    store_run<Epi, kGs>(y, static_cast<int64_t>(tc.m0 + r) * args.N + tc.n0 + c0, args);
  }
}

// Every (row, group) task of the tile for a group size known at compile time.
template <class Epi, int kThreads, bool kExact, bool kEager, int kGs>
__device__ __forceinline__ void group_tasks(float* tile, const float* w, const float* b,
                                            int rows_here, int groups_here, int tid, TileCoord tc,
                                            const FusedArgs& args) {
  for (int task = tid; task < rows_here * groups_here; task += kThreads)
    group_task<Epi, kExact, kEager, kGs>(tile, w, b, task % rows_here, (task / rows_here) * kGs,
                                         tc, args);
}

// The value a row reduction takes at window w of a staged row: the channel itself, or after a
// max pooling over the channels (Epi::kPool > 1) its window's maximum, taken as max_pool1d
// takes it (a later value replaces the maximum only if greater or NaN: of -0 and +0 the first
// stays); windows never straddle tiles, and the last tile's partial window is dropped, as
// max_pool1d drops it.
template <class Epi>
__device__ __forceinline__ float pooled(const float* row, int w) {
  constexpr int kPool = Epi::kPool;
  static_assert(kPool >= 1 && kTile % kPool == 0, "a pooling window within a tile");
  float v = row[w * kPool];
#pragma unroll
  for (int j = 1; j < kPool; ++j) {
    const float x = row[w * kPool + j];
    v = (x > v || x != x) ? x : v;
  }
  return v;
}

// A row run's partial of reduction kKind over windows [w0, w1), kWays independent chains at a
// time: min and max NaN-propagating, sum and mean compensated (CompensatedSums), logsumexp in
// two passes as PyTorch computes it (the maximum, then the exponentials shifted by it).
template <int kKind, class Epi>
__device__ __forceinline__ RowAcc run_partial(const float* row, int w0, int w1) {
  // wide pooling windows are loops of their own: unrolling those 16 times buys nothing
  constexpr int kWays = 4, kUnroll = Epi::kPool >= 16 ? 1 : 4;
  if constexpr (kKind == 3 || kKind == 4) {
    CompensatedSums<kWays> sums;
    for_each_way<kWays, kUnroll>(w0, w1, [&](int w, int i) { sums.add(i, pooled<Epi>(row, w)); });
    float comp;
    const float sum = sums.total(comp);
    return {sum, comp};
  } else {
    float top[kWays];
#pragma unroll
    for (int i = 0; i < kWays; ++i) top[i] = row_acc_empty<kKind>().m;
    auto pick = [](float a, float b) { return kKind == 1 ? min_nan(a, b) : max_nan(a, b); };
    for_each_way<kWays, kUnroll>(w0, w1, [&](int w, int i) { top[i] = pick(top[i], pooled<Epi>(row, w)); });
    const float m = pick(pick(top[0], top[1]), pick(top[2], top[3]));
    if constexpr (kKind != 5) return {m, 0.f};
    const float shift = lse_shift(m);
    float sums[kWays] = {};
    for_each_way<kWays, kUnroll>(w0, w1, [&](int w, int i) { sums[i] += expf(pooled<Epi>(row, w) - shift); });
    return {m, (sums[0] + sums[1]) + (sums[2] + sums[3])};  // an empty run: (-inf, 0)
  }
}

// A row's partial of one column tile, where the row-reducing kernels leave it for the last block
// of the row's band: row_partial [N tiles, M], and for the (m, s) pairs of sum, mean and
// logsumexp (row_reduce.cuh) the s halves after the m halves.
template <int kKind>
__device__ __forceinline__ void store_tile_partial(const FusedArgs& args, int n_tiles, int n_idx,
                                                   int row, RowAcc acc) {
  const int64_t at = static_cast<int64_t>(n_idx) * args.M + row;
  args.row_partial[at] = acc.m;
  if constexpr (kKind >= 3) args.row_partial[static_cast<int64_t>(n_tiles) * args.M + at] = acc.s;
}

// The last block of a row band: rows [m0, m0 + rows) each merge their n_tiles partials
// (store_tile_partial's) in tile order, a thread a row among `threads`, into row_out; n is the
// count a mean divides by. The partials are read through L2 (other blocks wrote them).
template <int kKind>
__device__ __forceinline__ void fold_tile_partials(const FusedArgs& args, int n_tiles, int m0,
                                                   int rows, int tid, int threads, int n) {
  const int64_t s_half = static_cast<int64_t>(n_tiles) * args.M;
  for (int r = tid; r < rows; r += threads) {
    const RowAcc acc = row_acc_merge_loads<kKind>(n_tiles, [&](int tn) {
      const int64_t at = static_cast<int64_t>(tn) * args.M + m0 + r;
      RowAcc part{__ldcg(args.row_partial + at), 0.f};
      if constexpr (kKind >= 3) part.s = __ldcg(args.row_partial + s_half + at);
      return part;
    });
    args.row_out[m0 + r] = row_acc_finish<kKind>(acc, n);
  }
}

// The tile's row partials of the chain's reduction, handed to put_partial(row, partial). kParts
// threads share a row, each a contiguous run of its windows (run_partial), and their partials
// merge in run order. A warp a row, each lane pushing values one at a time (a logsumexp's new
// maximum rescaling the sum), left the split kernel latency-bound: logsumexp's reduction took
// 20% of its warp samples at 16384 x 4096 x 1024, where it took 795 us against 616 us for the
// GEMM with no chain (ncu, torch.profiler, H100, 2026-11-26; 657 against 608 us this way). The
// staged tile's first slots of each row take the runs' partials once every thread has read its
// row. A tile of a few rows (the few-rows kernel's one or two) keeps a warp a row, each lane a
// run, merged by row_acc_warp's fixed tree: two threads a row would leave all but four idle.
template <class Epi, int kThreads, class Sync, class Put>
__device__ __forceinline__ void row_partials(float* tile, int rows_here, int cols_here, int tid,
                                             Sync sync, Put put_partial) {
  constexpr int kind = Epi::kReduce, kParts = kThreads >= 2 * kTile ? 2 : 1;
  static_assert(kThreads >= kTile, "a (row, run) task per thread at most");
  const int windows = cols_here / Epi::kPool, per_part = (windows + kParts - 1) / kParts;
  if (rows_here <= kThreads / 32) {  // uniform across the block
    const int lane = tid & 31, warp = tid >> 5, per_lane = (windows + 31) / 32;
    const int w0 = min(windows, lane * per_lane), w1 = min(windows, w0 + per_lane);
    if (warp < rows_here) {
      const RowAcc run = run_partial<kind, Epi>(tile + warp * kEpiStride, w0, w1);
      const RowAcc acc = row_acc_warp<kind>(run);
      if (lane == 0) put_partial(warp, acc);
    }
    return;
  }
  // Consecutive threads take consecutive rows: distinct banks (row stride kTile + 1).
  const int r = tid % kTile, part = tid / kTile;
  const bool active = r < rows_here && part < kParts;
  const int w0 = part * per_part, w1 = active ? min(windows, w0 + per_part) : w0;
  const RowAcc acc = run_partial<kind, Epi>(tile + r * kEpiStride, w0, w1);
  sync();  // every run of every row has been read
  if (active) {
    tile[r * kEpiStride + 2 * part] = acc.m;
    tile[r * kEpiStride + 2 * part + 1] = acc.s;
  }
  sync();
  for (int row = tid; row < rows_here; row += kThreads) {
    const float* slots = tile + row * kEpiStride;
    RowAcc merged{slots[0], slots[1]};
#pragma unroll
    for (int p = 1; p < kParts; ++p)
      merged = row_acc_merge<kind>(merged, RowAcc{slots[2 * p], slots[2 * p + 1]});
    put_partial(row, merged);
  }
}

// `tid` runs over kThreads threads that all call this; `sync()` is a barrier among exactly them.
// kExact: the fp32-accurate statistics (segment_moments). kRegisterGroups: groups of 8, 16 and
// 32 in registers (group_task); off where registers are scarce and rows few (the few-rows GEMV).
// kEager: honour params.group_stats (eager_group_stats; the epilogue path's kernel only).
// kRows: the tile's rows (kTile, or fewer: the 16-bit epilogue path's kEpilogueRows16).
// Groups of 64 stay in shared memory: in registers (a thread storing its group's run of the
// row) #37's fused kernel took 3.7 ms with autograd on against 3.2 (H100, 2026-11-24), the
// runs' 16-byte pieces of 32 rows per store beside z's stores.
template <class Epi, int kThreads, bool kExact, bool kRegisterGroups = true, bool kEager = false,
          int kRows = kTile, class Sync>
__device__ __forceinline__ void tile_epilogue(float* tile, const FusedArgs& args, TileCoord tc,
                                              int tid, Sync sync) {
  constexpr int kind = Epi::kReduce;
  const int lane = tid & 31, warp = tid >> 5;
  const int rows_here = min(kRows, args.M - tc.m0);
  const int cols_here = min(kTile, args.N - tc.n0);
  const int gs = args.group_size;

  auto store = [&](bool model16) {
    for (int idx = tid; idx < rows_here * kTile; idx += kThreads) {
      const int r = idx / kTile, c = idx % kTile;
      if (c < cols_here) {
        const int64_t at = static_cast<int64_t>(tc.m0 + r) * args.N + tc.n0 + c;
        if (model16)
          args.out16[at] = to_model16(tile[r * kEpiStride + c],
                                      model_dtype<Epi::kModelDtype>(args.params.model16));
        else
          args.out[at] = tile[r * kEpiStride + c];
      }
    }
  };

  // With a GroupNorm and a reduction, each group's task also reduces its outputs (in column
  // order) and leaves the partial in the group's first two slots, merged per row below in group
  // order: the normalised values never go back to shared memory. Groups of one have no room.
  bool reduced_in_groups = false;
  if constexpr (Epi::kNorm) {
    if (args.norm_wide) {
      const int g_first = tc.n0 / gs;
      const int segments = (tc.n0 + cols_here - 1) / gs - g_first + 1;
      const int64_t stats_row = static_cast<int64_t>(args.stats_per_tile) * tc.n_tiles;
      // Task (row r, segment of group g): its columns [c0, c1) of the tile.
      auto segment = [&](int task, int& r, int& g, int& c0, int& c1) {
        r = task % rows_here;  // consecutive tasks walk rows: distinct banks
        g = g_first + task / rows_here;
        c0 = max(g * gs, tc.n0) - tc.n0;
        c1 = min((g + 1) * gs, tc.n0 + cols_here) - tc.n0;
      };
      auto put = [&](int r, int g, SegmentMoments m) {
        args.norm_stats[(tc.m0 + r) * stats_row + tc.n_idx * args.stats_per_tile + (g - g_first)] =
            make_float4(m.mean, m.mean_lo, m.m2, 0.f);
      };
      int r, g, c0, c1;
      if (warp_per_task(gs, rows_here * segments, kThreads)) {
        for (int task = warp; task < rows_here * segments; task += kThreads / 32) {
          segment(task, r, g, c0, c1);
          const SegmentMoments m =
              segment_stats_warp<Epi>(tile + r * kEpiStride + c0, c1 - c0, lane);
          if (lane == 0) put(r, g, m);
        }
      } else {
        for (int task = tid; task < rows_here * segments; task += kThreads) {
          segment(task, r, g, c0, c1);
          put(r, g, segment_stats<Epi, true>(tile + r * kEpiStride + c0, c1 - c0));
        }
      }
      store(false);  // fp32, normalised in place by norm_finalize.cuh
      return;
    }
    // The tile's GroupNorm weights and biases, loaded once rather than once per row.
    __shared__ float s_gn_weight[kTile], s_gn_bias[kTile];
    if (args.gn_weight != nullptr) {
      for (int c = tid; c < cols_here; c += kThreads) {
        s_gn_weight[c] = __ldg(args.gn_weight + tc.n0 + c);
        s_gn_bias[c] = __ldg(args.gn_bias + tc.n0 + c);
      }
      sync();
    }
    reduced_in_groups = kind != 0 && gs >= 2;
    const int groups_here = cols_here / gs;  // N and kTile are multiples of gs
    // Common group sizes with the group in registers: the tasks store the output themselves
    // (without a reduction: then nothing is left to do) or leave their partials.
    const float *w = s_gn_weight, *b = s_gn_bias;
    bool in_registers = false;
    if constexpr (kRegisterGroups) {
      in_registers = true;
      switch (gs) {
        case 8:
          group_tasks<Epi, kThreads, kExact, kEager, 8>(tile, w, b, rows_here, groups_here,
                                                        tid, tc, args);
          break;
        case 16:
          group_tasks<Epi, kThreads, kExact, kEager, 16>(tile, w, b, rows_here, groups_here,
                                                         tid, tc, args);
          break;
        case 32:
          group_tasks<Epi, kThreads, kExact, kEager, 32>(tile, w, b, rows_here, groups_here,
                                                         tid, tc, args);
          break;
        default:
          in_registers = false;
      }
    }
    if constexpr (kind == 0) {
      if (in_registers) return;  // the caller's next barrier orders any reuse of the tile
    }
    // Other sizes: a thread per group, or a warp (warp_per_task).
    // Eager bf16 statistics at a run-time group size: a warp per group, as PyTorch's.
    const bool eager = eager_stats<Epi, kEager>(args);
    const bool warp_per_group = eager || warp_per_task(gs, rows_here * groups_here, kThreads);
    const int step = warp_per_group ? kThreads / 32 : kThreads;
    for (int task = warp_per_group ? warp : tid; task < rows_here * groups_here && !in_registers;
         task += step) {
      const int r = task % rows_here;
      const int c0 = (task / rows_here) * gs;
      float* v = tile + r * kEpiStride + c0;
      float rstd;
      SegmentMoments mom;
      if (eager) {
        mom = eager_group_stats_warp(v, gs, lane, args.params.group_stats, args.eps, rstd);
      } else {
        mom = warp_per_group ? segment_stats_warp<Epi>(v, gs, lane)
                             : segment_stats<Epi, kExact>(v, gs);
        rstd = norm_rstd<Epi, kExact>(mom.m2, mom.mean, mom.mean_lo, gs, args.eps);
      }
      auto out = [&](int j) {
        return normalize<Epi>(v[j], mom.mean, mom.mean_lo, rstd, w[c0 + j], b[c0 + j],
                              tc.m0 + r, tc.n0 + c0 + j, args);
      };
      const int j0 = warp_per_group ? lane : 0, j_step = warp_per_group ? 32 : 1;
      if constexpr (kind != 0) {
        if (reduced_in_groups) {
          RowAcc acc = row_acc_empty<kind>();
          for (int j = j0; j < gs; j += j_step) row_acc_push<kind>(acc, out(j));
          // Every lane has read its values by the tree's shuffles, before lane 0 writes.
          if (warp_per_group) acc = row_acc_warp<kind>(acc);
          if (j0 == 0) {
            v[0] = acc.m;
            v[1] = acc.s;
          }
          continue;
        }
      }
#pragma unroll 4
      for (int j = j0; j < gs; j += j_step) v[j] = out(j);
    }
    sync();
  }

  if constexpr (kind == 0) {
    store(Epi::kModelDtype != kFloat32Model && args.out16 != nullptr);
  } else {
    auto put_partial = [&](int r, RowAcc acc) {
      store_tile_partial<kind>(args, tc.n_tiles, tc.n_idx, tc.m0 + r, acc);
    };
    if (reduced_in_groups) {
      for (int r = tid; r < rows_here; r += kThreads) {
        const float* row = tile + r * kEpiStride;
        RowAcc acc{row[0], row[1]};
        for (int c0 = gs; c0 < cols_here; c0 += gs)
          acc = row_acc_merge<kind>(acc, RowAcc{row[c0], row[c0 + 1]});
        put_partial(r, acc);
      }
    } else {
      row_partials<Epi, kThreads>(tile, rows_here, cols_here, tid, sync, put_partial);
    }
    if (last_to_arrive(args.row_counter + tc.m_idx, tc.n_tiles, tid, sync)) {
      fold_tile_partials<kind>(args, tc.n_tiles, tc.m0, rows_here, tid, kThreads,
                               args.N / Epi::kPool);
      if (tid == 0) args.row_counter[tc.m_idx] = 0;  // ready for the next launch
    }
  }
}

}  // namespace gemmfuse
