// A part of a chain's library: the Hopper kernel's one-pass fp16 variant, precision="tf32"'s and
// float16 models' (gemm_gn_sm90.cuh).
#include "chain_part.cuh"
#include "gemm_gn_sm90.cuh"

namespace gemmfuse {
namespace parts {

// float32 models (precision="tf32") and float16 ones: an instance each, its roundings fixed.
cudaError_t sm90_one_pass(const FusedArgs& args, cudaStream_t stream) {
  if (args.params.model16 == kFp16Model)
    return sm90::launch<GeneratedEpilogueFor<kFp16Model>, false, false>(args, stream);
  return sm90::launch<GeneratedEpilogueFor<kFloat32Model>, false, false>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse
