// Binds SplitCache (host_plan.h): a module's weight splits and float32 vectors, which its plans
// share. Apart from bind_plan.cpp and bind_launch.cpp so that the three compile in parallel (as
// one file, 15.6 s: the host extension's slowest translation unit on an H200 machine's core).
#include "host_bindings.h"
#include "host_plan.h"

namespace {

namespace py = pybind11;
using gemmfuse::host::SplitCache;

}  // namespace

void bind_split_cache(pybind11::module_& m) {
  // Module-local: a standalone export loads one such module per chain, each with these types.
  py::class_<SplitCache, std::shared_ptr<SplitCache>>(m, "SplitCache", py::module_local())
      .def(py::init<bool>(), py::arg("keeps") = true)
      .def("rows", &SplitCache::rows, py::arg("weight"), py::arg("k_padded"))
      .def("cols", &SplitCache::cols, py::arg("weight"), py::arg("n_padded"));
}
