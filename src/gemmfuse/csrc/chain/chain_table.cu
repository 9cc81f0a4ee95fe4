// A part of a chain's library: the dispatch among the other parts and the table the host
// extension launches through (chain_table.h). Host code only: it compiles in a moment.
#include "chain_part.cuh"
#include "device_cache.h"

#ifdef GEMMFUSE_PARTS_APART
namespace gemmfuse {
namespace {

PartEntries entries;  // each part's library publishes its own (gemmfuse_part_entries)
// The package's builder (gemmfuse/jit.py): builds and loads the part in file `part` (which then
// publishes its entries) and returns 1, or says why it could not on stderr and returns 0.
std::atomic<int (*)(const char* part)> load_part{};
// What an entry of a part that could not be built or loaded returns (the builder said why).
constexpr cudaError_t kPartMissing = cudaErrorSharedObjectInitFailed;

// The entry `slot` of the part in file `part`, that part built and loaded first if it is not yet;
// nullptr if it could not be.
template <class Fn>
Fn entry(std::atomic<Fn> PartEntries::*slot, const char* part) {
  Fn fn = (entries.*slot).load(std::memory_order_acquire);
  if (fn != nullptr) return fn;
  int (*load)(const char*) = load_part.load(std::memory_order_acquire);
  if (load == nullptr || !load(part)) return nullptr;
  return (entries.*slot).load(std::memory_order_acquire);
}

// The parts' entry points as the dispatch below calls them: each through its part's library
// (internal linkage: the parts' own functions of these names are theirs alone).
namespace through_entries {

#define GEMMFUSE_FORWARD_TO_PART(name, file)                                  \
  cudaError_t name(const FusedArgs& args, cudaStream_t stream) {              \
    auto fn = entry(&PartEntries::name, file);                                \
    return fn != nullptr ? fn(args, stream) : kPartMissing;                   \
  }
GEMMFUSE_FORWARD_TO_PART(sm90_split, "chain_sm90_split.cu")
GEMMFUSE_FORWARD_TO_PART(sm90_one_pass, "chain_sm90_one_pass.cu")
GEMMFUSE_FORWARD_TO_PART(sm90_fp16, "chain_sm90_fp16.cu")
GEMMFUSE_FORWARD_TO_PART(sm90_bf16, "chain_sm90_bf16.cu")
GEMMFUSE_FORWARD_TO_PART(sm80, "chain_sm80.cu")
GEMMFUSE_FORWARD_TO_PART(finalize, "chain_epilogue.cu")
GEMMFUSE_FORWARD_TO_PART(tile_epilogue, "chain_epilogue.cu")
GEMMFUSE_FORWARD_TO_PART(finalize_16bit, "chain_epilogue_16bit.cu")
GEMMFUSE_FORWARD_TO_PART(tile_epilogue_16bit, "chain_epilogue_16bit.cu")
#undef GEMMFUSE_FORWARD_TO_PART

// Without its part the chain kernel runs after the GEMM (0: it does not follow).
int follows_tiles(const FusedArgs& args) {
  auto fn = entry(&PartEntries::follows_tiles, "chain_epilogue.cu");
  return fn != nullptr ? fn(args) : 0;
}

cudaError_t gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  auto fn = entry(&PartEntries::gemv, "chain_gemv.cu");
  return fn != nullptr ? fn(args, gemv, stream) : kPartMissing;
}

// Without its part: one slice of all of K (the launch that follows then fails, kPartMissing).
int gemv_slice(int K, int N) {
  auto fn = entry(&PartEntries::gemv_slice, "chain_gemv.cu");
  return fn != nullptr ? fn(K, N) : (K > 0 ? K : 1);
}

// Without its part: row_blocks kBackwardPartMissing, which the host and gemmfuse.autograd
// refuse with an error (0 would read as a plan that does not fit, and the backward would
// quietly run in PyTorch).
BackwardPlan backward_plan(int M, int N, int group_size, int model16) {
  auto fn = entry(&PartEntries::backward_plan, "chain_backward.cu");
  if (fn != nullptr) return fn(M, N, group_size, model16);
  BackwardPlan missing;
  missing.row_blocks = gemmfuse::kBackwardPartMissing;
  return missing;
}

cudaError_t backward(const BackwardArgs& args, const BackwardPlan& plan, cudaStream_t stream) {
  auto fn = entry(&PartEntries::backward, "chain_backward.cu");
  return fn != nullptr ? fn(args, plan, stream) : kPartMissing;
}

}  // namespace through_entries
}  // namespace
namespace part_calls = through_entries;
}  // namespace gemmfuse

