"""The spans of a timeline: one executed action each, and their kinds (standard library only).

``timeline`` assembles spans into a :class:`~poptorch_lite.profiling.timeline.Timeline`;
``timeline_svg`` draws one. Both read the kind letters and units from here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# The kind letters of schedule.Kind and their names in traces and legends; "C" is a replay of
# a captured step, every action of a run in one CUDA graph ([Note: step graphs] in step_graph).
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradients", "W": "weight gradients",
              "R": "recompute", "G": "reduce", "U": "update", "C": "step graph"}
_KIND_OF_NAME = {name: letter for letter, name in KIND_NAMES.items()}
_WORK = frozenset("FBIWRC")  # the kinds that define ramp-down ([Note: timeline phases])


@dataclasses.dataclass(frozen=True)
class Span:
    """One executed action: stream, stage s, micro-batch i, kind, start and end.

    Times are seconds from the start of the run. ``stage`` is None for the
    update; ``microbatch`` is None for the reduction and the update.

    Example:
        >>> Span(1, 1, 0, "F", 0.5, 1.0).label, Span(0, None, None, "U", 2, 3).label
        ('1F0', 'U')
    """

    stream: int
    stage: Optional[int]
    microbatch: Optional[int]
    kind: str
    start: float
    end: float
    run: int = 0

    def __post_init__(self):
        if self.kind not in KIND_NAMES:
            raise ValueError(f"span kind {self.kind!r} is not one of {''.join(KIND_NAMES)}; "
                             f"use the letter of a schedule.Kind")
        if self.end < self.start:
            raise ValueError(f"span {self.label} ends at {self.end} before it starts at "
                             f"{self.start}; pass start <= end")

    @property
    def label(self) -> str:
        """The action's text form, as ``schedule.Action``: ``"1F0"``, ``"0G"``, ``"U"``."""
        s = "" if self.stage is None else str(self.stage)
        i = "" if self.microbatch is None else str(self.microbatch)
        return f"{s}{self.kind}{i}"


def _busy(intervals: list) -> float:
    """The length of the union of (start, end) intervals: overlaps count once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total if cur_end is None else total + (cur_end - cur_start)


def _unit(seconds: float) -> tuple:
    """A readable unit for durations around ``seconds``: (name, factor)."""
    if seconds >= 1:
        return "s", 1.0
    return ("ms", 1e3) if seconds >= 1e-3 else ("us", 1e6)
