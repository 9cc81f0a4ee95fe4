// The host extension's tail ops: the outer broadcast of a reduction's value against an operand
// (outer_binary.cu), with its backward as an autograd node: PyTorch's derivative formulas for
// the op (derivatives.yaml's, alpha 1) in the output's shape, which autograd's engine reduces to
// each input's shape as it does for PyTorch's own broadcasting op. A C++ node, not a Python
// autograd.Function: less host time a call (the forward and backward of a bf16 step took some
// 100 us more with one, H200, 2026-11-26, when the kernel still took 16-bit models).
#include "autograd_node.h"
#include "host_common.h"
#include "outer_binary.h"

namespace gemmfuse {
namespace host {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

struct TailOuterBackward : public Node {
  int64_t op = 0;
  at::Tensor value, operand;  // saved for mul and div only, each where a gradient reads it
  int64_t value_version = 0, operand_version = 0;
  bool released = false;

  std::string name() const override { return "GemmfuseTailOuterBackward"; }

  void release_variables() override {
    value = operand = at::Tensor();
    released = true;
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(2);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    const bool want_v = task_should_compute_output(0), want_a = task_should_compute_output(1);
    if (op == gemmfuse::kOuterMul || op == gemmfuse::kOuterDiv) {
      TORCH_CHECK(!released,
                  "gemmfuse: trying to backward through a tail op a second time; specify "
                  "retain_graph=True the first time");
      TORCH_CHECK((!value.defined() || value._version() == value_version) &&
                      (!operand.defined() || operand._version() == operand_version),
                  "gemmfuse: a tensor the tail op's backward reads was modified by an in-place "
                  "operation after the forward");
    }
    at::Tensor dv, da;
    switch (op) {
      case gemmfuse::kOuterAdd: dv = da = g; break;
      case gemmfuse::kOuterSub:
        dv = g;
        if (want_a) da = g.neg();
        break;
      case gemmfuse::kOuterRsub:
        if (want_v) dv = g.neg();
        da = g;
        break;
      case gemmfuse::kOuterMul:
        if (want_v) dv = g.mul(operand);
        if (want_a) da = g.mul(value);
        break;
      default:
        if (want_v) dv = g.div(operand);
        if (want_a) da = g.neg().mul(value.div(operand).div(operand));
    }
    if (want_v) out[0] = dv;
    if (want_a) out[1] = da;
    // Differentiable once, as the fused call: with create_graph the gradients carry a node that
    // refuses a second differentiation.
    if (at::GradMode::is_enabled() && g.requires_grad()) {
      auto error = make_node<torch::autograd::Error>(
          "gemmfuse: a tail op's backward is not differentiable (a second derivative)",
          torch::autograd::collect_next_edges(g));
      for (auto& t : out) {
        if (!t.defined()) continue;
        t = t.tensor_data();
        torch::autograd::set_history(t, error);
      }
    }
    return out;
  }
};

}  // namespace
}  // namespace host
}  // namespace gemmfuse

using namespace gemmfuse::host;

// value, operand: float32 CUDA tensors whose broadcast is an outer product's layout
// (dispatch.outer_layout) of `shape`: out[o * inner + i] = op(value[i], operand[o]) where
// value_inner (inner = value's size), else op(value[o], operand[i]); op as gemmfuse::OuterOp
// numbers them. Where autograd records and either input
// requires grad, the result carries a TailOuterBackward node.
at::Tensor tail_outer(at::Tensor value, at::Tensor operand, int64_t op, bool value_inner,
                      std::vector<int64_t> shape) {
  TORCH_CHECK(value.is_cuda() && operand.device() == value.device() &&
                  value.scalar_type() == at::kFloat && operand.scalar_type() == at::kFloat,
              "gemmfuse: tail_outer needs float32 CUDA tensors on one device");
  TORCH_CHECK(op >= gemmfuse::kOuterAdd && op <= gemmfuse::kOuterDiv,
              "gemmfuse: tail_outer: bad op ", std::to_string(op));
  c10::cuda::CUDAGuard guard(value.device());
  const bool record = at::GradMode::is_enabled() && (value.requires_grad() || operand.requires_grad());
  at::Tensor out;
  {
    at::AutoGradMode no_grad(false);
    const at::Tensor v = value.detach().reshape({-1}).contiguous();
    const at::Tensor a = operand.detach().reshape({-1}).contiguous();
    const int64_t inner = value_inner ? v.numel() : a.numel();
    const int64_t outer = value_inner ? a.numel() : v.numel();
    out = v.new_empty(shape);
    TORCH_CHECK(out.numel() == outer * inner, "gemmfuse: tail_outer: shape does not hold ",
                std::to_string(outer), " x ", std::to_string(inner), " values");
    check_cuda(gemmfuse::launch_outer_binary(
                   v.data_ptr<float>(), a.data_ptr<float>(), out.data_ptr<float>(), outer, inner,
                   value_inner, static_cast<int>(op), c10::cuda::getCurrentCUDAStream()),
               "tail_outer launch");
  }
  if (record) {
    auto node = make_node<TailOuterBackward>();
    node->op = op;
    if (op == gemmfuse::kOuterMul || op == gemmfuse::kOuterDiv) {
      // As PyTorch's nodes save: the value for the operand's gradient; the operand for the
      // value's (and, dividing, for its own). So an in-place change to a tensor no gradient
      // reads is not refused.
      if (operand.requires_grad()) {
        node->value = value;
        node->value_version = value._version();
      }
      if (value.requires_grad() || (op == gemmfuse::kOuterDiv && operand.requires_grad())) {
        node->operand = operand;
        node->operand_version = operand._version();
      }
    }
    node->set_next_edges(torch::autograd::collect_next_edges(value, operand));
    torch::autograd::set_history(out, node);
  }
  return out;
}
