// Binds the host extension's forward entry points (one translation unit per group: pybind11's
// templates are most of the extension's compile time).
#include "host_bindings.h"

void bind_forward(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("fused_forward", &fused_forward, py::arg("table"), py::arg("x"), py::arg("w_hi"),
        py::arg("w_lo"), py::arg("w_inv_scale"), py::arg("bias"), py::arg("gn_weight"),
        py::arg("gn_bias"), py::arg("vec_params"), py::arg("scalar_params"),
        py::arg("group_size"), py::arg("eps"), py::arg("kernel"), py::arg("split"),
        py::arg("norm_wide"), py::arg("z_out"));
  m.def("fused_forward_16bit", &fused_forward_16bit, py::arg("table"), py::arg("x"), py::arg("w"),
        py::arg("bias"), py::arg("gn_weight"), py::arg("gn_bias"), py::arg("vec_params"),
        py::arg("scalar_params"), py::arg("group_size"), py::arg("eps"), py::arg("norm_wide"),
        py::arg("z_out"));
}
