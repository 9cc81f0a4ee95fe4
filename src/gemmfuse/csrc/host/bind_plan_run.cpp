// Binds a Plan's calls (plan_call.h) on the class bind_plan_call.cpp registers.
#include "host_bindings.h"
#include "plan_call.h"

namespace {

namespace py = pybind11;
using gemmfuse::host::PlanCall;

}  // namespace

void bind_plan_run(pybind11::module_& m) {
  // bind_plan_call has registered Plan: its methods added to that class
  py::reinterpret_borrow<py::class_<PlanCall>>(m.attr("Plan"))
      .def("__call__", &PlanCall::operator(), py::arg("epilogue"), py::arg("kernel"),
           py::arg("precision"), py::arg("x"), py::arg("weight"), py::arg("bias"),
           py::arg("gn_weight"), py::arg("gn_bias"), py::arg("params"))
      .def("saving_z", &PlanCall::saving_z, py::arg("epilogue"), py::arg("kernel"),
           py::arg("precision"), py::arg("x"), py::arg("weight"), py::arg("bias"),
           py::arg("gn_weight"), py::arg("gn_bias"), py::arg("params"));
}
