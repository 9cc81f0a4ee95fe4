// The epilogue path's kernel for GroupNorm groups of 8, 16 or 32 channels of a 16-bit model's z,
// and of 8 or 16 of a float32 z, or 32 and 64 where a call has few tasks (the common sizes;
// tile_epilogue_kernel in norm_finalize.cuh serves the rest): a thread per (row, group) loads the group's values from z straight into
// registers, 16 bytes a load, and normalises them, applies the chain and stores them from
// there, with no shared-memory tile between.
//
// Float32 since 2026-11-27: the chain kernel of a fused call whose chain runs apart
// (dispatch.chain_apart: the split GEMM stores z, this kernel normalises it in place) and of the
// float32 epilogue path. A chain apart in groups of 8 or 16 takes its tasks by output tile
// instead, behind the GEMM (group_tiles.cuh: group_tasks below, on the tiles as they are
// stored; a reduction's rows merged over the tiles in fold_rows' order). At 1024 x 8192 (torch.profiler, median of 10 launches on a given z in place, L2
// cleared before each, H100, two rounds alternating with the tile kernel's tree):
// #62's chain 52.4-53.2 -> 26.4-26.7 us (groups of 8), 50.7-51.3 -> 34.2-34.3 (16); #75's
// 41.0-41.1 -> 31.7-31.8 (8), 37.8-37.9 -> 29.6-29.7 (16). Groups of 32 take 160 registers
// (one block an SM, with the next task's loads in flight): 53.6-53.7 against 54.9-55.5 (#62),
// 39.9-40.3 against 36.2 (#75), so the tile kernel keeps them but at few tasks
// (kGroupRowsFewTasks, since 2026-11-28, without those loads: 64 registers). Groups of 16 are held to 64 registers (four blocks an SM; 72
// unbounded, three): 34.2-34.3 against 37.9-38.0 (#62), 29.6-29.7 against 36.7-36.9 (#75), in
// a call of their own (docs/DESIGN.md section 4).
//
// Why: after PyTorch's 16-bit GEMM (169-178 us at #62's 1024 x 8192 x 8192) the chain kernel is
// all that stands between the model and its floor. At that size (torch.profiler, median of 10
// calls, L2 cleared before each, H100, 2026-11-27) the tile kernel, staging 64 x 128 tiles in
// shared memory and walking them again per group, took 24.3 us for bf16 #62's chain and 21.1
// for bf16 #75's (fp16: 24.8, 20.8); this kernel 16.3 and 15.6 (fp16: 15.7, 16.2; in a call
// of its own, the tile kernel's figures steady at 24.1-24.4 and 21.0-21.2 over three others).
// One pass of PyTorch's own over the same z (z * 2, 16 MB in and out) took 9.1 us. Tried on
// the way (each in a call beside the tile kernel):
// - a thread per task, its loads then its arithmetic, two tasks a thread: 16.4-16.6 and 18.3 us
//   (ncu, groups of 16: warps waiting on global loads 40% of their cycles, 50% occupancy at
//   64 registers; groups of 32 take 76-80, 37.5%); software
//   pipelining (below) took it to the figures above;
// - a thread per 8 values, a group's lanes trading their words by shuffles (each warp-wide
//   load and store one contiguous 512 bytes): 19.9 and 22.0 us, since each lane then computes
//   its group's statistics again and the kernel is bound by issued instructions (ncu: 62% of
//   the SMs' throughput, 22% of DRAM's).
//
// The values are the tile kernel's (but for float32 groups of 32 and 64: at few tasks the tile
// kernel takes a group's statistics by a warp, segment_moments_warp, this kernel by a thread, so
// the bits differ, both fp32-accurate): the same `pre`, statistics (group_statistics with the
// group's size known at compile time, eager bf16's where the call asks), `normalize` and
// `post` per value; a reduction pushes a group's outputs in column order, merges a tile's
// (kTile columns') groups in group order and the row's tiles in tile order, the order of the
// tile kernel's register groups and its last block's fold, with the partials in shared
// memory: a block owns whole rows, so no partials go through global memory and no counters
// (host_common.h's allocate_outputs still makes the tile kernel's for a reducing call; they go
// unused here).
#pragma once
#include <algorithm>
#include <cstdint>

#include "fused_args.h"
#include "row_reduce.cuh"
#include "tile_epilogue.cuh"

