// group_rows_kernel's chain by output tiles, behind the GEMM that stores them: the chain kernel
// of a float32 call whose chain runs apart (dispatch.chain_apart), where its norm takes groups
// of 8 or 16 within 128-channel tiles (#62's chain; #75's, which reduces over the channels).
//
// Why: the plain split GEMM walks its 512 tiles (#62 at 1024 x 8192) on 132 SMs in four waves,
// and its last wave leaves some SMs idle: 16 of them for most of a tile's time (about 130 us
// of the GEMM's 522 on an H200, torch.profiler), during which the tiles of the first three
// waves are already in memory. Launched after the GEMM with programmatic dependent launch
// (griddepcontrol), this kernel's blocks take those SMs as the GEMM's blocks leave them and
// normalise the stored tiles then, in the GEMM's walk order (tile_walk.h), so what is left
// after the GEMM is the last wave's tiles, not the whole of z (29 us of chain kernel at #62).
//
// How: a block takes units (a slice of a tile's rows, a task a thread) by a ticket
// (tile_flags[tiles]), in walk order; one thread waits until the tile's two consumer
// warpgroups have counted their stores (kTileArrivals, acquire semantics), and the block runs
// group_rows' tasks on the slice's rows and the tile's groups. A reduction's unit merges each
// row's groups in group order into the row's partial of the tile (row_partial, as the tile
// kernel leaves it), and the last unit of a row band to arrive (row_counter, a count per
// kEpilogueRows16 rows) merges the band's rows over the tiles in tile order: group_rows' order
// (fold_rows), so its bits. Those counters sit after the tile counts in one set that the host
// makes before it queues the GEMM (host_forward.cpp's follow_flags), since units count rows
// before griddepcontrol.wait: zeros written between the GEMM and this kernel (a fill under
// graph capture, a stream's first memset) would not be visible to them. A ticket only waits for a tile
// that a resident GEMM block will store (the GEMM's persistent grid is resident when this
// kernel is scheduled), so nothing waits on a block that cannot run. Every block waits for the
// GEMM's end (griddepcontrol.wait) before it leaves, so this kernel ends after the GEMM and a
// launch behind it sees both complete; the last to leave zeroes the counts, the ticket and the
// exits for the next call.
#pragma once
#include <algorithm>

#include "device_cache.h"
#include "group_rows.cuh"
#include "tile_walk.h"

