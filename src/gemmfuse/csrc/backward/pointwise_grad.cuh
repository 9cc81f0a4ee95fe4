// Gradients of the pointwise ops whose formulas take more than an expression, as PyTorch's
// float32 CUDA backward kernels compute them (aten/src/ATen/native/cuda/ActivationGeluKernel.cu,
// ActivationSiluKernel.cu, ActivationMishKernel.cu, ActivationSoftplusKernel.cu). The generated
// epilogue's `pre_backward` / `post_backward` call them (epilogue.py's POINTWISE `grad`).
#pragma once
#include "fused_args.h"
#include "pointwise_math.cuh"
#include "row_reduce.cuh"

namespace gemmfuse {

// Adds v to the column sum acc[i], compensated: the rounding error accumulates at acc[i + errors]
// (the gradients of vectors and scalars sum many terms that may cancel).
__device__ __forceinline__ void column_add(float* acc, int i, int errors, float v) {
  float err;
  acc[i] = two_sum(acc[i], v, err);
  acc[i + errors] += err;
}

// d gelu(x) / dx, erf form: cdf + x * pdf.
__device__ __forceinline__ float gelu_grad(float x) {
  constexpr float kAlpha = 0.70710678118654752440f;  // 1 / sqrt(2)
  constexpr float kBeta = 0.39894228040143267794f;   // 1 / sqrt(2 pi)
  const float cdf = 0.5f * (1.f + erff(x * kAlpha));
  const float pdf = kBeta * expf(x * x * -0.5f);
  return cdf + x * pdf;
}

// d gelu(x) / dx, tanh form.
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  constexpr float kBeta = 0.79788456080286535588f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float x_sq = x * x;
  const float inner = kBeta * (x + kKappa * x_sq * x);
  const float tanh_inner = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float right_derivative = (1.f - tanh_inner * tanh_inner) * kBeta * (1.f + 3.f * kKappa * x_sq);
  return left_derivative + left * right_derivative;
}

__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid_rn(x);
  return s * (1.f + x * (1.f - s));
}

__device__ __forceinline__ float mish_grad(float x) {
  const float s = sigmoid_rn(x);
  const float t = tanhf(log1p_rn(expf(x)));
  return t + x * s * (1.f - t * t);
}

// x * sigmoid(x) written as two ops: mul's gradient to both factors, then sigmoid's
// (sigmoid_backward: grad * (1 - s) * s), with s rounded as the model rounds it.
template <int kModel>
__device__ __forceinline__ float swish_grad(float x, float g, const EpilogueParams& p) {
  const float s = round_like_model<kModel>(sigmoid_rn(x), p);
  return g * s + (g * x) * (1.f - s) * s;
}

// softplus(x; beta, threshold): linear above the threshold.
__device__ __forceinline__ float softplus_grad(float x, float g, float beta, float threshold) {
  const float z = expf(x * beta);
  return x * beta > threshold ? g : g * z / (z + 1.f);
}

}  // namespace gemmfuse
