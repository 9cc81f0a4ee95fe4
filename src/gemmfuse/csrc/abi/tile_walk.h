// The order in which the Hopper kernel's persistent grid walks its output tiles, and the tile
// arrivals by which a chain kernel launched behind it follows that walk (group_tiles.cuh): the
// two sit in different libraries (the plain GEMM's and a chain's), so the order is part of the
// interface between them.
#pragma once
#include "fused_args.h"

namespace gemmfuse {

// Row tiles per band of TileWalk. Measured flat from 2 to 32 (#40, #37, #45, #39 at KernelBench's
// sizes, H100, 2026-11-24), and 15-25% slower with all row tiles in one band.
constexpr int kWalkBand = 16;

// The order of the output tiles: bands of `band` row tiles, one after the other; within a band,
// row tiles fastest, then column tiles. The blocks running at once (about one wave of 132) then
// cover a band's rows times a few column tiles, so the operand panels they read are some
// band + 132 / band of them, each read from HBM once and shared in L2. A walk over all row
// tiles at once (band = m_tiles) reads every x panel again for each column tile when M is
// large: at 16384 x 4096 x 4096, 128 row panels of 2 MB per wave, past HBM's bandwidth.
struct TileWalk {
  int m_tiles;
  int tiles;  // m_tiles * column tiles
  int band;   // row tiles per band, at most m_tiles

  // The walk over an M x N output in tiles of tile_m x tile_n.
  __host__ __device__ static TileWalk of(int M, int N, int tile_m, int tile_n) {
    const int m_tiles = (M + tile_m - 1) / tile_m, n_tiles = (N + tile_n - 1) / tile_n;
    return TileWalk{m_tiles, m_tiles * n_tiles, m_tiles < kWalkBand ? m_tiles : kWalkBand};
  }

  // (row tile, column tile) of tile t.
  __device__ __forceinline__ int2 coords(int t) const {
    const int n_tiles = tiles / m_tiles, per_band = band * n_tiles;
    const int first = t / per_band * band, rows = min(m_tiles - first, band);
    const int r = t - first * n_tiles;  // the tile's place in its band
    return make_int2(first + r % rows, r / rows);
  }
};

// Tile arrivals (FusedArgs::tile_flags): a kernel that stores output tiles in a TileWalk's order
// counts kTileArrivals on tile_flags[t] once tile t is in memory, each count by one thread after
// a barrier of the warpgroup whose stores it covers, with release semantics (the pattern of
// CUTLASS's GenericBarrier); a chain kernel launched behind it takes work in walk order by
// tile_flags[tiles] (a ticket) and waits for each tile's count with acquire semantics, and its
// last block to leave (tile_flags[tiles + 1] counts the exits) zeroes them all: all zero again
// when it ends, as arrival counters must be (host_common.h).
constexpr int kTileArrivals = 2;  // the Hopper kernel's two consumer warpgroups

__device__ __forceinline__ void tile_arrive(int* flag) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

__device__ __forceinline__ int tile_arrivals(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

}  // namespace gemmfuse
