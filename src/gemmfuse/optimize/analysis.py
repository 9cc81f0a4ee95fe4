"""Finding chains: which Linear calls can be swapped, and how far the chain after each goes.

Each node after the Linear is recognised as a grammar step (matching.py) or refused with a
:class:`_Refusal` saying why it cannot join; the chain stops at the first refusal and records it.
"""

import dataclasses
from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn

from gemmfuse.epilogue import (
    MAX_SCALARS,
    MAX_TENSORS,
    Param,
    Reduction,
    Value,
    per_channel,
)
from gemmfuse.modules import BatchNormAffine, ChainNorm, ChainOp
from gemmfuse.optimize.grammar import (
    MaxPool,
    _alias_of,
    _first_refusal,
    _has_hooks,
    _linear_args,
    _linear_input,
    _pooling,
    _Refusal,
    _Step,
    _swish,
    _target_name,
)
from gemmfuse.optimize.matching import _NodeMatcher, _Stretch
from gemmfuse.optimize.tracing import _Meta, _source
from gemmfuse.pooling import ChannelPool, max_pool_settings_problem, pool_problem


@dataclass
class _Chain:
    linear: fx.Node
    path: str
    input: fx.Node  # the Linear's input as traced (an earlier rewrite may replace it)
    nodes: list[fx.Node] = field(default_factory=list)  # after the Linear, in order
    ops: list[ChainOp] = field(default_factory=list)
    norm: ChainNorm | None = None
    reduce: Reduction | None = None
    # get_attr targets, (owner, attribute) of a tensor derived at each call, or the node of a
    # tensor the forward computes (an argument of the fused call); Param order
    operands: list = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    stopped: str = ""
    pool: ChannelPool | None = None  # folded into the Linear (pooling.py)
    max_pool: MaxPool | None = None  # taken into the reduction that must follow it
    gemm: _Meta | None = None  # the product's output as the kernel computes it (pooled)

    @property
    def end(self) -> fx.Node:
        return self.nodes[-1] if self.nodes else self.linear

    @property
    def forward_operands(self) -> list[fx.Node]:
        """The operands the forward computes, in Param order: the fused call's arguments."""
        return [o for o in self.operands if isinstance(o, fx.Node)]

    def operand(self, target) -> Param:
        if target not in self.operands:
            self.operands.append(target)
        return Param(self.operands.index(target))


@dataclass
class _Saved:
    """A chain as it stood where nothing was pending: where it ends if it stops later."""

    nodes: list
    ops: list
    operands: list
    labels: list
    norm: object
    reduce: object
    v: fx.Node  # the chain's value there

    @classmethod
    def of(cls, chain: _Chain, v: fx.Node) -> "_Saved":
        return cls(list(chain.nodes), list(chain.ops), list(chain.operands), list(chain.labels),
                   chain.norm, chain.reduce, v)  # fmt: skip

    def restore(self, chain: _Chain) -> None:
        chain.nodes, chain.ops, chain.operands = self.nodes, self.ops, self.operands
        chain.labels, chain.norm, chain.reduce = self.labels, self.norm, self.reduce


