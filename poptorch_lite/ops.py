"""PopTorch's ops: the loss marker, printing, and IPU-only ops as their plain meaning."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from .compiler import markers
from .compiler.markers import is_tracing
from .enums import MultiConvPlanType
from .errors import InputError, OptionsError, warn_once

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
        markers.mark_loss(out)
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


def for_loop(count: int, body: Callable, inputs: list) -> list:
    """PopTorch's on-device loop, as the loop it stands for: ``body`` runs ``count`` times,
    each run taking the previous one's outputs as its arguments. The inputs are cloned first
    (passed by value, as PopTorch's are); the trace unrolls the loop.

    Raises:
        InputError: ``inputs`` is not a list of tensors, or ``count`` not an int >= 0.

    Example:
        >>> for_loop(3, lambda x: x * 2, [torch.ones(1)])
        [tensor([8.])]
    """
    if not isinstance(inputs, list):
        raise InputError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                         "tensors. (Object is not list)")
    for k, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"poptorch.for_loop expects input tensors (inputs) to be a list of "
                             f"tensors. (Object contained in list at index {k} is not "
                             f"torch.tensor)")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InputError(f"poptorch.for_loop needs an int count >= 0, got {count!r}")
    values = [t.clone() for t in inputs]
    for _ in range(count):
        out = body(*values)
        values = list(out) if isinstance(out, (list, tuple)) else [out]
    return values


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


def ipuHardwareVersion() -> int:
    """2, as PopTorch returns on a Mk2 IPU system (scripts gate Mk2-only features on it).

    Example:
        >>> ipuHardwareVersion()
        2
    """
    return 2


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


class Attribute:
    """PopTorch's attributes for the ops run inside (outlining hints such as
    ``__outline={"layer": 3}``): IPU-only compiler hints, stored and ignored (one warning).

    Example:
        >>> with Attribute(__outline={"layer": 0}) as attribute:
        ...     y = torch.ones(2) * 2
        >>> attribute.attributes
        {'__outline': {'layer': 0}}
    """

    def __init__(self, **attributes):
        self.attributes = attributes

    def __enter__(self):
        warn_once("ops.Attribute", "poptorch.Attribute only passes hints (outlining, ...) to "
                                   "the IPU compiler; the ops inside run unchanged")
        return self

    def __exit__(self, *exc) -> None:
        return None


class MultiConv:
    """PopTorch's multi-convolution scope: the convolutions inside run as they are written
    (on an IPU they run in parallel as one multi-convolution, with the same results).

    The setters validate as PopTorch's do and return ``self`` for chaining; their values
    only tune the IPU (one warning).

    Example:
        >>> conv = torch.nn.Conv2d(1, 1, 3)
        >>> with MultiConv().availableMemoryProportions(0.5).planType(MultiConvPlanType.Serial):
        ...     y = conv(torch.ones(1, 1, 4, 4))
        >>> tuple(y.shape)
        (1, 1, 2, 2)
    """

    def __init__(self):
        self._available_memory_proportions = self._partials_types = self._plan_type = None
        self._per_conv_reserved_tiles = self._cycle_back_off = None
        self._enable_conv_ditherings = None

    @staticmethod
    def _per_conv(name: str, value, kind: type):
        if value is None or (isinstance(value, kind) and not isinstance(value, bool)) \
                or kind is bool and isinstance(value, bool):
            return value if value is None else (value,)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
            return tuple(value)
        raise OptionsError(f"MultiConv: invalid {name} {value!r}: pass one {kind.__name__} "
                           f"or a list of them, one per convolution")

    def availableMemoryProportions(self, value) -> "MultiConv":  # noqa: N802 (PopTorch's)
        """The available memory proportion per convolution (IPU-only)."""
        self._available_memory_proportions = self._per_conv("availableMemoryProportions",
                                                            value, float)
        return self

    def partialsTypes(self, value) -> "MultiConv":  # noqa: N802
        """The partials type per convolution: torch.float or torch.half (IPU-only)."""
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or any(v not in (torch.float32, torch.float16) for v in values):
            raise OptionsError(f"MultiConv: invalid partials types {value!r}: expecting "
                               f"torch.float or torch.half")
        self._partials_types = tuple(values)
        return self

    def enableConvDithering(self, value) -> "MultiConv":  # noqa: N802
        """Per-convolution dithering (IPU-only)."""
        self._enable_conv_ditherings = self._per_conv("enableConvDithering", value, bool)
        return self

    def planType(self, value) -> "MultiConv":  # noqa: N802
        """The multi-convolution plan, a ``MultiConvPlanType`` (IPU-only)."""
        if value is not None and not isinstance(value, MultiConvPlanType):
            raise OptionsError(f"MultiConv: invalid plan type {value!r}: pass a "
                               f"poptorch.MultiConvPlanType")
        self._plan_type = value
        return self

    def perConvReservedTiles(self, value: int) -> "MultiConv":  # noqa: N802
        """Tiles reserved per convolution (IPU-only)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise OptionsError(f"MultiConv: perConvReservedTiles needs an int, got {value!r}")
        self._per_conv_reserved_tiles = value
        return self

    def cycleBackOff(self, value: float) -> "MultiConv":  # noqa: N802
        """Cycle back-off proportion, between 0 and 1 (IPU-only)."""
        if not isinstance(value, float):
            raise OptionsError(f"MultiConv: cycleBackOff needs a float, got {value!r}")
        self._cycle_back_off = value
        return self

    def __enter__(self) -> None:  # PopTorch's returns None too
        warn_once("ops.MultiConv", "poptorch.MultiConv only groups convolutions for the IPU; "
                                   "they run one after another with the same results")

    def __exit__(self, *exc) -> None:
        return None
