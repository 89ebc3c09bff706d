"""Anchored tensors: the names of a wrapped model's tensors, and the values anchored by them.

[Note: anchored tensors]
PopTorch names the tensors of its compiled graph as PopART does, and ``Options.anchorTensor
(short, long_name, mode)`` asks for one of them to come back after each call, read with
``getAnchoredTensor(short)``; ``getTensorNames()`` lists the names (pt:docs/user_guide/
debugging.py). Here the names a user can find are PopTorch's names for the weights:

- ``<name>``: each parameter and buffer, by its ``named_parameters``/``named_buffers`` name;
- ``Gradient___<name>``: a trainable parameter's gradient, as the last optimizer step of the
  call used it (accumulated over micro-batches and replicas, reduced, unscaled by the loss
  scale; PopART's is the gradient of one micro-batch, still scaled);
- ``UpdatedVar___<name>``: the parameter after the call's last step.

PopTorch before 3.0 traced with ``torch.jit.trace`` through a wrapper that held the model as
``model``, so SDK 2 programs name the same tensors ``model.<name>``, ``Gradient___model.<name>``
and ``UpdatedVar___model.<name>`` (MAE's and DINO's alignment scripts). With
``Options.Jit.traceModel(True)``, PopTorch 3.0's switch back to that tracer, these are the
names (``scope="model."``).

Their values are those after the call (``OutputMode.Final``, the default for a training
model, or ``Default``). What is not supported, and refused on the first call with the
names that are: PopART's activation names (``MatMul:0``, ...; an activation comes back by
returning it from ``forward``), and other output modes (one value per step or micro-batch).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..enums import OutputMode
from ..errors import DeviceError, OptionsError

GRADIENT, UPDATED = "Gradient___", "UpdatedVar___"
_MODES = (None, OutputMode.Default, OutputMode.Final)


def tensor_names(model: torch.nn.Module, training: bool, scope: str = "") -> list[str]:
    """PopTorch's names of ``model``'s tensors that can be anchored ([Note: anchored tensors]);
    ``scope``: what precedes each name (``"model."`` before PopTorch 3.0).

    Example:
        >>> tensor_names(torch.nn.Linear(2, 1), training=True)[:4]
        ['weight', 'bias', 'Gradient___weight', 'Gradient___bias']
    """
    params = [scope + n for n, _ in model.named_parameters()]
    names = params + [scope + n for n, _ in model.named_buffers()]
    if training:
        trained = [scope + n for n, p in model.named_parameters() if p.requires_grad]
        names += [GRADIENT + n for n in trained] + [UPDATED + n for n in trained]
    return names


def scope_of(options) -> str:
    """What precedes the tensor names under ``options`` ([Note: anchored tensors])."""
    return "model." if options.Jit.trace_model else ""


def gradients(anchors: dict, scope: str = "") -> frozenset:
    """The parameters whose gradients are anchored (their names without ``scope``).

    Example:
        >>> gradients({"g": ("Gradient___model.fc.bias", None, 1)}, "model.")
        frozenset({'fc.bias'})
    """
    return frozenset(long[len(GRADIENT) + len(scope):] for long, _, _ in anchors.values()
                     if long.startswith(GRADIENT))


def check(anchors: dict, model: torch.nn.Module, training: bool, scope: str = "") -> None:
    """Refuse anchors naming no tensor, or asking for a mode other than the final value.

    Raises:
        OptionsError: with the names that can be anchored.
    """
    names = tensor_names(model, training, scope)
    for short, (long_name, mode, _period) in anchors.items():
        if long_name not in names:
            shown = names if len(names) <= 12 else names[:12] + ["..."]
            raise OptionsError(
                f"anchorTensor({short!r}, {long_name!r}): the model has no tensor named "
                f"{long_name!r}; the names are getTensorNames()'s: {shown} (PopART's activation "
                f"names do not exist here: return the activation from forward instead)")
        if mode not in _MODES:
            raise OptionsError(
                f"anchorTensor({short!r}, {long_name!r}, {mode}): only the value after the "
                f"call is kept (OutputMode.Final or Default); pass one of those")


def check_updatable_buffers(names: list, model: torch.nn.Module) -> None:
    """Refuse ``Options.updatableNamedBuffers`` names that are not buffers of ``model``.

    Raises:
        OptionsError: with the model's buffer names.
    """
    buffers = [n for n, _ in model.named_buffers()]
    unknown = [n for n in names if n not in buffers]
    if unknown:
        raise OptionsError(
            f"Options.updatableNamedBuffers names {unknown}, which the model has no buffer "
            f"of; its buffers are {buffers if len(buffers) <= 12 else buffers[:12] + ['...']}")


def value(anchors: dict, short: str, model: torch.nn.Module, grads: dict,
          scope: str = "") -> Optional[torch.Tensor]:
    """The anchored tensor ``short`` of ``model`` (the host copy, synced by the caller);
    ``grads``: each parameter's gradient as its last step used it, where it lives; ``scope``:
    :func:`tensor_names`'.

    Raises:
        DeviceError: ``short`` was not anchored.
    """
    if short not in anchors:
        raise DeviceError(f"getAnchoredTensor({short!r}): no tensor was anchored as {short!r}; "
                          f"anchored: {sorted(anchors)}; call opts.anchorTensor({short!r}, "
                          f"name) before wrapping the model")
    name = anchors[short][0]
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if name.startswith(GRADIENT):
        key = name[len(GRADIENT) + len(scope):]
        grad = grads.get(key)
        return None if grad is None else grad.detach().to(tensors[key].device, copy=True)
    return tensors[name.removeprefix(UPDATED)[len(scope):]].detach().clone()
