"""KernelBench-format problem files (Model, size constants, get_inputs, get_init_inputs)."""
