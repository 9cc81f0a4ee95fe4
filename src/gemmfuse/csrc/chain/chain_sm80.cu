// A part of a chain's library: the portable kernel (gemm_gn_sm80.cuh), any GPU from sm_80.
#include "chain_part.cuh"
#include "gemm_gn_sm80.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t sm80(const FusedArgs& args, cudaStream_t stream) {
  return launch_fused_gemm_gn<GeneratedEpilogueFor<kFloat32Model>>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->sm80, &gemmfuse::parts::sm80);
}
#endif
