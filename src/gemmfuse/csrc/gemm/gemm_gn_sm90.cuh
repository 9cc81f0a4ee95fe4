// The fused kernel of the Hopper path (sm_90a): the same split-fp16 scheme as
// gemm_gn_sm80.cuh, on wgmma fed by TMA. Two one-pass variants share it: precision="tf32"
// (hi*hi alone, only the hi operands loaded) and bf16 models (their own bf16 operands).
//
// Two consumer warpgroups (threads 0-255) do the math, 64 rows each; one thread of the producer
// warpgroup after them streams the operand tiles of each 64-wide k-tile (128-byte swizzled)
// into a shared-memory ring with cp.async.bulk.tensor, completing on a "full" mbarrier per
// stage; the consumers free a stage through its "empty" mbarrier. setmaxnreg moves registers
// from the producer to the consumers. A block walks output tiles in TileWalk's order (bands of
// row tiles, row tiles fastest within a band, so the blocks running at once share their x and W
// panels in L2); a staged epilogue's fp32 tile reuses the ring, so the producer starts a
// block's next tile once that epilogue is done (a direct store holds no ring: direct_store).
// - Split (fp32-accurate): 128x128 tiles, one per block (a persistent grid where the chain is
//   pointwise: direct_store); with split K (few rows: at most half as many tiles as SMs) a
//   block per slice of a tile's k-tiles instead, the tile's last block adding the slices up
//   (fold_slices); a stage holds
//   x hi, x lo, W hi, W lo
//   (16 KB each), 3 stages. Per k-tile each consumer issues 12 wgmma.m64n128k16 (hi*lo, lo*hi,
//   hi*hi for each 16-wide k step) into a tensor-core accumulator that the first of them
//   overwrites, waits, frees the stage and promotes the k-tile's result into an fp32 register
//   sum with round-to-nearest adds: the promotion bounds the tensor cores' truncating
//   accumulation to 64 products; while one warpgroup promotes, the other's wgmmas keep the
//   tensor cores busy.
// - One pass: 128x256 tiles on a persistent grid (one block per SM walking the tiles); a stage
//   holds x (16 KB) and W (32 KB), 4 stages; 4 wgmma.m64n256k16 per k-tile accumulate across all
//   of K. The wider tile reads 48 KB from L2 per 4 MFLOP where a 128x128 one read 32 KB per 2.
// Measured on #62 (docs/DESIGN.md section 4): one-pass bf16 237 us against 262 us for
// one-pass 128x128 tiles, one block per tile; the split variant with a staged epilogue is 3-8%
// slower persistent, so it keeps a block per tile.
// The staged epilogue is tile_epilogue.cuh's, run by the 256 consumer threads on 128x128
// halves, with the fp32-accurate statistics in the split variant and plain ones in the one-pass
// variants; a direct store (split variant, pointwise chain) is store_direct's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>

#include "device_cache.h"
#include "fused_args.h"
#include "smem_limit.h"
#include "tile_walk.h"
#include "tile_epilogue.cuh"

