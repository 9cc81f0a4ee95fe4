// A planned call's backward (host_plan.h) as an autograd node: what
// gemmfuse.autograd.fused_backward computes on the kernel path, without Python (the chain
// backward kernel's dz and column sums, the products dx = dz W and dW = dz^T x on the sparse
// kernels, the split kernel or PyTorch's, db the column sum of dz). Its own translation unit:
// the autograd headers are the heaviest the host extension parses.
#include <algorithm>
#include <string>
#include <type_traits>

#include "autograd_node.h"
#include "host_common.h"
#include "host_plan.h"

namespace gemmfuse {
namespace host {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// A tensor the backward reads, with the version the forward saw (save_for_backward's check).
struct Saved {
  const char* name;
  at::Tensor tensor;
  int64_t version;
};

struct FusedLinearBackward : public Node {
  std::shared_ptr<const PlanState> plan;
  at::Tensor x, weight, z, gn_weight, gn_bias;  // gn_*: the float32 vectors the forward read
  std::vector<at::Tensor> vectors;              // the kernel tensor arguments, likewise
  std::vector<std::vector<int64_t>> param_sizes;
  std::vector<int64_t> param_edge;  // each params tensor's edge (-1: the kernels do not read it)
  std::vector<Saved> saved;
  bool released = false;

  std::string name() const override { return "GemmfuseFusedLinearBackward"; }

  void release_variables() override {
    x = weight = z = gn_weight = gn_bias = at::Tensor();
    vectors.clear();
    saved.clear();
    released = true;
  }

  void check_saved() const {
    TORCH_CHECK(!released,
                "gemmfuse: trying to backward through a fused call a second time (or to read "
                "its saved tensors after they were freed); specify retain_graph=True the first "
                "time");
    // The versions as text (std::to_string): streaming an integer into the message crashed
    // on autograd's thread (the H100 machine, torch 2.11: inside basic_ostream::_M_insert<long>)
    for (const auto& s : saved)
      TORCH_CHECK(static_cast<int64_t>(s.tensor._version()) == s.version,
                  "gemmfuse: ", s.name, ", which the fused call's backward reads, was modified "
                  "by an in-place operation after the forward: it is at version ",
                  std::to_string(s.tensor._version()), ", the forward saw version ",
                  std::to_string(s.version));
  }

  // dx = dz @ weight: contraction over the N output channels (autograd.grad_input).
  at::Tensor grad_input(const at::Tensor& dz) const {
    const PlanSpec& spec = plan->spec;
    if (!(spec.split_dx && weight.size(1) <= gemmfuse::kSplitColsMax)) return dz.mm(weight);
    const int64_t n_padded = split_padded(dz.size(1));
    const auto a = split_rows(unit_stride(dz), n_padded);
    const auto b = plan->cache->cols(weight, n_padded);
    return gemm_split(spec.plain_table, a[0], a[1], a[2], b[0], b[1], b[2], spec.kernel,
                      spec.split);
  }

  // dW = dz^T @ x: contraction over the M rows, both read down their columns (grad_weight).
  at::Tensor grad_weight(const at::Tensor& dz) const {
    const PlanSpec& spec = plan->spec;
    if (!(spec.split_dw && std::max(dz.size(1), x.size(1)) <= gemmfuse::kSplitColsMax))
      return dz.t().mm(x);
    const int64_t m_padded = split_padded(dz.size(0));
    const auto a = split_cols(unit_stride(dz), m_padded);
    const auto b = split_cols(unit_stride(x), m_padded);
    return gemm_split(spec.plain_table, a[0], a[1], a[2], b[0], b[1], b[2], spec.kernel,
                      spec.split);
  }

