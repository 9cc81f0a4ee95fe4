// The host extension's Python module: every entry point (bind_*.cpp add them by group).
#include "host_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_splits(m);
  bind_epilogue(m);
  bind_backward(m);
  bind_split_cache(m);
  bind_plan(m);
  bind_launch(m);
  bind_plan_call(m);
  bind_plan_run(m);  // after bind_plan_call: it adds to its class
}
