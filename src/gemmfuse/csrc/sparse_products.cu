// The backward's products dx = dz @ W and dW = dz^T @ x where dz is zero but for a few
// channel groups of each row: a min or max over the channels sends each row's gradient to its
// extremes, and a GroupNorm spreads it over their groups alone (dispatch.sparse_gradient).
// #75 at 1024 x 8192 x 8192 has 16 nonzero columns in a row of 8192: a dense product spends
// 99.8% of its multiplications on zeros, where these kernels read the nonzero entries and the
// rows of W (or x) they select, and write the result.
//
// dz's columns are cut into strips of 16. sparse_rows_kernel lists, per strip, the rows with a
// nonzero entry there (in row order) and counts each row's strips. dx: the rows of one strip
// (almost all: #75's ties are rare) from sparse_input_strip_kernel, which reads the strip's 16
// rows of W once per batch of rows; the rest (ties over strips, empty rows) from
// sparse_grad_input_kernel, a row at a time. dW: sparse_grad_weight_kernel, resident blocks
// taking (strip, chunk of K) items from a counter, each summing its strip's listed rows, then
// the idle strips' zeros. Every output is a float sum in a fixed order (columns, or rows,
// ascending; the row lists come from block-wide scans, not atomics; each output is one
// item's), rounded once: the same on every run. A NaN in dz is nonzero and reaches the
// products as in a dense one. dx skips dz's zero entries, and dW the rows whose strip of dz is
// all zero, where a dense product would turn an inf or NaN of W or x times those zeros into
// NaN (dW multiplies the zeros within a listed row's strip, as a dense product does).
//
// Measured on #75's bf16 backward (H100, 2026-11-25, torch.profiler, the kernels of 12c2ff5,
// dW then a block per (strip, chunk)): rows 12 us, dx 71 + 27 us, dW 154 us, against cuBLAS's
// 158 and 178; float32 models, where PyTorch's products take 2.6 ms each, gain the most. dW as
// items (3680ce2; H100, 2026-11-25, a standalone CUDA harness, not kept, that ran this file and
// 6c22eb8's on #75-like data, 1024 x 8192 x 8192 with one strip holding 197 rows' extremes,
// outputs equal bit for bit, medians of 20 launches): 142 us against 162, float32 121 against
// 144; its idle strips' zeros alone take 41 us, the strips with rows 118 (float32: 62), a cost
// not yet explained (loads batched eight at a time for every strip, not only the long ones, did
// not change it; at 80 registers three blocks fit an SM).
#include <cstdint>
#include <type_traits>

#include "sparse_products.h"

