// Host side of one fused-linear extension: checks, allocation and launches on the current
// stream. Python (gemmfuse/ops.py) validates user input first and raises readable errors;
// the checks here are the last line of defence against a malformed internal call.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "fused_args.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "gemmfuse: ", what, " failed: ", cudaGetErrorString(err));
}

void check_vector(const c10::optional<torch::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                  t->numel() == n,
              "gemmfuse: ", name, " must be a contiguous float32 CUDA tensor of ", n, " elements");
}

const float* ptr_or_null(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// Zeroed int32 arrival counters, one set per device, stream and use (kRowCounters: the reducing
// epilogue's, per row tile; kWindowCounters: the few-rows GEMV's, per column window): kernels
// leave them zero, and launches on one stream run in order, so a set is reused.
enum CounterUse { kRowCounters, kWindowCounters };
int* arrival_counters(const torch::Tensor& like, int64_t n, cudaStream_t stream, CounterUse use) {
  static std::mutex mutex;
  static std::map<std::tuple<int, cudaStream_t, CounterUse>, torch::Tensor> counters;
  std::lock_guard<std::mutex> lock(mutex);
  auto& counter = counters[{like.get_device(), stream, use}];
  if (!counter.defined() || counter.numel() < n)
    counter = torch::zeros({std::max<int64_t>(n, 64)}, like.options().dtype(torch::kInt32));
  return counter.data_ptr<int>();
}

// GroupNorm moments per (row, kTile-column window): a window meets at most
// (kTile - 1) / group_size + 2 groups, the layout norm_finalize.cuh reads.
int segments_per_tile(int64_t group_size) {
  return static_cast<int>((gemmfuse::fused_tile() - 1) / group_size + 2);
}

// Allocates what the launch writes and points `args` at it; returns the tensors, which must
// live until the launch: first the result ([M, N] in out_dtype, or fp32 [M] when the epilogue
// reduces; none when args.out is given and is the result), then scratch. With args.norm_wide
// set, the first kernel writes pre-norm fp32 values to args.out (the result itself for an fp32
// chain without reduction) and per-segment GroupNorm moments.
std::vector<torch::Tensor> allocate_outputs(gemmfuse::FusedArgs& args, const torch::Tensor& x,
                                            torch::ScalarType out_dtype, cudaStream_t stream) {
  const int64_t M = args.M, N = args.N, tile = gemmfuse::fused_tile();
  const int64_t n_tiles = (N + tile - 1) / tile, m_tiles = (M + tile - 1) / tile;
  const auto f32 = x.options().dtype(torch::kFloat32);
  const int reduce = gemmfuse::fused_reduce_kind();
  std::vector<torch::Tensor> keep;
  if (reduce != 0) {
    keep.push_back(torch::empty({M}, f32));
    args.row_out = keep.back().data_ptr<float>();
  } else if (out_dtype == torch::kBFloat16) {
    keep.push_back(torch::empty({M, N}, x.options().dtype(out_dtype)));
    args.out_bf16 = reinterpret_cast<__nv_bfloat16*>(keep.back().data_ptr());
  }
  const bool needs_out = args.norm_wide || (reduce == 0 && out_dtype != torch::kBFloat16);
  if (needs_out && args.out == nullptr) {
    keep.push_back(torch::empty({M, N}, f32));
    args.out = keep.back().data_ptr<float>();
  }
  if (args.norm_wide) {
    args.stats_per_tile = segments_per_tile(args.group_size);
    keep.push_back(torch::empty({M, n_tiles * args.stats_per_tile * 4}, f32));
    args.norm_stats = reinterpret_cast<float4*>(keep.back().data_ptr<float>());
  } else if (reduce != 0) {
    // (m, s) pairs for sum, mean and logsumexp (row_reduce.cuh): twice the partials.
    keep.push_back(torch::empty({reduce >= 3 ? 2 * n_tiles : n_tiles, M}, f32));
    args.row_partial = keep.back().data_ptr<float>();
    args.row_counter = arrival_counters(x, m_tiles, stream, kRowCounters);
  }
  return keep;
}

void set_channel_params(gemmfuse::FusedArgs& args, const std::vector<torch::Tensor>& vec_params,
                        const std::vector<double>& scalar_params) {
  TORCH_CHECK(vec_params.size() <= gemmfuse::kMaxParams && scalar_params.size() <= gemmfuse::kMaxParams,
              "gemmfuse: too many epilogue arguments");
  for (size_t i = 0; i < vec_params.size(); ++i) {
    check_vector(vec_params[i], args.N, "epilogue tensor argument");
    args.params.vec[i] = vec_params[i].data_ptr<float>();
  }
  for (size_t i = 0; i < scalar_params.size(); ++i)
    args.params.scalar[i] = static_cast<float>(scalar_params[i]);
}

// The chain's share of the kernel arguments, checked: sizes, the bias and GroupNorm vectors
// (float32, contiguous, N long), the group size and the epilogue's own arguments.
gemmfuse::FusedArgs chain_args(int64_t M, int64_t N, const c10::optional<torch::Tensor>& bias,
                               const c10::optional<torch::Tensor>& gn_weight,
                               const c10::optional<torch::Tensor>& gn_bias,
                               const std::vector<torch::Tensor>& vec_params,
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
void set_z_out(gemmfuse::FusedArgs& args, const c10::optional<torch::Tensor>& z_out,
               const torch::Tensor& x) {
  if (!z_out.has_value()) return;
  TORCH_CHECK(z_out->device() == x.device() && z_out->scalar_type() == x.scalar_type() &&
                  z_out->is_contiguous() && z_out->dim() == 2 && z_out->size(0) == args.M &&
                  z_out->size(1) == args.N,
              "gemmfuse: z_out must be a contiguous [M, N] tensor of x's dtype on x's device");
  if (x.scalar_type() == torch::kBFloat16)
    args.z_out_bf16 = reinterpret_cast<__nv_bfloat16*>(z_out->data_ptr());
  else
    args.z_out = z_out->data_ptr<float>();
}

// A split operand (split_rows or split_cols): fp16 hi, lo [rows, k_padded], fp32 scales [rows].
void check_split(const torch::Tensor& hi, const torch::Tensor& lo, const torch::Tensor& inv_scale,
                 const char* name) {
  TORCH_CHECK(hi.is_cuda() && hi.scalar_type() == torch::kFloat16 && hi.dim() == 2 &&
                  hi.is_contiguous() && lo.sizes() == hi.sizes() && lo.is_contiguous() &&
                  lo.scalar_type() == torch::kFloat16 && lo.device() == hi.device() &&
                  hi.size(1) % 64 == 0 && hi.size(0) < (int64_t{1} << 31) &&
                  hi.size(1) < (int64_t{1} << 31),
              "gemmfuse: ", name, " must be a split_rows/split_cols result");
  TORCH_CHECK(inv_scale.device() == hi.device(), "gemmfuse: ", name, " scales on another device");
  check_vector(inv_scale, hi.size(0), name);
}

}  // namespace

// Splits rows of a float32 [rows, k] matrix (unit column stride) into fp16 hi/lo
// [rows, k_padded] and the per-row inverse power-of-two scale.
std::vector<torch::Tensor> split_rows(torch::Tensor x, int64_t k_padded) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: split_rows needs a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(k_padded >= x.size(1) && k_padded % 64 == 0, "gemmfuse: bad k_padded");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31) && k_padded < (int64_t{1} << 31),
              "gemmfuse: split_rows sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  const auto rows = x.size(0);
  auto half_opts = x.options().dtype(torch::kFloat16);
  auto hi = torch::empty({rows, k_padded}, half_opts);
  auto lo = torch::empty({rows, k_padded}, half_opts);
  auto inv_scale = torch::empty({rows}, x.options());
  check_cuda(gemmfuse::launch_split_rows_f32(
                 x.data_ptr<float>(), x.stride(0), static_cast<int>(rows), static_cast<int>(x.size(1)),
                 static_cast<int>(k_padded), reinterpret_cast<__half*>(hi.data_ptr<at::Half>()),
                 reinterpret_cast<__half*>(lo.data_ptr<at::Half>()), inv_scale.data_ptr<float>(),
                 at::cuda::getCurrentCUDAStream()),
             "split_rows launch");
  return {hi, lo, inv_scale};
}

