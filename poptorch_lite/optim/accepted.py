"""The optimizers a wrapper takes, and what it reads of any of them.

torch's ``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` and PopTorch's (``optimizers``) are
accepted (:func:`check_optimizer`); of each the wrapper reads the loss scaling, the dtype
gradients accumulate in and the norm to clip to, and ``setOptimizer`` copies the
hyper-parameters of one into another (:func:`copy_hyperparameters`).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch

from .. import errors
from ..enums import MeanReductionStrategy
from ..errors import OptimizerError
from .extras import _EXTRAS, _global_value, _refuse_amsgrad
from .optimizers import LAMB, SGD, Adam, AdamW, RMSprop, _PopTorchOptimizer

__all__ = ["adopt", "check_optimizer", "loss_scaling", "accum_dtype", "max_grad_norm",
           "copy_hyperparameters", "needs_running_mean"]


_ACCEPTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
             SGD, Adam, AdamW, RMSprop, LAMB)
_KINDS = (LAMB, torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop)


def _kind(optimizer: Any) -> type | None:
    return next((kind for kind in _KINDS if isinstance(optimizer, kind)), None)


def check_optimizer(optimizer: Any) -> None:
    """Refuse what PopTorch refuses; warn once for a subclass of an accepted type.

    Args:
        optimizer: torch.optim's SGD, Adam, AdamW or RMSprop, or one of this module's.

    Raises:
        OptimizerError: another type, ``amsgrad=True``, RMSprop groups disagreeing on
            ``centered``, or param groups disagreeing on a global extra.

    Example:
        >>> check_optimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    """
    cls = type(optimizer)
    if cls not in _ACCEPTED:
        if _kind(optimizer) is None:
            names = [_public_name(c) for c in _ACCEPTED]
            raise OptimizerError(f"unsupported optimizer type {cls.__module__}.{cls.__qualname__}"
                                 f": use one of {names}")
        errors.warn_once(f"optim.subclass.{cls.__module__}.{cls.__qualname__}",
                         f"{cls.__qualname__} subclasses {_kind(optimizer).__qualname__}: only "
                         "the parent's update rule and hyper-parameters are known, so it is "
                         "unlikely to behave as intended", errors.PoptorchLiteWarning)
    _refuse_amsgrad(optimizer)
    centered = [group["centered"] for group in optimizer.param_groups if "centered" in group]
    if len(set(centered)) > 1:
        raise OptimizerError(f"RMSprop param groups must agree on centered, got {centered}; "
                             "use one value for every group")
    for name in getattr(optimizer, "_GLOBALS", ()):
        _global_value(optimizer, name)


def loss_scaling(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer's loss scaling: its ``loss_scaling``, 1.0 for torch's optimizers.

    Example:
        >>> loss_scaling(SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, loss_scaling=8))
        8.0
    """
    return optimizer.loss_scaling if isinstance(optimizer, _PopTorchOptimizer) else 1.0


def accum_dtype(optimizer: torch.optim.Optimizer) -> Optional[torch.dtype]:
    """The dtype gradients accumulate in: the optimizer's ``accum_type`` (PopTorch's
    "data type used for gradients"); None for torch's optimizers (the parameter's own).

    Example:
        >>> accum_dtype(SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
        torch.float32
    """
    dtype = getattr(optimizer, "accum_type", None) if isinstance(optimizer, _PopTorchOptimizer) \
        else None
    return dtype if isinstance(dtype, torch.dtype) else None


def needs_running_mean(optimizer: torch.optim.Optimizer) -> bool:
    """Whether PopTorch would set ``Training.meanAccumulationAndReplicationReductionStrategy``
    to ``Running`` for ``optimizer``: a float16 ``accum_type`` without the combined
    accumulator (POPTORCH_REFERENCE §2; the strategy only says when an IPU divides).

    Example:
        >>> needs_running_mean(SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1,
        ...                        accum_type=torch.float16))
        True
    """
    return accum_dtype(optimizer) == torch.float16 and not getattr(
        optimizer, "use_combined_accum", False)


def adopt(current: torch.optim.Optimizer, new: torch.optim.Optimizer, training_options,
          compiled: bool) -> torch.optim.Optimizer:
    """The optimizer a wrapper steps after ``setOptimizer(new)``: ``new`` itself when it
    carries state (a loaded state dict), else ``current`` with ``new``'s hyper-parameters, as
    PopTorch keeps the state. A float16 ``accum_type`` sets the Running strategy in
    ``training_options`` (the wrapper's own) as PopTorch does, refused once compiled.

    Raises:
        OptimizerError: ``new`` is not supported, or would change the strategy after the
            wrapper compiled (PopTorch's message).
    """
    check_optimizer(new)
    running = MeanReductionStrategy.Running  # checked on the same object too: its accum_type
    # may have been changed in place
    if needs_running_mean(new) and training_options.mean_reduction_strategy != running:
        if compiled:
            raise OptimizerError(
                "Invalid optimizer: the new optimizer would require changing options.Training."
                "meanAccumulationAndReplicationReductionStrategy to poptorch.MeanReductionStrategy"
                ".Running but the executable is already compiled.")
        training_options._store(mean_reduction_strategy=running)
    if new is current or len(new.state) > 0:
        return new
    copy_hyperparameters(new, current)
    return current


def max_grad_norm(optimizer: torch.optim.Optimizer) -> float:
    """The global gradient norm to clip to: inf (no clipping) unless one was given.

    Example:
        >>> max_grad_norm(torch.optim.Adam(torch.nn.Linear(2, 1).parameters()))
        inf
    """
    if "max_grad_norm" in getattr(optimizer, "_GLOBALS", ()):
        return optimizer.max_grad_norm
    return math.inf


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy every group's hyper-parameters and the global extras, keeping ``target.state``.

    PopTorch's ``setOptimizer`` rule: the new optimizer's hyper-parameters are used, the
    device optimizer's state (momenta, step counts) is kept. A global extra the source
    lacks (a torch optimizer has none) takes its default.

    Args:
        source: the optimizer whose hyper-parameters are wanted.
        target: the optimizer holding the state; updated in place.

    Raises:
        OptimizerError: different kinds of optimizer (SGD and Adam, say) or different
            numbers of param groups.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> device_opt = SGD(model.parameters(), lr=0.1)
        >>> copy_hyperparameters(SGD(model.parameters(), lr=0.01), device_opt)
        >>> device_opt.param_groups[0]["lr"]
        0.01
    """
    if _kind(source) is not _kind(target):
        raise OptimizerError(f"cannot copy hyper-parameters from {type(source).__qualname__} to "
                             f"{type(target).__qualname__}: they are different optimizers; pass "
                             "one of the same kind")
    if len(source.param_groups) != len(target.param_groups):
        raise OptimizerError(f"cannot copy hyper-parameters: the source has "
                             f"{len(source.param_groups)} param groups and the target "
                             f"{len(target.param_groups)}; give both the same param groups")
    skip = {"params", *_EXTRAS} - {"velocity_scaling"}  # globals: through their setters
    for src, dst in zip(source.param_groups, target.param_groups):
        dst.update({k: copy.deepcopy(v) for k, v in src.items() if k not in skip})
    target.defaults.update({k: copy.deepcopy(v) for k, v in source.defaults.items()
                            if k not in skip})
    for name in getattr(target, "_GLOBALS", ()):
        known = name in getattr(source, "_GLOBALS", ())
        setattr(target, name, getattr(source, name) if known else _EXTRAS[name][0])


def _public_name(cls: type) -> str:
    """``cls`` by the path users import it from: ``poptorch_lite.optim.SGD``, ``torch.optim.sgd.SGD``."""
    module = "poptorch_lite.optim" if cls.__module__.startswith("poptorch_lite.optim") \
        else cls.__module__
    return f"{module}.{cls.__qualname__}"
