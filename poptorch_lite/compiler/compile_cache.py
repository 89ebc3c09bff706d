"""Compiled graphs shared across wrappers: one compile per graph, backend, device and inputs.

[Note: the compile cache]
Wrapping a model again (a new ``trainingModel``, the Keras face's ``fit`` after ``compile``,
a test sweep) traces graphs that are the same code as before. A compiled stage
(``compiled_stages.CompiledGraph``) looks its graph up here first, and compiles only on a
miss. Two graphs are one when their code, what each name in it calls (a target not one of
torch's ops by its identity: two classes of one name read alike), their constants, the
backend, the device, the inputs' shapes, strides, dtypes and ``requires_grad``, the grad
mode and the split backward's weight positions agree. The cache holds the last 64
(least recently compiled dropped), each with the graph whose key names objects by identity,
so that those stay alive while their key does, and the sources torch.fx keeps of the graphs
made for it, forgotten with it.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Optional

import torch
import torch.fx as fx

from . import tracing

_SIZE = 64
_cache: "collections.OrderedDict" = collections.OrderedDict()  # key -> compiled entry
_lock = threading.Lock()


def key(gm: fx.GraphModule, backend: str, device: torch.device, random: bool, args: tuple,
        grad: bool, weights) -> tuple:
    """The key of ``gm`` compiled by ``backend`` for ``device`` and ``args`` in grad mode
    ``grad`` (``weights``: a split backward's weight positions)."""
    return _graph_key(gm, backend, device, random), _signature(args), grad, weights


def get(k: tuple) -> Optional[tuple]:
    """The entry kept under ``k``: ``(function, split, sources, graph, cut)``, or None."""
    with _lock:
        return _cache.get(k)


def put(k: tuple, entry: tuple) -> None:
    """Keep ``entry`` (its third item: the sources to forget with it) under ``k``."""
    with _lock:
        _cache[k] = entry
        while len(_cache) > _SIZE:
            tracing.forget_sources(_cache.popitem(last=False)[1][2])


def clear() -> None:
    """Forget every compiled graph of this process (the next compile starts afresh)."""
    with _lock:
        for _, _, keys, *_ in _cache.values():
            tracing.forget_sources(keys)
        _cache.clear()


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else repr(a) for a in args)


def _graph_key(gm: fx.GraphModule, backend: str, device: torch.device, random: bool) -> tuple:
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "call_function":
            digest.update(repr(_target_key(node.target)).encode())
        elif node.op == "call_module":
            digest.update(repr(("module", id(gm.get_submodule(node.target)))).encode())
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            digest.update(node.target.encode())
            if isinstance(value, torch.Tensor):
                digest.update(repr((value.dtype, tuple(value.shape))).encode())
                digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes())
            else:
                digest.update(repr(("object", id(value))).encode())
    return digest.hexdigest(), backend, str(device), random


def _target_key(target):
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if hasattr(target, "wrapped_op"):  # a wrapper of ``subgraphs``: its kind, and its op
        return getattr(target, "rewrap", None).__qualname__, _target_key(target.wrapped_op)
    if getattr(target, "__module__", None) in ("_operator", "operator", "builtins", "math"):
        return target.__module__, target.__qualname__
    return "object", id(target)  # alive while the cache holds the graph that calls it
