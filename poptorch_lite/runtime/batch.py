"""Micro-batch splitting: a call's combined batch into its micro-batches.

``merge`` is the other end.

[Note: batch layout]
One call's combined batch holds ``F = D·(R/g)·G`` micro-batches laid out as
PopART does on the host, ``[D, G, R, B, ...]``: micro-batch ``k`` belongs to
device iteration ``d = k // (G·R)``, accumulation step ``(k // R) % G`` and
replica ``r = k % R``; its rows are ``k·B .. (k+1)·B``. Every output with a
batch dimension comes back in the same order. ``options.combined_batch_size``
is the one function that computes the combined batch.

[Note: synthetic data]
``Options.enableSyntheticData(True)`` (PopART's ``syntheticDataMode`` 2, RandomNormal) or
``_Popart.set("syntheticDataMode", 1)`` (Zeros) benchmark a model without host I/O: PopART
streams no input and fills each input tensor of a micro-batch once, when the program is
built, with zeros or with draws of a normal(0, 1) generator seeded afresh per tensor,
converted to the tensor's type (popart ``Ir::prepare``). So every micro-batch of every
call sees the same data, of the shapes and types of the first call's inputs, and the
host's values are not read. Here each tensor leaf of a call is replaced the same way: its
micro-batch shape filled with zeros, or with ``torch.randn`` from a generator seeded 0,
and repeated for every micro-batch. Integer and bool inputs (labels, token ids, masks) get
zeros in both modes: a random-normal integer would be a negative index, which an IPU reads
silently and PyTorch refuses. The option warns once that the numbers differ from the
inputs'.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from ..compiler import structures
from ..compiler.casting import ambient_autocast
from ..enums import SyntheticDataMode
from ..errors import BatchSizeError, InputError, warn_once, PoptorchLiteWarning

_SCALARS = (bool, int, float, complex, str, type(None))
# What a call's checks map over its arguments, in C: a call's setup runs cold, and a
# generator expression is a Python frame ([Note: one setup per call] in ``plan``).
_TENSOR_TYPE = frozenset((torch.Tensor,))
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class MicroBatches:
    """A call's arguments, cut into micro-batches along dim 0 ([Note: batch layout]).

    Tensor leaves of ``(args, kwargs)`` (tuples, lists, dicts, nested) are cut
    into ``factor`` equal views; a 0-dim tensor goes whole to every micro-batch.
    Python scalars, strings and None pass through unchanged as constants.

    Args:
        args, kwargs: the call's arguments.
        factor: ``D·(R/g)·G``, the number of micro-batches.
        explain: what spells out the factor's arithmetic, called only for an error message
            (a call's f-string of options cost as much as a small model's whole tax).
        synthetic: what replaces the tensors' values ([Note: synthetic data]).

    Raises:
        InputError: an argument that should be a tensor is not (a numpy array,
            a list of numbers).
        BatchSizeError: a tensor's batch dimension is not a multiple of ``factor``.

    Example:
        >>> mb = MicroBatches((torch.arange(6.0),), {}, 3, lambda: "3")
        >>> mb.args_kwargs(1)[0][0]
        tensor([2., 3.])
    """

    __slots__ = ("factor", "spec", "_spec_text", "leaves", "tensor_positions")  # one a call

    def __init__(self, args: tuple, kwargs: dict, factor: int, explain: Callable[[], str],
                 synthetic: SyntheticDataMode = SyntheticDataMode.Off):
        self.factor = factor
        if not kwargs and _TENSOR_TYPE.issuperset(map(type, args)):  # the common call
            self.spec, self._spec_text = _tensors_spec(len(args))
            for t in args:
                if t.shape[0] % factor if t.dim() else False:
                    raise _batch_size_error(t, factor, explain)
            leaves = list(args)
            positions = list(range(len(leaves)))
        else:
            _check_number_lists(list(args) + list(kwargs.values()))
            lifted = structures.lift((tuple(args), dict(kwargs)))
            leaves, self.spec = pytree.tree_flatten(lifted)
            self._spec_text = None
            broken = structures.unrebuildable(lifted)
            if broken is not None:
                raise InputError(
                    f"an input is a {broken[0]}, which cannot be built again from its items "
                    f"({broken[1]}): each micro-batch gets it rebuilt as PopTorch does, "
                    f"type(x)({{key: value}}) for a dict subclass and type(x)(items) for a list "
                    f"or tuple subclass. Give it a constructor that takes that, or pass a plain "
                    f"dict")
            for leaf in leaves:
                _check_leaf(leaf)
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] % factor:
                    raise _batch_size_error(leaf, factor, explain)
            positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        if any(map(_REQUIRES_GRAD, map(leaves.__getitem__, positions))):
            warn_once("input.requires_grad",
                      "Input tensor has requires_grad=True set. This tensor will be detached "
                      "because backward pass via inputs is not supported.",
                      PoptorchLiteWarning)
            leaves = [v.detach() if isinstance(v, torch.Tensor) else v for v in leaves]
        if synthetic is not SyntheticDataMode.Off:
            leaves = [_synthetic(v, factor, synthetic) if isinstance(v, torch.Tensor) else v
                      for v in leaves]
        self.leaves = leaves
        self.tensor_positions = positions

    def tensors(self, k: int) -> list:
        """The tensor leaves of micro-batch ``k`` (views into the call's tensors)."""
        return [_slice(self.leaves[p], k, self.factor) for p in self.tensor_positions]

    def all_tensors(self) -> list:
        """The tensor leaves of every micro-batch, as ``tensors(k)`` for each k (one split per
        leaf instead of one slice per leaf and micro-batch).

        Example:
            >>> mb = MicroBatches((torch.arange(4.0), torch.tensor(5.0)), {}, 2, lambda: "2")
            >>> mb.all_tensors()
            [[tensor([0., 1.]), tensor(5.)], [tensor([2., 3.]), tensor(5.)]]
        """
        if self.factor == 1:  # the call is its one micro-batch
            return [list(map(self.leaves.__getitem__, self.tensor_positions))]
        parts = [[t] * self.factor if t.dim() == 0 else t.split(t.shape[0] // self.factor)
                 for t in (self.leaves[p] for p in self.tensor_positions)]
        return [list(mb) for mb in zip(*parts)] if parts else [[] for _ in range(self.factor)]

    def args_kwargs(self, k: int) -> tuple:
        """Micro-batch ``k`` as ``(args, kwargs)``, shaped like the call's arguments."""
        leaves = list(self.leaves)
        for p, t in zip(self.tensor_positions, self.tensors(k)):
            leaves[p] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def signature(self) -> tuple:
        """What a traced graph is specialised on: structure, constants, micro-batch shapes,
        and the autocast the call is made under ([Note: autocast around a call] in
        ``compiler/casting``)."""
        parts: list = [self._spec_text or str(self.spec)]
        for k, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):  # a micro-batch's shape, without slicing one
                shape = (leaf.shape[0] // self.factor, *leaf.shape[1:]) if leaf.dim() else ()
                parts.append((shape, leaf.dtype, leaf.device))
            else:
                parts.append(("const", type(leaf).__name__, repr(leaf)))
        autocast = ambient_autocast()
        if autocast:
            parts.append(("autocast", autocast))
        return tuple(parts)


def recompile_note(training: bool, old: tuple, new: tuple) -> str:
    """The log line of a call whose signature no compiled program has.

    [Note: a new signature compiles]
    PopTorch compiles a model for the first call's input signature (the arguments' structure,
    their shapes and dtypes) and refuses a later call that differs until ``destroy()``.
    poptorch_lite compiles again instead and keeps every program, since a trace costs
    seconds, not an IPU compile's minutes, and a smaller last batch or another sequence
    length is common off an IPU. So that the difference never goes unseen, each new
    signature logs one warning on the ``poptorch_lite`` logger saying what changed.
    """
    kind = "trainingModel" if training else "inferenceModel"
    inputs = _without_autocast(old)[0] != _without_autocast(new)[0]
    return (f"{kind}: a call whose {'input signature' if inputs else 'autocast'} differs from "
            f"the compiled one ({signature_change(old, new)}) compiles again and keeps both "
            f"programs; PopTorch would " + ("refuse it until destroy()" if inputs else
                                          "run the program it compiled first"))


def _without_autocast(signature: tuple) -> tuple:
    """``(signature without its autocast part, the autocast part's state or ())``."""
    last = signature[-1] if len(signature) > 1 else None
    if type(last) is tuple and len(last) == 2 and last[0] == "autocast":
        return signature[:-1], last[1]
    return signature, ()


def _shown_autocast(state: tuple) -> str:
    return ", ".join(f"{d} {str(t).replace('torch.', '')}" for d, t in state) or "off"


def signature_change(old: tuple, new: tuple) -> str:
    """What differs between two :meth:`MicroBatches.signature` values, for the log line of a
    recompile: the arguments' structure, or each leaf whose shape, dtype, device or value did,
    and the autocast around the call.

    Example:
        >>> a = ("spec", ((2, 4), torch.float32, torch.device("cpu")))
        >>> signature_change(a, ("spec", ((3, 4), torch.float32, torch.device("cpu"))))
        'argument leaf 0: shape (2, 4) -> (3, 4)'
    """
    (old, old_cast), (new, new_cast) = _without_autocast(old), _without_autocast(new)
    changes = [] if old_cast == new_cast else [
        f"autocast: {_shown_autocast(old_cast)} -> {_shown_autocast(new_cast)}"]
    if old[0] != new[0] or len(old) != len(new):
        return "; ".join([f"the arguments' structure: {old[0]} -> {new[0]}", *changes])
    for k, (a, b) in enumerate(zip(old[1:], new[1:])):
        if a == b:
            continue
        if a[0] == "const" or b[0] == "const":
            changes.append(f"argument leaf {k}: {a[-1] if a[0] == 'const' else 'a tensor'} -> "
                           f"{b[-1] if b[0] == 'const' else 'a tensor'}")
            continue
        what = [f"{name} {x} -> {y}" for name, x, y in zip(("shape", "dtype", "device"), a, b)
                if x != y]
        changes.append(f"argument leaf {k}: " + ", ".join(what))
    return "; ".join(changes)


_TENSORS_SPECS: dict = {}  # n -> the spec of the arguments (t_1, ..., t_n), no kwargs, and its text


def _tensors_spec(n: int) -> tuple:
    """The tree spec of a call with ``n`` tensor arguments and no keywords, and its text:
    the same for every such call, so worked out once (a call's flattening of plain tensors
    took 30 µs, a sixth of a small model's tax; docs/PERFORMANCE.md (h)).

    Example:
        >>> spec, text = _tensors_spec(2)
        >>> spec == pytree.tree_flatten(((torch.ones(1), torch.ones(1)), {}))[1]
        True
    """
    got = _TENSORS_SPECS.get(n)
    if got is None:
        spec = pytree.tree_flatten((tuple(range(n)), {}))[1]
        got = _TENSORS_SPECS[n] = (spec, str(spec))
    return got


def _batch_size_error(t: torch.Tensor, factor: int,
                      explain: Callable[[], str]) -> BatchSizeError:
    return BatchSizeError(
        f"Invalid batch dimension: In the input {tuple(t.shape)}, the batch dimension "
        f"({t.shape[0]}) must be a multiple of {explain()} = {factor}, because one call runs "
        f"that many micro-batches; pass a batch of micro_batch_size * {factor} rows "
        f"(poptorch_lite.DataLoader(options, ...) yields such batches)")


def _check_leaf(leaf: Any) -> None:
    if isinstance(leaf, (torch.Tensor,) + _SCALARS):
        return
    kind = type(leaf).__module__ + "." + type(leaf).__name__
    if type(leaf).__module__ == "numpy" or hasattr(leaf, "__array__"):
        raise InputError(f"an input is a {kind} where a tensor is needed; convert it with "
                         f"torch.from_numpy(...) or torch.as_tensor(...)")
    raise InputError(f"an input is a {kind} where a tensor is needed; pass tensors (in tuples, "
                     f"lists or dicts) or Python scalars")


def _synthetic(t: torch.Tensor, factor: int, mode: SyntheticDataMode) -> torch.Tensor:
    """``t``'s stand-in: each micro-batch zeros or the same normal draws ([Note: synthetic data])."""
    one = t.shape if t.dim() == 0 else (t.shape[0] // factor, *t.shape[1:])
    if mode == SyntheticDataMode.RandomNormal and t.is_floating_point():
        data = torch.randn(one, generator=torch.Generator().manual_seed(0)).to(t.dtype)
    else:
        data = torch.zeros(one, dtype=t.dtype)
    data = data.to(t.device)
    return data if t.dim() == 0 else data.repeat(factor, *[1] * (t.dim() - 1))


def _slice(t: torch.Tensor, k: int, factor: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    b = t.shape[0] // factor
    return t[k * b:(k + 1) * b]


def _check_number_lists(values: Sequence) -> None:
    """Refuse lists of plain numbers as inputs (they would be frozen into the graph)."""
    for v in values:
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            raise InputError(f"an input is a {type(v).__name__} of numbers where a tensor is "
                             f"needed; pass torch.tensor({v!r})")
