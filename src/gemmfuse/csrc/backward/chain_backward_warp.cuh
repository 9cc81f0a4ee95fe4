// The chain backward of chain_backward.cuh for narrow groups, held in registers: each thread owns
// four adjacent columns of a 1024-column slab for every row it visits (so a GroupNorm group of
// 4 to 128 columns lies within one warp, its sums a shuffle among the group's lanes), and keeps
// those columns' sums (bias, affine, tensor arguments; compensated) in registers across rows.
// No shared-memory row, no block barrier per row except a min/max's block reduction: rows
// stream through at the memory's pace. The arithmetic is the shared-memory kernel's: the same
// formulas, compensated group sums (mean, then centred sums that refine it), the same routing;
// sums in another order. A 16-bit model's instance (kExact false) sums in plain fp32 and
// finishes its statistics in float, as eager's GroupNorm and column sums do in bf16 and fp16:
// its results are rounded to 16 bits anyway, and the compensated sums kept the kernel bound by
// instruction issue, not memory (ncu, #62).
#pragma once
#include <cstdint>

#include "chain_backward.cuh"

namespace gemmfuse {

constexpr int kWarpSlab = 4 * kBackwardThreads;  // the slab width: four columns per thread

// Whether a chain of n columns in groups of group_size takes the register kernel.
template <class Epi>
__host__ __device__ inline bool backward_in_registers(int n, int group_size) {
  if (Epi::kReduce == 5 || n % kWarpSlab != 0) return false;  // logsumexp: one slab per row
  if (!Epi::kNorm) return true;
  const int lanes = group_size / 4;
  return group_size % 4 == 0 && lanes >= 1 && lanes <= 32 && 32 % lanes == 0;
}

// A running sum: compensated (TwoSum, its error in a.s) or, kExact false, plain (a.s stays 0).
template <bool kExact>
__device__ __forceinline__ void sum_push(RowAcc& a, float x) {
  if constexpr (kExact)
    row_acc_push<3>(a, x);
  else
    a.m += x;
}

// A column sum's term (pointwise_grad.cuh's column_add, or a plain add).
template <bool kExact>
__device__ __forceinline__ void column_sum(float* acc, int i, int errors, float v) {
  if constexpr (kExact)
    column_add(acc, i, errors, v);
  else
    acc[i] += v;
}

// The sum of a group's partials across its `lanes` lanes (aligned, a power of two): a
// butterfly, so every lane gets the same total (TwoSum's error term is exact either way round).
template <bool kExact>
__device__ __forceinline__ RowAcc group_total(RowAcc a, int lanes) {
  for (int off = 1; off < lanes; off <<= 1) {
    if constexpr (kExact) {
      const RowAcc o{__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.s, off)};
      a = row_acc_merge<3>(a, o);
    } else {
      a.m += __shfl_xor_sync(0xffffffffu, a.m, off);
    }
  }
  return a;
}

// Four values at element i (16-byte aligned for float32, 8 for 16-bit: ModelDtype model16).
__device__ __forceinline__ void load4(float (&v)[4], const void* p, int64_t i, int model16) {
  if (model16) {
    const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
    v[0] = from_model16(static_cast<uint16_t>(r.x & 0xffffu), model16);
    v[1] = from_model16(static_cast<uint16_t>(r.x >> 16), model16);
    v[2] = from_model16(static_cast<uint16_t>(r.y & 0xffffu), model16);
    v[3] = from_model16(static_cast<uint16_t>(r.y >> 16), model16);
  } else {
    const float4 r = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  }
}

__device__ __forceinline__ void store4(void* p, int64_t i, const float (&v)[4], int model16) {
  if (model16) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i) =
        make_uint2(pack_model16(v[0], v[1], model16), pack_model16(v[2], v[3], model16));
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// Whether the output gradient's four columns at c load as one vector in every row: unit column
// stride, and rows (and the base) aligned to four elements' bytes.
__device__ __forceinline__ bool grad_in_fours(const BackwardArgs& a, int c, int model16) {
  const int64_t bytes = model16 ? 2 : 4;
  return a.grad_col_stride == 1 && a.grad_row_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.grad) % (4 * bytes) == 0 && c % 4 == 0;
}

