// Binds the planned calls' pieces (host_plan.h): SplitCache; PlanSpec, the decisions
// gemmfuse/plan.py makes; and launch, the forward's executor (ops.launch_path runs every call
// decided afresh through it). The Plan itself is bind_plan_call.cpp's (apart so that the two
// compile in parallel: this file took 9.3 s, the host extension's slowest translation unit on the
// 2-core development machine).
#include "host_bindings.h"
#include "host_plan.h"

#include <optional>
#include <tuple>

namespace {

namespace py = pybind11;
using gemmfuse::host::defined_or_empty;
using gemmfuse::host::Launched;
using gemmfuse::host::PlanSpec;
using gemmfuse::host::SplitCache;

}  // namespace

void bind_plan(pybind11::module_& m) {
  // Module-local: a standalone export loads one such module per chain, each with these types.
  py::class_<SplitCache, std::shared_ptr<SplitCache>>(m, "SplitCache", py::module_local())
      .def(py::init<bool>(), py::arg("keeps") = true)
      .def("rows", &SplitCache::rows, py::arg("weight"), py::arg("k_padded"))
      .def("cols", &SplitCache::cols, py::arg("weight"), py::arg("n_padded"));
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
  m.def(
      "launch",
      [](const PlanSpec& spec, const std::shared_ptr<SplitCache>& cache,
         const std::vector<std::optional<at::Tensor>>& tensors, bool save_z) {
        const std::vector<at::Tensor> t = defined_or_empty(tensors);
        gemmfuse::host::check_launch(spec, cache.get(), t);
        Launched call = gemmfuse::host::launch_spec(spec, *cache, t, save_z);
        std::optional<at::Tensor> z;  // None where none was saved
        if (call.z.defined()) z = std::move(call.z);
        return std::make_tuple(std::move(call.out), std::move(z));
      },
      py::arg("spec"), py::arg("cache"), py::arg("tensors"), py::arg("save_z"));
}