namespace gemmfuse {

// Whether group_tiles_kernel serves a float32 chain-apart call: group_rows serves it with groups
// of 8 or 16 (checked with the GEMM's z not yet allocated: null counts as aligned, and a fresh
// allocation is; groups of 32 and 64 take group_rows only at few tasks, below any chain apart's
// size), the arguments are the epilogue path's (no bias or scales: the GEMM applied them), and
// the GPU has programmatic dependent launch (sm_90 on).
template <class Epi>
bool group_tiles_serves(const FusedArgs& args) {
  if constexpr (Epi::kModelDtype != kFloat32Model) {
    return false;
  } else {
    static DeviceCache majors;  // per device, asked once
    int major = 0;
    const cudaError_t err = majors.current(major, [](int device, int& found) {
      return cudaDeviceGetAttribute(&found, cudaDevAttrComputeCapabilityMajor, device);
    });
    if (err != cudaSuccess) return false;  // the chain kernel runs after the GEMM instead
    return major >= 9 && (args.group_size == 8 || args.group_size == 16) &&
           group_rows_serves<Epi>(args) && args.bias == nullptr && args.a_inv_scale == nullptr &&
           args.b_inv_scale == nullptr && args.epilogue_in16 == nullptr &&
           serves_model<Epi>(args.params);
  }
}

// Waits until a tile's stores are all counted. A count that never comes (a fault, not a case)
// ends the kernel with a trap after kTileWaitNs: an error that leaves the process's CUDA context
// unusable, where the stream would otherwise hang (a debugger holding the GEMM that long trips
// it too).
constexpr unsigned long long kTileWaitNs = 30ull * 1000 * 1000 * 1000;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ void wait_for_tile(const int* flag) {
  const unsigned long long start = global_ns();
  while (tile_arrivals(flag) < kTileArrivals) {
    __nanosleep(256);
    if (global_ns() - start > kTileWaitNs) __trap();
  }
}

// A unit of work: a tile's rows in slices of kGroupTilesRows<kGs>, a task per thread, so that
// what is left when the GEMM ends (its last wave's tiles) takes one short round of the blocks.
template <int kGs>
constexpr int kGroupTilesRows = kGroupRowsThreads * kGs / kTile;

// A reducing unit's end: its rows' partials of the tile (each row's groups merged in group order,
// a thread a row), then its arrival at the row band's count; the band's last unit merges the
// band's rows over the tiles (fold_tile_partials) and zeroes the count. part: the unit's
// (row, group) partials, row-major. Called by every thread of the block.
template <class Epi, int kGs>
__device__ __forceinline__ void finish_reducing_unit(const RowAcc* part, const TileWalk& walk,
                                                     int col_tile, int row0, int rows, int groups,
                                                     const FusedArgs& args) {
  constexpr int kind = Epi::kReduce, kRows = kGroupTilesRows<kGs>;
  static_assert(kEpilogueRows16 % kRows == 0, "a unit's rows lie in one row band");
  const int tid = threadIdx.x, n_tiles = walk.tiles / walk.m_tiles;
  __syncthreads();  // every task's partial is in shared memory
  if (tid < rows)  // fold_rows' merge of a tile's groups
    store_tile_partial<kind>(args, n_tiles, col_tile, row0 + tid,
                             row_acc_merge_run<kind>(part + tid * groups, groups));
  // a band's units that hold rows: n_tiles of each of its slices below M
  const int band = row0 / kEpilogueRows16, band0 = band * kEpilogueRows16;
  const int band_rows = min(kEpilogueRows16, args.M - band0);
  const int arrivals = n_tiles * ((band_rows + kRows - 1) / kRows);
  if (!last_to_arrive(args.row_counter + band, arrivals, tid)) return;
  fold_tile_partials<kind>(args, n_tiles, band0, band_rows, tid, kGroupRowsThreads, args.N);
  if (tid == 0) args.row_counter[band] = 0;  // ready for the next launch
}

template <class Epi, int kGs>
__global__ void __launch_bounds__(kGroupRowsThreads, kGroupRowsMinBlocksPerSm<Epi, kGs>)
    group_tiles_kernel(FusedArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kSlices = kTile / kGroupTilesRows<kGs>;  // units a tile
  __shared__ int s_unit;
  __shared__ RowAcc s_part[Epi::kReduce != 0 ? kGroupRowsThreads : 1];  // a unit's partials
  const void* in = group_rows_source<Epi>(args);
  const TileWalk walk = TileWalk::of(args.M, args.N, kTile, kTile);
  const int units = walk.tiles * kSlices;
  int* ticket = args.tile_flags + walk.tiles;
  // thread 0 takes each ticket a unit ahead: the atomic's round trip runs under the block's work
  int ahead = threadIdx.x == 0 ? atomicAdd(ticket, 1) : 0;
  for (;;) {
    if (threadIdx.x == 0) {
      const int u = ahead;
      if (u < units) {
        wait_for_tile(args.tile_flags + u / kSlices);
        ahead = atomicAdd(ticket, 1);
      }
      s_unit = u;
    }
    __syncthreads();
    const int u = s_unit;
    if (u >= units) break;
    const int2 tile = walk.coords(u / kSlices);
    const int row0 = tile.x * kTile + u % kSlices * kGroupTilesRows<kGs>, col0 = tile.y * kTile;
    const int rows = max(0, min(kGroupTilesRows<kGs>, args.M - row0));
    const int groups = min(kTile, args.N - col0) / kGs;
    group_tasks<Epi, kGs>(in, rows * groups,
                          [&](int task, int& row, int& col) {
                            row = row0 + task / groups;
                            col = col0 + task % groups * kGs;
                            return static_cast<int64_t>(row) * args.N + col;
                          },
                          s_part, args);
    if constexpr (Epi::kReduce != 0) {
      if (rows > 0)  // (the block's threads alike)
        finish_reducing_unit<Epi, kGs>(s_part, walk, tile.y, row0, rows, groups, args);
    }
    __syncthreads();  // every thread has read s_unit (and s_part) before the next unit
  }
  // Zeroing the counts for the next call: by the last block to leave, once the GEMM has ended
  // (griddepcontrol.wait: not just stored; a launch behind this kernel then finds both done).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  __shared__ bool s_last;
  if (threadIdx.x == 0)
    s_last = atomicAdd(ticket + 1, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (s_last)
    for (int i = threadIdx.x; i < walk.tiles + kTileFollowExtra; i += kGroupRowsThreads)
      args.tile_flags[i] = 0;
#endif
}

template <class Epi, int kGs>
cudaError_t launch_group_tiles_for(const FusedArgs& args, cudaStream_t stream) {
  auto kernel = group_tiles_kernel<Epi, kGs>;
  static DeviceCache residents;  // blocks resident at once on the device, found once
  int resident = 0;
  const cudaError_t err = resident_grid(residents, kernel, kGroupRowsThreads, 0, resident);
  if (err != cudaSuccess) return err;
  const TileWalk walk = TileWalk::of(args.M, args.N, kTile, kTile);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(std::min(walk.tiles, resident)));
  config.blockDim = dim3(kGroupRowsThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args);
}

// group_tiles_kernel for a call group_tiles_serves, args.tile_flags the GEMM's counts. Where it
// cannot run or its launch fails, the counts are zeroed (the next call starts from zero) and
// the result is cudaErrorNotSupported (launch_tile_epilogue then runs the chain kernel after
// the GEMM, as without counts) or the launch's error.
template <class Epi>
cudaError_t launch_group_tiles(const FusedArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaErrorNotSupported;
  if constexpr (Epi::kNorm && Epi::kPool == 1 && Epi::kModelDtype == kFloat32Model) {
    if (group_tiles_serves<Epi>(args)) {
      switch (args.group_size) {  // the sizes group_tiles_serves takes, each its own kernel
        case 8: err = launch_group_tiles_for<Epi, 8>(args, stream); break;
        case 16: err = launch_group_tiles_for<Epi, 16>(args, stream); break;
        default: break;
      }
    }
  }
  if (err == cudaSuccess) return err;
  const int tiles = TileWalk::of(args.M, args.N, kTile, kTile).tiles;
  const cudaError_t cleared = cudaMemsetAsync(
      args.tile_flags, 0, (tiles + kTileFollowExtra) * sizeof(int), stream);
  return cleared == cudaSuccess ? err : cleared;
}

}  // namespace gemmfuse
