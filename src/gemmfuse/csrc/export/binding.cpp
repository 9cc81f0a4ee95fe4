// The host extension as a standalone export builds it: its translation units as one (load_inline
// takes one C++ source). The package compiles them apart, in parallel (gemmfuse/jit.py).
#include "host_split.cpp"
#include "host_sparse.cpp"
#include "host_forward.cpp"
#include "host_backward.cpp"
#include "host_plan.cpp"
#include "host_autograd.cpp"
#include "host_tail.cpp"
#include "bind_splits.cpp"
#include "bind_epilogue.cpp"
#include "bind_backward.cpp"
#include "bind_plan.cpp"
#include "host_module.cpp"
