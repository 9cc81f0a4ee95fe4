"""The weight-split cache: a weight's fp16 hi/lo split (and float32 copies of per-channel
vectors) made once per version of the weight, and which cache a call may use.

This module imports only torch and the standard library: ``gemmfuse export`` inlines it into
standalone files.
"""

import itertools
import sys
import weakref

import torch


class SplitWeightCache:
    """The fp16 hi/lo split of a weight, computed once and recomputed when the weight changes.

    A change is any of: another tensor or storage (``.to()``, ``load_state_dict`` with
    ``assign=True``, ``param.data = ...``), or an in-place write through the parameter itself
    (optimizer steps, ``load_state_dict``), which bumps its version counter. The cache holds the
    storage it was built from, so that address cannot be reused by a new weight unnoticed.
    Writes through ``param.data`` bypass the version counter: call :meth:`clear` after them.
    Other tensors derived from a weight (a pooled weight: pooling.py) are kept by the same rules
    (:meth:`derived`).
    Memory: 4 bytes per weight element (two fp16 copies), plus 4 bytes per output channel; as
    much again once a backward has run (the transposed split its input gradient reads).
    The splits live in the host extension's ``SplitCache`` (csrc/host/host_plan.h), which the
    cache's plans share: ``fused_linear``'s calls of one kind decided once and run in C++
    (gemmfuse/plan.py; ``plans``, the most recent first).

    The forward's dense float32 copies of the per-channel vectors its kernels read, where they
    are not that already (a bfloat16 model's bias and GroupNorm affine), are kept in the
    SplitCache too, by the same rules (4 bytes per channel and vector, one copy per vector
    slot and width); the backward's chain kernel keeps its own copies of the GroupNorm affine
    here (:meth:`float32`).

    An inference tensor (made under ``torch.inference_mode``) has no version counter, so
    nothing is kept for it: a weight created under inference_mode is split again at every call
    (an allocation and a split kernel each time). Create the model outside inference_mode, or
    call it inside, to keep its split.
    """

    # Every live cache by its token: the torch.library ops (library.py) take a token, as a
    # compiled graph or an exported program holds ints, not Python objects.
    _live = weakref.WeakValueDictionary()
    # Tokens that no live cache holds (a program exported by another process), the oldest
    # dropped beyond _MAX_ADOPTED: a dropped token's next call splits its weight afresh.
    _adopted = {}
    _MAX_ADOPTED = 64
    _tokens = itertools.count()

    def __init__(self, keeps: bool = True):
        self.keeps = keeps  # False: graph_safe's kind, which keeps no tensor past a call
        self.token = next(self._tokens)
        self._live[self.token] = self
        self.clear()

    @classmethod
    def for_token(cls, token: int) -> "SplitWeightCache":
        """The cache of ``token``: a new one for -1 (no cache), and one kept (the last
        ``_MAX_ADOPTED`` of them) for a token no live cache holds (a program exported by another
        process)."""
        if token < 0:
            return cls()
        cache = cls._live.get(token)
        if cache is None:
            cache = cls._adopted.get(token)
        if cache is None:
            if len(cls._adopted) >= cls._MAX_ADOPTED:
                del cls._adopted[next(iter(cls._adopted))]
            cache = cls._adopted[token] = cls()
        return cache

    def __reduce__(self):
        # Derived state, and host extension objects that neither copy nor pickle: a copied model
        # (deepcopy, pickle) starts with an empty cache of its own.
        return (SplitWeightCache, ())

    def clear(self) -> None:
        self._entries = {}
        self._native = None  # (host extension module, its SplitCache)
        self.plans = []
        self.plan_kinds = []  # plan.py's kind of each plan, in the same order
        self._graph_safe = None  # graph_safe's twin, made at its first use

    def graph_safe(self) -> "SplitWeightCache":
        """This cache's twin for calls that a CUDA graph may record (the op
        ``gemmfuse::fused_linear_graph_safe``, library.py): it keeps plans, which hold no GPU
        memory, but no tensor (its SplitCache keeps nothing, :meth:`derived` makes afresh).
        torch.compile's CUDA graphs warm a graph up with allocations routed to their private
        pool, whose memory they hand out again: a tensor kept there would be overwritten."""
        if self._graph_safe is None:
            self._graph_safe = SplitWeightCache(keeps=False)
        return self._graph_safe

    def native(self, ext):
        """The SplitCache of ``ext``'s host extension (csrc/host/host_plan.h): this weight's splits,
        shared by the forward, the backward and the plans. A standalone export builds a module
        per chain, each with its own SplitCache type: another's replaces it."""
        if self._native is None or self._native[0] is not ext.host:
            self._native = (ext.host, ext.host.SplitCache(keeps=self.keeps))
        return self._native[1]

    def derived(self, t: torch.Tensor, slot, make):
        """``make()`` (a tensor computed from ``t``), made once per version of ``t`` for this
        slot (a hashable naming its role); at every call where ``t`` is an inference tensor,
        which has no version to key on (the host extension's SplitCache does the same), and at
        every call in a cache that keeps nothing (:meth:`graph_safe`)."""
        if t.is_inference() or not self.keeps:
            self._entries.pop(slot, None)  # what an earlier tensor left in the slot goes
            return make()
        storage = t.untyped_storage()
        # data_ptr: a storage freed and re-allocated (resize_) keeps its object but may move.
        # FSDP2's refills keep address and version alike: cache_for_call keeps no cache then.
        key = (t._version, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype, t.device)  # fmt: skip
        hit = self._entries.get(slot)
        if hit is None or hit[0] is not storage or hit[1] != key:
            # kept past this call, it is an ordinary tensor even when made under inference_mode
            # (a later training call may save it for backward, which an inference tensor refuses)
            with torch.inference_mode(False), torch.no_grad():
                hit = (storage, key, make())
            self._entries[slot] = hit
        return hit[2]

    def float32(self, t: torch.Tensor | None, slot: str) -> torch.Tensor | None:
        """``t`` as a contiguous float32 tensor, converted once per version of ``t``; ``slot``
        names its role ("gn_weight", ...), so a new tensor in a slot replaces the old copy."""
        if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
            return t
        return self.derived(t, slot, lambda: t.detach().to(torch.float32).contiguous())

    def transposed(self, ext, weight: torch.Tensor, n_padded: int):
        """The weight's columns split: (hi, lo) [K, n_padded] and scales [K] (dx's B)."""
        return self.native(ext).cols(weight, n_padded)


