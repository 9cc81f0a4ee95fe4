// A part of a chain's library: the Hopper kernel's one-pass fp16 variant for float32 models
// (precision="tf32"; gemm_gn_sm90.cuh). A float16 model's instance is chain_sm90_fp16.cu's,
// compiled beside this part (one part of both took 6.0-6.3 s for #62's chain on the 2-core
// development machine, the longest after the epilogue part's; nvcc for sm_90a, 2026-11-28).
#include "chain_part.cuh"
#include "gemm_gn_sm90.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t sm90_one_pass(const FusedArgs& args, cudaStream_t stream) {
  return sm90::launch<GeneratedEpilogueFor<kFloat32Model>, false, false>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->sm90_one_pass, &gemmfuse::parts::sm90_one_pass);
}
#endif
