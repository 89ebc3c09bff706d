"""Undoing a failed call: capture what a call may change, and put it back if it fails.

[Note: all-or-nothing calls]
Parameters and optimizer state change only in a step's update action
([Note: commit point] in ``update``), so a failed call needs no copy of them
to be left consistent: it leaves the model as after its last completed
optimizer step (as before the call, for ``deviceIterations(1)``). What the
update does not commit is captured before each run (one step's micro-batches)
and put back if that run fails before its update: buffers (BatchNorm
statistics move in forwards) and the loss scale. torch's random number
generators change in a call only by the bases its runs draw together, so they
are captured once per call and a failure rewinds them to the state after the
runs that committed (``rng.rewinder``). That copy is small, and the success
path pays nothing else.
``Options.allOrNothingCalls(True)`` also captures every parameter and the
optimizer's state and hyper-parameters before the call (one extra copy of
each, per call; docs/PERFORMANCE.md), so that a failure in any step, even inside
the optimizer's step, puts back the state from before the call. Tensors keep
their identity (values are copied back in place), so the user's model,
optimizer and any other wrapper of the model see exactly the restored state.

Example:
    >>> import torch
    >>> from poptorch_lite.runtime.weights import Weights
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> before = net.weight.detach().clone()
    >>> restore = capture(Weights(net, 1, False), opt, None, params=True)
    >>> with torch.no_grad():
    ...     _ = net.weight.add_(1.0)
    >>> restore()
    >>> torch.equal(net.weight, before)
    True
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

import torch

from ..optim.loss_scale import LossScale
from .weights import Weights


def capture(weights: Weights, optimizer: Optional[torch.optim.Optimizer],
            loss_scale: Optional[LossScale], params: bool = False,
            rng: bool = True, generator: Optional[torch.Generator] = None,
            generators: tuple = ()) -> Callable[[], None]:
    """Capture the state a call may change; return the function that puts it back.

    Args:
        weights: the wrapper's weights (parameters, buffers, device copies).
        optimizer: the optimizer whose state to capture (None: not captured).
        loss_scale: the wrapper's loss scale (None: inference).
        params: capture parameters too (``allOrNothingCalls``); else only what a
            step does not commit.
        rng: capture torch's random number generators, and ``generator`` (the model's
            own, ``Options.randomSeed``), if any (a run's capture leaves them to
            ``rng.rewinder``, once per call).
        generators: the generators of the model's own that its stages draw from ([Note: a
            user's generator] in ``rng``), captured whatever ``rng`` says.
    """
    restore_weights = _weights_snapshot(weights, params)
    restore_optimizer = _optimizer_snapshot(optimizer) if optimizer is not None else None
    # Only automatic loss scaling changes the scale (once per step: a copy, no __init__).
    scale = copy.copy(loss_scale) if loss_scale is not None and loss_scale.automatic else None
    if restore_optimizer is None and scale is None and not rng and not generators:
        return restore_weights  # a run's capture, most often: only the weights' own
    users = [(g, g.get_state()) for g in generators]
    cpu_rng = torch.get_rng_state() if rng else None
    cuda_rng = torch.cuda.get_rng_state_all() if rng and torch.cuda.is_initialized() else None
    own_rng = generator.get_state() if rng and generator is not None else None

    def restore() -> None:
        restore_weights()
        if restore_optimizer is not None:
            restore_optimizer()
        if scale is not None:
            for field in dataclasses.fields(scale):
                setattr(loss_scale, field.name, getattr(scale, field.name))
        if cpu_rng is not None:
            torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if own_rng is not None:
            generator.set_state(own_rng)
        for g, state in users:
            g.set_state(state)
    return restore


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    # The state's tensors are put back in place, so references to them stay valid.
    state = {p: (s, dict(s), _clone(s)) for p, s in optimizer.state.items()}
    groups = [{k: _clone(v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    defaults = _clone(optimizer.defaults)

    def restore() -> None:
        optimizer.state.clear()
        with torch.no_grad():
            for p, (entry, items, values) in state.items():
                entry.clear()
                for k, v in items.items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(values[k])
                        entry[k] = v
                    else:
                        entry[k] = values[k]
                optimizer.state[p] = entry
        optimizer.defaults.update(defaults)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    return restore


def undo_note(applied: int, steps: int, partial: bool = False) -> str:
    """The note a failed call's exception carries: what it left ([Note: commit point] in
    ``update``)."""
    if partial:
        return (f"poptorch_lite: {applied} of the call's {steps} steps completed before the "
                f"failing one; buffers, loss scale and random state were put back to the start "
                f"of its run, parameters and optimizer state could not be")
    if applied == 0:
        return ("poptorch_lite: the call was undone: parameters, buffers, optimizer state, "
                "loss scale and random state are as they were before it")
    return (f"poptorch_lite: the call was undone to its last completed optimizer step: "
            f"{applied} of its {steps} steps were applied, and parameters, optimizer state, "
            f"buffers, loss scale and random state are as right after step {applied}")


def _weights_snapshot(weights: Weights, params: bool) -> Callable[[], None]:
    """What a call changes outside the update; the returned function puts it back.

    Buffers, replica buffers and their copies always (BatchNorm statistics move in
    forwards); with ``params`` also every parameter and home (for all-or-nothing calls
    over several optimizer steps). Tensors keep their identity: values are copied back in
    place, and count as synced with the host again.
    """
    tensors = weights.tensors(params)
    if tensors:
        with torch.no_grad():
            saved = [(t, t.detach().clone()) for t in tensors]
    else:  # nothing to copy (every run of a model without buffers)
        saved = []
    stale = weights.host_stale

    def restore() -> None:
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
        weights.zero_grads(host=False)  # the host's are the user's ([Note: host gradients])
        weights.host_stale = stale
        weights.remember_versions(t for t, _ in saved)
    return restore
