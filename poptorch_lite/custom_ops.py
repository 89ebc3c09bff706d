"""Custom ops: PopTorch's ``custom_op``, run by implementations registered in Python.

[Note: custom ops]
PopTorch's ``custom_op(inputs, name, domain, domain_version, example_outputs, attributes)``
runs a PopART op that the program built in C++ and loaded from a ``.so`` (``ctypes``); the
example outputs only give the outputs' shapes and types. On stock PyTorch an op is a Python
implementation registered under its domain and name (and, optionally, its version):

    @poptorch.register_custom_op("Cube", "com.acme")
    def cube(x, bias, **attributes):
        return x ** 3 + bias, x ** 3

``custom_op`` finds it (the exact version first, then one registered for any version),
calls ``implementation(*inputs, **attributes)`` and returns its outputs as a list, after
checking that they are as many as the example outputs, with their shapes and dtypes; the
attributes are checked as PopTorch checks them. The op is exact when its implementation is:
in a wrapped model it is traced like any other code of the forward, so it runs in every
stage, schedule, replica and compiled mode, and its gradient is autograd's through the
implementation's torch ops, or its own where the implementation is a
``torch.autograd.Function``'s ``apply`` (traced as such: ``compiler/grad_semantics``). Outside
a wrapped model it computes the same numbers, so a program's CPU reference matches.

An op nobody registered is refused when the forward reaches it (while tracing: before any
state changes), naming the op, the domain, the version, what the domain has, and how to
register one. The ops Graphcore's applications call are registered from the start
(``graphcore_ops.SHIPPED``); a program may register its own under the same name to replace one.

A program loads its op library before it calls ``custom_op``
(``ctypes.cdll.LoadLibrary("./custom_ops.so")``), and the library exists only where the
program's C++ was built against PopART. ``poptorch-lite run --without-op-libraries
script.py`` runs such a program unchanged where it was not built: a ``LoadLibrary`` of a
file that does not exist returns a :class:`MissingLibrary` (one warning per path) instead of
raising ``OSError``, and the ops run from their registrations. Nothing is silent: the
warning names the path, and a program that calls a function of the missing library itself
gets an error that says which one and why.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional, Sequence

import torch

from .errors import CustomOpError, PoptorchLiteWarning, warn_once
from .graphcore_ops import SHIPPED

_REGISTRY: dict = {}  # (domain, name, version or None) -> implementation
_ATTRIBUTE_TYPES = (float, int, str)


def register_custom_op(name: str, domain: str, implementation: Optional[Callable] = None,
                       domain_version: Optional[int] = None):
    """Register ``implementation(*inputs, **attributes)`` as the custom op ``name`` of
    ``domain`` ([Note: custom ops]); without ``implementation``, a decorator. It returns a
    tensor or a sequence of tensors. ``domain_version``: the version it implements (None:
    every version not registered on its own). A later registration replaces an earlier one.

    Raises:
        CustomOpError: ``name`` or ``domain`` not a string, or ``implementation`` not callable.

    Example:
        >>> @register_custom_op("Twice", "com.example")
        ... def twice(x, **attributes):
        ...     return 2 * x
        >>> custom_op([torch.ones(2)], "Twice", "com.example", 1, [torch.ones(2)])
        [tensor([2., 2.])]
    """
    if not isinstance(name, str) or not isinstance(domain, str):
        raise CustomOpError(f"register_custom_op needs the op's name and domain as strings, got "
                            f"{name!r} and {domain!r}")
    if domain_version is not None and not isinstance(domain_version, int):
        raise CustomOpError(f"register_custom_op({name!r}, {domain!r}): domain_version must be an "
                            f"int or None (every version), got {domain_version!r}")

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise CustomOpError(f"register_custom_op({name!r}, {domain!r}) needs a callable "
                                f"implementation(*inputs, **attributes), got {fn!r}")
        _REGISTRY[domain, name, domain_version] = fn
        return fn
    return register if implementation is None else register(implementation)


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor], attributes: Optional[dict] = None) -> list:
    """PopTorch's ``custom_op``: the outputs of the op ``name`` of ``domain`` on ``inputs``, as a
    list shaped like ``example_outputs`` ([Note: custom ops]).

    Raises:
        CustomOpError: no implementation is registered; the inputs or example outputs are not
            tensors; an attribute is not as PopTorch allows; the implementation returned
            outputs other than the example outputs describe.

    Example:
        >>> x = torch.tensor([1.0, -2.0])
        >>> custom_op([x], "CopyTensor", "ai.graphcore", 1, example_outputs=[x])
        [tensor([ 1., -2.])]
    """
    what = f"custom_op {name!r} of domain {domain!r} (version {domain_version})"
    inputs = _tensors(inputs, "inputs", what)
    examples = _tensors(example_outputs, "example_outputs", what)
    attributes = dict(attributes or {})
    _check_attributes(attributes, what)
    fn = _REGISTRY.get((domain, name, domain_version)) or _REGISTRY.get((domain, name, None))
    if fn is None:
        raise CustomOpError(_unregistered(name, domain, domain_version))
    got = fn(*inputs, **attributes)
    outputs = [got] if isinstance(got, torch.Tensor) else list(got)
    if len(outputs) != len(examples) or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise CustomOpError(
            f"{what} returned {_described(outputs)} where example_outputs describe "
            f"{len(examples)} tensor(s): its implementation {_named(fn)} must return one tensor "
            f"per example output")
    for k, (out, example) in enumerate(zip(outputs, examples)):
        if out.shape != example.shape or out.dtype != example.dtype:
            raise CustomOpError(
                f"{what}: output {k} is {tuple(out.shape)} {out.dtype}, but example output {k} "
                f"is {tuple(example.shape)} {example.dtype}; PopTorch gives each output its "
                f"example's shape and type, so make {_named(fn)} return that")
    return outputs


def registered() -> list:
    """``(domain, name, version)`` of every registered op (version None: any), sorted."""
    return sorted(_REGISTRY, key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))


def _tensors(values, argument: str, what: str) -> list:
    values = [values] if isinstance(values, torch.Tensor) else values
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, torch.Tensor) for v in values):
        raise CustomOpError(f"{what}: {argument} must be a list or tuple of tensors, got "
                            f"{_described(values)}")
    return list(values)


def _check_attributes(attributes: dict, what: str) -> None:
    """PopTorch's rules: string keys; values a float, int or string, or a list or tuple of one
    of those types; ASCII only (PopART takes them as C++ strings)."""
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise CustomOpError(f"{what}: attribute keys must be strings, got {key!r}")
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, _ATTRIBUTE_TYPES) for v in items) or (
                isinstance(value, (list, tuple)) and len({type(v) for v in items}) > 1):
            raise CustomOpError(
                f"{what}: attribute {key!r} is {value!r}; an attribute is a float, an int or a "
                f"string, or a list or tuple of values of one of those types")
        for text in (key, *(v for v in items if isinstance(v, str))):
            if not text.isascii():
                raise CustomOpError(f"{what}: attribute {key!r}: {text!r} contains non-ASCII "
                                    f"characters, which PopART's attributes cannot hold")


def _unregistered(name: str, domain: str, version: int) -> str:
    same = [f"{n} (version {'any' if v is None else v})" for d, n, v in registered()
            if d == domain]
    return (f"no implementation of custom op {name!r} of domain {domain!r} (version {version}) "
            f"is registered; poptorch_lite runs custom ops from Python, not from the PopART "
            f"library the program loads, and domain {domain!r} has "
            f"{', '.join(same) if same else 'none'}. Register one before the model runs: "
            f"poptorch.register_custom_op({name!r}, {domain!r}, fn), with fn(*inputs, "
            f"**attributes) returning one tensor per example output")


def _described(values) -> str:
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(type(v).__name__ if not isinstance(v, torch.Tensor)
                               else f"tensor {tuple(v.shape)}" for v in values) + "]"
    return type(values).__name__


def _named(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class MissingLibrary:
    """What ``ctypes.cdll.LoadLibrary`` returns for a library that was not built, under
    ``poptorch-lite run --without-op-libraries`` ([Note: custom ops]): any function read from
    it raises, naming the library."""

    def __init__(self, path: str):
        self._name = path

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise CustomOpError(
            f"{name} is a function of {self._name}, which does not exist (the program's C++ was "
            f"not built) and which poptorch-lite run --without-op-libraries stood in for: only "
            f"custom ops, run from their Python registrations, work without it. Build the "
            f"library, or run without the flag")

    def __repr__(self) -> str:
        return f"<MissingLibrary {self._name!r}>"


def stand_in_for_missing_libraries() -> None:
    """Make ``ctypes.cdll.LoadLibrary`` of a file that does not exist return a
    :class:`MissingLibrary`, with one warning per path; other failures raise as before."""
    load = ctypes.cdll.LoadLibrary

    def load_library(name):
        try:
            return load(name)
        except OSError:
            if not isinstance(name, (str, os.PathLike)) or os.path.exists(name):
                raise
            warn_once(f"custom_ops.missing:{name}",
                      f"ctypes.cdll.LoadLibrary({str(name)!r}): no such file; poptorch-lite run "
                      f"--without-op-libraries stands in for it, and its custom ops run from "
                      f"their Python registrations (poptorch.register_custom_op)",
                      PoptorchLiteWarning)
            return MissingLibrary(str(name))
    ctypes.cdll.LoadLibrary = load_library


_REGISTRY.update(SHIPPED)
