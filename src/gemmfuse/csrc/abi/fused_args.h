// Arguments and constants shared by the host binding (binding.cpp, a plain C++ translation unit)
// and the kernels (the chain_*.cu parts of a chain's library).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace gemmfuse {

constexpr int kMaxParams = 8;
constexpr int kTile = 128;       // output tile side of every fused kernel
// Rows of a 16-bit model's tile on the epilogue path (norm_finalize.cuh's tile_epilogue_kernel
// says why half of kTile). Reducing chains take a row counter per band of this many rows.
constexpr int kEpilogueRows16 = 64;
constexpr int kGemvMaxRows = 2;  // the few-rows kernel (gemv_epilogue.cuh) takes 1 to this
constexpr int kMaxKSplits = 1024;  // FusedArgs::k_splits' bound (dispatch picks at most the SMs)
// FusedArgs::tile_flags: a count per output tile, then a ticket and an exit count (tile_walk.h).
constexpr int kTileFollowExtra = 2;
// The fused kernels' launch codes, decided by gemmfuse/dispatch.py's fused_kernel_code.
constexpr int kPortableKernel = 1;  // gemm_gn_sm80.cuh
constexpr int kHopperKernel = 2;    // gemm_gn_sm90.cuh

// The dtype a model computes in: float32 (the split GEMM), or one of the 16-bit dtypes whose
// models run one tensor-core product on their own operands and round where eager rounds.
enum ModelDtype : int { kFloat32Model = 0, kBf16Model = 1, kFp16Model = 2 };
// A kernel instance that serves either 16-bit ModelDtype, the one params.model16 names at run
// time (see round_like_model; float32 calls take float32 instances).
constexpr int kAnyModel = -1;

// Run-time arguments of the epilogue ops: floats (a LeakyReLU slope, a multiplier) and fp32
// tensors read at (row, col) as vec[i][row * vec_row_stride[i] + col]: per channel (row stride
// 0, an [N] vector) or per element (an [M, N] operand computed elsewhere, a residual). The
// generated epilogue reads them by position, so one compiled kernel serves every value and
// either kind of a chain's tensor arguments.
struct EpilogueParams {
  const float* vec[kMaxParams];
  int64_t vec_row_stride[kMaxParams];
  float scalar[kMaxParams];
  // A 16-bit model (ModelDtype: kBf16Model or kFp16Model; kFloat32Model otherwise): round to its
  // dtype wherever PyTorch's ops in that dtype would (after the Linear, the GroupNorm and each
  // pointwise op), so the result matches the eager model's, not just fp32 math.
  int model16;
  // A bf16 model's GroupNorm statistics on the epilogue path (tile_epilogue.cuh's
  // eager_group_stats): 0 the package's own; 1 as eager bf16 computes them (PyTorch's Welford
  // order, float); 2 the same, mean and rstd then rounded to bf16 (torch versions whose bf16
  // GroupNorm normalises with the bf16 statistics it returns). dispatch.py finds which.
  int group_stats;
};

// Whether a kernel instance (Epi: a GeneratedEpilogueFor) serves the dtype a call's params name:
// every launch checks, so a call never runs an instance that would round as another dtype does.
template <class Epi>
inline bool serves_model(const EpilogueParams& p) {
  return Epi::kModelDtype == kAnyModel ? p.model16 != kFloat32Model
                                       : Epi::kModelDtype == p.model16;
}

#ifdef __CUDACC__
// The model dtype a kernel instance serves, fixed at compile time where its variant serves one
// (the split kernel float32 models, the bf16 kernel bf16 ones: GeneratedEpilogueFor<kModel>),
// or kAnyModel: the 16-bit one params.model16 names at run time. Fixed, the roundings below
// are one select (float32) or one conversion. Decided at run time among the three dtypes at
// every rounding point (70eb585 to ce59cbb), they cost the float32 split kernel 30% at
// KernelBench's #81 (806-808 us against 612-619 with 8442a71's bf16-only rounding) and 40% at
// #37 (3.78 against 2.68-2.69 ms; H100, torch.profiler, one machine, 2026-11-26): conversions
// and selects issued, predicated off, for every value.

template <int kModel>
__device__ __forceinline__ int model_dtype(int model16) {
  return kModel == kAnyModel ? model16 : kModel;
}

