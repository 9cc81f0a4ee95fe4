// A part of a chain's library: the Hopper kernel's bf16-model variant (gemm_gn_sm90.cuh).
#include "chain_part.cuh"
#include "gemm_gn_sm90.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t sm90_bf16(const FusedArgs& args, cudaStream_t stream) {
  return sm90::launch<GeneratedEpilogueFor<kBf16Model>, false, true>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->sm90_bf16, &gemmfuse::parts::sm90_bf16);
}
#endif
