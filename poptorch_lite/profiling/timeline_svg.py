"""A timeline as a picture: an SVG Gantt chart of what each stream did (no torch).

:func:`render` draws a :class:`~poptorch_lite.profiling.timeline.Timeline` the way the
IPU tutorials and PopVision draw a pipeline: one row per stream, one box per
executed action coloured by its kind (forward, backward, recompute, reduce,
update) and labelled with its micro-batch (the kind letter for a reduction or
the update), the ramp-up, main and ramp-down phases ([Note: timeline phases])
as a band above the rows with dashed lines through them, a time axis with
ticks, and a legend. Every box carries a ``<title>`` (a tooltip: action,
stream, start and duration), and the elements carry ``class`` and ``data-*``
attributes so that tests and tools can read the chart back. SVG is text: this
needs only the standard library.

Example:
    >>> from poptorch_lite.profiling.timeline import Span, Timeline
    >>> svg = render(Timeline([Span(0, 0, 0, "F", 0, 1), Span(1, 1, 0, "F", 1, 2)],
    ...                       ["ipu0", "ipu1"], "grouped"))
    >>> svg.startswith("<svg") and svg.count('class="span"')
    2
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape, quoteattr

from .spans import KIND_NAMES, _unit

# One colour per action kind (Tableau 10), and the phases' band colours.
COLOURS = {"F": "#4c78a8", "B": "#f58518", "I": "#f58518", "W": "#eeca3b", "R": "#54a24b",
           "G": "#b279a2", "U": "#e45756", "C": "#9d755d"}
PHASE_COLOURS = {"ramp_up": "#fdf1cf", "main": "#dcefd6", "ramp_down": "#f7dada"}
ROW, GAP, TITLE, BAND, AXIS, LEGEND, PAD = 28, 6, 28, 20, 40, 28, 10
RIGHT = 3 * PAD  # room for the last tick's label
CHAR = 7.0  # px per character of the 12 px sans-serif labels, for widths


def nice_ticks(length: float, target: int = 8) -> list:
    """Tick positions 0, step, 2·step, ... <= ``length``, step 1, 2 or 5 × 10^k.

    The step is the smallest such that at most ``target`` + 1 ticks fit.

    Example:
        >>> nice_ticks(8.0), nice_ticks(0.037, 5)
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [0.0, 0.01, 0.02, 0.03])
    """
    if length <= 0:
        return [0.0]
    magnitude = 10.0 ** math.floor(math.log10(length / target))
    step = next(m * magnitude for m in (1, 2, 5, 10) if length / (m * magnitude) <= target + 1e-9)
    return [round(k * step, 12) for k in range(int(length / step + 1e-9) + 1)]


def _text(x: float, y: float, body: str, size: int = 12, anchor: str = "start", cls: str = "",
          colour: str = "#222") -> str:
    klass = f' class="{cls}"' if cls else ""
    return (f'<text{klass} x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{colour}">{escape(body)}</text>')


def render(timeline, width: int = 1200) -> str:
    """The SVG document of ``timeline``, ``width`` pixels wide.

    Args:
        timeline: a :class:`~poptorch_lite.profiling.timeline.Timeline`.
        width: the picture's width in pixels (the plot gets what the stream
            names leave).

    Returns:
        The SVG text. A box shows its micro-batch number when the number fits
        in it; its tooltip always names the action.

    Raises:
        ValueError: ``width`` is too small to leave 100 pixels for the plot.
    """
    names = timeline.stream_names
    left = PAD + CHAR * max([6] + [len(n) for n in names]) + PAD
    plot = width - left - RIGHT
    if plot < 100:
        raise ValueError(f"write_svg(width={width}) leaves {plot:.0f} px for the chart after the "
                         f"stream names; pass width >= {math.ceil(left + RIGHT + 100)}")
    rows_top = TITLE + BAND + GAP
    rows_bottom = rows_top + len(names) * (ROW + GAP)
    height = rows_bottom + AXIS + LEGEND + PAD
    t0, makespan = (timeline.spans[0].start if timeline.spans else 0.0), timeline.makespan
    unit, factor = _unit(makespan)

    def x(t: float) -> float:
        return left + (0.0 if makespan <= 0 else (t - t0) / makespan * plot)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           _text(PAD, 18, f"schedule {timeline.schedule_name}: {len(names)} streams, "
                 f"{len(timeline.spans)} actions, makespan {makespan * factor:.3f} {unit}, "
                 f"bubble {100 * timeline.bubble_fraction():.1f}%", 14, cls="title")]
    if not timeline.spans:
        out.append(_text(left, rows_top + ROW / 2, "no spans", cls="empty"))
    else:
        out += _phases(timeline, x, rows_top, rows_bottom)
    for k, name in enumerate(names):
        y = rows_top + k * (ROW + GAP)
        out.append(f'<g class="row" data-stream="{k}" data-name={quoteattr(name)}>')
        out.append(_text(left - PAD, y + ROW / 2 + 4, name, anchor="end", cls="stream"))
        out.append(f'<rect class="lane" x="{left:.1f}" y="{y:.1f}" width="{plot:.1f}" '
                   f'height="{ROW}" fill="#f4f4f4"/>')
        out += [_box(p, x, y, factor, unit) for p in timeline.spans if p.stream == k]
        out.append("</g>")
    out += _axis(makespan, factor, unit, x, rows_bottom, t0)
    out += _legend(timeline, height - PAD - 6)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _phases(timeline, x, top: float, bottom: float) -> list:
    """The ramp-up / main / ramp-down band above the rows, and dashed lines at its bounds."""
    out = ['<g class="phases">']
    for phase, (a, b) in timeline.phases().items():
        label = phase.replace("_", "-")
        out.append(f'<rect class="phase" data-phase="{label}" x="{x(a):.1f}" y="{TITLE}" '
                   f'width="{max(x(b) - x(a), 0):.1f}" height="{BAND}" '
                   f'fill="{PHASE_COLOURS[phase]}"><title>{label}</title></rect>')
        if x(b) - x(a) >= CHAR * len(label) + 4:
            out.append(_text((x(a) + x(b)) / 2, TITLE + BAND - 6, label, 11, "middle",
                             "phase-label", "#555"))
    (_, t1), (_, t2), _ = timeline.phases().values()
    for t in sorted({t1, t2}):
        out.append(f'<line class="phase-bound" x1="{x(t):.1f}" y1="{TITLE}" x2="{x(t):.1f}" '
                   f'y2="{bottom:.1f}" stroke="#777" stroke-dasharray="4 3"/>')
    out.append("</g>")
    return out


def _box(p, x, y: float, factor: float, unit: str) -> str:
    """One action: a box of its kind's colour, its micro-batch inside when it fits."""
    a, b = x(p.start), x(p.end)
    w = max(b - a, 1.0)
    label = p.kind if p.microbatch is None else str(p.microbatch)
    tip = (f"{p.label} ({KIND_NAMES[p.kind]}), stream {p.stream}, run {p.run}: starts at "
           f"{p.start * factor:.3f} {unit}, lasts {(p.end - p.start) * factor:.3f} {unit}")
    body = [f'<g class="span" data-label="{p.label}" data-kind="{p.kind}">',
            f'<rect x="{a:.2f}" y="{y + 2:.1f}" width="{w:.2f}" height="{ROW - 4}" '
            f'fill="{COLOURS[p.kind]}" stroke="white" stroke-width="0.5"><title>{escape(tip)}'
            f'</title></rect>']
    if w >= CHAR * len(label) + 2:
        body.append(_text(a + w / 2, y + ROW / 2 + 4, label, 12, "middle", "mb", "white"))
    body.append("</g>")
    return "".join(body)


