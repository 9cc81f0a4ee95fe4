"""Tensor parallelism for fused chains: ``gemmfuse.parallelize(model, mesh)``.

Each :class:`~gemmfuse.FusedLinear` of an optimized model is split by output channels over a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh` (column parallel, as PyTorch's
``ColwiseParallel``): rank r holds channels [r·N/W, (r+1)·N/W) of the weight, the bias, the
GroupNorm's affine vectors and every per-channel operand, as ``DTensor`` parameters placed
``Shard`` on the channel dimension, swapped in place where the model keeps them (the state_dict
keys do not change). The split follows GroupNorm group boundaries, so every group lives on one
rank and the chain runs locally up to its reduction, with no communication for the norm; a split
that would cut a group is refused.

Per call, with x replicated on every rank (M rows, K features):

- the chain without a reduction: each rank's (M, N/W) slice, all-gathered into (M, N) on every
  rank (M·N/W values sent per rank), or, with ``gather_output=False``, returned as a ``DTensor``
  placed ``Shard(1)`` (no communication);
- with a channel reduction (min, max, sum, mean, logsumexp), each rank reduces its own channels
  and the W partial results of M values each are all-gathered and combined (``amin``, ``amax``,
  ``sum``, ``mean`` of equal shards, ``logsumexp`` with its max shift): M values sent per rank;
  tail ops run on the replicated result.

Backward, as PyTorch's tensor parallelism defines it (every rank computes the same loss from
the replicated output): a gathered output's gradient is each rank's own slice (no
communication); x's gradient is the sum of the ranks' partial products, one all-reduce of M·K
values when x requires grad; the parameter shards get their own gradients locally. At a min or
max tied between ranks the gradient is split between the tied ranks first, then between a
rank's tied channels (eager splits it evenly over all tied channels).

The chain's settings (a GroupNorm's num_groups and eps, a LeakyReLU's slope...) are read when
``parallelize`` runs: a module changed later is not seen, unlike an unsplit FusedLinear.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gemmfuse.epilogue import Epilogue, per_channel
from gemmfuse.modules import BatchNormAffine, FusedLinear
from gemmfuse.ops import fused_linear_with_path
from gemmfuse.tail import apply_tail
from gemmfuse.weight_cache import SplitWeightCache

# How the W ranks' partial reductions (stacked on dim 0) combine into the whole row's.
_COMBINE = {
    "min": torch.amin,
    "max": torch.amax,
    "sum": torch.sum,
    "mean": torch.mean,  # every rank reduces the same number of channels
    "logsumexp": torch.logsumexp,
}


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward sums the ranks' partial input gradients (one all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's may be shared
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherFromRanks(torch.autograd.Function):
    """All-gather of each rank's tensor, concatenated along ``dim``; backward keeps this rank's
    slice of the gradient (each rank computed the same loss from the gathered value)."""

    @staticmethod
    def forward(ctx, t, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]  # fmt: skip
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=ctx.dim)[rank].contiguous(), None, None


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class ColumnParallelFusedLinear(nn.Module):
    """A :class:`FusedLinear` split by output channels over ``mesh`` (see the module
    docstring). Its parameters are the FusedLinear's (the same dict, now holding DTensors)."""

    def __init__(self, fused: FusedLinear, mesh: DeviceMesh, *, gather_output: bool = True):
        super().__init__()
        if not isinstance(fused, FusedLinear):
            raise TypeError(f"fused must be a gemmfuse.FusedLinear, got {type(fused).__name__}")
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise ValueError("mesh must be a 1-D torch.distributed DeviceMesh")
        self.epilogue = _splittable_epilogue(fused, mesh.size())
        self.mesh, self.gather_output = mesh, gather_output
        self.world = mesh.size()
        self._parameters = fused._parameters  # one state, as FusedLinear shares the Linear's
        object.__setattr__(self, "fused", fused)  # not registered: no second state_dict key
        self.weight_split = SplitWeightCache()
        _distribute_channels(fused, self.epilogue, mesh)
        self.sharded_operands = {
            i for i, (owner, name) in enumerate(fused._operands)
            if isinstance(getattr(owner, name), DTensor)
        }  # fmt: skip
        norm = self.epilogue.norm
        local_norm = None if norm is None else dataclasses.replace(
            norm, num_groups=norm.num_groups // self.world)  # fmt: skip
        self.local_epilogue = dataclasses.replace(self.epilogue, norm=local_norm, tail=())

    def extra_repr(self) -> str:
        return f"{self.fused.extra_repr()}, ranks={self.world}, gather_output={self.gather_output}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
            raise ValueError(f"x must be replicated on every rank, got {x.placements}")
        x = _local(x)
        row_wise = self.epilogue.norm is None and self.epilogue.reduce is None
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or (x.dim() > 2 and not row_wise):
            raise ValueError(
                f"x must be a tensor (rows, in_features), or of more dimensions before a "
                f"pointwise chain, got {_shape(x)}"
            )
        if x.dim() > 2:  # leading dimensions as rows, as FusedLinear runs them
            lead = x.shape[:-1]
            return self._call(x.reshape(-1, x.shape[-1])).unflatten(0, lead)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (_local(t) for t in self.fused._linear())
        operands, norm, _ = self.fused._state()
        group = self.mesh.get_group()
        grad_on = torch.is_grad_enabled()
        # A replicated operand of the chain sees this rank's channels only: its gradient is
        # the sum over the ranks (a tail operand's is whole on every rank already).
        replicated = set(self.epilogue.channel_params) - self.sharded_operands
        operands = [
            _CopyToRanks.apply(_local(t), group) if i in replicated and grad_on and t.requires_grad
            else _local(t)
            for i, t in enumerate(operands)
        ]  # fmt: skip
        gn = (None, None) if norm is None else (_local(norm.weight), _local(norm.bias))
        if x.requires_grad and grad_on:
            x = _CopyToRanks.apply(x, group)
        out, path = fused_linear_with_path(
            x, weight, bias, self.local_epilogue, *gn, params=operands,
            weight_cache=self.weight_split, kernel=self.fused.kernel,
            precision=self.fused.precision,
        )  # fmt: skip
        reduce = self.epilogue.reduce
        if reduce is None:
            if not self.gather_output:
                return DTensor.from_local(out, self.mesh, [Shard(1)], run_check=False)
            return _GatherFromRanks.apply(out, group, 1)
        parts = _GatherFromRanks.apply(out.unsqueeze(0), group, 0)
        combined = _COMBINE[reduce.op](parts, dim=0)
        out = apply_tail(combined, self.epilogue, operands, kernel=path != "torch")
        if not self.gather_output:
            return DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        return out


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _splittable_epilogue(fused: FusedLinear, world: int) -> Epilogue:
    """The FusedLinear's chain as of now; ValueError where W ranks cannot split it."""
    epilogue = fused.epilogue
    if epilogue is None:
        raise ValueError("the chain's current module settings are outside the epilogue grammar")
    if fused.pool is not None:
        raise ValueError(
            "a channel pooling is folded into this Linear's weights (pooling.py): parallelize "
            "does not split a pooled Linear yet"
        )
    if fused.forward_inputs:
        raise ValueError(
            "this chain reads an operand the forward computes (a residual): parallelize does "
            "not split one yet"
        )
    owners = [ref[0] for ref in fused._operands if isinstance(ref, tuple)]
    if any(isinstance(owner, BatchNormAffine) for owner in owners):
        # Its batch statistics would need all M rows on each rank, and its operands are
        # computed per call, not parameters a rank could hold a slice of.
        raise ValueError("a BatchNorm1d follows the Linear: parallelize does not split one yet")
    n = fused.out_features
    if n % world:
        raise ValueError(f"out_features={n} does not split evenly over {world} ranks")
    if epilogue.norm is not None and epilogue.norm.layer:
        raise ValueError(
            "a LayerNorm, RMSNorm or softmax normalises each row over all its channels: a "
            "column split would need its statistics all-reduced, which parallelize does not do "
            "yet"
        )
    pool = 1 if epilogue.reduce is None else epilogue.reduce.pool
    if (n // world) % pool:
        raise ValueError(
            f"splitting {n} channels over {world} ranks would cut a max-pooling window of "
            f"{pool} channels before the reduction: {n // world} is not a multiple of {pool}"
        )
    if epilogue.norm is not None and epilogue.norm.num_groups % world:
        raise ValueError(
            f"splitting {n} channels over {world} ranks would cut a GroupNorm group: "
            f"num_groups={epilogue.norm.num_groups} is not a multiple of {world}"
        )
    for i in epilogue.channel_params:
        owner, name = fused._operands[i]
        shape = tuple(getattr(owner, name).shape)
        if not per_channel(shape, n):
            raise ValueError(
                f"operand {name!r} of shape {shape} is not per channel ((), (1,), ({n},) or "
                f"(1, {n})): a column split cannot slice it"
            )
    return epilogue


def _distribute_channels(fused: FusedLinear, epilogue: Epilogue, mesh: DeviceMesh) -> None:
    """Swaps each channel-indexed tensor for its DTensor, in place where the model keeps it:
    the weight's rows and the last dimension of the vectors split, the rest replicated."""
    n = fused.out_features
    weight_ref, bias_ref = fused._tensor_refs
    owner, name = weight_ref or (fused, "weight")
    weight = getattr(owner, name)
    if not isinstance(weight, DTensor):  # (N, K): a block of rows per rank
        _set(owner, name, distribute_tensor(weight.detach(), mesh, [Shard(0)]), weight)
    slots = [bias_ref or (fused, "bias")]
    norm = fused._norm
    if norm is not None and norm.module is not None:
        slots += [(norm.module, "weight"), (norm.module, "bias")]
    elif norm is not None:
        slots += [fused._operands[i] for i in (norm.weight, norm.bias) if i is not None]
    slots += [fused._operands[i] for i in epilogue.channel_params]
    for owner, name in dict.fromkeys(slots):
        t = getattr(owner, name, None)
        if t is None or isinstance(t, DTensor):
            continue
        if t.dim() and t.shape[-1] == n:  # per channel: a slice per rank; else replicated
            placement = Shard(t.dim() - 1)
            _set(owner, name, distribute_tensor(t.detach(), mesh, [placement]), t)


def _set(owner: nn.Module, name: str, value: DTensor, old: torch.Tensor) -> None:
    if isinstance(old, nn.Parameter):
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    setattr(owner, name, value)


def parallelize(model: nn.Module, mesh: DeviceMesh, *, gather_output: bool = True) -> nn.Module:
    """Splits every :class:`FusedLinear` of ``model`` (an ``optimize`` result) by output
    channels over the 1-D ``mesh``, in place, and returns ``model`` (a FusedLinear itself is
    returned split). Every rank must call it on the same model; rank 0's values are scattered.
    ``gather_output`` False returns DTensors (``Shard(1)``, or ``Replicate()`` after a
    reduction) instead of gathered tensors.

    Raises ValueError, before changing anything, naming a FusedLinear whose split would cut a
    GroupNorm group or slice its channels unevenly, and when the model has no FusedLinear.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError("mesh must be a 1-D torch.distributed DeviceMesh")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedLinear)]
    if not found:
        raise ValueError("the model has no FusedLinear: run gemmfuse.optimize on it first")
    for path, fused in found:  # every split checked before any tensor moves
        try:
            _splittable_epilogue(fused, mesh.size())
        except ValueError as e:
            raise ValueError(f"{path or type(model).__name__}: {e}") from None
    if isinstance(model, FusedLinear):
        return ColumnParallelFusedLinear(model, mesh, gather_output=gather_output)
    for path, fused in found:
        parent_path, _, attr = path.rpartition(".")
        split = ColumnParallelFusedLinear(fused, mesh, gather_output=gather_output)
        setattr(model.get_submodule(parent_path), attr, split)
    return model
