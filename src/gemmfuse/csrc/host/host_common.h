// What the host extension's translation units share (host_*.cpp): the headers, and the checks
// and allocations of every entry point. The host extension does the checks, allocation and
// launches on the current stream for every chain: Python (gemmfuse/ops.py) validates user input
// first and raises readable errors; the checks here are the last line of defence against a
// malformed internal call. Integers enter their messages as text (std::to_string): streaming
// one into a TORCH_CHECK message segfaulted on autograd's thread (host_autograd.cpp).
//
// Built once per torch version, CUDA version and GPU architecture (gemmfuse/jit.py), in
// translation units compiled in parallel, with only the headers they need: not
// torch/extension.h (three times as long to parse), not at::empty's (tensors are allocated with
// Tensor methods), pybind11 only in host_module.cpp. A standalone export compiles them as one
// (binding.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cfloat>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "chain_table.h"
#include "host_entry.h"
#include "split.h"

namespace gemmfuse {
namespace host {

inline const gemmfuse::ChainTable& chain(int64_t table) {
  TORCH_CHECK(table != 0, "gemmfuse: no chain table");
  return *reinterpret_cast<const gemmfuse::ChainTable*>(table);
}

inline void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "gemmfuse: ", what, " failed: ", cudaGetErrorString(err));
}

inline void check_vector(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                  t->numel() == n,
              "gemmfuse: ", name, " must be a contiguous float32 CUDA tensor of ",
              std::to_string(n), " elements");
}

inline std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// n rounded up to the split operands' padding (kKAlign).
inline int64_t split_padded(int64_t n) {
  return (n + gemmfuse::kKAlign - 1) / gemmfuse::kKAlign * gemmfuse::kKAlign;
}

// t, or a copy with unit column stride (what the splits read).
inline at::Tensor unit_stride(const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); }

inline const float* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// A fused kernel's launch code as dispatch.fused_kernel_code decides it (the chain library's
// launch_fused and gemm_split run the code they get).
inline void check_kernel_code(int64_t kernel) {
  TORCH_CHECK(kernel == gemmfuse::kPortableKernel || kernel == gemmfuse::kHopperKernel,
              "gemmfuse: kernel must be a launch code, 1 (portable) or 2 (Hopper), as "
              "dispatch.fused_kernel_code decides it");
}

// Zeroed int32 arrival counters, one set per device, stream and use (kRowCounters: the reducing
// epilogue's, per row band; kWindowCounters: the few-rows GEMV's, per column window;
// kTileCounters: split K's, per output tile; kFollowCounters: a chain kernel following the plain
// GEMM's tiles, per output tile and two more (tile_walk.h), then a reducing chain's row bands
// (host_forward.cpp's follow_flags)): kernels leave them zero, and launches on one stream run in
// order, so a set is reused.
//
// A set outlives the call, so it is made with cudaMalloc, outside the caching allocator:
// torch.compile's CUDA graphs (reduce-overhead) warm a graph up with the allocator routed to
// their private pool, whose memory they hand out again. A call on a stream being captured gets
// counters of its own instead, zeroed in the graph and held in ``keep`` with the call's other
// scratch: a replay then zeroes them before its kernels, and shares them with no other graph or
// stream (a graph replays on whatever stream is current).
enum CounterUse { kRowCounters, kWindowCounters, kTileCounters, kFollowCounters };
inline int* arrival_counters(const at::Tensor& like, int64_t n, cudaStream_t stream, CounterUse use,
                             std::vector<at::Tensor>& keep) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    keep.push_back(like.new_zeros({n}, like.options().dtype(at::kInt)));
    return keep.back().data_ptr<int>();
  }
  struct Set {
    int* counters = nullptr;  // never freed: a set grows rarely, and the old one may be in use
    int64_t n = 0;
  };
  static std::mutex mutex;
  static std::map<std::tuple<int, cudaStream_t, CounterUse>, Set> sets;
  std::lock_guard<std::mutex> lock(mutex);
  Set& set = sets[{like.get_device(), stream, use}];
  if (set.n >= n) return set.counters;
  const int64_t size = std::max<int64_t>(n, 1024);
  c10::cuda::CUDAGuard guard(like.device());
  int* counters = nullptr;
  check_cuda(cudaMalloc(&counters, size * sizeof(int)), "arrival counters' cudaMalloc");
  check_cuda(cudaMemsetAsync(counters, 0, size * sizeof(int), stream), "arrival counters' memset");
  set = Set{counters, size};
  return counters;
}

// The 128 x 128 output tiles of an [M, N] result (split K's partials and counters, the tile
// counts of a chain kernel that follows them).
inline int64_t output_tiles(int64_t M, int64_t N) {
  const int64_t tile = gemmfuse::kTile;
  return ((M + tile - 1) / tile) * ((N + tile - 1) / tile);
}

