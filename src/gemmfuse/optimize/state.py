"""State a forward carries from one call to the next in the model's attributes, which torch.fx
cannot record: it runs such a write once, while tracing, and the traced graph keeps what that
first call left. ``_trace`` watches the trace with :class:`_AttributeWrites` and refuses what it
finds; the model is left as it was either way.

This module imports only torch and the standard library: standalone exports bundle it, and
KernelBench's static checker refuses any exception handler or thread in them (so a class with
``__exit__``, not try/finally).
"""

import collections
import copy
import types

import torch
import torch.fx as fx
import torch.nn as nn

_SLOTS = ("__getattribute__", "__setattr__", "__delattr__")
_ABSENT = object()
_MODULE_OWN = frozenset(vars(nn.Module()))  # the attributes every module has (hook dicts, ...)
_CONTAINERS = (dict, list, set, collections.deque)
_DEPTH = 3  # how far below a module's attributes contents are watched
_MOST = 10_000  # items looked at, in all the containers: past it, the rest are not


class _AttributeWrites:
    """Watches the modules under ``view`` (a shallow copy of the model that shares its
    submodules) while fx traces it.

    ``in_place`` names the plain tensor attributes (not parameters or buffers, whose writes the
    tracer records) that the forward wrote in place. ``frozen`` names what it changed in a way
    the graph cannot follow:
    - an attribute (of a module's ``__dict__``, parameters, buffers or submodules) it read
      before it bound it anew, added it or deleted it (``self.t = self.t + 1``, a counter,
      ``if self.h is None: ... self.h = y``);
    - one it changed that the graph reads by name (a buffer rebound, a submodule swapped):
      the name is put back, and the graph would read the old one;
    - a dict, list, set or deque the model keeps (``_DEPTH`` levels down, through tuples too)
      or a plain object's attributes (one held by a module itself) that now hold a traced
      value (a cache of the forward's values). Only traced values are looked for: they can
      only be the forward's, where other changes may be anyone's (a logger's registry filled
      by an import while tracing), and only what holds them is put back.
    An attribute written before it is read (a weight_norm hook's weight, a value kept for
    inspection) carries nothing over. Reads and writes are seen through the modules' classes,
    whose ``__getattribute__``, ``__setattr__`` and ``__delattr__`` are wrapped while tracing.

    On leaving, whether or not the trace raised, the classes and every watched attribute and
    content are as they were; what was added is gone but for what the graph reads by name (the
    tracer's constants, on ``view`` itself)."""

    def __init__(self, view: nn.Module):
        named = list(view.named_modules())
        self.spaces = {
            id(d): (path, id(m), d)
            for path, m in named
            for d in (m.__dict__, m._parameters, m._buffers, m._modules)
        }
        self.plain = {id(m.__dict__) for _, m in named}  # the spaces of plain attributes
        self.watched = {id(m) for _, m in named}
        self.own_dict = view.__dict__  # the trace's copy: what the tracer adds there is its own
        self.classes = list(dict.fromkeys(type(m) for _, m in named))
        self.first: dict[tuple[int, str], bool] = {}  # (module id, name) -> read before written
        self.graph: fx.Graph | None = None
        self.in_place: list[str] = []
        self.frozen: list[str] = []

    def __enter__(self):
        for cls in self.classes:
            if any(getattr(cls.__dict__.get(s), "_gemmfuse_noting", False) for s in _SLOTS):
                raise RuntimeError(
                    "gemmfuse.optimize: another optimize is tracing in this process (torch.fx "
                    "traces one model at a time): run them one after the other"
                )
        self.before = self._attributes()
        self.versions = {
            key: v._version
            for key, v in self.before.items()
            if key[0] in self.plain and isinstance(v, torch.Tensor)
        }
        self.contents = _contents(
            (self._name(key), v) for key, v in self.before.items() if key[1] not in _MODULE_OWN
        )
        self.own = {c: {s: c.__dict__[s] for s in _SLOTS if s in c.__dict__} for c in self.classes}
        originals = {c: {s: getattr(c, s) for s in _SLOTS} for c in self.classes}
        for cls, slots in originals.items():
            for slot, original in slots.items():
                setattr(cls, slot, self._noting(original, slot == "__getattribute__"))
        return self

    def __exit__(self, *exc) -> bool:
        for cls in self.classes:
            for slot in _SLOTS:
                if slot in self.own[cls]:
                    setattr(cls, slot, self.own[cls][slot])
                else:
                    delattr(cls, slot)
        self.in_place = sorted(
            self._name(key) for key, version in self.versions.items()
            if self.before[key]._version != version
        )  # fmt: skip
        nodes = () if self.graph is None else self.graph.nodes
        by_name = {str(n.target) for n in nodes if n.op in ("get_attr", "call_module")}
        self._put_back_attributes(by_name)
        for name, (container, kept) in self.contents.items():
            if _holds_traced(container, _DEPTH):
                self.frozen.append(f"{name} (its contents)")
                _refill(container, kept)
        self.frozen.sort()
        return False

    def _put_back_attributes(self, by_name: set) -> None:
        after = self._attributes()
        for key in self.before.keys() | after.keys():
            old, new = self.before.get(key, _ABSENT), after.get(key, _ABSENT)
            if new is old:
                continue
            name, space = self._name(key), self.spaces[key[0]][2]
            tracers = old is _ABSENT and name in by_name and space is self.own_dict
            if not tracers and (self._read_first(key) or name in by_name):
                self.frozen.append(name)
            if old is not _ABSENT:
                space[key[1]] = old  # rebound or deleted: put back
            elif not tracers:
                del space[key[1]]

    def _noting(self, original, read: bool):
        watched, first = self.watched, self.first

        def noting(obj, name, *value):
            if id(obj) in watched:
                first.setdefault((id(obj), name), read)
            return original(obj, name, *value)

        noting._gemmfuse_noting = True
        return noting

    def _attributes(self) -> dict[tuple[int, str], object]:
        return {(i, k): v for i, (_, _, d) in self.spaces.items() for k, v in d.items()}

    def _name(self, key: tuple[int, str]) -> str:
        return f"{self.spaces[key[0]][0]}.{key[1]}".lstrip(".")

    def _read_first(self, key: tuple[int, str]) -> bool:
        return self.first.get((self.spaces[key[0]][1], key[1]), False)