def _axis(makespan: float, factor: float, unit: str, x, top: float, t0: float) -> list:
    """The time axis under the rows: a line, ticks at nice steps, their labels, the unit."""
    end = x(t0 + makespan)
    out = ['<g class="axis">',
           f'<line x1="{x(t0):.1f}" y1="{top:.1f}" x2="{end:.1f}" y2="{top:.1f}" stroke="#333"/>']
    for v in nice_ticks(makespan * factor):
        tx = x(t0 + v / factor)
        out.append(f'<line class="tick" x1="{tx:.1f}" y1="{top:.1f}" x2="{tx:.1f}" '
                   f'y2="{top + 5:.1f}" stroke="#333"/>')
        out.append(_text(tx, top + 18, f"{v:g}", 11, "middle", "tick-label"))
    out.append(_text(end, top + 34, f"time ({unit})", 12, "end", "axis-label"))
    out.append("</g>")
    return out


def _legend(timeline, y: float) -> list:
    """A swatch and name for every action kind in the timeline, then for the phases."""
    kinds = [k for k in KIND_NAMES if any(p.kind == k for p in timeline.spans)]
    entries = [("swatch", f'data-kind="{k}"', COLOURS[k], f"{k} {KIND_NAMES[k]}", "legend-label")
               for k in kinds]
    entries += [("phase-swatch", f'data-phase="{p.replace("_", "-")}"', colour,
                 p.replace("_", "-"), "phase-legend-label")
                for p, colour in PHASE_COLOURS.items()] if timeline.spans else []
    out, cx = ['<g class="legend">'], float(PAD)
    for cls, data, colour, text, label_cls in entries:
        out.append(f'<rect class="{cls}" {data} x="{cx:.1f}" y="{y - 11:.1f}" width="14" '
                   f'height="14" fill="{colour}"/>')
        out.append(_text(cx + 20, y, text, cls=label_cls))
        cx += 20 + CHAR * len(text) + 16
    out.append("</g>")
    return out
