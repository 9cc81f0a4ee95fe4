// The host extension's forward entry points: the fused kernels, the epilogue path and the few-rows kernel.
#include "host_common.h"

using namespace gemmfuse::host;

// x [M, K] float32 -> epilogue(x @ W^T + bias): [M, N], or [M] when the epilogue reduces
// across channels. W arrives pre-split (split_rows) as w_hi, w_lo [N, k_padded], w_inv_scale [N].
at::Tensor fused_forward(int64_t table, at::Tensor x, at::Tensor w_hi, at::Tensor w_lo,
                         at::Tensor w_inv_scale, std::optional<at::Tensor> bias,
                         std::optional<at::Tensor> gn_weight, std::optional<at::Tensor> gn_bias,
                         std::vector<at::Tensor> vec_params, std::vector<double> scalar_params,
                         int64_t group_size, double eps, int64_t kernel, bool split,
                         int64_t k_splits, bool norm_wide, std::optional<at::Tensor> z_out,
                         int* tile_flags, std::vector<at::Tensor>* keep) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "gemmfuse: x must be a 2-D float32 CUDA tensor");
  check_kernel_code(kernel);
  const int64_t M = x.size(0), N = w_hi.size(0), k_padded = w_hi.size(1);
  TORCH_CHECK(k_splits == 1 || (kernel == gemmfuse::kHopperKernel && split && k_splits >= 2 &&
                                k_splits <= std::min<int64_t>(k_padded / 64, gemmfuse::kMaxKSplits)),
              "gemmfuse: k_splits must be 1, or 2 to the k-tiles (", std::to_string(k_padded / 64),
              ") and at most ", std::to_string(gemmfuse::kMaxKSplits),
              " on the Hopper kernel's split variant, as dispatch.fused_k_splits decides it");
  TORCH_CHECK(w_hi.scalar_type() == at::kHalf && w_lo.sizes() == w_hi.sizes() &&
                  w_hi.is_contiguous() && w_lo.is_contiguous() && w_hi.device() == x.device(),
              "gemmfuse: malformed weight split");
  TORCH_CHECK(x.size(1) <= k_padded && k_padded - x.size(1) < 64, "gemmfuse: x and weight K differ");
  check_vector(w_inv_scale, N, "w_inv_scale");
  // checked before the launch: a followed GEMM counts its tiles, which only the follower zeroes
  TORCH_CHECK(tile_flags == nullptr || keep != nullptr,
              "gemmfuse: a GEMM whose tiles are followed keeps its inputs");
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();

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
  args.tile_flags = tile_flags;
  set_z_out(args, z_out, x);

  const gemmfuse::ChainTable& t = chain(table);
  auto outputs = allocate_outputs(t, args, x, at::kFloat, stream);
  if (k_splits > 1) {  // each (tile, slice)'s sums, and a counter per tile
    const int64_t tiles = output_tiles(M, N);
    outputs.push_back(x.new_empty({tiles * k_splits, gemmfuse::kTile * gemmfuse::kTile}));
    args.k_partial = outputs.back().data_ptr<float>();
    args.k_counter = arrival_counters(x, tiles, stream, kTileCounters, outputs);
    args.k_splits = static_cast<int>(k_splits);
  }
  check_cuda(t.launch_fused(args, static_cast<int>(kernel), stream), "fused kernel launch");
  if (tile_flags != nullptr) {
    // A kernel launched behind this one runs beside it (group_tiles.cuh), so what the GEMM reads
    // must not go back to the allocator, whose next block on this stream (the chain kernel's
    // output) would be written while the GEMM still reads it: the caller keeps them until that
    // kernel is launched (the weight's split and the vectors too, whoever else holds them).
    keep->insert(keep->end(), a.begin(), a.end());
    keep->insert(keep->end(), outputs.begin() + 1, outputs.end());
    keep->insert(keep->end(), {w_hi, w_lo, w_inv_scale});
    for (const auto& v : {bias, gn_weight, gn_bias})
      if (v) keep->push_back(*v);
    keep->insert(keep->end(), vec_params.begin(), vec_params.end());
  }
  return outputs.front();
}

