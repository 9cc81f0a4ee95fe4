// A part of a chain's library: the few-rows kernel (gemv_epilogue.cuh).
#include "chain_part.cuh"
#include "device_cache.h"
#include "gemv_epilogue.cuh"

namespace gemmfuse {
namespace parts {

cudaError_t gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  return launch_gemv<GeneratedEpilogueFor<kFloat32Model>>(args, gemv, stream);
}

int gemv_slice(int K, int N) {
  static DeviceCache sm_counts;  // asked once per device, not at every call
  int sms = 0;
  const cudaError_t err = sm_counts.current(sms, [](int device, int& found) {
    return cudaDeviceGetAttribute(&found, cudaDevAttrMultiProcessorCount, device);
  });
  // A failed query keeps the H100's count: the slicing, not the result's correctness, hangs on it
  return gemmfuse::gemv_slice(K, N, err == cudaSuccess ? sms : 132);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->gemv, &gemmfuse::parts::gemv);
  gemmfuse::publish(entries->gemv_slice, &gemmfuse::parts::gemv_slice);
}
#endif
