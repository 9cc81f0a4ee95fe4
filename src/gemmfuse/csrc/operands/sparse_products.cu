// The backward's products dx = dz @ W and dW = dz^T @ x where dz is zero but for a few
// channel groups of each row: a min or max over the channels sends each row's gradient to its
// extremes, and a GroupNorm spreads it over their groups alone (dispatch.sparse_gradient).
// #75 at 1024 x 8192 x 8192 has 16 nonzero columns in a row of 8192: a dense product spends
// 99.8% of its multiplications on zeros, where these kernels read the nonzero entries and the
// rows of W (or x) they select, and write the result.
//
// dz's columns are cut into strips of 16. sparse_rows_kernel lists, per strip, the rows with a
// nonzero entry there (in row order) and counts each row's strips. Then sparse_products_kernel,
// a resident grid whose blocks take work items from one counter, computes both products:
// - dW for strips with many rows, each item's rows shared by its warps (the longest items:
//   first, so that they end with the rest);
// - dx for rows in several strips (ties; groups that straddle strips), a row at a time;
// - dx for the rows of one strip (almost all: #75's ties are rare), the strip's 16 rows of W
//   read once for a batch of rows;
// - dW for the other strips with rows, then the zeros: dx's rows without nonzero entries and
//   the idle strips' dW (pure stores, last).
// One launch for all of it: as three kernels (dx's strips, dx's other rows, dW), each ended on a
// tail of few busy blocks (dW's SMs were idle 47% of its 168 us: ncu, H100, 2026-11-25,
// #75's bf16 step at 3680ce2), and the latency-bound dx items could not overlap dW's stores.
// Every output is a float sum in a fixed order (columns, or rows, ascending; for a strip with
// many rows, each warp's share of them in row order, then the warps' sums in warp order; the
// row lists come from block-wide scans, not atomics; each output is one item's), rounded once:
// the same on every run. A NaN in dz is nonzero and reaches
// the products as in a dense one. dx skips dz's zero entries, and dW the rows whose strip of dz
// is all zero, where a dense product would turn an inf or NaN of W or x times those zeros into
// NaN (dW multiplies the zeros within a listed row's strip, as a dense product does).
//
// Measured on #75's bf16 backward (H100, 2026-11-25, torch.profiler, the kernels of 12c2ff5):
// rows 12 us, dx 71 + 27 us, dW 154 us, against cuBLAS's 158 and 178; float32 models, where
// PyTorch's products take 2.6 ms each, gain the most.
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include "sparse_products.h"

