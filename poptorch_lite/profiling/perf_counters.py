"""PopTorch's performance counters and latencies, read off a call's executed timeline.

[Note: performance counters]
PopTorch's ``getPerfCounters()`` gives four timestamps (fractional seconds) per
tensor input or output and per iteration: ``input`` (the device asks for the
input), ``input_complete`` (it has arrived), ``output`` (an output is ready to
leave), ``output_complete`` (it is on the host). ``counters['input'][j][k]`` is
input j of micro-batch k; there is one input timestamp per micro-batch of the
call (``D·G·R``: every replica's) and one output timestamp per output step of
the output mode (``D·G·R`` for All, ``R`` for Final and Sum, ``D/N·G·R`` for
EveryN(N)), as in PopTorch's ``tests/perf_counters_test.py``. Before the model
has run, each is ``[[]]``.

poptorch_lite reads them off the last call's :class:`~poptorch_lite.profiling.timeline.Timeline`
(seconds from the start of the call); micro-batch k of run d is the timeline's
micro-batch ``k - d·m`` of run d, for ``m`` micro-batches per run:

* ``input`` = ``input_complete`` = the start of k's first forward action. The
  inputs are copied to the stage's device inside that action and the copy is
  not timed apart (on a CPU device there is none), so the host-to-device
  latency reads 0;
* ``output`` = the end of the last forward action among the micro-batches the
  output step returns (one micro-batch, or all those a Sum adds up);
* ``output_complete`` = the end of the run that computed them: the executor
  hands a run's outputs back when the run ends (in training, after its
  optimizer step).

Every input (and every output) of a micro-batch has the same timestamps: they
move together. The latencies follow PopTorch's ``_computeLatency``: per
iteration, reduce over the tensors (first request, last completion), group the
input iterations that belong to one output step, and give ``(min, max, avg)``
of the durations in seconds; ``(0.0, 0.0, 0.0)`` when there is nothing to measure.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .timeline import Timeline

EVENTS = ("input", "input_complete", "output", "output_complete")


def empty() -> dict:
    """The counters of a model that has not run: ``[[]]`` for every event.

    Example:
        >>> empty()["input"]
        [[]]
    """
    return {event: [[]] for event in EVENTS}


def counters(timeline: Timeline, num_inputs: int, num_outputs: int, groups: Sequence[Sequence[int]],
             per_run: int) -> dict:
    """The call's counters ([Note: performance counters]).

    Args:
        timeline: the call's executed timeline (``runStatistics().timeline``).
        num_inputs: tensor inputs of the model.
        num_outputs: tensor outputs of the model.
        groups: the micro-batches of each output step (``batch.selected_microbatches``).
        per_run: micro-batches per run of the call (``G·R`` in training, ``D·R`` in inference).

    Returns:
        ``{event: [per tensor: [per iteration: seconds]]}``; ``[[]]`` for an event
        with no tensor.

    Example:
        >>> from poptorch_lite.profiling.timeline import Span
        >>> t = Timeline([Span(0, 0, 0, "F", 0.0, 1.0), Span(0, 0, 1, "F", 1.0, 2.5)], ["ipu0"], "s")
        >>> c = counters(t, num_inputs=2, num_outputs=1, groups=[[0], [1]], per_run=2)
        >>> c["input"], c["output"], c["output_complete"]
        ([[0.0, 1.0], [0.0, 1.0]], [[1.0, 2.5]], [[2.5, 2.5]])
    """
    first_start: dict = {}
    last_forward_end: dict = {}
    run_end: dict = {}
    for span in timeline.spans:
        run_end[span.run] = max(run_end.get(span.run, span.end), span.end)
        if span.kind == "F":
            k = span.run * per_run + span.microbatch
            first_start[k] = min(first_start.get(k, span.start), span.start)
            last_forward_end[k] = max(last_forward_end.get(k, span.end), span.end)
    starts = [first_start[k] for k in sorted(first_start)]
    outputs = [max(last_forward_end[k] for k in group) for group in groups]
    completes = [run_end[max(group) // per_run] for group in groups]

    def per_tensor(count: int, values: list) -> list:
        return [list(values) for _ in range(count)] if count else [[]]

    return {"input": per_tensor(num_inputs, starts),
            "input_complete": per_tensor(num_inputs, starts),
            "output": per_tensor(num_outputs, outputs),
            "output_complete": per_tensor(num_outputs, completes)}


def latency(perf: dict, from_event: str, from_reduce: Callable, to_event: str,
            to_reduce: Callable) -> tuple:
    """``(min, max, avg)`` seconds from one event to another, PopTorch's ``_computeLatency``.

    Example:
        >>> c = {"input": [[0.0, 1.0]], "output_complete": [[3.0]]}
        >>> latency(c, "input", min, "output_complete", max)
        (3.0, 3.0, 3.0)
    """
    def per_iteration(event: str, reduce: Callable) -> list:
        tensors = perf[event]
        return [reduce(t[step] for t in tensors) for step in range(len(tensors[0]))]

    starts = per_iteration(from_event, from_reduce)
    ends = per_iteration(to_event, to_reduce)
    if not starts or not ends:
        return (0.0, 0.0, 0.0)
    # Several input iterations feed one output step (accumulation, Final, Sum, EveryN):
    # an output step's duration runs from the first of its group's inputs.
    factor = len(starts) // len(ends)
    durations = [end - min(starts[n * factor:(n + 1) * factor]) for n, end in enumerate(ends)]
    return (min(durations), max(durations), sum(durations) / len(durations))


class Latencies:
    """PopTorch's four latencies of a wrapped model, from its ``getPerfCounters()``.

    Each is ``(min, max, avg)`` seconds over the last call's output steps
    ([Note: performance counters]); ``(0.0, 0.0, 0.0)`` before the model has run.

    Example:
        >>> class Ran(Latencies):
        ...     def getPerfCounters(self):
        ...         return {"input": [[0.0]], "input_complete": [[0.0]], "output": [[2.0]],
        ...                 "output_complete": [[3.0]]}
        >>> Ran().getLatency(), Ran().getComputeLatency(), Ran().getIpuHostLatency()
        ((3.0, 3.0, 3.0), (2.0, 2.0, 2.0), (1.0, 1.0, 1.0))
    """

    def getPerfCounters(self) -> dict:  # pragma: no cover (the wrapper defines it)
        raise NotImplementedError

    def getLatency(self) -> tuple:
        """From the first input requested to the last output back on the host."""
        return latency(self.getPerfCounters(), "input", min, "output_complete", max)

    def getHostIpuLatency(self) -> tuple:
        """From the first input requested to the last arrived (0 here: see the Note)."""
        return latency(self.getPerfCounters(), "input", min, "input_complete", max)

    def getComputeLatency(self) -> tuple:
        """From the last input arrived to the last output ready."""
        return latency(self.getPerfCounters(), "input_complete", max, "output", max)

    def getIpuHostLatency(self) -> tuple:
        """From the first output ready to the last one back on the host."""
        return latency(self.getPerfCounters(), "output", min, "output_complete", max)
