// The fused kernel of the portable (sm_80+) path:
//   out = epilogue(x @ W^T + b)   with x, W given as fp16 hi/lo splits (split_rows.cuh).
//
// Main loop: a 128x128 output tile per block, 8 warps of 64x32, K in steps of 32 through a
// cp.async pipeline of kStages shared-memory stages. Each 16-wide k-step issues three
// mma.sync per fragment: hi*lo, lo*hi, then hi*hi (lo*lo is below fp32's rounding); with
// args.split == 0 (precision="tf32") only hi*hi. The tensor
// cores add into their accumulator with truncation, which over thousands of steps biases an
// fp32 GEMM; so the tensor-core accumulator only ever holds one 32-wide k-tile and is then
// promoted into an fp32 register sum with round-to-nearest adds (Ootomo & Yokota 2022; the same
// reason DeepGEMM promotes its fp8 accumulators).
//
// Epilogue: the tile is undone from its power-of-two row scales, biased, passed through the
// generated `pre` ops and staged in shared memory as fp32; tile_epilogue.cuh does the rest.
//
// `Epi` is generated from the Python epilogue description (epilogue.py); it provides
//   static constexpr bool kNorm, kRms, kSoftmax, kLogSoftmax;
//   static constexpr int kReduce;  (0 none, 1 min, 2 max, 3 sum, 4 mean, 5 logsumexp)
//   static constexpr int kPool;    (the reduction's max-pooling window: 1 none)
//   static __device__ float pre(float v, int row, int col, const EpilogueParams& p);
//   static __device__ float post(float v, int row, int col, const EpilogueParams& p);
// and is defined before this header is included (see fused_linear.cu).
#pragma once
#include <cstdint>
#include <cuda_fp16.h>

#include "device_cache.h"
#include "fused_args.h"
#include "mma_sm80.cuh"
#include "smem_limit.h"
#include "tile_epilogue.cuh"

namespace gemmfuse {

constexpr int kBlockM = kTile, kBlockN = kTile, kBlockK = 32;
constexpr int kWarpsM = 2, kWarpsN = 4, kThreads = kWarpsM * kWarpsN * 32;
constexpr int kWarpTileM = kBlockM / kWarpsM, kWarpTileN = kBlockN / kWarpsN;  // 64 x 32
constexpr int kFragsM = kWarpTileM / 16, kFragsN = kWarpTileN / 8;            // 4 x 4
constexpr int kTileHalfs = kBlockM * kBlockK;  // one operand tile (kBlockM == kBlockN)
constexpr int kStageBytes = 4 * kTileHalfs * 2;  // a_hi, a_lo, b_hi, b_lo
static_assert(kBlockM == kBlockN, "operand tiles share one size");
static_assert(kBlockM * kEpiStride * 4 <= 3 * kStageBytes, "epilogue tile fits the pipeline");

constexpr int smem_bytes(int stages) { return stages * kStageBytes; }

// A row of a tile is 32 halfs = four 16-byte chunks; XOR-swizzling the chunk index with bits
// 1..2 of the row makes the eight rows that one ldmatrix phase reads fall in distinct banks.
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kBlockK + ((chunk ^ ((row >> 1) & 3)) << 3);
}

// One operand tile (kBlockM rows x kBlockK halfs) global -> shared; rows >= rows_valid read
// nothing and become zeros.
__device__ __forceinline__ void load_tile(__half* dst, const __half* src, int row0, int rows_valid,
                                          int k_padded, int k0) {
  constexpr int kChunks = kTileHalfs / 8;
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c >> 2, chunk = c & 3;
    const bool valid = row0 + r < rows_valid;
    const __half* g = src + static_cast<int64_t>(valid ? row0 + r : 0) * k_padded + k0 + chunk * 8;
    cp_async_16(dst + swizzle(r, chunk), g, valid);
  }
}