namespace gemmfuse {
namespace sm90 {

constexpr int kBlockK = 64;                           // one 128-byte swizzle row of fp16
constexpr int kOperandBytes = kTile * kBlockK * 2;    // 16 KB: 128 rows of a k-tile
constexpr int kConsumers = 2;                         // math warpgroups, 64 rows each
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr int kThreads = kConsumerThreads + 128;      // + the producer warpgroup
constexpr int kStagingBytes = kTile * kEpiStride * 4;  // the epilogue's fp32 128x128 tile

// Per variant (see the top of the file): tile width, ring depth and grid. kDirect: the split
// variant storing from registers (direct_store), on a persistent grid.
template <bool kSplit, bool kDirect = false>
struct Variant {
  static constexpr int kBlockN = kSplit ? 128 : 256;  // output columns per tile
  static constexpr int kAccRegs = kBlockN / 2;        // fp32 accumulators per consumer thread
  static constexpr int kStageBytes = (kSplit ? 4 : 1 + kBlockN / kTile) * kOperandBytes;
  static constexpr int kStages = kSplit ? 3 : 4;
  static constexpr bool kPersistent = !kSplit || kDirect;  // else one block per tile
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + 1 KB for alignment
  static_assert(kStagingBytes <= kStages * kStageBytes, "the epilogue tile fits the ring");
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int k, int row,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(smem_u32(bar))
      : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row core groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulator registers so the compiler cannot move their reads across a wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D(64xN, fp32) (+)= A(64x16) * B(16xN), both from shared memory, K-major, 128-byte swizzle,
// with TYPE ("f16" or "bf16") operands. scale_d == 0 overwrites D instead of accumulating.
#define GEMMFUSE_DEFINE_WGMMA_M64N128K16(NAME, TYPE)                                        \
  __device__ __forceinline__ void NAME(float (&d)[64], uint64_t desc_a, uint64_t desc_b, \
                                       int scale_d) { \
    asm volatile( \
      "{\n" \
      ".reg .pred p;\n" \
      "setp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, " \
      "%8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, " \
      "%24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, " \
      "%40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, " \
      "%56, %57, %58, %59, %60, %61, %62, %63" \
      "}, %64, %65, p, 1, 1, 0, 0;\n" \
      "}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)); \
  }
GEMMFUSE_DEFINE_WGMMA_M64N128K16(wgmma_m64n128k16_f16, "f16")
#undef GEMMFUSE_DEFINE_WGMMA_M64N128K16
#define GEMMFUSE_DEFINE_WGMMA_M64N256K16(NAME, TYPE)                                        \
  __device__ __forceinline__ void NAME(float (&d)[128], uint64_t desc_a, uint64_t desc_b, \
                                       int scale_d) { \
    asm volatile( \
      "{\n" \
      ".reg .pred p;\n" \
      "setp.ne.b32 p, %130, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, " \
      "%8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, " \
      "%24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, " \
      "%40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, " \
      "%56, %57, %58, %59, %60, %61, %62, %63, " \
      "%64, %65, %66, %67, %68, %69, %70, %71, " \
      "%72, %73, %74, %75, %76, %77, %78, %79, " \
      "%80, %81, %82, %83, %84, %85, %86, %87, " \
      "%88, %89, %90, %91, %92, %93, %94, %95, " \
      "%96, %97, %98, %99, %100, %101, %102, %103, " \
      "%104, %105, %106, %107, %108, %109, %110, %111, " \
      "%112, %113, %114, %115, %116, %117, %118, %119, " \
      "%120, %121, %122, %123, %124, %125, %126, %127" \
      "}, %128, %129, p, 1, 1, 0, 0;\n" \
      "}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), \
        "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), \
        "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), \
        "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), \
        "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
        "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)); \
  }
GEMMFUSE_DEFINE_WGMMA_M64N256K16(wgmma_m64n256k16_f16, "f16")
GEMMFUSE_DEFINE_WGMMA_M64N256K16(wgmma_m64n256k16_bf16, "bf16")
#undef GEMMFUSE_DEFINE_WGMMA_M64N256K16

template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  if constexpr (kBf16)
    wgmma_m64n256k16_bf16(d, desc_a, desc_b, scale_d);
  else
    wgmma_m64n256k16_f16(d, desc_a, desc_b, scale_d);
}

// The tiles' order: TileWalk (tile_walk.h).

// Whether a variant stores from registers: the split one on a chain of pointwise ops alone (no
// norm, no reduction: nothing reads across the tile). Its tiles are then walked by a persistent
// grid, the producer loading a block's next tile while its consumers store this one: staged in
// the ring, the epilogue held the next tile's loads (the backward's dW product, whose K is the
// batch, 16 k-tiles at KernelBench's #62, spent about a fifth of its time between tiles).
template <class Epi, bool kSplit>
__host__ __device__ constexpr bool direct_store() {
  return kSplit && !Epi::kNorm && Epi::kReduce == 0;
}

// Where a consumer thread's m64n128 wgmma fragment sits in the 128x128 tile: its value
// acc[fragment_index(j, half, e)] is at row fragment_row(...half) and column fragment_col(j, ...e)
// (j: the 8-column group, half: rows lane / 4 and lane / 4 + 8, e: the column pair's element).
__device__ __forceinline__ int fragment_row(int consumer, int warp, int lane, int half) {
  return consumer * 64 + warp * 16 + lane / 4 + half * 8;
}
__device__ __forceinline__ int fragment_col(int j, int lane, int e) {
  return j * 8 + 2 * (lane % 4) + e;
}
__device__ __forceinline__ int fragment_index(int j, int half, int e) { return 4 * j + 2 * half + e; }

// A tile's outputs stored from a consumer's wgmma fragment, each the staging path's value
// (gemm_value, then `pre`): pairs of columns as one 8-byte store where the rows allow it.
template <class Epi>
__device__ __forceinline__ void store_direct(const float (&acc)[64], const float* col_scale,
                                             const float* col_bias, int tile_m, int tile_n,
                                             int consumer, int warp, int lane,
                                             const FusedArgs& args) {
  const bool pairs = args.N % 2 == 0 && reinterpret_cast<uintptr_t>(args.out) % 8 == 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int grow = tile_m + fragment_row(consumer, warp, lane, half);
    if (grow >= args.M) continue;
    const float a_inv = args.a_inv_scale ? __ldg(args.a_inv_scale + grow) : 1.f;
    float* out_row = args.out + static_cast<int64_t>(grow) * args.N;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = fragment_col(j, lane, 0), gcol = tile_n + c;
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const ColumnTerms col{col_scale[c + e], col_bias[c + e]};
        v[e] = saved_epilogue_input<Epi>(acc[fragment_index(j, half, e)], a_inv, col, grow,
                                         gcol + e, args);
      }
      if (pairs && gcol + 1 < args.N) {
        *reinterpret_cast<float2*>(out_row + gcol) = make_float2(v[0], v[1]);
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (gcol + e < args.N) out_row[gcol + e] = v[e];
      }
    }
  }
}

// The k-tiles [x, y) of slice s when k_tiles are cut into k_splits slices (split K: FusedArgs).
__device__ __forceinline__ int2 k_slice(int s, int k_tiles, int k_splits) {
  return make_int2(static_cast<int>(int64_t{s} * k_tiles / k_splits),
                   static_cast<int>((int64_t{s} + 1) * k_tiles / k_splits));
}

// Split K: stores this (tile, slice) unit's promoted sums to its place in args.k_partial and
// counts it in; true in the tile's last block to arrive, whose acc is then every slice's sum,
// added in slice order from what the blocks stored (the same bits whichever block is last).
// The fence-then-count and count-then-fence pairs are the CUDA guide's last-block pattern.
template <class Sync>
__device__ __forceinline__ bool fold_slices(float (&acc)[64], int unit, int k_splits,
                                            const FusedArgs& args, Sync consumers_sync) {
  __shared__ int s_last;
  constexpr int kQuads = 64 / 4;  // float4s per consumer thread
  const int tile = unit / k_splits, tid = threadIdx.x;
  float4* partial = reinterpret_cast<float4*>(args.k_partial);
  float4* mine = partial + static_cast<int64_t>(unit) * kQuads * kConsumerThreads;
#pragma unroll
  for (int q = 0; q < kQuads; ++q)
    __stcg(mine + q * kConsumerThreads + tid,
           make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
  __threadfence();
  consumers_sync();
  if (tid == 0) {
    s_last = atomicAdd(args.k_counter + tile, 1) == k_splits - 1;
    if (s_last) args.k_counter[tile] = 0;  // every slice has arrived: zero for the next launch
  }
  consumers_sync();
  if (!s_last) return false;
  __threadfence();
  const float4* slices = partial + static_cast<int64_t>(tile) * k_splits * kQuads * kConsumerThreads;
#pragma unroll
  for (int q = 0; q < kQuads; ++q) {
    float4 sum = __ldcg(slices + q * kConsumerThreads + tid);
    for (int s = 1; s < k_splits; ++s) {
      const float4 v = __ldcg(slices + (s * kQuads + q) * kConsumerThreads + tid);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    acc[4 * q] = sum.x;
    acc[4 * q + 1] = sum.y;
    acc[4 * q + 2] = sum.z;
    acc[4 * q + 3] = sum.w;
  }
  return true;
}

// kSplit: hi*lo + lo*hi + hi*hi with promotion after every k-tile (fp32-accurate), or one
// product per k-step accumulated across all of K in the tensor cores (precision="tf32" on the
// fp16 hi parts, or a bf16 model's own operands when kBf16). Compile-time choices: a run-time
// branch between wgmmas makes ptxas fence (and serialise) them.
template <class Epi, bool kSplit, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1)
    fused_gemm_gn_sm90_kernel(const __grid_constant__ CUtensorMap tm_a_hi,
                              const __grid_constant__ CUtensorMap tm_a_lo,
                              const __grid_constant__ CUtensorMap tm_b_hi,
                              const __grid_constant__ CUtensorMap tm_b_lo, const FusedArgs args,
                              const TileWalk walk) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kDirect = direct_store<Epi, kSplit>();
  using V = Variant<kSplit, kDirect>;
  constexpr int kStageBytes = V::kStageBytes, kStages = V::kStages;
  extern __shared__ unsigned char smem_raw[];
  // Aligned to 1 KB by pointer arithmetic on the shared array (not through an integer), so the
  // compiler still knows it is shared memory: the epilogue's accesses compile to LDS/STS.
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  __shared__ __align__(8) uint64_t epilogue_done;

  const int tid_wg = threadIdx.x % 128;
  const int k_tiles = args.k_padded / kBlockK;
  // A block's work comes in units: a tile, or with split K (the split variant) a tile's slice
  // of k-tiles, units k_splits * tile + slice.
  const int k_splits = kSplit && args.k_splits > 1 ? args.k_splits : 1;
  const int units = walk.tiles * k_splits;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], kConsumers);
    }
    mbar_init(&epilogue_done, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // A chain kernel that follows the tiles may be scheduled now (programmatic dependent launch):
  // its blocks take the SMs this grid leaves (tile_walk.h). Without such a launch, no effect.
  if (args.tile_flags != nullptr) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  __syncthreads();

  if (threadIdx.x >= kConsumerThreads) {
    // Registers move from the producer to the consumers. ptxas compiles a kernel that uses
    // setmaxnreg to its launch bound's maximum, 168 a thread, and a block must stay within
    // what it was launched with: 128 * 40 + 256 * 232 <= 384 * 168.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == kConsumerThreads) {
      int it = 0;  // k-tiles loaded so far, across tiles: picks the stage and its phase
      int done = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x, ++done) {
        const int2 tile = walk.coords(u / k_splits);
        const int tile_m = tile.x * kTile, tile_n = tile.y * V::kBlockN;
        const int2 ks = k_slice(u % k_splits, k_tiles, k_splits);
        // the ring is free again (a direct store never holds it)
        if (!kDirect && done > 0) mbar_wait(&epilogue_done, (done - 1) & 1);
        for (int kt = ks.x; kt < ks.y; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);  // first round passes at once
          mbar_expect_tx(&full_bar[s], kStageBytes);
          unsigned char* st = smem + s * kStageBytes;
          const int k0 = kt * kBlockK;
          tma_load_2d(st, &tm_a_hi, k0, tile_m, &full_bar[s]);
          if constexpr (kSplit) {
            tma_load_2d(st + kOperandBytes, &tm_a_lo, k0, tile_m, &full_bar[s]);
            tma_load_2d(st + 2 * kOperandBytes, &tm_b_hi, k0, tile_n, &full_bar[s]);
            tma_load_2d(st + 3 * kOperandBytes, &tm_b_lo, k0, tile_n, &full_bar[s]);
          } else {
            // The W tile in 128-row boxes, one after the other: 256 K-major rows.
#pragma unroll
            for (int h = 0; h < V::kBlockN / kTile; ++h)
              tma_load_2d(st + (1 + h) * kOperandBytes, &tm_b_hi, k0, tile_n + h * kTile,
                          &full_bar[s]);
          }
        }
      }
    }
    return;
  }
  {  // the consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int consumer = threadIdx.x / 128;  // owns tile rows [64 * consumer, 64 * consumer + 64)
    auto consumers_sync = [] { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads)); };
    auto release = [&](int s) {
      if (tid_wg == 0) mbar_arrive(&empty_bar[s]);
    };
    float* staging = reinterpret_cast<float*>(smem);  // the ring, once a tile's GEMM is done
    const int warp = tid_wg / 32, lane = tid_wg % 32;
    const int n_tiles = (args.N + kTile - 1) / kTile;  // 128-column tiles, the epilogue's unit
    static_assert(V::kBlockN <= kConsumerThreads, "a column per consumer thread");
    // Two buffers where the store is direct: a warpgroup may load the next tile's terms while
    // the other still reads this tile's (each tile's epilogue starts with a barrier of both).
    constexpr int kColBuffers = kDirect ? 2 : 1;
    __shared__ float s_col_scale_buf[kColBuffers][V::kBlockN], s_col_bias_buf[kColBuffers][V::kBlockN];

    int it = 0;
    for (int u = blockIdx.x, done = 0; u < units; u += gridDim.x, ++done) {
      const int2 tile = walk.coords(u / k_splits);
      const int m_idx = tile.x, tile_m = m_idx * kTile, tile_n = tile.y * V::kBlockN;
      float* s_col_scale = s_col_scale_buf[done % kColBuffers];
      float* s_col_bias = s_col_bias_buf[done % kColBuffers];
      float acc[V::kAccRegs];
#pragma unroll
      for (int i = 0; i < V::kAccRegs; ++i) acc[i] = 0.f;
      // The tile's column terms, a column per consumer thread, loaded while the GEMM runs (a
      // staged epilogue is done reading the last tile's, and a direct store reads the other
      // buffer; the epilogue's first barrier publishes them).
      if (threadIdx.x < V::kBlockN) {
        const ColumnTerms col = column_terms(min(tile_n + static_cast<int>(threadIdx.x), args.N - 1), args);
        s_col_scale[threadIdx.x] = col.inv_scale;
        s_col_bias[threadIdx.x] = col.bias;
      }

      if constexpr (kSplit) {
        float tc[V::kAccRegs];
        const int2 ks = k_slice(u % k_splits, k_tiles, k_splits);
        for (int kt = ks.x; kt < ks.y; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&full_bar[s], (it / kStages) & 1);
          const uint32_t st = smem_u32(smem + s * kStageBytes);
          // x hi, x lo, W hi, W lo; this warpgroup's 64 rows of 128 bytes in the x tiles.
          const uint32_t a_hi = st + consumer * 64 * 128, a_lo = a_hi + kOperandBytes;
          const uint32_t b_hi = st + 2 * kOperandBytes, b_lo = b_hi + kOperandBytes;
          fence_operands(tc);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockK / 16; ++kk) {
            const uint32_t off = kk * 32;  // 16 fp16 along K within the swizzled row
            wgmma_m64n128k16_f16(tc, smem_desc(a_hi + off), smem_desc(b_lo + off), kk > 0);
            wgmma_m64n128k16_f16(tc, smem_desc(a_lo + off), smem_desc(b_hi + off), 1);
            wgmma_m64n128k16_f16(tc, smem_desc(a_hi + off), smem_desc(b_hi + off), 1);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_operands(tc);
          release(s);
#pragma unroll
          for (int i = 0; i < V::kAccRegs; ++i) acc[i] += tc[i];
        }
        if (k_splits > 1 && !fold_slices(acc, u, k_splits, args, consumers_sync)) {
          // another slice's block runs this tile's epilogue; the ring is free for the next unit
          if (!kDirect && threadIdx.x == 0) mbar_arrive(&epilogue_done);
          continue;
        }
      } else {
        // One wgmma group in flight: a stage is freed once the group after it has been issued.
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&full_bar[s], (it / kStages) & 1);
          const uint32_t st = smem_u32(smem + s * kStageBytes);
          const uint32_t a = st + consumer * 64 * 128, b = st + kOperandBytes;  // x, W (256 rows)
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockK / 16; ++kk) {
            const uint32_t off = kk * 32;
            wgmma_m64n256k16<kBf16>(acc, smem_desc(a + off), smem_desc(b + off), kt > 0 || kk > 0);
          }
          wgmma_commit();
          wgmma_wait<1>();
          if (kt > 0) release((it - 1) % kStages);
        }
        wgmma_wait<0>();
        fence_operands(acc);
        if (k_tiles > 0) release((it - 1) % kStages);
      }

      if constexpr (kDirect) {
        consumers_sync();  // the tile's column terms are published
        store_direct<Epi>(acc, s_col_scale, s_col_bias, tile_m, tile_n, consumer, warp, lane, args);
        static_assert(kTileArrivals == kConsumers && V::kBlockN == kTile,
                      "a follower counts a tile's warpgroups over 128-column tiles");
        if (args.tile_flags != nullptr) {  // a chain kernel follows the tiles (tile_walk.h)
          asm volatile("bar.sync %0, 128;\n" ::"r"(2 + consumer) : "memory");  // this warpgroup's stores
          if (tid_wg == 0) tile_arrive(args.tile_flags + u / k_splits);
        }
      } else {
        // The epilogue, on each 128-column half of the tile in turn: the accumulators go to the
        // staging tile as epilogue inputs (unscaled, biased, `pre`), then tile_epilogue.
#pragma unroll
        for (int h = 0; h < V::kBlockN / kTile; ++h) {
          const int n0 = tile_n + h * kTile;
          if (n0 >= args.N) break;  // uniform across the consumers
          consumers_sync();  // every wgmma has read the ring; the last epilogue is done with it
          float a_inv[2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = fragment_row(consumer, warp, lane, half);
            a_inv[half] = args.a_inv_scale ? __ldg(args.a_inv_scale + min(tile_m + r, args.M - 1)) : 1.f;
          }
#pragma unroll
          for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = fragment_col(j, lane, e);
              const ColumnTerms col{s_col_scale[h * kTile + c], s_col_bias[h * kTile + c]};
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int r = fragment_row(consumer, warp, lane, half);
                staging[r * kEpiStride + c] = saved_epilogue_input<Epi>(
                    acc[fragment_index(h * 16 + j, half, e)], a_inv[half], col, tile_m + r, n0 + c, args);
              }
            }
          }
          consumers_sync();
          const TileCoord coord{tile_m, n0, m_idx, n0 / kTile, n_tiles};
          tile_epilogue<Epi, kConsumerThreads, kSplit>(staging, args, coord, threadIdx.x,
                                                       consumers_sync);
        }
        consumers_sync();  // every consumer is done with the ring
        if (threadIdx.x == 0) mbar_arrive(&epilogue_done);
      }
    }
  }