def cache_for_call(cache: SplitWeightCache | None) -> SplitWeightCache:
    """The cache a call uses: ``cache``, or a new one (the split made in the call) where there is
    none, a CUDA graph is being captured, or FSDP2 manages modules (:func:`fsdp_in_use`). A graph
    captured with the cache's split would replay on that split after the weight changed in
    place; captured with a new one, the split is part of the graph and redone at each replay."""
    if cache is None or fsdp_in_use():
        return SplitWeightCache()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return SplitWeightCache()
    return cache


def fsdp_in_use() -> bool:
    """Whether a composable ``torch.distributed`` API (FSDP2's ``fully_shard``, among others)
    manages modules in this process.

    FSDP2 refills a module's unsharded parameters before each use in the same storage, from the
    second step on at the same address, without bumping their version counters (measured with
    torch 2.13, one rank: version 0 and one data pointer across SGD steps that changed every
    value), so no key the weight cache can read sees the new values. While FSDP2 is in use each
    call splits its weight afresh: training loses nothing by it (an optimizer step changes the
    weights between any two steps' calls), a forward repeated on unchanged weights pays the
    split (docs/PERFORMANCE.md's "weights changed" column).
    """
    state = sys.modules.get("torch.distributed._composable_state")
    return state is not None and len(getattr(state, "_module_state_mapping", ())) > 0
