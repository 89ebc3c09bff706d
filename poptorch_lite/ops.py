"""PopTorch's ops: the loss marker, printing, and IPU-only ops as their plain meaning."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from . import markers
from .annotations import is_tracing
from .errors import InputError, OptionsError, warn_once

# Every torch loss function: its output is a loss by provenance ([Note: loss provenance]).
LOSS_FUNCTIONS = frozenset(
    getattr(F, name) for name in dir(F)
    if name.endswith("_loss") or name in {"cross_entropy", "kl_div", "binary_cross_entropy",
                                           "binary_cross_entropy_with_logits"})

_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "none": None}


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` (reduced) as the model's loss.

    Backward sends a gradient of ones through ``x``, so ``reduction="none"``
    trains like ``x.sum()``. Outside a wrapper it just reduces.

    Args:
        x: the loss value(s).
        reduction: ``"sum"``, ``"mean"`` or ``"none"``.

    Raises:
        InputError: ``x`` is not a tensor.
        OptionsError: another reduction.

    Example:
        >>> identity_loss(torch.tensor([1.0, 3.0]), reduction="mean")
        tensor(2.)
    """
    if not isinstance(x, torch.Tensor):
        raise InputError(f"identity_loss needs a tensor, got {type(x).__name__} {x!r}; compute "
                         f"the loss with torch ops, or wrap a value with torch.as_tensor(...)")
    if reduction not in _REDUCTIONS:
        raise OptionsError(f"Unsupported reduction type {reduction!r} for identity_loss: "
                           f"use one of {sorted(_REDUCTIONS)}")
    reduce = _REDUCTIONS[reduction]
    out = x if reduce is None else reduce(x)
    if is_tracing():
        markers.MARK_LOSS(out)
    return out


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarize_threshold: int = 1000, edge_items: int = 3,
                     max_line_width: int = 80, digits: int = 4, float_format: str = "auto",
                     separator: str = " ", open_bracket: str = "(", close_bracket: str = ")"):
    """Print ``tensor`` every time the wrapped model runs; returns it.

    The formatting arguments are PopTorch's and are accepted; the value prints
    with torch's formatting. Gradients are not printed (``print_gradient`` is
    accepted and ignored with one warning).

    Example:
        >>> _ = ipu_print_tensor(torch.ones(1), "x=")
        x=tensor([1.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"ipu_print_tensor needs a tensor, got {type(tensor).__name__}; pass the "
                         f"tensor to print (torch.as_tensor(...) for other values)")
    if print_gradient and tensor.requires_grad:
        warn_once("ipu_print_tensor.print_gradient",
                  "ipu_print_tensor prints values only; gradients are not printed")
    markers.PRINT_TENSOR(tensor, title)
    return tensor


def isRunningOnIpu() -> bool:
    """True while a wrapped model is being traced or run, False in plain PyTorch."""
    return is_tracing()


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """Identity (PopTorch uses it to stop graph optimisations)."""
    return tensor


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float):
    """IPU-only tile-memory hint: returns ``tensor`` unchanged (one warning)."""
    warn_once("ops.set_available_memory", "set_available_memory only tunes IPU memory; ignored")
    return tensor


def serializedMatMul(lhs, rhs, mode=None, factor: int = 0, keep_precision: bool = False):
    """``lhs @ rhs``: the serialisation only saves IPU memory (one warning)."""
    warn_once("ops.serializedMatMul", "serializedMatMul's serialisation only saves IPU memory; "
                                      "computing a plain matmul")
    return torch.matmul(lhs, rhs)


def set_overlap_for_input(tensor, mode=None):
    """IPU-only I/O overlap hint: returns ``tensor`` unchanged (one warning)."""
    warn_once("ops.set_overlap_for_input", "set_overlap_for_input is IPU-only; ignored")
    return tensor


def set_overlap_for_output(tensor, mode=None):
    """IPU-only I/O overlap hint: returns ``tensor`` unchanged (one warning)."""
    warn_once("ops.set_overlap_for_output", "set_overlap_for_output is IPU-only; ignored")
    return tensor


@contextlib.contextmanager
def NameScope(name: str):
    """IPU op-naming scope: does nothing here."""
    yield


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Always True: poptorch_lite emulates any number of IPUs on torch devices."""
    return True


def ipuHardwareVersion() -> str:
    """The emulated IPU's version string."""
    return "poptorch_lite"


_LOG_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
               "ERR": logging.ERROR, "OFF": logging.CRITICAL + 10}


def setLogLevel(level) -> None:
    """Set the ``poptorch_lite`` logger's level (PopTorch's names or an int).

    Raises:
        OptionsError: an unknown level name.
    """
    if isinstance(level, str):
        if level not in _LOG_LEVELS:
            raise OptionsError(f"Unknown log level {level!r}: use one of {sorted(_LOG_LEVELS)}")
        level = _LOG_LEVELS[level]
    logging.getLogger("poptorch_lite").setLevel(int(level))