namespace gemmfuse {
// A named namespace, not an anonymous one: a standalone export compiles this file in one
// translation unit with the chain's parts, whose gemmfuse::kThreads an anonymous namespace's
// names would make ambiguous.
namespace sparse {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kInputPerThread = 8;   // dx columns per thread: a chunk of 2048
constexpr int kStrip = kSparseStrip;  // dz columns (dW rows) per strip
constexpr int kWeightPerThread = 2;  // dW columns per thread: a chunk of 512
constexpr int kStripPerThread = 2;  // dx columns per thread of a strip item: a chunk of 512
constexpr int kBatch = kSparseBatch;
// Entries whose loads a thread has in flight at once: dx's four (more registers, fewer blocks
// per SM: 8 took 113 registers against 64, the same bytes in flight per SM), dW's eight.
constexpr int kInputDepth = 4, kWeightDepth = 8;
static_assert(kThreads * kInputPerThread == kSparseInputChunk, "dx chunk");
static_assert(kThreads * kWeightPerThread == kSparseWeightChunk, "dW chunk");
constexpr int64_t kSparseStripChunk = kThreads * kStripPerThread;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// N consecutive values as a register array, moved in 16-byte pieces (or, for fewer bytes in
// all, one piece of 8 or 4).
template <class T, int N>
union Pack {
  static constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static constexpr int kPiece = kBytes >= 16 ? 16 : kBytes;
  static_assert(kPiece == 16 || kPiece == 8 || kPiece == 4, "a piece of 16, 8 or 4 bytes");
  using Word = typename std::conditional<
      kPiece == 16, uint4, typename std::conditional<kPiece == 8, uint2, uint32_t>::type>::type;
  Word words[kBytes / kPiece];
  T values[N];
};

// p[0..n) as floats, zeros past n (n <= N): vector loads where all N are there and p is
// aligned to a piece, else one at a time.
template <int N, class T>
__device__ __forceinline__ void load_run(const T* __restrict__ p, int n, float (&v)[N]) {
  using P = Pack<T, N>;
  if (n == N && reinterpret_cast<uintptr_t>(p) % P::kPiece == 0) {
    P pack;
#pragma unroll
    for (int i = 0; i < P::kBytes / P::kPiece; ++i)
      pack.words[i] = reinterpret_cast<const typename P::Word*>(p)[i];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = to_float(pack.values[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = j < n ? to_float(p[j]) : 0.f;
  }
}

// v[0..n) to p, each rounded to T once.
template <int N, class T>
__device__ __forceinline__ void store_run(T* __restrict__ p, int n, const float (&v)[N]) {
  using P = Pack<T, N>;
  if (n == N && reinterpret_cast<uintptr_t>(p) % P::kPiece == 0) {
    P pack;
#pragma unroll
    for (int j = 0; j < N; ++j) pack.values[j] = from_float<T>(v[j]);
#pragma unroll
    for (int i = 0; i < P::kBytes / P::kPiece; ++i)
      reinterpret_cast<typename P::Word*>(p)[i] = pack.words[i];
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < n) p[j] = from_float<T>(v[j]);
  }
}

// The block's exclusive prefix sum of `count` in thread order, and its total: where each
// thread's entries go in the block's ordered list. Every thread calls it; `scratch` holds
// kWarps ints of shared memory, free again on return.
__device__ __forceinline__ int block_offset(int count, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = count;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int below = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += below;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? scratch[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarps; off <<= 1) {
      const int below = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += below;
    }
    if (lane < kWarps) scratch[lane] = w;
  }
  __syncthreads();
  total = scratch[kWarps - 1];
  const int offset = (warp > 0 ? scratch[warp - 1] : 0) + inclusive - count;
  __syncthreads();
  return offset;
}

// dx's row items list their row's nonzero entries in shared memory where they fit (the usual
// case: a few groups a row), else lists and adds them a piece at a time (a dz that is dense in
// places). Both add the entries in column order, so the result does not depend on which.

// dx: entry e is column s_col[e] of the row with value s_val[e]; each thread adds
// value * w[column, its 8 columns], kInputDepth entries' loads in flight at once.
template <class T>
__device__ __forceinline__ void add_input_entries(const int* s_col, const float* s_val, int count,
                                                  const T* __restrict__ w, int k, int nk, int K,
                                                  float (&acc)[kInputPerThread]) {
  int e = 0;
  for (; e + kInputDepth <= count; e += kInputDepth) {
    float wv[kInputDepth][kInputPerThread];
#pragma unroll
    for (int u = 0; u < kInputDepth; ++u)
      load_run(w + static_cast<int64_t>(s_col[e + u]) * K + k, nk, wv[u]);
#pragma unroll
    for (int u = 0; u < kInputDepth; ++u) {
      const float a = s_val[e + u];
#pragma unroll
      for (int j = 0; j < kInputPerThread; ++j) acc[j] = fmaf(a, wv[u][j], acc[j]);
    }
  }
  for (; e < count; ++e) {
    float wv[kInputPerThread];
    load_run(w + static_cast<int64_t>(s_col[e]) * K + k, nk, wv);
    const float a = s_val[e];
#pragma unroll
    for (int j = 0; j < kInputPerThread; ++j) acc[j] = fmaf(a, wv[j], acc[j]);
  }
}

// Lists the nonzero entries of dz_row[c0, c0 + kThreads * 8) at s_col/s_val + first, in column
// order; returns how many (every thread the same). Not written where first + that count would
// pass `capacity`.
template <class T>
__device__ __forceinline__ int list_input_piece(const T* __restrict__ dz_row, int c0, int N,
                                                int first, int capacity, int* s_col,
                                                float* s_val, int* s_scratch) {
  const int c = c0 + kInputPerThread * threadIdx.x;
  const int nc = max(0, min(kInputPerThread, N - c));
  float v[kInputPerThread];
  load_run(dz_row + min(c, N - 1), nc, v);  // nc == 0 reads nothing
  int count = 0;
#pragma unroll
  for (int j = 0; j < kInputPerThread; ++j) count += v[j] != 0.f;  // NaN too; zeros past nc
  int total;
  int at = first + block_offset(count, s_scratch, total);
  if (first + total > capacity) return total;
#pragma unroll
  for (int j = 0; j < kInputPerThread; ++j) {
    if (v[j] != 0.f) {
      s_col[at] = c + j;
      s_val[at] = v[j];
      ++at;
    }
  }
  return total;
}

// dW: entry e is row s_row[e] of dz with its strip's values s_val[e][0..16); each thread adds
// value[j] * x[row, its 2 columns] into dW row j of the strip, the loads of kWeightDepth entries
// in flight at once, the last few's too (most strips hold a few rows).
template <class T>
__device__ __forceinline__ void add_weight_entries(const int* s_row,
                                                   const float (*s_val)[kStrip + 1], int count,
                                                   const T* __restrict__ x, int k, int nk, int K,
                                                   float (&acc)[kStrip][kWeightPerThread]) {
  for (int e = 0; e < count; e += kWeightDepth) {
    float xv[kWeightDepth][kWeightPerThread] = {};
#pragma unroll
    for (int u = 0; u < kWeightDepth; ++u)
      if (e + u < count) load_run(x + static_cast<int64_t>(s_row[e + u]) * K + k, nk, xv[u]);
#pragma unroll
    for (int u = 0; u < kWeightDepth; ++u) {
      if (e + u < count) {
#pragma unroll
        for (int j = 0; j < kStrip; ++j) {
          const float a = s_val[e + u][j];
#pragma unroll
          for (int i = 0; i < kWeightPerThread; ++i) acc[j][i] = fmaf(a, xv[u][i], acc[j][i]);
        }
      }
    }
  }
}

// Everything sparse_products_kernel reads and writes: the operands, the outputs (dx or dw null:
// not computed) and sparse_rows_kernel's lists.
template <class T>
struct SparseArgs {
  const T *dz, *w, *x;
  T *dx, *dw;
  int M, N, K;
  const int *row_strips, *counts, *rows, *order, *heavy, *others;
  const int2* batches;
  int* counters;
};

// The items' shared memory, one item's at a time.
union SparseShared {
  struct {  // a dW item's staged rows and their strip's values (+1: a row's own banks)
    int row[kThreads];
    float val[kThreads][kStrip + 1];
  } weight;
  struct {  // a dx strip item's batch of rows
    int row[kBatch];
    float val[kBatch][kStrip + 1];
  } strip;
  float heavy[kStrip][32 * kWeightPerThread];  // a heavy dW item's sum, its warps' added in turn
  struct {  // a dx row item's nonzero entries
    int col[kThreads * kInputPerThread];
    float val[kThreads * kInputPerThread];
  } input;
};

// dx[row, chunk of kSparseInputChunk] for a row with nonzero entries in two or more strips
// (ties; groups that straddle strips).
template <class T>
__device__ __forceinline__ void input_row_item(const SparseArgs<T>& a, int64_t row, int chunk,
                                               SparseShared& s, int* s_scratch) {
  constexpr int kPiece = kThreads * kInputPerThread;
  const int N = a.N, K = a.K;
  const T* dz_row = a.dz + row * N;
  const int k = chunk * static_cast<int>(kSparseInputChunk) + kInputPerThread * threadIdx.x;
  const int nk = max(0, min(kInputPerThread, K - k));
  float acc[kInputPerThread] = {};
  int listed = 0;
  bool fits = true;
  for (int c0 = 0; c0 < N && fits; c0 += kPiece) {
    const int count = list_input_piece(dz_row, c0, N, listed, kPiece, s.input.col, s.input.val,
                                       s_scratch);
    fits = listed + count <= kPiece;
    listed += count;
  }
  __syncthreads();
  if (fits) {
    if (nk > 0) add_input_entries(s.input.col, s.input.val, listed, a.w, k, nk, K, acc);
  } else {
    for (int c0 = 0; c0 < N; c0 += kPiece) {
      __syncthreads();  // the last piece's entries are read
      const int count = list_input_piece(dz_row, c0, N, 0, kPiece, s.input.col, s.input.val,
                                         s_scratch);
      __syncthreads();
      if (nk > 0) add_input_entries(s.input.col, s.input.val, count, a.w, k, nk, K, acc);
    }
  }
  if (nk > 0) store_run(a.dx + row * K + k, nk, acc);
}

// dx[r, chunk] = 0 for the rows of a range of kRange with no nonzero entry (row_strips[r] ==
// 0): each warp reads the range's counts at once. Ranges, not a list: the counts are complete
// only once sparse_rows_kernel has ended, and a range without such rows (almost every one)
// costs one load.
constexpr int kRange = 32;
template <class T>
__device__ __forceinline__ void empty_rows_item(const SparseArgs<T>& a, int64_t range, int chunk) {
  const int64_t r0 = range * kRange;
  const int64_t r = r0 + (threadIdx.x & 31);
  unsigned empty = __ballot_sync(0xffffffffu, r < a.M && a.row_strips[r] == 0);
  const int k = chunk * static_cast<int>(kSparseInputChunk) + kInputPerThread * threadIdx.x;
  const int nk = max(0, min(kInputPerThread, a.K - k));
  const float zeros[kInputPerThread] = {};
  for (; empty != 0 && nk > 0; empty &= empty - 1)
    store_run(a.dx + (r0 + __ffs(empty) - 1) * a.K + k, nk, zeros);
}

// dz[r, c0 .. c0 + nc) as floats, zeros past nc (nc <= 16).
template <class T>
__device__ __forceinline__ void load_strip(const T* __restrict__ dz, int64_t r, int N, int c0,
                                           int nc, float (&v)[kStrip]) {
  const T* p = dz + r * N + c0;
  float half[kStrip / 2];
  load_run(p, min(nc, kStrip / 2), half);
#pragma unroll
  for (int j = 0; j < kStrip / 2; ++j) v[j] = half[j];
  load_run(p + kStrip / 2, max(0, nc - kStrip / 2), half);  // nc <= 8 reads nothing
#pragma unroll
  for (int j = 0; j < kStrip / 2; ++j) v[kStrip / 2 + j] = half[j];
}

// A block per strip of 16 dz columns: the rows whose values there are not all zero, in row
// order, to rows[strip * M ...] and how many to counts[strip], kThreads rows at a time. Where the
// blocks of dW listed them themselves, once per chunk of K, a strip that holds many rows'
// extremes (197 of #75's 1024 rows in one strip, 2 on average) kept its blocks the longest.
// row_strips[r] (zeroed before) gains one for each strip in which row r has a nonzero entry,
// and a row with two or more goes to `others` (their number at counters[5]). The strip's rows
// go to dx's work list in batches of kBatch: (strip, first entry) pairs at batches[...], their
// number at counters[0]; the strip itself to a list for dW: `heavy` where it has more than
// kHeavyRows rows (their number at counters[4]), else `order`, from the front where it has rows
// (counters[1]), from the back where it has none (counters[2]). The counters are zeroed before.
constexpr int kHeavyRows = 4 * kWeightDepth;
template <class T>
__global__ void __launch_bounds__(kThreads)
    sparse_rows_kernel(const T* __restrict__ dz, int M, int N, int* __restrict__ counts,
                       int* __restrict__ rows, int* __restrict__ row_strips,
                       int* __restrict__ counters, int* __restrict__ order,
                       int* __restrict__ heavy, int* __restrict__ others,
                       int2* __restrict__ batches) {
  __shared__ int s_scratch[kWarps];
  const int64_t strip = blockIdx.x;
  const int c0 = static_cast<int>(strip) * kStrip, nc = min(kStrip, N - c0);
  int listed = 0;
  for (int r0 = 0; r0 < M; r0 += kThreads) {
    const int r = r0 + threadIdx.x;
    float v[kStrip] = {};
    if (r < M) load_strip(dz, r, N, c0, nc, v);
    bool nonzero = false;
#pragma unroll
    for (int j = 0; j < kStrip; ++j) nonzero |= v[j] != 0.f;  // NaN too
    int total;
    const int at = listed + block_offset(nonzero, s_scratch, total);
    if (nonzero) {
      rows[strip * M + at] = r;
      // A count (the same whatever the order); the increment that finds one strip there lists
      // the row, once, for a row item
      if (atomicAdd(row_strips + r, 1) == 1) others[atomicAdd(counters + 5, 1)] = r;
    }
    listed += total;
  }
  if (threadIdx.x == 0) {
    counts[strip] = listed;
    // The lists' order varies from run to run; each output's sum does not (one item writes it).
    const int n = (listed + kBatch - 1) / kBatch;
    const int at = n > 0 ? atomicAdd(counters, n) : 0;
    for (int b = 0; b < n; ++b) batches[at + b] = make_int2(static_cast<int>(strip), b * kBatch);
    const int strips = static_cast<int>(gridDim.x), s = static_cast<int>(strip);
    if (listed > kHeavyRows)
      heavy[atomicAdd(counters + 4, 1)] = s;
    else if (listed > 0)
      order[atomicAdd(counters + 1, 1)] = s;
    else
      order[strips - 1 - atomicAdd(counters + 2, 1)] = s;
  }
}

// dx[r, chunk] for each row r of a batch of a strip's rows (those in no other strip:
// row_strips[r] == 1), the strip's 16 rows of w read once for the batch: #75's extremes fall in
// 145 of 512 strips, so w is read a quarter over, where a row at a time reads 16 rows of w for
// every row of dx. The sum runs over the strip's columns in order, zeros skipped: the row
// item's sum, bit for bit. Batches, not whole strips: the strip with 197 of #75's 1024 rows
// would hold one block while the rest waited.
template <class T>
__device__ __forceinline__ void input_strip_item(const SparseArgs<T>& a, int64_t item, int chunks,
                                                 SparseShared& s) {
  const int2 batch = a.batches[item / chunks];
  const int64_t strip = batch.x;
  const int n = min(kBatch, a.counts[strip] - batch.y);
  const int c0 = static_cast<int>(strip) * kStrip, nc = min(kStrip, a.N - c0);
  const int k = static_cast<int>(item % chunks) * static_cast<int>(kSparseStripChunk) +
                kStripPerThread * threadIdx.x;
  const int nk = max(0, min(kStripPerThread, a.K - k));
  if (static_cast<int>(threadIdx.x) < n) {
    const int r = a.rows[strip * a.M + batch.y + threadIdx.x];
    float v[kStrip];
    load_strip(a.dz, r, a.N, c0, nc, v);
    s.strip.row[threadIdx.x] = a.row_strips[r] == 1 ? r : -1;
#pragma unroll
    for (int j = 0; j < kStrip; ++j) s.strip.val[threadIdx.x][j] = v[j];
  }
  float wv[kStrip][kStripPerThread];
#pragma unroll
  for (int j = 0; j < kStrip; ++j) {
    if (j < nc && nk > 0) {
      load_run(a.w + static_cast<int64_t>(c0 + j) * a.K + k, nk, wv[j]);
    } else {
#pragma unroll
      for (int i = 0; i < kStripPerThread; ++i) wv[j][i] = 0.f;
    }
  }
  __syncthreads();
  if (nk == 0) return;
  for (int e = 0; e < n; ++e) {
    const int r = s.strip.row[e];
    if (r < 0) continue;  // a row item's
    float acc[kStripPerThread] = {};
#pragma unroll
    for (int j = 0; j < kStrip; ++j) {
      const float v = s.strip.val[e][j];
      if (v != 0.f) {
#pragma unroll
        for (int i = 0; i < kStripPerThread; ++i) acc[i] = fmaf(v, wv[j][i], acc[i]);
      }
    }
    store_run(a.dx + static_cast<int64_t>(r) * a.K + k, nk, acc);
  }
}

// The n (<= kThreads) rows at strip_rows and their values in the strip's columns, to s.weight.
template <class T>
__device__ __forceinline__ void stage_weight_rows(const SparseArgs<T>& a, const int* strip_rows,
                                                  int n, int c0, int nc, SparseShared& s) {
  __syncthreads();  // the last batch's entries are read (the item loop separates items)
  if (static_cast<int>(threadIdx.x) < n) {
    const int r = strip_rows[threadIdx.x];
    float v[kStrip];
    load_strip(a.dz, r, a.N, c0, nc, v);
    s.weight.row[threadIdx.x] = r;
#pragma unroll
    for (int j = 0; j < kStrip; ++j) s.weight.val[threadIdx.x][j] = v[j];
  }
  __syncthreads();
}

// dW[strip's rows, chunk of kSparseWeightChunk] from the strip's listed rows, staged kThreads at
// a time with their values.
template <class T>
__device__ __forceinline__ void weight_item(const SparseArgs<T>& a, int strip, int chunk,
                                            SparseShared& s) {
  const int K = a.K, c0 = strip * kStrip, nc = min(kStrip, a.N - c0), count = a.counts[strip];
  const int* strip_rows = a.rows + static_cast<int64_t>(strip) * a.M;
  const int k = chunk * static_cast<int>(kSparseWeightChunk) + kWeightPerThread * threadIdx.x;
  const int nk = max(0, min(kWeightPerThread, K - k));
  float acc[kStrip][kWeightPerThread] = {};
  for (int e0 = 0; e0 < count; e0 += kThreads) {
    const int n = min(kThreads, count - e0);
    stage_weight_rows(a, strip_rows + e0, n, c0, nc, s);
    if (nk > 0) add_weight_entries(s.weight.row, s.weight.val, n, a.x, k, nk, K, acc);
  }
  if (nk > 0) {
#pragma unroll
    for (int j = 0; j < kStrip; ++j)
      if (j < nc) store_run(a.dw + static_cast<int64_t>(c0 + j) * K + k, nk, acc[j]);
  }
}

// dW[strip's rows, chunk of kHeavyChunk] for a strip with more than kHeavyRows rows: each warp
// sums a fixed share of the rows (its 32 of every kThreads staged) over its lanes' columns, then
// the warps' sums are added in warp order. A warp's chain of loads and FMAs is then an eighth of
// the strip's rows: as weight_item, the strip holding 212 of #75's 1024 rows ended its items
// last, long after the rest (dW 156 us, the same as with its items taken first).
constexpr int kHeavyChunk = 32 * kWeightPerThread;
template <class T>
__device__ __forceinline__ void heavy_weight_item(const SparseArgs<T>& a, int strip, int chunk,
                                                  SparseShared& s) {
  constexpr int kShare = kThreads / kWarps;
  const int K = a.K, c0 = strip * kStrip, nc = min(kStrip, a.N - c0), count = a.counts[strip];
  const int* strip_rows = a.rows + static_cast<int64_t>(strip) * a.M;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k = chunk * kHeavyChunk + kWeightPerThread * lane;
  const int nk = max(0, min(kWeightPerThread, K - k));
  float acc[kStrip][kWeightPerThread] = {};
  for (int e0 = 0; e0 < count; e0 += kThreads) {
    const int n = min(kThreads, count - e0);
    stage_weight_rows(a, strip_rows + e0, n, c0, nc, s);
    const int first = warp * kShare, mine = min(kShare, n - first);
    if (nk > 0 && mine > 0)
      add_weight_entries(s.weight.row + first, s.weight.val + first, mine, a.x, k, nk, K, acc);
  }
  for (int w = 0; w < kWarps; ++w) {
    __syncthreads();  // the entries (s.heavy shares their memory), then warp w - 1's sum, are read
    if (warp == w) {
#pragma unroll
      for (int j = 0; j < kStrip; ++j)
#pragma unroll
        for (int i = 0; i < kWeightPerThread; ++i) {
          float& sum = s.heavy[j][kWeightPerThread * lane + i];
          sum = w == 0 ? acc[j][i] : sum + acc[j][i];
        }
    }
  }
  __syncthreads();
  constexpr int kPerThread = kStrip * kHeavyChunk / kThreads, kRowThreads = kThreads / kStrip;
  const int j = threadIdx.x / kRowThreads, col = (threadIdx.x % kRowThreads) * kPerThread;
  const int kk = chunk * kHeavyChunk + col, nkk = max(0, min(kPerThread, K - kk));
  if (j < nc && nkk > 0) {
    float v[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) v[i] = s.heavy[j][col + i];
    store_run(a.dw + static_cast<int64_t>(c0 + j) * K + kk, nkk, v);
  }
}

// dW[strip's rows, chunk of kSparseZeroChunk] = 0 for a strip without rows: 16-byte stores where
// dW's rows allow them.
template <class T>
__device__ __forceinline__ void zero_item(const SparseArgs<T>& a, int strip, int chunk) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int K = a.K, c0 = strip * kStrip, nc = min(kStrip, a.N - c0);
  const int k0 = chunk * static_cast<int>(kSparseZeroChunk);
  const int k1 = min(K, k0 + static_cast<int>(kSparseZeroChunk));
  const bool vector = K % kVec == 0 && reinterpret_cast<uintptr_t>(a.dw) % 16 == 0;
  for (int j = 0; j < nc; ++j) {
    T* row = a.dw + static_cast<int64_t>(c0 + j) * K;
    if (vector) {  // k0 and k1 are multiples of kVec
      for (int k = k0 + kVec * static_cast<int>(threadIdx.x); k < k1; k += kVec * kThreads)
        *reinterpret_cast<uint4*>(row + k) = make_uint4(0u, 0u, 0u, 0u);
    } else {
      for (int k = k0 + static_cast<int>(threadIdx.x); k < k1; k += kThreads)
        row[k] = from_float<T>(0.f);
    }
  }
}

// Both products: resident blocks take items from counters[3] (zeroed before) in the order of
// the comment at the top (longest first, pure stores last); a product not asked for has no
// items.
// bf16 at four blocks an SM (64 registers, a few spilled): on #75-like data both products took
// 151 us against 169 at three (80 registers); float32 kept at three, where four spill more and
// took 179 against 180 (a standalone CUDA harness, H100, 2026-11-25, medians of 30 launches).
template <class T>
__global__ void __launch_bounds__(kThreads, std::is_same<T, float>::value ? 3 : 4)
    sparse_products_kernel(const SparseArgs<T> a) {
  __shared__ SparseShared s;
  __shared__ int s_scratch[kWarps];
  __shared__ int64_t s_item;
  const int strips = (a.N + kStrip - 1) / kStrip;
  const auto chunks_of = [&](int64_t chunk) { return static_cast<int>((a.K + chunk - 1) / chunk); };
  const int weight_chunks = chunks_of(kSparseWeightChunk), zero_chunks = chunks_of(kSparseZeroChunk);
  const int heavy_chunks = chunks_of(kHeavyChunk);
  const int row_chunks = chunks_of(kSparseInputChunk), strip_chunks = chunks_of(kSparseStripChunk);
  const bool dx = a.dx != nullptr, dw = a.dw != nullptr;
  const int64_t heavy = dw ? static_cast<int64_t>(a.counters[4]) * heavy_chunks : 0;
  const int64_t others = dx ? static_cast<int64_t>(a.counters[5]) * row_chunks : 0;
  const int64_t batches = dx ? static_cast<int64_t>(a.counters[0]) * strip_chunks : 0;
  const int64_t light = dw ? static_cast<int64_t>(a.counters[1]) * weight_chunks : 0;
  const int64_t ranges = dx ? (a.M + int64_t{kRange} - 1) / kRange * row_chunks : 0;
  const int64_t idle = dw ? static_cast<int64_t>(a.counters[2]) * zero_chunks : 0;
  for (;;) {
    // These two barriers separate items: the last item's shared memory and s_item are read
    // before the next item writes them, so the items themselves start without one
    __syncthreads();
    if (threadIdx.x == 0) s_item = atomicAdd(reinterpret_cast<unsigned*>(a.counters + 3), 1u);
    __syncthreads();
    int64_t item = s_item;
    if (item < heavy) {
      heavy_weight_item(a, a.heavy[item / heavy_chunks], static_cast<int>(item % heavy_chunks), s);
      continue;
    }
    item -= heavy;
    if (item < others) {
      input_row_item(a, a.others[item / row_chunks], static_cast<int>(item % row_chunks), s,
                     s_scratch);
      continue;
    }
    item -= others;
    if (item < batches) {
      input_strip_item(a, item, strip_chunks, s);
      continue;
    }
    item -= batches;
    if (item < light) {
      weight_item(a, a.order[item / weight_chunks], static_cast<int>(item % weight_chunks), s);
      continue;
    }
    item -= light;
    if (item < ranges) {
      empty_rows_item(a, item / row_chunks, static_cast<int>(item % row_chunks));
      continue;
    }
    item -= ranges;
    if (item >= idle) return;
    zero_item(a, a.order[strips - 1 - item / zero_chunks], static_cast<int>(item % zero_chunks));
  }
}

// Blocks of sparse_products_kernel<T> resident on the current GPU at once, queried once per
// device (the attribute calls cost microseconds); a failed query is returned, not kept.
template <class T>
cudaError_t resident_blocks(int& blocks) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::mutex lock;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> guard(lock);
  auto found = known.find(device);
  if (found == known.end()) {
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess)
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sparse_products_kernel<T>,
                                                          kThreads, 0);
    if (err != cudaSuccess) return err;
    if (per_sm * sms < 1) return cudaErrorLaunchOutOfResources;
    found = known.emplace(device, per_sm * sms).first;
  }
  blocks = found->second;
  return cudaSuccess;
}

