// The host extension's sparse backward products (sparse_products.cu): dx = dz @ W and
// dW = dz^T @ x from dz's nonzero entries, for float32, bfloat16 and float16 tensors.
#include "host_common.h"
#include "sparse_products.h"

using namespace gemmfuse::host;

namespace {

template <class T>
cudaError_t launch(const at::Tensor& dz, const at::Tensor& weight, const at::Tensor& x,
                   at::Tensor& dx, at::Tensor& dw, at::Tensor& scratch, cudaStream_t stream) {
  const auto in = [](const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); };
  const auto out = [](at::Tensor& t) {
    return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
  };
  return gemmfuse::launch_sparse_products(in(dz), in(weight), in(x), out(dx), out(dw),
                                          scratch.data_ptr<int>(), static_cast<int>(dz.size(0)),
                                          static_cast<int>(dz.size(1)),
                                          static_cast<int>(x.size(1)), stream);
}

}  // namespace

// [dx = dz @ weight, dW = dz^T @ x] (each undefined where not asked for): dz [M, N], weight
// [N, K], x [M, K], 2-D CUDA tensors of one dtype (float32, bfloat16 or float16) on one device.
std::vector<at::Tensor> sparse_products(at::Tensor dz, at::Tensor weight, at::Tensor x,
                                        bool want_dx, bool want_dw) {
  TORCH_CHECK(dz.dim() == 2 && weight.dim() == 2 && x.dim() == 2 && dz.is_cuda() &&
                  weight.device() == dz.device() && x.device() == dz.device(),
              "gemmfuse: sparse_products takes 2-D CUDA tensors dz, weight and x on one device");
  const at::ScalarType dtype = dz.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                  weight.scalar_type() == dtype && x.scalar_type() == dtype,
              "gemmfuse: sparse_products takes float32, bfloat16 or float16 tensors of one dtype");
  const int64_t M = dz.size(0), N = dz.size(1), K = x.size(1);
  TORCH_CHECK(weight.size(0) == N && weight.size(1) == K && x.size(0) == M,
              "gemmfuse: sparse_products: dz is [", std::to_string(M), ", ", std::to_string(N),
              "], so weight must be [", std::to_string(N), ", K] and x [", std::to_string(M),
              ", K]");
  const int64_t limit = int64_t{1} << 31;
  TORCH_CHECK(M < limit && N < limit - 2048 && K <= gemmfuse::kSparseMaxK &&
                  gemmfuse::sparse_scratch(M, N) < limit,
              "gemmfuse: sparse_products sizes must fit the kernels' 32-bit indexing");
  c10::cuda::CUDAGuard guard(dz.device());
  dz = dz.contiguous();
  weight = weight.contiguous();
  x = x.contiguous();
  at::Tensor dx = want_dx ? dz.new_empty({M, K}) : at::Tensor();
  at::Tensor dw = want_dw ? dz.new_empty({N, K}) : at::Tensor();
  if (K == 0 || (!want_dx && !want_dw)) return {dx, dw};
  if (M == 0 || N == 0) {  // an empty contraction: zeros
    for (auto* t : {&dx, &dw})
      if (t->defined()) t->zero_();
    return {dx, dw};
  }
  auto scratch = dz.new_empty({gemmfuse::sparse_scratch(M, N)}, dz.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err =
      dtype == at::kFloat      ? launch<float>(dz, weight, x, dx, dw, scratch, stream)
      : dtype == at::kBFloat16 ? launch<__nv_bfloat16>(dz, weight, x, dx, dw, scratch, stream)
                               : launch<__half>(dz, weight, x, dx, dw, scratch, stream);
  check_cuda(err, "sparse_products launch");
  return {dx, dw};
}