namespace gemmfuse {
// A named namespace, not an anonymous one: a standalone export compiles this file in one
// translation unit with the chain's parts, whose gemmfuse::kThreads an anonymous namespace's
// names would make ambiguous.
namespace sparse {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kInputPerThread = 8;   // dx columns per thread: a chunk of 2048
constexpr int kStrip = kSparseStrip;  // dz columns (dW rows) per dW item
constexpr int kWeightPerThread = 2;  // dW columns per thread: a chunk of 512
constexpr int kStripPerThread = 2;  // dx columns per thread of the strip kernel: a chunk of 512
constexpr int kBatch = kSparseBatch;
// Entries whose loads a thread has in flight at once: dx's four (more registers, fewer blocks
// per SM: 8 took 113 registers against 64, the same bytes in flight per SM), dW's eight.
constexpr int kInputDepth = 4, kWeightDepth = 8;
static_assert(kThreads * kInputPerThread == kSparseInputChunk, "dx chunk");
static_assert(kThreads * kWeightPerThread == kSparseWeightChunk, "dW chunk");
constexpr int64_t kSparseStripChunk = kThreads * kStripPerThread;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
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

// dx's row kernel lists its row's nonzero entries in shared memory where they fit (the usual
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

// Block (row, chunk of K): dx[row, chunk] for a row whose nonzero entries are not in one strip
// alone (sparse_input_strip_kernel takes those): in two or more (ties; groups that straddle
// strips), or in none (dx's row is then zero).
template <class T>
__global__ void __launch_bounds__(kThreads)
    sparse_grad_input_kernel(const T* __restrict__ dz, const T* __restrict__ w,
                             const int* __restrict__ row_strips, T* __restrict__ dx, int N,
                             int K) {
  constexpr int kPiece = kThreads * kInputPerThread;
  __shared__ int s_col[kPiece];
  __shared__ float s_val[kPiece];
  __shared__ int s_scratch[kWarps];
  const int64_t row = blockIdx.x;
  if (row_strips[row] == 1) return;
  const T* dz_row = dz + row * N;
  const int k = blockIdx.y * static_cast<int>(kSparseInputChunk) + kInputPerThread * threadIdx.x;
  const int nk = max(0, min(kInputPerThread, K - k));
  float acc[kInputPerThread] = {};
  int listed = 0;
  bool fits = true;
  for (int c0 = 0; c0 < N && fits; c0 += kPiece) {
    const int count = list_input_piece(dz_row, c0, N, listed, kPiece, s_col, s_val, s_scratch);
    fits = listed + count <= kPiece;
    listed += count;
  }
  __syncthreads();
  if (fits) {
    if (nk > 0) add_input_entries(s_col, s_val, listed, w, k, nk, K, acc);
  } else {
    for (int c0 = 0; c0 < N; c0 += kPiece) {
      __syncthreads();  // the last piece's entries are read
      const int count = list_input_piece(dz_row, c0, N, 0, kPiece, s_col, s_val, s_scratch);
      __syncthreads();
      if (nk > 0) add_input_entries(s_col, s_val, count, w, k, nk, K, acc);
    }
  }
  if (nk > 0) store_run(dx + row * K + k, nk, acc);
}

// dW: entry e is row s_row[e] of dz with its strip's values s_val[e][0..16); each thread adds
// value[j] * x[row, its 2 columns] into dW row j of the strip, kWeightDepth entries' loads in
// flight. (add_input_entries' loop shape, with an outer product in place of a scaled row.)
template <class T>
__device__ __forceinline__ void add_weight_entries(const int* s_row,
                                                   const float (*s_val)[kStrip + 1], int count,
                                                   const T* __restrict__ x, int k, int nk, int K,
                                                   float (&acc)[kStrip][kWeightPerThread]) {
  int e = 0;
  for (; e + kWeightDepth <= count; e += kWeightDepth) {
    float xv[kWeightDepth][kWeightPerThread];
#pragma unroll
    for (int u = 0; u < kWeightDepth; ++u)
      load_run(x + static_cast<int64_t>(s_row[e + u]) * K + k, nk, xv[u]);
#pragma unroll
    for (int u = 0; u < kWeightDepth; ++u) {
#pragma unroll
      for (int j = 0; j < kStrip; ++j) {
        const float a = s_val[e + u][j];
#pragma unroll
        for (int i = 0; i < kWeightPerThread; ++i) acc[j][i] = fmaf(a, xv[u][i], acc[j][i]);
      }
    }
  }
  for (; e < count; ++e) {
    float xv[kWeightPerThread];
    load_run(x + static_cast<int64_t>(s_row[e]) * K + k, nk, xv);
#pragma unroll
    for (int j = 0; j < kStrip; ++j) {
      const float a = s_val[e][j];
#pragma unroll
      for (int i = 0; i < kWeightPerThread; ++i) acc[j][i] = fmaf(a, xv[i], acc[j][i]);
    }
  }
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
// row_strips[r] (zeroed before) gains one for each strip in which row r has a nonzero entry;
// the strip's rows go to dx's work list in batches of kBatch: (strip, first entry) pairs at
// batches[...], their number at counters[0]; the strip itself to `order`, from the front where
// it has rows (their number at counters[1]), from the back where it has none (counters[2]).
// The counters are zeroed before.
template <class T>
__global__ void __launch_bounds__(kThreads)
    sparse_rows_kernel(const T* __restrict__ dz, int M, int N, int* __restrict__ counts,
                       int* __restrict__ rows, int* __restrict__ row_strips,
                       int* __restrict__ counters, int* __restrict__ order,
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
      atomicAdd(row_strips + r, 1);  // a count: the same whatever the order
    }
    listed += total;
  }
  if (threadIdx.x == 0) {
    counts[strip] = listed;
    // The lists' order varies from run to run; each output's sum does not (one item writes it).
    const int n = (listed + kBatch - 1) / kBatch;
    const int at = n > 0 ? atomicAdd(counters, n) : 0;
    for (int b = 0; b < n; ++b) batches[at + b] = make_int2(static_cast<int>(strip), b * kBatch);
    const int strips = static_cast<int>(gridDim.x);
    order[listed > 0 ? atomicAdd(counters + 1, 1) : strips - 1 - atomicAdd(counters + 2, 1)] =
        static_cast<int>(strip);
  }
}

// dx[r, chunk] for each row r listed in a strip that has no nonzero entry elsewhere
// (row_strips[r] == 1), the strip's 16 rows of w read once for all of a batch: #75's extremes
// fall in 145 of 512 strips, so w is read a quarter over, where the row kernel reads 16 rows of
// w for every row of dx. The sum runs over the strip's columns in order, zeros skipped: the row
// kernel's sum, bit for bit. Blocks stay resident and take (batch, chunk) items in turn: one
// item per (strip, chunk) left the strip with 197 of #75's 1024 rows to a few blocks, which the
// rest waited for (86-107 us); rows are independent, so a strip's batches share the work.
template <class T>
__global__ void __launch_bounds__(kThreads)
    sparse_input_strip_kernel(const T* __restrict__ dz, const T* __restrict__ w,
                              const int* __restrict__ counts, const int* __restrict__ rows,
                              const int* __restrict__ row_strips,
                              const int* __restrict__ batch_count,
                              const int2* __restrict__ batches, T* __restrict__ dx, int M, int N,
                              int K) {
  __shared__ int s_row[kBatch];
  __shared__ float s_val[kBatch][kStrip + 1];
  const int chunks = static_cast<int>((K + kSparseStripChunk - 1) / kSparseStripChunk);
  const int64_t items = static_cast<int64_t>(*batch_count) * chunks;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int2 batch = batches[item / chunks];
    const int64_t strip = batch.x;
    const int n = min(kBatch, counts[strip] - batch.y);
    const int c0 = static_cast<int>(strip) * kStrip, nc = min(kStrip, N - c0);
    const int k = static_cast<int>(item % chunks) * static_cast<int>(kSparseStripChunk) +
                  kStripPerThread * threadIdx.x;
    const int nk = max(0, min(kStripPerThread, K - k));
    __syncthreads();  // the last item's entries are read
    if (static_cast<int>(threadIdx.x) < n) {
      const int r = rows[strip * M + batch.y + threadIdx.x];
      float v[kStrip];
      load_strip(dz, r, N, c0, nc, v);
      s_row[threadIdx.x] = row_strips[r] == 1 ? r : -1;
#pragma unroll
      for (int j = 0; j < kStrip; ++j) s_val[threadIdx.x][j] = v[j];
    }
    float wv[kStrip][kStripPerThread];
#pragma unroll
    for (int j = 0; j < kStrip; ++j) {
      if (j < nc && nk > 0) {
        load_run(w + static_cast<int64_t>(c0 + j) * K + k, nk, wv[j]);
      } else {
#pragma unroll
        for (int i = 0; i < kStripPerThread; ++i) wv[j][i] = 0.f;
      }
    }
    __syncthreads();
    if (nk == 0) continue;
    for (int e = 0; e < n; ++e) {
      const int r = s_row[e];
      if (r < 0) continue;  // the row kernel's
      float acc[kStripPerThread] = {};
#pragma unroll
      for (int j = 0; j < kStrip; ++j) {
        const float a = s_val[e][j];
        if (a != 0.f) {
#pragma unroll
          for (int i = 0; i < kStripPerThread; ++i) acc[i] = fmaf(a, wv[j][i], acc[i]);
        }
      }
      store_run(dx + static_cast<int64_t>(r) * K + k, nk, acc);
    }
  }
}

