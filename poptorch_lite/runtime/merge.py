"""Merging: a call's outputs, from its micro-batches' to what the call returns.

From one list of output leaves per micro-batch to what the call returns, per the output
mode ([Note: batch layout] in ``batch``: micro-batch ``k``'s place).

The other end of a call from ``batch``'s split: the runs return each kept micro-batch's
outputs on the host, and :class:`Outputs` picks, combines and rebuilds them into the
model's output structure.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils import _pytree as pytree

from ..enums import OutputMode
from ..errors import OptionsError


class Outputs:
    """Which micro-batches a wrapper's calls return, and how they are merged: worked out
    once per wrapper from its (frozen) options.

    Args:
        mode: ``Options.outputMode``; period: its ``output_return_period`` (EveryN);
            training: a training wrapper (Default's meaning); D, G, R: device iterations,
            gradient accumulation, the replicas this process runs in turn.
    """

    def __init__(self, mode: OutputMode, period: int, training: bool, D: int, G: int, R: int):
        self.groups = selected_microbatches(resolve_output_mode(mode, training), period, D, G, R)
        self.kept = {i for group in self.groups for i in group}  # copied to the host
        self._flat: dict = {}  # id(output spec) -> (the spec, whether it is a tuple of leaves)

    def merge(self, part, per_microbatch: list):
        """The call's result: the kept micro-batches' outputs merged (:func:`merge`) and put
        back into the model's output structure with its constant outputs."""
        merged = iter(merge(per_microbatch, self.groups))
        leaves = [next(merged) if isinstance(v, str) else v[1] for v in part.outputs]
        spec = part.out_spec
        flat = self._flat.get(id(spec))
        if flat is None or flat[0] is not spec:  # a tuple of leaves (the common return) or not
            flat = self._flat[id(spec)] = (
                spec, spec == pytree.tree_flatten(tuple(range(spec.num_leaves)))[1])
        return tuple(leaves) if flat[1] else pytree.tree_unflatten(leaves, spec)


def resolve_output_mode(mode: OutputMode, training: bool) -> OutputMode:
    """``OutputMode.Default`` is Final for training and All for inference."""
    if mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return OutputMode(mode)


def selected_microbatches(mode: OutputMode, period: int, D: int, G: int, R: int) -> list:
    """Which micro-batches an output mode returns, as groups to combine.

    Returns a list of groups; each group's outputs are summed (Sum) or taken
    alone (the others); the groups are then joined in order.

    Example:
        >>> selected_microbatches(OutputMode.Final, 1, D=2, G=2, R=1)
        [[3]]
    """
    def k(d, g, r):
        return (d * G + g) * R + r

    if mode == OutputMode.All:
        return [[i] for i in range(D * G * R)]
    if mode == OutputMode.Final:
        return [[k(D - 1, G - 1, r)] for r in range(R)]
    if mode == OutputMode.Sum:
        return [[k(d, g, r) for d in range(D) for g in range(G)] for r in range(R)]
    if mode == OutputMode.EveryN:
        return [[i] for d in range(period - 1, D, period) for i in range(d * G * R, (d + 1) * G * R)]
    raise OptionsError(f"unknown output mode {mode!r}")


def merge(per_microbatch: Sequence[Sequence[torch.Tensor]], groups: list) -> list:
    """Combine one list of output leaves per micro-batch into the returned leaves.

    With more than one group, scalars stack into shape ``(n,)`` and other
    outputs concatenate along dim 0; with one group the shape is unchanged
    (POPTORCH_REFERENCE §3, the shape rule). Only the micro-batches in ``groups``
    are read (the others may be None: not copied to the host).
    """
    n_out = len(per_microbatch[groups[0][0]]) if per_microbatch and groups else 0
    merged = []
    for j in range(n_out):
        pieces = []
        for group in groups:
            value = per_microbatch[group[0]][j]
            for i in group[1:]:
                value = value + per_microbatch[i][j]
            pieces.append(value)
        if len(pieces) == 1:
            merged.append(pieces[0])
        elif pieces[0].dim() == 0:
            merged.append(torch.stack(pieces))
        else:
            merged.append(torch.cat(pieces))
    return merged
