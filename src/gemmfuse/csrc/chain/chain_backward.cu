// A part of a chain's library: the chain's backward (chain_backward_plan.cuh).
#include "chain_part.cuh"
#include "chain_backward_plan.cuh"

namespace gemmfuse {
namespace parts {

BackwardPlan backward_plan(int M, int N, int group_size, int model16) {
  return chain_backward_plan_for<GeneratedEpilogue>(M, N, group_size, model16 != 0);
}

cudaError_t backward(const BackwardArgs& args, const BackwardPlan& plan, cudaStream_t stream) {
  return launch_chain_backward_kernel<GeneratedEpilogue>(args, plan, stream);
}

}  // namespace parts
}  // namespace gemmfuse
