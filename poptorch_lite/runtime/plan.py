"""Plans: how an executor runs a schedule, worked out once per schedule, and a call's runs.

[Note: one setup per call]
A training call of ``deviceIterations(D)`` runs its schedule D times, one run per
optimizer step, so whatever a run sets up is paid every step (a step of a small model
is a few milliseconds, and each piece of setup runs cold). What does not change
between runs is therefore worked out once: per schedule, the :class:`Plan` (each
stream's list, the waits, and, when the caller's thread runs the actions itself, the
ordered actions with their handlers and timeline labels); per call, the :class:`Call`
(the plan, and on the caller's thread the intra-op thread count and the grad mode,
entered once and restored when the call ends, also when it fails). A run then only
makes its state (``stage_work.Run``), seeds its micro-batches' random streams, clears
the gradients and runs its actions; its commit point, undo and failure report are
unchanged ([Note: commit point] in ``update``). Per program, what every call does alike
under the wrapper's frozen options (the schedule, the runs' slices, the micro-batches that
come back, the gradient's divisor) is its ``program.CallLayout``, made on the first call.

A call's setup runs *cold*: the step before it has pushed the interpreter's objects out of
the CPU's caches, so each line of it costs microseconds, not the tenths a warm benchmark
shows, and a tensor allocated in it about 10 µs (a context made by a generator, a
``torch.device`` made by reading ``.device``, an option read through ``__getattr__`` all
show). The setup's contexts are therefore classes, its random bases are drawn into a
buffer kept per thread (``rng.draw_bases``), and options are read once
(``docs/PERFORMANCE.md`` (g) has the profile and the figures).

A plan and a call are data: the executor runs them (``Executor.run_call``), and neither
calls back into it.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from ..compiler.casting import ambient_autocast, outside_autocast
from .schedule import Kind, Schedule
from .streams import CudaStream


class Plan:
    """How an executor runs one schedule, worked out once per schedule.

    Attributes:
        lists: IPU -> the actions its stream runs, in order; rows: action -> its row.
        waits: action -> the actions on other streams it waits for.
        in_order: ``(ipu, action)`` in row order when the schedule is a total order, else None.
        ahead: action -> the next action of its stream that receives messages (processes).
        here: when the caller's thread runs every action itself on CPU streams
            (``Placement.here``), ``(action, (ipu, stage, micro-batch, kind))`` in order;
            else None.
        launch: when the caller's thread runs every action itself and some are on CUDA
            streams, ``(ipu, action)`` in order (``Placement.run_in_order``); else None.
        ordered: this process's ``(ipu, action)`` in row order, an order that launches every
            action after those it depends on (what a captured step launches).
        step: the schedule's optimizer step (``U``) when this process runs one, else None.
        split: whether a backward is split into I and W (zero bubble: [Note: split backward]).
        threads: the intra-op threads for ``here`` (None: the caller's).
    """

    __slots__ = ("schedule", "lists", "waits", "rows", "in_order", "ahead", "threads", "here",
                 "launch", "ordered", "step", "split")

    def __init__(self, schedule: Schedule, lists: dict, waits: dict, rows: dict,
                 in_order: Optional[list], ahead: dict, threads: Optional[int],
                 here: Optional[list], launch: Optional[list], ordered: list):
        self.schedule, self.lists, self.waits, self.rows = schedule, lists, waits, rows
        self.in_order, self.ahead, self.threads, self.here = in_order, ahead, threads, here
        self.launch, self.ordered = launch, ordered
        self.step = next((a for a in rows if a.kind is Kind.STEP), None)
        self.split = any(a.kind is Kind.BACKWARD_WEIGHT for a in rows)


def make_plan(schedule: Schedule, placement, ipu_of: Callable, runs_here: Callable,
              channels=None, launched: bool = False) -> Plan:
    """The plan of ``schedule`` for an executor.

    Args:
        placement: the executor's ``Placement``.
        ipu_of: action -> the IPU (stream) that runs it; runs_here: action -> whether this
            process runs it ([Note: stages in other processes] in ``distributed``).
        channels: the messages to other processes' stages (None: every stage runs here).
        launched: the caller's thread launches every action on the GPU streams in row order,
            even where workers could run the streams' lists: a program whose steps are
            captured warms up with the launches it captures ([Note: step graphs] in
            ``step_graph``).
    """
    # This process's actions: every one unless stages run in other processes, where
    # a dependency is a message instead.
    mine = [[a for a in row if a is not None and runs_here(a)] for row in schedule.rows]
    lists = {ipu: [] for ipu in placement.devices}
    rows = {}
    for t, row in enumerate(mine):
        for a in row:
            lists[ipu_of(a)].append(a)
            rows[a] = t
    waits = {a: [d for d in schedule.dependencies(a) if runs_here(d) and ipu_of(d) != ipu_of(a)]
             for a in rows}
    total_order = all(sum(a is not None for a in row) <= 1 for row in schedule.rows)
    ordered = [(ipu_of(a), a) for row in mine for a in row]
    in_order = ordered if total_order else None
    ahead = {}  # per action, the next one of its stream that receives messages
    for actions in lists.values() if channels is not None else ():
        following = None
        for a in reversed(actions):
            ahead[a] = following
            if channels.receives(a):
                following = a
    here, threads = placement.here(lists, in_order) if channels is None else (None, None)
    launch = None
    if here is not None and any(isinstance(placement.streams[ipu], CudaStream)
                                for ipu, _ in here):
        here, launch = None, here  # launched on their CUDA streams, with the GPU's waits
    elif here is None and launched and channels is None and all(
            isinstance(placement.streams[ipu], CudaStream) for ipu, _ in ordered):
        launch = ordered
    return Plan(schedule, lists, waits, rows, in_order, ahead, threads,
                None if here is None else [(a, (ipu, a.stage, a.microbatch, a.kind.value))
                                           for ipu, a in here], launch, ordered)


class Call:
    """A call's runs of one plan ([Note: one setup per call]); a context manager that holds
    the caller's thread as the runs need it, in one enter and one exit (each context of its
    own cost a few microseconds of a small step, cold): no automatic garbage collection
    (:func:`collection_paused`); autocast off ([Note: autocast around a call] in
    ``compiler/casting``); where that thread runs the actions, their intra-op threads and
    grad mode; for a training call of a wrapper, the host parameters' gradients as the user
    left them ([Note: host gradients] in ``weights``) and, on the main thread, the Ctrl-C
    handler that the update reads (``update.CtrlC``).

    Args:
        plan: the schedule's plan; step: the optimizer step's arithmetic (None:
            inference); recorder: the timeline's (None: not recorded); watchdog:
            ``Options.watchdogTimeout``; weights: whose host gradients a training call
            holds (None: none held); update: whose ``ctrl_c`` is the call's handler while
            inside (None: no handler installed).
    """

    __slots__ = ("plan", "step", "recorder", "watchdog", "_weights", "_update", "_paused",
                 "_autocast", "_held", "_restore")

    def __init__(self, plan: Plan, step, recorder, watchdog: Optional[float], weights=None,
                 update=None):
        self.plan, self.step, self.recorder = plan, step, recorder
        self.watchdog = watchdog
        self._weights, self._update = weights, update
        self._paused = collection_paused()
        self._autocast = None
        self._held: Optional[tuple] = None
        self._restore: Optional[tuple] = None

    def __enter__(self) -> "Call":
        self._paused.__enter__()
        try:
            on = ambient_autocast()
            if on:
                self._autocast = outside_autocast(on)
                self._autocast.__enter__()
            if self._weights is not None:
                self._held = self._weights.hold_host_grads()
            if self.plan.here is not None:  # the caller's thread runs the actions: its settings
                threads, ours = self.plan.threads, torch.get_num_threads()
                self._restore = (ours, torch.is_grad_enabled())
                if threads is not None and threads != ours:
                    torch.set_num_threads(threads)
                torch._C._set_grad_enabled(self.plan.schedule.training)  # per thread
            if self._update is not None:
                self._update.guard_call()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if self._update is not None:
                self._update.unguard_call(ended_normally=kind is None)
        finally:
            if self._restore is not None:
                ours, grad = self._restore
                if torch.get_num_threads() != ours:
                    torch.set_num_threads(ours)
                torch._C._set_grad_enabled(grad)
                self._restore = None
            if self._held is not None:
                self._weights.give_back_host_grads(self._held)
                self._held = None
            if self._autocast is not None:
                self._autocast.__exit__(None, None, None)
                self._autocast = None
            self._paused.__exit__()


def collection_paused() -> "_CollectionPaused":
    """No automatic garbage collection while a call runs. A collection runs the finalizers of
    the garbage it finds on the thread that happened to allocate, and CPython drops a Ctrl-C
    that lands in a finalizer ("Exception ignored in: <finalize object ...>
    KeyboardInterrupt"), so a call could run on past its Ctrl-C, and after it, a loop
    (``benchmarks/soak.py`` saw both). Collection resumes when the call ends; a caller that
    turned it off keeps it off."""
    return _CollectionPaused()


class _CollectionPaused:
    """:func:`collection_paused`'s context: a class, not a generator (a call's setup runs
    cold: [Note: one setup per call])."""

    __slots__ = ("paused",)

    def __enter__(self) -> None:
        self.paused = gc.isenabled()
        if self.paused:
            gc.disable()

    def __exit__(self, *exc) -> None:
        if self.paused:
            gc.enable()