// dW[strip's rows, chunk] from the strip's listed rows, staged kThreads at a time with their
// values.
template <class T>
__device__ __forceinline__ void weight_item(const T* __restrict__ dz, const T* __restrict__ x,
                                            const int* __restrict__ strip_rows, int count, int c0,
                                            int nc, int chunk, T* __restrict__ dw, int N, int K,
                                            int* s_row, float (*s_val)[kStrip + 1]) {
  const int k = chunk * static_cast<int>(kSparseWeightChunk) + kWeightPerThread * threadIdx.x;
  const int nk = max(0, min(kWeightPerThread, K - k));
  float acc[kStrip][kWeightPerThread] = {};
  for (int e0 = 0; e0 < count; e0 += kThreads) {
    const int n = min(kThreads, count - e0);
    __syncthreads();  // the last batch's entries are read
    if (static_cast<int>(threadIdx.x) < n) {
      const int r = strip_rows[e0 + threadIdx.x];
      float v[kStrip];
      load_strip(dz, r, N, c0, nc, v);
      s_row[threadIdx.x] = r;
#pragma unroll
      for (int j = 0; j < kStrip; ++j) s_val[threadIdx.x][j] = v[j];
    }
    __syncthreads();
    if (nk > 0) add_weight_entries(s_row, s_val, n, x, k, nk, K, acc);
  }
  if (nk > 0) {
#pragma unroll
    for (int j = 0; j < kStrip; ++j)
      if (j < nc) store_run(dw + static_cast<int64_t>(c0 + j) * K + k, nk, acc[j]);
  }
}

