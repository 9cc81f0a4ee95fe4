// A part of a chain's library: the Hopper kernel's one-pass fp16 variant, precision="tf32"
// (gemm_gn_sm90.cuh).
#include "chain_part.cuh"
#include "gemm_gn_sm90.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t sm90_one_pass(const FusedArgs& args, cudaStream_t stream) {
  return sm90::launch<GeneratedEpilogue, false, false>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse
