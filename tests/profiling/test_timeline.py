"""Executed timelines on hand-made spans: exact numbers, charts and traces; no torch involved."""

import dataclasses
import json
import threading
import xml.etree.ElementTree as ET

import pytest

from poptorch_lite.runtime.schedule import Action
from poptorch_lite.runtime.schedule_kinds import sequential
from poptorch_lite.profiling.timeline import Recorder, Span, Timeline
from poptorch_lite.profiling.timeline_svg import COLOURS, nice_ticks, render

NAMES = ["ipu0 (cpu)", "ipu1 (cpu)"]


def one_f_one_b() -> Timeline:
    """S=2, m=2, one second per action; busy: stream 0 6 s, stream 1 5 s, of 8 s.

        time | 0   1   2   3   4   5   6   7
        s0   | 0F0 0F1 .   0B0 .   0B1 0G  U
        s1   | .   1F0 1B0 1F1 1B1 1G  .   .
    """
    return Timeline([
        Span(0, 0, 0, "F", 0, 1), Span(0, 0, 1, "F", 1, 2), Span(0, 0, 0, "B", 3, 4),
        Span(0, 0, 1, "B", 5, 6), Span(0, 0, None, "G", 6, 7), Span(0, None, None, "U", 7, 8),
        Span(1, 1, 0, "F", 1, 2), Span(1, 1, 0, "B", 2, 3), Span(1, 1, 1, "F", 3, 4),
        Span(1, 1, 1, "B", 4, 5), Span(1, 1, None, "G", 5, 6),
    ], NAMES, "1f1b")


def from_grid(schedule) -> Timeline:
    """The timeline of a schedule whose every step takes exactly one second."""
    spans = [Span(k, a.stage, a.microbatch, a.kind.value, t, t + 1)
             for t, row in enumerate(schedule.rows) for k, a in enumerate(row) if a is not None]
    return Timeline(spans, [f"ipu{k}" for k in range(schedule.num_streams)], schedule.name)


@pytest.mark.parametrize("module, allowed", [
    ("profiling.timeline", {"__future__", "dataclasses", "json", "typing", "spans", "timeline_svg"}),
    ("profiling.timeline_svg", {"__future__", "math", "xml", "spans"}),
    ("profiling.spans", {"__future__", "dataclasses", "typing"}),
])
def test_timeline_modules_do_not_import_torch(module, allowed):
    import ast
    import importlib
    path = importlib.import_module(f"poptorch_lite.{module}").__file__
    tree = ast.parse(open(path).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)}
    assert imported <= allowed


