"""``FusedLinear``: an ``nn.Linear`` (or ``F.linear`` call) and the chain after it, run by
``fused_linear``.

``gemmfuse.optimize`` builds these; each replaces one Linear of a traced model together with the
ops after it that the epilogue grammar expresses. A FusedLinear is a second view on the model's
own state, never a copy of it:

- it registers the Linear's parameter dict itself (``weight``, ``bias``: the same Parameter
  objects, under the Linear's state_dict keys), so optimizer steps and ``.to()`` reach both; an
  ``F.linear`` call's weight and bias are read at each call from the module that holds them;
- it holds the GroupNorm module and the pointwise modules of the chain by reference, without
  registering them (they stay registered at their own paths), and reads their settings
  (``num_groups``, ``eps``, ``weight``, ``bias``, a LeakyReLU's slope...) at each call;
- it reads each tensor operand (a parameter or buffer of the model) at each call from the
  module that holds it, so a buffer that ``.to()`` replaced is seen; a plain tensor attribute
  (not a buffer) is the tensor optimize saw, as README.md says; an operand the forward computes
  (a residual ``fc2(h) + x``: :class:`ForwardInput`) is an argument of its call after x, of the
  chain's own shape (read per element) or per channel; a BatchNorm1d's operands
  (:class:`BatchNormAffine`) are computed from the module at each call, and where it normalises
  with the batch's statistics (training mode) the call splits there: ``fused_linear`` up to it,
  the statistics, then ``fused_epilogue`` for the rest of the chain.

An input of more than two dimensions (batch, sequence, features) runs with its leading
dimensions flattened into rows, when the chain acts on the features alone (pointwise ops only).
Whenever the fused call's preconditions do not hold at run time (a 1-D input, a higher one
before a GroupNorm or a reduction, GroupNorm settings that no longer divide the channels, an
operand of another dtype...), the original chain runs instead: an fx GraphModule of the
model's own nodes (``last_path == "fallback"``), which computes exactly what the model
computed.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from gemmfuse.dispatch import FallbackWarning
from gemmfuse.epilogue import (
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    epilogue_problem,
    split_epilogue,
)
from gemmfuse.epilogue_op import fused_epilogue_with_path
from gemmfuse.ops import fused_linear_with_path, plans_apply
from gemmfuse.plan import planned_call
from gemmfuse.pointwise import POINTWISE
from gemmfuse.pooling import ChannelPool, max_pool_window, pooled_linear
from gemmfuse.reference import apply_epilogue, linear_epilogue
from gemmfuse.tail import apply_tail
from gemmfuse.validation import argument_problem
from gemmfuse.weight_cache import SplitWeightCache

# The pointwise modules a chain may hold: class -> (op name, float arguments) of an instance,
# read at each call (pointwise.py's rows). A name of None means the instance's settings are
# outside the grammar.
MODULE_OPS: dict[type, Callable[[nn.Module], tuple[str | None, tuple[float, ...]]]] = {
    module_cls: read for op_row in POINTWISE.values() for module_cls, read in op_row.modules
}

_STAGES = ("pre", "post", "tail")
_MAX_EPILOGUES = 64  # distinct settings cached per module (a slope swept every call stays bounded)
_MISSING = object()


@dataclass(frozen=True)
class ForwardInput:
    """A tensor operand that the model's forward computes (a residual ``fc2(h) + x``): the
    ``index``-th argument of the FusedLinear's call after x."""

    index: int


@dataclass(frozen=True)
class ChainOp:
    """One pointwise op of a chain: fixed ``name``/``args``, or a ``module`` read at each call.

    ``args`` holds floats and :class:`gemmfuse.Param` indices into the FusedLinear's operands.
    """

    stage: str  # "pre" (before the GroupNorm), "post" (after it) or "tail" (after the reduction)
    name: str = ""
    args: tuple = ()
    module: nn.Module | None = None

    def __post_init__(self):
        if self.stage not in _STAGES:
            raise ValueError(f"stage must be one of {_STAGES}, got {self.stage!r}")
        if self.module is not None and type(self.module) not in MODULE_OPS:
            raise TypeError(f"module must be one of {[c.__name__ for c in MODULE_OPS]}")

    def current(self) -> tuple[str | None, tuple]:
        if self.module is None:
            return self.name, self.args
        return MODULE_OPS[type(self.module)](self.module)


