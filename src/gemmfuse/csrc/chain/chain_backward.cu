// A part of a chain's library: the chain's backward (chain_backward_plan.cuh).
#include "chain_part.cuh"
#include "chain_backward_plan.cuh"

namespace gemmfuse {
namespace parts {

// A float32 model's instance (its roundings fixed), or the 16-bit models' (bfloat16 or float16,
// chosen at run time).
BackwardPlan backward_plan(int M, int N, int group_size, int model16) {
  if (model16 == kFloat32Model)
    return chain_backward_plan_for<GeneratedEpilogueFor<kFloat32Model>>(M, N, group_size);
  return chain_backward_plan_for<GeneratedEpilogue>(M, N, group_size);
}

cudaError_t backward(const BackwardArgs& args, const BackwardPlan& plan, cudaStream_t stream) {
  if (args.model16 == kFloat32Model)
    return launch_chain_backward_kernel<GeneratedEpilogueFor<kFloat32Model>>(args, plan, stream);
  return launch_chain_backward_kernel<GeneratedEpilogue>(args, plan, stream);
}

}  // namespace parts
}  // namespace gemmfuse

#ifdef GEMMFUSE_PARTS_APART
GEMMFUSE_EXPORT void gemmfuse_part_entries(gemmfuse::PartEntries* entries) {
  gemmfuse::publish(entries->backward_plan, &gemmfuse::parts::backward_plan);
  gemmfuse::publish(entries->backward, &gemmfuse::parts::backward);
}
#endif
