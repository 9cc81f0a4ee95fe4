// A part of a chain's library: the kernels after a product (norm_finalize.cuh) for a float32
// model: the wide GroupNorm's finalize pass, and the epilogue path's tile and row kernels. A
// 16-bit model's instances are chain_epilogue_16bit.cu's, compiled beside this part (one part of
// both took the longest of a chain's parts to compile: 6.1-7.0 s for #62's chain on the 2-core
// development machine, 4.1-4.5 s each apart; nvcc for sm_90a, 2026-11-28).
#include "chain_part.cuh"
#include "norm_finalize.cuh"

namespace gemmfuse {
namespace parts {

// A wide GroupNorm's finalize pass after a float32 model's fused kernel.
cudaError_t finalize(const FusedArgs& args, cudaStream_t stream) {
  return launch_norm_finalize<GeneratedEpilogueFor<kFloat32Model>>(args, stream);
}

// The epilogue path's chain kernel on a float32 z.
cudaError_t tile_epilogue(const FusedArgs& args, cudaStream_t stream) {
  return launch_tile_epilogue<GeneratedEpilogueFor<kFloat32Model>>(args, stream);
}

// Whether tile_epilogue, given the plain GEMM's tile counts, follows its tiles (group_tiles.cuh).
int follows_tiles(const FusedArgs& args) {
  return group_tiles_serves<GeneratedEpilogueFor<kFloat32Model>>(args) ? 1 : 0;
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->finalize, &gemmfuse::parts::finalize);
  gemmfuse::publish(entries->tile_epilogue, &gemmfuse::parts::tile_epilogue);
  gemmfuse::publish(entries->follows_tiles, &gemmfuse::parts::follows_tiles);
}
#endif