@dataclass(frozen=True)
class ChainNorm:
    """The chain's norm: an ``nn.GroupNorm``, ``nn.LayerNorm`` or ``nn.RMSNorm`` read at each
    call, or ``F.group_norm``'s / ``F.layer_norm``'s / ``F.rms_norm``'s constant
    ``num_groups``/``eps`` with its weight and bias as operand indices (or None). ``layer``: a
    norm over the channels (one group); ``rms``: that norm is an RMSNorm (``layer`` too);
    ``softmax``: a softmax over the channels (``layer`` too, no module, no weight or bias;
    ``log``: a log_softmax)."""

    module: nn.GroupNorm | nn.LayerNorm | nn.RMSNorm | None = None
    num_groups: int = 1
    eps: float | None = 1e-5
    weight: int | None = None
    bias: int | None = None
    layer: bool = False
    rms: bool = False
    softmax: bool = False
    log: bool = False

    def __post_init__(self):
        if self.rms and not self.layer:
            raise TypeError("rms=True (an RMSNorm) goes with layer=True")
        if self.softmax and not (self.layer and self.module is None and self.weight is None):
            raise TypeError("softmax=True goes with layer=True, no module and no weight")
        kind = {nn.LayerNorm: (True, False), nn.RMSNorm: (True, True)}.get(type(self.module))
        if self.module is not None and (self.layer, self.rms) != (kind or (False, False)):
            raise TypeError(
                "layer=True goes with an nn.LayerNorm or nn.RMSNorm module (rms=True with the "
                "RMSNorm), both False with a GroupNorm"
            )

    def current(self, operands: Sequence, dtype: torch.dtype) -> "NormValues":
        """The norm's values as the model would use them now, on a ``dtype`` input (an
        RMSNorm's eps=None is the machine epsilon of the dtype it computes in, as F.rms_norm
        resolves it: float64's for float64, float32's otherwise, bfloat16 and float16
        included)."""
        m = self.module
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            norm = NormValues(1, m.eps, m.weight, getattr(m, "bias", None))
        elif m is not None:
            norm = NormValues(m.num_groups, m.eps, m.weight, m.bias)
        else:
            pick = (None if i is None else operands[i] for i in (self.weight, self.bias))
            norm = NormValues(self.num_groups, self.eps, *pick)
        if norm.eps is None and self.rms:
            computes_in = torch.float64 if dtype == torch.float64 else torch.float32
            return norm._replace(eps=torch.finfo(computes_in).eps)
        return norm


