// Binds the host extension's splits entry points (one translation unit per group: pybind11's
// templates are most of the extension's compile time).
#include "host_bindings.h"

void bind_splits(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("split_rows", &split_rows, py::arg("x"), py::arg("k_padded"));
  m.def("split_cols", &split_cols, py::arg("x"), py::arg("rows_padded"));
  m.def("gemm_split", &gemm_split, py::arg("table"), py::arg("a_hi"), py::arg("a_lo"),
        py::arg("a_inv_scale"), py::arg("b_hi"), py::arg("b_lo"), py::arg("b_inv_scale"),
        py::arg("kernel"), py::arg("split"));
}
