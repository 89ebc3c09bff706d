"""PopTorch's custom argument parsers: a user type in a call's arguments, as its tensors.

A model's inputs may be objects of the user's own types (a batch class holding tensors).
PopTorch learns their tensors from an :class:`ICustomArgParser` registered for the type;
here ``registerCustomArgParser`` registers the type with torch's pytree, which is how
``MicroBatches`` finds the tensors to cut into micro-batches and rebuilds each micro-batch's
object (``reconstruct`` from the call's own object, its tensors replaced).
"""

from __future__ import annotations

import abc
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from .errors import InputError

__all__ = ["ICustomArgParser", "registerCustomArgParser"]


class ICustomArgParser(abc.ABC):
    """How to find the tensors in an object of a custom type, and rebuild it.

    Example:
        >>> class Pair:
        ...     def __init__(self, a, b): self.a, self.b = a, b
        >>> class PairParser(ICustomArgParser):
        ...     def yieldTensors(self, struct): yield struct.a; yield struct.b
        ...     def reconstruct(self, original, tensors): return Pair(next(tensors), next(tensors))
        >>> registerCustomArgParser(Pair, PairParser())
        >>> pytree.tree_flatten(Pair(torch.zeros(1), torch.ones(1)))[0]
        [tensor([0.]), tensor([1.])]
    """

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:  # noqa: N802 (PopTorch's)
        """Yield the tensors of ``struct``, in a fixed order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any, tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """An object like ``original_structure`` holding the tensors ``tensor_iterator``
        yields, in :meth:`yieldTensors`' order."""


class _Original:
    """A flattened object, kept to rebuild it; it reads as its type in a tree spec, so calls
    with objects of one type share a traced graph."""

    def __init__(self, struct: Any):
        self.struct = struct

    def __repr__(self) -> str:
        return type(self.struct).__qualname__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Original) and type(other.struct) is type(self.struct)

    def __hash__(self) -> int:
        return hash(type(self.struct))


def registerCustomArgParser(arg_type: type, parser: ICustomArgParser) -> None:  # noqa: N802
    """Use ``parser`` for the arguments of type ``arg_type`` (PopTorch's registration).

    Raises:
        InputError: ``parser`` is not an :class:`ICustomArgParser`, or ``arg_type`` is no type.
    """
    if not isinstance(parser, ICustomArgParser) or not isinstance(arg_type, type):
        raise InputError(f"registerCustomArgParser needs a type and an ICustomArgParser, got "
                         f"{arg_type!r} and {type(parser).__name__}; subclass "
                         f"poptorch.ICustomArgParser and pass "
                         f"registerCustomArgParser(Type, Parser())")

    def flatten(struct):
        return list(parser.yieldTensors(struct)), _Original(struct)

    def unflatten(values, context):
        return parser.reconstruct(context.struct, iter(values))

    if arg_type in pytree.SUPPORTED_NODES:  # PopTorch: a later parser replaces the earlier
        deregister = getattr(pytree, "_deregister_pytree_node", None)
        if deregister is not None:
            deregister(arg_type)
        else:
            pytree.SUPPORTED_NODES.pop(arg_type)
    pytree.register_pytree_node(arg_type, flatten, unflatten)