// dW[strip's rows, chunk of kSparseZeroChunk] = 0 for a strip without rows: 16-byte stores where
// dW's rows allow them.
template <class T>
__device__ __forceinline__ void zero_item(int c0, int nc, int chunk, T* __restrict__ dw, int K) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int k0 = chunk * static_cast<int>(kSparseZeroChunk);
  const int k1 = min(K, k0 + static_cast<int>(kSparseZeroChunk));
  const bool vector = K % kVec == 0 && reinterpret_cast<uintptr_t>(dw) % 16 == 0;
  for (int j = 0; j < nc; ++j) {
    T* row = dw + static_cast<int64_t>(c0 + j) * K;
    if (vector) {  // k0 and k1 are multiples of kVec
      for (int k = k0 + kVec * static_cast<int>(threadIdx.x); k < k1; k += kVec * kThreads)
        *reinterpret_cast<uint4*>(row + k) = make_uint4(0u, 0u, 0u, 0u);
    } else {
      for (int k = k0 + static_cast<int>(threadIdx.x); k < k1; k += kThreads)
        row[k] = from_float<T>(0.f);
    }
  }
}

// dW: resident blocks take work items in turn from counters[3] (zeroed before): first (strip
// with rows, chunk of K) items, a block's sum over the strip's listed rows in row order, then
// the idle strips' zeros. A block per (strip, chunk), 8192 of them for #75 with almost every
// strip idle, kept the SMs busy less than half the kernel's 177 us (ncu, H100, 2026-11-25);
// the items come from a counter so that the strip holding most extremes (197 of #75's 1024
// rows) does not hold up the blocks that would follow it.
template <class T>
__global__ void __launch_bounds__(kThreads)
    sparse_grad_weight_kernel(const T* __restrict__ dz, const T* __restrict__ x,
                              const int* __restrict__ counts, const int* __restrict__ rows,
                              const int* __restrict__ order, int* __restrict__ counters,
                              T* __restrict__ dw, int M, int N, int K) {
  __shared__ int s_row[kThreads];
  __shared__ float s_val[kThreads][kStrip + 1];  // +1: a thread's row of values, own banks
  __shared__ int64_t s_item;
  const int strips = (N + kStrip - 1) / kStrip, busy = counters[1];
  const int chunks = static_cast<int>((K + kSparseWeightChunk - 1) / kSparseWeightChunk);
  const int zero_chunks = static_cast<int>((K + kSparseZeroChunk - 1) / kSparseZeroChunk);
  const int64_t weighted = static_cast<int64_t>(busy) * chunks;
  const int64_t items = weighted + static_cast<int64_t>(strips - busy) * zero_chunks;
  for (;;) {
    __syncthreads();  // the last item's s_item and entries are read
    if (threadIdx.x == 0) s_item = atomicAdd(reinterpret_cast<unsigned*>(counters + 3), 1u);
    __syncthreads();
    const int64_t item = s_item;
    if (item >= items) return;
    if (item < weighted) {
      const int strip = order[item / chunks];
      const int c0 = strip * kStrip;
      weight_item(dz, x, rows + static_cast<int64_t>(strip) * M, counts[strip], c0,
                  min(kStrip, N - c0), static_cast<int>(item % chunks), dw, N, K, s_row, s_val);
    } else {
      const int64_t idle = (item - weighted) / zero_chunks;
      const int strip = order[busy + idle], c0 = strip * kStrip;
      zero_item(c0, min(kStrip, N - c0), static_cast<int>((item - weighted) % zero_chunks), dw, K);
    }
  }
}

