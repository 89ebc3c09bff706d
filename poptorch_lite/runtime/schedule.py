"""Pipeline schedules as data.

A schedule is a pure function of (stages S, micro-batches m, training or
inference, the stream of each stage, the recomputed stages) that returns a
grid: one row per step, one column per stream, each cell an :class:`Action` or
empty. The executor runs the rows in order, the actions of one row together,
each on its own stream (or each stream's list in order, waiting for
:meth:`Schedule.dependencies`). This module does not import torch, so
schedules are tested as lists.

[Note: schedule grid]
Actions have a compact text form: ``"1F0"`` is stage 1's forward of
micro-batch 0, ``"0B3"`` stage 0's backward of micro-batch 3, ``"2R1"`` a
recompute, ``"1I0"`` and ``"1W0"`` the two halves of a split backward (the input
gradients, then the weight gradients: [Note: split backward] in ``split_backward``), ``"1G"`` the reduction of stage 1's gradients (accumulation, loss
scaling, replicas), ``"U"`` the optimizer update. Sequential (sharded) training
of S=2 stages on m=2 micro-batches, streams 0 and 1:

    >>> from poptorch_lite.runtime.schedule_kinds import sequential
    >>> print(sequential(2, 2, True, (0, 1)).render())
      step | s0  | s1
    ------------------
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

The builders of each kind live in ``schedule_kinds`` ([Note: schedule kinds]).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Optional, Sequence

from ..errors import ScheduleError



class Kind(enum.Enum):
    """What an action does; the value is its letter in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"    # the input-gradient half of a split backward
    BACKWARD_WEIGHT = "W"   # the weight-gradient half, after the stage's I of that micro-batch
    RECOMPUTE = "R"
    REDUCE = "G"
    STEP = "U"

    __hash__ = object.__hash__  # members are singletons; C-level hashing keeps sets of actions fast

    @property
    def input_grads(self) -> bool:
        """Whether the action makes its stage's input gradients (B, or I of a split backward)."""
        return self is Kind.BACKWARD or self is Kind.BACKWARD_INPUT


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
        raise ScheduleError(f"not an action: {text!r}; write stage, kind letter and micro-batch, "
                            f"e.g. '1F0', '0B3', '1G' or 'U'")


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
        recompute: per stage, whether it recomputes its forward before its
            backward (``R`` actions); empty when no stage does.
        split: whether each backward is split into I and W actions.
    """

    name: str
    num_stages: int
    num_microbatches: int
    training: bool
    stage_streams: tuple
    rows: tuple
    recompute: tuple = ()
    split: bool = False

    @property
    def num_streams(self) -> int:
        return max(self.stage_streams) + 1

    def actions(self) -> list:
        """Every action in row order (within a row, by stream)."""
        return [a for row in self.rows for a in row if a is not None]

    @functools.cached_property
    def _present(self) -> frozenset:
        return frozenset(self.actions())

    @functools.cached_property
    def _previous(self) -> dict:
        """action -> the one before it, when every row holds one action (a total order)."""
        if any(sum(a is not None for a in row) != 1 for row in self.rows):
            return {}
        order = self.actions()
        return dict(zip(order[1:], order))

    def dependencies(self, a: Action) -> list:
        """The actions of this schedule that must finish before ``a`` starts.

        A stream that runs its list in order and waits for these (on other
        streams) keeps every dependency without row barriers. A grid whose
        rows hold one action each (Sequential) is a total order: there each
        action also waits for the one before it.

        Example:
            >>> from poptorch_lite.enums import PipelineSchedule
            >>> from poptorch_lite.runtime.schedule_kinds import build
            >>> s = build(PipelineSchedule.Grouped, 2, 2, True, recompute=[True, False])
            >>> [str(d) for d in s.dependencies(Action.parse("0B1"))]
            ['0F1', '1B1', '0B0', '0R1']
        """
        deps = _dependencies(a, self.num_stages, self.num_microbatches, self.training,
                             self.recompute, self.split)
        previous = self._previous.get(a)
        if previous is not None and previous not in deps:
            deps.append(previous)
        return [d for d in deps if d in self._present]

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
        head = "  step | " + " | ".join(f"s{k}".ljust(width) for k in range(self.num_streams))
        lines = [head, "-" * len(head)]
        for t, row in enumerate(cells):
            mark = ">>" if t == mark_row else "  "
            lines.append(f"{mark}{t:>4} | " + " | ".join(c.ljust(width) for c in row))
        return "\n".join(line.rstrip() for line in lines)

    def peak_in_flight(self) -> list:
        """Per stage, the most micro-batches forwarded but not yet backwarded at once.

        In inference a micro-batch leaves a stage as soon as its forward ends; with a
        split backward, at its W (its activations stay until then).
        """
        live = [0] * self.num_stages
        peak = [0] * self.num_stages
        for a in self.actions():
            if a.kind is Kind.FORWARD:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
                if not self.training:
                    live[a.stage] -= 1
            elif a.kind is Kind.BACKWARD or a.kind is Kind.BACKWARD_WEIGHT:
                live[a.stage] -= 1
        return peak

    def makespan(self, cost: dict) -> float:
        """The time the grid takes when each stream runs its list in order, every action
        waiting for its dependencies, and an action of kind k takes ``cost[k]`` (0 if absent).

        A model of the runtime for comparing kinds (the bubble), not a measurement.

        Example:
            >>> from poptorch_lite.enums import PipelineSchedule
            >>> from poptorch_lite.runtime.schedule_kinds import build
            >>> build(PipelineSchedule.Sequential, 2, 1, True).makespan({Kind.FORWARD: 1, Kind.BACKWARD: 2})
            6
        """
        end: dict = {}
        free = [0] * self.num_streams
        for a in self.actions():  # row order is a topological order
            k = _stream(a, self.stage_streams)
            start = max([free[k], *(end[d] for d in self.dependencies(a))])
            end[a] = free[k] = start + cost.get(a.kind, 0)
        return max(end.values(), default=0)


def _dependencies(a: Action, S: int, m: int, training: bool, recompute: tuple = (),
                  split: bool = False) -> list:
    """The actions that must finish in an earlier row before ``a`` may start.

    A split backward's I takes B's place (its input gradients are what stage s-1
    needs); W(s,i) needs I(s,i). The reduction of stage s needs its W's and those
    of every later stage: a weight that a later stage uses too (tied) gets its
    gradient there, and without the split B(s,i) already waits for theirs.
    """
    s, i = a.stage, a.microbatch
    if a.kind is Kind.FORWARD:
        deps = [Action(Kind.FORWARD, s - 1, i)] if s > 0 else []
        return deps + ([Action(Kind.FORWARD, s, i - 1)] if i > 0 else [])
    if a.kind is Kind.RECOMPUTE:
        return [Action(Kind.FORWARD, s, i)]
    if a.kind is Kind.BACKWARD or a.kind is Kind.BACKWARD_INPUT:
        kind = a.kind
        deps = [Action(Kind.FORWARD, s, i)]
        deps += [Action(kind, s + 1, i)] if s < S - 1 else []
        deps += [Action(kind, s, i - 1)] if i > 0 else []
        return deps + ([Action(Kind.RECOMPUTE, s, i)] if recompute and recompute[s] else [])
    if a.kind is Kind.BACKWARD_WEIGHT:
        return [Action(Kind.BACKWARD_INPUT, s, i)] + (
            [Action(Kind.BACKWARD_WEIGHT, s, i - 1)] if i > 0 else [])
    if a.kind is Kind.REDUCE:
        if split:
            return ([Action(Kind.BACKWARD_WEIGHT, s, j) for j in range(m)]
                    + [Action(Kind.BACKWARD_WEIGHT, t, m - 1) for t in range(s + 1, S)])
        return [Action(Kind.BACKWARD, s, j) for j in range(m)]
    return [Action(Kind.REDUCE, t) for t in range(S)]  # STEP


def _required(S: int, m: int, training: bool, recompute: tuple, split: bool = False) -> set:
    """Every action a schedule of this shape must hold once."""
    required = {Action(Kind.FORWARD, s, i) for s in range(S) for i in range(m)}
    backwards = (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if split else (Kind.BACKWARD,)
    if training:
        required |= {Action(k, s, i) for k in backwards for s in range(S) for i in range(m)}
        required |= {Action(Kind.RECOMPUTE, s, i) for s in range(S) if recompute and recompute[s]
                     for i in range(m)}
        required |= {Action(Kind.REDUCE, s) for s in range(S)} | {Action(Kind.STEP)}
    return required


def _stream(a: Action, stage_streams: Sequence[int]) -> int:
    return stage_streams[a.stage] if a.stage is not None else 0


def validate(schedule: Schedule) -> None:
    """Check that the grid does every required action once, in dependency order.

    Raises:
        ValueError: naming the first action that is missing, repeated, on the
            wrong stream, not part of this schedule, or scheduled before
            something it needs.
    """
    S, m, training = schedule.num_stages, schedule.num_microbatches, schedule.training
    if len(schedule.recompute) not in (0, S):
        raise ScheduleError(f"recompute={schedule.recompute} needs one flag per stage ({S})")
    split = schedule.split and training
    required = _required(S, m, training, schedule.recompute, split)
    done: dict = {}
    for t, row in enumerate(schedule.rows):
        if len(row) != schedule.num_streams:
            raise ScheduleError(f"row {t} has {len(row)} cells for {schedule.num_streams} streams")
        for k, a in enumerate(row):
            if a is None:
                continue
            if a not in required:
                raise ScheduleError(f"{a} at row {t} is not an action of this schedule (S={S}, m={m}, "
                                    f"training={training}, recompute={schedule.recompute}, "
                                    f"split={split})")
            if a in done:
                raise ScheduleError(f"{a} appears twice (rows {done[a]} and {t})")
            stream = _stream(a, schedule.stage_streams)
            if stream != k:
                raise ScheduleError(f"{a} is on stream {k}; its stage runs on stream {stream}")
            for d in _dependencies(a, S, m, training, schedule.recompute, split):  # all required
                if done.get(d, t) >= t:
                    raise ScheduleError(f"{a} at row {t} runs before {d}, which it needs")
            done[a] = t
    missing = sorted(str(a) for a in required - set(done))
    if missing:
        raise ScheduleError(f"actions never scheduled: {', '.join(missing)}")