// Row-band counters of a reducing chain: one per kEpilogueRows16 rows, the bands of the 16-bit
// epilogue path and of a chain kernel following the GEMM's tiles, and enough for the fused
// kernels' kTile-row bands.
inline int64_t row_band_counters(int64_t M) {
  return (M + gemmfuse::kEpilogueRows16 - 1) / gemmfuse::kEpilogueRows16;
}

// The kFollowCounters set of a chain kernel following the plain GEMM's tiles on an [M, N] z: a
// count per output tile and kTileFollowExtra more (tile_walk.h), then, for a reducing chain,
// its row bands. follow_tile_counts: where the row bands start (the counts the GEMM takes).
inline int64_t follow_tile_counts(int64_t M, int64_t N) {
  return output_tiles(M, N) + gemmfuse::kTileFollowExtra;
}
inline int64_t follow_counters(int64_t M, int64_t N, bool reduces) {
  return follow_tile_counts(M, N) + (reduces ? row_band_counters(M) : 0);
}

// GroupNorm moments per (row, kTile-column window): a window meets at most
// (kTile - 1) / group_size + 2 groups, the layout norm_finalize.cuh reads.
inline int segments_per_tile(int64_t group_size) {
  return static_cast<int>((gemmfuse::kTile - 1) / group_size + 2);
}

// Allocates what the launch writes and points `args` at it; returns the tensors, which must
// live until the launch: first the result ([M, N] in out_dtype, or fp32 [M] when the epilogue
// reduces; none when args.out is given and is the result), then scratch. With args.norm_wide
// set, the first kernel writes pre-norm fp32 values to args.out (the result itself for an fp32
// chain without reduction) and per-segment GroupNorm moments.
inline std::vector<at::Tensor> allocate_outputs(const gemmfuse::ChainTable& table,
                                                gemmfuse::FusedArgs& args, const at::Tensor& x,
                                         at::ScalarType out_dtype, cudaStream_t stream) {
  const int64_t M = args.M, N = args.N, tile = gemmfuse::kTile;
  const int64_t n_tiles = (N + tile - 1) / tile;
  const auto f32 = x.options().dtype(at::kFloat);
  const int reduce = table.reduce_kind;
  std::vector<at::Tensor> keep;
  if (reduce != 0) {
    keep.push_back(x.new_empty({M}, f32));
    args.row_out = keep.back().data_ptr<float>();
  } else if (out_dtype != at::kFloat) {  // a 16-bit model's (args.params.model16 says which)
    keep.push_back(x.new_empty({M, N}, x.options().dtype(out_dtype)));
    args.out16 = reinterpret_cast<uint16_t*>(keep.back().data_ptr());
  }
  const bool needs_out = args.norm_wide || (reduce == 0 && out_dtype == at::kFloat);
  if (needs_out && args.out == nullptr) {
    keep.push_back(x.new_empty({M, N}, f32));
    args.out = keep.back().data_ptr<float>();
  }
  if (args.norm_wide) {
    args.stats_per_tile = segments_per_tile(args.group_size);
    keep.push_back(x.new_empty({M, n_tiles * args.stats_per_tile * 4}, f32));
    args.norm_stats = reinterpret_cast<float4*>(keep.back().data_ptr<float>());
  } else if (reduce != 0) {
    // (m, s) pairs for sum, mean and logsumexp (row_reduce.cuh): twice the partials.
    keep.push_back(x.new_empty({reduce >= 3 ? 2 * n_tiles : n_tiles, M}, f32));
    args.row_partial = keep.back().data_ptr<float>();
    // a counter per row band (row_band_counters), unless the call brings its own (a chain
    // kernel following the GEMM's tiles: follow_flags made them before the GEMM)
    if (args.row_counter == nullptr)
      args.row_counter = arrival_counters(x, row_band_counters(M), stream, kRowCounters, keep);
  }
  return keep;
}

// A double rounded to the nearest float, ±inf past float's range, a NaN a NaN: a plain cast is
// undefined in C++ for a value beyond the largest float (a float divisor under 2^-128 in
// magnitude puts its reciprocal there, pointwise.py's _reciprocal). From FLT_MAX plus half its
// ulp on, IEEE rounding (ties to even, FLT_MAX's last bit odd) gives inf.
inline float nearest_float(double v) {
  constexpr double kRoundsToInf = 0x1.ffffffp127;
  if (std::isnan(v)) return NAN;
  if (std::fabs(v) >= kRoundsToInf) return v > 0 ? INFINITY : -INFINITY;
  return static_cast<float>(std::copysign(std::fmin(std::fabs(v), double{FLT_MAX}), v));
}