namespace gemmfuse {

constexpr int kGroupRowsThreads = 256;
// Groups of a row whose partials one block keeps in shared memory (8 bytes each): a longer
// row's reduction takes the tile kernel.
constexpr int kGroupRowsMaxGroups = 4096;

// The values of z in one 16-byte load: 8 of a 16-bit model's, 4 of float32.
template <class Epi>
constexpr int kGroupRowsPer = Epi::kModelDtype == kFloat32Model ? 4 : 8;

// z as the kernel reads it: the model's 16-bit z, or float32 (in place or not).
template <class Epi>
__device__ __host__ __forceinline__ const void* group_rows_source(const FusedArgs& args) {
  if constexpr (Epi::kModelDtype == kFloat32Model)
    return epilogue_source(args);
  else
    return args.epilogue_in16;
}

// Float32 groups of 32 and 64 hold that many values a thread, so they take this kernel only
// where a call has at most this many (row, group) tasks and a row at most kGroupRowsThreads
// groups: then group_rows_per_block gives a block at most kGroupRowsThreads tasks (a task a
// thread or fewer), and the tile kernel's 128-row tiles are mostly empty. (A row of more groups
// would put a row's tasks in series on a block's threads: 8 x 32768 in groups of 32 on 8 blocks,
// where the tile kernel runs 256.) The chain kernel alone, #62's chain on the
// epilogue path (torch.profiler, median of 15 launches, L2 cleared, H200, 2026-11-28), tile
// kernel against this one: groups of 32 at M x N = 16 x 1024 5.3 / 5.3 us, 128 x 1024 12.5 / 5.6,
// 1024 x 1024 (32768 tasks) 13.4 / 10.1, 300 x 8192 19.8 / 20.7, 1024 x 8192 56.4 / 51.9,
// 4096 x 8192 157 / 179; groups of 64 at 16 x 1024 8.6 / 7.9, 128 x 1024 15.7 / 8.4, 1024 x 1024
// 17.0 / 13.1, 300 x 8192 (38400 tasks) 21.3 / 29.2, 1024 x 8192 43.1 / 55.7.
constexpr int64_t kGroupRowsFewTasks = 32768;

// Whether group_rows_kernel serves an epilogue-path call: a norm over groups of 8, 16 or 32
// (a float32 z: 8 or 16, or 32 and 64 where the tasks are few) that never straddle tiles, z and
// the norm's weights 16-byte aligned (N a multiple of the group size keeps every group's start
// so), no max pooling (Epi::kPool 1), and for a reduction at most kGroupRowsMaxGroups groups a
// row.
template <class Epi>
bool group_rows_serves(const FusedArgs& args) {
  if constexpr (!Epi::kNorm || Epi::kPool != 1) {
    return false;
  } else {
    const int gs = args.group_size;
    constexpr bool kF32 = Epi::kModelDtype == kFloat32Model;
    if (gs != 8 && gs != 16 && gs != 32 && (gs != 64 || !kF32)) return false;
    if (kF32 && gs >= 32 &&
        (static_cast<int64_t>(args.M) * (args.N / gs) > kGroupRowsFewTasks ||
         args.N / gs > kGroupRowsThreads))
      return false;
    if (args.norm_wide || args.N % gs != 0) return false;
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    if (!aligned(group_rows_source<Epi>(args)) || !aligned(args.gn_weight) ||
        !aligned(args.gn_bias))
      return false;  // (null is aligned: a norm without the affine part)
    return Epi::kReduce == 0 || args.N / gs <= kGroupRowsMaxGroups;
  }
}

// Rows a block owns: about kGroupRowsTasks (row, group) tasks' worth (4 a thread: one task's
// loads in flight while the thread computes another, kGroupRowsAhead), fewer where that would leave under
// kGroupRowsMinBlocks blocks (about two an SM on an H100's 132). The kernel derives its rows
// from its grid (group_rows_of_grid): the fewest that cover M in the host's number of blocks,
// at most the host's count, so the shared memory sized for that count always suffices.
constexpr int kGroupRowsTasks = 4 * kGroupRowsThreads;
constexpr int kGroupRowsMinBlocks = 256;

inline int group_rows_per_block(int M, int groups_per_row) {
  int rows = std::max(1, kGroupRowsTasks / groups_per_row);
  while (rows > 1 && (static_cast<int64_t>(M) + rows - 1) / rows < kGroupRowsMinBlocks) rows /= 2;
  return rows;
}

// A block's rows, as many as cover M over the grid (at most what group_rows_per_block chose).
__device__ __forceinline__ int group_rows_of_grid(int M) {
  return static_cast<int>((static_cast<int64_t>(M) + gridDim.x - 1) / gridDim.x);
}

// One (row, group) task: the group's kGs values of z as 16-byte words, kPer values each.
template <int kGs, int kPer>
struct GroupWords {
  uint4 w[kGs / kPer];
};

// A 16-bit z through the read-only cache; a float32 one, which the kernel may overwrite (in
// place: each group is read, then written, by one thread), by plain loads: so too where a GEMM
// is still storing z beside the kernel (group_tiles.cuh), whose tiles the read-only path could
// serve stale.
template <class Epi, int kGs>
__device__ __forceinline__ GroupWords<kGs, kGroupRowsPer<Epi>> load_group(const void* in,
                                                                        int64_t at) {
  constexpr int kPer = kGroupRowsPer<Epi>;
  GroupWords<kGs, kPer> g;
  if constexpr (Epi::kModelDtype == kFloat32Model) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const float*>(in) + at);
#pragma unroll
    for (int i = 0; i < kGs / kPer; ++i) g.w[i] = src[i];
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(in) + at);
#pragma unroll
    for (int i = 0; i < kGs / kPer; ++i) g.w[i] = __ldg(src + i);
  }
  return g;
}

