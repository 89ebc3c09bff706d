"""PopTorch's optimizers: torch's update rules plus PopTorch's extra arguments."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .. import errors
from ..errors import OptimizerError
from . import precision
from .extras import _EXTRAS, _MOMENT_TYPES, _Global, _global_value, _refuse_amsgrad
from .rules import _adamw_step_without_bias_correction, _lamb_init, _lamb_step, _rmsprop_tf_step

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "LAMB", "VariableAttributes"]


class VariableAttributes:
    """Which hyper-parameters are variable (may change after compilation) or constant.

    Arguments given to a PopTorch optimizer's constructor are variable, the rest constant;
    ``lr`` starts variable. Marks are recorded only: here a constant may still change.

    Example:
        >>> opt = SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> opt.variable_attrs.isConstant("lr"), opt.variable_attrs.isConstant("momentum")
        (False, True)
    """

    def __init__(self, variables: Iterable[str], allowed: Iterable[str]):
        self._allowed = sorted(allowed)
        self._variables = set(variables) & set(self._allowed)

    def _check(self, name: str) -> str:
        if name not in self._allowed:
            raise OptimizerError(f"unknown optimizer attribute {name!r}: the attributes are "
                                 f"{self._allowed}")
        return name

    def isConstant(self, name: str) -> bool:  # noqa: N802 (PopTorch's names)
        """True when ``name`` is constant; an unknown name raises :class:`OptimizerError`."""
        return self._check(name) not in self._variables

    def markAsConstant(self, name: str) -> None:  # noqa: N802
        """Mark ``name`` as constant."""
        self._variables.discard(self._check(name))

    def markAsVariable(self, name: str) -> None:  # noqa: N802
        """Mark ``name`` as variable."""
        self._variables.add(self._check(name))


class Optimizer:
    """PopTorch's optimizer base class: every optimizer of this module derives from it.

    ``isinstance(opt, poptorch.optim.Optimizer)`` tells PopTorch's optimizers from torch's
    (optimum-graphcore converts a torch optimizer when it is not one). Each optimizer also
    derives from its torch class (LAMB from ``torch.optim.Optimizer``); ``state_dict()`` is
    torch's (PopTorch adds its device state under ``ipu_state``/``ipu_param``; here the state
    is the torch optimizer's own).

    Example:
        >>> isinstance(SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), Optimizer)
        True
    """


class _PopTorchOptimizer(Optimizer):
    """Mixin: the global extras named in ``_GLOBALS``, and ``variable_attrs``."""

    _GLOBALS: tuple[str, ...] = ()
    (loss_scaling, max_grad_norm, use_combined_accum, bias_correction, use_tf_variant,
     accum_type, velocity_accum_type, first_order_momentum_accum_type,
     second_order_momentum_accum_type) = (_Global() for _ in range(9))

    def _init(self, torch_init: Callable, args: dict[str, Any], per_group: tuple = ()) -> None:
        """Call ``torch_init`` with the constructor's non-None torch arguments (``args`` is
        its ``locals()``), then install the global extras and the ``per_group`` ones."""
        args = {k: v for k, v in args.items() if k not in ("self", "__class__")}
        params, torch_kwargs = args.pop("params"), args.pop("torch_kwargs", {})
        extras = {k: args.pop(k) for k in list(args) if k in _EXTRAS}
        given = {k: v for k, v in {**args, **torch_kwargs}.items() if v is not None}
        try:
            torch_init(self, params, **given)
        except ValueError as e:  # torch's own checks, moved into our hierarchy
            raise OptimizerError(f"{type(self).__name__}: {e}") from e
        _refuse_amsgrad(self)
        for name in self._GLOBALS + per_group:
            default, validate = _EXTRAS[name]
            self.defaults[name] = validate(name, default if extras[name] is None else extras[name])
            for group in self.param_groups:
                group[name] = validate(name, group.setdefault(name, self.defaults[name]))
        for name in self._GLOBALS:
            _global_value(self, name)
        passed = {k for k, v in extras.items() if v is not None} | set(given)
        self.variable_attrs = VariableAttributes(passed | {"lr"}, self.defaults)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "variable_attrs": self.variable_attrs}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping each state tensor in its PopTorch dtype ([Note: optimizer state
        dtypes]): torch casts loaded state to the parameter's dtype."""
        super().load_state_dict(state_dict)
        precision.keep_loaded_dtypes(self, state_dict)


def _torch_step(torch_cls: type, opt: Any, closure: Callable | None) -> Any:
    """torch's step without the hook wrapper torch patches onto classes (ours already ran)."""
    step = torch_cls.step
    return (step.__wrapped__ if getattr(step, "hooked", False) else step)(opt, closure)


