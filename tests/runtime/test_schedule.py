"""Schedules as lists: exact action order, step counts, dependencies; no torch involved."""

import warnings

import pytest

from poptorch_lite.enums import PipelineSchedule
from poptorch_lite.runtime.schedule import Action, Kind, Schedule, validate
from poptorch_lite.runtime.schedule_kinds import (_list_schedule, build, gpipe, grouped, interleaved,
                                                  sequential, zero_bubble)

P = PipelineSchedule
CONCURRENT = [P.Grouped, P.Interleaved, P.GPipe, P.ZeroBubble]
BUILDERS = {P.Sequential: sequential, P.Grouped: grouped, P.Interleaved: interleaved,
            P.GPipe: gpipe, P.ZeroBubble: zero_bubble}
BY_STAGE = [P.Sequential, P.Grouped, P.Interleaved, P.GPipe]  # built per stage, then on streams

# [Note: schedule kinds], one stream per stage, no recomputation: per kind, the training
# steps, the inference steps, the training peak in flight at stage s, and the warm-up w
# (each stage runs w forwards, then forward and backward in turn, then its last w backwards).
FORMULAS = {
    P.Sequential: (lambda S, m: 2 * S * m + S + 1, lambda S, m: S * m,
                   lambda S, m, s: 1, lambda S, m, s: 0),
    P.Grouped: (lambda S, m: 2 * m + 2 * S, lambda S, m: m + S - 1,
                lambda S, m, s: min(m, 2 * (S - s) - 1), lambda S, m, s: min(2 * (S - 1 - s), m)),
    P.Interleaved: (lambda S, m: 2 * m + 2 * S, lambda S, m: m + S - 1,
                    lambda S, m, s: min(m, S - s), lambda S, m, s: min(S - 1 - s, m)),
    P.GPipe: (lambda S, m: 2 * m + 2 * S, lambda S, m: m + S - 1,
              lambda S, m, s: m, lambda S, m, s: m),
    P.ZeroBubble: (lambda S, m: 3 * m + 2 * S, lambda S, m: m + S - 1,  # I in B's place
                   lambda S, m, s: min(m, S - s), lambda S, m, s: min(S - 1 - s, m)),
}


def _r(cells: str) -> list:
    """One grid row from its cells separated by spaces, ``.`` for idle."""
    return ["" if c == "." else c for c in cells.split()]


def _stage_order(schedule: Schedule, s: int) -> list:
    """Stage s's forwards and backwards, in the order its stream runs them."""
    kinds = (Kind.FORWARD, Kind.BACKWARD)
    return [str(a) for a in schedule.actions() if a.stage == s and a.kind in kinds]


def _warmup_order(m: int, w: int, training: bool) -> list:
    """w forwards, then forward and backward in turn, then the last w backwards: (kind, i)."""
    F, B = [("F", i) for i in range(m)], [("B", i) for i in range(m)] if training else []
    return F[:w] + [a for i in range(w, m) for a in (F[i], B[i - w])] + B[m - w:]


def _without_recompute(schedule: Schedule) -> list:
    return [r for r in schedule.text() if not any("R" in c for c in r)]


