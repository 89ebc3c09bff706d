"""Keras' names for optimizers, losses and metrics, as torch objects and functions.

[Note: Keras formulas]
The losses follow Keras 3's formulas (its torch backend), with Keras' argument
order ``loss(y_true, y_pred)`` and its epsilon ``1e-7``:

- ``sparse_categorical_crossentropy`` / ``categorical_crossentropy`` on
  probabilities (the default): ``p = y_pred / sum(y_pred)``, clipped to
  ``[eps, 1 - eps]``, then ``-sum(onehot(y_true) * log(p))`` per sample; with
  ``from_logits=True``: ``-sum(onehot(y_true) * log_softmax(y_pred))``.
- ``binary_crossentropy``: ``p`` clipped the same way, then
  ``-(t log p + (1 - t) log(1 - p))`` averaged over the last axis; with logits,
  ``binary_cross_entropy_with_logits``.
- ``mse`` / ``mae``: the squared / absolute error averaged over the last axis.

Each per-sample loss is then averaged over the batch (Keras'
``sum_over_batch_size``) and marked as the model's loss with
``identity_loss(..., "mean")``.

The optimizers are ``poptorch_lite.optim``'s with Keras' defaults: ``sgd``
lr 0.01; ``adam`` lr 0.001, betas (0.9, 0.999), eps 1e-7; ``rmsprop`` lr 0.001,
rho (torch's ``alpha``) 0.9, eps 1e-7. Their update rules are torch's, which
place epsilon slightly differently from Keras' (Adam: Keras adds it to
``sqrt(v)`` before the bias correction of the step size; RMSprop: Keras adds it
inside the square root), so equal hyperparameters give steps that differ in
the epsilon term only.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .. import optim
from ..errors import InputError, OptimizerError, OptionsError
from ..ops import identity_loss

EPSILON = 1e-7  # Keras' backend.epsilon()


# -- optimizers ----------------------------------------------------------------------------

class _KerasOptimizer:
    """A Keras optimizer by name and hyperparameters; ``build(params)`` makes the torch one."""

    def __init__(self, name: str, **kwargs):
        self.name, self.kwargs = name, kwargs

    def __call__(self, params):
        return _OPTIMIZERS[self.name](params, **self.kwargs)

    def __eq__(self, other):
        return isinstance(other, _KerasOptimizer) and (self.name, self.kwargs) == (
            other.name, other.kwargs)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"keras.optimizers.{self.name}({args})"


def _sgd(params, learning_rate=0.01, momentum=0.0, nesterov=False):
    return optim.SGD(params, lr=learning_rate, momentum=momentum, nesterov=nesterov)


def _adam(params, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=EPSILON):
    return optim.Adam(params, lr=learning_rate, betas=(beta_1, beta_2), eps=epsilon)


def _rmsprop(params, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=EPSILON,
             centered=False):
    return optim.RMSprop(params, lr=learning_rate, alpha=rho, eps=epsilon, momentum=momentum,
                         centered=centered)


_OPTIMIZERS = {"SGD": _sgd, "Adam": _adam, "RMSprop": _rmsprop}
_OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "rmsprop": "RMSprop"}


class optimizers:  # noqa: N801 - Keras' namespace ``keras.optimizers``
    """``keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)``, ``Adam(...)``, ``RMSprop(...)``.

    Each returns a description that ``compile`` builds over the model's parameters.

    Example:
        >>> optimizers.SGD(learning_rate=0.1, momentum=0.9)
        keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=False)
    """

    @staticmethod
    def SGD(learning_rate=0.01, momentum=0.0, nesterov=False):  # noqa: N802 - Keras' name
        return _KerasOptimizer("SGD", learning_rate=learning_rate, momentum=momentum,
                               nesterov=nesterov)

    @staticmethod
    def Adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=EPSILON):  # noqa: N802
        return _KerasOptimizer("Adam", learning_rate=learning_rate, beta_1=beta_1,
                               beta_2=beta_2, epsilon=epsilon)

    @staticmethod
    def RMSprop(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=EPSILON,  # noqa: N802
                centered=False):
        return _KerasOptimizer("RMSprop", learning_rate=learning_rate, rho=rho,
                               momentum=momentum, epsilon=epsilon, centered=centered)


def resolve_optimizer(spec) -> Callable:
    """``compile``'s ``optimizer``: a function from parameters to a torch optimizer.

    Args:
        spec: ``"sgd"``, ``"adam"``, ``"rmsprop"``, a ``keras.optimizers`` description,
            a torch / ``poptorch_lite.optim`` optimizer, or a callable from parameters
            to one.

    Raises:
        OptimizerError: an unknown name or another type.

    Example:
        >>> build = resolve_optimizer("adam")
        >>> build(torch.nn.Linear(2, 1).parameters()).defaults["eps"]
        1e-07
    """
    if isinstance(spec, str):
        if spec.lower() not in _OPTIMIZER_NAMES:
            raise OptimizerError(f"unknown optimizer {spec!r}: use one of "
                                 f"{sorted(_OPTIMIZER_NAMES)}, a torch optimizer or a callable "
                                 f"from parameters to one")
        return _KerasOptimizer(_OPTIMIZER_NAMES[spec.lower()])
    if isinstance(spec, torch.optim.Optimizer):
        return lambda params: spec
    if callable(spec):
        return spec
    raise OptimizerError(f"optimizer must be a name, a torch optimizer or a callable from "
                         f"parameters to one, got {type(spec).__name__} {spec!r}")


# -- losses --------------------------------------------------------------------------------

def _sparse_labels(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    return y_true.long()


def _clipped_log(y_pred: torch.Tensor) -> torch.Tensor:
    p = y_pred / y_pred.sum(-1, keepdim=True)
    return torch.log(p.clamp(EPSILON, 1.0 - EPSILON))


def sparse_categorical_crossentropy(y_true, y_pred, from_logits: bool = False):
    """Per-sample ``-log p[y_true]`` ([Note: Keras formulas]).

    Example:
        >>> sparse_categorical_crossentropy(torch.tensor([1]), torch.tensor([[0.0, 1.0]]))
        tensor([1.1921e-07])
    """
    labels = _sparse_labels(y_true, y_pred)
    log_p = F.log_softmax(y_pred, -1) if from_logits else _clipped_log(y_pred)
    return -log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def categorical_crossentropy(y_true, y_pred, from_logits: bool = False):
    """Per-sample ``-sum(y_true * log p)`` ([Note: Keras formulas]).

    Example:
        >>> categorical_crossentropy(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]))
        tensor([0.6931])
    """
    log_p = F.log_softmax(y_pred, -1) if from_logits else _clipped_log(y_pred)
    return -(y_true * log_p).sum(-1)


def binary_crossentropy(y_true, y_pred, from_logits: bool = False):
    """Per-sample binary cross-entropy averaged over the last axis ([Note: Keras formulas]).

    Example:
        >>> binary_crossentropy(torch.tensor([[1.0]]), torch.tensor([[0.5]]))
        tensor([0.6931])
    """
    y_true = y_true.to(y_pred.dtype)
    if from_logits:
        bce = F.binary_cross_entropy_with_logits(y_pred, y_true, reduction="none")
    else:
        p = y_pred.clamp(EPSILON, 1.0 - EPSILON)
        bce = -(y_true * torch.log(p) + (1.0 - y_true) * torch.log(1.0 - p))
    return bce.mean(-1)


def mean_squared_error(y_true, y_pred):
    """Per-sample mean of ``(y_pred - y_true) ** 2`` over the last axis.

    Example:
        >>> mean_squared_error(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 0.0]]))
        tensor([5.])
    """
    return (y_pred - y_true.to(y_pred.dtype)).square().mean(-1)


def mean_absolute_error(y_true, y_pred):
    """Per-sample mean of ``|y_pred - y_true|`` over the last axis.

    Example:
        >>> mean_absolute_error(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 0.0]]))
        tensor([2.])
    """
    return (y_pred - y_true.to(y_pred.dtype)).abs().mean(-1)


_LOSSES = {
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
    "mse": mean_squared_error, "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error, "mean_absolute_error": mean_absolute_error,
}


class _KerasLoss:
    """A Keras loss object: ``loss(y_true, y_pred)`` is the batch mean of the per-sample loss."""

    fn: Callable = None

    def __init__(self, from_logits: bool = False):
        self.from_logits = from_logits

    def __call__(self, y_true, y_pred):
        kwargs = {"from_logits": self.from_logits} if self.fn in _FROM_LOGITS else {}
        return type(self).fn(y_true, y_pred, **kwargs).mean()

    def __repr__(self):
        return f"keras.losses.{type(self).__name__}(from_logits={self.from_logits})"


_FROM_LOGITS = (sparse_categorical_crossentropy, categorical_crossentropy, binary_crossentropy)


class losses:  # noqa: N801 - Keras' namespace ``keras.losses``
    """Keras' loss classes and functions (``keras.losses``).

    ``losses.SparseCategoricalCrossentropy(from_logits=True)`` is a loss for logits.

    Example:
        >>> losses.MeanSquaredError()(torch.zeros(2, 1), torch.ones(2, 1))
        tensor(1.)
    """

    sparse_categorical_crossentropy = staticmethod(sparse_categorical_crossentropy)
    categorical_crossentropy = staticmethod(categorical_crossentropy)
    binary_crossentropy = staticmethod(binary_crossentropy)
    mean_squared_error = mse = staticmethod(mean_squared_error)
    mean_absolute_error = mae = staticmethod(mean_absolute_error)

    class SparseCategoricalCrossentropy(_KerasLoss):
        fn = staticmethod(sparse_categorical_crossentropy)

    class CategoricalCrossentropy(_KerasLoss):
        fn = staticmethod(categorical_crossentropy)

    class BinaryCrossentropy(_KerasLoss):
        fn = staticmethod(binary_crossentropy)

    class MeanSquaredError(_KerasLoss):
        fn = staticmethod(mean_squared_error)

    class MeanAbsoluteError(_KerasLoss):
        fn = staticmethod(mean_absolute_error)


def resolve_loss(spec) -> Callable:
    """``compile``'s ``loss`` as ``fn(y_pred, y_true, weight=None, scale=None) -> scalar loss``
    marked for the trace (``scale``: compile's ``loss_weights``).

    With ``weight`` (``fit(..., sample_weight=w)``), the per-sample losses are
    weighted and averaged over the batch, Keras' ``sum_over_batch_size``:
    ``sum(w * loss) / batch_size``.

    Args:
        spec: a Keras name (``"sparse_categorical_crossentropy"``, ..., ``"mse"``), a
            ``keras.losses`` object, a torch loss module (called ``module(y_pred, y_true)``,
            torch's order) or a callable ``fn(y_true, y_pred)`` (Keras' order) returning a
            scalar or per-sample losses (averaged).

    Raises:
        OptionsError: an unknown name, no loss, or another type.

    Example:
        >>> fn = resolve_loss("mse")
        >>> fn(torch.ones(2, 1), torch.zeros(2, 1))
        tensor(1.)
        >>> fn(torch.ones(2, 1), torch.zeros(2, 1), torch.tensor([1.0, 0.0]))
        tensor(0.5000)
    """
    if spec is None:
        raise OptionsError("compile() needs a loss to train or evaluate: pass e.g. "
                           "loss=\"sparse_categorical_crossentropy\"")
    if isinstance(spec, str):
        if spec not in _LOSSES:
            raise OptionsError(f"unknown loss {spec!r}: use one of {sorted(_LOSSES)}, a torch "
                               f"loss module or a callable fn(y_true, y_pred)")
        fn = _LOSSES[spec]
        return lambda y_pred, y_true, weight=None, scale=None: identity_loss(
            _weighted(fn(y_true, y_pred), weight, spec, scale), "mean")
    if isinstance(spec, torch.nn.Module):
        def module_loss(y_pred, y_true, weight=None, scale=None):
            if weight is not None:
                raise InputError(f"sample_weight needs per-sample losses, but the torch loss "
                                 f"module {type(spec).__name__} returns them reduced; pass a "
                                 f"Keras loss name or keras.losses object")
            return spec(y_pred, y_true)
        return module_loss
    if callable(spec):
        def loss(y_pred, y_true, weight=None, scale=None):
            value = spec(y_true, y_pred)
            if not isinstance(value, torch.Tensor):
                raise InputError(f"the loss {spec!r} returned {type(value).__name__}, not a "
                                 f"tensor; compute it with torch ops")
            return identity_loss(_weighted(value, weight, spec, scale), "mean")
        return loss
    raise OptionsError(f"loss must be a Keras name, a torch loss module or a callable "
                       f"fn(y_true, y_pred), got {type(spec).__name__} {spec!r}")


def _weighted(per_sample: torch.Tensor, weight, spec, scale=None) -> torch.Tensor:
    """The per-sample losses times the sample weights (Keras' sample_weight) and the
    ``loss_weights`` of compile (``scale``)."""
    if scale is not None:
        per_sample = per_sample * scale
    if weight is None:
        return per_sample
    if per_sample.shape != weight.shape:
        raise InputError(f"sample_weight needs one loss per sample, but the loss {spec!r} "
                         f"returned shape {tuple(per_sample.shape)} for {len(weight)} samples")
    return per_sample * weight


# -- metrics -------------------------------------------------------------------------------

def sparse_categorical_accuracy(y_true, y_pred):
    """Per-sample 1.0 where ``argmax(y_pred) == y_true``.

    Example:
        >>> p = torch.tensor([[0.2, 0.8], [0.3, 0.7]])
        >>> sparse_categorical_accuracy(torch.tensor([1, 0]), p)
        tensor([1., 0.])
    """
    return (y_pred.argmax(-1) == _sparse_labels(y_true, y_pred)).float()


def categorical_accuracy(y_true, y_pred):
    """Per-sample 1.0 where ``argmax(y_pred) == argmax(y_true)``.

    Example:
        >>> categorical_accuracy(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.8]]))
        tensor([1.])
    """
    return (y_pred.argmax(-1) == y_true.argmax(-1)).float()


def binary_accuracy(y_true, y_pred, threshold: float = 0.5):
    """Per-sample mean over the last axis of ``(y_pred > threshold) == y_true``.

    Example:
        >>> binary_accuracy(torch.tensor([[1.0]]), torch.tensor([[0.7]]))
        tensor([1.])
    """
    return ((y_pred > threshold).to(y_pred.dtype) == y_true.to(y_pred.dtype)).float().mean(-1)


def accuracy(y_true, y_pred):
    """Keras' ``"accuracy"``: binary for one output column, sparse for integer labels with one
    dimension fewer (or a last dimension of 1), categorical otherwise.

    Example:
        >>> accuracy(torch.tensor([1]), torch.tensor([[0.1, 0.9]]))
        tensor([1.])
    """
    if y_pred.shape[-1] == 1 and y_pred.dim() == y_true.dim():
        return binary_accuracy(y_true, y_pred)
    if y_true.dim() < y_pred.dim() or y_true.shape[-1] == 1:
        return sparse_categorical_accuracy(y_true, y_pred)
    return categorical_accuracy(y_true, y_pred)


_METRICS = {"accuracy": accuracy, "acc": accuracy,
            "sparse_categorical_accuracy": sparse_categorical_accuracy,
            "categorical_accuracy": categorical_accuracy, "binary_accuracy": binary_accuracy}


def resolve_metrics(specs) -> list:
    """``compile``'s ``metrics`` as ``[(name, fn(y_true, y_pred) -> per-sample values)]``.

    Raises:
        OptionsError: an unknown name or another type.

    Example:
        >>> [name for name, _ in resolve_metrics(["accuracy"])]
        ['accuracy']
    """
    if specs is None:
        return []
    if isinstance(specs, str) or callable(specs):
        specs = [specs]
    out = []
    for spec in specs:
        if isinstance(spec, str):
            if spec not in _METRICS:
                raise OptionsError(f"unknown metric {spec!r}: use one of {sorted(_METRICS)} or "
                                   f"a callable fn(y_true, y_pred)")
            out.append((spec, _METRICS[spec]))
        elif callable(spec):
            out.append((getattr(spec, "__name__", type(spec).__name__), spec))
        else:
            raise OptionsError(f"a metric must be a name or a callable fn(y_true, y_pred), got "
                               f"{type(spec).__name__} {spec!r}")
    return out
