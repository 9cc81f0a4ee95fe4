// The last-block pattern (the CUDA guide's threadFenceReduction): blocks leave partial results in
// global memory, count themselves in, and the last of a set to arrive combines them. Used by
// tile_epilogue.cuh's row reductions, group_tiles.cuh's row bands and gemv_epilogue.cuh's
// column windows and rows (the Hopper kernel's K slices, gemm_gn_sm90.cuh's fold_slices, reset
// the count within the same step and keep their own).
#pragma once

namespace gemmfuse {

// Whether this block is the last of `arrivals` to reach `counter`, every block's global writes
// before its arrival then visible to all its threads. Every thread that wrote calls it: `sync`
// is their barrier (the block's __syncthreads, or a named barrier of some of its warps), and
// `tid` 0 (theirs) counts the block in.
template <class Sync>
__device__ __forceinline__ bool last_to_arrive(int* counter, int arrivals, int tid, Sync sync) {
  __shared__ bool last;
  __threadfence();
  sync();
  if (tid == 0) last = atomicAdd(counter, 1) == arrivals - 1;
  sync();
  if (!last) return false;
  __threadfence();
  return true;
}

// The same, every thread of the block writing: the block's __syncthreads is the barrier.
__device__ __forceinline__ bool last_to_arrive(int* counter, int arrivals, int tid) {
  return last_to_arrive(counter, arrivals, tid, [] { __syncthreads(); });
}

}  // namespace gemmfuse
