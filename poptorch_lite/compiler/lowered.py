"""Lowered stages: a partition's stages in the form the runtime runs.

[Note: lowered stages]
The compile step ends here ([Note: the compile step] in ``runtime/compiling``): once the
stages' graphs are rewritten for their devices (``retarget``), :func:`lower` turns each
stage into a :class:`LoweredStage`, its graphs (the forward, and the segments between
recomputation checkpoints that a recompute re-runs) plus the tables of what they read and
write: where each argument comes from, which ones change per micro-batch, which buffers and
arguments the forward writes in place, what a recompute starts from, where the loss is.
Every fact about a stage that is known when it is compiled is worked out here, once; the
runtime (``runtime/stage_work``) only reads these tables and calls these graphs, and never
traces. A compiled backend (Inductor, CUDA graphs) takes the same form: the graphs to
compile and the tables that say what to feed them.

What depends on where a program runs (devices, streams, the stages other processes run) is
the runtime's, not here.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import torch.fx as fx

from .partition import Partition, Stage


def _source(name: str, replica_values: dict) -> tuple:
    """``(name, kind, key)`` of a stage argument named ``name`` ([Note: partition]): an
    input's key is the index of its tensor leaf; a per-replica variable is a "value"."""
    kind, key = name.split(":", 1)
    if kind == "param" and key in replica_values:
        kind = "value"
    return name, kind, int(key) if kind == "input" else key


@dataclasses.dataclass(frozen=True)
class LoweredStage:
    """One stage as the runtime runs it ([Note: lowered stages]).

    Attributes:
        index, ipu, blocks, inputs, outputs, written_inputs, random: the stage's
            (``partition.Stage``).
        module: the forward graph, called with the values named by ``inputs``.
        segments: the graphs between its recomputation checkpoints (``partition.Segment``).
        recompute: whether it is recomputed ([Note: recomputation] in ``runtime/recompute``).
        sources: per argument, ``(name, kind, key)``.
        varying: ``(position, name, kind, key, written in place)`` of every argument but
            the parameters (their tensors never change once placed).
        param_names: the parameters it reads; exclusive: those no other stage reads (their
            gradient may go to an accumulator).
        written: the buffers it writes in place; written_state: those and the call's
            arguments and the parameters it writes, what a recompute starts afresh from.
        crossing: its outputs that a stage on another IPU reads.
        loss_at: where the loss is among its outputs (None: elsewhere).
        cuts: the values that cross a checkpoint cut inside it (what a recompute keeps).
    """

    index: int
    ipu: int
    blocks: tuple
    module: fx.GraphModule
    segments: tuple
    inputs: tuple
    outputs: tuple
    written_inputs: frozenset
    random: bool
    recompute: bool
    sources: tuple
    varying: tuple
    param_names: tuple
    exclusive: tuple
    written: frozenset
    written_state: tuple
    crossing: frozenset
    loss_at: Optional[int]
    cuts: tuple


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A partition's lowered stages, and the facts that join them.

    Attributes:
        stages: the :class:`LoweredStage` of each stage, in execution order.
        producer: value name -> the IPU of the stage that computes it.
        wanted: the value names the call returns.
        loss: the loss's value name (None: no loss).
        replica_values: the partition's per-replica variables ([Note: per-replica
            variables] in ``runtime/replica_groups``).
    """

    stages: tuple
    producer: dict
    wanted: frozenset
    loss: Optional[str]
    replica_values: dict


def lower(partition: Partition, recompute: Optional[Sequence[bool]] = None) -> Lowered:
    """The lowered form of ``partition``'s stages ([Note: lowered stages]).

    Args:
        recompute: per stage, whether it is recomputed (None: none is).

    Example:
        >>> import torch
        >>> from poptorch_lite.compiler.partition import partition
        >>> from poptorch_lite.strategies import PipelinedExecution
        >>> m = torch.nn.Linear(2, 1)
        >>> part = partition(m, {m: True}, (torch.ones(3, 2),), {}, PipelinedExecution(), False)
        >>> [kind for _, kind, _ in lower(part).stages[0].sources]
        ['param', 'param', 'input']
    """
    stages = partition.stages
    recompute = tuple(recompute or [False] * len(stages))
    users = collections.Counter(n for st in stages for n in st.param_names)
    return Lowered(
        stages=tuple(_lowered(st, partition, recompute[st.index], users) for st in stages),
        producer={n: st.ipu for st in stages for n in st.outputs},
        wanted=frozenset(o for o in partition.outputs if isinstance(o, str)),
        loss=partition.loss, replica_values=partition.replica_values)


def _lowered(st: Stage, partition: Partition, recompute: bool,
             users: collections.Counter) -> LoweredStage:
    sources = tuple(_source(n, partition.replica_values) for n in st.inputs)
    written = [n for n in st.inputs if n.startswith("buffer:")
               and n.split(":", 1)[1] in partition.mutated_buffers]
    inside = {n for seg in st.segments for n in seg.outputs}
    return LoweredStage(
        index=st.index, ipu=st.ipu, blocks=tuple(st.blocks), module=st.module,
        segments=tuple(st.segments), inputs=tuple(st.inputs), outputs=tuple(st.outputs),
        written_inputs=frozenset(st.written_inputs), random=st.random, recompute=recompute,
        sources=sources,
        varying=tuple((at, *source, source[0] in st.written_inputs)
                      for at, source in enumerate(sources) if source[1] != "param"),
        param_names=tuple(st.param_names),
        exclusive=tuple(n for n in st.param_names if users[n] == 1),
        written=frozenset(written),
        written_state=tuple(written + [n for n in st.inputs if n.startswith(("input:", "param:"))
                                       and n in st.written_inputs]),
        crossing=frozenset(n for n in st.outputs if any(
            n in t.inputs and t.ipu != st.ipu for t in partition.stages)),
        loss_at=st.outputs.index(partition.loss) if partition.loss in st.outputs else None,
        cuts=tuple(dict.fromkeys(n for seg in st.segments[1:] for n in seg.inputs
                                 if n in inside)))