// A float to the 16-bit dtype of the model (kBf16Model or kFp16Model), as its bits: both
// conversions, then a select (no branch between the dtypes when model16 is known only at run
// time).
__device__ __forceinline__ uint16_t to_model16(float v, int model16) {
  const uint16_t h = __half_as_ushort(__float2half_rn(v));
  const uint16_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return model16 == kFp16Model ? h : b;
}

__device__ __forceinline__ float from_model16(uint16_t bits, int model16) {
  const float h = __half2float(__ushort_as_half(bits));
  const float b = __bfloat162float(__ushort_as_bfloat16(bits));
  return model16 == kFp16Model ? h : b;
}

// Two floats to two 16-bit values of the model's dtype, packed (the first in the low half).
__device__ __forceinline__ uint32_t pack_model16(float a, float b, int model16) {
  return static_cast<uint32_t>(to_model16(a, model16)) |
         (static_cast<uint32_t>(to_model16(b, model16)) << 16);
}

// v rounded to the model's dtype where it is a 16-bit one (kModel: the kernel instance's, named
// at every call). Every call is a rounding point of eager's: the op's result as PyTorch's own op
// stores it.
template <int kModel>
__device__ __forceinline__ float round_like_model(float v, const EpilogueParams& p) {
  if constexpr (kModel == kFloat32Model) {
    // float32: v itself, but never fused into the next op. A select on the dtype field (always
    // float32 here: the launch checked serves_model) is a barrier the code generator cannot see
    // through. Returned bare, ptxas fused a product into the next op's sum (one FMA where eager
    // rounds the product), and the backward's recomputed values disagreed with PyTorch's at
    // the kinks of a min or hardtanh (tests/gpu/test_chain_backward.py, pool chain 2: twice
    // PyTorch's error; H100, 2026-11-26).
    return p.model16 == kFloat32Model ? v : __int_as_float(0x7fc00000);
  }
  const int model16 = model_dtype<kModel>(p.model16);
  if (model16 == kFloat32Model) return v;
  const float h = __half2float(__float2half_rn(v));
  const float b = __bfloat162float(__float2bfloat16_rn(v));
  return model16 == kFp16Model ? h : b;
}
#endif

struct FusedArgs {
  // fp32 models: x and W split into fp16 hi/lo [rows, k_padded] with per-row inverse scales.
  // 16-bit models (params.model16 != 0, Hopper only): a_hi/b_hi are the model's own x and W
  // (bf16 == 1 for bfloat16 bits, 0 and split == 0 for float16 ones), with k_cols valid columns
  // and the given row strides; no lo parts, no scales (nullptr).
  const __half* a_hi;        // [M, k_padded]
  const __half* a_lo;
  const float* a_inv_scale;  // [M] or nullptr
  const __half* b_hi;        // [N, k_padded]
  const __half* b_lo;
  const float* b_inv_scale;  // [N] or nullptr
  const float* bias;         // [N] or nullptr
  const float* gn_weight;    // [N] or nullptr (GroupNorm without affine)
  const float* gn_bias;      // [N] or nullptr
  float* out;                // [M, N] when the epilogue does not reduce (fp32 models)
  // The epilogue path's input [M, N] (contiguous fp32) when it is not `out` itself; nullptr: the
  // chain is applied to `out` in place. The GEMM kernels leave it nullptr.
  const float* epilogue_in;
  // The same, a 16-bit model's (PyTorch's GEMM in its dtype): bits of params.model16's dtype.
  const uint16_t* epilogue_in16;
  uint16_t* out16;           // [M, N] when it does not reduce (16-bit models), params.model16's

