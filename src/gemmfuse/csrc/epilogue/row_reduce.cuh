// Reductions over a row's channels. Kinds are REDUCTIONS in epilogue.py: 1 min, 2 max, 3 sum,
// 4 mean, 5 logsumexp. A partial is a RowAcc; partials combine in a fixed order wherever they
// meet (lanes by xor tree, warps and tiles in index order), so results never depend on timing.
#pragma once

namespace gemmfuse {

// m: the running min / max / sum, or for logsumexp the running max. s: for sum and mean, the
// rounding error of m (the sum is m + s, compensated: a row of values that cancel, such as a
// GroupNorm output, keeps its few remaining bits); for logsumexp, the sum of exp(x - shift(m)).
struct RowAcc {
  float m, s;
};

// a + b = sum + err exactly (Knuth's TwoSum; nvcc does not reassociate without fast-math).
// An infinite or NaN sum carries no error term, so inf stays inf as in PyTorch's sum.
__device__ __forceinline__ float two_sum(float a, float b, float& err) {
  const float sum = a + b, bb = sum - a;
  err = isfinite(sum) ? (a - (sum - bb)) + (b - bb) : 0.f;
  return sum;
}

// PyTorch's logsumexp shifts by the max unless it is infinite (then by 0).
__device__ __forceinline__ float lse_shift(float m) { return isinf(m) ? 0.f : m; }

// NaN-propagating like torch.amin / torch.amax.
__device__ __forceinline__ float min_nan(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

template <int kKind>
__device__ __forceinline__ RowAcc row_acc_empty() {
  if constexpr (kKind == 1) return {INFINITY, 0.f};
  if constexpr (kKind == 2 || kKind == 5) return {-INFINITY, 0.f};
  return {0.f, 0.f};
}

template <int kKind>
__device__ __forceinline__ void row_acc_push(RowAcc& a, float x) {
  if constexpr (kKind == 1) {
    a.m = min_nan(a.m, x);
  } else if constexpr (kKind == 2) {
    a.m = max_nan(a.m, x);
  } else if constexpr (kKind == 3 || kKind == 4) {
    float err;
    a.m = two_sum(a.m, x, err);
    a.s += err;
  } else {
    if (x > a.m) {  // a new maximum: rescale what was summed so far
      const float c = lse_shift(x);
      a.s = (a.s == 0.f ? 0.f : a.s * expf(lse_shift(a.m) - c)) + expf(x - c);
      a.m = x;
    } else {
      if (x != x) a.m = x;  // NaN sticks (and makes s NaN below)
      a.s += expf(x - lse_shift(a.m));
    }
  }
}

template <int kKind>
__device__ __forceinline__ RowAcc row_acc_merge(RowAcc a, RowAcc b) {
  if constexpr (kKind == 1) return {min_nan(a.m, b.m), 0.f};
  if constexpr (kKind == 2) return {max_nan(a.m, b.m), 0.f};
  if constexpr (kKind == 3 || kKind == 4) {
    float err;
    const float m = two_sum(a.m, b.m, err);
    return {m, a.s + b.s + err};
  }
  const float m = max_nan(a.m, b.m), c = lse_shift(m);
  // An empty side (s == 0) adds nothing, even where exp of its shift would overflow.
  const float sa = a.s == 0.f ? 0.f : a.s * expf(lse_shift(a.m) - c);
  const float sb = b.s == 0.f ? 0.f : b.s * expf(lse_shift(b.m) - c);
  return {m, sa + sb};
}

// n >= 1 partials merged in index order, from the first.
template <int kKind>
__device__ __forceinline__ RowAcc row_acc_merge_run(const RowAcc* parts, int n) {
  RowAcc acc = parts[0];
  for (int i = 1; i < n; ++i) acc = row_acc_merge<kKind>(acc, parts[i]);
  return acc;
}

// n >= 1 partials load(0), ..., load(n - 1) merged in index order, kFold loads in flight before
// they merge: one at a time, the last block of a row band waited on 64 L2 loads in turn (#75 at
// N = 8192) after every other block had finished.
template <int kKind, class Load>
__device__ __forceinline__ RowAcc row_acc_merge_loads(int n, Load load) {
  constexpr int kFold = 8;
  RowAcc acc = row_acc_empty<kKind>();
  for (int i0 = 0; i0 < n; i0 += kFold) {
    RowAcc part[kFold];
#pragma unroll
    for (int j = 0; j < kFold; ++j) part[j] = load(min(i0 + j, n - 1));
#pragma unroll
    for (int j = 0; j < kFold; ++j)
      if (i0 + j < n) acc = i0 + j == 0 ? part[j] : row_acc_merge<kKind>(acc, part[j]);
  }
  return acc;
}

template <int kKind>
__device__ __forceinline__ float row_acc_finish(RowAcc a, int n) {
  if constexpr (kKind == 3) return a.m + a.s;
  if constexpr (kKind == 4) return (a.m + a.s) * (1.f / static_cast<float>(n));
  if constexpr (kKind == 5) return a.m != a.m ? a.m : logf(a.s) + lse_shift(a.m);
  return a.m;
}

template <int kKind>
__device__ __forceinline__ RowAcc row_acc_warp(RowAcc a) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const RowAcc o{__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.s, off)};
    a = row_acc_merge<kKind>(a, o);
  }
  return a;
}

// A block's accumulators as one (each warp by row_acc_warp, then the warps in order by thread
// 0), the row's result stored at *out by thread 0.
template <int kKind, int kThreads>
__device__ __forceinline__ void row_acc_block_store(RowAcc acc, float* out, int n) {
  __shared__ RowAcc s_acc[kThreads / 32];
  const int tid = threadIdx.x;
  acc = row_acc_warp<kKind>(acc);
  if (tid % 32 == 0) s_acc[tid / 32] = acc;
  __syncthreads();
  if (tid == 0) {
    RowAcc total = s_acc[0];
    for (int w = 1; w < kThreads / 32; ++w) total = row_acc_merge<kKind>(total, s_acc[w]);
    *out = row_acc_finish<kKind>(total, n);
  }
}

}  // namespace gemmfuse
