// Binds the host extension's epilogue entry points (one translation unit per group: pybind11's
// templates are most of the extension's compile time).
#include "host_bindings.h"

void bind_epilogue(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("epilogue_forward", &epilogue_forward, py::arg("table"), py::arg("y"),
        py::arg("gn_weight"), py::arg("gn_bias"), py::arg("vec_params"), py::arg("scalar_params"),
        py::arg("group_size"), py::arg("eps"), py::arg("norm_wide"), py::arg("in_place"),
        py::arg("group_stats") = 0);
  m.def("tail_outer", &tail_outer, py::arg("value"), py::arg("operand"), py::arg("op"),
        py::arg("value_inner"), py::arg("shape"));
}
