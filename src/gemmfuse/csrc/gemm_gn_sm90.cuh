// The fused kernel of the Hopper path (sm_90a): the same split-fp16 scheme as
// gemm_gn_sm80.cuh, on wgmma fed by TMA. Two one-pass variants share it: precision="tf32"
// (hi*hi alone, only the hi operands loaded) and bf16 models (their own bf16 operands).
//
// A block computes a 128x128 output tile. Two consumer warpgroups (threads 0-255) do the math;
// one thread of the producer warpgroup after them streams the four operand tiles of each
// 64-wide k-tile (x hi/lo, W hi/lo, 16 KB each, 128-byte swizzled) into a 3-stage
// shared-memory ring with cp.async.bulk.tensor, completing on a "full" mbarrier per stage
// (one-pass modes load two tiles per stage, into 6 stages). The consumers each own 64 rows:
// per k-tile they issue 12 wgmma.m64n128k16 (hi*lo, lo*hi, hi*hi for each 16-wide k step)
// into a tensor-core accumulator that the first of them overwrites, wait for them, free the
// stage through its "empty" mbarrier, and promote the k-tile's result into an fp32 register
// sum with round-to-nearest adds. The promotion bounds the tensor cores' truncating
// accumulation to 64 products; while one warpgroup waits and promotes, the other's wgmmas
// keep the tensor cores busy. setmaxnreg moves registers from the producer to the consumers.
// The epilogue is tile_epilogue.cuh's, run by the 256 consumer threads.
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>

#include "fused_args.h"
#include "tile_epilogue.cuh"

namespace gemmfuse {
namespace sm90 {

constexpr int kBlockK = 64;                           // one 128-byte swizzle row of fp16
constexpr int kOperandBytes = kTile * kBlockK * 2;    // 16 KB
constexpr int kConsumers = 2;                         // math warpgroups, 64 rows each
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr int kThreads = kConsumerThreads + 128;      // + the producer warpgroup

// Per variant: a stage holds x hi, x lo, W hi, W lo (split) or x, W (one pass); the ring is
// reused as the epilogue's fp32 tile once the GEMM is done.
template <bool kSplit>
struct Variant {
  static constexpr int kStageBytes = (kSplit ? 4 : 2) * kOperandBytes;
  static constexpr int kStages = kSplit ? 3 : 6;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align to 1 KB
  static_assert(kTile * kEpiStride * 4 <= kStages * kStageBytes, "epilogue tile fits the ring");
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
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D(64x128, fp32) (+)= A(64x16) * B(16x128), both from shared memory, K-major, 128-byte
// swizzle, with TYPE ("f16" or "bf16") operands. scale_d == 0 overwrites D instead of
// accumulating into it.
#define GEMMFUSE_DEFINE_WGMMA_M64N128K16(NAME, TYPE)                                         \
  __device__ __forceinline__ void NAME(float (&d)[64], uint64_t desc_a, uint64_t desc_b,      \
                                       int scale_d) {                                         \
    asm volatile(                                                                            \
      "{\n"                                                                                  \
      ".reg .pred p;\n"                                                                      \
      "setp.ne.b32 p, %66, 0;\n"                                                             \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                      \
      "%0, %1, %2, %3, %4, %5, %6, %7, " \
      "%8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, " \
      "%24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, " \
      "%40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, " \
      "%56, %57, %58, %59, %60, %61, %62, %63" \
      "}, %64, %65, p, 1, 1, 0, 0;\n"                                                        \
      "}\n"                                                                                  \
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
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                             \
  }
GEMMFUSE_DEFINE_WGMMA_M64N128K16(wgmma_m64n128k16_f16, "f16")
GEMMFUSE_DEFINE_WGMMA_M64N128K16(wgmma_m64n128k16_bf16, "bf16")
#undef GEMMFUSE_DEFINE_WGMMA_M64N128K16

template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  if constexpr (kBf16)
    wgmma_m64n128k16_bf16(d, desc_a, desc_b, scale_d);
  else
    wgmma_m64n128k16_f16(d, desc_a, desc_b, scale_d);
}

// kSplit: issue hi*lo + lo*hi + hi*hi with promotion after every k-tile (fp32-accurate), or one
// product per k-step accumulated across all of K in the tensor cores (precision="tf32" on the
// fp16 hi parts, or a bf16 model's own operands when kBf16). Compile-time choices: a run-time
// branch between wgmmas makes ptxas fence (and serialise) them.
template <class Epi, bool kSplit, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1)
    fused_gemm_gn_sm90_kernel(const __grid_constant__ CUtensorMap tm_a_hi,
                              const __grid_constant__ CUtensorMap tm_a_lo,
                              const __grid_constant__ CUtensorMap tm_b_hi,
                              const __grid_constant__ CUtensorMap tm_b_lo, const FusedArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  constexpr int kStageBytes = Variant<kSplit>::kStageBytes, kStages = Variant<kSplit>::kStages;
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];

