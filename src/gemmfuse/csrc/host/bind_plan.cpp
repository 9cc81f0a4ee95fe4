// Binds PlanSpec (host_plan.h): the decisions gemmfuse/plan.py makes, which the host's executor
// runs. The Plan itself is bind_plan_call.cpp's, SplitCache bind_split_cache.cpp's and launch
// bind_launch.cpp's (apart so that they compile in parallel).
#include "host_bindings.h"
#include "host_plan.h"

#include <vector>

namespace {

namespace py = pybind11;
using gemmfuse::host::PlanSpec;

}  // namespace

void bind_plan(pybind11::module_& m) {
  py::class_<PlanSpec>(m, "PlanSpec", py::module_local())
      .def(py::init([](int64_t table, int64_t plain_table, bool model16, int64_t kernel_code,
                       bool split, std::vector<double> scalars, int64_t group_size, double eps,
                       bool norm_wide, bool keepdim, std::vector<int64_t> channel_params,
                       bool epilogue_path, int64_t group_stats, bool gemv, bool chain_apart,
                       int64_t k_splits, int64_t first_slot, bool backward, bool split_dx,
                       bool split_dw, bool sparse) {
             return PlanSpec{table,          plain_table,   model16,     kernel_code, split,
                             scalars,        group_size,    eps,         norm_wide,   keepdim,
                             channel_params, first_slot,    backward,    split_dx,    split_dw,
                             sparse,         epilogue_path, group_stats, gemv,        chain_apart,
                             k_splits};
           }),
           py::kw_only(), py::arg("table"), py::arg("plain_table"), py::arg("model16"),
           py::arg("kernel_code"), py::arg("split"), py::arg("scalars"), py::arg("group_size"),
           py::arg("eps"), py::arg("norm_wide"), py::arg("keepdim"), py::arg("channel_params"),
           py::arg("epilogue_path"), py::arg("group_stats"), py::arg("gemv"),
           py::arg("chain_apart"), py::arg("k_splits"), py::arg("first_slot") = 1,
           py::arg("backward") = false, py::arg("split_dx") = false, py::arg("split_dw") = false,
           py::arg("sparse") = false);
}