#endif
}

// A 2-D tensor map over a row-major 16-bit [rows, k_cols] matrix (row stride in elements), in
// kTile x kBlockK boxes; reads past k_cols or rows return zeros.
inline cudaError_t encode_operand(CUtensorMap* map, const void* base, int rows, int k_cols,
                                  int64_t row_stride, bool bf16) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorSymbolNotFound;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k_cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};
  const cuuint32_t box[2] = {kBlockK, kTile};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = encode(
      map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <class Epi, bool kSplit, bool kBf16>
cudaError_t launch_kernel(const CUtensorMap (&maps)[4], const FusedArgs& args,
                          cudaStream_t stream) {
  using V = Variant<kSplit, direct_store<Epi, kSplit>()>;
  auto kernel = fused_gemm_gn_sm90_kernel<Epi, kSplit, kBf16>;
  cudaError_t err = raise_smem_once(reinterpret_cast<const void*>(kernel), V::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int m_tiles = (args.M + kTile - 1) / kTile;
  const int n_tiles = (args.N + V::kBlockN - 1) / V::kBlockN;
  const int k_splits = std::max(args.k_splits, 1);
  if (int64_t{m_tiles} * n_tiles * k_splits >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const TileWalk walk = TileWalk::of(args.M, args.N, kTile, V::kBlockN);
  int blocks = walk.tiles * k_splits;  // work units (the kernel's)
  if constexpr (V::kPersistent) {
    // As many blocks as can be resident at once (per device, found once): each walks every
    // grid-th tile.
    static DeviceCache residents;
    int resident = 0;
    err = resident_grid(residents, kernel, kThreads, V::kSmemBytes, resident);
    if (err != cudaSuccess) return err;
    blocks = std::min(blocks, resident);
  }
  kernel<<<blocks, kThreads, V::kSmemBytes, stream>>>(maps[0], maps[1], maps[2], maps[3], args, walk);
  return cudaGetLastError();
}

// Launches one variant (each a part of its own: chain_sm90_*.cu): its operand maps, then the
// kernel; args.split and args.bf16 must name the same variant.
template <class Epi, bool kSplit, bool kBf16>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  static_assert(!kSplit || Epi::kModelDtype == kFloat32Model, "the split variant: float32 models");
  static_assert(!kBf16 || Epi::kModelDtype == kBf16Model, "the bf16 variant: bf16 models");
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (args.k_padded % kBlockK != 0 || (args.bf16 != 0) != kBf16 || (args.split != 0) != kSplit ||
      !serves_model<Epi>(args.params))
    return cudaErrorInvalidValue;
  // split K: the split variant, at most a slice per k-tile, with its partials and counters
  // tile counts (tile_walk.h): made by the direct stores alone
  if (args.tile_flags != nullptr && !direct_store<Epi, kSplit>()) return cudaErrorInvalidValue;
  if (args.k_splits > 1 && (!kSplit || args.k_splits > args.k_padded / kBlockK ||
                            args.k_splits > kMaxKSplits || args.k_partial == nullptr ||
                            args.k_counter == nullptr))
    return cudaErrorInvalidValue;
  CUtensorMap maps[4];
  const struct {
    const void* base;
    int rows;
    int64_t stride;
  } operands[4] = {{args.a_hi, args.M, args.a_row_stride},
                   {kSplit ? args.a_lo : args.a_hi, args.M, args.a_row_stride},
                   {args.b_hi, args.N, args.b_row_stride},
                   {kSplit ? args.b_lo : args.b_hi, args.N, args.b_row_stride}};
  for (int i = 0; i < 4; ++i) {
    const cudaError_t err = encode_operand(&maps[i], operands[i].base, operands[i].rows,
                                           args.k_cols, operands[i].stride, kBf16);
    if (err != cudaSuccess) return err;
  }
  return launch_kernel<Epi, kSplit, kBf16>(maps, args, stream);
}

}  // namespace sm90
}  // namespace gemmfuse
