// How a chain backward runs: which kernel (chain_backward_warp.cuh for narrow groups on rows of
// whole 1024-column slabs, else chain_backward.cuh), how the columns and rows are cut, its launch.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "chain_backward.cuh"
#include "chain_backward_warp.cuh"

namespace gemmfuse {

// Blocks of `kernel` with `bytes` of dynamic shared memory resident on the current GPU at once
// (0: they do not fit), queried once per device (the attribute calls cost microseconds each).
// Keyed by the kernel's own address: every chain's library instantiates these templates with a
// struct of the same name (GeneratedEpilogueFor<...>), and a template's static could be one object for
// the whole process (GNU unique symbols; the parts compile with -fno-gnu-unique, and since 2bef679
// with hidden symbols, so each library now keeps its own; the key holds regardless). Keyed by
// kind alone, a second chain's kernel found the first one's answer and never had its shared
// memory limit raised: its launch failed with "invalid argument" (measured, H100, two chains
// of 4096 channels in one process).
template <class Kernel>
int resident_blocks(Kernel kernel, size_t bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  static std::mutex lock;
  static std::map<std::tuple<int, const void*, size_t>, int> known;  // -> blocks
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), bytes);
  auto found = known.find(key);
  if (found == known.end()) {
    // Dynamic shared memory beyond the default 48 KB needs the kernel's limit raised (to what its
    // static shared memory leaves of the device's maximum, once); a kernel without any needs none.
    int optin = 0, sms = 0, per_sm = 0;
    cudaFuncAttributes attributes{};
    bool ok = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
              cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess;
    const size_t dynamic_max = ok ? static_cast<size_t>(optin) - attributes.sharedSizeBytes : 0;
    ok = ok && bytes <= dynamic_max;
    if (ok && bytes > 0)
      ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(dynamic_max)) == cudaSuccess;
    ok = ok && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBackwardThreads, bytes) ==
                   cudaSuccess;
    if (!ok) cudaGetLastError();  // a refused size is an answer, not a sticky error
    found = known.emplace(key, ok ? per_sm * sms : 0).first;
  }
  return found->second;
}

// How the backward of an M x N chain is cut. In registers: slabs of 1024 columns. Else the widest
// number of slabs (at most N / 1024, each a whole number of groups; one for logsumexp, whose
// row-wide sum is not split). Then as many row blocks as fill the GPU. row_blocks 0: a slab's
// working set exceeds what the device gives a block, or the chain has a softmax over the
// channels or a max pooling before its reduction, which the kernels do not differentiate (the
// chain's backward runs in PyTorch).
// Epi: a float32 model's instance (GeneratedEpilogueFor<kFloat32Model>), or the 16-bit models'
// (kAnyModel: bfloat16 or float16 at run time).
template <class Epi>
BackwardPlan chain_backward_plan_for(int m, int n, int group_size) {
  if constexpr (Epi::kSoftmax || Epi::kPool > 1) return {1, 0, 0, 0};
  // float32 sums compensated (exact), 16-bit models' plain (chain_backward_warp.cuh)
  constexpr bool kExact = Epi::kModelDtype == kFloat32Model;
  if (backward_in_registers<Epi>(n, group_size)) {
    const int slabs = n / kWarpSlab;
    const int resident = resident_blocks(chain_backward_warp_kernel<Epi, kExact>, 0);
    if (resident < 1) return {slabs, 0, 0, 1};
    return {slabs, max(1, min(m, resident / slabs)), 0, 1};
  }
  int slabs = Epi::kReduce == 5 ? 1 : max(1, min(256, n / kBackwardSlab));
  while (slabs > 1 && (n % slabs != 0 || (n / slabs) % group_size != 0)) --slabs;
  const size_t bytes = sizeof(float) * static_cast<size_t>(
      backward_smem(n / slabs, group_size, Epi::kNorm, Epi::kColumnSums).total);
  const int resident = resident_blocks(chain_backward_kernel<Epi>, bytes);
  if (resident < 1) return {slabs, 0, bytes, 0};
  return {slabs, max(1, min(m, resident / slabs)), bytes, 0};
}

// Launches a plan: the `extremes` phase first where min/max span several slabs. The shared-memory
// kernel's limit was raised to the device's maximum when the plan was made. The register
// kernel reads and writes four columns at once: z and dz 16-byte aligned (checked here).
template <class Epi>
cudaError_t launch_chain_backward_kernel(BackwardArgs a, const BackwardPlan& plan, cudaStream_t stream) {
  if (plan.row_blocks < 1 || plan.slabs < 1 || a.N % plan.slabs != 0 ||
      !serves_model<Epi>(a.params) || a.params.model16 != a.model16)
    return cudaErrorInvalidValue;
  if (plan.in_registers &&
      (reinterpret_cast<uintptr_t>(a.z) % 16 != 0 || reinterpret_cast<uintptr_t>(a.dz) % 16 != 0))
    return cudaErrorMisalignedAddress;
  a.slab = a.N / plan.slabs;
  const dim3 grid(plan.row_blocks, plan.slabs);
  auto launch = [&]() {
    if (plan.in_registers)  // 16-bit models' plain sums: chain_backward_warp.cuh
      chain_backward_warp_kernel<Epi, Epi::kModelDtype == kFloat32Model>
          <<<grid, kBackwardThreads, 0, stream>>>(a);
    else
      chain_backward_kernel<Epi><<<grid, kBackwardThreads, plan.smem_bytes, stream>>>(a);
    return cudaGetLastError();
  };
  if ((Epi::kReduce == 1 || Epi::kReduce == 2) && plan.slabs > 1) {
    if (a.extremes == nullptr) return cudaErrorInvalidValue;
    a.phase = 1;
    const cudaError_t err = launch();
    if (err != cudaSuccess) return err;
  }
  a.phase = 0;
  return launch();
}

}  // namespace gemmfuse
