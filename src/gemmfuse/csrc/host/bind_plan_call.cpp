// Binds Plan (plan_call.h): its construction and the path it runs. Its calls are
// bind_plan_run.cpp's (apart so that the two compile in parallel: as one file, 12.6 s, the host
// extension's slowest translation unit on an H200 machine's core).
#include "host_bindings.h"
#include "plan_call.h"

#include <optional>
#include <vector>

namespace {

namespace py = pybind11;
using gemmfuse::host::PlanCall;
using gemmfuse::host::PlanSpec;
using gemmfuse::host::SplitCache;

}  // namespace

void bind_plan_call(pybind11::module_& m) {
  py::class_<PlanCall>(m, "Plan", py::module_local())
      .def(py::init<std::shared_ptr<SplitCache>, py::object, py::object, py::object,
                    std::vector<std::optional<at::Tensor>>, const PlanSpec&>(),
           py::arg("cache"), py::arg("epilogue"), py::arg("kernel"), py::arg("precision"),
           py::arg("tensors"), py::arg("spec"))
      .def_property_readonly("path", &PlanCall::path);
}