def test_schedule_modules_do_not_import_torch():
    import ast
    import poptorch_lite.enums
    import poptorch_lite.runtime.schedule
    import poptorch_lite.runtime.schedule_kinds
    import poptorch_lite.profiling.timeline
    for module in (poptorch_lite.runtime.schedule, poptorch_lite.runtime.schedule_kinds, poptorch_lite.enums,
                   poptorch_lite.profiling.timeline):
        tree = ast.parse(open(module.__file__).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, module.__name__


# -- exact grids -------------------------------------------------------------------------

GRIDS = {
    (P.Sequential, 2, 2, True): [
        _r("0F0 ."), _r(". 1F0"), _r(". 1B0"), _r("0B0 ."),
        _r("0F1 ."), _r(". 1F1"), _r(". 1B1"), _r("0B1 ."),
        _r(". 1G"), _r("0G ."), _r("U ."),
    ],
    (P.Sequential, 3, 2, False): [
        _r("0F0 . ."), _r(". 1F0 ."), _r(". . 2F0"),
        _r("0F1 . ."), _r(". 1F1 ."), _r(". . 2F1"),
    ],
    (P.Grouped, 2, 3, True): [
        _r("0F0 ."), _r("0F1 1F0"), _r(". 1B0"), _r("0F2 1F1"), _r("0B0 1B1"),
        _r(". 1F2"), _r("0B1 1B2"), _r("0B2 ."), _r("0G 1G"), _r("U ."),
    ],
    (P.Grouped, 3, 2, True): [
        _r("0F0 . ."), _r("0F1 1F0 ."), _r(". 1F1 2F0"), _r(". . 2B0"), _r(". . 2F1"),
        _r(". 1B0 2B1"), _r("0B0 1B1 ."), _r("0B1 . ."), _r("0G 1G 2G"), _r("U . ."),
    ],
    (P.Interleaved, 2, 3, True): [
        _r("0F0 ."), _r("0F1 1F0"), _r(". 1B0"), _r("0B0 1F1"), _r("0F2 1B1"),
        _r("0B1 1F2"), _r(". 1B2"), _r("0B2 ."), _r("0G 1G"), _r("U ."),
    ],
    (P.Interleaved, 3, 4, True): [
        _r("0F0 . ."), _r("0F1 1F0 ."), _r("0F2 1F1 2F0"), _r(". . 2B0"), _r(". 1B0 2F1"),
        _r("0B0 1F2 2B1"), _r("0F3 1B1 2F2"), _r("0B1 1F3 2B2"), _r(". 1B2 2F3"),
        _r("0B2 . 2B3"), _r(". 1B3 ."), _r("0B3 . ."), _r("0G 1G 2G"), _r("U . ."),
    ],
    (P.GPipe, 2, 2, True): [
        _r("0F0 ."), _r("0F1 1F0"), _r(". 1F1"), _r(". 1B0"), _r("0B0 1B1"), _r("0B1 ."),
        _r("0G 1G"), _r("U ."),
    ],
    (P.GPipe, 3, 2, True): [
        _r("0F0 . ."), _r("0F1 1F0 ."), _r(". 1F1 2F0"), _r(". . 2F1"), _r(". . 2B0"),
        _r(". 1B0 2B1"), _r("0B0 1B1 ."), _r("0B1 . ."), _r("0G 1G 2G"), _r("U . ."),
    ],
}
INFERENCE_GRIDS = {  # the same for every concurrent kind
    (2, 3): [_r("0F0 ."), _r("0F1 1F0"), _r("0F2 1F1"), _r(". 1F2")],
    (3, 2): [_r("0F0 . ."), _r("0F1 1F0 ."), _r(". 1F1 2F0"), _r(". . 2F1")],
}


@pytest.mark.parametrize("kind, S, m, training", list(GRIDS))
def test_training_and_sequential_grids_are_exact(kind, S, m, training):
    assert build(kind, S, m, training).text() == GRIDS[kind, S, m, training]


@pytest.mark.parametrize("kind", CONCURRENT)
@pytest.mark.parametrize("S, m", list(INFERENCE_GRIDS))
def test_inference_grids_are_exact(kind, S, m):
    assert build(kind, S, m, False).text() == INFERENCE_GRIDS[S, m]


def test_sequential_builder_keeps_its_grid():
    assert sequential(2, 2, True, [0, 1]).text() == GRIDS[P.Sequential, 2, 2, True]


# -- every kind over S in 1..8, m in 1..32 -------------------------------------------------


@pytest.mark.parametrize("kind", list(P))
@pytest.mark.parametrize("S", range(1, 9))
@pytest.mark.parametrize("training", [True, False])
def test_steps_peak_and_stage_order_match_the_documented_formulas(kind, S, training):
    train_steps, infer_steps, peak, warmup = FORMULAS[kind]
    for m in range(1, 33):
        s = BUILDERS[kind](S, m, training, range(S))
        validate(s)
        assert len(s.rows) == (train_steps(S, m) if training else infer_steps(S, m)), (S, m)
        assert s.peak_in_flight() == [peak(S, m, t) if training else 1 for t in range(S)], (S, m)
        by_stage = [[] for _ in range(S)]  # each stage's actions, in its stream's order
        for acts in s.per_stream():
            for a in acts:
                if a.kind is Kind.FORWARD or a.kind.input_grads:
                    by_stage[a.stage].append((a.kind.value.replace("I", "B"), a.microbatch))
        for t, got in enumerate(by_stage):
            F, B = [i for k, i in got if k == "F"], [i for k, i in got if k == "B"]
            assert F == list(range(m)) and B == (list(range(m)) if training else []), (S, m, t)
            w = warmup(S, m, t) if training else m
            assert got == _warmup_order(m, w, training), (S, m, t)
        if not training and kind is not P.Sequential:
            assert s.rows == grouped(S, m, False, range(S)).rows


def test_sequential_runs_one_action_at_a_time():
    for S, m, training in [(1, 3, True), (3, 2, True), (4, 5, False)]:
        rows = sequential(S, m, training, range(S)).rows
        assert all(sum(a is not None for a in row) == 1 for row in rows)


# -- stages sharing a stream -------------------------------------------------------------


def test_stages_sharing_an_ipu_share_a_stream():
    s = sequential(3, 1, False, [0, 1, 0])
    assert s.num_streams == 2
    assert [[str(a) for a in acts] for acts in s.per_stream()] == [["0F0", "2F0"], ["1F0"]]


SHARED_GRIDS = {
    (P.Grouped, (0, 1, 0)): [  # S=3, m=2
        _r("0F0 ."), _r("0F1 1F0"), _r("2F0 1F1"), _r("2B0 ."), _r("2F1 ."), _r("2B1 1B0"),
        _r("0B0 1B1"), _r("0B1 ."), _r("2G 1G"), _r("0G ."), _r("U ."),
    ],
    (P.Interleaved, (0, 1, 0)): [
        _r("0F0 ."), _r("0F1 1F0"), _r("2F0 1F1"), _r("2B0 ."), _r("2F1 1B0"), _r("2B1 ."),
        _r("0B0 ."), _r(". 1B1"), _r("0B1 ."), _r("2G 1G"), _r("0G ."), _r("U ."),
    ],
    (P.GPipe, (0, 0)): [  # S=2, m=2
        _r("0F0"), _r("0F1"), _r("1F0"), _r("1F1"), _r("1B0"), _r("1B1"), _r("0B0"), _r("0B1"),
        _r("1G"), _r("0G"), _r("U"),
    ],
}


@pytest.mark.parametrize("kind, streams", list(SHARED_GRIDS))
def test_shared_stream_grids_are_exact(kind, streams):
    assert build(kind, len(streams), 2, True, streams).text() == SHARED_GRIDS[kind, streams]


@pytest.mark.parametrize("kind", list(P))
@pytest.mark.parametrize("streams", [(0, 1, 0), (0, 0), (0, 0, 1, 1), (1, 0), (0, 1, 1, 0, 2)])
@pytest.mark.parametrize("training", [True, False])
def test_shared_streams_keep_each_stages_order_and_peak(kind, streams, training):
    S = len(streams)
    for m in (1, 2, 3, 8):
        shared, own = build(kind, S, m, training, streams), build(kind, S, m, training)
        validate(shared)
        assert shared.num_streams == max(streams) + 1
        for s in range(S):
            assert _stage_order(shared, s) == _stage_order(own, s)
        assert shared.peak_in_flight() == own.peak_in_flight()


# -- recomputation -----------------------------------------------------------------------


def test_recompute_grids_are_exact():
    assert build(P.Grouped, 2, 2, True, recompute=[True, False]).text() == [
        _r("0F0 ."), _r("0F1 1F0"), _r(". 1B0"), _r(". 1F1"), _r("0R0 ."), _r("0B0 1B1"),
        _r("0R1 ."), _r("0B1 ."), _r("0G 1G"), _r("U ."),
    ]
    assert build(P.Sequential, 2, 1, True, recompute=[True, True]).text() == [
        _r("0F0 ."), _r(". 1F0"), _r(". 1R0"), _r(". 1B0"), _r("0R0 ."), _r("0B0 ."),
        _r(". 1G"), _r("0G ."), _r("U ."),
    ]


def test_a_grid_of_one_action_per_row_is_a_total_order():
    """Sequential: each action also waits for the one before it, on whatever stream."""
    s = sequential(2, 2, True, (0, 1))

    def deps(text):
        return [str(d) for d in s.dependencies(Action.parse(text))]

    assert deps("1G") == ["1B0", "1B1", "0B1"]    # 0B1 ran just before it on stream 0
    assert deps("0F1") == ["0F0", "0B0"]          # already a dependency: not repeated
    assert deps("1F0") == ["0F0"]
    concurrent = build(P.Grouped, 2, 2, True)
    assert [str(d) for d in concurrent.dependencies(Action.parse("1G"))] == ["1B0", "1B1"]


@pytest.mark.parametrize("kind", list(P))
@pytest.mark.parametrize("streams, recompute", [
    ((0,), (True,)), ((0, 1), (True, True)), ((0, 1, 2), (False, True, False)),
    ((0, 1, 2, 3), (True, False, True, True)), ((0, 1, 0), (True, True, False)),
    ((0, 0), (False, True)),
])
def test_recompute_runs_right_before_each_backward_of_its_stage(kind, streams, recompute):
    S = len(streams)
    for m in (1, 2, 5):
        s = build(kind, S, m, True, streams, recompute)
        assert s.recompute == recompute
        for acts in s.per_stream():
            for k, a in enumerate(acts):
                if a.kind.input_grads and recompute[a.stage]:
                    assert acts[k - 1] == Action(Kind.RECOMPUTE, a.stage, a.microbatch), (m, str(a))
                if a.kind is Kind.RECOMPUTE:
                    assert recompute[a.stage] and acts[k + 1].kind.input_grads
        assert len([a for a in s.actions() if a.kind is Kind.RECOMPUTE]) == m * sum(recompute)
        plain = build(kind, S, m, True, streams)
        assert _without_recompute(s) == plain.text()  # only rows were inserted
        assert s.peak_in_flight() == plain.peak_in_flight()


@pytest.mark.parametrize("kind, extra", [
    (P.Grouped, lambda S, m: m + S - 1), (P.GPipe, lambda S, m: m + S - 1),
    (P.Interleaved, lambda S, m: 2 * m + S - 2 if S > 1 else m), (P.Sequential, lambda S, m: S * m),
])
def test_recomputing_every_stage_adds_one_row_per_row_of_backwards(kind, extra):
    for S in range(1, 9):
        for m in (1, 2, 3, 7, 32):
            plain = len(BUILDERS[kind](S, m, True, range(S)).rows)
            recomputed = len(BUILDERS[kind](S, m, True, range(S), [True] * S).rows)
            assert recomputed == plain + extra(S, m), (S, m)


@pytest.mark.parametrize("kind", list(P))
def test_inference_and_no_recomputed_stage_have_no_recompute(kind):
    s = build(kind, 3, 4, False, recompute=[True] * 3)
    assert s.recompute == () and s.text() == build(kind, 3, 4, False).text()
    assert build(kind, 3, 4, True, recompute=[False] * 3).text() == build(kind, 3, 4, True).text()


def test_validate_refuses_a_missing_or_late_recompute():
    good = build(P.Sequential, 1, 1, True, recompute=[True])
    assert good.text() == [_r("0F0"), _r("0R0"), _r("0B0"), _r("0G"), _r("U")]
    rows = good.rows
    with pytest.raises(ValueError, match="0B0 at row 1 runs before 0R0"):
        validate(Schedule("bad", 1, 1, True, (0,), rows[:1] + rows[2:], (True,)))
    with pytest.raises(ValueError, match="0B0 at row 1 runs before 0R0"):
        validate(Schedule("bad", 1, 1, True, (0,), (rows[0], rows[2], rows[1]) + rows[3:], (True,)))
    with pytest.raises(ValueError, match="0R0 at row 1 is not an action of this schedule"):
        validate(Schedule("bad", 1, 1, True, (0,), rows))  # R of a stage that does not recompute
    with pytest.raises(ValueError, match="needs one flag per stage"):
        validate(Schedule("bad", 1, 1, True, (0,), rows, (True, False)))


# -- dependencies: what a stream waits for without row barriers --------------------------


def test_dependencies_are_exact_and_limited_to_the_schedule():
    s = build(P.Interleaved, 2, 2, True, recompute=[True, False])

    def deps(text):
        return [str(d) for d in s.dependencies(Action.parse(text))]

    assert deps("1F1") == ["0F1", "1F0"]
    assert deps("0R1") == ["0F1"]
    assert deps("0B1") == ["0F1", "1B1", "0B0", "0R1"]
    assert deps("1B0") == ["1F0"]
    assert deps("0G") == ["0B0", "0B1"]
    assert deps("U") == ["0G", "1G"]
    inference = build(P.Interleaved, 2, 2, False)
    assert [str(d) for d in inference.dependencies(Action.parse("0B1"))] == ["0F1"]


@pytest.mark.parametrize("kind", list(P))
@pytest.mark.parametrize("streams, recompute", [
    ((0, 1, 2), None), ((0, 1, 0), (True, False, True)),
])
def test_streams_waiting_on_dependencies_run_every_action(kind, streams, recompute):
    """Run each stream's list in order, an action once its dependencies are done: no deadlock."""
    for training in (True, False):
        s = build(kind, len(streams), 4, training, streams, recompute)
        queues, done = [list(acts) for acts in s.per_stream()], set()
        while any(queues):
            moved = False
            for q in queues:
                while q and all(d in done for d in s.dependencies(q[0])):
                    done.add(q.pop(0))
                    moved = True
            assert moved, [str(q[0]) for q in queues if q]
        assert done == set(s.actions())


def test_list_scheduling_refuses_orders_that_deadlock():
    f, b = Action(Kind.FORWARD, 0, 0), Action(Kind.BACKWARD, 0, 0)
    assert _list_schedule([[f, b]], 1, 1, True) == [[f], [b]]
    with pytest.raises(ValueError, match="deadlock at row 0: 0B0"):
        _list_schedule([[b, f]], 1, 1, True)


# -- validate, text form, render, build -----------------------------------------------------


def test_validate_rejects_a_backward_before_its_forward():
    good = sequential(2, 1, True, [0, 1])
    rows = list(good.rows)
    rows[0], rows[1] = rows[1], rows[0]  # 1F0 before 0F0
    bad = Schedule("bad", 2, 1, True, (0, 1), tuple(rows))
    with pytest.raises(ValueError, match="1F0 at row 0 runs before 0F0"):
        validate(bad)


def test_validate_rejects_missing_and_repeated_actions():
    good = sequential(1, 2, True, [0])
    with pytest.raises(ValueError, match="0G at row 3 runs before 0B1"):
        validate(Schedule("bad", 1, 2, True, (0,), tuple(r for r in good.rows if str(r[0]) != "0B1")))
    inference = sequential(2, 2, False, [0, 1])
    with pytest.raises(ValueError, match="never scheduled: 1F1"):
        validate(Schedule("bad", 2, 2, False, (0, 1), inference.rows[:-1]))
    with pytest.raises(ValueError, match="appears twice"):
        validate(Schedule("bad", 1, 2, True, (0,), good.rows[:1] + good.rows))


def test_validate_rejects_wrong_stream():
    rows = ((None, Action(Kind.FORWARD, 0, 0)),)
    with pytest.raises(ValueError, match="0F0 is on stream 1"):
        validate(Schedule("bad", 1, 1, False, (0, 0, 1)[:1] + (1,), rows))


def test_action_text_round_trips():
    for text in ["0F0", "12B31", "3R2", "1G", "U"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("0B3") == Action(Kind.BACKWARD, 0, 3)
    with pytest.raises(ValueError):
        Action.parse("X1")


def test_render_marks_the_failing_row():
    text = sequential(2, 1, False, [0, 1]).render(mark_row=1)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "|", "s0", "|", "s1"]
    assert lines[3].startswith(">>   1 |")
    assert "1F0" in lines[3]
    assert lines[0].index("|") == lines[2].index("|") == lines[3].index("|")
    assert all(line == line.rstrip() for line in lines)


@pytest.mark.parametrize("kind", list(P))
def test_build_does_not_warn_for_any_kind(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for S in (1, 2, 3):
            assert build(kind, S, 3, True).name == kind.value


def test_build_refuses_shapes_it_cannot_schedule():
    for args in [(0, 2, None, None), (2, 0, None, None), (2, 2, (0,), None), (2, 2, None, (True,))]:
        S, m, streams, recompute = args
        with pytest.raises(ValueError, match="one stream"):
            build(P.Grouped, S, m, True, streams, recompute)


# -- zero bubble: the backward split into I and W ([Note: zero bubble]) -----------------

UNIT = {Kind.FORWARD: 1, Kind.BACKWARD: 2, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}


def test_zero_bubble_grid_is_exact_and_its_ws_fill_the_bubble():
    assert build(P.ZeroBubble, 2, 3, True).text() == [
        _r("0F0 ."), _r("0F1 1F0"), _r(". 1I0"), _r("0I0 1W0"), _r("0W0 1F1"), _r("0F2 1I1"),
        _r("0I1 1W1"), _r("0W1 1F2"), _r(". 1I2"), _r("0I2 1W2"), _r("0W2 ."), _r("0G 1G"),
        _r("U ."),
    ]
    # bubble (S-1)·(F+I) against 1F1B's (S-1)·(F+B): each stream's work is 3·m
    for S, m in [(2, 2), (2, 8), (3, 5), (4, 8), (6, 16)]:
        zb, ofb = build(P.ZeroBubble, S, m, True), build(P.Interleaved, S, m, True)
        assert zb.makespan(UNIT) == 3 * m + (S - 1) * 2, (S, m)
        assert ofb.makespan(UNIT) == 3 * m + (S - 1) * 3, (S, m)


def test_zero_bubble_dependencies_and_validation():
    s = build(P.ZeroBubble, 2, 2, True, recompute=[True, False])

    def deps(text):
        return [str(d) for d in s.dependencies(Action.parse(text))]

    assert Action.parse("1I0") == Action(Kind.BACKWARD_INPUT, 1, 0) and s.split
    assert deps("0I1") == ["0F1", "1I1", "0I0", "0R1"]
    assert deps("0W1") == ["0I1", "0W0"]
    assert deps("1G") == ["1W0", "1W1"]
    assert deps("0G") == ["0W0", "0W1", "1W1"]  # a weight stage 1 shares gets its W there
    rows = build(P.ZeroBubble, 1, 1, True).rows
    assert [[str(a) for a in r] for r in rows] == [["0F0"], ["0I0"], ["0W0"], ["0G"], ["U"]]
    with pytest.raises(ValueError, match="0W0 at row 1 runs before 0I0"):
        validate(Schedule("bad", 1, 1, True, (0,), (rows[0], rows[2], rows[1]) + rows[3:],
                          split=True))
    with pytest.raises(ValueError, match="0I0 at row 1 is not an action"):
        validate(Schedule("bad", 1, 1, True, (0,), rows))  # I and W in an unsplit schedule


@pytest.mark.parametrize("streams", [(0, 1, 1, 0), (0, 1, 0, 1), (0, 1, 2, 2, 1, 0)])
def test_virtual_stages_interleave_on_their_streams_with_a_smaller_bubble(streams):
    """IPUs repeating: the V of ZBV, the loop of Interleaved1F1B; 1F1B's peak per stage."""
    S = len(streams)
    for m in (1, 2, 4, 8):
        zb, ofb = build(P.ZeroBubble, S, m, True, streams), build(P.Interleaved, S, m, True, streams)
        assert zb.num_streams == max(streams) + 1
        assert zb.peak_in_flight() == ofb.peak_in_flight() == [min(m, S - s) for s in range(S)]
        if m >= 4:
            assert zb.makespan(UNIT) < ofb.makespan(UNIT), (m, zb.render())
