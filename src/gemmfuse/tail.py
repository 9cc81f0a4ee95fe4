"""A chain's tail ops (after its reduction) on the reduction's result, as PyTorch computes them.

Each op is PyTorch's, but one whose tensor operand broadcasts the reduction's value into an
outer product's layout (#75's ``(M, 1) + (1, C, 1, 1) -> (1, C, M, 1)``, ``dispatch.outer_layout``)
runs in one CUDA kernel (csrc/operands/outer_binary.cu) in a float32 model
(``dispatch.OUTER_DTYPES`` says why not a 16-bit one): PyTorch's broadcasting kernel reads one
value a thread through an offset calculator (22 us for #75's output, H200, 2026-11-26), this
one stores 16 bytes a thread (11 us). Its values are PyTorch's bit for bit, and with autograd
recording so are its gradients (a C++ autograd node,
csrc/host/host_tail.cpp, with PyTorch's formulas for the op, whose results autograd's engine
reduces to each input's shape as it does for PyTorch's own op).
Under torch.compile the ops stay PyTorch's, for its compiler to fuse.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

from collections.abc import Sequence

import torch
from torch.autograd.forward_ad import unpack_dual

from gemmfuse.dispatch import OUTER_DTYPES, OUTER_OPS, kernels_run_on, outer_layout
from gemmfuse.epilogue import Epilogue
from gemmfuse.jit import extension_for
from gemmfuse.pointwise import POINTWISE
from gemmfuse.reference import op_argument


def apply_tail(
    v: torch.Tensor, epilogue: Epilogue, params: Sequence[torch.Tensor] = (), kernel: bool = True
):
    """``epilogue.tail`` on the reduction's result ``v`` (what ``reference.apply_pointwise``
    computes), an outer broadcast in one kernel. ``kernel=False``: PyTorch's ops alone (a call
    that took the PyTorch path, for which no kernel library is built)."""
    values = [v]
    for op in epilogue.tail:
        args = [op_argument(a, params, values) for a in op.args]
        out = _outer(epilogue, op.name, values[-1], args) if kernel else None
        values.append(POINTWISE[op.name].torch(values[-1], *args) if out is None else out)
    return values[-1]


def _outer(epilogue: Epilogue, name: str, v: torch.Tensor, args: list):
    """The op on the outer-broadcast kernel, or None where it does not apply."""
    if name not in OUTER_OPS or len(args) != 1 or torch.compiler.is_compiling():
        return None
    operand = args[0]
    if not (isinstance(operand, torch.Tensor) and kernels_run_on(v) and operand.device == v.device):
        return None
    if v.dtype not in OUTER_DTYPES or operand.dtype != v.dtype:
        return None  # PyTorch's type promotion decides the result's dtype
    if not (v.is_contiguous() and operand.is_contiguous()):
        return None  # PyTorch's result may follow a permuted input's layout; the kernel's not
    if any(unpack_dual(t).tangent is not None for t in (v, operand)):
        return None  # forward-mode AD: the C++ op carries no tangent
    layout = outer_layout(v, operand)
    if layout is None:
        return None
    value_inner, shape = layout
    # autograd records in C++ (host_tail.cpp's node) where v or the operand requires grad
    return extension_for(epilogue).tail_outer(v, operand, OUTER_OPS.index(name), value_inner,
                                              list(shape))  # fmt: skip