// The transposed split: x [rows, cols] float32 (unit column stride) -> fp16 hi, lo
// [cols, rows_padded] and the per-column inverse power-of-two scale [cols]: split_rows of x^T.
std::vector<torch::Tensor> split_cols(torch::Tensor x, int64_t rows_padded) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: split_cols needs a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(rows_padded >= x.size(0) && rows_padded % 64 == 0, "gemmfuse: bad rows_padded");
  TORCH_CHECK(rows_padded < (int64_t{1} << 31) && x.size(1) < (int64_t{1} << 31),
              "gemmfuse: split_cols sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  const int rows = static_cast<int>(x.size(0)), cols = static_cast<int>(x.size(1));
  auto half_opts = x.options().dtype(torch::kFloat16);
  auto hi = torch::empty({cols, rows_padded}, half_opts);
  auto lo = torch::empty({cols, rows_padded}, half_opts);
  auto inv_scale = torch::empty({cols}, x.options());
  auto col_max = torch::empty({std::max(gemmfuse::split_cols_chunks(rows), 1), cols}, x.options());
  check_cuda(gemmfuse::launch_split_cols_f32(
                 x.data_ptr<float>(), x.stride(0), rows, cols, static_cast<int>(rows_padded),
                 reinterpret_cast<__half*>(hi.data_ptr<at::Half>()),
                 reinterpret_cast<__half*>(lo.data_ptr<at::Half>()), inv_scale.data_ptr<float>(),
                 col_max.data_ptr<float>(), at::cuda::getCurrentCUDAStream()),
             "split_cols launch");
  return {hi, lo, inv_scale};
}