// A row's four z values at column c and, for a chain without a reduction, the output gradient's
// (a reducing chain's one gradient per row is read where it is used).
template <int kKind>
__device__ __forceinline__ void load_row_inputs(float (&zv)[4], float (&dv)[4], const BackwardArgs& a,
                                                int row, int c, bool grad_vector, int model16) {
  load4(zv, a.z, static_cast<int64_t>(row) * a.N + c, model16);
  if constexpr (kKind == 0) {
    const int64_t at = row * a.grad_row_stride;
    if (grad_vector) {
      load4(dv, a.grad, at + c, model16);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dv[i] = load_float(a.grad, at + (c + i) * a.grad_col_stride, model16);
    }
  }
}

template <class Epi, bool kExact>
__global__ void __launch_bounds__(kBackwardThreads) chain_backward_warp_kernel(const BackwardArgs a) {
  constexpr int kSums = Epi::kColumnSums, kKind = Epi::kReduce;
  constexpr bool kExtremes = kKind == 1 || kKind == 2;
  if constexpr (kKind == 5) {
    return;  // never launched (backward_in_registers)
  } else {
    __shared__ float scratch[2 * kBackwardWarps + 2];
    const int n = a.N, gs = a.group_size, slabs = n / kWarpSlab;
    const int c = blockIdx.y * kWarpSlab + 4 * threadIdx.x;  // this thread's first column
    const int lanes = Epi::kNorm ? gs / 4 : 1;
    const float inv_gs = 1.f / static_cast<float>(gs);
    const bool extremes_phase = kExtremes && a.phase == 1;
    const EpilogueParams& p = a.params;
    const int model16 = model_dtype<Epi::kModelDtype>(a.model16);  // fixed where the instance is
    const bool affine = a.gn_weight != nullptr;
    float gw[4] = {1.f, 1.f, 1.f, 1.f}, gb[4] = {0.f, 0.f, 0.f, 0.f};
    if (affine) {
#pragma unroll
      for (int i = 0; i < 4; ++i) gw[i] = __ldg(a.gn_weight + c + i), gb[i] = __ldg(a.gn_bias + c + i);
    }
    float acc[2 * kSums * 4];  // this thread's column sums, then their rounding errors
#pragma unroll
    for (int i = 0; i < 2 * kSums * 4; ++i) acc[i] = 0.f;
    constexpr int kErrors = kSums * 4;

    // A row's z and output gradient are loaded one row ahead: a thread's next loads are in
    // flight while it works on the current row (ncu, #62 bf16: without it the kernel waited on
    // memory at 17% of DRAM bandwidth, occupancy capped at 3 blocks by registers).
    const bool grad_vector = grad_in_fours(a, c, model16);
    float z_next[4], grad_next[4] = {0.f, 0.f, 0.f, 0.f};
    if (blockIdx.x < a.M) load_row_inputs<kKind>(z_next, grad_next, a, blockIdx.x, c, grad_vector, model16);
    for (int row = blockIdx.x; row < a.M; row += gridDim.x) {
      const int64_t base = static_cast<int64_t>(row) * n + c;
      float zv[4], u[4], dv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) zv[i] = z_next[i], dv[i] = grad_next[i];
      if (row + gridDim.x < a.M)
        load_row_inputs<kKind>(z_next, grad_next, a, row + gridDim.x, c, grad_vector, model16);
#pragma unroll
      for (int i = 0; i < 4; ++i) u[i] = Epi::pre(zv[i], row, c + i, p);

      float mean = 0.f, rstd = 1.f;
      if constexpr (Epi::kNorm) {
        RowAcc s{0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) sum_push<kExact>(s, u[i]);
        s = group_total<kExact>(s, lanes);
        mean = (s.m + s.s) * inv_gs;
        RowAcc d{0.f, 0.f}, d2{0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float t = u[i] - mean;
          sum_push<kExact>(d, t);
          sum_push<kExact>(d2, t * t);
        }
        d = group_total<kExact>(d, lanes);
        d2 = group_total<kExact>(d2, lanes);
        finish_group_stats<Epi::kRms, kExact>(d.m + d.s, d2.m + d2.s, gs, a.eps, mean, rstd);
      }
      float xh[4], y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xh[i] = (u[i] - mean) * rstd;
        y[i] = round_like_model<Epi::kModelDtype>(affine ? xh[i] * gw[i] + gb[i] : xh[i], p);
      }
      auto chain_out = [&](int i) {
        if constexpr (Epi::kNorm) return Epi::post(y[i], row, c + i, p);
        return u[i];
      };

      if constexpr (kKind != 0) {
        const float row_grad = load_float(a.grad, row * a.grad_row_stride, model16);
        float out = 0.f, ties = 0.f;
        if constexpr (kExtremes) {
          RowAcc r;
          if (slabs == 1 || extremes_phase) {
            r = row_acc_empty<kKind>();
#pragma unroll
            for (int i = 0; i < 4; ++i) r = extreme_merge<kKind>(r, {chain_out(i), 1.f});
            r = block_reduce<kKind>(r, scratch);
            if (extremes_phase) {
              if (threadIdx.x == 0) a.extremes[static_cast<int64_t>(row) * slabs + blockIdx.y] = make_float2(r.m, r.s);
              continue;
            }
          } else {
            r = merge_slabs<kKind>(a.extremes + static_cast<int64_t>(row) * slabs, slabs);
          }
          out = r.m;
          ties = r.s;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
          dv[i] = route<kKind>(row_grad, kExtremes ? chain_out(i) : 0.f, out, ties, n);
      }

      float dz[4];
      if constexpr (Epi::kNorm) {
        float g[4];
        RowAcc sg{0.f, 0.f}, sgx{0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float dy = Epi::post_backward(y[i], row, c + i, p, dv[i], acc, i, 4);
          if (affine) {
            column_sum<kExact>(acc, 4 + i, kErrors, dy * xh[i]);
            column_sum<kExact>(acc, 8 + i, kErrors, dy);
          }
          g[i] = affine ? dy * gw[i] : dy;
          sum_push<kExact>(sg, g[i]);
          sum_push<kExact>(sgx, g[i] * xh[i]);
        }
        sg = group_total<kExact>(sg, lanes);
        sgx = group_total<kExact>(sgx, lanes);
        // an RMSNorm's output does not shift with its input: no mean(g) term
        const float g_mean = Epi::kRms ? 0.f : (sg.m + sg.s) * inv_gs;
        const float gx_mean = (sgx.m + sgx.s) * inv_gs;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float du = rstd * (g[i] - g_mean - xh[i] * gx_mean);
          dz[i] = Epi::pre_backward(zv[i], row, c + i, p, du, acc, i, 4);
          column_sum<kExact>(acc, i, kErrors, dz[i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          dz[i] = Epi::pre_backward(zv[i], row, c + i, p, dv[i], acc, i, 4);
          column_sum<kExact>(acc, i, kErrors, dz[i]);
        }
      }
      store4(a.dz, base, dz, model16);
    }
    if (extremes_phase) return;
    float* partial = a.column_partial + static_cast<int64_t>(blockIdx.x) * kSums * n + c;
#pragma unroll
    for (int slot = 0; slot < kSums; ++slot) {
      const float* e = acc + kErrors + 4 * slot;
      const float4 v = make_float4(acc[4 * slot] + e[0], acc[4 * slot + 1] + e[1],
                                   acc[4 * slot + 2] + e[2], acc[4 * slot + 3] + e[3]);
      *reinterpret_cast<float4*>(partial + static_cast<int64_t>(slot) * n) = v;
    }
  }
}

}  // namespace gemmfuse
