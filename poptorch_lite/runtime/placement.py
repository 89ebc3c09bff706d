"""Placement: each IPU id on a torch device and an execution stream.

[Note: streams]
A stream runs its actions in submission order. On CUDA it is a
``torch.cuda.Stream``; on the CPU it is a worker thread (a "CPU stream").
Every stream gets its whole action list for a run at once
(:meth:`Placement.run_lists`) and runs it on its worker thread; before an
action it waits until the actions it depends on (on other streams) are done,
so stages work concurrently exactly as far as the schedule's dependencies
allow, with no barrier between steps. On the GPU "done" means launched: the
CUDA stream then also waits on the CUDA event that each such action recorded
after it, and the host waits for every stream before it reads results.
The caller's thread only watches: it returns when all lists are done, and
raises :class:`ActionFailed` as soon as an action fails (the other streams
stop before their next action) or :class:`ActionStuck` when no action has
finished for ``watchdog`` seconds; it sleeps until the last action is done or one
failed, so the workers' launches do not lose the GIL to it at every action. One
exception: when a run uses a single stream, or its schedule is a total order
(Sequential, one action per row), the caller's thread runs the actions itself,
in order, as plain PyTorch would run the same ops: a CPU stream's with all of
the caller's intra-op threads, a CUDA stream's launched on that stream (inside
its context, after the same waits and with the same events that its worker
would use, the streams synchronized before it returns or raises:
:meth:`Placement.run_in_order`). Handing every action to a worker thread cost a
single-stage model 15–100% of its step time on a 2-core machine (its intra-op
threads ran a team of their own beside the caller's; docs/PERFORMANCE.md (g)),
and on an H100 a thread hand-off per action and per run made a one-stage
step 1.23–1.52× plain PyTorch's (docs/PERFORMANCE.md (h)); with one stream, or
one action at a time, there is nothing to overlap. The watchdog then has no other stream to watch: a
stuck action there hangs the call as it would hang plain PyTorch, and Ctrl-C
stops it as usual. Workers start on first use, are reused by
every run, and stop on ``close()`` or when the placement is garbage
collected; a stream whose action is stuck is abandoned and gets a fresh
worker on its next use. The CPU streams share the caller's intra-op threads
(``torch.get_num_threads()`` when the placement is made) evenly, at least one
each, so concurrent stages do not oversubscribe the cores. The streams themselves,
and how a tensor crosses between them, are ``streams``'.

[Note: GPU timeline]
A CUDA action's span on the timeline is measured on the GPU: its stream
records a timing event when the action begins (after its waits) and one after
it, and the run's reference event per GPU (recorded when the run starts, with
the host's ``time.perf_counter()`` beside it) converts them to host time after
the run. Launch times would say nothing: the host launches far ahead of the GPU.
Where the caller's thread launches a run (:meth:`Placement.run_in_order`), an
action that waits for nothing starts at the event that ended its stream's
previous action: nothing was enqueued between them, and a launch-bound step
saves an event per action.

[Note: Ctrl-C during a run]
Ctrl-C reaches the caller's thread, which is waiting for the workers: Python runs the
handler when that wait is interrupted, the caller marks the run stopped (each stream stops
before its next action), logs a warning naming the actions still running, waits for them and
re-raises ([Note: all-or-nothing calls] in ``undo`` says what is undone). Two races are closed.
The streams are handed their lists inside the ``try``, so a Ctrl-C between two hand-offs still
stops the streams already running. And a SIGINT that lands just before the caller blocks (after
Python's last look at its pending signals, before the wait's system call) does not interrupt
that wait: the caller looks again after at most ``_LOOK_S`` seconds, where an unbounded wait
let the whole run finish first (and a finalizer running at its end could then swallow the
interrupt, which ``update.CtrlC`` raises again at the call's end). Four wake-ups a second cost
nothing measurable beside the workers' launches.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

import torch

from .devices import resolve_devices
from .gpu import current as current_gpu
from .streams import (ActionFailed, ActionStuck, CpuStream, CudaStream, StreamFailed,
                      _close_all, on_caller)

_LOG = logging.getLogger("poptorch_lite")
_LOOK_S = 0.25  # the caller's look at a run's progress: watchdog and Ctrl-C


class _Progress:
    """What the workers of one run share: actions done, the first failure, a stop flag."""

    def __init__(self, start: list, total: int):
        self.cond = threading.Condition()
        self.finished = threading.Event()  # every action done, or one failed: the caller's
        self.total = total
        if not total:
            self.finished.set()
        self.done: set = set()
        self.start = start        # CUDA events of the caller's work before the run
        self.events: dict = {}    # action -> CUDA event recorded after it
        self.begun: dict = {}     # action -> CUDA event recorded when it began (timeline)
        self.running: dict = {}   # stream -> action
        self.failure: Optional[BaseException] = None
        self.stop = False
        self.stamp = time.monotonic()


class Placement:
    """The device and stream of every IPU a partition uses.

    Args:
        ipus: the IPU ids in use.
        mapping: ``Options.ipu_devices`` (None: the default mapping).

    Raises:
        OptionsError: a device this machine does not have (:func:`resolve_devices`).

    Example:
        >>> p = Placement([0], {0: "cpu"})
        >>> p.device(0)
        device(type='cpu')
        >>> p.close()
    """

    def __init__(self, ipus: Sequence[int], mapping: Optional[dict]):
        self.devices = resolve_devices(sorted(set(ipus)), mapping)
        self.gpu = gpu = current_gpu()  # [Note: the GPU seam] in ``gpu``
        self.streams = {}
        gpus = [dev for dev in self.devices.values() if gpu.is_gpu(dev)]
        cpu_streams = len(self.devices) - len(gpus)
        threads = max(1, torch.get_num_threads() // cpu_streams) if cpu_streams else None
        for ipu, dev in self.devices.items():
            name = f"poptorch_lite-ipu{ipu}"
            self.streams[ipu] = (CudaStream(name, dev, gpus, gpu) if gpu.is_gpu(dev) else
                                 CpuStream(name, threads))
        self.gpus = list(dict.fromkeys(gpus))
        self.gpu_ipus = frozenset(ipu for ipu, dev in self.devices.items()  # on a GPU
                                  if gpu.is_gpu(dev))
        # Garbage collection may run this on any thread, even one that is starting and holds
        # threading's internal locks: it must not join, so it only tells the workers to exit.
        self._finalizer = weakref.finalize(self, _close_all, list(self.streams.values()), False)

    def device(self, ipu: int) -> torch.device:
        return self.devices[ipu]

    def begin(self) -> dict:
        """Mark the caller's work so far on every GPU: the streams of the next run wait for it.

        Returns, per GPU, the event recorded on the caller's current stream (with
        timing) and ``time.perf_counter()`` beside it ([Note: GPU timeline]).
        """
        refs = {}
        for dev in self.gpus:
            event = self.gpu.Event(enable_timing=True)
            event.record(self.gpu.current_stream(dev))
            refs[dev] = (event, time.perf_counter())
        return refs

    def run_lists(self, lists: dict, waits: Callable, call: Callable,
                  watchdog: Optional[float] = None, in_order: Optional[list] = None,
                  begun: Optional[dict] = None) -> dict:
        """Run every stream's action list concurrently ([Note: streams]).

        Args:
            lists: IPU id -> the actions its stream runs, in order.
            waits: action -> the actions on other streams it must wait for.
            call: runs one action (on its stream's worker thread).
            watchdog: seconds without any action finishing before giving up
                (None or 0: wait forever).
            in_order: ``(ipu, action)`` for every action, when the schedule is a total
                order: the caller's thread runs them so (:meth:`run_in_order`).
            begun: what :meth:`begin` returned, if the caller called it (None: now).

        Returns:
            For each action that ran on a CUDA stream, ``(reference event, its
            time.perf_counter(), event at its start, event at its end)``
            ([Note: GPU timeline]; ``timeline.Recorder.add_gpu`` converts them when asked).

        Raises:
            ActionFailed: the first action that raised (the others stopped).
            ActionStuck: the watchdog fired; the stuck streams were abandoned.
            StreamFailed: an asynchronous CUDA error surfaced at the end of the run.
            KeyboardInterrupt: on the caller's thread; the workers stopped first.
        """
        here, threads = self.here(lists, in_order)
        if here is not None:
            return self.run_in_order(here, waits, call, threads, begun)
        # The caller's work so far (weights pushed, an undo) comes first.
        refs = self.begin() if begun is None else begun
        progress = _Progress([event for event, _ in refs.values()],
                             sum(len(actions) for actions in lists.values()))
        futures = {}
        try:  # [Note: Ctrl-C during a run]
            for ipu, actions in lists.items():
                if actions:
                    futures[ipu] = self.streams[ipu].submit(
                        functools.partial(self._work, ipu, actions, waits, call, progress))
            # The caller sleeps until the last action is done or one failed (woken only then,
            # not by every action: a wake-up takes the GIL from the workers' launches), and
            # looks at the progress four times a second: the watchdog's, and a Ctrl-C's turn.
            while not progress.finished.wait(timeout=_LOOK_S):
                if not watchdog:
                    continue
                with progress.cond:
                    idle = time.monotonic() - progress.stamp
                    if progress.failure is None and idle > watchdog:
                        progress.failure = ActionStuck(dict(progress.running), watchdog)
                        break
            with progress.cond:
                progress.stop = progress.failure is not None
                progress.cond.notify_all()
        except BaseException as exc:  # KeyboardInterrupt while waiting: stop the workers, re-raise
            with progress.cond:
                running = dict(progress.running)
                progress.stop = True
                progress.cond.notify_all()
            where = (", ".join(f"{a} on stream {ipu}" for ipu, a in sorted(running.items()))
                     or "no action")
            exc.add_note(f"poptorch_lite: interrupted while running {where}; every stream "
                         "stopped before its next action")
            if isinstance(exc, KeyboardInterrupt):
                _LOG.warning("Ctrl-C: every stream stops before its next action; waiting for "
                             "the running ones (%s)", where)
            concurrent.futures.wait(futures.values())
            self._drain(futures)
            raise
        stuck = progress.failure.running if isinstance(progress.failure, ActionStuck) else {}
        for ipu in stuck:
            self.streams[ipu].abandon()
        concurrent.futures.wait([f for ipu, f in futures.items() if ipu not in stuck])
        failed = self._drain([ipu for ipu in futures if ipu not in stuck])
        if progress.failure is not None:
            raise progress.failure
        if failed is not None:
            raise failed
        return {a: (*refs[self.devices[ipu]], progress.begun[a], progress.events[a])
                for ipu, actions in lists.items() if isinstance(self.streams[ipu], CudaStream)
                for a in actions}

    def run_in_order(self, pairs: list, waits: Callable, call: Callable,
                     threads: Optional[int] = None, begun: Optional[dict] = None,
                     into=None, watch: Optional[Callable] = None) -> dict:
        """Run ``(ipu, action)`` pairs in this order on the caller's thread ([Note: streams]).

        An action of a CUDA stream is launched as that stream's worker would launch it:
        inside the stream's context, after the caller's work so far and the events of the
        actions it depends on; the streams used are synchronized before this returns or
        raises ([Note: values crossing streams] in ``streams``). With ``into``, a stream
        being captured ([Note: step graphs] in ``step_graph``), the same launches are
        recorded: each stream forks from ``into`` before its first action and joins it back
        at the end, also when an action raises, and nothing is timed or synchronized.

        Args:
            pairs: ``(ipu, action)`` in the order to run them; waits, call and begun: as
                :meth:`run_lists`'s; threads: the intra-op threads to run them with (None:
                the caller's own); into: the capture's stream (None: run them); watch: action ->
            a context to run its launch in (a step graph's look for host syncs).

        Returns:
            :meth:`run_lists`'s spans (none inside a capture).

        Raises:
            ActionFailed, StreamFailed, KeyboardInterrupt: as :meth:`run_lists`.
        """
        gpus = [ipu for ipu in dict.fromkeys(ipu for ipu, _ in pairs)
                if isinstance(self.streams[ipu], CudaStream)]
        if not gpus:
            self._run_here(pairs, call, threads)
            return {}
        timed = into is None
        if timed:
            refs = self.begin() if begun is None else begun
            start = [event for event, _ in refs.values()]
        else:
            start = [self.gpu.Event()]
            start[0].record(into)
        events, spans, used = {}, {}, []
        last = {}  # stream -> the event after its latest action, while nothing was enqueued since
        current = context = a = ipu = None
        try:
            for ipu, a in pairs:
                stream = self.streams[ipu]
                if ipu != current:  # this thread's current streams become ipu's
                    if context is not None:
                        context.close()
                    context, current = stream.context(), ipu
                    if stream not in last:  # its first action: after the caller's work
                        stream.wait(start)
                        last[stream] = None
                        used.append(stream)
                needs = waits(a)  # actions of other streams
                if needs:
                    stream.wait([events[d] for d in needs if d in events])
                    last[stream] = None
                on_gpu = ipu in gpus
                # [Note: GPU timeline]: back to back, an action starts where the last one ended
                first = None if not (on_gpu and timed) else (
                    last[stream] if last[stream] is not None else stream.record())
                if watch is None:
                    call(a)
                else:
                    with watch(a):
                        call(a)
                if on_gpu:
                    stream.join()
                    events[a] = last[stream] = stream.record(timed)
                    if timed:
                        spans[a] = (*refs[self.devices[ipu]], first, events[a])
        except BaseException as exc:
            if context is not None:
                context.close()
                context = None
            if timed:
                self._drain(gpus)  # what was launched lands before the caller moves on
            raised = on_caller(a, ipu, exc)
            if raised is exc:
                raise
            raise raised from None
        finally:
            if context is not None:
                context.close()
            if not timed:  # every stream forked into the capture is joined back: it can end
                for stream in used:
                    into.wait_stream(stream.stream)
        if not timed:
            return spans
        failed = self._drain(gpus)
        if failed is not None:
            raise failed
        return spans

    def here(self, lists: dict, in_order: Optional[list] = None) -> tuple:
        """Whether the caller's thread runs these lists itself ([Note: streams]): the
        ``(ipu, action)`` pairs in the order it runs them and the intra-op threads to run them
        with (None: the caller's own), or ``(None, None)`` when the streams' workers run them.

        Example:
            >>> p = Placement([0], {0: "cpu"})
            >>> p.here({0: ["F0", "B0"]})[0]
            [(0, 'F0'), (0, 'B0')]
            >>> p.close()
        """
        used = [ipu for ipu, actions in lists.items() if actions]
        if len(used) == 1:
            return [(used[0], a) for a in lists[used[0]]], self.streams[used[0]].threads
        if in_order is not None:
            return list(in_order), None
        return None, None

    def _drain(self, ipus) -> Optional[StreamFailed]:
        """Wait until the GPU work of ``ipus``' streams has finished, on every path out of a
        run, so that nothing it launched lands after the caller moves on (an undo, the next
        run); the first error it raised, if any."""
        failed = None
        for ipu in ipus:
            try:
                self.streams[ipu].synchronize()
            except Exception as exc:  # an asynchronous CUDA error, raised here and not at its launch
                failed = failed or StreamFailed(ipu, exc)
        return failed

    def _run_here(self, actions: list, call: Callable, threads: Optional[int]) -> None:
        """``(ipu, action)`` pairs in order, on the caller's thread ([Note: streams])."""
        ours = torch.get_num_threads()
        if threads is not None and threads != ours:
            torch.set_num_threads(threads)
        try:
            for ipu, a in actions:
                try:
                    call(a)
                except BaseException as exc:
                    raised = on_caller(a, ipu, exc)
                    if raised is exc:
                        raise
                    raise raised from None
        finally:
            if threads is not None and threads != ours:
                torch.set_num_threads(ours)

    def _work(self, ipu: int, actions: list, waits: Callable, call: Callable,
              progress: _Progress) -> None:
        stream = self.streams[ipu]
        gpu = isinstance(stream, CudaStream)
        with stream.context():
            stream.wait(progress.start)
            for a in actions:
                needs = waits(a)
                if any(d not in progress.done for d in needs):
                    with progress.cond:
                        while not progress.stop and any(d not in progress.done for d in needs):
                            progress.cond.wait()
                if progress.stop:
                    return
                stream.wait([progress.events[d] for d in needs if d in progress.events])
                if gpu:
                    progress.begun[a] = stream.record()
                progress.running[ipu] = a
                try:
                    call(a)
                except BaseException as exc:  # reported by the caller's thread
                    with progress.cond:
                        if progress.failure is None:
                            progress.failure = ActionFailed(a, exc)
                        progress.stop = True
                        progress.cond.notify_all()
                    progress.finished.set()
                    return
                if gpu:
                    stream.join()
                    progress.events[a] = stream.record()
                with progress.cond:
                    del progress.running[ipu]
                    progress.done.add(a)
                    progress.stamp = time.monotonic()
                    progress.cond.notify_all()  # the streams waiting for it
                    if len(progress.done) == progress.total:
                        progress.finished.set()

    def close(self) -> None:
        """Stop every worker thread; a later run starts them again (idempotent)."""
        _close_all(list(self.streams.values()))