// The backward's products: a [M, K] and b [N, K], both split (split_rows / split_cols, K padded
// alike) -> a @ b^T, float32 [M, N], on the fused kernels (kernel and split as in fused_forward).
// Runs only in the plain GEMM's extension, whose epilogue is the identity.
torch::Tensor gemm_split(torch::Tensor a_hi, torch::Tensor a_lo, torch::Tensor a_inv_scale,
                         torch::Tensor b_hi, torch::Tensor b_lo, torch::Tensor b_inv_scale,
                         int64_t kernel, bool split) {
  TORCH_CHECK(gemmfuse::fused_is_plain(), "gemmfuse: gemm_split needs the plain GEMM's extension");
  check_split(a_hi, a_lo, a_inv_scale, "a");
  check_split(b_hi, b_lo, b_inv_scale, "b");
  TORCH_CHECK(a_hi.size(1) == b_hi.size(1) && a_hi.device() == b_hi.device(),
              "gemmfuse: a and b must share K and device");
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "gemmfuse: kernel must be 0 (auto), 1 or 2");
  gemmfuse::FusedArgs args = chain_args(a_hi.size(0), b_hi.size(0), c10::nullopt, c10::nullopt,
                                        c10::nullopt, {}, {}, 1, 0.0, false);
  c10::cuda::CUDAGuard guard(a_hi.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  args.a_hi = reinterpret_cast<const __half*>(a_hi.data_ptr<at::Half>());
  args.a_lo = reinterpret_cast<const __half*>(a_lo.data_ptr<at::Half>());
  args.a_inv_scale = a_inv_scale.data_ptr<float>();
  args.b_hi = reinterpret_cast<const __half*>(b_hi.data_ptr<at::Half>());
  args.b_lo = reinterpret_cast<const __half*>(b_lo.data_ptr<at::Half>());
  args.b_inv_scale = b_inv_scale.data_ptr<float>();
  args.k_padded = args.k_cols = static_cast<int>(a_hi.size(1));
  args.a_row_stride = args.b_row_stride = a_hi.size(1);
  args.split = split ? 1 : 0;
  const auto outputs = allocate_outputs(args, a_inv_scale, torch::kFloat32, stream);
  check_cuda(gemmfuse::launch_fused(args, static_cast<int>(kernel), stream), "gemm_split launch");
  return outputs.front();
}

