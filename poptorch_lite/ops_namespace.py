"""PopTorch's ``torch.ops.poptorch`` namespace: the ops scripts call there directly.

Graphcore's applications call a few of PopTorch's registered ops by their ``torch.ops``
names. They are defined here (``torch.library``) with their plain meaning, so a model using
them runs in plain PyTorch, traces, and trains like the same model written without them:

- ``push_name_scope(name)`` / ``pop_name_scope()``: op-naming scopes (``NameScope``);
  nothing to do here.
- ``internal_cast(x, dtype)``: ``x`` cast to ``"FLOAT"`` (float32) or ``"FLOAT16"``
  (PopTorch's names; ``"HALF"`` too), differentiable like ``x.to(dtype)``.
- ``identity_loss(x, reduction)``: ``poptorch.identity_loss`` with PopTorch's reduction
  codes (0 sum, 1 mean, 2 none).
- ``ipu_print_tensor(x, title="")``: ``poptorch.ipu_print_tensor``.
- ``nop(x)``: the identity.

Ops that only steer PopTorch's compiler (``begin_ipu_block``, ``begin_multi_conv``,
``push_attributes``, ...) are not registered: use ``Block``/``BeginBlock``, ``MultiConv``
and ``Attribute``.
"""

from __future__ import annotations

import torch

from .errors import InputError
from .ops import identity_loss, ipu_print_tensor

__all__ = ["CAST_DTYPES"]

CAST_DTYPES = {"FLOAT": torch.float32, "FLOAT32": torch.float32, "FLOAT16": torch.float16,
               "HALF": torch.float16}
_REDUCTIONS = {0: "sum", 1: "mean", 2: "none"}


def _internal_cast(x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype.upper() not in CAST_DTYPES:
        raise InputError(f"torch.ops.poptorch.internal_cast: unknown dtype {dtype!r}; use one "
                         f"of {sorted(CAST_DTYPES)} (PopTorch's names)")
    return x.to(CAST_DTYPES[dtype.upper()])


def _identity_loss(x: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction not in _REDUCTIONS:
        raise InputError(f"torch.ops.poptorch.identity_loss: unknown reduction {reduction}; "
                         f"use 0 (sum), 1 (mean) or 2 (none)")
    return identity_loss(x, _REDUCTIONS[reduction])


def _nothing(*args) -> None:
    return None


_lib = torch.library.Library("poptorch", "DEF")
_lib.define("push_name_scope(str name) -> ()")
_lib.define("pop_name_scope() -> ()")
_lib.define("internal_cast(Tensor self, str dtype) -> Tensor")
_lib.define("identity_loss(Tensor self, int reduction) -> Tensor")
_lib.define("ipu_print_tensor(Tensor self, str title='') -> Tensor")
_lib.define("nop(Tensor self) -> Tensor")
# CompositeImplicitAutograd: the ops decompose into what they mean, so autograd and tracing
# see only that (a name scope leaves nothing in a traced graph).
for _name, _fn in (("push_name_scope", _nothing), ("pop_name_scope", _nothing),
                   ("internal_cast", _internal_cast), ("identity_loss", _identity_loss),
                   ("ipu_print_tensor", ipu_print_tensor), ("nop", lambda x: x.view_as(x))):
    _lib.impl(_name, _fn, "CompositeImplicitAutograd")
