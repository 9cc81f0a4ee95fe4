// A part of a chain's library: the kernels after a product (norm_finalize.cuh): the wide
// GroupNorm's finalize pass, and the epilogue path's tile and row kernels.
#include "chain_part.cuh"
#include "norm_finalize.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t finalize(const FusedArgs& args, cudaStream_t stream) {
  return launch_norm_finalize<GeneratedEpilogue>(args, stream);
}

cudaError_t tile_epilogue(const FusedArgs& args, cudaStream_t stream) {
  return launch_tile_epilogue<GeneratedEpilogue>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse
