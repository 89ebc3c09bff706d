"""Pipeline schedules as data.

A schedule is a pure function of (stages S, micro-batches m, training or
inference, the stream of each stage) that returns a grid: one row per step, one
column per stream, each cell an :class:`Action` or empty. The executor runs the
rows in order; the actions of one row run together, each on its own stream.
This module does not import torch, so schedules are tested as lists.

[Note: schedule grid]
Actions have a compact text form: ``"1F0"`` is stage 1's forward of
micro-batch 0, ``"0B3"`` stage 0's backward of micro-batch 3, ``"2R1"`` a
recompute, ``"1G"`` the reduction of stage 1's gradients (accumulation, loss
scaling, replicas), ``"U"`` the optimizer update. Sequential (sharded) training
of S=2 stages on m=2 micro-batches, streams 0 and 1::

    step | s0  | s1
    -----+-----+-----
       0 | 0F0 |
       1 |     | 1F0
       2 |     | 1B0
       3 | 0B0 |
       4 | 0F1 |
       5 |     | 1F1
       6 |     | 1B1
       7 | 0B1 |
       8 |     | 1G
       9 | 0G  |
      10 | U   |

Steps: training ``2·S·m + S + 1``, inference ``S·m``; one micro-batch in
flight per stage.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Optional, Sequence

from .enums import PipelineSchedule
from .errors import PoptorchLiteWarning, warn_once


class Kind(enum.Enum):
    """What an action does; the value is its letter in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"
    REDUCE = "G"
    STEP = "U"


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work on one stream: (kind, stage s, micro-batch i).

    ``stage`` is None for the optimizer update; ``microbatch`` is None for the
    reduction and the update.

    Example:
        >>> str(Action(Kind.FORWARD, 1, 0)), str(Action(Kind.STEP))
        ('1F0', 'U')
    """

    kind: Kind
    stage: Optional[int] = None
    microbatch: Optional[int] = None

    def __str__(self) -> str:
        s = "" if self.stage is None else str(self.stage)
        i = "" if self.microbatch is None else str(self.microbatch)
        return f"{s}{self.kind.value}{i}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read the text form back: ``Action.parse("0B3") == Action(Kind.BACKWARD, 0, 3)``."""
        for kind in Kind:
            head, sep, tail = text.partition(kind.value)
            if sep and (head == "" or head.isdigit()) and (tail == "" or tail.isdigit()):
                return cls(kind, int(head) if head else None, int(tail) if tail else None)
        raise ValueError(f"not an action: {text!r}")