// A 16-bit model (bfloat16 or float16) on Hopper: x [M, K] and W [N, K] of that dtype go to the
// tensor cores as they are (one pass, fp32 accumulation); the epilogue runs in fp32 (the bias
// and GroupNorm vectors come as float32), rounding where the eager model rounds; the output is of
// x's dtype ([M, N], or [M] when the epilogue reduces). K must be a multiple of 8 (16-byte rows
// for TMA). A bf16 model runs the kernel's bf16 variant; a float16 one the one-pass variant
// (precision="tf32"'s, on fp16 operands) with no scales.
at::Tensor fused_forward_16bit(int64_t table, at::Tensor x, at::Tensor w,
                               std::optional<at::Tensor> bias, std::optional<at::Tensor> gn_weight,
                               std::optional<at::Tensor> gn_bias, std::vector<at::Tensor> vec_params,
                               std::vector<double> scalar_params, int64_t group_size, double eps,
                               bool norm_wide, std::optional<at::Tensor> z_out) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf) && x.dim() == 2 &&
                  x.stride(1) == 1,
              "gemmfuse: x must be a 2-D bfloat16 or float16 CUDA tensor with unit column stride");
  TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous() &&
                  w.device() == x.device() && w.size(1) == x.size(1),
              "gemmfuse: w must be a contiguous [N, K] tensor of x's dtype on x's device");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemmfuse: 16-bit rows must be 16-byte aligned (K a multiple of 8)");
  TORCH_CHECK(K < (int64_t{1} << 30), "gemmfuse: sizes must fit in 32 bits");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  const bool bf16 = dtype == at::kBFloat16;
  args.a_hi = reinterpret_cast<const __half*>(x.data_ptr());  // bf16 bits for bf16: the kernel knows
  args.b_hi = reinterpret_cast<const __half*>(w.data_ptr());
  args.k_padded = static_cast<int>((K + 63) / 64 * 64);
  args.k_cols = static_cast<int>(K);
  args.a_row_stride = x.stride(0);
  args.b_row_stride = K;
  args.split = 0;
  args.bf16 = bf16 ? 1 : 0;
  args.params.model16 = bf16 ? gemmfuse::kBf16Model : gemmfuse::kFp16Model;
  set_z_out(args, z_out, x);
  const gemmfuse::ChainTable& t = chain(table);
  const auto outputs = allocate_outputs(t, args, x, dtype, stream);
  check_cuda(t.launch_fused(args, gemmfuse::kHopperKernel, stream), "fused 16-bit kernel launch");
  const auto& result = outputs.front();
  return result.scalar_type() == dtype ? result : result.to(dtype);  // a reduction's fp32 [M]
}

