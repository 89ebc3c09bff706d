"""The executed timeline of a pipeline run: what each stream did, and when.

A schedule ([Note: schedule grid]) says what runs in which order; a
:class:`Timeline` records what really ran: one :class:`Span` per action, with
its stream, stage s, micro-batch i, kind letter and start/end in seconds from
the start of the run. The executor fills a :class:`Recorder` around every
action; the timeline then gives utilisation, the pipeline bubble, the
ramp-up/main/ramp-down phases, an ASCII Gantt chart, a Chrome/Perfetto
trace and an SVG picture (``timeline_svg``). The spans and their kinds are
``spans``'. This package imports only the standard library.

[Note: timeline phases]
Over the window ``[t0, t3]`` from the first start to the last end:

* ramp-up ``[t0, t1]``: ``t1`` is the latest first start among the streams
  that do any work, i.e. the moment every working stream has started;
* ramp-down ``[t2, t3]``: ``t2`` is the earliest end of a stream's last
  forward, backward or recompute (F/B/R), taken over the streams that do any;
  reductions (G) and the update (U) therefore fall in ramp-down. If that is
  before ``t1`` (the pipeline never fills), ``t2 = t1``; if no stream does any
  F/B/R, ``t2 = t1`` too;
* main ``[t1, t2]``, possibly empty.

With one stream ramp-up is empty and ramp-down holds the reduction and update.
An empty timeline has every phase ``(0.0, 0.0)``. For several runs joined by
:meth:`Timeline.concat`, ramp-up lies in the first run, ramp-down in the last.

A 2-stream one-forward-one-backward example, 1 column = 0.5 s::

    >>> spans = [Span(0, 0, 0, "F", 0, 1), Span(0, 0, 1, "F", 1, 2),
    ...          Span(1, 1, 0, "F", 1, 2), Span(1, 1, 0, "B", 2, 3),
    ...          Span(1, 1, 1, "F", 3, 4), Span(0, 0, 0, "B", 3, 4),
    ...          Span(1, 1, 1, "B", 4, 5), Span(0, 0, 1, "B", 5, 6),
    ...          Span(1, 1, None, "G", 5, 6), Span(0, 0, None, "G", 6, 7),
    ...          Span(0, None, None, "U", 7, 8)]
    >>> print(Timeline(spans, ["ipu0", "ipu1"], "1f1b").render(width=16))
    schedule 1f1b: makespan 8.000 s, 1 column = 500.000 ms
    ipu0   FFFF..BB..BBGGUU
    ipu1   ..FFBBFFBBGG....
    phases |-|-------|-----|  |ramp-up|main|ramp-down|
    legend: F forward, B backward, R recompute, G reduce, U update, . idle
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Optional, Sequence

from .spans import _KIND_OF_NAME, _WORK, KIND_NAMES, Span, _busy, _unit
from .timeline_svg import render as _render_svg

_PROCESS_PREFIX = "poptorch_lite "


class Timeline:
    """The spans of one call's runs, on named streams, sorted by start.

    Args:
        spans: the executed actions (any order; stored sorted by start, then stream).
        stream_names: one name per stream, e.g. ``["ipu0 (cpu)", "ipu1 (cpu)"]``;
            every span's stream indexes this list.
        schedule_name: the schedule that ran (``"sequential"``, ...).

    Raises:
        ValueError: a span's stream has no name.

    Example:
        >>> t = Timeline([Span(0, 0, 0, "F", 0, 2), Span(1, 1, 0, "F", 2, 4)], ["a", "b"], "seq")
        >>> t.makespan, t.utilisation(), t.bubble_fraction()
        (4, [0.5, 0.5], 0.5)
    """

    def __init__(self, spans: Iterable[Span], stream_names: Sequence[str], schedule_name: str):
        self.spans = sorted(spans, key=lambda p: (p.start, p.stream, p.end))
        self.stream_names = list(stream_names)
        self.schedule_name = schedule_name
        for p in self.spans:
            if not 0 <= p.stream < len(self.stream_names):
                raise ValueError(f"span {p.label} is on stream {p.stream} but the timeline names "
                                 f"{len(self.stream_names)} streams {self.stream_names}; pass one "
                                 f"name per stream")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return ((self.spans, self.stream_names, self.schedule_name)
                == (other.spans, other.stream_names, other.schedule_name))

    def __repr__(self) -> str:
        return (f"Timeline({self.schedule_name!r}, {len(self.spans)} spans, "
                f"streams={self.stream_names})")

    @classmethod
    def concat(cls, timelines: Sequence["Timeline"]) -> "Timeline":
        """Several runs (device iterations) of one call, back to back.

        Times are kept as they are (every run is timed from the call's origin);
        ``run`` is renumbered so that the runs of each timeline follow those of
        the timelines before it (a timeline with no spans counts as one run).

        Raises:
            ValueError: no timelines, or their streams or schedules differ.

        Example:
            >>> a = Timeline([Span(0, 0, 0, "F", 0, 1)], ["ipu0"], "seq")
            >>> b = Timeline([Span(0, 0, 0, "F", 1, 2)], ["ipu0"], "seq")
            >>> [p.run for p in Timeline.concat([a, b]).spans]
            [0, 1]
        """
        if not timelines:
            raise ValueError("Timeline.concat needs at least one timeline")
        first = timelines[0]
        spans, base = [], 0
        for t in timelines:
            if (t.stream_names, t.schedule_name) != (first.stream_names, first.schedule_name):
                raise ValueError(f"cannot join runs of different calls: schedule "
                                 f"{t.schedule_name!r} on {t.stream_names} after "
                                 f"{first.schedule_name!r} on {first.stream_names}")
            spans += [dataclasses.replace(p, run=base + p.run) for p in t.spans]
            base += 1 + max((p.run for p in t.spans), default=0)
        return cls(spans, first.stream_names, first.schedule_name)

    @property
    def makespan(self) -> float:
        """Last end minus first start, in seconds (0 for an empty timeline)."""
        if not self.spans:
            return 0.0
        return max(p.end for p in self.spans) - self.spans[0].start

    def utilisation(self) -> list:
        """Per stream, busy time / makespan; overlapping spans on a stream count once.

        Every stream is 0.0 when the makespan is 0.

        Example:
            >>> Timeline([Span(0, 0, 0, "F", 0, 2), Span(0, 0, 1, "F", 1, 3)],
            ...          ["a", "b"], "x").utilisation()
            [1.0, 0.0]
        """
        makespan = self.makespan
        busy = self._busy_per_stream()
        return [b / makespan if makespan > 0 else 0.0 for b in busy]

    def _busy_per_stream(self) -> list:
        intervals = [[] for _ in self.stream_names]
        for p in self.spans:
            intervals[p.stream].append((p.start, p.end))
        return [_busy(iv) for iv in intervals]

    def bubble_fraction(self) -> float:
        """``1 - total busy / (streams * makespan)``: the idle share of all streams.

        Streams that never work count as idle. 0.0 when the makespan is 0.

        Example:
            >>> Timeline([Span(0, 0, 0, "F", 0, 1), Span(1, 1, 0, "F", 1, 2)],
            ...          ["a", "b"], "x").bubble_fraction()
            0.5
        """
        makespan = self.makespan
        if makespan <= 0 or not self.stream_names:
            return 0.0
        return 1.0 - sum(self._busy_per_stream()) / (len(self.stream_names) * makespan)

    def phases(self) -> dict:
        """Ramp-up, main and ramp-down as (start, end) times; see [Note: timeline phases].

        Example:
            >>> Timeline([Span(0, 0, 0, "F", 0, 1), Span(1, 1, 0, "F", 1, 2),
            ...           Span(0, 0, 1, "F", 1, 2), Span(1, 1, 1, "F", 2, 3)],
            ...          ["a", "b"], "x").phases()
            {'ramp_up': (0, 1), 'main': (1, 2), 'ramp_down': (2, 3)}
        """
        if not self.spans:
            return {"ramp_up": (0.0, 0.0), "main": (0.0, 0.0), "ramp_down": (0.0, 0.0)}
        first_start, last_work_end = {}, {}
        for p in self.spans:  # sorted by start: the first seen is the first start
            first_start.setdefault(p.stream, p.start)
            if p.kind in _WORK:
                last_work_end[p.stream] = max(last_work_end.get(p.stream, p.end), p.end)
        t0, t3 = self.spans[0].start, max(p.end for p in self.spans)
        t1 = max(first_start.values())
        t2 = max(t1, min(last_work_end.values(), default=t1))
        return {"ramp_up": (t0, t1), "main": (t1, t2), "ramp_down": (t2, t3)}

    def summary(self) -> str:
        """A few lines: schedule, makespan, utilisation per stream, bubble, phase durations.

        Example:
            >>> print(Timeline([Span(0, 0, 0, "F", 0, 1), Span(1, 1, 0, "F", 1, 2)],
            ...                ["ipu0", "ipu1"], "seq").summary())
            schedule seq: 2 streams, 2 spans, 1 run, makespan 2.000 s
              ipu0  utilisation  50.0%
              ipu1  utilisation  50.0%
              bubble 50.0%
              phases: ramp-up 1.000 s, main 0.000 s, ramp-down 1.000 s
        """
        unit, factor = _unit(self.makespan)
        runs = 1 + max((p.run for p in self.spans), default=-1)
        lines = [f"schedule {self.schedule_name}: {len(self.stream_names)} streams, "
                 f"{len(self.spans)} spans, {runs} run{'' if runs == 1 else 's'}, "
                 f"makespan {self.makespan * factor:.3f} {unit}"]
        w = max([0] + [len(n) for n in self.stream_names])
        for name, u in zip(self.stream_names, self.utilisation()):
            lines.append(f"  {name.ljust(w)}  utilisation {100 * u:5.1f}%")
        lines.append(f"  bubble {100 * self.bubble_fraction():.1f}%")
        durations = ", ".join(f"{phase.replace('_', '-')} {(b - a) * factor:.3f} {unit}"
                              for phase, (a, b) in self.phases().items())
        lines.append(f"  phases: {durations}")
        return "\n".join(lines)

    def render(self, width: int = 100) -> str:
        """An ASCII Gantt chart: one line per stream, time scaled to ``width`` columns.

        Each span fills the columns its rounded start and end cover (at least
        one; a later span overwrites an earlier one in a shared column) with its
        kind letter; idle columns are ``'.'``. The ``phases`` line puts ``'|'``
        under the first column of ramp-up, main and ramp-down and one past the
        last column, so a stream that starts late shows dots up to the second
        ``'|'``. See the module docstring for an example.

        When a stream has more spans than ``width`` columns and the timeline
        holds several runs (steps), only the last run is drawn, and the first
        line says so: a smear of overwritten letters shows no schedule.

        Raises:
            ValueError: ``width`` < 1.
        """
        if width < 1:
            raise ValueError(f"render(width={width}) needs at least 1 column; pass width >= 1")
        if not self.spans:
            return f"schedule {self.schedule_name}: no spans"
        per_stream = [0] * len(self.stream_names)
        for p in self.spans:
            per_stream[p.stream] += 1
        runs = sorted({p.run for p in self.spans})
        if max(per_stream) > width and len(runs) > 1:
            last = Timeline([p for p in self.spans if p.run == runs[-1]], self.stream_names,
                            self.schedule_name).render(width)
            head, rest = last.split("\n", 1)
            return (f"{head}; the last of {len(runs)} runs (a stream has {max(per_stream)} "
                    f"spans, more than {width} columns)\n{rest}")
        t0, makespan = self.spans[0].start, self.makespan

        def col(t: float) -> int:  # the boundary before column col(t), 0..width
            return 0 if makespan <= 0 else int((t - t0) / makespan * width + 0.5)

        rows = [["."] * width for _ in self.stream_names]
        for p in self.spans:
            a = min(col(p.start), width - 1)
            b = min(max(col(p.end), a + 1), width)
            rows[p.stream][a:b] = [p.kind] * (b - a)
        axis = ["-"] * (width + 1)
        (u0, u1), (_, m1), (_, d1) = self.phases().values()
        for t in (u0, u1, m1, d1):
            axis[col(t)] = "|"
        unit, factor = _unit(makespan)
        step_unit, step_factor = _unit(makespan / width)
        w = max([len("phases")] + [len(n) for n in self.stream_names])
        legend = ", ".join(f"{k} {name}" for k, name in KIND_NAMES.items()
                           if k not in "IWC" or any(p.kind == k for p in self.spans))
        return "\n".join(
            [f"schedule {self.schedule_name}: makespan {makespan * factor:.3f} {unit}, "
             f"1 column = {makespan / width * step_factor:.3f} {step_unit}"]
            + [f"{name.ljust(w)} {''.join(r)}" for name, r in zip(self.stream_names, rows)]
            + [f"{'phases'.ljust(w)} {''.join(axis)}  |ramp-up|main|ramp-down|",
               f"legend: {legend}, . idle"])

    def to_chrome_trace(self) -> dict:
        """Chrome/Perfetto trace-event JSON (open in chrome://tracing or ui.perfetto.dev).

        One complete event (``"ph": "X"``) per span, ``ts``/``dur`` in
        microseconds, ``tid`` the stream, ``name`` the label, ``cat`` the kind
        name, ``args`` stage, micro-batch and run; then metadata events naming
        the process (``"poptorch_lite <schedule>"``) and each stream.

        Example:
            >>> t = Timeline([Span(1, 1, 0, "F", 0.5, 1.0)], ["ipu0", "ipu1"], "seq")
            >>> e = t.to_chrome_trace()["traceEvents"][0]
            >>> e["ph"], e["pid"], e["tid"], e["name"], e["cat"], e["ts"], e["dur"]
            ('X', 0, 1, '1F0', 'forward', 500000.0, 500000.0)
            >>> e["args"]
            {'stage': 1, 'microbatch': 0, 'run': 0}
        """
        events = [{"ph": "X", "pid": 0, "tid": p.stream, "name": p.label,
                   "cat": KIND_NAMES[p.kind], "ts": p.start * 1e6, "dur": (p.end - p.start) * 1e6,
                   "args": {"stage": p.stage, "microbatch": p.microbatch, "run": p.run}}
                  for p in self.spans]
        events.append({"ph": "M", "pid": 0, "tid": 0, "name": "process_name",
                       "args": {"name": _PROCESS_PREFIX + self.schedule_name}})
        events += [{"ph": "M", "pid": 0, "tid": k, "name": "thread_name", "args": {"name": name}}
                   for k, name in enumerate(self.stream_names)]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path) -> None:
        """Write :meth:`to_chrome_trace` as JSON to ``path``.

        Example:
            >>> import os, tempfile
            >>> with tempfile.TemporaryDirectory() as d:
            ...     Timeline([], ["ipu0"], "seq").write_chrome_trace(os.path.join(d, "t.json"))
        """
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)

    def write_svg(self, path, width: int = 1200) -> None:
        """Write the timeline as an SVG Gantt chart (``timeline_svg.render``) to ``path``.

        Example:
            >>> import os, tempfile
            >>> with tempfile.TemporaryDirectory() as d:
            ...     Timeline([Span(0, 0, 0, "F", 0, 1)], ["ipu0"], "seq").write_svg(
            ...         os.path.join(d, "t.svg"))
        """
        with open(path, "w", encoding="utf-8") as f:
            f.write(_render_svg(self, width))

    @classmethod
    def from_chrome_trace(cls, data) -> "Timeline":
        """Read a timeline back from :meth:`to_chrome_trace` output (a dict or its event list).

        Times come back from microseconds, exact up to float rounding. Streams
        without a ``thread_name`` are called ``"stream k"``; events of other
        phases (``"B"``/``"E"``, counters, ...) are ignored.

        Raises:
            ValueError: a complete event whose ``cat`` is not a kind name.

        Example:
            >>> t = Timeline([Span(0, None, None, "U", 1, 2)], ["ipu0"], "seq")
            >>> Timeline.from_chrome_trace(t.to_chrome_trace()) == t
            True
        """
        events = data["traceEvents"] if isinstance(data, dict) else data
        names, spans, schedule_name = {}, [], ""
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names[e["tid"]] = e["args"]["name"]
            elif e.get("ph") == "M" and e.get("name") == "process_name":
                schedule_name = e["args"]["name"]
                if schedule_name.startswith(_PROCESS_PREFIX):
                    schedule_name = schedule_name[len(_PROCESS_PREFIX):]
            elif e.get("ph") == "X":
                if e.get("cat") not in _KIND_OF_NAME:
                    raise ValueError(f"trace event {e.get('name')!r} has category "
                                     f"{e.get('cat')!r}, not one of {sorted(_KIND_OF_NAME)}; "
                                     f"only poptorch_lite traces can be read back")
                args = e.get("args", {})
                spans.append(Span(e["tid"], args.get("stage"), args.get("microbatch"),
                                  _KIND_OF_NAME[e["cat"]], e["ts"] / 1e6,
                                  (e["ts"] + e["dur"]) / 1e6, args.get("run", 0)))
        n = 1 + max(list(names) + [p.stream for p in spans], default=-1)
        return cls(spans, [names.get(k, f"stream {k}") for k in range(n)], schedule_name)


class Recorder:
    """Collects spans in the executor's hot path; cheap and thread-safe.

    :meth:`add` only appends a tuple to a list: ``list.append`` is atomic under
    the GIL (and locks the list itself in free-threaded builds), so the worker
    threads of several streams may call it at once without a lock. Spans are
    built, shifted to the origin and sorted only in :meth:`timeline`.

    Args:
        origin: ``time.perf_counter()`` at the start of the run.

    Example:
        >>> r = Recorder(origin=10.0)
        >>> r.add(0, 0, 0, "F", 10.0, 10.5)
        >>> r.timeline(["ipu0"], "seq").spans
        [Span(stream=0, stage=0, microbatch=0, kind='F', start=0.0, end=0.5, run=0)]
    """

    __slots__ = ("origin", "records", "_gpu")  # one a call: no ``__dict__`` made

    def __init__(self, origin: float):
        self.origin = origin
        self.records: list = []  # (stream, stage, micro-batch, kind, start, end, run), appended
        self._gpu: list = []

    def add(self, stream: int, stage: Optional[int], microbatch: Optional[int], kind: str,
            start: float, end: float, run: int = 0) -> None:
        """Record one action; ``start``/``end`` are ``time.perf_counter()`` values."""
        self.records.append((stream, stage, microbatch, kind, start, end, run))

    def add_gpu(self, stream: int, stage: Optional[int], microbatch: Optional[int], kind: str,
                ref, ref_time: float, begun, ended, run: int = 0) -> None:
        """Record one action measured on the GPU ([Note: GPU timeline] in ``placement``).

        ``begun`` and ``ended`` are CUDA timing events recorded on its stream; ``ref``
        one on the same GPU, recorded at ``time.perf_counter()`` ``ref_time``. They are
        converted in :meth:`timeline`, once the GPU has passed them.
        """
        self._gpu.append((stream, stage, microbatch, kind, ref, ref_time, begun, ended, run))

    def timeline(self, stream_names: Sequence[str], schedule_name: str) -> Timeline:
        """The recorded spans, times relative to the origin, sorted by start."""
        o = self.origin
        records = list(self.records) + [
            (k, s, i, kind, t + ref.elapsed_time(begun) / 1e3, t + ref.elapsed_time(ended) / 1e3,
             run) for k, s, i, kind, ref, t, begun, ended, run in self._gpu]
        return Timeline([Span(k, s, i, kind, a - o, b - o, run)
                         for k, s, i, kind, a, b, run in records],
                        stream_names, schedule_name)
