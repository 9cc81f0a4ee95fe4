// A part of a chain's library: the few-rows kernel (gemv_epilogue.cuh).
#include "chain_part.cuh"
#include "gemv_epilogue.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  return launch_gemv<GeneratedEpilogueFor<kFloat32Model>>(args, gemv, stream);
}

int gemv_slice(int K, int N) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return gemmfuse::gemv_slice(K, N, sms);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
extern "C" void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->gemv, &gemmfuse::parts::gemv);
  gemmfuse::publish(entries->gemv_slice, &gemmfuse::parts::gemv_slice);
}
#endif
