"""Replica groups: which replicas share an input slice, and which share a value of a variable.

[Note: per-replica variables]
PopTorch's ``poptorch_model.W.replicaGrouping(comm_group_type, size, OnePerGroup)`` gives a
parameter one value per group of replicas (Graphcore's knowledge-graph application shards
its entity embedding so, one shard per replica). The host ``W`` holds the values along
dim 0; replica r computes with ``W[group(r)]``, which is what the trace sees (the model's
``forward`` is written for one value). Groups follow ``CommGroupType`` (:func:`groups`):
``Consecutive`` groups of ``size`` consecutive replicas, ``Orthogonal`` groups of ``size``
replicas ``R / size`` apart, ``NoGrouping`` a value per replica, ``All`` one value.

Autograd adds each replica's gradient into the slice it computed with, so a value's
gradient is the sum over its group's replicas, and the step divides it as it divides every
gradient ([Note: gradient arithmetic] in ``update``: Mean by G·R): plain PyTorch's gradient of
the one model whose weight the values are pieces of. The optimizer steps the whole tensor.

Replicas that share an input slice (``inputReplicaGrouping(g)``) otherwise run once for all
g of them, since they compute the same; with a per-replica variable they do not, so then
every replica runs: a run holds G·R micro-batches, replica r reading the slice of its input
group ([Note: batch layout] in ``batch``), and a call returns the outputs of all R replicas,
as PopTorch does.
"""

from __future__ import annotations

from typing import Sequence

from ..enums import CommGroupType


def groups(kind: CommGroupType, size: int, R: int) -> tuple:
    """The group of each of R replicas, for a ``CommGroupType`` and group ``size``.

    Example:
        >>> groups(CommGroupType.Consecutive, 2, 4), groups(CommGroupType.Orthogonal, 2, 4)
        ((0, 0, 1, 1), (0, 1, 0, 1))
    """
    if kind == CommGroupType.Consecutive:
        return tuple(r // size for r in range(R))
    if kind == CommGroupType.Orthogonal:
        return tuple(r % (R // size) for r in range(R))
    if kind == CommGroupType.NoGrouping:
        return tuple(range(R))
    return (0,) * R


def every_replica(tensors: Sequence, D: int, G: int, R: int, g: int,
                  kind: CommGroupType) -> list:
    """A call's micro-batches with one per replica: ``tensors`` holds ``D·G·(R/g)`` of them,
    one per input group ([Note: batch layout]); the result ``D·G·R``, replica r of each
    accumulation step reading its input group's ([Note: per-replica variables]).

    Example:
        >>> every_replica(["a0", "a1"], 1, 1, 4, 2, CommGroupType.Consecutive)
        ['a0', 'a0', 'a1', 'a1']
    """
    inputs, per = groups(kind, g, R), R // g  # replicas sharing an input form a group
    return [tensors[(d * G + j) * per + inputs[r]]
            for d in range(D) for j in range(G) for r in range(R)]
