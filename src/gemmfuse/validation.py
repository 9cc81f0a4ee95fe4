"""What a fused call accepts: ``fused_linear`` raises on the first problem, ``FusedLinear``
falls back to the model's own chain on it (one set of rules for both).

A problem is (exception class, message): TypeError for an argument of the wrong kind,
ValueError for a wrong shape, dtype or device; the message names the argument.

This module imports only torch and the standard library (plus the package's own standalone-safe
modules): ``gemmfuse export`` inlines it into standalone files.
"""

import torch

from gemmfuse.epilogue import Epilogue, Problem, keeps_shape, raise_problem


def _vector_problem(t, name: str, n: int, like, like_name="the weight") -> "Problem | None":
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return TypeError, f"{name} must be a torch.Tensor or None, got {type(t).__name__}"
    if t.shape != (n,):
        return ValueError, f"{name} must have shape ({n},), got {tuple(t.shape)}"
    if t.device != like.device or t.dtype != like.dtype:
        return ValueError, (
            f"{name} must be {like.dtype} on {like.device} like {like_name}, "
            f"got {t.dtype} on {t.device}"
        )
    return None


def _params_problem(params, epilogue: Epilogue) -> "Problem | None":
    if not isinstance(params, (tuple, list)):
        return TypeError, f"params must be a tuple or list of tensors, got {type(params).__name__}"
    for i, t in enumerate(params):
        if not isinstance(t, torch.Tensor):
            return TypeError, f"params[{i}] must be a torch.Tensor, got {type(t).__name__}"
    used = epilogue.channel_params + epilogue.tail_params
    if used and max(used) >= len(params):
        return ValueError, (
            f"the epilogue reads params[{max(used)}] but {len(params)} tensor(s) were given"
        )
    return None


def _norm_problem(x, n, like, epilogue: Epilogue, gn_weight, gn_bias, like_name="the weight"):
    """The first problem with the GroupNorm's settings and vectors on rows ``x`` of ``n``
    channels (``like``: the tensor whose dtype and device the vectors share)."""
    norm = epilogue.norm
    if norm is None:
        if gn_weight is not None or gn_bias is not None:
            return ValueError, "gn_weight/gn_bias given but the epilogue has no GroupNorm"
        return None
    if n % norm.num_groups:
        return ValueError, f"num_groups={norm.num_groups} must divide out_features={n}"
    if not norm.layer and x.shape[0] * (n // norm.num_groups) == 1:  # F.group_norm refuses it
        return ValueError, (
            f"GroupNorm needs more than 1 value per group, got x of shape {tuple(x.shape)} "
            f"with {norm.num_groups} groups of {n} channels"
        )
    if norm.affine != (gn_weight is not None) or (gn_weight is None) != (gn_bias is None):
        return ValueError, (
            "gn_weight and gn_bias must both be given exactly when the GroupNorm is affine "
            f"(affine={norm.affine})"
        )
    return _vector_problem(gn_weight, "gn_weight", n, like, like_name) or _vector_problem(
        gn_bias, "gn_bias", n, like, like_name
    )


def _chain_problem(epilogue, params) -> "Problem | None":
    """The first problem with the chain and its ``params`` apart from the rows they act on."""
    if not isinstance(epilogue, Epilogue):
        return TypeError, f"epilogue must be a gemmfuse.Epilogue, got {type(epilogue).__name__}"
    return _params_problem(params, epilogue)


def _chain_tensors_problem(
    x, n, like, epilogue, gn_weight, gn_bias, params, like_name="the weight"
):
    """The first problem with the chain's tensors on rows ``x`` of ``n`` channels: ``params``
    that change the (M, N) shape before the reduction, then the GroupNorm's (``like``, named
    ``like_name``: the tensor whose dtype and device its vectors share)."""
    for i in sorted(set(epilogue.channel_params)):
        shape = tuple(params[i].shape)
        if not keeps_shape(shape, (x.shape[0], n)):
            return ValueError, (
                f"params[{i}] of shape {shape} does not broadcast to the chain's "
                f"({x.shape[0]}, {n}): the ops before the reduction keep the GEMM's shape"
            )
    pool = 1 if epilogue.reduce is None else epilogue.reduce.pool
    if pool > 1 and pool > n:  # max_pool1d refuses a window wider than its input
        return ValueError, (
            f"the reduction's max-pooling window of {pool} channels (Reduction.pool) is wider "
            f"than the chain's {n} channels"
        )
    return _norm_problem(x, n, like, epilogue, gn_weight, gn_bias, like_name)


def argument_problem(x, weight, bias, epilogue, gn_weight, gn_bias, params=()) -> "Problem | None":
    """The first problem with ``fused_linear``'s arguments, or None: everything PyTorch would
    accept for the chain passes."""
    if not isinstance(x, torch.Tensor):
        return TypeError, f"x must be a torch.Tensor, got {type(x).__name__}"
    if not isinstance(weight, torch.Tensor):
        return TypeError, f"weight must be a torch.Tensor, got {type(weight).__name__}"
    if weight.dim() != 2:
        return ValueError, "weight must be a 2-D torch.Tensor of shape (out_features, in_features)"
    problem = _chain_problem(epilogue, params)
    if problem is not None:
        return problem
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        return ValueError, f"x must have shape (batch, {k}) to match weight, got {tuple(x.shape)}"
    if x.device != weight.device or x.dtype != weight.dtype:
        return ValueError, (
            f"x ({x.dtype} on {x.device}) and weight ({weight.dtype} on {weight.device}) "
            "must share dtype and device"
        )
    problem = _vector_problem(bias, "bias", n, weight)
    if problem is not None:
        return problem
    return _chain_tensors_problem(x, n, weight, epilogue, gn_weight, gn_bias, params)


def epilogue_argument_problem(z, epilogue, gn_weight, gn_bias, params=()) -> "Problem | None":
    """The first problem with ``fused_epilogue``'s arguments (the chain on an (M, N) tensor
    ``z``), or None."""
    if not isinstance(z, torch.Tensor):
        return TypeError, f"z must be a torch.Tensor, got {type(z).__name__}"
    if z.dim() != 2:
        return ValueError, f"z must be 2-D (rows, channels), got shape {tuple(z.shape)}"
    if not z.is_floating_point():
        return ValueError, f"z must be a floating-point tensor, got {z.dtype}"
    return _chain_problem(epilogue, params) or _chain_tensors_problem(
        z, z.shape[1], z, epilogue, gn_weight, gn_bias, params, "z"
    )


def validate(x, weight, bias, epilogue, gn_weight, gn_bias, params=()) -> None:
    """Raises TypeError/ValueError naming the bad argument; accepts everything PyTorch would."""
    raise_problem(argument_problem(x, weight, bias, epilogue, gn_weight, gn_bias, params))