def _contents(roots) -> dict[str, tuple[object, object]]:
    """name -> (container, a shallow copy) of every dict, list, set or deque reachable from
    ``roots`` ((name, value) pairs: a module's attributes) within ``_DEPTH`` levels, through
    tuples too, and the ``__dict__`` of a plain object among ``roots``, each once; at most
    ``_MOST`` items are looked at in all."""
    found, seen, budget = {}, set(), _MOST
    level = [(name, value, True) for name, value in roots]
    for _ in range(_DEPTH):
        below = []
        for name, value, top in level:
            container = _container_of(value, top)
            if container is None or id(container) in seen or len(container) > budget:
                continue
            seen.add(id(container))
            budget -= len(container)
            if not isinstance(container, tuple):
                found[name] = (container, copy.copy(container))
            items = container.items() if isinstance(container, dict) else enumerate(container)
            below += [(f"{name}[{_key(k)}]", v, False) for k, v in items if _walked(v)]
        level = below
    return found


def _walked(value) -> bool:
    return isinstance(value, (*_CONTAINERS, tuple))


def _container_of(value, top: bool):
    """What :func:`_contents` looks into of ``value``: itself (a container or tuple), the
    ``__dict__`` of a plain object held by a module itself, or None."""
    if _walked(value):
        return value
    plain = not isinstance(value, (torch.Tensor, nn.Module, type, types.ModuleType, fx.Proxy))
    if top and plain and not callable(value) and type(value).__dictoffset__:
        return object.__getattribute__(value, "__dict__")
    return None


def _key(key) -> str:
    return repr(key) if isinstance(key, (str, int)) else type(key).__name__


def _holds_traced(value, depth: int) -> bool:
    """Whether ``value`` is, or holds within ``depth`` levels of containers and tuples, an fx
    Proxy (a traced value: what only the forward being traced can have put there)."""
    if isinstance(value, fx.Proxy):
        return True
    if depth == 0 or not _walked(value):
        return False
    if isinstance(value, dict):
        return any(_holds_traced(k, 0) or _holds_traced(v, depth - 1) for k, v in value.items())
    return any(_holds_traced(v, depth - 1) for v in value)


def _refill(container, kept) -> None:
    """Puts ``kept``'s contents back into ``container``."""
    container.clear()
    (container.update if isinstance(container, (dict, set)) else container.extend)(kept)