// The epilogue path: y = x @ W^T + b [M, N] float32, computed by PyTorch (its fp32 GEMM, bias
// included), or any (M, N) value -> the chain of y ([M, N]), or its reduction ([M]). in_place:
// the chain's values overwrite y (which is returned); else y is left as it is and a new tensor
// holds them. A 16-bit y (a bf16 or fp16 model's own GEMM, from PyTorch: the bits eager
// normalises and reduces) takes chains that norm or reduce in tiles (no wide GroupNorm groups),
// rounds as eager rounds in its dtype and returns that dtype; group_stats: tile_epilogue.cuh's
// eager_group_stats mode (bf16 only; 0 for other dtypes). tile_flags: the plain GEMM's tile
// counts, then a reducing chain's row-band counters (follow_flags' set), where the chain kernel
// follows its tiles (epilogue_forward_following); else nullptr.
static at::Tensor run_epilogue(int64_t table, at::Tensor y, std::optional<at::Tensor> gn_weight,
                               std::optional<at::Tensor> gn_bias, std::vector<at::Tensor> vec_params,
                               std::vector<double> scalar_params, int64_t group_size, double eps,
                               bool norm_wide, bool in_place, int64_t group_stats, int* tile_flags) {
  const at::ScalarType dtype = y.scalar_type();
  const bool bf16 = dtype == at::kBFloat16, model16 = bf16 || dtype == at::kHalf;
  TORCH_CHECK(y.is_cuda() && (dtype == at::kFloat || model16) && y.dim() == 2 && y.is_contiguous(),
              "gemmfuse: y must be a contiguous 2-D float32, bfloat16 or float16 CUDA tensor");
  TORCH_CHECK(group_stats >= 0 && group_stats <= 2 && (bf16 || group_stats == 0),
              "gemmfuse: group_stats must be 0, or 1 or 2 for a bfloat16 y");
  gemmfuse::FusedArgs args = chain_args(y.size(0), y.size(1), std::nullopt, gn_weight, gn_bias,
                                        vec_params, scalar_params, group_size, eps, norm_wide);
  args.tile_flags = tile_flags;
  if (tile_flags != nullptr && chain(table).reduce_kind != 0)  // follow_flags' set, after the counts
    args.row_counter = tile_flags + follow_tile_counts(args.M, args.N);
  c10::cuda::CUDAGuard guard(y.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const gemmfuse::ChainTable& t = chain(table);
  if (model16) {
    // (the launch refuses a chain with neither a norm nor a reduction: its kernel reads float32;
    // the check after the launch says so)
    TORCH_CHECK(!norm_wide, "gemmfuse: a 16-bit y takes chains without wide GroupNorm groups");
    args.epilogue_in16 = reinterpret_cast<const uint16_t*>(y.data_ptr());
    args.params.model16 = bf16 ? gemmfuse::kBf16Model : gemmfuse::kFp16Model;
    args.params.group_stats = static_cast<int>(group_stats);
  } else if (in_place) {
    args.out = y.data_ptr<float>();
  } else {
    args.epilogue_in = y.data_ptr<float>();  // allocate_outputs gives `out` where one is needed
  }
  const auto outputs = allocate_outputs(t, args, y, dtype, stream);
  const cudaError_t err = t.launch_epilogue_only(args, stream);
  TORCH_CHECK(!(model16 && err == cudaErrorInvalidValue),
              "gemmfuse: a 16-bit y takes chains that norm or reduce within 128-channel tiles");
  check_cuda(err, "epilogue kernel launch");
  if (model16) return outputs.front().to(dtype);  // the reduced rows: 16-bit, as eager's
  return t.reduce_kind != 0 || !in_place ? outputs.front() : y;
}

at::Tensor epilogue_forward(int64_t table, at::Tensor y, std::optional<at::Tensor> gn_weight,
                            std::optional<at::Tensor> gn_bias, std::vector<at::Tensor> vec_params,
                            std::vector<double> scalar_params, int64_t group_size, double eps,
                            bool norm_wide, bool in_place, int64_t group_stats) {
  return run_epilogue(table, y, gn_weight, gn_bias, vec_params, scalar_params, group_size, eps,
                      norm_wide, in_place, group_stats, nullptr);
}

at::Tensor epilogue_forward_following(int64_t table, at::Tensor y,
                                      std::optional<at::Tensor> gn_weight,
                                      std::optional<at::Tensor> gn_bias,
                                      std::vector<at::Tensor> vec_params,
                                      std::vector<double> scalar_params, int64_t group_size,
                                      double eps, bool in_place, int* tile_flags) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && tile_flags != nullptr && y.dim() == 2,
              "gemmfuse: a chain kernel follows a float32 z's tiles, by their counts");
  try {
    return run_epilogue(table, y, gn_weight, gn_bias, vec_params, scalar_params, group_size, eps,
                        false, in_place, 0, tile_flags);
  } catch (...) {
    // The GEMM has counted its tiles and no kernel will zero them: zeroed here (in stream
    // order, after the GEMM), so that the next call on this stream starts from zero. A failed
    // memset's error is cleared, not left for the next launch's check to report as its own.
    // (A reducing chain's row bands after them need nothing: only the chain kernel counts rows.)
    c10::cuda::CUDAGuard guard(y.device());
    const int64_t counts = follow_tile_counts(y.size(0), y.size(1));
    if (cudaMemsetAsync(tile_flags, 0, counts * sizeof(int),
                        c10::cuda::getCurrentCUDAStream(y.get_device())) != cudaSuccess)
      (void)cudaGetLastError();
    throw;
  }
}

