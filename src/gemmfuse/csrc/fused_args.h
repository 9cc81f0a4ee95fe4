// Arguments shared by the host binding (binding.cpp, a plain C++ translation unit) and the
// kernels (fused_linear.cu).
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace gemmfuse {

constexpr int kMaxParams = 8;

// Run-time values of the epilogue ops: scalars (a LeakyReLU slope, a multiplier) and
// per-channel vectors (indexed by output column). The generated epilogue reads them by index,
// so one compiled kernel serves every value of a chain's scalars.
struct EpilogueParams {
  const float* vec[kMaxParams];
  float scalar[kMaxParams];
};

struct FusedArgs {
  const __half* a_hi;        // [M, k_padded]
  const __half* a_lo;
  const float* a_inv_scale;  // [M]
  const __half* b_hi;        // [N, k_padded]
  const __half* b_lo;
  const float* b_inv_scale;  // [N]
  const float* bias;         // [N] or nullptr
  const float* gn_weight;    // [N] or nullptr (GroupNorm without affine)
  const float* gn_bias;      // [N] or nullptr
  float* out;                // [M, N] when the epilogue does not reduce
  float* row_partial;        // [N tiles, M] when it reduces
  float* row_out;            // [M] when it reduces
  int* row_counter;          // [M tiles], zero on entry, left zero on exit
  int M, N, k_padded, group_size;
  int split;                 // 1: hi*hi + hi*lo + lo*hi (fp32-accurate); 0: hi*hi alone (fast)
  float eps;
  EpilogueParams params;
};

// Defined in fused_linear.cu, one translation unit per epilogue.
int fused_reduce_kind();
int fused_tile();  // side of the square output tile
cudaError_t launch_split_rows_f32(const float* x, int64_t row_stride, int rows, int k,
                                  int k_padded, __half* hi, __half* lo, float* inv_scale,
                                  cudaStream_t stream);
// kernel: 0 picks by device (Hopper's on sm_90, else the portable one), 1 the portable sm_80
// kernel, 2 the Hopper kernel (sm_90 only).
cudaError_t launch_fused(const FusedArgs& args, int kernel, cudaStream_t stream);

}  // namespace gemmfuse
