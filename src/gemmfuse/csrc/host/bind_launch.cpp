// Binds launch: the forward's executor (host_plan.h), which ops.launch_path runs every call
// decided afresh through.
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

void bind_launch(pybind11::module_& m) {
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