Row = tuple  # tuple[Optional[Action], ...], one cell per stream


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A grid of actions: ``rows[t][k]`` is what stream k does at step t.

    Attributes:
        name: the schedule kind (``"sequential"``, ...).
        num_stages: S.
        num_microbatches: m.
        training: whether backward, reduction and update actions are present.
        stage_streams: the stream of each stage (stages on one IPU share it).
        rows: the grid.
    """

    name: str
    num_stages: int
    num_microbatches: int
    training: bool
    stage_streams: tuple
    rows: tuple

    @property
    def num_streams(self) -> int:
        return max(self.stage_streams) + 1

    def actions(self) -> list:
        """Every action in row order (within a row, by stream)."""
        return [a for row in self.rows for a in row if a is not None]

    def per_stream(self) -> list:
        """The action list of each stream, in the order the stream runs them."""
        return [[row[k] for row in self.rows if row[k] is not None] for k in range(self.num_streams)]

    def text(self) -> list:
        """The grid as lists of text cells (``""`` for idle), for tests and logs."""
        return [[("" if a is None else str(a)) for a in row] for row in self.rows]

    def render(self, mark_row: Optional[int] = None) -> str:
        """An ASCII table of the grid (step × stream), ``>>`` marking ``mark_row``."""
        cells = self.text()
        width = max([3] + [len(c) for row in cells for c in row])
        head = " step | " + " | ".join(f"s{k}".ljust(width) for k in range(self.num_streams))
        lines = [head, "-" * len(head)]
        for t, row in enumerate(cells):
            mark = ">>" if t == mark_row else "  "
            lines.append(f"{mark}{t:>4} | " + " | ".join(c.ljust(width) for c in row))
        return "\n".join(lines)

    def peak_in_flight(self) -> list:
        """Per stage, the most micro-batches forwarded but not yet backwarded at once.

        In inference a micro-batch leaves a stage as soon as its forward ends.
        """
        live = [0] * self.num_stages
        peak = [0] * self.num_stages
        for a in self.actions():
            if a.kind is Kind.FORWARD:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
                if not self.training:
                    live[a.stage] -= 1
            elif a.kind is Kind.BACKWARD:
                live[a.stage] -= 1
        return peak


def _dependencies(a: Action, S: int, m: int, training: bool) -> list:
    """The actions that must finish in an earlier row before ``a`` may start."""
    s, i = a.stage, a.microbatch
    if a.kind is Kind.FORWARD:
        deps = [Action(Kind.FORWARD, s - 1, i)] if s > 0 else []
        return deps + ([Action(Kind.FORWARD, s, i - 1)] if i > 0 else [])
    if a.kind is Kind.RECOMPUTE:
        return [Action(Kind.FORWARD, s, i)]
    if a.kind is Kind.BACKWARD:
        deps = [Action(Kind.FORWARD, s, i)]
        deps += [Action(Kind.BACKWARD, s + 1, i)] if s < S - 1 else []
        return deps + ([Action(Kind.BACKWARD, s, i - 1)] if i > 0 else [])
    if a.kind is Kind.REDUCE:
        return [Action(Kind.BACKWARD, s, j) for j in range(m)]
    return [Action(Kind.REDUCE, t) for t in range(S)]  # STEP


def validate(schedule: Schedule) -> None:
    """Check that the grid does every required action once, in dependency order.

    Raises:
        ValueError: naming the first action that is missing, repeated, on the
            wrong stream, or scheduled before something it needs.
    """
    S, m, training = schedule.num_stages, schedule.num_microbatches, schedule.training
    kinds = [Kind.FORWARD] + ([Kind.BACKWARD] if training else [])
    required = {Action(k, s, i) for k in kinds for s in range(S) for i in range(m)}
    if training:
        required |= {Action(Kind.REDUCE, s) for s in range(S)} | {Action(Kind.STEP)}
    done: dict = {}
    for t, row in enumerate(schedule.rows):
        if len(row) != schedule.num_streams:
            raise ValueError(f"row {t} has {len(row)} cells for {schedule.num_streams} streams")
        for k, a in enumerate(row):
            if a is None:
                continue
            if a in done:
                raise ValueError(f"{a} appears twice (rows {done[a]} and {t})")
            stream = schedule.stage_streams[a.stage] if a.stage is not None else 0
            if stream != k:
                raise ValueError(f"{a} is on stream {k}; its stage runs on stream {stream}")
            for d in _dependencies(a, S, m, training):
                if d in required and done.get(d, t) >= t:
                    raise ValueError(f"{a} at row {t} runs before {d}, which it needs")
            done[a] = t
    missing = sorted(str(a) for a in required - set(done))
    if missing:
        raise ValueError(f"actions never scheduled: {', '.join(missing)}")


def _grid(stage_streams: Sequence[int], order: list) -> tuple:
    """Rows holding one action each, in ``order``, placed on their streams."""
    n = max(stage_streams) + 1
    rows = []
    for a in order:
        row = [None] * n
        row[stage_streams[a.stage] if a.stage is not None else 0] = a
        rows.append(tuple(row))
    return tuple(rows)


def sequential(S: int, m: int, training: bool, stage_streams: Sequence[int]) -> Schedule:
    """One action at a time, a micro-batch through every stage before the next.

    This is PopTorch's sharded execution and the debug mode of pipelining:
    ``2·S·m + S + 1`` steps in training (``S·m`` in inference), one stream
    busy per step, one micro-batch in flight per stage. See [Note: schedule grid].

    Example:
        >>> [str(a) for a in sequential(2, 1, False, [0, 1]).actions()]
        ['0F0', '1F0']
    """
    order = []
    for i in range(m):
        order += [Action(Kind.FORWARD, s, i) for s in range(S)]
        if training:
            order += [Action(Kind.BACKWARD, s, i) for s in reversed(range(S))]
    if training:
        order += [Action(Kind.REDUCE, s) for s in reversed(range(S))] + [Action(Kind.STEP)]
    return Schedule("sequential", S, m, training, tuple(stage_streams), _grid(stage_streams, order))


_BUILDERS: dict = {PipelineSchedule.Sequential: sequential}


def build(kind: PipelineSchedule, S: int, m: int, training: bool,
          stage_streams: Optional[Sequence[int]] = None) -> Schedule:
    """The schedule of ``kind`` for S stages and m micro-batches, validated.

    Args:
        kind: which schedule.
        S: number of stages (>= 1).
        m: micro-batches per run of the grid (>= 1).
        training: include backward, reduction and update.
        stage_streams: the stream of each stage; default one stream per stage.

    A kind without a builder yet (the concurrent pipelined kinds arrive with
    pipelined execution) runs as Sequential, which is numerically identical,
    with one warning when there is more than one stage.

    Example:
        >>> build(PipelineSchedule.Sequential, 1, 2, True).text()[:2]
        [['0F0'], ['0B0']]
    """
    streams = tuple(range(S)) if stage_streams is None else tuple(stage_streams)
    builder: Optional[Callable] = _BUILDERS.get(kind)
    if builder is None:
        builder = sequential
        if S > 1:
            warn_once(f"schedule.{kind.name}",
                      f"the {kind.name} schedule is not implemented yet: its {S} stages run one "
                      f"action at a time (Sequential); results are identical, only speed differs",
                      PoptorchLiteWarning, stacklevel=5)  # the user's call of the wrapped model
    schedule = builder(S, m, training, streams)
    validate(schedule)
    return schedule
