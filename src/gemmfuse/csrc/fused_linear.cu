// One translation unit per epilogue: the generated epilogue, the kernels, and the entry points
// that binding.cpp calls. build.py substitutes "epilogue_generated.cuh" with the code it
// generates from the epilogue description.
#include "fused_args.h"
#include "epilogue_generated.cuh"
#include "gemm_gn_sm80.cuh"
#include "split_rows.cuh"

namespace gemmfuse {

int fused_reduce_kind() { return GeneratedEpilogue::kReduce; }
int fused_tile() { return kBlockN; }

cudaError_t launch_split_rows_f32(const float* x, int64_t row_stride, int rows, int k,
                                  int k_padded, __half* hi, __half* lo, float* inv_scale,
                                  cudaStream_t stream) {
  return launch_split_rows(x, row_stride, rows, k, k_padded, hi, lo, inv_scale, stream);
}

cudaError_t launch_fused(const FusedArgs& args, cudaStream_t stream) {
  return launch_fused_gemm_gn<GeneratedEpilogue>(args, stream);
}

}  // namespace gemmfuse