  // The kernel tensor arguments' gradients from their column sums (autograd's
  // _kernel_chain_backward): a one-element tensor sums its columns in float64 first (they may
  // cancel); a tensor read twice adds its two gradients.
  void param_grads(const at::Tensor& sums, const at::Tensor& rounded, variable_list& out) const {
    const PlanSpec& spec = plan->spec;
    const int64_t M = z.size(0), N = z.size(1);
    for (size_t k = 0; k < spec.channel_params.size(); ++k) {
      const int64_t i = spec.channel_params[k], edge = param_edge[i];
      const auto& sizes = param_sizes[i];
      if (!task_should_compute_output(edge) || per_element(sizes, M, N)) continue;
      const int64_t slot = spec.first_slot + static_cast<int64_t>(k);
      int64_t numel = 1;
      for (int64_t s : sizes) numel *= s;
      at::Tensor g = numel == 1 ? sums[slot].sum().to(z.scalar_type()) : rounded[slot];
      g = g.reshape(sizes);
      out[edge] = out[edge].defined() ? out[edge].add(g) : g;
    }
  }

  variable_list apply(variable_list&& grads) override {
    check_saved();
    variable_list out(num_outputs());
    if (grads.empty() || !grads[0].defined()) return out;
    const bool create_graph = at::GradMode::is_enabled();
    {
      at::AutoGradMode no_grad(false);
      c10::cuda::CUDAGuard guard(z.device());
      const PlanSpec& spec = plan->spec;
      const auto r = chain_backward(spec.table, z, grads[0], maybe(gn_weight), maybe(gn_bias),
                                    vectors, spec.scalars, spec.group_size, spec.eps);
      const at::Tensor &dz = r[0], &sums = r[1], &rounded = r[2];  // rounded: sums in z's dtype
      const bool want_dx = task_should_compute_output(0), want_dw = task_should_compute_output(1);
      if (spec.sparse && (want_dx || want_dw)) {
        auto products = sparse_products(dz, weight, x, want_dx, want_dw);
        out[0] = std::move(products[0]);
        out[1] = std::move(products[1]);
      } else {
        if (want_dx) out[0] = grad_input(dz);
        if (want_dw) out[1] = grad_weight(dz);
      }
      if (task_should_compute_output(2)) out[2] = rounded[0];
      if (gn_weight.defined()) {
        if (task_should_compute_output(3)) out[3] = rounded[1];
        if (task_should_compute_output(4)) out[4] = rounded[2];
      }
      param_grads(sums, rounded, out);
    }
    // Differentiable once, as autograd.FusedLinearFunction (once_differentiable): with
    // create_graph the gradients carry a node that refuses a second differentiation.
    if (create_graph && grads[0].requires_grad()) {
      auto error = make_node<torch::autograd::Error>(
          "gemmfuse: the fused call's backward is not differentiable (a second derivative)",
          torch::autograd::collect_next_edges(grads[0]));
      for (auto& g : out) {
        if (!g.defined()) continue;
        g = g.tensor_data();  // not a view of the column sums: a tensor of its own history
        torch::autograd::set_history(g, error);
      }
    }
    return out;
  }
};

}  // namespace

void record_backward(const std::shared_ptr<const PlanState>& plan, const at::Tensor& out,
                     const std::vector<at::Tensor>& t, const at::Tensor& z,
                     const at::Tensor& gn_weight, const at::Tensor& gn_bias,
                     const std::vector<at::Tensor>& vectors) {
  auto node = make_node<FusedLinearBackward>();
  node->plan = plan;
  node->x = t[0];
  node->weight = t[1];
  node->z = z;
  node->gn_weight = gn_weight;
  node->gn_bias = gn_bias;
  node->vectors = vectors;
  // Edges: x, weight, bias, gn_weight, gn_bias, then each params tensor the kernels read, once.
  variable_list inputs(t.begin(), t.begin() + 5);
  const size_t params = t.size() - 5;
  node->param_sizes.resize(params);
  node->param_edge.assign(params, -1);
  static const char* const names[] = {"x", "weight", "bias", "gn_weight", "gn_bias"};
  for (int i : {0, 1, 3, 4})
    if (t[i].defined()) node->saved.push_back({names[i], t[i], t[i]._version()});
  for (int64_t i : plan->spec.channel_params) {
    if (node->param_edge[i] >= 0) continue;
    node->param_edge[i] = static_cast<int64_t>(inputs.size());
    node->param_sizes[i] = t[5 + i].sizes().vec();
    inputs.push_back(t[5 + i]);
    node->saved.push_back({"a params tensor", t[5 + i], t[5 + i]._version()});
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(out, node);
}

}  // namespace host
}  // namespace gemmfuse
