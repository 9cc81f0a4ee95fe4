// A part of a chain's library: the dispatch among the other parts and the table the host
// extension launches through (chain_table.h). Host code only: it compiles in a moment.
#include "chain_part.cuh"

namespace gemmfuse {
namespace {

cudaError_t launch_fused(const FusedArgs& args, int kernel, cudaStream_t stream) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  // The library is compiled for exactly this device, so on 9.0 the sm_90a kernel bodies are present.
  const bool hopper = major == 9 && minor == 0;
  if ((kernel == 2 || args.bf16) && !hopper) return cudaErrorInvalidDeviceFunction;
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  if (args.bf16)
    err = parts::sm90_bf16(args, stream);
  else if (kernel == 2 || (kernel == 0 && hopper))
    err = args.split ? parts::sm90_split(args, stream) : parts::sm90_one_pass(args, stream);
  else
    err = parts::sm80(args, stream);
  if (err != cudaSuccess || !args.norm_wide) return err;
  return parts::finalize(args, stream);
}

cudaError_t launch_epilogue_only(const FusedArgs& args, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  return parts::tile_epilogue(args, stream);
}

cudaError_t launch_gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  return parts::gemv(args, gemv, stream);
}

}  // namespace
}  // namespace gemmfuse

// The library's one exported symbol (C linkage: found by name with dlsym, or linked directly
// into a standalone export's single library).
extern "C" const gemmfuse::ChainTable* gemmfuse_chain_table() {
  using namespace gemmfuse;
  static const ChainTable table = {
      kChainTableVersion,
      static_cast<int>(sizeof(ChainTable)),
      static_cast<int>(sizeof(FusedArgs)),
      static_cast<int>(sizeof(BackwardArgs)),
      static_cast<int>(sizeof(GemvArgs)),
      GeneratedEpilogue::kReduce,
      GeneratedEpilogue::kPlain ? 1 : 0,
      GeneratedEpilogue::kColumnSums,
      launch_fused,
      launch_epilogue_only,
      launch_gemv,
      parts::gemv_slice,
      parts::backward_plan,
      parts::backward,
  };
  return &table;
}