// x [M, K] float32 -> epilogue(x @ W^T + bias): [M, N], or [M] when the epilogue reduces
// across channels. W arrives pre-split (split_rows) as w_hi, w_lo [N, k_padded], w_inv_scale [N].
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor w_hi, torch::Tensor w_lo,
                            torch::Tensor w_inv_scale, c10::optional<torch::Tensor> bias,
                            c10::optional<torch::Tensor> gn_weight,
                            c10::optional<torch::Tensor> gn_bias, std::vector<torch::Tensor> vec_params,
                            std::vector<double> scalar_params, int64_t group_size, double eps,
                            int64_t kernel, bool split, bool norm_wide,
                            c10::optional<torch::Tensor> z_out) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "gemmfuse: x must be a 2-D float32 CUDA tensor");
  const int64_t M = x.size(0), N = w_hi.size(0), k_padded = w_hi.size(1);
  TORCH_CHECK(w_hi.scalar_type() == torch::kFloat16 && w_lo.sizes() == w_hi.sizes() &&
                  w_hi.is_contiguous() && w_lo.is_contiguous() && w_hi.device() == x.device(),
              "gemmfuse: malformed weight split");
  TORCH_CHECK(x.size(1) <= k_padded && k_padded - x.size(1) < 64, "gemmfuse: x and weight K differ");
  check_vector(w_inv_scale, N, "w_inv_scale");
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();

  x = x.stride(1) == 1 ? x : x.contiguous();
  auto a = split_rows(x, k_padded);

  args.a_hi = reinterpret_cast<const __half*>(a[0].data_ptr<at::Half>());
  args.a_lo = reinterpret_cast<const __half*>(a[1].data_ptr<at::Half>());
  args.a_inv_scale = a[2].data_ptr<float>();
  args.b_hi = reinterpret_cast<const __half*>(w_hi.data_ptr<at::Half>());
  args.b_lo = reinterpret_cast<const __half*>(w_lo.data_ptr<at::Half>());
  args.b_inv_scale = w_inv_scale.data_ptr<float>();
  args.k_padded = static_cast<int>(k_padded);
  args.k_cols = static_cast<int>(k_padded);  // the split pre-pass zero-pads to k_padded
  args.a_row_stride = args.b_row_stride = k_padded;
  args.split = split ? 1 : 0;
  set_z_out(args, z_out, x);

  TORCH_CHECK(kernel >= 0 && kernel <= 2, "gemmfuse: kernel must be 0 (auto), 1 or 2");
  const auto outputs = allocate_outputs(args, x, torch::kFloat32, stream);
  check_cuda(gemmfuse::launch_fused(args, static_cast<int>(kernel), stream), "fused kernel launch");
  return outputs.front();
}

// A bfloat16 model on Hopper: x [M, K] and W [N, K] in bf16 go to the tensor cores as they are
// (one pass, fp32 accumulation); the epilogue runs in fp32 (the bias and GroupNorm vectors come
// as float32); the output is bf16 ([M, N], or [M] when the epilogue reduces). K must be a
// multiple of 8 (16-byte rows for TMA).
torch::Tensor fused_forward_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                 c10::optional<torch::Tensor> gn_weight,
                                 c10::optional<torch::Tensor> gn_bias,
                                 std::vector<torch::Tensor> vec_params,
                                 std::vector<double> scalar_params, int64_t group_size, double eps,
                                 bool norm_wide, c10::optional<torch::Tensor> z_out) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: x must be a 2-D bfloat16 CUDA tensor with unit column stride");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous() &&
                  w.device() == x.device() && w.size(1) == x.size(1),
              "gemmfuse: w must be a contiguous bfloat16 [N, K] tensor on x's device");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemmfuse: bf16 rows must be 16-byte aligned (K a multiple of 8)");
  TORCH_CHECK(K < (int64_t{1} << 30), "gemmfuse: sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  args.a_hi = reinterpret_cast<const __half*>(x.data_ptr());  // bf16 bits; the kernel knows
  args.b_hi = reinterpret_cast<const __half*>(w.data_ptr());
  args.k_padded = static_cast<int>((K + 63) / 64 * 64);
  args.k_cols = static_cast<int>(K);
  args.a_row_stride = x.stride(0);
  args.b_row_stride = K;
  args.split = 0;
  args.bf16 = 1;
  args.params.round_bf16 = 1;
  set_z_out(args, z_out, x);
  const auto outputs = allocate_outputs(args, x, torch::kBFloat16, stream);
  check_cuda(gemmfuse::launch_fused(args, 2, stream), "fused bf16 kernel launch");
  const auto& result = outputs.front();
  return result.scalar_type() == torch::kBFloat16 ? result : result.to(torch::kBFloat16);
}