class _Analysis(_NodeMatcher):
    """Follows each Linear's chain node by node, from the steps the matcher recognises."""

    # -- extending one Linear's chain

    def _accept(self, chain: _Chain, step: _Step, end: fx.Node, stage: str) -> "str | _Refusal":
        """Adds step to chain; returns the stage after it (or, leaving the chain as it was, a
        :class:`_Refusal`)."""
        linear = chain.gemm
        if end not in self.meta or self.meta[end].dtype != linear.dtype:
            return _Refusal(f"its result is not a {linear.dtype} tensor")
        if chain.max_pool is not None and chain.reduce is None and step.kind != "reduce":
            return _Refusal("not a channel reduction")
        softmax = step.name in ("softmax", "log_softmax")
        layer, rms = softmax or step.name in ("layer_norm", "rms_norm"), step.name == "rms_norm"
        if len(linear.shape) > 2 and step.kind != "op" and not layer:
            # The leading dimensions are flattened into rows: only ops on the features keep
            # their meaning (a GroupNorm of (B, T, N) normalises dim 1; reductions take dim 1)
            return _Refusal(f"{'GroupNorm' if step.kind == 'norm' else 'a reduction'} after a "
                            f"Linear on a {len(linear.shape)}-D input")  # fmt: skip
        if step.kind == "norm":
            if stage != "pre":
                return _Refusal("a second norm" if chain.norm else "a norm after the reduction")
            if step.module is not None:
                chain.norm = ChainNorm(module=step.module, layer=layer, rms=rms)
            else:
                groups, eps, weight, bias = step.args
                for a in (weight, bias):
                    if a is not None and self.meta[a].dtype != linear.dtype:
                        return _Refusal(f"{a.target} is {self.meta[a].dtype}, not {linear.dtype}")
                index = [None if a is None else chain.operand(a.target).index
                         for a in (weight, bias)]  # fmt: skip
                log = step.name == "log_softmax"
                chain.norm = ChainNorm(None, groups, eps, *index, layer, rms, softmax, log)
            return "post"
        if step.kind == "affine":
            return self._accept_affine(chain, step, stage)
        if step.kind == "reduce":
            if stage == "tail":
                return self._reduce_kept_dim(chain, step)
            pool = 1 if chain.max_pool is None else chain.max_pool.kernel_size
            chain.reduce = dataclasses.replace(step.reduction, pool=pool)
            return "tail"
        if stage != "tail":
            if self.meta[end].shape != linear.shape:
                return _Refusal(
                    f"it changes the shape {linear.shape} to {self.meta[end].shape} "
                    "before the reduction"
                )
            scalars = sum(self._floats(op.current()[1]) for op in chain.ops)
            tensors = self._tensor_count(chain)
            new_tensors = sum(isinstance(a, fx.Node) for a in step.args)
            if scalars + self._floats(step.args) > MAX_SCALARS:
                return _Refusal(f"the kernel takes at most {MAX_SCALARS} float arguments")
            if tensors + new_tensors > MAX_TENSORS:
                return _Refusal(f"the kernel takes at most {MAX_TENSORS} tensor arguments")
            n = linear.shape[-1]
            for a in step.args:
                shape = tuple(self.meta[a].shape) if isinstance(a, fx.Node) else ()
                if isinstance(a, fx.Node) and a.op != "get_attr" and shape == tuple(linear.shape):
                    continue  # computed in the forward, read per element (a residual)
                if not per_channel(shape, n):
                    # ops.py would route such a chain to PyTorch on every call
                    return _Refusal(
                        f"operand {a.target} of shape {shape} is not per channel (the kernel "
                        f"reads (), (1,), ({n},) or (1, {n}) before the reduction)"
                    )
        for a in step.args:
            if isinstance(a, fx.Node) and self.meta[a].dtype != linear.dtype:
                return _Refusal(f"operand {a.target} is {self.meta[a].dtype}, not {linear.dtype}")
            if isinstance(a, fx.Node) and stage == "tail" and step.inplace:
                return _Refusal("an in-place op with a tensor operand after the reduction")
        if step.module is not None:
            chain.ops.append(ChainOp(stage, module=step.module))
        else:
            args = tuple(chain.operand(a.target if a.op == "get_attr" else a)
                         if isinstance(a, fx.Node) else a for a in step.args)  # fmt: skip
            chain.ops.append(ChainOp(stage, step.name, args))
        return stage

    def _accept_affine(self, chain: _Chain, step: _Step, stage: str) -> "str | _Refusal":
        """Adds an eval-mode BatchNorm1d's ops, each reading an operand derived from the module
        at each call."""
        if stage == "tail":
            return _Refusal("a BatchNorm1d after the reduction")
        module = step.module
        for name in ("running_mean", "weight"):
            t = getattr(module, name)
            if t is not None and t.dtype != chain.gemm.dtype:
                return _Refusal(f"its {name} is {t.dtype}, not {chain.gemm.dtype}")
        if BatchNormAffine(module).uses_batch_statistics:
            # The chain splits at it (its statistics need the whole (M, N) value first): values
            # read again across the split, or a second split, are not supported
            if self.stretch.pending:
                return _Refusal("a value before it is read again after it (batch statistics)")
            if any(isinstance(t, tuple) and isinstance(t[0], BatchNormAffine)
                   and t[0].uses_batch_statistics for t in chain.operands):  # fmt: skip
                return _Refusal("a second BatchNorm1d with batch statistics in the chain")
        if self._tensor_count(chain) + len(step.args) > MAX_TENSORS:
            return _Refusal(f"the kernel takes at most {MAX_TENSORS} tensor arguments")
        for name, operand in step.args:
            chain.ops.append(ChainOp(stage, name, (chain.operand(operand),)))
        return stage

    def _reduce_kept_dim(self, chain: _Chain, step: _Step) -> "str | _Refusal":
        """A reduction after the chain's own, over the size-1 dimension it kept: the identity
        with keepdim (min, max, sum, mean, logsumexp of one value are that value, exactly), else
        the chain's reduction without keepdim, when no tail op came between."""
        rows = chain.gemm.shape[0]
        if not chain.reduce.keepdim or self.meta[chain.end].shape != (rows, 1):
            return _Refusal("a second reduction")
        if step.reduction.keepdim:
            return "tail"
        if any(op.stage == "tail" for op in chain.ops):
            return _Refusal("a reduction dropping the kept dimension after tail ops")
        chain.reduce = dataclasses.replace(chain.reduce, keepdim=False)
        return "tail"

    @staticmethod
    def _tensor_count(chain: _Chain) -> int:
        """The tensor arguments the chain's ops take so far."""
        return sum(isinstance(a, Param) for op in chain.ops for a in op.current()[1])

    @staticmethod
    def _floats(args) -> int:
        return sum(not isinstance(a, (Param, Value, fx.Node)) for a in args)

    def chain(self, linear: fx.Node, path: str, label: str) -> _Chain:
        """The chain after ``linear``: node by node while each joins the grammar. A value may
        be read again further on (a :class:`gemmfuse.Value` argument, in registers); the chain
        ends at the last node where every value it holds is read by the chain alone."""
        chain = _Chain(linear, path, _linear_input(linear, self.gm), labels=[label])
        self.linear = linear
        chain.gemm = self.meta[linear]
        stage, v = "pre", linear
        folded = self._fold_pool(chain)
        if isinstance(folded, _Refusal):
            chain.stopped = str(folded)
            return chain
        v = folded or v
        self.stretch = _Stretch({v: Value(0)})
        saved = _Saved.of(chain, v)
        while True:
            users = self._users(chain, v)
            # _swish's refusal: not swish, but maybe values read again further on
            pair = _swish(self.gm, v) if len(users) == 2 and not self.stretch.pending else None
            if isinstance(pair, tuple):
                extended = self._extend_swish(chain, *pair, stage)
                if isinstance(extended, _Refusal):
                    chain.stopped = f"stopped at {pair[1].name} (x * sigmoid(x)): {extended}"
                    break
            else:
                if not users:
                    chain.stopped = f"stopped after {v.name}: its result is not used{_source(v)}"
                    break
                u = users[0]  # the first in the graph; the others must read v again further on
                if len(users) > 1:
                    self.stretch.pending[v] = set(users[1:])
                if u.op == "output":
                    chain.stopped = "ends at the model's output"
                    break
                extended = self._extend(chain, u, v, stage)
                if isinstance(extended, _Refusal):
                    where = u.target if u.op == "call_module" else u.name  # a path, or fx's name
                    at = _source(u)  # where the node is (unless the refusal ends saying so)
                    at = "" if str(extended).endswith(at) else at
                    chain.stopped = f"stopped at {where} ({self._describe(u)}): {extended}{at}"
                    break
            stage, v = extended
            if not self.stretch.pending:
                saved = _Saved.of(chain, v)
        if self.stretch.pending:
            chain.stopped = self._unread(chain, saved)
        if chain.max_pool is not None and chain.reduce is None:  # it reached no reduction
            chain.stopped = (
                f"stopped at {chain.nodes[1].name} (channel pooling): a max pooling over the "
                "channels is fused where a channel reduction follows it at once, the kernels "
                f"taking the windows' maxima as they reduce a row ({chain.stopped})"
            )
            chain.nodes, chain.ops, chain.operands = [], [], []
            chain.labels, chain.max_pool = chain.labels[:1], None
        return chain

    def _fold_pool(self, chain: _Chain) -> "fx.Node | _Refusal | None":
        """Takes an average pooling over the channels right after the Linear (``unsqueeze(1)``,
        ``avg_pool1d``, ``squeeze(1)``) into the chain, to be folded into the weights: the
        squeeze's node (the chain's value from there on), None where there is no such pooling,
        or a :class:`_Refusal` where there is one the Linear cannot take."""
        found = _pooling(self.gm, chain.linear)
        if isinstance(found, _Refusal):  # the unsqueeze's line: where the pooling is written
            return _Refusal(f"{found}{_source(next(iter(chain.linear.users)))}")
        if found is None:
            return None
        nodes, pool, settings = found
        at = f"stopped at {nodes[1].name} (channel pooling)"
        # (M, N): avg_pool1d takes (M, 1, N), so a higher Linear output never gets here
        channels = chain.gemm.shape[-1]
        if isinstance(pool, MaxPool):
            problem = max_pool_settings_problem(settings, pool.dilation, pool.return_indices,
                                                channels)  # fmt: skip
        else:
            problem = pool_problem(*settings, channels)
        if problem:
            return _Refusal(f"{at}: {problem}{_source(nodes[1])}")
        if nodes[-1] not in self.meta or self.meta[nodes[-1]].dtype != chain.gemm.dtype:
            return _Refusal(f"{at}: its result is not a {chain.gemm.dtype} tensor")
        chain.nodes += nodes
        if isinstance(pool, MaxPool):  # the kernel's product stays (M, N): the reduction pools
            chain.max_pool = pool
            chain.labels.append(f"max_pool1d({pool.kernel_size}) over the channels")
            return nodes[-1]
        chain.pool = pool
        chain.gemm = self.meta[nodes[-1]]
        chain.labels.append(
            f"avg_pool1d({settings[0]}) over the channels (folded into the weights)"
        )
        return nodes[-1]

    def _extend_swish(self, chain: _Chain, s: fx.Node, m: fx.Node, stage: str):
        """Adds ``s = sigmoid(x)``, ``m = x * s`` as the one op swish: as :meth:`_extend`."""
        after = self._accept(chain, _Step("op", "x * sigmoid(x)", "swish"), m, stage)
        if isinstance(after, _Refusal):
            return after
        chain.nodes += [s, m]
        chain.labels.append("x * sigmoid(x)")
        return after, self._joined(chain, (stage, after), [s, m], m)

    def _extend(self, chain: _Chain, u: fx.Node, v: fx.Node, stage: str):
        """Adds ``u`` (the next node on the chain's value ``v``) to the chain: (the stage after
        it, the chain's new value), or a :class:`_Refusal` leaving the chain as it was."""
        step = self._match(u, v)
        end = u if isinstance(step, _Refusal) or not step.selects else self._select(u)
        refusal = _first_refusal((step, end))
        ends_stretch = refusal is None and (
            step.kind == "norm" or (step.kind == "reduce" and stage != "tail")
        )
        if ends_stretch and self.stretch.pending:
            # the kernels keep a stretch's values up to its norm or reduction, not past it
            pending = sorted(n.name for n in self.stretch.pending)
            refusal = _Refusal(f"{', '.join(pending)} is read again after it")
        if refusal is None and step.inplace and self.stretch.pending:
            refusal = _Refusal("an in-place op while a value is still to be read again")
        if refusal is None:
            after = self._accept(chain, step, end, stage)
            refusal = _first_refusal((after,))
        if refusal is not None:
            return refusal
        nodes = [u] if end is u else [u, end]
        chain.nodes += nodes
        chain.labels.append(step.label)
        return after, self._joined(chain, (stage, after), nodes, end)

    def _joined(self, chain: _Chain, stages, nodes: list[fx.Node], end: fx.Node) -> fx.Node:
        """Records ``nodes`` (ending at ``end``) as joined: their reads are done, and ``end``
        holds the stretch's latest value (value 0 of a new stretch where ``stages``, before and
        after, differ: after a norm or the reduction)."""
        before, after = stages
        self.stretch.joined(nodes)
        if after != before:
            self.stretch = _Stretch({end: Value(0)})
        else:  # an op's result, or (a reduction over a kept dimension) the value unchanged
            self.stretch.values[end] = Value(sum(op.stage == after for op in chain.ops))
        self.stretch.names[end] = nodes[0].name  # torch.max's node, not its [0] / .values
        return end

    def _users(self, chain: _Chain, v: fx.Node) -> list[fx.Node]:
        """v's users in graph order, apart from ``detach()`` / ``clone()`` copies of it: those
        join the chain as values to read again."""
        users = []
        for u in sorted(v.users, key=self.order):
            detach = _alias_of(u, v)
            if detach is None or v not in self.stretch.values:
                users.append(u)
            elif u.users:  # a copy nothing reads (kept as an attribute, or unused) joins nothing
                self._copy(chain, u, v, detach)
        return users

    def _copy(self, chain: _Chain, u: fx.Node, v: fx.Node, detach: bool) -> None:
        """Adds ``u``, a detach or clone of the chain value ``v``, as a value of the stretch
        (detached if either is); its users wait to read it, copies of it joining in turn."""
        base = self.stretch.values[v]
        self.stretch.values[u] = Value(base.index, base.detach or detach)
        base_name = self.stretch.names.get(v, v.name)
        self.stretch.names[u] = f"{base_name}.{'detach' if detach else 'clone'}()"
        chain.nodes.append(u)
        readers = set(self._users(chain, u))
        if readers:
            self.stretch.pending[u] = readers

    def _unread(self, chain: _Chain, saved: _Saved) -> str:
        """The chain cut back to ``saved``: the stop message saying why."""
        pending = sorted({n.name for n in self.stretch.pending})
        readers = sorted({u.name for us in self.stretch.pending.values() for u in us})
        saved.restore(chain)
        return (
            f"stopped after {saved.v.name}: {', '.join(pending)} is also read by "
            f"{', '.join(readers)}, which the chain does not reach ({chain.stopped})"
        )

    def _describe(self, node: fx.Node) -> str:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            prefix = "nn." if type(module).__module__.startswith("torch.nn") else ""
            return prefix + type(module).__name__
        if node.op in ("call_function", "call_method"):
            return _target_name(node.target)
        return node.op

    def linear_problem(self, node: fx.Node) -> str:
        """Why this Linear call (a module's, F.linear's or a matmul by a transposed attribute)
        cannot be swapped ("" if it can)."""
        x = _linear_input(node, self.gm)
        if node.op != "call_module":  # F.linear: on the model's own tensors only
            args = _linear_args(node, self.gm)
            for key in ("weight", "bias"):
                t = args[key]
                if t is not None and not (isinstance(t, fx.Node) and t.op == "get_attr"):
                    return (
                        f"its {key} is computed in the forward (F.linear is fused on "
                        "parameters, buffers and tensor attributes)"
                    )
        else:
            module = self.gm.get_submodule(node.target)
            if type(module).forward is not nn.Linear.forward:
                return f"{type(module).__name__} overrides nn.Linear.forward"
            if _has_hooks(module):
                return "the module has forward hooks"
            if node.kwargs.keys() - {"input"} or len(node.args) > 1:
                return "its input is not a tensor of the forward"
        if x not in self.meta:
            return "its input is not a tensor of the forward"
        shape = self.meta[x].shape
        if len(shape) < 2:
            return f"its input is {len(shape)}-D {shape}; the fused kernel takes (batch, features)"
        return ""
