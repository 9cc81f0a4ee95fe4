// The host extension's operand splits and the backward's split products.
#include "host_common.h"

using namespace gemmfuse::host;

// Splits rows of a float32 [rows, k] matrix (unit column stride) into fp16 hi/lo
// [rows, k_padded] and the per-row inverse power-of-two scale.
std::vector<at::Tensor> split_rows(at::Tensor x, int64_t k_padded) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: split_rows needs a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(k_padded >= x.size(1) && k_padded % 64 == 0, "gemmfuse: bad k_padded");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31) && k_padded < (int64_t{1} << 31),
              "gemmfuse: split_rows sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  const auto rows = x.size(0);
  auto half_opts = x.options().dtype(at::kHalf);
  auto hi = x.new_empty({rows, k_padded}, half_opts);
  auto lo = x.new_empty({rows, k_padded}, half_opts);
  auto inv_scale = x.new_empty({rows}, x.options());
  check_cuda(gemmfuse::launch_split_rows_f32(
                 x.data_ptr<float>(), x.stride(0), static_cast<int>(rows), static_cast<int>(x.size(1)),
                 static_cast<int>(k_padded), reinterpret_cast<__half*>(hi.data_ptr<at::Half>()),
                 reinterpret_cast<__half*>(lo.data_ptr<at::Half>()), inv_scale.data_ptr<float>(),
                 c10::cuda::getCurrentCUDAStream()),
             "split_rows launch");
  return {hi, lo, inv_scale};
}

// The transposed split: x [rows, cols] float32 (unit column stride) -> fp16 hi, lo
// [cols, rows_padded] and the per-column inverse power-of-two scale [cols]: split_rows of x^T.
std::vector<at::Tensor> split_cols(at::Tensor x, int64_t rows_padded) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: split_cols needs a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(rows_padded >= x.size(0) && rows_padded % 64 == 0, "gemmfuse: bad rows_padded");
  TORCH_CHECK(rows_padded < (int64_t{1} << 31) && x.size(1) < (int64_t{1} << 31),
              "gemmfuse: split_cols sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  const int rows = static_cast<int>(x.size(0)), cols = static_cast<int>(x.size(1));
  auto half_opts = x.options().dtype(at::kHalf);
  auto hi = x.new_empty({cols, rows_padded}, half_opts);
  auto lo = x.new_empty({cols, rows_padded}, half_opts);
  auto inv_scale = x.new_empty({cols}, x.options());
  auto col_max = x.new_empty({std::max(gemmfuse::split_cols_chunks(rows), 1), cols}, x.options());
  check_cuda(gemmfuse::launch_split_cols_f32(
                 x.data_ptr<float>(), x.stride(0), rows, cols, static_cast<int>(rows_padded),
                 reinterpret_cast<__half*>(hi.data_ptr<at::Half>()),
                 reinterpret_cast<__half*>(lo.data_ptr<at::Half>()), inv_scale.data_ptr<float>(),
                 col_max.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
             "split_cols launch");
  return {hi, lo, inv_scale};
}

// The backward's products: a [M, K] and b [N, K], both split (split_rows / split_cols, K padded
// alike) -> a @ b^T, float32 [M, N], on the fused kernels (kernel and split as in fused_forward).
// Runs only with the plain GEMM's library, whose epilogue is the identity.
at::Tensor gemm_split(int64_t table, at::Tensor a_hi, at::Tensor a_lo, at::Tensor a_inv_scale,
                      at::Tensor b_hi, at::Tensor b_lo, at::Tensor b_inv_scale, int64_t kernel,
                      bool split) {
  const gemmfuse::ChainTable& t = chain(table);
  TORCH_CHECK(t.is_plain, "gemmfuse: gemm_split needs the plain GEMM's library");
  check_split(a_hi, a_lo, a_inv_scale, "a");
  check_split(b_hi, b_lo, b_inv_scale, "b");
  TORCH_CHECK(a_hi.size(1) == b_hi.size(1) && a_hi.device() == b_hi.device(),
              "gemmfuse: a and b must share K and device");
  check_kernel_code(kernel);
  gemmfuse::FusedArgs args = chain_args(a_hi.size(0), b_hi.size(0), std::nullopt, std::nullopt,
                                        std::nullopt, {}, {}, 1, 0.0, false);
  c10::cuda::CUDAGuard guard(a_hi.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  args.a_hi = reinterpret_cast<const __half*>(a_hi.data_ptr<at::Half>());
  args.a_lo = reinterpret_cast<const __half*>(a_lo.data_ptr<at::Half>());
  args.a_inv_scale = a_inv_scale.data_ptr<float>();
  args.b_hi = reinterpret_cast<const __half*>(b_hi.data_ptr<at::Half>());
  args.b_lo = reinterpret_cast<const __half*>(b_lo.data_ptr<at::Half>());
  args.b_inv_scale = b_inv_scale.data_ptr<float>();
  args.k_padded = args.k_cols = static_cast<int>(a_hi.size(1));
  args.a_row_stride = args.b_row_stride = a_hi.size(1);
  args.split = split ? 1 : 0;
  const auto outputs = allocate_outputs(t, args, a_inv_scale, at::kFloat, stream);
  check_cuda(t.launch_fused(args, static_cast<int>(kernel), stream), "gemm_split launch");
  return outputs.front();
}
