// The host extension's chain backward, and what Python checks when it loads a library.
#include "column_sums.h"
#include "outer_binary.h"
#include "host_common.h"

using namespace gemmfuse::host;

// A standalone export links one chain's library into this one: its table (weak: the package's
// host extension has none, and finds each chain's table with dlsym instead).
extern "C" __attribute__((weak)) const gemmfuse::ChainTable* gemmfuse_chain_table();

// The chain's backward (chain_backward.cuh): z [M, N] (the saved GEMM result, float32,
// bfloat16 or float16, contiguous) and the gradient of the chain's output (z's dtype: [M, N], or M values
// when the chain reduces; any strides) -> {dz [M, N] of z's dtype, column sums float64
// [the table's column_sums, N], the same sums rounded to z's dtype}: slot 0 the sum of dz over
// rows, then the GroupNorm affine's and each per-channel tensor argument's gradients per column
// (epilogue.column_sum_slots); the row blocks' partial sums added in float64, in block order.
std::vector<at::Tensor> chain_backward(int64_t table, at::Tensor z, at::Tensor grad,
                                       std::optional<at::Tensor> gn_weight,
                                       std::optional<at::Tensor> gn_bias,
                                       std::vector<at::Tensor> vec_params,
                                       std::vector<double> scalar_params, int64_t group_size,
                                       double eps) {
  const at::ScalarType dtype = z.scalar_type();
  TORCH_CHECK(z.is_cuda() && z.dim() == 2 && z.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "gemmfuse: z must be a contiguous 2-D float32, bfloat16 or float16 CUDA tensor");
  const int64_t M = z.size(0), N = z.size(1);
  TORCH_CHECK(grad.device() == z.device() && grad.scalar_type() == z.scalar_type(),
              "gemmfuse: grad must have z's dtype and device");
  const gemmfuse::ChainTable& t = chain(table);
  const int kind = t.reduce_kind;
  const bool reduces = kind != 0;
  if (reduces) {
    TORCH_CHECK(grad.numel() == M && (grad.dim() == 1 || (grad.dim() == 2 && grad.size(1) == 1)),
                "gemmfuse: the gradient of a reducing chain must have M elements");
  } else {
    TORCH_CHECK(grad.dim() == 2 && grad.size(0) == M && grad.size(1) == N,
                "gemmfuse: grad must have z's shape");
  }
  gemmfuse::FusedArgs chain = chain_args(M, N, std::nullopt, gn_weight, gn_bias, vec_params,
                                         scalar_params, group_size, eps, false);
  c10::cuda::CUDAGuard guard(z.device());
  const int model16 = dtype == at::kBFloat16 ? gemmfuse::kBf16Model
                      : dtype == at::kHalf   ? gemmfuse::kFp16Model
                                             : gemmfuse::kFloat32Model;
  const gemmfuse::BackwardPlan plan = t.backward_plan(chain.M, chain.N, chain.group_size, model16);
  TORCH_CHECK(plan.row_blocks != gemmfuse::kBackwardPartMissing,
              "gemmfuse: the chain backward's part could not be built (its errors are on stderr)");
  TORCH_CHECK(plan.row_blocks > 0, "gemmfuse: the chain backward does not fit a block (chain_backward_plan)");
  // The register kernel reads four columns at once (a view of a larger z may start unaligned)
  if (plan.in_registers && reinterpret_cast<uintptr_t>(z.data_ptr()) % 16 != 0) z = z.clone();
  const int sums_count = t.column_sums;
  auto dz = z.new_empty(z.sizes());
  auto partial = z.new_empty({plan.row_blocks, sums_count, N}, z.options().dtype(at::kFloat));
  const bool slab_extremes = (kind == 1 || kind == 2) && plan.slabs > 1;
  auto extremes = z.new_empty({slab_extremes ? M : 0, plan.slabs, 2}, partial.options());
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
  args.model16 = model16;
  args.params = chain.params;
  args.params.model16 = model16;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  check_cuda(t.launch_backward(args, plan, stream), "chain backward launch");
  auto sums = partial.new_empty({sums_count, N}, partial.options().dtype(at::kDouble));
  auto rounded = dz.new_empty({sums_count, N});
  const int64_t count = sums_count * N;
  const auto column_sums = [&](auto* out) {
    return gemmfuse::launch_column_sums(partial.data_ptr<float>(), plan.row_blocks, count,
                                        sums.data_ptr<double>(), out, stream);
  };
  const cudaError_t err =
      dtype == at::kBFloat16 ? column_sums(reinterpret_cast<__nv_bfloat16*>(rounded.data_ptr()))
      : dtype == at::kHalf   ? column_sums(reinterpret_cast<__half*>(rounded.data_ptr()))
                             : column_sums(rounded.data_ptr<float>());
  check_cuda(err, "column sums launch");
  return {dz, sums, rounded};
}

// How chain_backward cuts an M x N chain in groups of group_size (model16: of 16-bit tensors,
// bfloat16 or float16) on this device: [slabs, row blocks, in registers (1) or shared memory (0)]; row blocks 0 where a
// slab does not fit a block (the backward then runs in PyTorch), -1 where the chain backward's
// part could not be built.
std::vector<int64_t> chain_backward_plan(int64_t table, int64_t M, int64_t N, int64_t group_size,
                                         bool model16) {
  TORCH_CHECK(M >= 1 && M < (int64_t{1} << 31) && N >= 1 && N < (int64_t{1} << 31) &&
                  group_size >= 1 && N % group_size == 0,
              "gemmfuse: bad chain_backward_plan sizes");
  const gemmfuse::BackwardPlan plan = chain(table).backward_plan(
      static_cast<int>(M), static_cast<int>(N), static_cast<int>(group_size), model16 ? 1 : 0);
  return {plan.slabs, plan.row_blocks, plan.in_registers};
}

// Checks a chain library's table against the layout this extension was compiled with; Python
// calls it once per library, when it loads one.
void check_table(int64_t table) {
  const gemmfuse::ChainTable& t = chain(table);
  TORCH_CHECK(t.version == gemmfuse::kChainTableVersion &&
                  t.table_bytes == static_cast<int>(sizeof(gemmfuse::ChainTable)) &&
                  t.fused_args_bytes == static_cast<int>(sizeof(gemmfuse::FusedArgs)) &&
                  t.backward_args_bytes == static_cast<int>(sizeof(gemmfuse::BackwardArgs)) &&
                  t.gemv_args_bytes == static_cast<int>(sizeof(gemmfuse::GemvArgs)),
              "gemmfuse: a chain library built from other sources than the host extension "
              "(table version ", std::to_string(t.version), ", expected ",
              std::to_string(gemmfuse::kChainTableVersion), ")");
}

// The table of the chain library linked into this one (a standalone export), else 0.
int64_t linked_chain_table() {
  return gemmfuse_chain_table ? reinterpret_cast<int64_t>(gemmfuse_chain_table()) : 0;
}

// The constants Python holds copies of (sources.check_constants checks them when it loads the
// extension).
std::map<std::string, int64_t> constants() {
  return {{"tile", gemmfuse::kTile},
          {"gemv_max_rows", gemmfuse::kGemvMaxRows},
          {"max_params", gemmfuse::kMaxParams},
          {"split_cols_max", gemmfuse::kSplitColsMax},
          {"k_align", gemmfuse::kKAlign},
          {"outer_ops", gemmfuse::kOuterDiv + 1},
          {"portable_kernel", gemmfuse::kPortableKernel},
          {"hopper_kernel", gemmfuse::kHopperKernel},
          {"max_k_splits", gemmfuse::kMaxKSplits}};
}
