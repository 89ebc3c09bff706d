"""Schedule kinds: the builders of Sequential, Grouped, Interleaved, GPipe and ZeroBubble grids.

Each builder is a pure function of (S, m, training, stage streams, recomputed
stages) returning a validated :class:`~poptorch_lite.runtime.schedule.Schedule`;
:func:`build` picks one by :class:`~poptorch_lite.enums.PipelineSchedule`. No torch.

[Note: schedule kinds]
In training, stage s runs w forwards, then a forward and a backward in turn,
then its last w backwards: both in ascending micro-batch order, as its FIFO
activation stash needs. The kinds differ in w, hence in the peak micro-batches
in flight at stage s (``peak_in_flight()``; 1 in inference). The concurrent
kinds end training with one row of every stage's reduction, then the update.
Steps with one stream per stage and no recomputation:

    kind        | w                 | training steps | inference | peak at stage s
    ------------+-------------------+----------------+-----------+--------------------
    Sequential  | 0                 | 2·S·m + S + 1  | S·m       | 1
    Grouped     | min(2·(S-1-s), m) | 2·m + 2·S      | m + S - 1 | min(m, 2·(S-s) - 1)
    Interleaved | min(S-1-s, m)     | 2·m + 2·S      | m + S - 1 | min(m, S - s)
    GPipe       | m                 | 2·m + 2·S      | m + S - 1 | m
    ZeroBubble  | min(S-1-s, m)     | 3·m + 2·S      | m + S - 1 | min(m, S - s)

ZeroBubble splits each backward into I and W and is built per stream, not per
stage ([Note: zero bubble]); the other kinds add rows where stages share a
stream ([Note: shared streams]). Recomputation adds rows too ([Note:
recomputation rows]) and leaves the peak unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..enums import PipelineSchedule
from ..errors import ScheduleError
from .schedule import Action, Kind, Schedule, _dependencies, _stream, validate


def _split_order(a: Action) -> tuple:
    """Forwards first in ascending stage order, then the rest in descending stage order."""
    s = a.stage or 0
    return (0, s) if a.kind is Kind.FORWARD else (1, -s)


def _on_streams(stage_rows: Sequence[Sequence[Action]], stage_streams: Sequence[int]) -> tuple:
    """Place rows built over stages onto streams, splitting rows where stages share a stream.

    [Note: shared streams]
    Stages on one IPU share its stream. Builders think in stages (each stage
    its own column); where a row puts two actions on one stream they run in
    consecutive rows: forwards in ascending stage order, then backwards and
    reductions in descending stage order (the directions data flows). Actions
    of one row never depend on each other, so splitting keeps the grid valid.
    """
    n = max(stage_streams) + 1
    rows: list = []
    for actions in stage_rows:
        split: list = []  # the rows this one becomes; the j-th action of stream k goes in split[j]
        depth = [0] * n
        for a in sorted(actions, key=_split_order):
            k = _stream(a, stage_streams)
            if depth[k] == len(split):
                split.append([None] * n)
            split[depth[k]][k] = a
            depth[k] += 1
        rows += map(tuple, split)
    return tuple(rows)


def _with_recompute(rows: tuple, recompute: tuple) -> tuple:
    """Insert, before each row holding backwards of recomputed stages, a row of their recomputes.

    [Note: recomputation rows]
    A recomputed stage runs its forward again (R) right before the backward of
    the same micro-batch, on the same stream, so its forward need not keep
    activations for the backward. R(s,i) needs F(s,i); B(s,i) needs R(s,i).
    Every kind gets the same transform: one row before each row that holds
    backwards of recomputed stages. Micro-batches in flight do not change.
    Recomputing every stage adds S·m rows to Sequential, m + S - 1 to Grouped
    and GPipe, 2·m + S - 2 to Interleaved (m when S = 1).
    """
    out = []
    for row in rows:
        r = tuple(Action(Kind.RECOMPUTE, a.stage, a.microbatch)
                  if a is not None and a.kind.input_grads and recompute[a.stage] else None
                  for a in row)
        out += [r, row] if any(c is not None for c in r) else [row]
    return tuple(out)


def _schedule(name: str, S: int, m: int, training: bool, stage_streams: Sequence[int],
              recompute: Optional[Sequence[bool]], stage_rows: list, split: bool = False) -> Schedule:
    """The Schedule of rows built over stages: placed on streams, recomputes inserted."""
    streams = tuple(stage_streams)
    rec = tuple(bool(r) for r in recompute) if training and recompute and any(recompute) else ()
    rows = _on_streams(stage_rows, streams)
    return Schedule(name, S, m, training, streams, _with_recompute(rows, rec) if rec else rows, rec,
                    split and training)


def _list_schedule(orders: list, S: int, m: int, training: bool) -> list:
    """Rows over stages from each stage's action order, by list scheduling.

    Actions take one row each. At every row, each stage takes the next action
    of its order if everything that action needs finished in an earlier row.

    Raises:
        ValueError: no stage can take its next action (the orders deadlock, or
            one needs an action that no order holds).
    """
    pos, done, rows = [0] * len(orders), set(), []
    needs = [_dependencies(o[0], S, m, training) if o else [] for o in orders]  # of next actions
    while any(p < len(o) for p, o in zip(pos, orders)):
        ready = [s for s, o in enumerate(orders)
                 if pos[s] < len(o) and all(d in done for d in needs[s])]
        if not ready:
            waiting = ", ".join(str(o[p]) for p, o in zip(pos, orders) if p < len(o))
            raise ScheduleError(f"the stage orders deadlock at row {len(rows)}: {waiting} each "
                                f"wait for an action that is not done")
        rows.append([orders[s][pos[s]] for s in ready])
        done.update(rows[-1])
        for s in ready:
            pos[s] += 1
            if pos[s] < len(orders[s]):
                needs[s] = _dependencies(orders[s][pos[s]], S, m, training)
    return rows


def _orders(S: int, m: int, training: bool, warmup: Callable) -> list:
    """Per stage s: ``warmup(s)`` forwards, then forward and backward in turn, then the rest."""
    orders = []
    for s in range(S):
        F = [Action(Kind.FORWARD, s, i) for i in range(m)]
        B = [Action(Kind.BACKWARD, s, i) for i in range(m)] if training else []
        w = warmup(s) if training else m
        orders.append(F[:w] + [a for i in range(w, m) for a in (F[i], B[i - w])] + B[m - w:])
    return orders


def _ending(S: int) -> list:
    """The rows after the last backward: every stage's reduction, then the update."""
    return [[Action(Kind.REDUCE, s) for s in range(S)], [Action(Kind.STEP)]]


