"""PopTorch's optimizers: torch's update rules plus PopTorch's extra arguments."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch

from . import errors
from .errors import OptimizerError

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "LAMB", "VariableAttributes", "check_optimizer",
           "loss_scaling", "max_grad_norm", "copy_hyperparameters"]

# [Note: optimizer extras]
# PopTorch's extra arguments (except SGD's velocity_scaling) are *global*: one value per
# optimizer, kept in every param group's dict (PopTorch scripts read group["loss_scaling"])
# and in `defaults` (for groups added later). The attribute (`opt.loss_scaling`) reads the
# groups and refuses groups that disagree; setting it validates and writes every group.
# step() never applies loss_scaling or max_grad_norm: the wrapper scales the loss, then
# unscales and clips the gradients before step(). Accumulator dtypes and velocity scaling
# only pick IPU storage precision; the state here stays float32, so results do not change.


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
    if value == torch.float16:
        errors.warn_once(f"optim.{name}", f"{name}=torch.float16 only sets IPU storage precision;"
                         " poptorch_lite keeps optimizer state in float32")
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
            raise AttributeError(f"{type(opt).__name__} has no {self.name} (PopTorch gives it "
                                 f"only {list(type(opt)._GLOBALS)})")
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


class _PopTorchOptimizer:
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


def _torch_step(torch_cls: type, opt: Any, closure: Callable | None) -> Any:
    """torch's step without the hook wrapper torch patches onto classes (ours already ran)."""
    step = torch_cls.step
    return (step.__wrapped__ if getattr(step, "hooked", False) else step)(opt, closure)


def _closure_loss(closure: Callable | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(group: dict[str, Any]) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) pairs of a group, the gradient negated when maximize=True."""
    for p in group["params"]:
        if p.grad is not None:
            yield p, (-p.grad if group.get("maximize", False) else p.grad)


def _stepped_state(state: dict, p: torch.Tensor, **buffers: Callable) -> dict:
    """A parameter's state, created with ``buffers`` on first use, its step incremented."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state.update({name: make(p) for name, make in buffers.items()})
    state["step"] += 1
    return state


class SGD(_PopTorchOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` (``lr`` required) plus PopTorch's extras; ``step()`` is torch's.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov: torch's (None: default).
        loss_scaling: global loss scale, applied by the wrapper (default 1.0).
        velocity_scaling: per group, only with ``use_combined_accum=True``; otherwise
            ignored with a warning, as PopTorch's separate-tensor variant does.
        use_combined_accum: PopTorch's combined-accumulator variant (default False).
        accum_type, velocity_accum_type: torch.float32 or torch.float16 (IPU storage).
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


class Adam(_PopTorchOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` plus PopTorch's extras; ``step()`` is torch's; no amsgrad.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad: torch's (None: default).
        loss_scaling, accum_type, max_grad_norm: as :class:`SGD`.
        first_order_momentum_accum_type, second_order_momentum_accum_type: IPU storage
            dtypes of the two moments (torch.float32 or torch.float16).
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
        """One update: torch's AdamW, or the formulas above without bias correction."""
        if self.bias_correction:
            return _torch_step(torch.optim.AdamW, self, closure)
        return self._step_without_bias_correction(closure)

    @torch.no_grad()
    def _step_without_bias_correction(self, closure: Callable | None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p, grad in _with_grads(group):
                state = _stepped_state(self.state[p], p, exp_avg=torch.zeros_like,
                                       exp_avg_sq=torch.zeros_like)
                p.mul_(1 - lr * group["weight_decay"])
                m = state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                v = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-lr)
        return loss


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
        """One update: torch's RMSprop, or TensorFlow's (the formulas above)."""
        if not self.use_tf_variant:
            return _torch_step(torch.optim.RMSprop, self, closure)
        return self._tf_step(closure)

    @torch.no_grad()
    def _tf_step(self, closure: Callable | None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            alpha, eps, lr, momentum = group["alpha"], group["eps"], group["lr"], group["momentum"]
            buffers = {"square_avg": torch.ones_like}  # TF: the squares start at 1
            if momentum > 0:
                buffers["momentum_buffer"] = torch.zeros_like
            if group["centered"]:
                buffers["grad_avg"] = torch.zeros_like
            for p, grad in _with_grads(group):
                state = _stepped_state(self.state[p], p, **buffers)
                if group["weight_decay"] != 0:
                    grad = grad.add(p, alpha=group["weight_decay"])
                s = state["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
                if group["centered"]:
                    a = state["grad_avg"].mul_(alpha).add_(grad, alpha=1 - alpha)
                    denom = s.addcmul(a, a, value=-1).add_(eps).sqrt_()
                else:
                    denom = s.add(eps).sqrt_()
                if momentum > 0:  # TF: lr goes inside the momentum buffer
                    p.sub_(state["momentum_buffer"].mul_(momentum).addcdiv_(grad, denom, value=lr))
                else:
                    p.addcdiv_(grad, denom, value=-lr)
        return loss


def _lamb_init(opt: torch.optim.Optimizer, params: Any, lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, max_weight_norm: float = 65500.0) -> None:
    """LAMB's per-group defaults and their checks, as torch's constructors do them."""
    if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"invalid hyper-parameters lr={lr}, eps={eps}, weight_decay="
                         f"{weight_decay}, betas={betas}: lr, eps, weight_decay must be >= 0 "
                         "and betas in [0, 1)")
    max_weight_norm = _positive("max_weight_norm", max_weight_norm, allow_inf=True)
    torch.optim.Optimizer.__init__(opt, params, dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm))


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

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        """One LAMB update of every parameter that has a gradient (the formulas above)."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, grad in _with_grads(group):
                state = _stepped_state(self.state[p], p, exp_avg=torch.zeros_like,
                                       exp_avg_sq=torch.zeros_like)
                m = state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                v = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                t = state["step"].item()
                bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if self.bias_correction else (1.0, 1.0)
                u = (m / bc1) / (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
                u.add_(p, alpha=group["weight_decay"])
                r1, r2 = p.norm().clamp(max=group["max_weight_norm"]), u.norm()  # phi(||p||)
                trust = torch.where((r1 == 0) | (r2 == 0), torch.ones_like(r1), r1 / r2)
                p.sub_(u * (group["lr"] * trust))
        return loss


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
            names = [f"{c.__module__}.{c.__qualname__}" for c in _ACCEPTED]
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
