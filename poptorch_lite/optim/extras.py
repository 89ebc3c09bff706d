"""PopTorch's optimizer extras: their defaults, validation and one global value per optimizer."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .. import errors
from ..errors import OptimizerError

# [Note: optimizer extras]
# PopTorch's extra arguments (except SGD's velocity_scaling) are *global*: one value per
# optimizer, kept in every param group's dict (PopTorch scripts read group["loss_scaling"])
# and in `defaults` (for groups added later). The attribute (`opt.loss_scaling`) reads the
# groups and refuses groups that disagree; setting it validates and writes every group.
# step() never applies loss_scaling or max_grad_norm: the wrapper scales the loss, then
# unscales and clips the gradients before step(). accum_type is the gradient accumulators'
# dtype (the executor's); the state dtypes are honoured by step() ([Note: optimizer state
# dtypes] in optim/precision.py); velocity scaling only picks IPU storage precision.


def _positive(name: str, value: Any, allow_inf: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (math.isinf(value) and not allow_inf):
        kind = "a positive float (inf allowed)" if allow_inf else "a positive finite float"
        raise OptimizerError(f"{name}={value!r} is invalid: it must be {kind}, e.g. {name}=1.0")
    return float(value)


def _accum_dtype(name: str, value: Any) -> torch.dtype:
    if value not in (torch.float32, torch.float16):
        raise OptimizerError(f"{name}={value!r} is invalid: accumulation types must be either "
                             f"torch.float32 or torch.float16; pass {name}=torch.float32")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptimizerError(f"{name}={value!r} is invalid: pass {name}=True or {name}=False")
    return value


_EXTRAS: dict[str, tuple[Any, Callable[[str, Any], Any]]] = {  # name: (default, validator)
    "loss_scaling": (1.0, _positive),
    "max_grad_norm": (math.inf, lambda name, v: _positive(name, v, allow_inf=True)),
    "use_combined_accum": (False, _flag), "bias_correction": (True, _flag),
    "use_tf_variant": (False, _flag), "accum_type": (torch.float32, _accum_dtype),
    "velocity_accum_type": (torch.float32, _accum_dtype),
    "first_order_momentum_accum_type": (torch.float32, _accum_dtype),
    "second_order_momentum_accum_type": (torch.float32, _accum_dtype),
    "velocity_scaling": (1.0, _positive),  # SGD's one per-group extra
}
_MOMENT_TYPES = ("accum_type", "first_order_momentum_accum_type",
                 "second_order_momentum_accum_type")


class _Global:
    """A global extra (see [Note: optimizer extras]): read from the groups, written to all."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else _global_value(opt, self._owned(opt))

    def __set__(self, opt: Any, value: Any) -> None:
        value = _EXTRAS[self._owned(opt)][1](self.name, value)
        opt.defaults[self.name] = value
        for group in opt.param_groups:
            group[self.name] = value


    def _owned(self, opt: Any) -> str:
        if self.name not in type(opt)._GLOBALS:
            raise errors.UnknownAttributeError(
                f"{type(opt).__name__} has no {self.name} (PopTorch gives it only "
                f"{list(type(opt)._GLOBALS)}); set {self.name} only on an optimizer that has it")
        return self.name


def _global_value(opt: Any, name: str) -> Any:
    values = [group.get(name, opt.defaults[name]) for group in opt.param_groups]
    if any(v != values[0] for v in values):
        raise OptimizerError(f"{name} is global in PopTorch but the param groups disagree: "
                             f"{values}; set opt.{name} = value to give every group one value")
    return values[0]


def _refuse_amsgrad(opt: torch.optim.Optimizer) -> None:
    flags = [group.get("amsgrad", False) for group in opt.param_groups]
    if any(flags):
        raise OptimizerError(f"amsgrad=True is not supported by PopTorch (the param groups' "
                             f"amsgrad: {flags}); pass amsgrad=False")
