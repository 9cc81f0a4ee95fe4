// The host extension's Python module in parts (bind_*.cpp), each adding its group of entry
// points, with named arguments, to the module host_module.cpp defines.
#pragma once
#include <torch/csrc/utils/pybind.h>

#include "host_entry.h"

void bind_splits(pybind11::module_& m);
void bind_epilogue(pybind11::module_& m);
void bind_backward(pybind11::module_& m);
void bind_split_cache(pybind11::module_& m);
void bind_plan(pybind11::module_& m);
void bind_launch(pybind11::module_& m);
void bind_plan_call(pybind11::module_& m);
void bind_plan_run(pybind11::module_& m);
