// One translation unit per epilogue: the generated epilogue, the kernels, and the entry points
// that binding.cpp calls. build.py substitutes "epilogue_generated.cuh" with the code it
// generates from the epilogue description.
#include "fused_args.h"
#include "pointwise_grad.cuh"
#include "epilogue_generated.cuh"
#include "chain_backward_plan.cuh"
#include "gemm_gn_sm80.cuh"
#include "gemm_gn_sm90.cuh"
#include "gemv_epilogue.cuh"
#include "norm_finalize.cuh"
#include "split_rows.cuh"

namespace gemmfuse {

int fused_reduce_kind() { return GeneratedEpilogue::kReduce; }
bool fused_is_plain() { return GeneratedEpilogue::kPlain; }
int fused_tile() { return kTile; }

cudaError_t launch_split_rows_f32(const float* x, int64_t row_stride, int rows, int k,
                                  int k_padded, __half* hi, __half* lo, float* inv_scale,
                                  cudaStream_t stream) {
  return launch_split_rows(x, row_stride, rows, k, k_padded, hi, lo, inv_scale, stream);
}

cudaError_t launch_split_cols_f32(const float* x, int64_t row_stride, int rows, int cols,
                                  int rows_padded, __half* hi, __half* lo, float* inv_scale,
                                  float* col_max, cudaStream_t stream) {
  return launch_split_cols(x, row_stride, rows, cols, rows_padded, hi, lo, inv_scale, col_max,
                           stream);
}

int split_cols_chunks(int rows) { return col_max_chunks(rows); }

cudaError_t launch_fused(const FusedArgs& args, int kernel, cudaStream_t stream) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  // build.py compiles for exactly this device, so on 9.0 the sm_90a kernel body is present.
  const bool hopper = major == 9 && minor == 0;
  if ((kernel == 2 || args.bf16) && !hopper) return cudaErrorInvalidDeviceFunction;
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  if (args.bf16 || kernel == 2 || (kernel == 0 && hopper))
    err = sm90::launch<GeneratedEpilogue>(args, stream);
  else
    err = launch_fused_gemm_gn<GeneratedEpilogue>(args, stream);
  if (err != cudaSuccess || !args.norm_wide) return err;
  return launch_norm_finalize<GeneratedEpilogue>(args, stream);
}

cudaError_t launch_gemv_epilogue(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  return launch_gemv<GeneratedEpilogue>(args, gemv, stream);
}

int gemv_max_rows() { return kGemvMaxRows; }

int chain_backward_sums() { return GeneratedEpilogue::kColumnSums; }

BackwardPlan chain_backward_plan(int M, int N, int group_size) {
  return chain_backward_plan_for<GeneratedEpilogue>(M, N, group_size);
}

cudaError_t launch_chain_backward(const BackwardArgs& args, const BackwardPlan& plan,
                                  cudaStream_t stream) {
  return launch_chain_backward_kernel<GeneratedEpilogue>(args, plan, stream);
}

int gemv_slice_for(int K, int N) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return gemv_slice(K, N, sms);
}

cudaError_t launch_epilogue_only(const FusedArgs& args, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  return launch_tile_epilogue<GeneratedEpilogue>(args, stream);
}

}  // namespace gemmfuse
