"""ModelNew for KernelBench L2 #62 and #75, and for any problem file (``model_new_for``).

Each class takes its problem Model's constructor arguments and creates the same parameters, in the
same order, with the same initialisers and names, so seeded construction gives identical weights and
state_dicts load either way. Forward runs ``fused_linear``: its fused path on a CUDA float32 input
(on an H100 or H200 at KernelBench's sizes the split GEMM, then the chain in a kernel of its own:
``dispatch.chain_apart``), the PyTorch reference elsewhere. ``last_path`` records the path an eager
call took (a compiled graph's calls leave it as it was: they hold the ``gemmfuse::`` op, whose chain
a ``traced_specs_*`` function gives as constants); setting ``kernel`` to "portable" or "hopper"
forces that fused kernel (the chain in its epilogue), and ``precision`` to "tf32" opts into the
speed mode, the hi*hi product alone (see ``fused_linear``).

``gemmfuse export`` copies these classes (renamed ``ModelNew``) into standalone files, so they
use only torch and names from the standalone-safe modules.
"""

import functools

import torch
import torch.nn as nn

from gemmfuse.epilogue import (
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    traced_constant,
)
from gemmfuse.modules import FusedLinear
from gemmfuse.ops import chain_call_specs, fused_linear_with_path, traced_chain_call
from gemmfuse.optimize import optimize
from gemmfuse.weight_cache import SplitWeightCache


@functools.lru_cache(maxsize=64)
def epilogue_62(num_groups, eps, affine, negative_slope) -> Epilogue:
    """#62's chain; one object per distinct value set, so its derived data is computed once."""
    return Epilogue(
        norm=GroupNormSpec(num_groups, eps, affine),
        post=(Pointwise("leaky_relu", (negative_slope,)), Pointwise("add_self")),
    )


@torch.compiler.assume_constant_result
def traced_specs_62(num_groups, eps, affine, negative_slope) -> tuple:
    """#62's chain as a compiled graph holds it: constants (ops.chain_call_specs says why)."""
    return chain_call_specs(epilogue_62(num_groups, eps, affine, negative_slope))


@functools.lru_cache(maxsize=64)
def epilogue_75(num_groups, eps, affine) -> Epilogue:
    """#75's chain: the row minimum in the kernel, then the bias add as PyTorch broadcasts it,
    (M, 1) + (1, C, 1, 1) -> (1, C, M, 1)."""
    return Epilogue(
        norm=GroupNormSpec(num_groups, eps, affine),
        reduce=Reduction("min", keepdim=True),
        tail=(Pointwise("add", (Param(0),)),),
    )


@torch.compiler.assume_constant_result
def traced_specs_75(num_groups, eps, affine) -> tuple:
    """#75's chain as a compiled graph holds it: constants (ops.chain_call_specs says why)."""
    return chain_call_specs(epilogue_75(num_groups, eps, affine))


class ModelNew62(nn.Module):
    """#62: Linear -> GroupNorm -> LeakyReLU -> x + x."""

    def __init__(self, input_size, hidden_size, num_groups, eps=1e-5, negative_slope=0.01):
        super().__init__()
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)
        self.weight_split = SplitWeightCache()
        self.kernel = "auto"
        self.precision = "fp32"
        self.last_path = None

    def forward(self, x):
        gn = self.gn
        settings = (gn.num_groups, gn.eps, gn.affine, float(self.leaky_relu.negative_slope))
        if torch.compiler.is_compiling():
            return traced_chain_call(
                traced_specs_62(*map(traced_constant, settings)), x, self.fc.weight, self.fc.bias,
                gn.weight, gn.bias, (), self.weight_split, self.kernel, self.precision,
            )  # fmt: skip
        out, self.last_path = fused_linear_with_path(
            x, self.fc.weight, self.fc.bias, epilogue_62(*settings), gn.weight, gn.bias,
            weight_cache=self.weight_split, kernel=self.kernel, precision=self.precision,
        )  # fmt: skip
        return out


class ModelNew75(nn.Module):
    """#75: Linear -> GroupNorm -> min over channels (keepdim) -> + bias (1, C, 1, 1)."""

    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.weight_split = SplitWeightCache()
        self.kernel = "auto"
        self.precision = "fp32"
        self.last_path = None

    def forward(self, x):
        gn = self.group_norm
        settings = (gn.num_groups, gn.eps, gn.affine)
        if torch.compiler.is_compiling():
            return traced_chain_call(
                traced_specs_75(*map(traced_constant, settings)), x, self.gemm.weight,
                self.gemm.bias, gn.weight, gn.bias, (self.bias,), self.weight_split, self.kernel,
                self.precision,
            )  # fmt: skip
        out, self.last_path = fused_linear_with_path(
            x, self.gemm.weight, self.gemm.bias, epilogue_75(*settings), gn.weight, gn.bias,
            params=(self.bias,), weight_cache=self.weight_split, kernel=self.kernel,
            precision=self.precision,
        )  # fmt: skip
        return out


def model_new_for(model_cls: type[nn.Module]) -> type[nn.Module]:
    """The ModelNew of any KernelBench problem: ``model_cls`` whose first call optimizes it.

    ModelNew has Model's constructor (seeded construction gives identical weights under the same
    state_dict keys). Its first call runs ``optimize`` on the model itself and those inputs,
    tracing ``model_cls.forward``; the rewritten module shares the model's parameters and
    buffers and is kept in ``__dict__``, outside the module tree (no duplicate state_dict keys).
    ``kernel`` and ``precision`` are read at each call; ``last_path`` joins the paths its
    FusedLinears took ("fused", "epilogue", "torch", "fallback"); ``gemmfuse_report`` is
    optimize's report.
    """

    class ModelNew(model_cls):
        kernel = "auto"
        precision = "fp32"
        last_path = None

        def forward(self, *inputs):
            state = self.__dict__.get("_gemmfuse")
            if state is None:
                optimized, report = optimize(
                    self, inputs, kernel=self.kernel, precision=self.precision,
                    forward=model_cls.forward,
                )  # fmt: skip
                fused = [m for m in optimized.modules() if isinstance(m, FusedLinear)]
                state = self.__dict__["_gemmfuse"] = (optimized, report, fused)
            optimized, _, fused = state
            for m in fused:
                m.kernel, m.precision = self.kernel, self.precision
            out = optimized(*inputs)
            self.last_path = "/".join(sorted({m.last_path for m in fused})) or "torch"
            return out

        @property
        def gemmfuse_report(self):
            state = self.__dict__.get("_gemmfuse")
            return None if state is None else state[1]

    return ModelNew