template <class T>
cudaError_t launch(const T* dz, const T* w, const T* x, T* dx, T* dw, int* scratch, int M,
                   int N, int K, cudaStream_t stream) {
  const int64_t strips = (N + kStrip - 1) / kStrip;
  int* row_strips = scratch;
  int* counters = scratch + M;
  int* counts = counters + kSparseCounters;
  int* order = counts + strips;
  int* heavy = order + strips;
  int* others = heavy + strips;
  int* rows = others + M;
  const int64_t listed_end = 2 * M + kSparseCounters + strips * (3 + M);  // batches: aligned
  int2* batches = reinterpret_cast<int2*>(scratch + listed_end + listed_end % 2);
  int blocks = 0;
  cudaError_t err = resident_blocks<T>(blocks);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(row_strips, 0, sizeof(int) * (M + kSparseCounters), stream);
  if (err != cudaSuccess) return err;
  sparse_rows_kernel<T><<<static_cast<unsigned>(strips), kThreads, 0, stream>>>(
      dz, M, N, counts, rows, row_strips, counters, order, heavy, others, batches);
  // The item counter runs to at most about N * K / 1024 (dW, every strip heavy: 16 x 64 values
  // an item) + M * K / 2048 (dx, every row in several strips) plus the grid: far from 2^32 for
  // operands that fit in a GPU's memory.
  const SparseArgs<T> args{dz, w, x, dx, dw, M, N, K, row_strips, counts, rows, order, heavy,
                           others, batches, counters};
  sparse_products_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace sparse

template <class T>
cudaError_t launch_sparse_products(const T* dz, const T* w, const T* x, T* dx, T* dw,
                                  int* scratch, int M, int N, int K, cudaStream_t stream) {
  return sparse::launch(dz, w, x, dx, dw, scratch, M, N, K, stream);
}

template cudaError_t launch_sparse_products<float>(const float*, const float*, const float*,
                                                   float*, float*, int*, int, int, int,
                                                   cudaStream_t);
template cudaError_t launch_sparse_products<__nv_bfloat16>(const __nv_bfloat16*,
                                                           const __nv_bfloat16*,
                                                           const __nv_bfloat16*, __nv_bfloat16*,
                                                           __nv_bfloat16*, int*, int, int, int,
                                                           cudaStream_t);
template cudaError_t launch_sparse_products<__half>(const __half*, const __half*, const __half*,
                                                    __half*, __half*, int*, int, int, int,
                                                    cudaStream_t);

}  // namespace gemmfuse
