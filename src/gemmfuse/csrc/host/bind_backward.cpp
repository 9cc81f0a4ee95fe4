// Binds the host extension's backward entry points (one translation unit per group: pybind11's
// templates are most of the extension's compile time).
#include "host_bindings.h"

void bind_backward(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("chain_backward", &chain_backward, py::arg("table"), py::arg("z"), py::arg("grad"),
        py::arg("gn_weight"), py::arg("gn_bias"), py::arg("vec_params"), py::arg("scalar_params"),
        py::arg("group_size"), py::arg("eps"));
  m.def("chain_backward_plan", &chain_backward_plan, py::arg("table"), py::arg("M"),
        py::arg("N"), py::arg("group_size"), py::arg("model16"));
  m.def("sparse_products", &sparse_products, py::arg("dz"), py::arg("weight"), py::arg("x"),
        py::arg("want_dx"), py::arg("want_dw"));
  m.def("check_table", &check_table, py::arg("table"));
  m.def("linked_chain_table", &linked_chain_table);
  m.def("constants", &constants);
}
