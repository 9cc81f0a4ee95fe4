// Pointwise functions the generated epilogue calls where the plain expression is slow: each
// returns exactly what nvcc gives the plain expression under the package's flags (no fast-math,
// no flush-to-zero), which is what PyTorch's float32 CUDA kernels compute, but without a branch
// per value.
//
// Why: `a / d` compiles to a fast path, a range check and a call to a slow path. In the fused
// kernel's epilogue the branch around each division keeps ptxas from interleaving the
// independent values a thread holds, and with 8 warps an SM the epilogue is latency-bound:
// sigmoid cost the split kernel 17-20% of its time at 16384 x 2048 x 4096 (H100, 2026-11-26;
// docs/DESIGN.md section 4). Here the quotient is the same fast path (a reciprocal refined by
// Newton's step, the quotient by one more), always taken: d >= 1 keeps it in range, and the
// ranges where it is not (huge d, tiny or subnormal results) are scaled into it by powers of
// two, selected without branching; every scale factor is a normal float, so flush-to-zero
// cannot turn one into 0. tests/gpu/test_pointwise_math.py checks them against PyTorch over
// all 2^32 floats. Not done for a general a / b: a branch-free one (both mantissas through the
// fast path, the exponents put back, subnormals rounded once) was bit-exact but slower, 1.4-2.7x
// in a microbenchmark and 690 -> 855 us in the fused kernel with an rdiv chain (H100,
// 2026-11-26, docs/DESIGN.md section 4): the grammar's div, rdiv and softplus keep `/`.
#pragma once

namespace gemmfuse {

// a / d by div.rn's fast path: correctly rounded where d and the quotient are normal and d is in
// [1, 2^123) (or scaled into a range named below); checked only as this file uses it.
__device__ __forceinline__ float div_fast_path(float a, float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  const float q = a * r;
  return fmaf(r, fmaf(-d, q, a), q);
}

// 1 / d correctly rounded (subnormal results included) for d >= 1, inf or NaN: one fast path
// on d scaled into its range by a power of two, then the result scaled back.
// - d < 2^123: no scaling.
// - d in [2^123, 2^126]: 1/d in [2^-126, 2^-123] is normal; d and the result scaled by 2^-64.
// - d in (2^126, inf): 1/d = k 2^-149 for an integer k <= 2^23 (a subnormal, rounded once from
//   the exact value). With d' = d 2^-149, q = 1/d' rounded to float's 24 bits is k's value to
//   1/4 or 1/2; rint(q) is k unless q is a half-integer, where the remainder's sign says which
//   way the exact value lies (it is never a half-integer itself: d would be a power of two).
__device__ __forceinline__ float reciprocal_at_least_one(float d) {
  const bool unscaled = d < 0x1p123f, normal = d <= 0x1p126f;
  // 2^-149 in two normal steps (2^-126, then 2^-23), here and for the result
  const float ds = unscaled ? d : normal ? d * 0x1p-64f : (d * 0x1p-126f) * 0x1p-23f;
  const float q = div_fast_path(1.f, ds);
  const float rem = fmaf(-ds, q, 1.f), down = floorf(q);
  const float k = (q - down == 0.5f && rem != 0.f) ? (rem > 0.f ? down + 1.f : down) : rintf(q);
  const float r = unscaled ? q : normal ? q * 0x1p-64f : (k * 0x1p-23f) * 0x1p-126f;
  return d < INFINITY ? r : d == INFINITY ? 0.f : d;  // inf: 0; NaN stays NaN
}

// log1pf(a) by the operations nvcc 13.0 emits for it (its libdevice's, read from the PTX), with
// the branch to its special cases (a < 0, inf, NaN) made selects (ptxas predicates what is left:
// no branch in the SASS): the same value as log1pf for every a (a one-off check over all 2^32
// floats, H100, 2026-11-26; docs/DESIGN.md section 4). tests/gpu/test_pointwise_math.py checks
// it as mish and softplus use it, on expf's results, against PyTorch over every input float; a
// toolkit whose log1pf differed there would show.
__device__ __forceinline__ float log1p_rn(float a) {
  // the bit arithmetic unsigned, where it wraps (a = -1: 0x40800000 - e is 2^31)
  const unsigned ua = __float_as_uint(a);
  const unsigned e = (__float_as_uint(__fadd_rz(a, 1.f)) - 0x3f400000u) & 0xff800000u;
  const float m = __uint_as_float(ua - e);
  const float u = __fadd_rn(fmaf(0.25f, __uint_as_float(0x40800000u - e), -1.f), m);
  float p = fmaf(__uint_as_float(0xbd39bf78u), u, __int_as_float(0x3dd80012));
  p = fmaf(p, u, __uint_as_float(0xbe0778e0u));
  p = fmaf(p, u, __int_as_float(0x3e146475));
  p = fmaf(p, u, __uint_as_float(0xbe2a68ddu));
  p = fmaf(p, u, __int_as_float(0x3e4caf9e));
  p = fmaf(p, u, __uint_as_float(0xbe800042u));
  p = fmaf(p, u, __int_as_float(0x3eaaaae6));
  p = fmaf(p, u, -0.5f);
  const float r = fmaf(__fmul_rn(static_cast<float>(static_cast<int>(e)), 0x1p-23f),
                       __int_as_float(0x3f317218),
                       fmaf(__fmul_rn(u, p), u, u));
  // a < -1, +inf or NaN: a * inf + inf (NaN, inf, NaN); -0: -0; [-1, -0) and the rest: r
  const bool special = ua >= 0x7f800000u;
  const float s = static_cast<int>(ua) >= -1082130431 ? fmaf(a, INFINITY, INFINITY) : r;
  return special ? (a == 0.f ? -0.f : s) : r;
}

// a > b ? x : y as a select, x and y both computed: a ternary whose y is long (softplus's
// log1p(exp(v beta)) / beta) compiles to a branch around y, which keeps ptxas from interleaving
// the values a thread holds. NaN compares false, as in the ternary.
__device__ __forceinline__ float select_greater(float a, float b, float x, float y) {
  float r;
  asm("{\n .reg .pred p;\n setp.gt.f32 p, %1, %2;\n selp.f32 %0, %3, %4, p;\n}"
      : "=f"(r) : "f"(a), "f"(b), "f"(x), "f"(y));
  return r;
}

// torch.sigmoid: 1 / (1 + exp(-v)).
__device__ __forceinline__ float sigmoid_rn(float v) {
  return reciprocal_at_least_one(1.f + expf(-v));
}

// F.silu: v / (1 + exp(-v)). The quotient is normal wherever d is huge (|v| >= 85 there), so
// scaling d and the result by 2^-64 is exact; 0, inf and NaN numerators pass through as the
// division passes them (v = -inf: d = inf, NaN). (With flush-to-zero a subnormal v would pass
// through where the division flushes it to 0.)
__device__ __forceinline__ float silu_rn(float v) {
  const float d = 1.f + expf(-v);
  const bool big = !(d < 0x1p123f);
  const float ds = big ? d * 0x1p-64f : d;
  float q = div_fast_path(v, ds);
  q = big ? q * 0x1p-64f : q;
  q = (v == 0.f || isinf(v)) ? v : q;
  return isinf(d) ? v * 0.f : q;
}

}  // namespace gemmfuse
