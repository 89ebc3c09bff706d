"""Inputs and outputs as tensor leaves and a structure to rebuild them with.

[Note: container subclasses]
PopTorch walks every ``dict``, ``list`` and ``tuple`` of a call's inputs and of
what ``forward`` returns, subclasses included, and rebuilds each container with
its own type (``poptorch/python/_utils.py`` ``reconstructTensorStructure``:
``type(x)({k: ... for k in x})`` for a dict, ``type(x)(...)`` for a list or
tuple). ``torch.utils._pytree`` walks only the types registered with it (dict,
OrderedDict, defaultdict, list, tuple, namedtuples, ...) and takes any other
object whole, as one leaf. An output that is an unregistered ``dict`` subclass
(transformers' ``ModelOutput`` in versions that do not register it, any user's
``OrderedDict`` subclass) would then be one constant of the trace: every later
call would return the trace-time object, its tensors frozen. So :func:`flatten`
first turns every unregistered ``dict``, ``list`` or ``tuple`` subclass into a
node of its own (``_Container``), whose unflattening builds the subclass again
from its rebuilt children, the way PopTorch does. A type registered with pytree
keeps its own flattening. A ``Mapping`` that is not a ``dict`` (transformers'
``BatchEncoding``, a ``UserDict``) is walked and rebuilt as a dict subclass is:
PopTorch accepts dicts, and a tokenizer's output passed whole is one.

Some libraries register their own types with pytree for ``torch.export``, and
only when asked: transformers registers its ``ModelOutput`` classes as they are
defined, but its key/value caches (``DynamicCache``, ``EncoderDecoderCache``, ...,
returned by default with ``use_cache=True``) only when an export asks for them
(``transformers.exporters.exporter_dynamo.register_cache_pytrees_for_model``, or
``transformers.integrations.executorch.register_dynamic_cache_export_support`` in
versions without ``exporters``). :func:`lift` asks that library the same way
(:data:`_LIBRARY_REGISTRATIONS`) when it meets such a type, then walks it: the
cache comes back rebuilt at every call with that call's keys and values, as a
``ModelOutput`` does. The registration is the library's own, global to the
process, as it is after an export. What still comes out as a leaf and is not a
tensor is a constant of the trace; :func:`tensor_holder` finds a constant that
holds tensors (a dataclass, an object with tensor attributes, a set of tensors),
which the trace refuses rather than freeze.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree


class _Container:
    """An unregistered ``dict``/``list``/``tuple`` subclass on its way through pytree."""

    __slots__ = ("kind", "keys", "children")

    def __init__(self, kind: type, keys: Optional[tuple], children: list):
        self.kind, self.keys, self.children = kind, keys, children


def _flatten_container(node: _Container):
    return node.children, (node.kind, node.keys)


def _rebuild(children, context):
    """The subclass again, from its rebuilt children, as PopTorch rebuilds it."""
    kind, keys = context
    if keys is not None:
        return kind(dict(zip(keys, children)))
    return kind(children)


pytree.register_pytree_node(_Container, _flatten_container, _rebuild,
                            serialized_type_name="poptorch_lite.compiler.structures._Container")


def _transformers_registers(kind: type) -> bool:
    """Register ``kind`` with pytree the way transformers' own export does, if it is one of
    the caches transformers registers; whether it did ([Note: container subclasses])."""
    try:
        from transformers.exporters.exporter_dynamo import is_cache_class, register_pytree_node
    except ImportError:  # transformers without exporters: its DynamicCache support only
        from transformers.cache_utils import DynamicCache
        from transformers.integrations.executorch import (
            register_dynamic_cache_export_support as register_dynamic)
        if kind is not DynamicCache:
            return False
        register_dynamic()
        return True
    if not is_cache_class(kind):
        return False
    register_pytree_node(kind)
    return True


#: Top-level module -> its own pytree registration for export, for a type of that library
#: that pytree does not know yet ([Note: container subclasses]).
_LIBRARY_REGISTRATIONS: dict[str, Callable[[type], bool]] = {"transformers": _transformers_registers}


def _registered_by_its_library(leaf: Any) -> bool:
    """Whether ``leaf``'s library registered its type with pytree, asked just now."""
    library = type(leaf).__module__.partition(".")[0]
    register = _LIBRARY_REGISTRATIONS.get(library)
    return (register is not None and library in sys.modules and register(type(leaf))
            and type(leaf) in pytree.SUPPORTED_NODES)


