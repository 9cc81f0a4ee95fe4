// The host extension's Plan as Python calls it (bind_plan_call.cpp, bind_plan_run.cpp): a
// planned call (host_plan.h) called with a fused_linear call's own arguments. A call that is not
// the plan's kind returns None without raising: Python then decides it afresh (and raises the
// readable error, where there is one).
#pragma once
#include <torch/csrc/utils/pybind.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "host_plan.h"

namespace gemmfuse {
namespace host {

namespace py = pybind11;

// A plain tensor or Parameter (a call with a subclass is decided afresh by the Python rules).
inline bool unpack(py::handle h, at::Tensor& t) {
  // Held for the process's life (never released: no Python call at exit).
  static const py::handle tensor = py::object(py::module_::import("torch").attr("Tensor")).release();
  static const py::handle parameter =
      py::object(py::module_::import("torch.nn.parameter").attr("Parameter")).release();
  if (h.is_none()) {
    t = at::Tensor();
    return true;
  }
  const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()));
  if (!type.is(tensor) && !type.is(parameter)) return false;
  t = h.cast<at::Tensor>();
  return true;
}

// a is b, or a == b (a comparison that raises counts as different)
inline bool same(py::handle a, const py::object& b) {
  if (a.ptr() == b.ptr()) return true;
  const int equal = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (equal < 0) PyErr_Clear();
  return equal == 1;
}

// A Plan with the Python-side part of its key: the epilogue (the same object, or an equal one),
// kernel and precision.
class __attribute__((visibility("hidden"))) PlanCall {
 public:
  PlanCall(std::shared_ptr<SplitCache> cache, py::object epilogue, py::object kernel,
           py::object precision, const std::vector<std::optional<at::Tensor>>& tensors,
           const PlanSpec& spec)
      : plan_(std::move(cache), spec, defined_or_empty(tensors)),
        epilogue_(std::move(epilogue)),
        kernel_(std::move(kernel)),
        precision_(std::move(precision)),
        tensors_(tensors.size()) {}

  py::object operator()(py::handle epilogue, py::handle kernel, py::handle precision,
                        py::handle x, py::handle weight, py::handle bias, py::handle gn_weight,
                        py::handle gn_bias, py::handle params) const {
    std::vector<at::Tensor> t;
    if (!call_tensors(epilogue, kernel, precision, {x, weight, bias, gn_weight, gn_bias}, params, t))
      return py::none();
    at::Tensor out = plan_.run(t);
    if (!out.defined()) return py::none();
    return py::cast(std::move(out));
  }

  // (out, z) as the op gemmfuse::fused_linear_saving_z returns them, or None (operator()'s
  // rules).
  py::object saving_z(py::handle epilogue, py::handle kernel, py::handle precision,
                      py::handle x, py::handle weight, py::handle bias, py::handle gn_weight,
                      py::handle gn_bias, py::handle params) const {
    std::vector<at::Tensor> t;
    if (!call_tensors(epilogue, kernel, precision, {x, weight, bias, gn_weight, gn_bias}, params, t))
      return py::none();
    auto [out, z] = plan_.run_saving_z(t);
    if (!out.defined()) return py::none();
    return py::make_tuple(std::move(out), std::move(z));
  }

  // The path the plan runs, as fused_linear_with_path names it.
  const char* path() const { return plan_.spec().epilogue_path ? "epilogue" : "fused"; }

 private:
  // The call's tensors (x, weight, bias, gn_weight, gn_bias, params...) where its Python-side
  // key is the plan's and each is a plain tensor (or None where allowed); false otherwise.
  bool call_tensors(py::handle epilogue, py::handle kernel, py::handle precision,
                    std::initializer_list<py::handle> first, py::handle params,
                    std::vector<at::Tensor>& t) const {
    if (!same(epilogue, epilogue_) || !same(kernel, kernel_) || !same(precision, precision_))
      return false;
    if (!PyTuple_Check(params.ptr()) && !PyList_Check(params.ptr())) return false;
    const py::sequence seq = py::reinterpret_borrow<py::sequence>(params);
    if (first.size() + seq.size() != tensors_) return false;
    t.resize(tensors_);
    size_t i = 0;
    for (py::handle h : first)
      if (!unpack(h, t[i++])) return false;
    for (size_t j = 0; j < seq.size(); ++j, ++i)
      if (!unpack(seq[j], t[i]) || !t[i].defined()) return false;
    return true;
  }

  Plan plan_;
  py::object epilogue_, kernel_, precision_;
  size_t tensors_;
};

}  // namespace host
}  // namespace gemmfuse
