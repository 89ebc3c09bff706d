"""Recomputation: a recomputed stage's activations, rebuilt from what its forward kept.

A recomputed stage's forward keeps no activations, and its recompute action rebuilds them
from what the forward kept (``stage_work`` runs both).

[Note: recomputation]
A recomputed stage's forward runs without keeping activations (a saved-tensor
hook drops them). Its recompute action, in the backward slot, re-runs each
segment between checkpoints from the kept values with gradients on, replaying
the micro-batch's random state (same dropout masks) on copies of the written
buffers (BatchNorm statistics move once) and of the written parameters (a ``clamp_``
under ``no_grad``: the recompute reads the value the forward read, as plain PyTorch's
backward differentiates the forward that read it; the copy passes its gradient on to
the parameter, :class:`_AsBefore`). Each segment starts from leaves, so
the backward runs segment by segment, last first, and hands each segment's
input gradients to the one before; without recomputation the stage is one
segment.
"""

from __future__ import annotations

import torch

from ..compiler import rng
from ..errors import Error
from .inputs import memory_copy
from .run import Entry


def _drop(t: torch.Tensor) -> None:
    return None


def _gone(_) -> torch.Tensor:
    raise Error("a recomputed stage's forward activations were dropped; its backward must "
                "follow its recompute action (a schedule error)")


def dropping():
    """Around a recomputed stage's forward: the tensors autograd saves are dropped."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _gone)


def rebuild(st, entry: Entry) -> list:
    """Re-run each segment of the lowered stage ``st`` from what ``entry`` kept, gradients
    on: ``(outputs, output names, leaves)`` per segment."""
    env = {}
    for name, v in zip(st.inputs, entry.args):
        if name in entry.buffers:  # writes land in a copy: statistics move once
            before = entry.buffers[name]
            v = _AsBefore.apply(v, before) if v.requires_grad else memory_copy(before)
        elif name in entry.boundary:
            v = entry.boundary[name]
            if name in st.written_inputs:
                v = memory_copy(v)
        env[name] = v
    segments = []
    with rng.use(entry.rng.snapshot() if entry.rng is not None else None):
        for seg in st.segments:
            leaves, args = {}, []
            for name in seg.inputs:
                if name in entry.kept:
                    value, requires_grad = entry.kept[name]
                    v = value.detach().requires_grad_(requires_grad)
                    if requires_grad:
                        leaves[name] = v
                    args.append(memory_copy(v) if requires_grad and name in seg.written else v)
                else:
                    args.append(env[name])
            segments.append((seg.module(*args), seg.outputs, leaves))
    return segments


class _AsBefore(torch.autograd.Function):
    """A copy of ``before`` (a parameter's value before the forward wrote it) whose gradient
    is the parameter's."""

    @staticmethod
    def forward(ctx, param, before):
        return memory_copy(before)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