int sm_count() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

template <class T>
cudaError_t launch(const T* dz, const T* w, const T* x, T* dx, T* dw, int* scratch, int M,
                   int N, int K, cudaStream_t stream) {
  const int64_t strips = (N + kStrip - 1) / kStrip;
  int* row_strips = scratch;
  int* counters = scratch + M;
  int* counts = counters + kSparseCounters;
  int* order = counts + strips;
  int* rows = order + strips;
  const int64_t listed_end = M + kSparseCounters + strips * (2 + M);  // batches: 8-byte aligned
  int2* batches = reinterpret_cast<int2*>(scratch + listed_end + listed_end % 2);
  cudaError_t err = cudaMemsetAsync(row_strips, 0, sizeof(int) * (M + kSparseCounters), stream);
  if (err != cudaSuccess) return err;
  sparse_rows_kernel<T><<<static_cast<unsigned>(strips), kThreads, 0, stream>>>(
      dz, M, N, counts, rows, row_strips, counters, order, batches);
  // Resident grids (their blocks take items in turn): four blocks an SM, as many as dx's strip
  // kernel fits; dW's 80 registers fit three, and its fourth blocks find the items taken
  const unsigned resident = static_cast<unsigned>(4 * sm_count());
  if (dx != nullptr) {
    sparse_input_strip_kernel<T><<<resident, kThreads, 0, stream>>>(
        dz, w, counts, rows, row_strips, counters, batches, dx, M, N, K);
    // A block per chunk: the rows it takes are few (ties), and each would do its chunks in turn
    // (a block per row, its chunks in turn, took 42 us against 20 on #75-like data; resident
    // blocks taking (row, chunk) items in turn, 42 us too: the few tie rows' latency bounds it)
    const dim3 row_grid(M, static_cast<unsigned>((K + kSparseInputChunk - 1) / kSparseInputChunk));
    sparse_grad_input_kernel<T><<<row_grid, kThreads, 0, stream>>>(dz, w, row_strips, dx, N, K);
  }
  if (dw != nullptr) {
    // The item counter runs to (strips with rows) * K / 512 + (idle strips) * K / 2048 plus the
    // grid: about N * K / 8192, far from 2^32 for any dW that fits in a GPU's memory.
    sparse_grad_weight_kernel<T><<<resident, kThreads, 0, stream>>>(dz, x, counts, rows, order,
                                                                   counters, dw, M, N, K);
  }
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

}  // namespace gemmfuse