class SGD(_PopTorchOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` (``lr`` required) plus PopTorch's extras; ``step()`` is torch's.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov: torch's (None: default).
        loss_scaling: global loss scale, applied by the wrapper (default 1.0).
        velocity_scaling: per group, only with ``use_combined_accum=True``; otherwise
            ignored with a warning, as PopTorch's separate-tensor variant does.
        use_combined_accum: PopTorch's combined-accumulator variant (default False).
        accum_type: the gradient accumulators' dtype; velocity_accum_type: the momentum
            buffer's (torch.float32, the default, or torch.float16; ignored with
            use_combined_accum=True).
        max_grad_norm: clip gradients to this global norm (default inf: no clipping).
        **torch_kwargs: torch's other arguments (maximize, foreach, ...).

    Raises:
        OptimizerError: an invalid extra, or param groups disagreeing on a global one.

    Example:
        >>> opt = SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, loss_scaling=128.0)
        >>> opt.loss_scaling, opt.param_groups[0]["loss_scaling"]
        (128.0, 128.0)
    """

    _GLOBALS = ("loss_scaling", "max_grad_norm", "use_combined_accum", "accum_type",
                "velocity_accum_type")

    def __init__(self, params: Iterable, lr: float, momentum: float | None = None,
                 dampening: float | None = None, weight_decay: float | None = None,
                 nesterov: bool | None = None, *, loss_scaling: float | None = None,
                 velocity_scaling: float | None = None, use_combined_accum: bool | None = None,
                 accum_type: torch.dtype | None = None,
                 velocity_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None, **torch_kwargs: Any):
        self._init(torch.optim.SGD.__init__, locals(),  # velocity_scaling: per group, like lr
                   per_group=("velocity_scaling",) if use_combined_accum else ())
        if velocity_scaling is not None and not self.use_combined_accum:
            errors.warn_once("optim.SGD.velocity_scaling", f"velocity_scaling={velocity_scaling}"
                             " is ignored with use_combined_accum=False (PopTorch's separate-"
                             "tensor variant); pass use_combined_accum=True or drop it",
                             errors.PoptorchLiteWarning)

    def step(self, closure: Callable | None = None) -> Any:
        """One update: torch's, or with the momentum in ``velocity_accum_type``
        ([Note: optimizer state dtypes] in ``optim/precision.py``)."""
        if precision.differs(self):
            return precision.sgd_step(self, closure)
        return _torch_step(torch.optim.SGD, self, closure)


class Adam(_PopTorchOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` plus PopTorch's extras; ``step()`` is torch's; no amsgrad.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad: torch's (None: default).
        loss_scaling, accum_type, max_grad_norm: as :class:`SGD`.
        first_order_momentum_accum_type, second_order_momentum_accum_type: the dtypes of
            the two moments (torch.float32, the default, or torch.float16).
        **torch_kwargs: torch's other arguments (maximize, foreach, ...).

    Raises:
        OptimizerError: ``amsgrad=True``, or an invalid extra.

    Example:
        >>> opt = Adam(torch.nn.Linear(2, 1).parameters(), lr=1e-3, max_grad_norm=1.0)
        >>> opt.max_grad_norm
        1.0
    """

    _GLOBALS = ("loss_scaling", "max_grad_norm") + _MOMENT_TYPES

    def __init__(self, params: Iterable, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, amsgrad: bool | None = None, *,
                 loss_scaling: float | None = None, accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None, **torch_kwargs: Any):
        self._init(torch.optim.Adam.__init__, locals())

    def step(self, closure: Callable | None = None) -> Any:
        """One update: torch's, or with the moments in their dtypes
        ([Note: optimizer state dtypes] in ``optim/precision.py``)."""
        if precision.differs(self):
            return precision.adam_step(self, closure, decoupled=False,
                                             bias_correction=True)
        return _torch_step(torch.optim.Adam, self, closure)


class AdamW(_PopTorchOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` plus PopTorch's extras, including ``bias_correction``.

    ``step()`` is torch's when ``bias_correction=True`` (default). With False, for each
    parameter p with gradient g (m and v start at 0)::

        p <- p * (1 - lr * weight_decay)
        m <- beta1 * m + (1 - beta1) * g;   v <- beta2 * v + (1 - beta2) * g * g
        p <- p - lr * m / (sqrt(v) + eps)

    Args:
        bias_correction: global; False drops Adam's bias correction of m and v.
        others: as :class:`Adam`, with torch's AdamW defaults (weight_decay 1e-2).

    Example:
        >>> opt = AdamW(torch.nn.Linear(2, 1).parameters(), bias_correction=False)
        >>> opt.bias_correction
        False
    """

    _GLOBALS = Adam._GLOBALS + ("bias_correction",)

    def __init__(self, params: Iterable, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, amsgrad: bool | None = None, *,
                 loss_scaling: float | None = None, bias_correction: bool | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None, **torch_kwargs: Any):
        self._init(torch.optim.AdamW.__init__, locals())

    def step(self, closure: Callable | None = None) -> Any:
        """One update: torch's AdamW, or the formulas above without bias correction; with
        the moments in their dtypes ([Note: optimizer state dtypes] in ``optim/precision.py``)."""
        if precision.differs(self):
            return precision.adam_step(self, closure, decoupled=True,
                                             bias_correction=self.bias_correction)
        if self.bias_correction:
            return _torch_step(torch.optim.AdamW, self, closure)
        return _adamw_step_without_bias_correction(self, closure)


class RMSprop(_PopTorchOptimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` plus PopTorch's extras, including ``use_tf_variant``.

    ``step()`` is torch's when ``use_tf_variant=False`` (default). With True (TensorFlow's
    RMSprop), for each parameter p with gradient g (s starts at 1, a and b at 0)::

        g <- g + weight_decay * p
        s <- alpha * s + (1 - alpha) * g * g
        a <- alpha * a + (1 - alpha) * g             (centered only)
        d = sqrt(s - a * a + eps)  if centered  else  sqrt(s + eps)
        b <- momentum * b + lr * g / d;  p <- p - b   (momentum > 0)
        p <- p - lr * g / d                           (momentum == 0)

    Args:
        params, lr, alpha, eps, weight_decay, momentum, centered: torch's (None: default).
        use_tf_variant: global; True selects the formulas above.
        loss_scaling, accum_type, first/second_order_momentum_accum_type: as :class:`Adam`.

    Example:
        >>> opt = RMSprop(torch.nn.Linear(2, 1).parameters(), use_tf_variant=True)
        >>> opt.use_tf_variant
        True
    """

    _GLOBALS = ("loss_scaling", "use_tf_variant") + _MOMENT_TYPES

    def __init__(self, params: Iterable, lr: float | None = None, alpha: float | None = None,
                 eps: float | None = None, weight_decay: float | None = None,
                 momentum: float | None = None, centered: bool | None = None, *,
                 loss_scaling: float | None = None, accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 use_tf_variant: bool | None = None, **torch_kwargs: Any):
        self._init(torch.optim.RMSprop.__init__, locals())

    def step(self, closure: Callable | None = None) -> Any:
        """One update: torch's RMSprop, or TensorFlow's (the formulas above); with the state
        in its dtypes ([Note: optimizer state dtypes] in ``optim/precision.py``)."""
        if precision.differs(self):
            return precision.rmsprop_step(self, closure, self.use_tf_variant)
        if not self.use_tf_variant:
            return _torch_step(torch.optim.RMSprop, self, closure)
        return _rmsprop_tf_step(self, closure)


class LAMB(_PopTorchOptimizer, torch.optim.Optimizer):
    """LAMB as PopART computes it: biased LAMB with phi(z) = min(z, max_weight_norm).

    For each parameter p with gradient g (m and v start at 0, t counts steps)::

        m <- beta1 * m + (1 - beta1) * g;   v <- beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps) + weight_decay * p
            (bias_correction=False: u = m / (sqrt(v) + eps) + weight_decay * p)
        trust = min(||p||, max_weight_norm) / ||u||      (1 when either norm is 0)
        p <- p - lr * trust * u

    Args:
        params, lr, betas, eps, weight_decay: per group (defaults 1e-3, (0.9, 0.999),
            1e-8, 1e-2).
        bias_correction: global (default True).
        max_weight_norm: per group; None is PopTorch's 65500.0 (float16's max).
        loss_scaling, accum_type, first/second_order_momentum_accum_type, max_grad_norm:
            as :class:`Adam`.

    Example:
        >>> opt = LAMB(torch.nn.Linear(2, 1).parameters(), lr=1e-2)
        >>> opt.param_groups[0]["max_weight_norm"], opt.bias_correction
        (65500.0, True)
    """

    _GLOBALS = Adam._GLOBALS + ("bias_correction",)

    def __init__(self, params: Iterable, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, bias_correction: bool | None = None,
                 loss_scaling: float | None = None, max_weight_norm: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None):
        self._init(_lamb_init, locals())

    def step(self, closure: Callable | None = None) -> Any:
        """One LAMB update of every parameter that has a gradient (the formulas above); with
        the moments in their dtypes ([Note: optimizer state dtypes] in ``optim/precision.py``)."""
        if precision.differs(self):
            return precision.adam_step(self, closure, decoupled=True,
                                             bias_correction=self.bias_correction, lamb=True)
        return _lamb_step(self, closure)