template <class Epi, int kStages>
__global__ void __launch_bounds__(kThreads, 1) fused_gemm_gn_kernel(const FusedArgs args) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* smem = reinterpret_cast<__half*>(smem_raw);

  // Row tiles vary fastest: the blocks resident at once share a few W panels through L2.
  const int tile_m = blockIdx.x * kBlockM;
  const int tile_n = blockIdx.y * kBlockN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int k_tiles = args.k_padded / kBlockK;

  auto stage_ptr = [&](int s, int which) { return smem + (s * 4 + which) * kTileHalfs; };
  auto load_stage = [&](int s, int kt) {
    const int k0 = kt * kBlockK;
    load_tile(stage_ptr(s, 0), args.a_hi, tile_m, args.M, args.k_padded, k0);
    load_tile(stage_ptr(s, 1), args.a_lo, tile_m, args.M, args.k_padded, k0);
    load_tile(stage_ptr(s, 2), args.b_hi, tile_n, args.N, args.k_padded, k0);
    load_tile(stage_ptr(s, 3), args.b_lo, tile_n, args.N, args.k_padded, k0);
  };

  float acc[kFragsM][kFragsN][4];  // fp32 sum, round-to-nearest adds
  float tc[kFragsM][kFragsN][4];   // tensor-core accumulator for the current k-tile
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt is visible; every warp is done with the slot refilled below
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();

    const int s = kt % kStages;
    const __half* a_hi = stage_ptr(s, 0);
    const __half* a_lo = stage_ptr(s, 1);
    const __half* b_hi = stage_ptr(s, 2);
    const __half* b_lo = stage_ptr(s, 3);
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) tc[i][j][e] = 0.f;

#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t bh[kFragsN / 2][4], bl[kFragsN / 2][4];
#pragma unroll
      for (int p = 0; p < kFragsN / 2; ++p) {
        const int n = warp_n * kWarpTileN + p * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int chunk = kk * 2 + ((lane >> 3) & 1);
        ldmatrix_x4(bh[p], b_hi + swizzle(n, chunk));
        ldmatrix_x4(bl[p], b_lo + swizzle(n, chunk));
      }
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        uint32_t ah[4], al[4];
        const int m = warp_m * kWarpTileM + i * 16 + (lane & 15);
        const int chunk = kk * 2 + (lane >> 4);
        ldmatrix_x4(ah, a_hi + swizzle(m, chunk));
        ldmatrix_x4(al, a_lo + swizzle(m, chunk));
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) {
          const uint32_t* bhj = bh[j >> 1] + (j & 1) * 2;
          const uint32_t* blj = bl[j >> 1] + (j & 1) * 2;
          if (args.split) {
            mma_f16_16816(tc[i][j], ah, blj[0], blj[1]);
            mma_f16_16816(tc[i][j], al, bhj[0], bhj[1]);
          }
          mma_f16_16816(tc[i][j], ah, bhj[0], bhj[1]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += tc[i][j][e];
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory becomes the epilogue tile

  // ---- Epilogue 1: unscale, bias, pre ops -> shared fp32 tile.
  float* tile = reinterpret_cast<float*>(smem_raw);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * kWarpTileM + i * 16 + g + half * 8;
      const int grow = min(tile_m + r, args.M - 1);
      const float a_inv = __ldg(args.a_inv_scale + grow);
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = warp_n * kWarpTileN + j * 8 + 2 * t + e;
          const int gcol = min(tile_n + c, args.N - 1);
          tile[r * kEpiStride + c] = saved_epilogue_input<Epi>(
              acc[i][j][half * 2 + e], a_inv, column_terms(gcol, args), tile_m + r, tile_n + c, args);
        }
      }
    }
  }
  __syncthreads();

  const TileCoord coord{tile_m, tile_n, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                        static_cast<int>(gridDim.y)};
  tile_epilogue<Epi, kThreads, true>(tile, args, coord, threadIdx.x, [] { __syncthreads(); });
}

template <class Epi>
cudaError_t launch_fused_gemm_gn(const FusedArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (!serves_model<Epi>(args.params)) return cudaErrorInvalidValue;
  static DeviceCache optins;  // the device's opt-in shared memory a block, asked once
  int optin = 0;
  cudaError_t err = optins.current(optin, [](int device, int& found) {
    return cudaDeviceGetAttribute(&found, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  });
  if (err != cudaSuccess) return err;
  const dim3 grid((args.M + kBlockM - 1) / kBlockM, (args.N + kBlockN - 1) / kBlockN);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  // Four stages where the GPU's shared memory allows (sm_80, sm_90), else three (sm_86, sm_89).
  if (optin >= smem_bytes(4)) {
    auto kernel = fused_gemm_gn_kernel<Epi, 4>;
    err = raise_smem_once(reinterpret_cast<const void*>(kernel), smem_bytes(4));
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, smem_bytes(4), stream>>>(args);
  } else {
    auto kernel = fused_gemm_gn_kernel<Epi, 3>;
    err = raise_smem_once(reinterpret_cast<const void*>(kernel), smem_bytes(3));
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, smem_bytes(3), stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace gemmfuse