# -- the builders -------------------------------------------------------------------------


def sequential(S: int, m: int, training: bool, stage_streams: Sequence[int],
               recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """One action at a time, a micro-batch through every stage before the next.

    This is PopTorch's sharded execution and the debug mode of pipelining:
    ``2·S·m + S + 1`` steps in training (``S·m`` in inference), one stream
    busy per step, one micro-batch in flight per stage. Arguments as
    :func:`build`; the result is not validated. See [Note: schedule grid].

    Example (S=2, m=1, training):
        >>> print(sequential(2, 1, True, (0, 1)).render())
          step | s0  | s1
        ------------------
             0 | 0F0 |
             1 |     | 1F0
             2 |     | 1B0
             3 | 0B0 |
             4 |     | 1G
             5 | 0G  |
             6 | U   |
    """
    order = []
    for i in range(m):
        order += [Action(Kind.FORWARD, s, i) for s in range(S)]
        if training:
            order += [Action(Kind.BACKWARD, s, i) for s in reversed(range(S))]
    if training:
        order += [Action(Kind.REDUCE, s) for s in reversed(range(S))] + [Action(Kind.STEP)]
    return _schedule("sequential", S, m, training, stage_streams, recompute, [[a] for a in order])


def grouped(S: int, m: int, training: bool, stage_streams: Sequence[int],
            recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """Graphcore's default: in lockstep clocks, all stages forward, then all backward.

    Clock c is a forward row, F(s,i) with c = i + s, then in training a
    backward row, B(s,i) with c = i + 2·(S-1) - s; empty rows are dropped.
    So stage s runs w = min(2·(S-1-s), m) forwards before its first backward.
    Steps: ``2·m + 2·S`` in training, ``m + S - 1`` in inference. Peak in
    flight at stage s: ``min(m, 2·(S-s) - 1)``. Arguments as :func:`build`;
    the result is not validated. See [Note: schedule kinds].

    Example (S=2, m=3, training):
        >>> print(grouped(2, 3, True, (0, 1)).render())
          step | s0  | s1
        ------------------
             0 | 0F0 |
             1 | 0F1 | 1F0
             2 |     | 1B0
             3 | 0F2 | 1F1
             4 | 0B0 | 1B1
             5 |     | 1F2
             6 | 0B1 | 1B2
             7 | 0B2 |
             8 | 0G  | 1G
             9 | U   |
    """
    rows = []
    for c in range(m + S - 1 + (S - 1 if training else 0)):
        rows.append([Action(Kind.FORWARD, s, c - s) for s in range(S) if 0 <= c - s < m])
        if training:
            b = c - 2 * (S - 1)
            rows.append([Action(Kind.BACKWARD, s, b + s) for s in range(S) if 0 <= b + s < m])
    rows = [r for r in rows if r] + (_ending(S) if training else [])
    return _schedule("grouped", S, m, training, stage_streams, recompute, rows)


def interleaved(S: int, m: int, training: bool, stage_streams: Sequence[int],
                recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """One forward, one backward (1F1B, PipeDream-flush): fewest activations in flight.

    Stage s runs w = min(S-1-s, m) forwards, then one forward and one backward
    in turn until its forwards run out, then its last backwards; the rows come
    from list scheduling these orders. Steps: ``2·m + 2·S`` in training,
    ``m + S - 1`` in inference. Peak in flight at stage s: ``min(m, S - s)``.
    Arguments as :func:`build`; the result is not validated. See
    [Note: schedule kinds].

    Example (S=2, m=3, training):
        >>> print(interleaved(2, 3, True, (0, 1)).render())
          step | s0  | s1
        ------------------
             0 | 0F0 |
             1 | 0F1 | 1F0
             2 |     | 1B0
             3 | 0B0 | 1F1
             4 | 0F2 | 1B1
             5 | 0B1 | 1F2
             6 |     | 1B2
             7 | 0B2 |
             8 | 0G  | 1G
             9 | U   |
    """
    orders = _orders(S, m, training, lambda s: min(S - 1 - s, m))
    rows = _list_schedule(orders, S, m, training) + (_ending(S) if training else [])
    return _schedule("interleaved", S, m, training, stage_streams, recompute, rows)


def gpipe(S: int, m: int, training: bool, stage_streams: Sequence[int],
          recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """Fill-drain (GPipe): every stage runs all its forwards, then all its backwards.

    The rows come from list scheduling these orders. Steps: ``2·m + 2·S`` in
    training, ``m + S - 1`` in inference. Peak in flight at every stage: ``m``.
    Arguments as :func:`build`; the result is not validated. See
    [Note: schedule kinds].

    Example (S=2, m=2, training):
        >>> print(gpipe(2, 2, True, (0, 1)).render())
          step | s0  | s1
        ------------------
             0 | 0F0 |
             1 | 0F1 | 1F0
             2 |     | 1F1
             3 |     | 1B0
             4 | 0B0 | 1B1
             5 | 0B1 |
             6 | 0G  | 1G
             7 | U   |
    """
    orders = _orders(S, m, training, lambda s: m)
    rows = _list_schedule(orders, S, m, training) + (_ending(S) if training else [])
    return _schedule("gpipe", S, m, training, stage_streams, recompute, rows)


def zero_bubble(S: int, m: int, training: bool, stage_streams: Sequence[int],
                recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """Zero-bubble 1F1B (ZB-H1): each backward split into I and W, the W's filling the bubble.

    [Note: zero bubble]
    A backward is two actions ([Note: split backward] in ``split_backward``): I(s,i)
    makes the input gradients that stage s-1 waits for, W(s,i) the weight
    gradients nobody waits for but the reduction. The grid is built per stream,
    row by row: each stream takes, of the stages it runs, the first that can
    go of (1) the next I, highest stage first (the critical path), (2) the
    next F, highest stage first, while stage s holds fewer than ``S - s``
    micro-batches between F and W (1F1B's peak: the activations stay until
    W), (3) the oldest W waiting. So a W runs only where its stream would
    otherwise wait: ZB-H1 under 1F1B's memory bound, counting a micro-batch's
    activations until its W (ZB-H1 as published frees part of them at I and
    lets W's lag further). With one stream per stage and F = I = W = B/2, the
    bubble is ``(S-1)·(F+I)`` against 1F1B's ``(S-1)·(F+B)``: a third less
    (``Schedule.makespan``); the W's fill the drain. Stages whose IPUs repeat (more stages than
    streams) are virtual stages on shared streams, scheduled the same way:
    IPUs ``0, 1, 1, 0`` make the V of ZBV, ``0, 1, 0, 1`` the loop of
    Interleaved1F1B; then each stream interleaves its stages' actions.

    Example (S=2, m=3, training; the W's of stage 0 fill rows 8 and 10):
        >>> print(zero_bubble(2, 3, True, (0, 1)).render())
          step | s0  | s1
        ------------------
             0 | 0F0 |
             1 | 0F1 | 1F0
             2 |     | 1I0
             3 | 0I0 | 1W0
             4 | 0W0 | 1F1
             5 | 0F2 | 1I1
             6 | 0I1 | 1W1
             7 | 0W1 | 1F2
             8 |     | 1I2
             9 | 0I2 | 1W2
            10 | 0W2 |
            11 | 0G  | 1G
            12 | U   |
    """
    streams = tuple(stage_streams)
    on = [[s for s in reversed(range(S)) if streams[s] == k] for k in range(max(streams) + 1)]
    nxt = {k: [0] * S for k in (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)}
    live, done, rows = [0] * S, set(), []

    def ready(kind: Kind, s: int) -> Optional[Action]:
        i = nxt[kind][s]
        a = Action(kind, s, i)
        return a if i < m and all(d in done for d in _dependencies(a, S, m, True, (), True)) else None

    while len(done) < (3 * S * m if training else S * m):
        row = []
        for stages in on:
            a = next((a for s in stages if (a := ready(Kind.BACKWARD_INPUT, s))), None) \
                if training else None
            a = a or next((a for s in stages if (not training or live[s] < S - s)
                           and (a := ready(Kind.FORWARD, s))), None)
            a = a or next((a for s in reversed(stages) if training
                           and (a := ready(Kind.BACKWARD_WEIGHT, s))), None)
            if a is not None:
                row.append(a)
        if not row:
            raise ScheduleError(f"zero_bubble deadlocks at row {len(rows)} (S={S}, m={m}, "
                                f"stage_streams={streams})")
        for a in row:
            nxt[a.kind][a.stage] += 1
            live[a.stage] += {Kind.FORWARD: 1, Kind.BACKWARD_WEIGHT: -1}.get(a.kind, 0)
        done.update(row)
        rows.append(row)
    return _schedule("zero_bubble", S, m, training, streams, recompute,
                     rows + (_ending(S) if training else []), split=True)


_BUILDERS: dict = {PipelineSchedule.Sequential: sequential, PipelineSchedule.Grouped: grouped,
                   PipelineSchedule.Interleaved: interleaved, PipelineSchedule.GPipe: gpipe,
                   PipelineSchedule.ZeroBubble: zero_bubble}


def build(kind: PipelineSchedule, S: int, m: int, training: bool,
          stage_streams: Optional[Sequence[int]] = None,
          recompute: Optional[Sequence[bool]] = None) -> Schedule:
    """The schedule of ``kind`` for S stages and m micro-batches, validated.

    Args:
        kind: which schedule.
        S: number of stages (>= 1).
        m: micro-batches per run of the grid (>= 1).
        training: include backward, reduction and update.
        stage_streams: the stream of each stage; default one stream per stage.
        recompute: per stage, whether it recomputes its forward before its
            backward (training only); default none.

    Returns:
        The validated schedule.

    Raises:
        ValueError: S or m below 1, or stage_streams or recompute not one
            entry per stage.

    Example:
        >>> build(PipelineSchedule.Sequential, 1, 2, True).text()[:2]
        [['0F0'], ['0B0']]
    """
    streams = tuple(range(S)) if stage_streams is None else tuple(stage_streams)
    rec = () if recompute is None else tuple(recompute)
    if S < 1 or m < 1 or len(streams) != S or len(rec) not in (0, S):
        raise ScheduleError(f"a schedule needs S >= 1 stages, m >= 1 micro-batches and one stream "
                            f"(and optionally one recompute flag) per stage; got S={S}, m={m}, "
                            f"stage_streams={streams}, recompute={rec}")
    schedule = _BUILDERS[kind](S, m, training, streams, rec)
    validate(schedule)
    return schedule
