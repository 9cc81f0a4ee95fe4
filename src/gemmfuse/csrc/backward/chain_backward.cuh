// The chain's backward in one kernel: from the saved GEMM result z = x @ W^T + b and the
// gradient of the chain's output, dz (what the backward's two products read) and the column sums
// the other gradients need (the bias's, the GroupNorm affine's, each per-channel tensor
// argument's), with PyTorch's gradient formulas.
//
// The columns are cut into `slabs` of equal width on GroupNorm group boundaries (about 1024
// columns each, so a block's shared memory is small and several blocks share an SM, one's loads
// under another's arithmetic). Block (r, s) takes slab s of rows r, r + gridDim.x, ..., its
// threads striding over the slab's columns, the slab of z held in shared memory:
// 1. (GroupNorm) each group's mean and rstd of u = pre(z): a sum, then a centred one that also
//    refines the mean, over runs of `segment` columns, each group's runs in order;
// 2. (min, max, logsumexp) the row's reduced value, recomputed (for min/max with how many
//    columns hold it: PyTorch's amin/amax split the gradient evenly among ties; logsumexp as
//    PyTorch computes it, the max first, then a sum of exp(v - max)). A row-wide value needs
//    the whole row: logsumexp runs one slab per row; min/max over several slabs first run the
//    kernel in its `extremes` phase, which writes each slab's extreme and ties, and the main
//    phase merges a row's slabs in order (exact: extremes and counts do not round);
// 3. each column: the output's gradient routed through the reduction, then back through the
//    post ops (generated `post_backward`) to the GroupNorm's output; the affine's column sums;
// 4. (GroupNorm) per group the means of g = dy * weight and g * x_hat, then
//    du = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), back through the pre ops to dz.
// Column sums accumulate in shared memory, one slot per gradient (epilogue.column_sum_slots),
// each column owned by one thread in every row, so sums are in row order; each block writes its
// slab of partial sums, which the host adds in block order: results do not depend on timing.
#pragma once
#include <cstdint>

#include "fused_args.h"
#include "pointwise_grad.cuh"
#include "row_reduce.cuh"

namespace gemmfuse {

constexpr int kBackwardThreads = 256;
constexpr int kBackwardSlab = 1024;  // the slab width aimed at, in columns
constexpr int kBackwardWarps = kBackwardThreads / 32;

// Shared memory, in floats, for a slab of w columns: the slab of z; of the output's gradient,
// overwritten by g (GroupNorm); the column sums, then their rounding errors (column_add); the
// group runs' partial sums (two per run);
// mean, rstd and the two gradient means per group; block-reduction scratch.
struct BackwardSmem {
  int z, g, sums, runs, stats, scratch, total;
};

// About sqrt(group_size), so a run's serial sum and a group's sum of runs are alike short (and a
// warp's runs, read from shared memory with a stride of `segment` floats, conflict little).
__host__ __device__ inline int backward_segment(int group_size) {
  int s = 1;
  while (s * s < group_size) ++s;
  return s;
}

__host__ __device__ inline BackwardSmem backward_smem(int w, int group_size, bool norm,
                                                     int column_sums) {
  const int groups = norm ? w / group_size : 0;
  const int segment = backward_segment(group_size);
  const int runs = groups * ((group_size + segment - 1) / segment);
  BackwardSmem s{};
  s.z = 0;
  s.g = w;
  s.sums = s.g + w;
  s.runs = s.sums + 2 * column_sums * w;  // each sum and its rounding error
  s.stats = s.runs + 2 * runs;
  s.scratch = s.stats + 4 * groups;
  s.total = s.scratch + 2 * kBackwardWarps + 2;
  return s;
}

// Element i of a float32 tensor, or of a 16-bit one of that ModelDtype (model16 != 0).
__device__ __forceinline__ float load_float(const void* p, int64_t i, int model16) {
  return model16 ? from_model16(static_cast<const uint16_t*>(p)[i], model16)
                 : static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_float(void* p, int64_t i, float v, int model16) {
  if (model16)
    static_cast<uint16_t*>(p)[i] = to_model16(v, model16);
  else
    static_cast<float*>(p)[i] = v;
}

// Copies row values src[base + c * stride], c < n, into dst[c] (float), eight loads in flight
// per thread: a loop of single loads would wait for each in turn (the shared-memory stores
// between them may alias the source, so the compiler cannot hoist the loads).
__device__ __forceinline__ void load_row(float* dst, const void* src, int64_t base, int64_t stride,
                                         int n, int model16) {
  constexpr int kBatch = 8;
  for (int c0 = threadIdx.x; c0 < n; c0 += kBatch * blockDim.x) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int c = c0 + j * blockDim.x;
      v[j] = c < n ? load_float(src, base + c * stride, model16) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int c = c0 + j * blockDim.x;
      if (c < n) dst[c] = v[j];
    }
  }
}

