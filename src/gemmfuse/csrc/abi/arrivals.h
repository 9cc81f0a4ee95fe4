// The last-block pattern's arrival count: blocks leave partial results in global memory and the
// last of a set to arrive combines them (gemv_epilogue.cuh's column windows and rows,
// tile_epilogue.cuh's row reductions, the Hopper kernel's K slices).
#pragma once

namespace gemmfuse {

// Counts a block in and returns the count before it. One thread calls it after a barrier of the
// threads whose global writes the arrival covers, and a barrier follows before any thread of the
// last block reads what the others wrote: the count's acq_rel semantics at GPU scope release
// this block's writes and acquire every earlier block's, the barriers carry that to the block's
// other threads (CUTLASS's GenericBarrier pattern, as tile_walk.h's tile arrivals). A
// __threadfence() in every thread before the count, and in the last block after it, cost about
// 1,500 SM cycles each on the few-rows kernel's critical path (H200, clock64, session 47).
__device__ __forceinline__ int arrive_counted(int* counter) {
  int before;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n"
               : "=r"(before)
               : "l"(counter)
               : "memory");
  return before;
}

}  // namespace gemmfuse
