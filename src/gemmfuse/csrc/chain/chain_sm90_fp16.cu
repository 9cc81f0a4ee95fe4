// A part of a chain's library: the Hopper kernel's one-pass variant for float16 models
// (gemm_gn_sm90.cuh), apart from chain_sm90_one_pass.cu's float32 instance so that both compile
// in parallel.
#include "chain_part.cuh"
#include "gemm_gn_sm90.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t sm90_fp16(const FusedArgs& args, cudaStream_t stream) {
  return sm90::launch<GeneratedEpilogueFor<kFp16Model>, false, false>(args, stream);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->sm90_fp16, &gemmfuse::parts::sm90_fp16);
}
#endif
