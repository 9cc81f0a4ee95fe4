// The package builds each part of a chain's library (csrc/chain/chain_*.cu) as a shared library
// of its own, only when a call first needs it (gemmfuse/jit.py), so that a chain's first call
// compiles the two or three parts it runs rather than all ten. The table's library (chain_table.cu)
// then reaches the parts' entry points through PartEntries: each part's library publishes its own
// (gemmfuse_part_entries), and an entry still empty when called asks the package to build and load
// its part first (gemmfuse_chain_set_loader's callback) rather than failing.
// Only with GEMMFUSE_PARTS_APART; a standalone export links every part into one library and calls
// them directly.
#pragma once
#include <atomic>

#include "chain_table.h"

namespace gemmfuse {

struct PartEntries {
  std::atomic<cudaError_t (*)(const FusedArgs&, cudaStream_t)> sm90_split{}, sm90_one_pass{},
      sm90_fp16{}, sm90_bf16{}, sm80{}, finalize{}, finalize_16bit{}, tile_epilogue{},
      tile_epilogue_16bit{};
  std::atomic<int (*)(const FusedArgs&)> follows_tiles{};
  std::atomic<cudaError_t (*)(const FusedArgs&, const GemvArgs&, cudaStream_t)> gemv{};
  std::atomic<int (*)(int, int)> gemv_slice{};
  std::atomic<BackwardPlan (*)(int, int, int, int)> backward_plan{};
  std::atomic<cudaError_t (*)(const BackwardArgs&, const BackwardPlan&, cudaStream_t)> backward{};
};

// A part's entry point, made visible to the table's library once it is callable.
template <class Fn>
void publish(std::atomic<Fn>& entry, Fn fn) {
  entry.store(fn, std::memory_order_release);
}

}  // namespace gemmfuse
