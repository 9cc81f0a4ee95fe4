// The interface between the host extension (binding.cpp and split.cu: built once per torch
// version, CUDA version and GPU architecture) and a chain's kernels (the chain_*.cu parts: built
// per epilogue structure). chain_table.cu's library exports gemmfuse_chain_table() (the package
// builds each other part as a library of its own, reached through it: part_entries.h); the
// binding launches through the table it returns, after checking that both sides were built from
// one layout.
#pragma once
#include "fused_args.h"

// A chain library's C entry points, found by name (dlsym): of the package's own symbols, the
// only ones its libraries export. The package compiles each part with -fvisibility=hidden
// (jit._PART_FLAGS), so that what every chain's library defines under the same name (the
// GeneratedEpilogueFor<...> instances, their launches' caches) binds within its own library
// whatever else is loaded.
#define GEMMFUSE_EXPORT extern "C" __attribute__((visibility("default")))

namespace gemmfuse {

// Bump when ChainTable or an argument struct changes meaning without changing size.
constexpr int kChainTableVersion = 6;  // 6: tile following (FusedArgs::tile_flags)

struct ChainTable {
  // Checked by the binding (check_table): the layout the library was compiled with.
  int version;
  int table_bytes, fused_args_bytes, backward_args_bytes, gemv_args_bytes;
  int reduce_kind;  // the channel reduction: REDUCTIONS in epilogue.py, 0 none
  int is_plain;     // the epilogue is the identity (a plain GEMM + bias)
  int column_sums;  // the column sums chain_backward writes (epilogue.column_sum_slots)
  // kernel: kPortableKernel (sm_80+) or kHopperKernel (sm_90 only), as the caller decided it
  // (dispatch.fused_kernel_code); anything else is refused. With args.norm_wide, norm_finalize
  // follows.
  cudaError_t (*launch_fused)(const FusedArgs& args, int kernel, cudaStream_t stream);
  // The epilogue path: args.out holds x @ W^T + b (fp32, from PyTorch's GEMM); applies the chain
  // tile by tile (and, with args.norm_wide, row by row), in place or into args.row_out.
  cudaError_t (*launch_epilogue_only)(const FusedArgs& args, cudaStream_t stream);
  // Whether launch_epilogue_only, given these args with tile_flags set, runs the kernel that
  // follows the plain GEMM's tiles (and leaves the flags zero): asked before the GEMM is
  // launched with them. 0: set no tile_flags (the chain kernel runs after the GEMM).
  int (*follows_tiles)(const FusedArgs& args);
  // The epilogue path at M <= kGemvMaxRows: x @ W^T + b and the chain in one launch (two for
  // groups wider than a tile); args.bias is W's bias.
  cudaError_t (*launch_gemv)(const FusedArgs& args, const GemvArgs& gemv, cudaStream_t stream);
  int (*gemv_slice)(int K, int N);  // K per gemv block on the current device
  // How the chain's backward cuts M x N (row_blocks 0: it does not fit; kBackwardPartMissing:
  // its part could not be built) for float32 or
  // (model16 != 0) 16-bit tensors, and its launch (args.model16 must be the plan's kind).
  BackwardPlan (*backward_plan)(int M, int N, int group_size, int model16);
  cudaError_t (*launch_backward)(const BackwardArgs& args, const BackwardPlan& plan,
                                 cudaStream_t stream);
};

}  // namespace gemmfuse
