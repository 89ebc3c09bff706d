"""Schedules as lists: exact action order, step counts, dependencies; no torch involved."""

import pytest

from poptorch_lite.enums import PipelineSchedule
from poptorch_lite.schedule import Action, Kind, Schedule, build, sequential, validate


def test_schedule_modules_do_not_import_torch():
    import ast
    import poptorch_lite.enums
    import poptorch_lite.schedule
    for module in (poptorch_lite.schedule, poptorch_lite.enums):
        tree = ast.parse(open(module.__file__).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, module.__name__


def test_sequential_training_grid_is_exact():
    s = sequential(2, 2, True, [0, 1])
    assert s.text() == [
        ["0F0", ""], ["", "1F0"], ["", "1B0"], ["0B0", ""],
        ["0F1", ""], ["", "1F1"], ["", "1B1"], ["0B1", ""],
        ["", "1G"], ["0G", ""], ["U", ""],
    ]


def test_sequential_inference_grid_is_exact():
    assert sequential(3, 2, False, [0, 1, 2]).text() == [
        ["0F0", "", ""], ["", "1F0", ""], ["", "", "2F0"],
        ["0F1", "", ""], ["", "1F1", ""], ["", "", "2F1"],
    ]


@pytest.mark.parametrize("S", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 32])
@pytest.mark.parametrize("training", [True, False])
def test_sequential_steps_dependencies_and_peak(S, m, training):
    s = sequential(S, m, training, list(range(S)))
    validate(s)
    assert len(s.rows) == (2 * S * m + S + 1 if training else S * m)
    assert all(sum(a is not None for a in row) == 1 for row in s.rows)  # one action at a time
    assert s.peak_in_flight() == [1] * S


def test_stages_sharing_an_ipu_share_a_stream():
    s = sequential(3, 1, False, [0, 1, 0])
    assert s.num_streams == 2
    assert [[str(a) for a in acts] for acts in s.per_stream()] == [["0F0", "2F0"], ["1F0"]]


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


def test_build_runs_unimplemented_kinds_as_sequential_with_one_warning():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = build(PipelineSchedule.Grouped, 2, 3, True)
        build(PipelineSchedule.Grouped, 2, 3, True)
        build(PipelineSchedule.Grouped, 1, 3, True)  # one stage: every kind is the same
    assert a.text() == sequential(2, 3, True, [0, 1]).text()
    assert len([w for w in caught if "Grouped" in str(w.message)]) == 1
