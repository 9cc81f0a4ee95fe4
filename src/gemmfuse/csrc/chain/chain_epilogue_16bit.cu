// A part of a chain's library: chain_epilogue.cu's kernels for 16-bit models (norm_finalize.cuh),
// an instance per dtype, in a translation unit of their own so that both compile in parallel.
#include "chain_part.cuh"
#include "norm_finalize.cuh"

namespace gemmfuse {
namespace parts {

// A wide GroupNorm's finalize pass after a 16-bit model's fused kernel: one instance for both
// dtypes (its roundings are chosen at run time).
cudaError_t finalize_16bit(const FusedArgs& args, cudaStream_t stream) {
  return launch_norm_finalize<GeneratedEpilogue>(args, stream);
}

// The epilogue path's chain kernel on a bf16 or fp16 model's z.
cudaError_t tile_epilogue_16bit(const FusedArgs& args, cudaStream_t stream) {
  if (args.params.model16 == kBf16Model)
    return launch_tile_epilogue<GeneratedEpilogueFor<kBf16Model>>(args, stream);
  if (args.params.model16 == kFp16Model)
    return launch_tile_epilogue<GeneratedEpilogueFor<kFp16Model>>(args, stream);
  return cudaErrorInvalidValue;
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->finalize_16bit, &gemmfuse::parts::finalize_16bit);
  gemmfuse::publish(entries->tile_epilogue_16bit, &gemmfuse::parts::tile_epilogue_16bit);
}
#endif