// Per group of the row, the sums of f(c, g) = (a, b) over its columns c (g the group): each
// thread sums runs of `segment` columns, then each group adds its runs in order; both levels
// compensated (TwoSum), as a GroupNorm's gradient sums cancel to about 0.
// Ends with the block synchronised.
template <class F>
__device__ __forceinline__ void group_sums(F f, int groups, int group_size, int segment,
                                           float* runs, float* out_a, float* out_b) {
  const int per_group = (group_size + segment - 1) / segment, n_runs = groups * per_group;
  for (int i = threadIdx.x; i < n_runs; i += blockDim.x) {
    const int g = i / per_group, c0 = g * group_size + (i - g * per_group) * segment;
    const int c1 = min(c0 + segment, (g + 1) * group_size);
    RowAcc sa{0.f, 0.f}, sb{0.f, 0.f};
    for (int c = c0; c < c1; ++c) {
      const float2 v = f(c, g);
      row_acc_push<3>(sa, v.x);
      row_acc_push<3>(sb, v.y);
    }
    runs[i] = sa.m + sa.s;
    runs[n_runs + i] = sb.m + sb.s;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    RowAcc sa{0.f, 0.f}, sb{0.f, 0.f};
    for (int r = g * per_group; r < (g + 1) * per_group; ++r) {
      row_acc_push<3>(sa, runs[r]);
      row_acc_push<3>(sb, runs[n_runs + r]);
    }
    out_a[g] = sa.m + sa.s;
    out_b[g] = sb.m + sb.s;
  }
  __syncthreads();
}

// A group's statistics from its centred sums, in double: the mean (first estimate `mean`) refined
// by the centred values' mean, and rstd = 1 / sqrt(biased variance + eps). Both kernels finish
// their groups here, so they normalise alike. An RMSNorm (kRms) subtracts no mean: rstd =
// 1 / sqrt(mean(u^2) + eps), mean(u^2) = variance + mean^2, and `mean` is set to 0, so the
// callers' (u - mean) * rstd is its u * rstd. kExact false (a 16-bit model's register kernel):
// in float, with rsqrtf, as eager's GroupNorm finishes its statistics in bf16 and fp16.
template <bool kRms, bool kExact = true>
__device__ __forceinline__ void finish_group_stats(float sum_d, float sum_d2, int group_size,
                                                   float eps, float& mean, float& rstd) {
  if constexpr (!kExact) {
    const float d = sum_d / static_cast<float>(group_size);
    const float var = fmaxf(sum_d2 / static_cast<float>(group_size) - d * d, 0.f);
    if constexpr (kRms) {
      const float mu = mean + d;
      rstd = rsqrtf(var + mu * mu + eps);
      mean = 0.f;
    } else {
      mean += d;
      rstd = rsqrtf(var + eps);
    }
    return;
  }
  const double d = static_cast<double>(sum_d) / group_size;
  const double var = fmax(static_cast<double>(sum_d2) / group_size - d * d, 0.0);
  if constexpr (kRms) {
    const double mu = static_cast<double>(mean) + d;
    rstd = static_cast<float>(1.0 / sqrt(var + mu * mu + static_cast<double>(eps)));
    mean = 0.f;
  } else {
    mean += static_cast<float>(d);
    rstd = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
  }
}

// The row's min or max (m) and how many columns hold it (s); NaN wins, as in torch.amin/amax.
template <int kKind>
__device__ __forceinline__ RowAcc extreme_merge(RowAcc a, RowAcc b) {
  if (a.m != a.m) return a;
  if (b.m != b.m) return b;
  if (a.m == b.m) return {a.m, a.s + b.s};
  return (kKind == 1 ? b.m < a.m : b.m > a.m) ? b : a;
}

template <int kKind>
__device__ __forceinline__ RowAcc reduce_merge(RowAcc a, RowAcc b) {
  if constexpr (kKind == 3) return row_acc_merge<3>(a, b);
  return extreme_merge<kKind>(a, b);
}

// The block's merge of every thread's partial: lanes by xor tree, warps in index order.
template <int kKind>
__device__ __forceinline__ RowAcc block_reduce(RowAcc a, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const RowAcc o{__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.s, off)};
    a = reduce_merge<kKind>(a, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch[2 * warp] = a.m;
    scratch[2 * warp + 1] = a.s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    RowAcc r{scratch[0], scratch[1]};
    for (int w = 1; w < kBackwardWarps; ++w) r = reduce_merge<kKind>(r, {scratch[2 * w], scratch[2 * w + 1]});
    scratch[2 * kBackwardWarps] = r.m;
    scratch[2 * kBackwardWarps + 1] = r.s;
  }
  __syncthreads();
  const RowAcc r{scratch[2 * kBackwardWarps], scratch[2 * kBackwardWarps + 1]};
  __syncthreads();  // the scratch is free again
  return r;
}