@pytest.mark.parametrize("text", ["1F0", "0B3", "2R1", "1G", "U", "12F34"])
def test_span_label_is_the_schedule_text_form(text):
    a = Action.parse(text)
    assert Span(0, a.stage, a.microbatch, a.kind.value, 0, 1).label == text == str(a)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="X"), "span kind 'X' is not one of FBIWRGU"),
    (dict(start=2.0, end=1.0), "span 0F0 ends at 1.0 before it starts at 2.0"),
])
def test_span_refuses_bad_values(kwargs, match):
    fields = dict(stream=0, stage=0, microbatch=0, kind="F", start=0.0, end=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        Span(**fields)


def test_timeline_refuses_a_span_on_an_unnamed_stream():
    with pytest.raises(ValueError, match="span 2F0 is on stream 2 but the timeline names 2 str"):
        Timeline([Span(2, 2, 0, "F", 0, 1)], NAMES, "x")


def test_spans_are_sorted_by_start_then_stream():
    t = one_f_one_b()
    assert [p.label for p in t.spans] == [
        "0F0", "0F1", "1F0", "1B0", "0B0", "1F1", "1B1", "0B1", "1G", "0G", "U"]


def test_one_f_one_b_numbers_are_exact():
    t = one_f_one_b()
    assert t.makespan == 8
    assert t.utilisation() == [6 / 8, 5 / 8]
    assert t.bubble_fraction() == 1 - 11 / 16
    assert t.phases() == {"ramp_up": (0, 1), "main": (1, 5), "ramp_down": (5, 8)}


def test_sequential_grid_numbers_are_exact():
    # Steps of sequential(2, 2): s1 starts at 1; s1's last backward (1B1) ends at 7, before 0B1.
    t = from_grid(sequential(2, 2, True, [0, 1]))
    assert t.makespan == 11
    assert t.utilisation() == [6 / 11, 5 / 11]
    assert t.bubble_fraction() == 0.5
    assert t.phases() == {"ramp_up": (0, 1), "main": (1, 7), "ramp_down": (7, 11)}


@pytest.mark.parametrize("S", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("training", [True, False])
def test_sequential_bubble_is_one_minus_one_over_streams(S, m, training):
    # One action at a time: total busy = makespan, so the bubble is 1 - 1/S.
    t = from_grid(sequential(S, m, training, list(range(S))))
    assert t.makespan == len(sequential(S, m, training, list(range(S))).rows)
    assert sum(t.utilisation()) == pytest.approx(1.0, abs=1e-12)
    assert t.bubble_fraction() == pytest.approx(1 - 1 / S, abs=1e-12)


def test_overlapping_spans_on_a_stream_count_once():
    t = Timeline([Span(0, 0, 0, "F", 0, 2), Span(0, 0, 1, "F", 1, 3), Span(0, 0, 2, "F", 3.5, 4),
                  Span(1, 1, 0, "F", 2, 4), Span(1, 1, 1, "F", 2.5, 3)], NAMES, "x")
    assert t.utilisation() == [3.5 / 4, 2 / 4]
    assert t.bubble_fraction() == 1 - 5.5 / 8


def test_a_stream_that_never_works_is_all_bubble():
    t = Timeline([Span(0, 0, 0, "F", 0, 1)], ["a", "b", "c", "d"], "x")
    assert t.utilisation() == [1.0, 0.0, 0.0, 0.0]
    assert t.bubble_fraction() == 0.75
    assert t.phases() == {"ramp_up": (0, 0), "main": (0, 1), "ramp_down": (1, 1)}


def test_times_are_measured_from_the_first_start():
    t = Timeline([Span(0, 0, 0, "F", 2, 3), Span(1, 1, 0, "F", 3, 4)], NAMES, "x")
    assert t.makespan == 2
    assert t.utilisation() == [0.5, 0.5]
    assert t.phases() == {"ramp_up": (2, 3), "main": (3, 3), "ramp_down": (3, 4)}


def test_phases_when_the_pipeline_never_fills():
    # S=3 inference, m=1: stream 0 is done before stream 2 starts; main is empty at t1.
    t = from_grid(sequential(3, 1, False, [0, 1, 2]))
    assert t.phases() == {"ramp_up": (0, 2), "main": (2, 2), "ramp_down": (2, 3)}


def test_phases_with_only_reduce_and_update():
    t = Timeline([Span(1, 1, None, "G", 0, 1), Span(0, 0, None, "G", 1, 2),
                  Span(0, None, None, "U", 2, 3)], NAMES, "x")
    assert t.phases() == {"ramp_up": (0, 1), "main": (1, 1), "ramp_down": (1, 3)}


def test_recompute_counts_as_work_for_ramp_down():
    t = Timeline([Span(0, 0, 0, "F", 0, 1), Span(1, 1, 0, "F", 1, 2), Span(1, 1, 0, "B", 2, 3),
                  Span(0, 0, 0, "R", 3, 4), Span(0, 0, 0, "B", 4, 5)], NAMES, "x")
    assert t.phases() == {"ramp_up": (0, 1), "main": (1, 3), "ramp_down": (3, 5)}


def test_single_stream():
    t = from_grid(sequential(1, 2, True, [0]))  # 0F0 0B0 0F1 0B1 0G U
    assert t.makespan == 6
    assert t.utilisation() == [1.0]
    assert t.bubble_fraction() == 0.0
    assert t.phases() == {"ramp_up": (0, 0), "main": (0, 4), "ramp_down": (4, 6)}
    assert t.render(width=6).splitlines()[1:3] == [
        "ipu0   FBFBGU", "phases |---|-|  |ramp-up|main|ramp-down|"]


@pytest.mark.parametrize("names", [[], NAMES])
def test_empty_timeline(names):
    t = Timeline([], names, "x")
    assert t.makespan == 0.0
    assert t.utilisation() == [0.0] * len(names)
    assert t.bubble_fraction() == 0.0
    assert t.phases() == {"ramp_up": (0.0, 0.0), "main": (0.0, 0.0), "ramp_down": (0.0, 0.0)}
    assert t.render() == "schedule x: no spans"
    assert t.summary().splitlines()[0] == (
        f"schedule x: {len(names)} streams, 0 spans, 0 runs, makespan 0.000 us")
    assert Timeline.from_chrome_trace(t.to_chrome_trace()) == t


def test_zero_length_spans():
    t = Timeline([Span(0, 0, 0, "F", 1, 1), Span(1, 1, 0, "F", 1, 1)], NAMES, "x")
    assert (t.makespan, t.utilisation(), t.bubble_fraction()) == (0, [0.0, 0.0], 0.0)
    assert t.render(width=4).splitlines()[1:4] == [
        "ipu0 (cpu) F...", "ipu1 (cpu) F...", "phases     |----  |ramp-up|main|ramp-down|"]


@pytest.mark.parametrize("width, column, rows, axis", [
    (16, "500.000 ms", ["FFFF..BB..BBGGUU", "..FFBBFFBBGG...."], "|-|-------|-----|"),
    (8, "1.000 s", ["FF.B.BGU", ".FBFBG.."], "||---|--|"),
    (4, "2.000 s", ["FFBU", ".BBG"], "||-||"),
])
def test_render_is_exact(width, column, rows, axis):
    # Spans cover the columns of their rounded start and end; a later span overwrites.
    assert one_f_one_b().render(width=width) == "\n".join([
        f"schedule 1f1b: makespan 8.000 s, 1 column = {column}",
        f"ipu0 (cpu) {rows[0]}",
        f"ipu1 (cpu) {rows[1]}",
        f"phases     {axis}  |ramp-up|main|ramp-down|",
        "legend: F forward, B backward, R recompute, G reduce, U update, . idle",
    ])


def test_render_shows_the_late_start_of_each_stream():
    t = from_grid(sequential(3, 1, True, [0, 1, 2]))  # 10 steps, one column each
    assert t.render(width=10).splitlines()[1:5] == [
        "ipu0   F....B..GU",
        "ipu1   .F..B..G..",
        "ipu2   ..FB..G...",
        "phases |-|-|-----|  |ramp-up|main|ramp-down|",  # ipu2 starts at 2, ends 2B0 at 4
    ]


def test_render_of_more_spans_than_columns_shows_the_last_run():
    runs = [Timeline([dataclasses.replace(p, start=p.start + 8 * k, end=p.end + 8 * k)
                      for p in one_f_one_b().spans], NAMES, "1f1b") for k in range(3)]
    t = Timeline.concat(runs)  # 3 runs of 6 spans on ipu0: more than 16 columns
    assert t.render(width=16) == "\n".join([
        "schedule 1f1b: makespan 8.000 s, 1 column = 500.000 ms; the last of 3 runs (a stream "
        "has 18 spans, more than 16 columns)",
        "ipu0 (cpu) FFFF..BB..BBGGUU",
        "ipu1 (cpu) ..FFBBFFBBGG....",
        "phases     |-|-------|-----|  |ramp-up|main|ramp-down|",
        "legend: F forward, B backward, R recompute, G reduce, U update, . idle",
    ])
    assert t.render(width=18).splitlines()[0] == "schedule 1f1b: makespan 24.000 s, 1 column = " \
                                                 "1.333 s"  # 18 spans fit in 18 columns


def test_render_refuses_no_columns():
    with pytest.raises(ValueError, match=r"render\(width=0\) needs at least 1 column"):
        one_f_one_b().render(width=0)


def test_summary_is_exact():
    assert one_f_one_b().summary() == "\n".join([
        "schedule 1f1b: 2 streams, 11 spans, 1 run, makespan 8.000 s",
        "  ipu0 (cpu)  utilisation  75.0%",
        "  ipu1 (cpu)  utilisation  62.5%",
        "  bubble 31.2%",
        "  phases: ramp-up 1.000 s, main 4.000 s, ramp-down 3.000 s",
    ])


@pytest.mark.parametrize("scale, unit", [(1.0, "8.000 s"), (1e-3, "8.000 ms"), (1e-6, "8.000 us")])
def test_summary_picks_a_unit_for_the_makespan(scale, unit):
    spans = [dataclasses.replace(p, start=p.start * scale, end=p.end * scale)
             for p in one_f_one_b().spans]
    assert Timeline(spans, NAMES, "x").summary().splitlines()[0].endswith(f"makespan {unit}")


def test_chrome_trace_contents():
    trace = one_f_one_b().to_chrome_trace()
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert len(events) == 11 + 1 + 2
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 11
    assert complete[0] == {"ph": "X", "pid": 0, "tid": 0, "name": "0F0", "cat": "forward",
                           "ts": 0.0, "dur": 1e6,
                           "args": {"stage": 0, "microbatch": 0, "run": 0}}
    assert [(e["tid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in complete[-3:]] == [
        (1, "1G", "reduce", 5e6, 1e6), (0, "0G", "reduce", 6e6, 1e6), (0, "U", "update", 7e6, 1e6)]
    assert complete[-1]["args"] == {"stage": None, "microbatch": None, "run": 0}
    assert [e for e in events if e["ph"] == "M"] == [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name",
         "args": {"name": "poptorch_lite 1f1b"}},
        {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "ipu0 (cpu)"}},
        {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name", "args": {"name": "ipu1 (cpu)"}},
    ]


@pytest.mark.parametrize("kind, cat", [("F", "forward"), ("B", "backward"), ("R", "recompute"),
                                       ("G", "reduce"), ("U", "update")])
def test_chrome_trace_category_of_each_kind(kind, cat):
    (e, *_) = Timeline([Span(0, 0, None, kind, 0.25, 0.75)], ["a"], "x").to_chrome_trace()[
        "traceEvents"]
    assert (e["cat"], e["ts"], e["dur"]) == (cat, 250000.0, 500000.0)


def test_chrome_trace_round_trips_through_json_and_a_file(tmp_path):
    t = Timeline.concat([one_f_one_b(), one_f_one_b()])
    assert Timeline.from_chrome_trace(json.loads(json.dumps(t.to_chrome_trace()))) == t
    path = tmp_path / "trace.json"
    t.write_chrome_trace(path)
    with open(path) as f:
        back = Timeline.from_chrome_trace(json.load(f))
    assert back == t
    assert (back.stream_names, back.schedule_name) == (NAMES, "1f1b")
    assert Timeline.from_chrome_trace(t.to_chrome_trace()["traceEvents"]) == t  # a bare event list


def test_chrome_trace_round_trip_of_inexact_times():
    t = Timeline([Span(0, 0, 0, "F", 0.1, 0.3), Span(1, 1, 0, "F", 0.3, 0.7000001)], NAMES, "x")
    back = Timeline.from_chrome_trace(t.to_chrome_trace())
    for p, q in zip(t.spans, back.spans):
        assert (q.start, q.end) == pytest.approx((p.start, p.end), abs=1e-12)
        assert (q.stream, q.label, q.run) == (p.stream, p.label, p.run)


def test_from_chrome_trace_names_unnamed_streams_and_ignores_other_events():
    events = [{"ph": "X", "pid": 0, "tid": 1, "name": "1F0", "cat": "forward", "ts": 0, "dur": 2,
               "args": {"stage": 1, "microbatch": 0}},
              {"ph": "C", "pid": 0, "tid": 0, "name": "memory", "ts": 0, "args": {"bytes": 1}}]
    t = Timeline.from_chrome_trace({"traceEvents": events})
    assert (t.stream_names, t.schedule_name) == (["stream 0", "stream 1"], "")
    assert t.spans == [Span(1, 1, 0, "F", 0.0, 2e-6, 0)]


def test_from_chrome_trace_refuses_foreign_events():
    events = [{"ph": "X", "pid": 0, "tid": 0, "name": "conv", "cat": "kernel", "ts": 0, "dur": 1}]
    with pytest.raises(ValueError, match="'conv' has category 'kernel', not one of"):
        Timeline.from_chrome_trace({"traceEvents": events})


def test_concat_numbers_runs_and_keeps_times():
    runs = [Timeline([Span(0, 0, 0, "F", 2 * r, 2 * r + 1),
                      Span(1, 1, 0, "F", 2 * r + 1, 2 * r + 2)], NAMES, "seq") for r in range(3)]
    t = Timeline.concat(runs)
    assert [(p.label, p.run, p.start) for p in t.spans] == [
        ("0F0", 0, 0), ("1F0", 0, 1), ("0F0", 1, 2), ("1F0", 1, 3), ("0F0", 2, 4), ("1F0", 2, 5)]
    assert t.makespan == 6
    assert t.phases() == {"ramp_up": (0, 1), "main": (1, 5), "ramp_down": (5, 6)}
    assert t.summary().splitlines()[0] == (
        "schedule seq: 2 streams, 6 spans, 3 runs, makespan 6.000 s")


def test_concat_of_concats_and_empty_runs_keeps_counting():
    a = Timeline([Span(0, 0, 0, "F", 0, 1)], ["a"], "x")
    b = Timeline([Span(0, 0, 0, "F", 2, 3)], ["a"], "x")
    t = Timeline.concat([Timeline.concat([a, b]), Timeline([], ["a"], "x"), b])
    assert [p.run for p in t.spans] == [0, 1, 3]


@pytest.mark.parametrize("other, match", [
    (Timeline([], ["other"], "x"), "cannot join runs of different calls"),
    (Timeline([], ["a"], "y"), "cannot join runs of different calls"),
])
def test_concat_refuses_runs_of_different_calls(other, match):
    with pytest.raises(ValueError, match=match):
        Timeline.concat([Timeline([], ["a"], "x"), other])


def test_concat_refuses_nothing():
    with pytest.raises(ValueError, match="at least one timeline"):
        Timeline.concat([])


def test_recorder_makes_times_relative_and_sorts():
    r = Recorder(origin=100.0)
    r.add(1, 1, 0, "F", 101.0, 102.0)
    r.add(0, 0, 0, "F", 100.0, 101.0, run=2)
    t = r.timeline(NAMES, "seq")
    assert t.spans == [Span(0, 0, 0, "F", 0.0, 1.0, 2), Span(1, 1, 0, "F", 1.0, 2.0, 0)]
    assert (t.stream_names, t.schedule_name) == (NAMES, "seq")


def test_recorder_from_several_threads():
    r, barrier = Recorder(origin=0.0), threading.Barrier(4)

    def work(k):
        barrier.wait()
        for i in range(1000):
            r.add(k, k, i, "F", k + i * 4.0, k + i * 4.0 + 1.0)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t = r.timeline([f"ipu{k}" for k in range(4)], "seq")
    assert len(t.spans) == 4000
    assert {(p.stream, p.microbatch) for p in t.spans} == {
        (k, i) for k in range(4) for i in range(1000)}
    assert [p.start for p in t.spans] == [float(n) for n in range(4000)]
    assert t.utilisation() == [0.25] * 4


# -- the SVG picture --------------------------------------------------------------------------

SVG = "{http://www.w3.org/2000/svg}"


def svg_tree(timeline, tmp_path, **kwargs) -> ET.Element:
    path = tmp_path / "t.svg"
    timeline.write_svg(path, **kwargs)
    return ET.parse(path).getroot()


def by_class(root, cls):
    return [e for e in root.iter() if e.get("class") == cls]


def text_of(group, cls):
    return [e.text for e in group.iter(f"{SVG}text") if e.get("class") == cls]


def test_svg_has_a_row_per_stream_and_a_box_per_action(tmp_path):
    t = one_f_one_b()
    root = svg_tree(t, tmp_path)
    assert root.tag == f"{SVG}svg" and root.get("width") == "1200"
    rows = by_class(root, "row")
    assert [(r.get("data-stream"), r.get("data-name")) for r in rows] == [
        ("0", "ipu0 (cpu)"), ("1", "ipu1 (cpu)")]
    assert [text_of(r, "stream") for r in rows] == [["ipu0 (cpu)"], ["ipu1 (cpu)"]]
    for k, row in enumerate(rows):  # each stream's boxes, in start order, coloured by kind
        boxes = by_class(row, "span")
        assert [b.get("data-label") for b in boxes] == [p.label for p in t.spans if p.stream == k]
        for b in boxes:
            (rect,) = b.iter(f"{SVG}rect")
            assert rect.get("fill") == COLOURS[b.get("data-kind")]
            assert rect.find(f"{SVG}title").text.startswith(b.get("data-label") + " (")
    # the micro-batch number in each F/B box, the kind letter in reductions and the update
    assert [text_of(b, "mb") for b in by_class(rows[0], "span")] == [
        ["0"], ["1"], ["0"], ["1"], ["G"], ["U"]]


def test_svg_boxes_are_placed_on_the_time_scale(tmp_path):
    root = svg_tree(one_f_one_b(), tmp_path)
    rects = [next(b.iter(f"{SVG}rect")) for b in by_class(root, "span")]
    xs = sorted({float(r.get("x")) for r in rects})
    widths = {round(float(r.get("width")), 2) for r in rects}
    assert len(xs) == 8 and len(widths) == 1  # 8 one-second steps, every action lasts 1 s
    steps = {round(b - a, 2) for a, b in zip(xs, xs[1:])}
    assert steps == widths


def test_svg_marks_the_phases_and_has_an_axis_and_a_legend(tmp_path):
    root = svg_tree(one_f_one_b(), tmp_path)
    phases = by_class(root, "phase")
    assert [p.get("data-phase") for p in phases] == ["ramp-up", "main", "ramp-down"]
    assert [e.text for e in by_class(root, "phase-label")] == ["ramp-up", "main", "ramp-down"]
    widths = [float(p.get("width")) for p in phases]  # phases (0, 1), (1, 5), (5, 8) seconds
    assert widths[1] == pytest.approx(4 * widths[0]) and widths[2] == pytest.approx(3 * widths[0])
    bounds = sorted(float(line.get("x1")) for line in by_class(root, "phase-bound"))
    assert bounds == pytest.approx([float(phases[1].get("x")), float(phases[2].get("x"))])
    assert [e.text for e in by_class(root, "tick-label")] == [str(k) for k in range(9)]
    assert len(by_class(root, "tick")) == 9
    assert [e.text for e in by_class(root, "axis-label")] == ["time (s)"]
    assert [e.get("data-kind") for e in by_class(root, "swatch")] == ["F", "B", "G", "U"]
    assert [e.text for e in by_class(root, "legend-label")] == [
        "F forward", "B backward", "G reduce", "U update"]
    assert [e.text for e in by_class(root, "phase-legend-label")] == [
        "ramp-up", "main", "ramp-down"]
    assert by_class(root, "title")[0].text == (
        "schedule 1f1b: 2 streams, 11 actions, makespan 8.000 s, bubble 31.2%")


def test_svg_of_a_real_grid_with_recompute_and_a_narrow_picture(tmp_path):
    t = from_grid(sequential(3, 4, True, [0, 1, 2], (True, True, True)))
    root = svg_tree(t, tmp_path, width=300)
    assert len(by_class(root, "span")) == len(t.spans)
    assert {e.get("data-kind") for e in by_class(root, "swatch")} == set("FBRGU")
    assert len(by_class(root, "mb")) < len(t.spans)  # numbers that do not fit are left out
    with pytest.raises(ValueError, match=r"write_svg\(width=120\) leaves"):
        t.write_svg(tmp_path / "x.svg", width=120)


def test_svg_of_an_empty_timeline(tmp_path):
    root = svg_tree(Timeline([], NAMES, "x"), tmp_path)
    assert len(by_class(root, "row")) == 2 and by_class(root, "span") == []
    assert [e.text for e in by_class(root, "empty")] == ["no spans"]


def test_svg_escapes_names():
    svg = render(Timeline([Span(0, 0, 0, "F", 0, 1)], ["a<b> & 'c'"], "s&t"))
    root = ET.fromstring(svg)
    assert by_class(root, "row")[0].get("data-name") == "a<b> & 'c'"
    assert by_class(root, "title")[0].text.startswith("schedule s&t:")


@pytest.mark.parametrize("length, target, ticks", [
    (8.0, 8, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
    (74.169, 8, [0, 10, 20, 30, 40, 50, 60, 70]),
    (168.2, 8, [0, 50, 100, 150]),
    (0.037, 5, [0, 0.01, 0.02, 0.03]),
    (0.0, 8, [0.0]),
])
def test_nice_ticks(length, target, ticks):
    assert nice_ticks(length, target) == pytest.approx(ticks)


def test_docstring_examples_run():
    import doctest

    from poptorch_lite.profiling import timeline, timeline_svg
    for module in (timeline, timeline_svg):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0