// The epilogue path: y = x @ W^T + b [M, N] float32, computed by PyTorch (its fp32 GEMM, bias
// included) -> the chain applied to y in place ([M, N]), or its reduction ([M]).
torch::Tensor epilogue_forward(torch::Tensor y, c10::optional<torch::Tensor> gn_weight,
                               c10::optional<torch::Tensor> gn_bias,
                               std::vector<torch::Tensor> vec_params,
                               std::vector<double> scalar_params, int64_t group_size, double eps,
                               bool norm_wide) {
  TORCH_CHECK(y.is_cuda() && y.scalar_type() == torch::kFloat32 && y.dim() == 2 && y.is_contiguous(),
              "gemmfuse: y must be a contiguous 2-D float32 CUDA tensor");
  gemmfuse::FusedArgs args = chain_args(y.size(0), y.size(1), c10::nullopt, gn_weight, gn_bias,
                                        vec_params, scalar_params, group_size, eps, norm_wide);
  c10::cuda::CUDAGuard guard(y.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  args.out = y.data_ptr<float>();
  const auto outputs = allocate_outputs(args, y, torch::kFloat32, stream);
  check_cuda(gemmfuse::launch_epilogue_only(args, stream), "epilogue kernel launch");
  return gemmfuse::fused_reduce_kind() != 0 ? outputs.front() : y;
}

// The epilogue path at a few rows (M <= gemv_max_rows()): x [M, K] and W [N, K] float32 (K a
// multiple of 4, 16-byte aligned rows) -> the chain of x @ W^T + bias, [M, N] or [M], with the
// matrix-vector product compensated (gemv_epilogue.cuh).
torch::Tensor gemv_forward(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                           c10::optional<torch::Tensor> gn_weight,
                           c10::optional<torch::Tensor> gn_bias,
                           std::vector<torch::Tensor> vec_params,
                           std::vector<double> scalar_params, int64_t group_size, double eps,
                           bool norm_wide) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: x must be a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous() &&
                  w.device() == x.device() && w.size(1) == x.size(1),
              "gemmfuse: w must be a contiguous float32 [N, K] tensor on x's device");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= gemmfuse::gemv_max_rows(), "gemmfuse: gemv_forward takes 1 to ",
              gemmfuse::gemv_max_rows(), " rows, got ", M);
  TORCH_CHECK(K % 4 == 0 && x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemmfuse: gemv_forward needs 16-byte aligned rows (K a multiple of 4)");
  TORCH_CHECK(K < (int64_t{1} << 30), "gemmfuse: sizes must fit in 32 bits");
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  auto outputs = allocate_outputs(args, x, torch::kFloat32, stream);

  gemmfuse::GemvArgs gemv{};
  gemv.x = x.data_ptr<float>();
  gemv.w = w.data_ptr<float>();
  gemv.x_stride = x.stride(0);
  gemv.K = static_cast<int>(K);
  gemv.slice = gemmfuse::gemv_slice_for(gemv.K, args.N);
  const int64_t slices = (K + gemv.slice - 1) / gemv.slice, windows = (N + 127) / 128;
  outputs.push_back(torch::empty({slices, M, N, 2}, x.options()));
  gemv.partial = reinterpret_cast<float2*>(outputs.back().data_ptr<float>());
  gemv.counter = arrival_counters(x, windows + 1, stream, kWindowCounters);
  check_cuda(gemmfuse::launch_gemv_epilogue(args, gemv, stream), "gemv epilogue launch");
  return outputs.front();
}