class BatchNormAffine:
    """An ``nn.BatchNorm1d`` as the per-channel ops it computes, ``(x - mean) * scale + bias``,
    its operands read at each call from the module: ``bias``; in eval mode with running
    statistics ``mean = running_mean`` and ``scale = weight / sqrt(running_var + eps)`` (float64
    rounded once, differentiable in the weight). Otherwise (training mode, or no running
    statistics) the module normalises with the batch's statistics: :meth:`batch_operands`
    computes ``mean`` and ``scale`` from the chain's (M, N) value where the module stands, and
    updates the running statistics as the module does."""

    def __init__(self, module: nn.BatchNorm1d):
        self.module = module

    @property
    def uses_batch_statistics(self) -> bool:
        m = self.module
        return m.training or m.running_mean is None

    def problem(self, dtype: torch.dtype) -> str:
        """Why the module's ops are not fused on a ``dtype`` chain now ("" when they are)."""
        if self.uses_batch_statistics and dtype not in (torch.float32, torch.float64):
            return f"its batch statistics are fused for float32 chains, not {dtype}"
        return ""

    # mean and scale: the eval-mode operands; None while the batch's statistics stand in for
    # them (batch_operands), so a training step does not compute them for nothing.
    @property
    def mean(self) -> torch.Tensor | None:
        return None if self.uses_batch_statistics else self.module.running_mean

    @property
    def scale(self) -> torch.Tensor | None:
        m = self.module
        if self.uses_batch_statistics:
            return None
        rstd = 1.0 / torch.sqrt(m.running_var.double() + m.eps)
        scale = rstd if m.weight is None else m.weight.double() * rstd
        return scale.to(m.running_var.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.module.bias

    def batch_operands(self, u: torch.Tensor, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, scale) of the batch ``u`` (M, N), differentiable in u and the weight, as
        F.batch_norm normalises in training: the biased variance; with ``update`` (a forward,
        not a check), the running statistics stepped as the module steps them (the unbiased
        variance; ``momentum=None``: the cumulative average)."""
        m = self.module
        var, mean = torch.var_mean(u, dim=0, correction=0)
        if update and m.training and m.running_mean is not None:
            self._step_running(mean.detach(), var.detach(), u.shape[0])
        rstd = torch.rsqrt(var + m.eps)
        return mean, rstd if m.weight is None else m.weight * rstd

    def _step_running(self, mean: torch.Tensor, var: torch.Tensor, rows: int) -> None:
        m = self.module
        with torch.no_grad():
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            m.running_mean.mul_(1.0 - factor).add_(mean, alpha=factor)
            m.running_var.mul_(1.0 - factor).add_(var * (rows / (rows - 1)), alpha=factor)


class NormValues(NamedTuple):
    """A chain norm's settings and affine tensors at one call (``ChainNorm.current``)."""

    num_groups: int
    eps: float | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


class FusedLinear(nn.Module):
    """``linear`` and the chain after it as one ``fused_linear`` call (see the module docstring).

    Args:
        linear: the ``nn.Linear``; its parameter dict becomes this module's. Or None, for an
            ``F.linear`` call: then ``weight`` and ``bias`` give (module, attribute name) of its
            tensors (``bias`` None for no bias), read at each call.
        ops, norm, reduce: the chain: pointwise :class:`ChainOp` s (stages in order), an optional
            :class:`ChainNorm`, an optional :class:`gemmfuse.Reduction` over channels.
        operands: (module, attribute name) of each tensor operand, or a :class:`ForwardInput`
            for one the forward computes, in the ``Param`` indices' order.
        pool: an average pooling over the Linear's output channels right after it, folded into
            its weight and bias (pooling.py); the chain then acts on the pooled channels.
        max_pool: the ``nn.MaxPool1d`` whose windows ``reduce`` takes (``Reduction.pool``),
            read at each call: where its settings no longer make such a window, the original
            chain runs. None for none, or for ``F.max_pool1d``'s constant window.
        fallback: the original chain, called as ``fallback(x, weight, bias, *operands)``.
        labels: the chain in model terms, for ``repr`` and reports.
        kernel, precision: as in ``fused_linear``; attributes, changeable later.
    """

    def __init__(
        self,
        linear: nn.Linear | None,
        *,
        weight: tuple[nn.Module, str] | None = None,
        bias: tuple[nn.Module, str] | None = None,
        ops: Sequence[ChainOp] = (),
        norm: ChainNorm | None = None,
        reduce: Reduction | None = None,
        operands: Sequence[tuple[nn.Module, str]] = (),
        pool: ChannelPool | None = None,
        max_pool: nn.MaxPool1d | None = None,
        fallback: Callable[..., torch.Tensor],
        labels: Sequence[str] = (),
        kernel: str = "auto",
        precision: str = "fp32",
    ):
        super().__init__()
        if linear is not None:
            if not isinstance(linear, nn.Linear) or weight or bias:
                raise TypeError("give an nn.Linear as linear, or linear=None and its weight")
            self._parameters = linear._parameters  # the Linear's own dict: one state, two views
        elif weight is None:
            raise TypeError("linear=None needs weight=(module, attribute name)")
        self._tensor_refs = (weight, bias)
        self.pool = pool
        self.out_features, self.in_features = self._linear()[0].shape
        if pool is not None:
            window = pool.current(self.out_features)
            if window is None:
                raise ValueError("pool's settings do not fold into the Linear (see pooling.py)")
            self.out_features //= window
        self._ops = tuple(ops)
        self._norm = norm
        self._reduce = reduce
        self._operands = tuple(operands)
        self.forward_inputs = sum(isinstance(o, ForwardInput) for o in self._operands)
        # Not an attribute assignment: nn.Module would register the GraphModule (and with it
        # the chain's modules) a second time, adding duplicate state_dict keys.
        object.__setattr__(self, "_fallback", fallback)
        object.__setattr__(self, "_max_pool", max_pool)  # the model's module, not a child
        if max_pool is not None and (reduce is None or reduce.pool == 1):
            raise ValueError("max_pool needs a reduce whose pool is its window")
        self.labels = tuple(labels)
        self._batch_norms = _batch_norm_positions(self._operands, self._ops)
        self.weight_split = SplitWeightCache()
        self.kernel = kernel
        self.precision = precision
        self.last_path: str | None = None
        self._epilogues: dict = {}

    def _linear(self):
        """(weight, bias) as of now."""
        weight, bias = self._tensor_refs
        if weight is None:
            return self.weight, self.bias
        return getattr(*weight), None if bias is None else getattr(*bias)

    def _folded(self, weight, bias):
        """(weight, bias) as the fused call takes them: the Linear's, with the pooling folded
        in; or, a string, why the pooling's current settings no longer fold."""
        if self.pool is None:
            return weight, bias
        window = self.pool.current(weight.shape[0])
        if window is None:
            return "the AvgPool1d's current settings do not fold into the Linear"
        return pooled_linear(weight, bias, window, self.weight_split)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self._linear()[1] is not None}, chain={' -> '.join(self.labels)}, "
            f"kernel={self.kernel}, precision={self.precision}"
        )

    @property
    def epilogue(self) -> Epilogue | None:
        """The chain with the current settings (None when they are outside the grammar)."""
        return self._state()[2]

    @property
    def kernel_structures(self) -> list[Epilogue]:
        """The kernel structures this module's calls launch as its settings are now: its
        chain's, or with a BatchNorm1d normalising with batch statistics, the chain up to it
        and the rest (the two calls ``_batch_norm_call`` makes). Empty outside the grammar."""
        epilogue = self.epilogue
        if epilogue is None:
            return []
        found = []
        for at in self._batch_statistics():
            found += [part.structure for part in split_epilogue(epilogue, at.position)]
        return found or [epilogue.structure]

    def _state(self, weight=None, inputs=None):
        """(operands, GroupNorm values or None, epilogue or None) as of now; ``weight``: the
        Linear's, where the caller has it already (its dtype resolves an RMSNorm's eps=None);
        ``inputs``: the call's arguments after x (None where no call is made: the forward's
        operands are then None)."""
        operands = [
            (None if inputs is None else inputs[o.index])
            if isinstance(o, ForwardInput)
            else getattr(*o)
            for o in self._operands
        ]
        weight = self._linear()[0] if weight is None else weight
        dtype = getattr(weight, "dtype", torch.float32)
        norm = None if self._norm is None else self._norm.current(operands, dtype)
        key = (
            tuple(op.current() for op in self._ops),
            None if norm is None else (norm.num_groups, norm.eps, norm.weight is not None),
            self._pool_window(weight),
        )
        epilogue = self._epilogues.get(key, _MISSING)
        if epilogue is _MISSING:
            epilogue = self._build_epilogue(*key)
            if len(self._epilogues) >= _MAX_EPILOGUES:
                self._epilogues.clear()
            self._epilogues[key] = epilogue
        return operands, norm, epilogue

    def _pool_window(self, weight) -> int | None:
        """The reduction's max-pooling window as the chain's nn.MaxPool1d is set now (None:
        no longer a window the kernels take) over the Linear's channels (``weight``'s rows);
        the traced one where there is no module."""
        if self._max_pool is None:
            return None if self._reduce is None else self._reduce.pool
        return max_pool_window(self._max_pool, weight.shape[0])

    def _build_epilogue(self, ops, norm, pool) -> Epilogue | None:
        """The Epilogue of these settings; None when they are outside the grammar."""
        reduce = self._reduce
        if reduce is not None:
            if pool is None:  # a max pooling's module set to something the kernels do not take
                return None
            reduce = dataclasses.replace(reduce, pool=pool)
        stages = {stage: [] for stage in _STAGES}
        for op, (name, args) in zip(self._ops, ops, strict=True):
            stages[op.stage].append((name, tuple(args)))
        # e.g. a GELU set to approximate="sigmoid" after tracing: outside the grammar
        if epilogue_problem(stages["pre"], norm, stages["post"], reduce, stages["tail"]):
            return None
        return Epilogue(
            pre=tuple(Pointwise(*op) for op in stages["pre"]),
            norm=None
            if norm is None
            else GroupNormSpec(
                *norm, self._norm.layer, self._norm.rms, self._norm.softmax, self._norm.log
            ),
            post=tuple(Pointwise(*op) for op in stages["post"]),
            reduce=reduce,
            tail=tuple(Pointwise(*op) for op in stages["tail"]),
        )

    def _fused_problem(self, x, weight, bias, operands, norm, epilogue, gn_weight, gn_bias) -> str:
        """Why the fused call cannot stand in for the chain now ("" when it can): what this
        module's chain adds (its settings in the grammar, a row-wise chain for a higher input,
        a row norm over the channels, operands of x's dtype), then ``fused_linear``'s own rules
        (validation.py) on the call it would make."""
        if epilogue is None:
            return "the chain's current module settings are outside the epilogue grammar"
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return f"the input {shape} is not a tensor of 2 or more dimensions"
        problem = self._operands_problem(x.dtype)
        if problem:
            return problem
        if self._batch_statistics() and (x.dim() != 2 or x.shape[0] < 2):
            return f"a BatchNorm1d's batch statistics of the input {tuple(x.shape)}"
        if x.dim() > 2 and not _acts_on_rows(epilogue):
            return f"the input {tuple(x.shape)} is not 2-D and the chain is not row-wise"
        if norm is not None and self._norm.layer and isinstance(weight, torch.Tensor):
            problem = _layer_norm_problem(self._norm.module, weight.shape[0], norm)
            if problem:
                return problem
        for i in epilogue.channel_params + epilogue.tail_params:
            t = operands[i]
            if not isinstance(t, torch.Tensor) or t.dtype != x.dtype:
                return f"operand {_operand_name(self._operands[i])} is not a tensor of x's dtype"
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        problem = argument_problem(rows, weight, bias, epilogue, gn_weight, gn_bias, operands)
        return "" if problem is None else problem[1]

    def _operands_problem(self, dtype: torch.dtype) -> str:
        """Why an operand derived from a module (a BatchNorm1d's) is not fused now on a
        ``dtype`` chain ("" when every one is)."""
        for ref in self._operands:
            owner = ref[0] if isinstance(ref, tuple) else None
            problem = owner.problem(dtype) if isinstance(owner, BatchNormAffine) else ""
            if problem:
                return problem
        if len(self._batch_statistics()) > 1:
            return "more than one BatchNorm1d of the chain normalises with batch statistics"
        return ""

    def _batch_statistics(self) -> list["_BatchNormAt"]:
        """The chain's BatchNorm1d that normalise with the batch's statistics now."""
        return [b for b in self._batch_norms if b.affine.uses_batch_statistics]

    def _batch_norm_call(self, rows, weight, bias, epilogue, operands, gn_weight, gn_bias, at,
                         check=False):  # fmt: skip
        """(the chain's value, the GEMM's path) with a BatchNorm1d normalising with batch
        statistics: the fused call up to it, its statistics of that (M, N) value, then the
        rest of the chain on it (``fused_epilogue``). ``check``: the PyTorch reference, the
        running statistics left alone."""
        head, rest = split_epilogue(epilogue, at.position)
        gn = (gn_weight, gn_bias)
        gn_head, gn_rest = (gn, (None, None)) if head.norm is not None else ((None, None), gn)
        if check:
            u, path = linear_epilogue(rows, weight, bias, head, *gn_head, operands), "torch"
        else:
            u, path = fused_linear_with_path(
                rows, weight, bias, head, *gn_head, params=operands,
                weight_cache=self.weight_split, kernel=self.kernel, precision=self.precision,
            )  # fmt: skip
        operands = list(operands)
        operands[at.mean], operands[at.scale] = at.affine.batch_operands(u, update=not check)
        if check:
            return apply_epilogue(u, rest, *gn_rest, operands), path
        return fused_epilogue_with_path(u, rest, *gn_rest, params=operands)[0], path

    def _with_stand_ins(self, operands: list, like: torch.Tensor) -> list:
        """``operands`` with the batch statistics' places held by empty tensors of ``like``'s
        dtype (what the checks and the call up to the BatchNorm1d see; they read neither)."""
        operands = list(operands)
        for at in self._batch_statistics():
            operands[at.mean] = operands[at.scale] = like.new_empty(())
        return operands

    def _flat_inputs(self, operands: list, x: torch.Tensor) -> list:
        """``operands`` as the call on a higher x's flattened rows takes them: each forward
        input of x's leading shape (and the channels) with its leading dimensions flattened."""
        lead = x.shape[:-1]
        return [
            t.reshape(-1, t.shape[-1])
            if isinstance(o, ForwardInput) and isinstance(t, torch.Tensor) and t.shape[:-1] == lead
            else t
            for o, t in zip(self._operands, operands, strict=True)
        ]

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != self.forward_inputs:
            raise TypeError(
                f"FusedLinear takes x and {self.forward_inputs} operand(s) computed in the "
                f"forward, got {len(inputs)} after x"
            )
        weight, bias = self._linear()
        operands, norm, epilogue = self._state(weight, inputs)
        model_operands = operands
        gn_weight, gn_bias = _norm_vectors(norm)
        offered, planned = self._planned(x, weight, bias, epilogue, gn_weight, gn_bias, operands)
        if planned is not None:
            out, self.last_path = planned
            return out
        folded = self._folded(weight, bias)
        batch = self._batch_statistics()
        if batch and isinstance(x, torch.Tensor):
            operands = self._with_stand_ins(operands, x)
        if inputs and isinstance(x, torch.Tensor) and x.dim() > 2:
            operands = self._flat_inputs(operands, x)
        problem = (
            folded
            if isinstance(folded, str)
            else self._fused_problem(x, *folded, operands, norm, epilogue, gn_weight, gn_bias)
        )
        if problem:
            if isinstance(x, torch.Tensor) and x.is_cuda:
                warnings.warn(
                    f"gemmfuse: {problem}; the original PyTorch chain runs",
                    FallbackWarning,
                    stacklevel=2,
                )
            self.last_path = "fallback"
            return self._fallback(x, weight, bias, *model_operands)
        # leading dimensions as rows (a pointwise chain); a 2-D x as it is (no view node for
        # autograd to record on every call)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if batch:
            out, self.last_path = self._batch_norm_call(
                rows, *folded, epilogue, operands, gn_weight, gn_bias, batch[0]
            )
            return out
        out, self.last_path = fused_linear_with_path(
            rows, *folded, epilogue, gn_weight, gn_bias, params=operands,
            weight_cache=self.weight_split, kernel=self.kernel, precision=self.precision,
            offer_plans=not offered,
        )  # fmt: skip
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def _planned(self, x, weight, bias, epilogue, gn_weight, gn_bias, operands):
        """(whether the call was offered to the weight cache's plans (plan.py), and (the
        output, the path) where one ran it, else None): an offered call is not offered again
        (fused_linear_with_path's offer_plans). A plan exists only for kinds of tensors that
        passed every rule of the call below (its dtypes, shapes and strides are the plan's
        key), so those rules are not run again; what the key does not see is checked here: a
        chain with a pooling or a BatchNorm1d (their operands are computed at each call) is not
        planned, and a higher input only for a row-wise chain (as _fused_problem rules)."""
        cache = self.weight_split
        if not plans_apply() or not cache.plans:  # under torch.compile, plans are not read
            return False, None
        if self.pool is not None or self._batch_norms or epilogue is None:
            return False, None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return False, None
        rows = x
        if x.dim() > 2:
            if not _acts_on_rows(epilogue):
                return False, None
            rows, operands = x.reshape(-1, x.shape[-1]), self._flat_inputs(operands, x)
        planned = planned_call(cache, epilogue, self.kernel, self.precision, rows, weight, bias,
                               gn_weight, gn_bias, operands)  # fmt: skip
        if planned is None:
            return True, None
        out, path = planned
        if epilogue.tail:
            out = apply_tail(out, epilogue, operands)
        return True, ((out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])), path)

    def reference(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """The chain evaluated by ``gemmfuse.reference`` with the current settings: what the
        fused path computes, in plain PyTorch (``optimize`` checks it against the model)."""
        operands, norm, epilogue = self._state(inputs=inputs)
        if epilogue is None:
            raise ValueError("the chain's current module settings are outside the grammar")
        folded = self._folded(*self._linear())
        problem = folded if isinstance(folded, str) else self._operands_problem(x.dtype)
        if problem:
            raise ValueError(problem)
        gn_weight, gn_bias = _norm_vectors(norm)
        batch = self._batch_statistics()
        if batch:
            operands = self._with_stand_ins(operands, x)
            return self._batch_norm_call(x, *folded, epilogue, operands, gn_weight, gn_bias,
                                         batch[0], check=True)[0]  # fmt: skip
        return linear_epilogue(x, *folded, epilogue, gn_weight, gn_bias, params=operands)


class _BatchNormAt(NamedTuple):
    """A BatchNorm1d of the chain: its operands' indices and the position of its first op
    among the chain's pre and post ops."""

    affine: BatchNormAffine
    mean: int
    scale: int
    position: int


def _batch_norm_positions(operands, ops) -> tuple[_BatchNormAt, ...]:
    """Where each BatchNorm1d of the chain stands (its ``mean`` operand's first reader)."""
    found = []
    chain = [op for op in ops if op.stage != "tail"]
    for i, ref in enumerate(operands):
        if isinstance(ref, tuple) and isinstance(ref[0], BatchNormAffine) and ref[1] == "mean":
            owner = ref[0]
            scale = operands.index((owner, "scale"))
            position = next(k for k, op in enumerate(chain) if Param(i) in op.args)
            found.append(_BatchNormAt(owner, i, scale, position))
    return tuple(found)


def _acts_on_rows(epilogue: Epilogue) -> bool:
    """Whether the chain acts on each row alone (pointwise ops, a norm over the channels, no
    reduction): then a higher input's leading dimensions may be flattened into rows."""
    return (epilogue.norm is None or epilogue.norm.layer) and epilogue.reduce is None


def _operand_name(ref) -> str:
    """How a problem names an operand: its attribute, or its place among the call's inputs."""
    if isinstance(ref, ForwardInput):
        return f"{ref.index + 1} computed in the forward"
    return repr(ref[1])


def _layer_norm_problem(module: nn.LayerNorm | nn.RMSNorm | None, n: int, norm: NormValues) -> str:
    """Why a LayerNorm's or RMSNorm's current settings do not fit the fused call ("" when they
    do)."""
    name = type(module).__name__ if module is not None else "norm"
    if module is not None and tuple(module.normalized_shape) != (n,):
        return f"the {name} normalises {tuple(module.normalized_shape)}, not the {n} channels"
    if norm.weight is None and norm.bias is not None:
        return f"the {name} has a bias but no weight"
    return ""


def _norm_vectors(norm: NormValues | None) -> tuple:
    """(weight, bias) of the norm as the kernels take them: a LayerNorm with a weight and no
    bias (``bias=False``), or an RMSNorm's weight, gets zeros, adding nothing (x * w + 0 is
    x * w)."""
    if norm is None:
        return None, None
    weight, bias = norm.weight, norm.bias
    if isinstance(weight, torch.Tensor) and bias is None:
        bias = torch.zeros_like(weight)
    return weight, bias
