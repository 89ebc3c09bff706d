"""Annotations: blocks, stages' building bricks, and recomputation checkpoints.

Annotations only record data. Outside a wrapped model they do nothing at all
(an annotated model runs natively as plain PyTorch). While a wrapper traces the
model ([Note: trace context] in ``compiler/markers.py``) they leave marker nodes
in the graph (``poptorch_lite.compiler.markers``) from which the partition reads
which block every op belongs to.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch

from .compiler import markers
from .compiler.markers import _current, is_tracing, trace_context
from .errors import BlockError, InputError


def _resolve_id(user_id: Optional[str]) -> str:
    state = _current()
    if user_id is None:
        user_id = str(state.next_auto_id)
        state.next_auto_id += 1
    return str(user_id)


def _begin(user_id: Optional[str], ipu_id: Optional[int]) -> None:
    if is_tracing():
        uid = _resolve_id(user_id)
        _current().current_block = uid
        markers.BEGIN_BLOCK(uid, -1 if ipu_id is None else int(ipu_id))


def _check_ids(user_id: Any, ipu_id: Any) -> None:
    if user_id is not None and (isinstance(user_id, bool) or not isinstance(user_id, (str, int))):
        raise BlockError(f"a block's user_id must be a str (or an int, as PopTorch allows), "
                         f"got {user_id!r}; write user_id=\"{user_id}\"")
    if ipu_id is not None and (isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0):
        raise BlockError(f"a block's ipu_id must be a non-negative int, got {ipu_id!r}; "
                         f"write e.g. ipu_id=0, or leave it None")


class _BlockHook:
    """The forward pre-hook that BeginBlock registers (a class, so copies keep it)."""

    def __init__(self, user_id: Optional[str], ipu_id: Optional[int]):
        self.user_id, self.ipu_id = user_id, ipu_id

    def __call__(self, module, inputs):
        _begin(self.user_id, self.ipu_id)

    def __repr__(self):  # PopTorch's, which module_repr shows
        return f"BeginBlock(user_id={self.user_id}, ipu_id={self.ipu_id})"


class BlockStart(torch.nn.Module):
    """A function that starts a block when called: what ``BeginBlock(function)`` returns, a
    module (so it can be saved, as PopTorch's ``LegacyBeginBlockFn`` can).

    Example:
        >>> double = BlockStart(torch.nn.functional.relu, "B1", 1)
        >>> double._user_id, double._ipu_id
        ('B1', 1)
    """

    def __init__(self, layer_to_call: Callable, user_id=None, ipu_id: Optional[int] = None):
        super().__init__()
        self._layer_to_call, self._user_id, self._ipu_id = layer_to_call, user_id, ipu_id

    def forward(self, *args, **kwargs):
        _begin(self._user_id, self._ipu_id)
        return self._layer_to_call(*args, **kwargs)


def BeginBlock(layer_to_call, user_id: Optional[str] = None, ipu_id: Optional[int] = None):
    """Start a block at ``module``: it and everything run after it belong to the block.

    Layers after a BeginBlock inherit its block until the next one starts; ops
    before the first block run on IPU 0.

    Args:
        layer_to_call: an ``nn.Module`` (returned unchanged, parameter names intact),
            or a plain callable (returned as a :class:`BlockStart` module that starts the
            block and calls it); PopTorch's keyword name.
        user_id: the block's name (``Stage`` refers to it; an int is its str); auto-numbered
            if None.
        ipu_id: the IPU the block runs on.

    Raises:
        BlockError: the module already starts a block, or ``module`` is neither
            a module nor callable.

    Example:
        >>> import torch
        >>> layer = BeginBlock(torch.nn.Linear(2, 2), "B1", ipu_id=1)
    """
    _check_ids(user_id, ipu_id)
    module = layer_to_call
    if isinstance(module, torch.nn.Module):
        if block_of(module) is not None:
            raise BlockError(f"module {type(module).__name__} has already been assigned to a "
                             f"block ({block_of(module)!r}); call removeBlocks(module) first")
        module.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
        return module
    if callable(module):
        return BlockStart(module, user_id, ipu_id)
    raise BlockError(f"BeginBlock needs an nn.Module or a callable, got {type(module).__name__}")


def block_of(module: torch.nn.Module) -> Optional[_BlockHook]:
    """The BeginBlock annotation on ``module`` itself, or None."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _BlockHook):
            return hook
    return None


def module_repr(m: torch.nn.Module) -> str:
    """``repr(m)`` with the BeginBlock annotations shown before the modules they start, as
    PopTorch's ``module_repr`` shows them (``torch``'s repr leaves forward pre-hooks out).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.ReLU(), BeginBlock(torch.nn.ReLU(), "B1", 1))
        >>> print(module_repr(net))
        Sequential(
          (0): ReLU()
          (1): BeginBlock(user_id=B1, ipu_id=1) ReLU()
        )
    """
    lines = m.extra_repr().split("\n") if m.extra_repr() else []
    children = [f"({name}): " + module_repr(child).replace("\n", "\n  ")
                for name, child in m._modules.items()]
    hooks = "".join(f"{hook!r} " for hook in m._forward_pre_hooks.values()
                    if isinstance(hook, _BlockHook))
    inner = ""
    if len(lines) == 1 and not children:
        inner = lines[0]
    elif lines or children:
        inner = "\n  " + "\n  ".join(lines + children) + "\n"
    return f"{hooks}{m._get_name()}({inner})"


def removeBlocks(module: torch.nn.Module) -> torch.nn.Module:
    """Remove every BeginBlock annotation from ``module`` and its children."""
    for m in module.modules():
        for key, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, _BlockHook):
                del m._forward_pre_hooks[key]
    return module