// Whether a kernel tensor argument of these sizes is read per element (an [M, N] operand, M > 1)
// rather than per channel: set_channel_params' rule, and the plans' (host_plan.cpp,
// host_autograd.cpp).
inline bool per_element(c10::IntArrayRef sizes, int64_t M, int64_t N) {
  return sizes.size() == 2 && sizes[0] == M && sizes[1] == N && M > 1;
}

inline void set_channel_params(gemmfuse::FusedArgs& args, const std::vector<at::Tensor>& vec_params,
                        const std::vector<double>& scalar_params) {
  TORCH_CHECK(vec_params.size() <= gemmfuse::kMaxParams && scalar_params.size() <= gemmfuse::kMaxParams,
              "gemmfuse: too many epilogue arguments");
  for (size_t i = 0; i < vec_params.size(); ++i) {
    const at::Tensor& t = vec_params[i];
    const bool by_element = per_element(t.sizes(), args.M, args.N);
    if (by_element) {
      TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                  "gemmfuse: an [M, N] epilogue tensor argument must be contiguous float32 on CUDA");
    } else {
      check_vector(t, args.N, "epilogue tensor argument");
    }
    args.params.vec[i] = t.data_ptr<float>();
    args.params.vec_row_stride[i] = by_element ? args.N : 0;
  }
  for (size_t i = 0; i < scalar_params.size(); ++i)
    args.params.scalar[i] = nearest_float(scalar_params[i]);
}

// The chain's share of the kernel arguments, checked: sizes, the bias and GroupNorm vectors
// (float32, contiguous, N long), the group size and the epilogue's own arguments.
inline gemmfuse::FusedArgs chain_args(int64_t M, int64_t N, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& gn_weight,
                               const std::optional<at::Tensor>& gn_bias,
                               const std::vector<at::Tensor>& vec_params,
                               const std::vector<double>& scalar_params, int64_t group_size,
                               double eps, bool norm_wide) {
  TORCH_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31), "gemmfuse: sizes must fit in 32 bits");
  TORCH_CHECK(group_size >= 1 && N % group_size == 0, "gemmfuse: group_size must divide N");
  check_vector(bias, N, "bias");
  check_vector(gn_weight, N, "gn_weight");
  check_vector(gn_bias, N, "gn_bias");
  TORCH_CHECK(gn_weight.has_value() == gn_bias.has_value(), "gemmfuse: gn_weight and gn_bias go together");
  gemmfuse::FusedArgs args{};
  args.bias = ptr_or_null(bias);
  args.gn_weight = ptr_or_null(gn_weight);
  args.gn_bias = ptr_or_null(gn_bias);
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(N);
  set_channel_params(args, vec_params, scalar_params);
  args.group_size = static_cast<int>(group_size);
  args.eps = static_cast<float>(eps);
  args.norm_wide = norm_wide ? 1 : 0;
  return args;
}

// The optional z output (autograd's saved GEMM result): [M, N], contiguous, of the model's dtype.
inline void set_z_out(gemmfuse::FusedArgs& args, const std::optional<at::Tensor>& z_out,
               const at::Tensor& x) {
  if (!z_out.has_value()) return;
  TORCH_CHECK(z_out->device() == x.device() && z_out->scalar_type() == x.scalar_type() &&
                  z_out->is_contiguous() && z_out->dim() == 2 && z_out->size(0) == args.M &&
                  z_out->size(1) == args.N,
              "gemmfuse: z_out must be a contiguous [M, N] tensor of x's dtype on x's device");
  if (x.scalar_type() != at::kFloat)  // a 16-bit model's (args.params.model16 says which)
    args.z_out16 = reinterpret_cast<uint16_t*>(z_out->data_ptr());
  else
    args.z_out = z_out->data_ptr<float>();
}

// A split operand (split_rows or split_cols): fp16 hi, lo [rows, k_padded], fp32 scales [rows].
inline void check_split(const at::Tensor& hi, const at::Tensor& lo, const at::Tensor& inv_scale,
                 const char* name) {
  TORCH_CHECK(hi.is_cuda() && hi.scalar_type() == at::kHalf && hi.dim() == 2 &&
                  hi.is_contiguous() && lo.sizes() == hi.sizes() && lo.is_contiguous() &&
                  lo.scalar_type() == at::kHalf && lo.device() == hi.device() &&
                  hi.size(1) % 64 == 0 && hi.size(0) < (int64_t{1} << 31) &&
                  hi.size(1) < (int64_t{1} << 31),
              "gemmfuse: ", name, " must be a split_rows/split_cols result");
  TORCH_CHECK(inv_scale.device() == hi.device(), "gemmfuse: ", name, " scales on another device");
  check_vector(inv_scale, hi.size(0), name);
}

}  // namespace host
}  // namespace gemmfuse