// What the package's builder reaches in this library (by dlsym): the entries each part's
// library fills, and the builder of a part not yet loaded.
GEMMFUSE_EXPORT gemmfuse::PartEntries* gemmfuse_chain_entries() { return &gemmfuse::entries; }
GEMMFUSE_EXPORT void gemmfuse_chain_set_loader(int (*loader)(const char* part)) {
  gemmfuse::load_part.store(loader, std::memory_order_release);
}
#else
namespace gemmfuse {
namespace part_calls = parts;  // one library: the parts' functions themselves
}  // namespace gemmfuse
#endif  // GEMMFUSE_PARTS_APART

namespace gemmfuse {
namespace {

// Whether this device is sm_90 (asked once per device): a check of the launch code the caller
// decided (gemmfuse/dispatch.py's fused_kernel_code), not a choice.
cudaError_t is_hopper(int device, bool& hopper) {
  static DeviceCache known;  // 1 sm_90, 2 another
  int kind = 0;
  const cudaError_t err = known.get(device, kind, [](int d, int& found) {
    int major = 0, minor = 0;
    cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d);
    found = major == 9 && minor == 0 ? 1 : 2;
    return e;
  });
  hopper = kind == 1;
  return err;
}

// kernel: kHopperKernel or kPortableKernel, as dispatch.fused_kernel_code decided it.
cudaError_t launch_fused(const FusedArgs& args, int kernel, cudaStream_t stream) {
  if (kernel != kHopperKernel && kernel != kPortableKernel) return cudaErrorInvalidValue;
  int device = 0;
  bool hopper = false;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = is_hopper(device, hopper);
  if (err != cudaSuccess) return err;
  // The library is compiled for exactly this device: the sm_90a kernel bodies exist on 9.0 only.
  if ((kernel == kHopperKernel || args.bf16) && !hopper) return cudaErrorInvalidDeviceFunction;
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  // tile counts for a chain kernel that follows: the split variant's direct stores make them
  if (args.tile_flags != nullptr && (kernel != kHopperKernel || !args.split || args.bf16 ||
                                     !GeneratedEpilogue::kPlain))
    return cudaErrorInvalidValue;
  const bool model16 = args.params.model16 != kFloat32Model;
  if (args.bf16)
    err = part_calls::sm90_bf16(args, stream);
  else if (kernel == kHopperKernel && args.split)
    err = part_calls::sm90_split(args, stream);
  else if (kernel == kHopperKernel)  // one pass: precision="tf32", or a float16 model
    err = args.params.model16 == kFp16Model ? part_calls::sm90_fp16(args, stream)
                                            : part_calls::sm90_one_pass(args, stream);
  else
    err = part_calls::sm80(args, stream);
  if (err != cudaSuccess || !args.norm_wide) return err;
  return model16 ? part_calls::finalize_16bit(args, stream) : part_calls::finalize(args, stream);
}

// A 16-bit model's z (args.epilogue_in16) takes its dtype's instance, a float32 z float32's.
cudaError_t launch_epilogue_only(const FusedArgs& args, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  if (args.epilogue_in16 != nullptr && args.params.model16 != kFloat32Model)
    return part_calls::tile_epilogue_16bit(args, stream);
  return part_calls::tile_epilogue(args, stream);
}

cudaError_t launch_gemv(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream) {
  if (args.norm_wide && !GeneratedEpilogue::kNorm) return cudaErrorInvalidValue;
  return part_calls::gemv(args, gemv, stream);
}

}  // namespace
}  // namespace gemmfuse

// The table (C linkage: found by name with dlsym, or linked directly into a standalone export's
// single library).
GEMMFUSE_EXPORT const gemmfuse::ChainTable* gemmfuse_chain_table() {
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
      part_calls::follows_tiles,
      launch_gemv,
      part_calls::gemv_slice,
      part_calls::backward_plan,
      part_calls::backward,
  };
  return &table;
}
