"""PopTorch's private helpers that client libraries import (optimum-graphcore's ``poptorch._impl``).

PopTorch swaps the classes of a wrapped model's parameters and buffers for its own tensor
wrappers; ``unwrapModelIfNecessary`` takes them off (before a deep copy or a generate loop)
and ``rewrapModelIfNecessary`` puts them back. poptorch_lite never changes a tensor's class,
so both leave the model as it is.
"""

from __future__ import annotations

import torch

__all__ = ["isWrapped", "rewrapModelIfNecessary", "unwrapIfWrapped", "unwrapModelIfNecessary"]


def isWrapped(obj) -> bool:  # noqa: N802 (PopTorch's names)
    """False: no tensor or module carries a PopTorch wrapper class here.

    Example:
        >>> isWrapped(torch.nn.Linear(2, 1).weight)
        False
    """
    return False


def unwrapIfWrapped(obj):  # noqa: N802
    """``obj`` itself (nothing is wrapped)."""
    return obj


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:  # noqa: N802
    """Nothing to take off: the parameters and buffers keep their own classes.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> unwrapModelIfNecessary(model); type(model.weight) is torch.nn.Parameter
        True
    """


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:  # noqa: N802
    """Nothing to put back (see :func:`unwrapModelIfNecessary`)."""
