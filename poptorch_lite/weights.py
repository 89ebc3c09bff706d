"""Weights: the tensors each stage computes with, and snapshots of them.

[Note: weight homes]
A stage uses a parameter where it lives: on the same device, the user's own
``Parameter`` object (one home for the weights). A stage on another device
uses a copy that ``Weights`` keeps in step: gradients are gathered on the
host parameter before the optimizer step, and copies are refreshed after it.
Replicas beyond the first keep their own buffers when
``broadcastBuffers(False)``.

A call that fails puts every one of these tensors back as it was
(:meth:`Weights.snapshot`, used by the wrapper's all-or-nothing calls).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class Weights:
    """The tensors each stage computes with ([Note: weight homes]).

    Args:
        model: the user's model (its parameters and buffers are the host copy).
        replicas: R.
        separate_buffers: replicas r > 0 keep their own buffers.
    """

    def __init__(self, model: torch.nn.Module, replicas: int, separate_buffers: bool):
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.replicas = replicas
        self.separate_buffers = separate_buffers and replicas > 1
        self._param_copies: dict = {}
        self._buffer_copies: dict = {}
        self._replica_buffers: list = []
        self.to_device()

    def param(self, name: str, device: torch.device) -> torch.Tensor:
        p = self.params[name]
        if p.device == device:
            return p
        key = (name, device)
        if key not in self._param_copies:
            self._param_copies[key] = p.detach().to(device).requires_grad_(p.requires_grad)
        return self._param_copies[key]

    def buffer(self, name: str, replica: int, device: torch.device) -> torch.Tensor:
        b = self._replica_buffers[replica - 1][name] if self.separate_buffers and replica else \
            self.buffers[name]
        if b.device == device:
            return b
        key = (name, replica, device)
        if key not in self._buffer_copies:
            self._buffer_copies[key] = b.detach().to(device)
        return self._buffer_copies[key]

    def to_device(self) -> None:
        """Refresh every copy from the host model (``copyWeightsToDevice``)."""
        with torch.no_grad():
            self._replica_buffers = [{n: b.detach().clone() for n, b in self.buffers.items()}
                                     for _ in range(self.replicas - 1)] if self.separate_buffers else []
            for (name, device), c in self._param_copies.items():
                c.copy_(self.params[name])
            self._buffer_copies.clear()

    def to_host(self) -> None:
        """Copy device-side buffers of replica 0 back to the host model (``copyWeightsToHost``)."""
        with torch.no_grad():
            for (name, replica, device), c in self._buffer_copies.items():
                if replica == 0:
                    self.buffers[name].copy_(c)

    def storages(self) -> set:
        """The storages of every parameter and buffer and their copies (not activations)."""
        tensors = (*self.params.values(), *self.buffers.values(), *self._param_copies.values(),
                   *self._buffer_copies.values(),
                   *(b for bufs in self._replica_buffers for b in bufs.values()))
        return {t.untyped_storage().data_ptr() for t in tensors}

    def zero_grads(self) -> None:
        for p in self.params.values():
            p.grad = None
        for c in self._param_copies.values():
            c.grad = None

    def gather_grad(self, name: str) -> Optional[torch.Tensor]:
        """Sum the gradient of parameter ``name`` over its device copies onto the host parameter."""
        p = self.params[name]
        for (n, device), c in self._param_copies.items():
            if n == name and c.grad is not None:
                g = c.grad.to(p.device)
                p.grad = g if p.grad is None else p.grad + g
                c.grad = None
        return p.grad

    def after_step(self) -> None:
        """The optimizer changed the host parameters: refresh their device copies."""
        with torch.no_grad():
            for (name, device), c in self._param_copies.items():
                c.copy_(self.params[name])

    def snapshot(self, params: bool = True) -> Callable[[], None]:
        """Capture every tensor a call may change; the returned function puts them back.

        ``params=False`` leaves out the parameters (an inference call only
        changes buffers). Parameters, buffers, replica buffers and device copies keep their
        identity (values are copied back in place); parameter ``.grad`` is
        re-bound to the tensor it held; copies made after the snapshot are dropped.
        """
        with torch.no_grad():
            saved = [(t, t.detach().clone()) for t in (
                *(self.params.values() if params else ()), *self.buffers.values(),
                *(b for bufs in self._replica_buffers for b in bufs.values()),
                *self._buffer_copies.values())]
        grads = [(p, p.grad) for p in self.params.values()]
        param_keys, buffer_keys = set(self._param_copies), set(self._buffer_copies)

        def restore() -> None:
            with torch.no_grad():
                for t, value in saved:
                    t.copy_(value)
            for p, g in grads:  # (a grad whose parameter was given new data cannot return)
                p.grad = g if g is None or g.shape == p.shape else None
            for key in set(self._param_copies) - param_keys:
                del self._param_copies[key]
            for key in set(self._buffer_copies) - buffer_keys:
                del self._buffer_copies[key]
            self.after_step()  # parameter copies follow the restored host values
            for c in self._param_copies.values():
                c.grad = None
        return restore
