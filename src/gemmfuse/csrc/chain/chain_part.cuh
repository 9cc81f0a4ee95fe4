// What every part of a chain's library starts with: the argument structs, the pointwise
// derivatives the generated code calls, the generated epilogue (GeneratedEpilogueFor) and the
// parts' entry points, which chain_table.cu's dispatch calls (through part_entries.h's
// PartEntries where each part is a library of its own).
#pragma once
#include "fused_args.h"
#include "pointwise_grad.cuh"
#include "epilogue_generated.cuh"
#include "chain_table.h"
#include "part_entries.h"

namespace gemmfuse {
namespace parts {

// One kernel family each, in a translation unit of its own (compiled in parallel): the Hopper
// kernel's three variants (the one-pass one's float32 and float16 instances apart), the portable
// kernel, the wide-GroupNorm finalize pass and the epilogue path's tile kernels (float32 and
// 16-bit apart), the few-rows kernel, the chain's backward.
cudaError_t sm90_split(const FusedArgs& args, cudaStream_t stream);
cudaError_t sm90_one_pass(const FusedArgs& args, cudaStream_t stream);
cudaError_t sm90_fp16(const FusedArgs& args, cudaStream_t stream);
cudaError_t sm90_bf16(const FusedArgs& args, cudaStream_t stream);
cudaError_t sm80(const FusedArgs& args, cudaStream_t stream);
cudaError_t finalize(const FusedArgs& args, cudaStream_t stream);
cudaError_t finalize_16bit(const FusedArgs& args, cudaStream_t stream);
cudaError_t tile_epilogue(const FusedArgs& args, cudaStream_t stream);
int follows_tiles(const FusedArgs& args);
cudaError_t tile_epilogue_16bit(const FusedArgs& args, cudaStream_t stream);
cudaError_t gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream);
int gemv_slice(int K, int N);
BackwardPlan backward_plan(int M, int N, int group_size, int model16);
cudaError_t backward(const BackwardArgs& args, const BackwardPlan& plan, cudaStream_t stream);

}  // namespace parts
}  // namespace gemmfuse
