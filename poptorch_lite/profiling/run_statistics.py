"""What the last call of a wrapped model measured: ``PoplarExecutor.runStatistics()``."""

from __future__ import annotations

import dataclasses

from .timeline import Timeline


@dataclasses.dataclass(frozen=True)
class RunStatistics:
    """What the last call of a wrapped model measured (``model.runStatistics()``).

    Attributes:
        schedule: the schedule's name (``"grouped"``, ...).
        peak_stash_depth: per stage, the most micro-batches held in its
            activation stash at once (never more than the schedule's
            ``peak_in_flight``).
        peak_stash_bytes: per stage, the most bytes its stash held at once
            (distinct storages; parameters, buffers and the call's inputs
            excluded).
        timeline: every action's stream, stage, micro-batch, kind, start and
            end (:class:`~poptorch_lite.profiling.timeline.Timeline`: ``summary()``,
            ``render()``, ``write_chrome_trace(path)``).
    """

    schedule: str
    peak_stash_depth: tuple
    peak_stash_bytes: tuple
    timeline: Timeline


def run_statistics(schedule, stats: list, recorder, devices: dict, layout) -> RunStatistics:
    """The statistics of a call's runs: its schedule, the per-run stash statistics
    (``runtime.run.RunStats``), the call's timeline recorder, IPU -> device of this
    process's stages, and the process layout (None in one process) naming the others."""
    names = [f"ipu{k} ({devices[k]})" if k in devices else
             f"ipu{k} (process {layout.rank_of(layout.pipeline, layout.position_of(k))})"
             if layout is not None and layout.position_of(k) is not None else
             f"ipu{k} (unused)" for k in range(schedule.num_streams)]
    return RunStatistics(  # peaks over the call's runs
        schedule.name, tuple(max(v) for v in zip(*(r.peak_stash_depth for r in stats))),
        tuple(max(v) for v in zip(*(r.peak_stash_bytes for r in stats))),
        recorder.timeline(names, schedule.name))
