// A part of a chain's library: the kernels after a product (norm_finalize.cuh): the wide
// GroupNorm's finalize pass, and the epilogue path's tile and row kernels.
#include "chain_part.cuh"
#include "norm_finalize.cuh"

namespace gemmfuse {
namespace parts {

// After a fused kernel: a float32 model's instance, or one for the 16-bit dtypes (a wide
// GroupNorm's finalize is a pass over memory; its roundings are chosen at run time).
cudaError_t finalize(const FusedArgs& args, cudaStream_t stream) {
  if (args.params.model16 == kFloat32Model)
    return launch_norm_finalize<GeneratedEpilogueFor<kFloat32Model>>(args, stream);
  return launch_norm_finalize<GeneratedEpilogue>(args, stream);
}

// An instance per model dtype: the chain kernel is a 16-bit model's whole epilogue path.
cudaError_t tile_epilogue(const FusedArgs& args, cudaStream_t stream) {
  if (args.epilogue_in16 != nullptr && args.params.model16 == kBf16Model)
    return launch_tile_epilogue<GeneratedEpilogueFor<kBf16Model>>(args, stream);
  if (args.epilogue_in16 != nullptr && args.params.model16 == kFp16Model)
    return launch_tile_epilogue<GeneratedEpilogueFor<kFp16Model>>(args, stream);
  return launch_tile_epilogue<GeneratedEpilogueFor<kFloat32Model>>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse
