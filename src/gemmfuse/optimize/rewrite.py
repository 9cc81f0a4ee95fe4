"""The rewrite: each accepted chain checked on the example inputs and swapped for a
:class:`FusedLinear`, the module tree mirrored, and the report."""

import copy
import inspect
import types
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrize import is_parametrized

from gemmfuse.dispatch import check_settings
from gemmfuse.modules import ForwardInput, FusedLinear
from gemmfuse.optimize.analysis import _Analysis, _Chain
from gemmfuse.optimize.grammar import (
    _alias_of,
    _attribute,
    _linear_args,
    _linear_input,
    _next_in_chain,
    _owner,
    _spelled_linear,
    _thread_inplace,
)
from gemmfuse.optimize.tracing import _Recorder, _trace

# torch.testing.assert_close's default (rtol, atol) per dtype; other dtypes compare exactly.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


@dataclass(frozen=True)
class LinearReport:
    """What ``optimize`` did with one Linear call."""

    name: str  # the Linear's module path (or the F.linear call's node name)
    fused: bool  # replaced by a FusedLinear
    chain: tuple[str, ...]  # the ops the FusedLinear runs, in model terms, the Linear first
    stopped: str  # where the chain stopped, and why
    reason: str = ""  # why the Linear was not swapped ("" when it was)
    verified: bool | None = None  # checked on example_inputs; None: not checked
    module: str = ""  # the FusedLinear's path in the result ("" when not swapped)

    def __str__(self) -> str:
        if not self.fused:
            return f"{self.name}: not swapped: {self.reason}"
        check = " [not verified: meta tensors]" if self.verified is None else ""
        return f"{self.name}: fused {' -> '.join(self.chain)}{check}; {self.stopped}"


@dataclass(frozen=True)
class OptimizeReport:
    """One :class:`LinearReport` per Linear call of the traced forward, in graph order."""

    model: str
    linears: tuple[LinearReport, ...] = field(default_factory=tuple)

    @property
    def fused(self) -> tuple[LinearReport, ...]:
        return tuple(r for r in self.linears if r.fused)

    @property
    def bare(self) -> tuple[LinearReport, ...]:
        """The fused calls with no op after the GEMM (the tensor-core product alone)."""
        return tuple(r for r in self.fused if len(r.chain) == 1)

    def __str__(self) -> str:
        head = f"gemmfuse.optimize({self.model}): {len(self.fused)} of {len(self.linears)} "
        head += "Linear call(s) fused"
        if self.bare:
            chained = len(self.fused) - len(self.bare)
            head += f" ({chained} with a chain, {len(self.bare)} bare GEMM)"
        return "\n".join([head, *(f"  {r}" for r in self.linears)])


def _shared_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of module: its own children dict, the same parameter and buffer dicts."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    return new


def _mirror(src: nn.Module, dst: nn.Module, paths: set[str], prefix: str = "") -> None:
    """Gives dst src's children: src's own objects, or shared copies where a path in
    ``paths`` lies below."""
    dst._modules = {}
    for name, child in src._modules.items():
        here = prefix + name
        if child is not None and any(p.startswith(here + ".") for p in paths):
            copied = _shared_copy(child)
            _mirror(child, copied, paths, here + ".")
            child = copied
        dst._modules[name] = child


def _fallback(gm: fx.GraphModule, chain: _Chain) -> fx.GraphModule:
    """The chain's own nodes as ``fallback(x, weight, bias, *operands)``."""
    graph = fx.Graph()
    x, weight, bias = (graph.placeholder(n) for n in ("x", "weight", "bias"))
    operands = {t: graph.placeholder(f"operand_{i}") for i, t in enumerate(chain.operands)}
    env = {chain.linear: graph.call_function(F.linear, (x, weight, bias))}

    def mapped(a: fx.Node) -> fx.Node:  # a chain value, a computed operand, or an attribute's
        return env[a] if a in env else operands[a] if a in operands else operands[a.target]

    for node in chain.nodes:
        env[node] = graph.node_copy(node, mapped)
    graph.output(env[chain.end])
    modules = {n.target: gm.get_submodule(n.target) for n in chain.nodes if n.op == "call_module"}
    return fx.GraphModule(modules, graph, class_name="FusedLinearFallback")


def _verify(fused: FusedLinear, x, inputs, expected: torch.Tensor) -> str:
    """Why fused's reference on x (and the operands the forward computed, ``inputs``) does not
    reproduce the model's value ("" when it does): equal shape, dtype and device, and close
    within ``torch.testing.assert_close``'s default tolerances for the dtype (NaN equal to
    NaN). A chain that raises propagates."""
    got = fused.reference(x, *inputs)
    if not isinstance(got, torch.Tensor):
        return f"the chain returned {type(got).__name__}, not a tensor"
    for what, a, b in (
        ("shape", tuple(got.shape), tuple(expected.shape)),
        ("dtype", got.dtype, expected.dtype),
        ("device", got.device, expected.device),
    ):
        if a != b:
            return f"its result's {what} is {a}, the model's is {b}"
    rtol, atol = _TOLERANCES.get(got.dtype, (0.0, 0.0))
    close = torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return ""
    wrong = int((~close).sum())
    worst = float((got.double() - expected.double()).abs().masked_fill(close, 0.0).max())
    return (
        f"{wrong} of {close.numel()} values differ beyond rtol={rtol}, atol={atol} "
        f"(greatest absolute difference {worst})"
    )


def _cuda_devices(*groups) -> list[int]:
    """The CUDA devices (indices) of the tensors in ``groups``."""
    return sorted({t.device.index for g in groups for t in g
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})  # fmt: skip


def optimize(
    model: nn.Module,
    example_inputs: Sequence,
    *,
    kernel: str = "auto",
    precision: str = "fp32",
    forward: types.FunctionType | None = None,
) -> tuple[nn.Module, OptimizeReport]:
    """``model`` with each Linear chain replaced by a :class:`FusedLinear`, and a report.

    Args:
        model: the module to rewrite; it is left unchanged, and shares its parameters and
            buffers with the result.
        example_inputs: the forward's positional arguments (a tuple or list), used for shapes
            and to check each chain; meta tensors give shapes only (chains go unchecked).
        kernel, precision: the FusedLinears' settings (see ``fused_linear``).
        forward: the function to trace instead of ``type(model).forward``, e.g. a parent
            class's forward (a ModelNew that overrides forward to call optimize).

    Returns:
        (an ``fx.GraphModule`` computing what model computes, an :class:`OptimizeReport`).

    Raises:
        TypeError, ValueError: for the arguments above, and ValueError for a forward that
            writes a plain tensor attribute in place. What ``torch.fx`` raises tracing the
            forward (``torch.fx.proxy.TraceError``, a ValueError, for control flow on tensor
            values) and what the forward raises on ``example_inputs`` reach the caller as they
            are.
    """
    _check_arguments(model, example_inputs, kernel, precision, forward)
    # Tracing, the example run and the checks draw on a fork of the random state: a model with
    # random ops sees the same random numbers after optimize as without it.
    devices = _cuda_devices(example_inputs, model.parameters(), model.buffers())
    with torch.random.fork_rng(devices=devices):
        gm = _trace(model, forward)
    _thread_inplace(gm)
    linears = _linear_calls(gm)
    # The example run must leave the model as it was: a forward that writes its buffers
    # (BatchNorm's running statistics in training mode, a counter) would otherwise take the
    # step twice when the caller then runs the result, so it runs on copies of them (see
    # _Recorder).
    recorder = _Recorder(gm, _values_to_record(gm, linears), model.buffers())
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        recorder.run(*example_inputs)

    calls = {}
    for node in linears:
        calls[node.target] = calls.get(node.target, 0) + 1
    # A Linear module called more than once: each call gets its own FusedLinear, a new
    # submodule reading the module's tensors (as for F.linear), the module itself kept. So
    # does a parametrized one (weight_norm's): its weight is computed at each read.
    shared = {
        n.target
        for n in linears
        if n.op == "call_module"
        and (calls[n.target] > 1 or is_parametrized(gm.get_submodule(n.target)))
    }
    decisions = _decide(gm, _Analysis(gm, recorder.meta), linears, shared)
    chains = [c for c in decisions.values() if isinstance(c, _Chain)]
    _adopt_model_state(model, gm, {c.path for c in chains if _in_place(c, shared)})

    swap = _Swapper(gm, recorder, devices, shared, kernel, precision)
    for node, chain in list(decisions.items()):
        if isinstance(chain, _Chain):
            decisions[node] = swap(node, chain)
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:  # operands only the chains read
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm, OptimizeReport(type(model).__name__, tuple(decisions.values()))


def _check_arguments(model, example_inputs, kernel, precision, forward) -> None:
    """Raises TypeError/ValueError naming the first bad argument of ``optimize``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs must be a tuple or list of the forward's positional arguments, "
            f"got {type(example_inputs).__name__}"
        )
    check_settings(kernel, precision)
    if forward is not None and not isinstance(forward, types.FunctionType):
        raise TypeError(f"forward must be a Python function, got {type(forward).__name__}")
    traced = forward or type(model).forward
    problem = _inputs_problem(traced, len(example_inputs))
    if problem:
        name = getattr(traced, "__qualname__", f"{type(model).__name__}.forward")
        raise TypeError(f"example_inputs do not fit {name}: {problem}")


def _inputs_problem(forward, count: int) -> str:
    """Why ``count`` positional arguments do not fit ``forward`` after its ``self`` ("" where
    they do, or where it is not a Python function: the example run decides). The example run
    would otherwise drop extra inputs where the model's own call raises. The signature is read,
    not bound: standalone exports bundle this module, and KernelBench's static checker refuses
    any exception handler in them."""
    if not isinstance(forward, types.FunctionType):
        return ""
    kind = inspect.Parameter
    params = list(inspect.signature(forward).parameters.values())[1:]
    positional = [p for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    keywords = [p.name for p in params if p.kind == kind.KEYWORD_ONLY and p.default is p.empty]
    takes_more = any(p.kind == kind.VAR_POSITIONAL for p in params)
    if keywords:
        return f"it needs keyword argument(s) {keywords}, which positional inputs cannot give"
    if count < len(required) or (count > len(positional) and not takes_more):
        takes = f"{len(required)} or more" if takes_more else f"{len(required)}"
        if len(positional) > len(required) and not takes_more:
            takes += f" to {len(positional)}"
        names = ", ".join(p.name for p in positional)
        return f"{count} input(s) given, it takes {takes} ({names})"
    return ""


def _linear_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's Linear calls, in graph order: nn.Linear modules, F.linear, and the spelled
    forms (x @ W.T, addmm, ...)."""
    return [
        n for n in gm.graph.nodes
        if (n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear))
        or (n.op == "call_function" and n.target is F.linear)
        or _spelled_linear(n, gm) is not None
    ]  # fmt: skip


def _values_to_record(gm: fx.GraphModule, linears: list[fx.Node]) -> set[fx.Node]:
    """The nodes whose example values the analysis and the checks read: each Linear's input,
    every node a chain can end at, and what those read that the forward computes."""
    keep = set()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}.__getitem__
    for node in linears:
        x = _linear_input(node, gm)
        if isinstance(x, fx.Node):
            keep.add(x)
        v = node
        while v is not None:
            keep.add(v)
            # and what it reads that the forward computes: an operand of the fused call
            keep.update(i for i in v.all_input_nodes if i.op != "get_attr")
            v = _next_in_chain(gm, v, order)
    return keep


def _decide(gm, analysis: _Analysis, linears, shared) -> dict[fx.Node, "LinearReport | _Chain"]:
    """Per Linear call, the chain to fuse, or the report of why it is not swapped."""
    decisions = {}
    for node in linears:
        problem = analysis.linear_problem(node)
        if node.op == "call_module":
            name = node.name if node.target in shared else node.target
            label = node.target
        elif node.target is F.linear:
            name, label = node.name, f"F.linear({_linear_args(node, gm)['weight'].target})"
        else:
            args = _linear_args(node, gm)
            name, label = node.name, f"x @ {args['weight'].target}.T"
            if args["bias"] is not None:
                label = f"addmm({args['bias'].target}, x, {args['weight'].target}.T)"
        if problem:
            decisions[node] = LinearReport(name, False, (), "", problem)
        else:
            decisions[node] = analysis.chain(node, name, label)
    return decisions


def _in_place(chain: _Chain, shared: set) -> bool:
    """Whether the chain's FusedLinear takes its Linear module's place in the module tree."""
    return chain.linear.op == "call_module" and chain.linear.target not in shared


def _adopt_model_state(model: nn.Module, gm: fx.GraphModule, swapped: set[str]) -> None:
    """Gives gm the model's module tree (shared copies above the ``swapped`` paths), its
    parameter and buffer dicts and its training flag."""
    attributes = {n.target: _attribute(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    _mirror(model, gm, swapped)
    gm._parameters, gm._buffers = model._parameters, model._buffers
    gm._non_persistent_buffers_set = model._non_persistent_buffers_set
    gm.training = model.training
    for target, value in attributes.items():
        # Unregistered tensors the graph reads (attributes, traced constants) stay plain
        # attributes; fx made them buffers, which would add state_dict keys.
        if isinstance(value, torch.Tensor) and "." not in target:
            if target not in gm._parameters and target not in gm._buffers:
                gm.__dict__[target] = value


class _Swapper:
    """Swaps accepted chains for FusedLinears one at a time, in graph order: each checked on
    the example values first (unless they are meta tensors), its report returned."""

    def __init__(self, gm, recorder: _Recorder, devices, shared, kernel, precision):
        self.gm, self.recorder, self.devices, self.shared = gm, recorder, devices, shared
        self.kernel, self.precision = kernel, precision
        self.verify = all(t.device.type != "meta" for t in recorder.values.values())
        self.splits = {}  # a shared Linear module's target -> its calls' weight split cache
        self.fused_at: dict[fx.Node, fx.Node] = {}  # a swapped chain's end -> its call

    def __call__(self, node: fx.Node, chain: _Chain) -> LinearReport:
        # an operand computed in the forward may be an earlier swapped chain's end: its call now
        computed = [self.recorder.values.get(o) for o in chain.forward_operands]
        chain.operands = [self.fused_at.get(o, o) if isinstance(o, fx.Node) else o
                          for o in chain.operands]  # fmt: skip
        parent, name, target, fused = self._fused_linear(chain)
        mismatch = ""
        if self.verify:
            with torch.random.fork_rng(devices=self.devices), torch.no_grad():
                values = self.recorder.values
                mismatch = _verify(fused, values[chain.input], computed, values[chain.end])
        report = LinearReport(
            chain.path,
            not mismatch,
            tuple(chain.labels),
            chain.stopped,
            f"the fused chain did not reproduce the model on example_inputs: {mismatch}"
            if mismatch else "",
            (True if self.verify else None) if not mismatch else False,
            "" if mismatch else target,
        )  # fmt: skip
        if not mismatch:
            parent._modules[name] = fused
            self._rewire(node, chain, target)
        return report

    def _fused_linear(self, chain: _Chain) -> tuple[nn.Module, str, str, FusedLinear]:
        """(the module that will own it, its name there, its path, the FusedLinear)."""
        gm = self.gm
        if _in_place(chain, self.shared):
            target = chain.path
            parent, name = _owner(gm, target)
            linear = {"linear": parent._modules[name]}
        else:  # F.linear, x @ W.T, a shared module's call: a new submodule of the root,
            # reading the tensors from their owners
            parent, target = gm, f"{chain.path}_fused"
            while hasattr(gm, target):
                target += "_"
            name = target
            linear = _functional_tensors(gm, chain.linear)
        fused = FusedLinear(
            **linear,
            ops=chain.ops,
            norm=chain.norm,
            reduce=chain.reduce,
            operands=_operand_refs(gm, chain),
            pool=chain.pool,
            max_pool=None if chain.max_pool is None else chain.max_pool.module,
            fallback=_fallback(gm, chain),
            labels=chain.labels,
            kernel=self.kernel,
            precision=self.precision,
        )
        if chain.linear.op == "call_module" and chain.linear.target in self.shared:
            # the calls of one module split its weight once between them
            fused.weight_split = self.splits.setdefault(chain.linear.target, fused.weight_split)
        return parent, name, target, fused

    def _rewire(self, node: fx.Node, chain: _Chain, target: str) -> None:
        """The graph calls the FusedLinear at ``target`` in place of the Linear and its chain."""
        graph = self.gm.graph
        # where the Linear was; with operands the forward computes, where the chain ends (they
        # may come later; analysis.py checked that no in-place op makes the move matter)
        inputs = chain.forward_operands
        with graph.inserting_before(chain.end if inputs else node):
            call = graph.call_module(target, (_linear_input(node, self.gm), *inputs))
        chain.end.replace_all_uses_with(call)
        self.fused_at[chain.end] = call  # a later chain's operand computed in the forward
        transposed = node.args[-1] if _spelled_linear(node, self.gm) is not None else None
        for n in [node, *chain.nodes]:  # copies of a value that nothing reads go with it
            for u in [u for u in n.users if not u.users and _alias_of(u, n) is not None]:
                graph.erase_node(u)
        for n in reversed([node, *chain.nodes]):
            graph.erase_node(n)
        if transposed is not None and not transposed.users:  # x @ W.T's W.T (addmm's too)
            graph.erase_node(transposed)


def _operand_refs(gm: fx.GraphModule, chain: _Chain) -> list:
    """FusedLinear's operands for the chain's: (owner, name) of an attribute, a derived
    tensor's (owner, name) as it is, a :class:`ForwardInput` for a node the forward computes."""
    refs, computed = [], 0
    for t in chain.operands:
        if isinstance(t, fx.Node):
            refs.append(ForwardInput(computed))
            computed += 1
        else:
            refs.append(t if isinstance(t, tuple) else _owner(gm, t))
    return refs


def _functional_tensors(gm: fx.GraphModule, node: fx.Node) -> dict:
    """FusedLinear's weight and bias arguments for a Linear call that is not swapped at its
    module's path: (owner, name) pairs of an F.linear's or a spelled Linear's get_attr targets,
    or of a shared Linear module's own tensors."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        bias = None if module.bias is None else (module, "bias")
        return {"linear": None, "weight": (module, "weight"), "bias": bias}
    args = _linear_args(node, gm)
    return {
        "linear": None,
        "weight": _owner(gm, args["weight"].target),
        "bias": None if args["bias"] is None else _owner(gm, args["bias"].target),
    }