  const int tid_wg = threadIdx.x % 128;
  const int tile_m = blockIdx.x * kTile, tile_n = blockIdx.y * kTile;
  const int k_tiles = args.k_padded / kBlockK;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Registers move from the producer to the consumers. ptxas compiles a kernel that uses
  // setmaxnreg to its launch bound's maximum, 168 a thread, and a block must stay within what
  // it was launched with: 128 * 40 + 256 * 232 <= 384 * 168.
  if (threadIdx.x >= kConsumerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == kConsumerThreads) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        mbar_wait(&empty_bar[s], ((kt / kStages) & 1) ^ 1);  // first round passes at once
        mbar_expect_tx(&full_bar[s], kStageBytes);
        unsigned char* st = smem + s * kStageBytes;
        const int k0 = kt * kBlockK;
        tma_load_2d(st, &tm_a_hi, k0, tile_m, &full_bar[s]);
        if constexpr (kSplit) {
          tma_load_2d(st + kOperandBytes, &tm_a_lo, k0, tile_m, &full_bar[s]);
          tma_load_2d(st + 2 * kOperandBytes, &tm_b_hi, k0, tile_n, &full_bar[s]);
          tma_load_2d(st + 3 * kOperandBytes, &tm_b_lo, k0, tile_n, &full_bar[s]);
        } else {
          tma_load_2d(st + kOperandBytes, &tm_b_hi, k0, tile_n, &full_bar[s]);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = threadIdx.x / 128;  // owns tile rows [64 * consumer, 64 * consumer + 64)
  auto operands = [&](int s, uint32_t& a_hi, uint32_t& a_lo, uint32_t& b_hi, uint32_t& b_lo) {
    const uint32_t st = smem_u32(smem + s * kStageBytes);
    // A stage holds x hi, x lo, W hi, W lo (split) or x, W (one pass), 16 KB each.
    a_hi = st + consumer * 64 * 128;  // this warpgroup's 64 rows of 128 bytes
    a_lo = a_hi + kOperandBytes;
    b_hi = st + (kSplit ? 2 : 1) * kOperandBytes;
    b_lo = b_hi + kOperandBytes;
  };
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;

  if constexpr (kSplit) {
    float tc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) tc[i] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      mbar_wait(&full_bar[s], (kt / kStages) & 1);
      uint32_t a_hi, a_lo, b_hi, b_lo;
      operands(s, a_hi, a_lo, b_hi, b_lo);
      fence_operands(tc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint32_t off = kk * 32;  // 16 fp16 along K within the swizzled row
        wgmma_m64n128k16<false>(tc, smem_desc(a_hi + off), smem_desc(b_lo + off), kk > 0);
        wgmma_m64n128k16<false>(tc, smem_desc(a_lo + off), smem_desc(b_hi + off), 1);
        wgmma_m64n128k16<false>(tc, smem_desc(a_hi + off), smem_desc(b_hi + off), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(tc);
      if (tid_wg == 0) mbar_arrive(&empty_bar[s]);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] += tc[i];
    }
  } else {
    // One wgmma group in flight: a stage is freed once the group after it has been issued.
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      mbar_wait(&full_bar[s], (kt / kStages) & 1);
      uint32_t a_hi, a_lo, b_hi, b_lo;
      operands(s, a_hi, a_lo, b_hi, b_lo);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint32_t off = kk * 32;
        wgmma_m64n128k16<kBf16>(acc, smem_desc(a_hi + off), smem_desc(b_hi + off), kt > 0 || kk > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (kt > 0 && tid_wg == 0) mbar_arrive(&empty_bar[(kt - 1) % kStages]);
    }
    wgmma_wait<0>();
    fence_operands(acc);
  }

