// Raising a kernel's dynamic shared-memory limit once per (device, kernel): the launches of the
// chain library's kernels that stage more than the default 48 KB call it before each launch.
#pragma once
#include <mutex>
#include <set>
#include <utility>

#include <cuda_runtime.h>

namespace gemmfuse {

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once: the
// call costs microseconds of host time and every forward waits on it (torch.profiler listed 26
// us against it in each bf16 #75 forward, H200, 2026-11-26, when the chain kernel called it
// before every launch; not timed on its own). Keyed by the kernel's address, not
// a template static: every chain's library instantiates the kernels with a struct of the same
// name (GeneratedEpilogueFor<...>), and such a static was once one object for the whole process
// (chain_backward_plan.cuh's resident_blocks says how that failed). The part libraries now keep
// their statics to themselves (-fno-gnu-unique, and -fvisibility=hidden since 2bef679, which
// tests/gpu/test_parts.py checks; DeviceCache's per-kernel statics rely on it); the address key
// holds however a library is built.
inline cudaError_t raise_smem_once(const void* kernel, int bytes) {
  int device = 0;
  const cudaError_t got = cudaGetDevice(&device);
  if (got != cudaSuccess) return got;
  static std::mutex lock;
  static std::set<std::pair<int, const void*>> raised;
  std::lock_guard<std::mutex> guard(lock);
  if (raised.count({device, kernel})) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) raised.insert({device, kernel});
  return err;
}

}  // namespace gemmfuse