  float* row_partial;        // [N tiles, M] when it reduces ([2, N tiles, M] for sum/mean/lse)
  float* row_out;            // [M] when it reduces
  int* row_counter;          // a counter per kEpilogueRows16 rows (every kernel's row bands
                             // are that or wider), zero on entry, left zero on exit
  int M, N, k_padded, group_size;
  int k_cols;                // valid K columns of the operands; TMA zero-fills up to k_padded
  int64_t a_row_stride, b_row_stride;  // elements
  int split;                 // 1: hi*hi + hi*lo + lo*hi (fp32-accurate); 0: hi*hi alone (fast)
  int bf16;                  // the operands are bfloat16 (a bf16 model; the wgmma's and TMA's type)
  float eps;
  // GroupNorm groups straddle tiles: the GEMM kernel stores pre-norm fp32 values in `out` and
  // per (row, tile, group segment) moments in norm_stats [M, N tiles, stats_per_tile]
  // (mean, mean_lo, centred sum of squares, unused: tile_epilogue.cuh's SegmentMoments);
  // norm_finalize.cuh does the rest. (The epilogue path's one-launch row kernels,
  // row_epilogue_kernel and wide_rows_kernel, keep a row's moments in shared memory instead.)
  int norm_wide;
  int stats_per_tile;
  float4* norm_stats;
  // Under autograd the GEMM kernels also store z = x @ W^T + b [M, N], the chain's input before
  // `pre` (rounded as the model rounds), for the backward: into z_out (fp32 models) or
  // z_out16 (16-bit models, params.model16's dtype); both nullptr otherwise.
  float* z_out;
  uint16_t* z_out16;
  // Split K (the Hopper kernel's split variant at few output tiles, dispatch.fused_k_splits):
  // each tile's k-tiles cut into k_splits (at most kMaxKSplits) slices, a block each. A slice's
  // block stores its promoted sums in k_partial [tiles in walk order, k_splits, kTile * kTile
  // values in the consumer threads' fragment order]; the last of a tile's blocks to arrive
  // (k_counter, a counter per tile, zero on entry, left zero on exit) adds the slices up in slice
  // order and runs the epilogue. 0 or 1: no split.
  int k_splits;
  float* k_partial;
  int* k_counter;
  // A chain run apart whose kernel follows the plain GEMM's tiles (tile_walk.h): the Hopper
  // kernel's direct-store variant counts each stored tile here, and the chain kernel, launched
  // behind it with programmatic dependent launch, normalises each tile once it is counted, on
  // the SMs that the GEMM's last wave leaves idle. [tiles + kTileFollowExtra], zero on entry,
  // left zero on exit; nullptr: no following (the chain kernel runs after the GEMM).
  int* tile_flags;
  EpilogueParams params;
};

// The chain's backward (chain_backward.cuh): from z and the output's gradient to dz and the
// column sums of the other gradients.
struct BackwardArgs {
  const void* z;     // [M, N] contiguous: float32, or 16-bit of model16's dtype
  const void* grad;  // z's dtype: [M, N], or [M] when the chain reduces; strides in elements
  int64_t grad_row_stride, grad_col_stride;
  void* dz;                // [M, N] contiguous, z's dtype
  float* column_partial;   // [row blocks, column_sums, N]: each row block's column sums
  float2* extremes;        // [M, slabs] (min/max over several slabs): each slab's extreme, ties
  const float* gn_weight;  // [N] or nullptr (no affine)
  const float* gn_bias;
  int M, N, group_size;
  int slab;   // columns per slab (set by the launch from the plan)
  int phase;  // 1: only each slab's extreme and ties (min/max over several slabs), 0: the rest
  float eps;
  int model16;  // ModelDtype of z, grad and dz (kFloat32Model: float32)
  EpilogueParams params;
};

// How a chain backward runs (chain_backward_plan.cuh): the columns cut into `slabs`
// (group-aligned), the rows over `row_blocks` (0: it does not fit a block's shared memory;
// kBackwardPartMissing: the chain backward's part could not be built), smem_bytes per block;
// in_registers: the register kernel (narrow groups, 1024-column slabs).
constexpr int kBackwardPartMissing = -1;
struct BackwardPlan {
  int slabs = 0, row_blocks = 0;
  size_t smem_bytes = 0;
  int in_registers = 0;
};

// The epilogue path's operands for a few rows (gemv_epilogue.cuh): x and W themselves, float32.
struct GemvArgs {
  const float* x;  // [M, K], row stride x_stride, rows 16-byte aligned
  const float* w;  // [N, K] contiguous, 16-byte aligned
  int64_t x_stride;
  int K, slice;     // slice: K per block, a multiple of 128 (gemv_slice)
  float2* partial;  // [K slices, M, N]: each slice's compensated sums (value, error)
  int* counter;     // [column windows + 1 (the rows')], zero on entry, left zero on exit
};

}  // namespace gemmfuse