// The chain's backward (chain_backward.cuh): z [M, N] (the saved GEMM result, float32 or
// bfloat16, contiguous) and the gradient of the chain's output (z's dtype: [M, N], or M values
// when the chain reduces; any strides) -> {dz [M, N] of z's dtype, column sums float64
// [chain_backward_sums(), N]}: slot 0 the sum of dz over rows, then the GroupNorm affine's and
// each per-channel tensor argument's gradients per column (epilogue.column_sum_slots).
std::vector<torch::Tensor> chain_backward(torch::Tensor z, torch::Tensor grad,
                                          c10::optional<torch::Tensor> gn_weight,
                                          c10::optional<torch::Tensor> gn_bias,
                                          std::vector<torch::Tensor> vec_params,
                                          std::vector<double> scalar_params, int64_t group_size,
                                          double eps) {
  TORCH_CHECK(z.is_cuda() && z.dim() == 2 && z.is_contiguous() &&
                  (z.scalar_type() == torch::kFloat32 || z.scalar_type() == torch::kBFloat16),
              "gemmfuse: z must be a contiguous 2-D float32 or bfloat16 CUDA tensor");
  const int64_t M = z.size(0), N = z.size(1);
  TORCH_CHECK(grad.device() == z.device() && grad.scalar_type() == z.scalar_type(),
              "gemmfuse: grad must have z's dtype and device");
  const int kind = gemmfuse::fused_reduce_kind();
  const bool reduces = kind != 0;
  if (reduces) {
    TORCH_CHECK(grad.numel() == M && (grad.dim() == 1 || (grad.dim() == 2 && grad.size(1) == 1)),
                "gemmfuse: the gradient of a reducing chain must have M elements");
  } else {
    TORCH_CHECK(grad.dim() == 2 && grad.size(0) == M && grad.size(1) == N,
                "gemmfuse: grad must have z's shape");
  }
  gemmfuse::FusedArgs chain = chain_args(M, N, c10::nullopt, gn_weight, gn_bias, vec_params,
                                         scalar_params, group_size, eps, false);
  c10::cuda::CUDAGuard guard(z.device());
  const gemmfuse::BackwardPlan plan = gemmfuse::chain_backward_plan(chain.M, chain.N, chain.group_size);
  TORCH_CHECK(plan.row_blocks > 0, "gemmfuse: the chain backward does not fit a block (chain_backward_plan)");
  // The register kernel reads four columns at once (a view of a larger z may start unaligned)
  if (plan.in_registers && reinterpret_cast<uintptr_t>(z.data_ptr()) % 16 != 0) z = z.clone();
  const int sums = gemmfuse::chain_backward_sums();
  auto dz = torch::empty_like(z);
  auto partial = torch::empty({plan.row_blocks, sums, N}, z.options().dtype(torch::kFloat32));
  const bool slab_extremes = (kind == 1 || kind == 2) && plan.slabs > 1;
  auto extremes = torch::empty({slab_extremes ? M : 0, plan.slabs, 2}, partial.options());
  gemmfuse::BackwardArgs args{};
  args.z = z.data_ptr();
  args.grad = grad.data_ptr();
  args.grad_row_stride = grad.stride(0);
  args.grad_col_stride = reduces ? 0 : grad.stride(1);
  args.dz = dz.data_ptr();
  args.column_partial = partial.data_ptr<float>();
  args.extremes = slab_extremes ? reinterpret_cast<float2*>(extremes.data_ptr<float>()) : nullptr;
  args.gn_weight = chain.gn_weight;
  args.gn_bias = chain.gn_bias;
  args.M = chain.M;
  args.N = chain.N;
  args.group_size = chain.group_size;
  args.eps = chain.eps;
  args.bf16 = z.scalar_type() == torch::kBFloat16 ? 1 : 0;
  args.params = chain.params;
  args.params.round_bf16 = args.bf16;
  check_cuda(gemmfuse::launch_chain_backward(args, plan, at::cuda::getCurrentCUDAStream()),
             "chain backward launch");
  return {dz, partial.sum({0}, false, torch::kFloat64)};  // the blocks' sums added in float64
}

// How chain_backward cuts an M x N chain in groups of group_size on this device: [slabs, row
// blocks, in registers (1) or shared memory (0)]; row blocks 0 where a slab does not fit a block
// (the backward then runs in PyTorch).
std::vector<int64_t> chain_backward_plan(int64_t M, int64_t N, int64_t group_size) {
  TORCH_CHECK(M >= 1 && M < (int64_t{1} << 31) && N >= 1 && N < (int64_t{1} << 31) &&
                  group_size >= 1 && N % group_size == 0,
              "gemmfuse: bad chain_backward_plan sizes");
  const gemmfuse::BackwardPlan plan = gemmfuse::chain_backward_plan(
      static_cast<int>(M), static_cast<int>(N), static_cast<int>(group_size));
  return {plan.slabs, plan.row_blocks, plan.in_registers};
}