def lift(x: Any) -> Any:
    """``x`` with every unregistered container subclass in it turned into a ``_Container``.

    pytree takes a ``dict``, ``list`` or ``tuple`` it does not know whole, as one leaf, so a
    leaf of that kind is exactly an unregistered subclass. A ``Mapping`` is walked as a dict;
    a type whose library registers it with pytree for export is registered so, then walked.
    """
    def one(leaf):
        if isinstance(leaf, (dict, collections.abc.Mapping)):
            return _Container(type(leaf), tuple(leaf), [lift(v) for v in leaf.values()])
        if isinstance(leaf, (list, tuple)):
            return _Container(type(leaf), None, [lift(v) for v in leaf])
        if not isinstance(leaf, torch.Tensor) and _registered_by_its_library(leaf):
            return lift(leaf)
        return leaf
    return pytree.tree_map(one, x)


def flatten(x: Any) -> tuple:
    """``(leaves, spec)`` of ``x``, walking container subclasses ([Note: container subclasses]).

    ``torch.utils._pytree.tree_unflatten(leaves, spec)`` rebuilds ``x``'s structure, each
    container with its own type.

    Example:
        >>> import collections
        >>> class Out(collections.OrderedDict): pass
        >>> leaves, spec = flatten(Out(a=torch.zeros(1), b=2))
        >>> type(pytree.tree_unflatten([torch.ones(1), 2], spec)).__name__
        'Out'
    """
    return pytree.tree_flatten(lift(x))


def unrebuildable(lifted: Any) -> Optional[tuple]:
    """``(type name, why)`` of the first container subclass in ``lifted`` (a :func:`lift`
    result) that cannot be built again from its own items as PopTorch builds it; None when
    every one can."""
    pending = [lifted]
    while pending:
        leaves, _ = pytree.tree_flatten(pending.pop(), is_leaf=lambda n: isinstance(n, _Container))
        for node in (n for n in leaves if isinstance(n, _Container)):
            pending.extend(node.children)
            try:
                again = _rebuild(node.children, (node.kind, node.keys))
            except Exception as exc:  # a subclass whose constructor takes something else
                return describe_type(node.kind), f"{type(exc).__name__}: {exc}"
            same = (tuple(again) == node.keys if node.keys is not None
                    else len(again) == len(node.children))
            if type(again) is not node.kind or not same:
                return describe_type(node.kind), "it comes back with other items"
    return None


def tensor_holder(leaf: Any, _seen: Optional[set] = None) -> bool:
    """Whether ``leaf``, a non-tensor pytree leaf, holds a tensor that flattening cannot reach."""
    seen = set() if _seen is None else _seen
    if isinstance(leaf, torch.Tensor):
        return True
    if id(leaf) in seen or isinstance(leaf, (str, bytes, int, float, complex, bool, type(None),
                                             type, torch.dtype, torch.device)):
        return False
    seen.add(id(leaf))
    if isinstance(leaf, (set, frozenset, list, tuple)):
        children = list(leaf)
    elif isinstance(leaf, dict):
        children = list(leaf.values())
    elif dataclasses.is_dataclass(leaf):
        children = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    elif isinstance(leaf, torch.nn.Module) or callable(leaf):
        return False  # a module or function returned as is: its tensors are weights, not outputs
    else:
        children = list(getattr(leaf, "__dict__", {}).values())
        children += [getattr(leaf, s, None) for s in getattr(type(leaf), "__slots__", ())
                     if isinstance(s, str)]
    return any(tensor_holder(c, seen) for c in children)


def describe_type(kind: type) -> str:
    """``module.QualName`` of a type, for messages."""
    return f"{kind.__module__}.{kind.__qualname__}"
