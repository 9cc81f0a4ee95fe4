"""``fused_epilogue``: a chain on an (M, N) tensor computed elsewhere, in one CUDA kernel.

The kernel is the one ``fused_linear``'s epilogue path runs after PyTorch's GEMM
(csrc/epilogue/norm_finalize.cuh says which; a GroupNorm wider than a 128-channel tile on a
row the one-launch kernels do not hold adds a second sweep), here on a tensor the caller gives:
a chain after an op that is not a Linear, or the rest of a chain
that needs the whole (M, N) value first (a BatchNorm1d in training mode: its batch statistics,
then the normalisation and what follows, modules.py). Paths:

``epilogue``
    CUDA float32 on sm_80+, the chain's tensor arguments per channel: the chain kernel; with
    autograd recording, :class:`gemmfuse.autograd.FusedEpilogueFunction` (the chain backward
    kernel where it fits, as ``fused_linear``'s backward).
``torch``
    The PyTorch reference (reference.py): CPU tensors, other dtypes, arguments not per channel,
    and inside ``torch.compile`` (whose compiler fuses the reference's ops itself). A CUDA call
    outside ``torch.compile`` warns (:class:`gemmfuse.FallbackWarning`) why.

Tail ops (after a reduction) run as tail.py runs them: PyTorch's, a float32 outer broadcast in
one kernel.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import warnings
from collections.abc import Sequence

import torch

from gemmfuse.autograd import FusedEpilogueFunction
from gemmfuse.dispatch import FallbackWarning, select_epilogue_path
from gemmfuse.epilogue import Epilogue
from gemmfuse.jit import extension_for
from gemmfuse.ops import chain_arguments, records_grad
from gemmfuse.reference import apply_epilogue
from gemmfuse.tail import apply_tail
from gemmfuse.validation import epilogue_argument_problem, raise_problem


def fused_epilogue(
    z: torch.Tensor,
    epilogue: Epilogue,
    gn_weight: torch.Tensor | None = None,
    gn_bias: torch.Tensor | None = None,
    *,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``epilogue(z)`` as PyTorch computes it, in one CUDA kernel where it can.

    Args:
        z: the (M, N) tensor the chain starts from (what a Linear's output is to
            ``fused_linear``).
        epilogue, gn_weight, gn_bias, params: as in :func:`gemmfuse.fused_linear`.

    Returns what the chain returns in PyTorch; with autograd recording, gradients for z, the
    GroupNorm's affine vectors and ``params``.
    """
    return fused_epilogue_with_path(z, epilogue, gn_weight, gn_bias, params=params)[0]


def fused_epilogue_with_path(
    z, epilogue, gn_weight=None, gn_bias=None, *, params=()
) -> tuple[torch.Tensor, str]:
    """:func:`fused_epilogue`, also returning the path taken: "epilogue" or "torch"."""
    raise_problem(epilogue_argument_problem(z, epilogue, gn_weight, gn_bias, params))
    compiling = torch.compiler.is_compiling()
    path, reason = ("torch", "") if compiling else select_epilogue_path(z, epilogue, params)
    if path == "torch":
        if z.is_cuda and not compiling:
            warnings.warn(f"gemmfuse: {reason}", FallbackWarning, stacklevel=3)
        out = apply_epilogue(z, epilogue, gn_weight, gn_bias, params)
        # an empty chain returns its input: the result is a new tensor on every path
        return (out.clone() if out is z else out), path
    launch = _epilogue_launcher(epilogue)
    if records_grad(epilogue.channel_params, params, z, gn_weight, gn_bias):
        out = FusedEpilogueFunction.apply(epilogue.untailed, launch, z, gn_weight, gn_bias, *params)
    else:
        out = launch(z, gn_weight, gn_bias, params)
    return apply_tail(out, epilogue, params), path


def _epilogue_launcher(epilogue: Epilogue):
    """launch(z, gn_weight, gn_bias, params) -> the chain up to its tail ops, on the kernel."""

    def launch(z, gn_weight, gn_bias, params):
        m, n = z.shape
        y = z.detach().contiguous()  # read, not written: the kernel writes a new tensor
        gn = [None if t is None else t.detach().contiguous() for t in (gn_weight, gn_bias)]
        out = extension_for(epilogue).epilogue_forward(
            y, *gn, *chain_arguments(epilogue, params, m, n), False
        )
        return out.view(m, 1) if epilogue.reduce is not None and epilogue.reduce.keepdim else out

    return launch