  auto consumers_sync = [] { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads)); };
  consumers_sync();  // every wgmma has read its operands: the ring becomes the epilogue tile

  float* tile = reinterpret_cast<float*>(smem);
  const int warp = tid_wg / 32, lane = tid_wg % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = consumer * 64 + warp * 16 + lane / 4 + half * 8;
    const float a_inv =
        args.a_inv_scale ? __ldg(args.a_inv_scale + min(tile_m + r, args.M - 1)) : 1.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        tile[r * kEpiStride + j * 8 + 2 * (lane % 4) + e] = acc[4 * j + 2 * half + e] * a_inv;
    }
  }
  consumers_sync();
  // The column scale, bias and `pre` in a second sweep, a thread per column, which loads each
  // column's values once.
  {
    const int c = threadIdx.x % kTile, gcol = min(tile_n + c, args.N - 1);
    for (int r = threadIdx.x / kTile; r < kTile; r += kConsumerThreads / kTile)
      tile[r * kEpiStride + c] = epilogue_input<Epi>(tile[r * kEpiStride + c], 1.f, gcol, args);
  }
  consumers_sync();
  const TileCoord coord{tile_m, tile_n, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                        static_cast<int>(gridDim.y)};
  tile_epilogue<Epi, kConsumerThreads>(tile, args, coord, threadIdx.x, consumers_sync);
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
cudaError_t launch_kernel(const CUtensorMap (&maps)[4], dim3 grid, const FusedArgs& args,
                          cudaStream_t stream) {
  auto kernel = fused_gemm_gn_sm90_kernel<Epi, kSplit, kBf16>;
  constexpr int smem = Variant<kSplit>::kSmemBytes;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, smem, stream>>>(maps[0], maps[1], maps[2], maps[3], args);
  return cudaGetLastError();
}

template <class Epi>
cudaError_t launch(const FusedArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (args.k_padded % kBlockK != 0 || (args.bf16 && args.split)) return cudaErrorInvalidValue;
  CUtensorMap maps[4];
  const bool bf16 = args.bf16 != 0;
  const struct {
    const void* base;
    int rows;
    int64_t stride;
  } operands[4] = {{args.a_hi, args.M, args.a_row_stride},
                   {args.split ? args.a_lo : args.a_hi, args.M, args.a_row_stride},
                   {args.b_hi, args.N, args.b_row_stride},
                   {args.split ? args.b_lo : args.b_hi, args.N, args.b_row_stride}};
  for (int i = 0; i < 4; ++i) {
    const cudaError_t err = encode_operand(&maps[i], operands[i].base, operands[i].rows,
                                           args.k_cols, operands[i].stride, bf16);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((args.M + kTile - 1) / kTile, (args.N + kTile - 1) / kTile);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  if (bf16) return launch_kernel<Epi, false, true>(maps, grid, args, stream);
  if (args.split) return launch_kernel<Epi, true, false>(maps, grid, args, stream);
  return launch_kernel<Epi, false, false>(maps, grid, args, stream);
}

}  // namespace sm90
}  // namespace gemmfuse