int* follow_flags(int64_t table, const at::Tensor& x, int64_t N,
                  const std::optional<at::Tensor>& gn_weight,
                  const std::optional<at::Tensor>& gn_bias, const std::vector<at::Tensor>& vec_params,
                  const std::vector<double>& scalar_params, int64_t group_size, double eps,
                  std::vector<at::Tensor>& keep) {
  const int64_t M = x.size(0);
  // the chain kernel's arguments as run_epilogue makes them, z not yet allocated (null)
  const gemmfuse::FusedArgs args = chain_args(M, N, std::nullopt, gn_weight, gn_bias, vec_params,
                                              scalar_params, group_size, eps, false);
  if (M == 0 || N == 0 || !chain(table).follows_tiles(args)) return nullptr;
  // A reducing chain's row-band counters come after the tile counts in the same set, made here,
  // before the GEMM is queued: made later (by a fill kernel under graph capture, or a memset on
  // a stream's first call), they would sit between the GEMM and the chain kernel, which counts
  // rows before the griddepcontrol.wait that would make their zeros visible.
  return arrival_counters(x, follow_counters(M, N, chain(table).reduce_kind != 0),
                          c10::cuda::getCurrentCUDAStream(), kFollowCounters, keep);
}

// The epilogue path at a few rows (M <= kGemvMaxRows): x [M, K] and W [N, K] float32 (K a
// multiple of 4, 16-byte aligned rows) -> the chain of x @ W^T + bias, [M, N] or [M], with the
// matrix-vector product compensated (gemv_epilogue.cuh).
at::Tensor gemv_forward(int64_t table, at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias,
                        std::optional<at::Tensor> gn_weight, std::optional<at::Tensor> gn_bias,
                        std::vector<at::Tensor> vec_params, std::vector<double> scalar_params,
                        int64_t group_size, double eps, bool norm_wide) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "gemmfuse: x must be a 2-D float32 CUDA tensor with unit column stride");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() &&
                  w.device() == x.device() && w.size(1) == x.size(1),
              "gemmfuse: w must be a contiguous float32 [N, K] tensor on x's device");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= gemmfuse::kGemvMaxRows, "gemmfuse: gemv_forward takes 1 to ",
              std::to_string(gemmfuse::kGemvMaxRows), " rows, got ", std::to_string(M));
  TORCH_CHECK(K % 4 == 0 && x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemmfuse: gemv_forward needs 16-byte aligned rows (K a multiple of 4)");
  TORCH_CHECK(K < (int64_t{1} << 30), "gemmfuse: sizes must fit in 32 bits");
  gemmfuse::FusedArgs args = chain_args(M, N, bias, gn_weight, gn_bias, vec_params, scalar_params,
                                        group_size, eps, norm_wide);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const gemmfuse::ChainTable& t = chain(table);
  auto outputs = allocate_outputs(t, args, x, at::kFloat, stream);

  gemmfuse::GemvArgs gemv{};
  gemv.x = x.data_ptr<float>();
  gemv.w = w.data_ptr<float>();
  gemv.x_stride = x.stride(0);
  gemv.K = static_cast<int>(K);
  gemv.slice = t.gemv_slice(gemv.K, args.N);
  const int64_t slices = (K + gemv.slice - 1) / gemv.slice, windows = (N + 127) / 128;
  outputs.push_back(x.new_empty({slices, M, N, 2}, x.options()));
  gemv.partial = reinterpret_cast<float2*>(outputs.back().data_ptr<float>());
  gemv.counter = arrival_counters(x, windows + 1, stream, kWindowCounters, outputs);
  check_cuda(t.launch_gemv(args, gemv, stream), "gemv epilogue launch");
  return outputs.front();
}