// The gradient reaching one column's chain output v from the row's output gradient `grad`,
// given the row's reduced value `out` and (min/max) how many columns hold it.
template <int kKind>
__device__ __forceinline__ float route(float grad, float v, float out, float ties, int n) {
  if constexpr (kKind == 3) return grad;
  if constexpr (kKind == 4) return grad / static_cast<float>(n);
  if constexpr (kKind == 5) return grad * expf(v - out);
  if (!(ties > 0.f)) return NAN;  // a NaN row: amin/amax's 0 / 0
  return v == out ? grad / ties : 0.f;
}

// The row's min or max and ties from its slabs' (the `extremes` phase's), merged in slab order.
template <int kKind>
__device__ __forceinline__ RowAcc merge_slabs(const float2* extremes, int slabs) {
  RowAcc r = row_acc_empty<kKind>();
  for (int s = 0; s < slabs; ++s) {
    const float2 e = extremes[s];
    r = extreme_merge<kKind>(r, {e.x, e.y});
  }
  return r;
}

template <class Epi>
__global__ void __launch_bounds__(kBackwardThreads) chain_backward_kernel(const BackwardArgs a) {
  extern __shared__ float smem[];
  constexpr int kSums = Epi::kColumnSums, kKind = Epi::kReduce;
  constexpr bool kExtremes = kKind == 1 || kKind == 2;
  const int n = a.N, gs = a.group_size, w = a.slab, slabs = n / w, c0 = blockIdx.y * w;
  const int groups = Epi::kNorm ? w / gs : 0;
  const bool extremes_phase = kExtremes && a.phase == 1;
  const BackwardSmem at = backward_smem(w, gs, Epi::kNorm, kSums);
  float* zrow = smem + at.z;
  float* grow = smem + at.g;
  float* sums = smem + at.sums;
  float* mean = smem + at.stats;
  float* rstd = mean + groups;
  float* g_mean = rstd + groups;
  float* gx_mean = g_mean + groups;
  const EpilogueParams& p = a.params;
  const int model16 = model_dtype<Epi::kModelDtype>(a.model16);  // fixed where the instance is
  const bool affine = a.gn_weight != nullptr;
  for (int i = threadIdx.x; i < 2 * kSums * w; i += blockDim.x) sums[i] = 0.f;
  const int errors = kSums * w;  // where each sum's rounding error is kept

  // Columns: j in the slab, c = c0 + j in the row. The group of j without an integer division
  // where float is exact enough: (j + 0.5) / gs is at least 0.5 / gs from an integer, and the
  // product's relative error (2^-23 or so) stays below that while j < 2^21.
  const float inv_gs = 1.f / static_cast<float>(gs);
  const bool float_groups = w <= (1 << 21);
  auto group_of = [&](int j) {
    return float_groups ? static_cast<int>((static_cast<float>(j) + 0.5f) * inv_gs) : j / gs;
  };
  // x_hat of column j from u = pre(z), and the GroupNorm's output y (rounded as the model does)
  auto x_hat = [&](int j, float u) {
    const int g = group_of(j);
    return (u - mean[g]) * rstd[g];
  };
  auto norm_out = [&](int c, float xh) {
    return round_like_model<Epi::kModelDtype>(affine ? xh * __ldg(a.gn_weight + c) + __ldg(a.gn_bias + c) : xh, p);
  };
  int row = 0;  // the row the lambdas below read (the loop's)
  auto chain_out = [&](int j) {
    const int c = c0 + j;
    const float u = Epi::pre(zrow[j], row, c, p);
    if constexpr (Epi::kNorm) return Epi::post(norm_out(c, x_hat(j, u)), row, c, p);
    return u;
  };

  for (row = blockIdx.x; row < a.M; row += gridDim.x) {
    const int64_t base = static_cast<int64_t>(row) * n + c0;
    load_row(zrow, a.z, base, 1, w, model16);
    if constexpr (kKind == 0)
      load_row(grow, a.grad, row * a.grad_row_stride + c0 * a.grad_col_stride, a.grad_col_stride,
               w, model16);
    __syncthreads();
    if constexpr (Epi::kNorm) {
      // the mean, then the centred sums that refine it and give the variance
      const int segment = backward_segment(gs);
      group_sums([&](int j, int) { return make_float2(Epi::pre(zrow[j], row, c0 + j, p), 0.f); },
                 groups, gs, segment, smem + at.runs, mean, rstd);
      for (int g = threadIdx.x; g < groups; g += blockDim.x) mean[g] *= inv_gs;
      __syncthreads();
      group_sums([&](int j, int g) {
        const float d = Epi::pre(zrow[j], row, c0 + j, p) - mean[g];
        return make_float2(d, d * d);
      }, groups, gs, segment, smem + at.runs, g_mean, gx_mean);
      for (int g = threadIdx.x; g < groups; g += blockDim.x)
        finish_group_stats<Epi::kRms>(g_mean[g], gx_mean[g], gs, a.eps, mean[g], rstd[g]);
      __syncthreads();
    }

    float out = 0.f, ties = 0.f, row_grad = 0.f;
    if constexpr (kKind != 0) row_grad = load_float(a.grad, row * a.grad_row_stride, model16);
    if constexpr (kExtremes || kKind == 5) {
      // min / max (and logsumexp's shift): the extreme and its ties, of the slab, then the row
      constexpr int kExtreme = kKind == 5 ? 2 : kKind;
      if (!kExtremes || slabs == 1 || extremes_phase) {
        RowAcc r = row_acc_empty<kExtreme>();
        for (int j = threadIdx.x; j < w; j += blockDim.x) r = extreme_merge<kExtreme>(r, {chain_out(j), 1.f});
        r = block_reduce<kExtreme>(r, smem + at.scratch);
        if (extremes_phase) {
          if (threadIdx.x == 0) a.extremes[static_cast<int64_t>(row) * slabs + blockIdx.y] = make_float2(r.m, r.s);
          __syncthreads();  // the slab's buffers are free again
          continue;
        }
        out = r.m;
        ties = r.s;
      } else {
        const RowAcc r = merge_slabs<kExtreme>(a.extremes + static_cast<int64_t>(row) * slabs, slabs);
        out = r.m;
        ties = r.s;
      }
    }
    if constexpr (kKind == 5) {
      // logsumexp as PyTorch's: the max, then a (compensated) sum of exp(v - max), then log
      const float shift = lse_shift(out);
      RowAcc r{0.f, 0.f};
      for (int j = threadIdx.x; j < w; j += blockDim.x) row_acc_push<3>(r, expf(chain_out(j) - shift));
      r = block_reduce<3>(r, smem + at.scratch);
      out = out != out ? out : logf(r.m + r.s) + shift;
    }

    for (int j = threadIdx.x; j < w; j += blockDim.x) {
      const int c = c0 + j;
      float dv;
      if constexpr (kKind == 0)
        dv = grow[j];  // this thread's own column: read before it writes g there
      else
        dv = route<kKind>(row_grad, kKind == 3 || kKind == 4 ? 0.f : chain_out(j), out, ties, n);
      if constexpr (Epi::kNorm) {
        const float xh = x_hat(j, Epi::pre(zrow[j], row, c, p));
        const float dy = Epi::post_backward(norm_out(c, xh), row, c, p, dv, sums, j, w);
        if (affine) {
          column_add(sums, w + j, errors, dy * xh);
          column_add(sums, 2 * w + j, errors, dy);
        }
        grow[j] = affine ? dy * __ldg(a.gn_weight + c) : dy;
      } else {
        const float dz = Epi::pre_backward(zrow[j], row, c, p, dv, sums, j, w);
        column_add(sums, j, errors, dz);
        store_float(a.dz, base + j, dz, model16);
      }
    }

    if constexpr (Epi::kNorm) {
      __syncthreads();
      group_sums([&](int j, int g) {
        const float gj = grow[j];
        return make_float2(gj, gj * ((Epi::pre(zrow[j], row, c0 + j, p) - mean[g]) * rstd[g]));
      }, groups, gs, backward_segment(gs), smem + at.runs, g_mean, gx_mean);
      for (int j = threadIdx.x; j < w; j += blockDim.x) {
        const int c = c0 + j, g = group_of(j);
        const float xh = (Epi::pre(zrow[j], row, c, p) - mean[g]) * rstd[g];
        // an RMSNorm's output does not shift with its input: no mean(g) term
        const float g_term = Epi::kRms ? 0.f : g_mean[g] * inv_gs;
        const float du = rstd[g] * (grow[j] - g_term - xh * (gx_mean[g] * inv_gs));
        const float dz = Epi::pre_backward(zrow[j], row, c, p, du, sums, j, w);
        column_add(sums, j, errors, dz);
        store_float(a.dz, base + j, dz, model16);
      }
    }
    __syncthreads();  // the slab's buffers are free again
  }
  if (extremes_phase) return;
  float* partial = a.column_partial + static_cast<int64_t>(blockIdx.x) * kSums * n + c0;
  for (int i = threadIdx.x; i < kSums * w; i += blockDim.x) {
    const int slot = i / w;
    partial[static_cast<int64_t>(slot) * n + (i - slot * w)] = sums[i] + sums[errors + i];
  }
}

}  // namespace gemmfuse