// Value j of a task's words: a float32 one's bits, or a 16-bit model's value widened.
template <class Epi, int kGs>
__device__ __forceinline__ float group_value(const GroupWords<kGs, kGroupRowsPer<Epi>>& g, int j,
                                             int model16) {
  if constexpr (Epi::kModelDtype == kFloat32Model) {
    return __uint_as_float((&g.w[j / 4].x)[j % 4]);
  } else {
    const uint32_t word = (&g.w[j / 8].x)[(j % 8) / 2];
    return from_model16(static_cast<uint16_t>(word >> (16 * (j % 2))), model16);
  }
}

// The chain on one task's values: `pre`, the group's statistics, the norm and `post`; stored,
// or (a reduction) pushed in column order into the returned partial (empty without reduction).
// The statistics are the tile kernel's for the model: fp32-accurate (kExact) for float32, eager
// bf16's where a 16-bit call asks.
template <class Epi, int kGs>
__device__ __forceinline__ RowAcc finish_group(const GroupWords<kGs, kGroupRowsPer<Epi>>& g,
                                               int row, int col, int64_t at,
                                               const FusedArgs& args) {
  // eager bf16's statistics are a 16-bit call's only (dispatch.group_stats_mode never asks a
  // float32 one; their one-value-a-lane form does not take groups of 64)
  constexpr bool kExact = Epi::kModelDtype == kFloat32Model, kEager = !kExact;
  const int model16 = model_dtype<Epi::kModelDtype>(args.params.model16);
  float y[kGs];
#pragma unroll
  for (int j = 0; j < kGs; ++j)
    y[j] = staged_input<Epi>(group_value<Epi, kGs>(g, j, model16), row, col + j, args);
  float rstd;
  const SegmentMoments mom = group_statistics<Epi, kExact, kEager, kGs>(y, kGs, args, rstd);
  const bool affine = args.gn_weight != nullptr;
#pragma unroll
  for (int j = 0; j < kGs; j += 4) {
    float4 w = make_float4(0.f, 0.f, 0.f, 0.f), b = w;
    if (affine) {
      w = __ldg(reinterpret_cast<const float4*>(args.gn_weight + col + j));
      b = __ldg(reinterpret_cast<const float4*>(args.gn_bias + col + j));
    }
    const float ws[4] = {w.x, w.y, w.z, w.w}, bs[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      y[j + i] = normalize<Epi>(y[j + i], mom.mean, mom.mean_lo, rstd, ws[i], bs[i], row,
                                col + j + i, args);
  }
  RowAcc acc = row_acc_empty<Epi::kReduce>();
  if constexpr (Epi::kReduce != 0) {
#pragma unroll
    for (int j = 0; j < kGs; ++j) row_acc_push<Epi::kReduce>(acc, y[j]);
  } else {
    store_run<Epi, kGs>(y, at, args);
  }
  return acc;
}

// A row's partials (one per group, in shared memory) folded as tile_epilogue folds its tiles':
// each tile's groups in order (a thread per (row, tile)), then the row's tiles in order (a
// thread per row).
template <class Epi, int kGs>
__device__ __forceinline__ void fold_rows(RowAcc* part, int row0, int rows_here, int groups,
                                          int tid, const FusedArgs& args) {
  constexpr int kind = Epi::kReduce, kPerTile = kTile / kGs;
  const int n_tiles = (groups + kPerTile - 1) / kPerTile;
  for (int task = tid; task < rows_here * n_tiles; task += kGroupRowsThreads) {
    RowAcc* row = part + (task / n_tiles) * groups;
    const int g0 = (task % n_tiles) * kPerTile, g1 = min(groups, g0 + kPerTile);
    row[g0] = row_acc_merge_run<kind>(row + g0, g1 - g0);  // no other task reads these groups
  }
  __syncthreads();
  for (int r = tid; r < rows_here; r += kGroupRowsThreads) {
    const RowAcc* row = part + r * groups;
    const RowAcc acc = row_acc_merge_loads<kind>(n_tiles, [&](int t) { return row[t * kPerTile]; });
    args.row_out[row0 + r] = row_acc_finish<kind>(acc, args.N);
  }
}

// Blocks an SM must hold (0: as many as the registers allow): float32 groups of 16 take 72
// registers unbounded, three blocks an SM; bounded to 64 (four blocks), a few bytes spill.
template <class Epi, int kGs>
constexpr int kGroupRowsMinBlocksPerSm = Epi::kModelDtype == kFloat32Model && kGs == 16 ? 4 : 0;

// Whether a thread loads its next task's group before finishing the current one: not for
// float32 groups of 32 and 64, which run at a task a thread or fewer (kGroupRowsFewTasks) and
// would hold twice their values.
template <class Epi, int kGs>
constexpr bool kGroupRowsAhead = !(Epi::kModelDtype == kFloat32Model && kGs >= 32);

// A block's (row, group) tasks [0, tasks), task i's z offset (and its row and column) from
// place(i, row, col): each thread walks its tasks, where kGroupRowsAhead with the next task's
// loads issued before the current task's arithmetic (software pipelining: a thread per task,
// its loads then its arithmetic, left ncu's warps 40% of their cycles waiting on global loads
// at 50% occupancy, H100, 2026-11-27). A reduction's partials go to part[task].
template <class Epi, int kGs, class Place>
__device__ __forceinline__ void group_tasks(const void* in, int tasks, Place place, RowAcc* part,
                                            const FusedArgs& args) {
  const int tid = threadIdx.x;
  int row, col;
  GroupWords<kGs, kGroupRowsPer<Epi>> current{};
  if (kGroupRowsAhead<Epi, kGs> && tid < tasks)
    current = load_group<Epi, kGs>(in, place(tid, row, col));
  for (int task = tid; task < tasks; task += kGroupRowsThreads) {
    if constexpr (!kGroupRowsAhead<Epi, kGs>)
      current = load_group<Epi, kGs>(in, place(task, row, col));
    const int next = task + kGroupRowsThreads;
    GroupWords<kGs, kGroupRowsPer<Epi>> ahead{};
    if (kGroupRowsAhead<Epi, kGs> && next < tasks)
      ahead = load_group<Epi, kGs>(in, place(next, row, col));
    const int64_t at = place(task, row, col);
    const RowAcc acc = finish_group<Epi, kGs>(current, row, col, at, args);
    if constexpr (Epi::kReduce != 0) part[task] = acc;
    if constexpr (kGroupRowsAhead<Epi, kGs>) current = ahead;
  }
}

// A block takes group_rows_of_grid rows, a task per (row, group).
template <class Epi, int kGs>
__global__ void __launch_bounds__(kGroupRowsThreads, kGroupRowsMinBlocksPerSm<Epi, kGs>)
    group_rows_kernel(FusedArgs args) {
  extern __shared__ RowAcc group_part[];  // [rows, groups]: a reduction's partials
  const int groups = args.N / kGs, rows = group_rows_of_grid(args.M);
  const int row0 = blockIdx.x * rows, rows_here = min(rows, args.M - row0);
  group_tasks<Epi, kGs>(group_rows_source<Epi>(args), rows_here * groups,
                        [&](int task, int& row, int& col) {
                          row = row0 + task / groups;
                          col = task % groups * kGs;
                          return static_cast<int64_t>(row) * args.N + col;
                        },
                        group_part, args);
  if constexpr (Epi::kReduce != 0) {
    __syncthreads();
    fold_rows<Epi, kGs>(group_part, row0, rows_here, groups, threadIdx.x, args);
  }
}

template <class Epi, int kGs>
cudaError_t launch_group_rows_for(const FusedArgs& args, cudaStream_t stream) {
  const int groups = args.N / kGs, rows = group_rows_per_block(args.M, groups);
  const int blocks = static_cast<int>((static_cast<int64_t>(args.M) + rows - 1) / rows);
  const int smem = Epi::kReduce != 0 ? rows * groups * static_cast<int>(sizeof(RowAcc)) : 0;
  group_rows_kernel<Epi, kGs><<<blocks, kGroupRowsThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// group_rows_kernel for a call group_rows_serves.
template <class Epi>
cudaError_t launch_group_rows(const FusedArgs& args, cudaStream_t stream) {
  if constexpr (!Epi::kNorm || Epi::kPool != 1) {
    return cudaErrorInvalidValue;
  } else {
    switch (args.group_size) {
      case 8:
        return launch_group_rows_for<Epi, 8>(args, stream);
      case 16:
        return launch_group_rows_for<Epi, 16>(args, stream);
      case 32:
        return launch_group_rows_for<Epi, 32>(args, stream);
      case 64:  // float32 only (group_rows_serves): not compiled for a 16-bit z
        if constexpr (Epi::kModelDtype == kFloat32Model)
          return launch_group_rows_for<Epi, 64>(args, stream);
        return cudaErrorInvalidValue;
      default:
        return cudaErrorInvalidValue;
    }
  }
}

}  // namespace gemmfuse