class Block(contextlib.ContextDecorator):
    """A scope inside ``forward`` whose ops belong to one block.

    After the scope closes no block is active: an op there is refused ("No active
    Block") until the next block starts. Blocks with the same ``user_id`` are one
    block (re-entering one is allowed).

    Example:
        >>> import torch
        >>> def forward(x):
        ...     with Block("B0", ipu_id=0):
        ...         x = x * 2
        ...     with Block("B1", ipu_id=1):
        ...         return x + 1
        >>> forward(torch.ones(1))
        tensor([3.])
    """

    def __init__(self, user_id: Optional[str] = None, ipu_id: Optional[int] = None):
        _check_ids(user_id, ipu_id)
        self.user_id, self.ipu_id = user_id, ipu_id

    def __enter__(self):
        _begin(self.user_id, self.ipu_id)
        return self

    def __exit__(self, *exc):
        if is_tracing():
            _current().current_block = None
            markers.END_BLOCK()
        return False

    @staticmethod
    def start(user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        """Start a block without a scope: it lasts until the next block starts."""
        _check_ids(user_id, ipu_id)
        _begin(user_id, ipu_id)

    @staticmethod
    def useAutoId() -> None:
        """Number id-less blocks "0", "1", ... from here (each trace restarts at 0)."""
        _current().next_auto_id = 0


def BlockFunction(user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> Callable:
    """Decorator: the function's body runs inside ``with Block(user_id, ipu_id)``.

    Example:
        >>> @BlockFunction("B0", ipu_id=0)
        ... def double(x):
        ...     return x * 2
    """
    _check_ids(user_id, ipu_id)

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return fn(*args, **kwargs)
        return wrapper
    return decorate


def recomputationCheckpoint(*tensors):
    """Mark values to keep rather than recompute; returns its inputs.

    One tensor returns the tensor, several a tuple, one list or tuple argument
    the same container. Recomputation itself comes with pipelined execution;
    the mark never changes results.

    Raises:
        InputError: an input is not a tensor ("All inputs must be tensors").

    Example:
        >>> import torch
        >>> recomputationCheckpoint(torch.ones(2))
        tensor([1., 1.])
    """
    container = None
    items = tensors
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        container, items = type(tensors[0]), tuple(tensors[0])
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise InputError(f"All inputs must be tensors: recomputationCheckpoint got "
                             f"{type(t).__name__}; pass the tensors to keep")
    if is_tracing():
        for t in items:
            markers.MARK_CHECKPOINT(t)
    if container is not None:
        return container(items)
    return items[0] if len(items) == 1 else tuple(items)
