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
finished for ``watchdog`` seconds. One exception: when a run uses a single CPU
stream, or only CPU streams under a schedule that is a total order (Sequential,
one action per row), the caller's thread runs the actions itself, in order, as
plain PyTorch would run the same ops, with all of its intra-op threads.
Handing every action to a worker thread cost a single-stage model 15–100% of
its step time on a 2-core machine (its intra-op threads ran a team of their own
beside the caller's; docs/PERFORMANCE.md (g)), and with one stream, or one
action at a time, there is nothing to overlap. The watchdog then has no other stream to watch: a
stuck action there hangs the call as it would hang plain PyTorch, and Ctrl-C
stops it as usual. Workers start on first use, are reused by
every run, and stop on ``close()`` or when the placement is garbage
collected; a stream whose action is stuck is abandoned and gets a fresh
worker on its next use. The CPU streams share the caller's intra-op threads
(``torch.get_num_threads()`` when the placement is made) evenly, at least one
each, so concurrent stages do not oversubscribe the cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

import torch


def default_device(ipu: int) -> torch.device:
    """IPU ``ipu``'s device when no mapping is given: CUDA round-robin, else CPU.

    The round starts at the current CUDA device (cuda:LOCAL_RANK in a process
    that torchrun started; ``distributed``), so processes on one host use
    different GPUs.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", (torch.cuda.current_device() + ipu) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_devices(ipus: Sequence[int], mapping: Optional[dict]) -> dict:
    """IPU id -> torch.device, from ``Options.set_ipu_devices`` or the default.

    Example:
        >>> resolve_devices([0, 1], {0: torch.device("cpu"), 1: torch.device("cpu")})[1]
        device(type='cpu')
    """
    devices = {}
    for ipu in ipus:
        if mapping is not None and ipu in mapping:
            devices[ipu] = torch.device(mapping[ipu])
        else:
            devices[ipu] = default_device(ipu)
    return devices


def _set_threads(n: int) -> None:
    torch.get_num_threads()  # torch sets a thread's count lazily, from its default: do it now
    torch.set_num_threads(n)


class ActionFailed(Exception):
    """An action raised: ``.action`` and the exception as ``__cause__``-style ``.exc``."""

    def __init__(self, action, exc: BaseException):
        super().__init__(f"{action}: {exc!r}")
        self.action, self.exc = action, exc


class ActionStuck(Exception):
    """No action finished for ``.seconds``; ``.running`` maps stream -> its current action."""

    def __init__(self, running: dict, seconds: float):
        super().__init__(f"no progress for {seconds} s; running: {running}")
        self.running, self.seconds = running, seconds


class CpuStream:
    """A worker thread that runs submitted work in order ([Note: streams]).

    Args:
        name: the worker thread's name prefix.
        threads: torch intra-op threads for the worker (None: torch's default). CPU
            streams share the cores: two streams with two intra-op threads each on two
            cores lose about a quarter of their speed to oversubscription.
    """

    def __init__(self, name: str, threads: Optional[int] = None):
        self.name = name
        self.threads = threads
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def context(self):
        """What the worker runs its list inside (the CUDA stream on a GPU)."""
        return contextlib.nullcontext()

    def wait(self, events: list) -> None:
        """Order this stream after ``events`` (CUDA); on the CPU, being done is enough."""

    def record(self):
        """An event marking the end of the work launched so far (CUDA), else None."""
        return None

    def synchronize(self) -> None:
        """Wait on the host until the work launched so far has finished."""

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn`` on this stream's worker thread (started on first use)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
            if self.threads is not None:
                ours = torch.get_num_threads()
                self._pool.submit(_set_threads, self.threads).result()
                torch.set_num_threads(ours)  # the setting is also torch's default for new threads
        return self._pool.submit(fn)

    def abandon(self) -> None:
        """Leave a stuck worker behind (it exits when its action returns); start afresh."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self, wait: bool = True) -> None:
        """Stop the worker (``wait``: until it has exited)."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
            self._pool = None


class CudaStream(CpuStream):
    """A ``torch.cuda.Stream`` that a worker thread launches actions on ([Note: streams])."""

    def __init__(self, name: str, device: torch.device):
        super().__init__(name)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def wait(self, events: list) -> None:
        for event in events:
            self.stream.wait_event(event)

    def record(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()


class _Progress:
    """What the workers of one run share: actions done, the first failure, a stop flag."""

    def __init__(self):
        self.cond = threading.Condition()
        self.done: set = set()
        self.events: dict = {}    # action -> CUDA event recorded after it
        self.running: dict = {}   # stream -> action
        self.failure: Optional[BaseException] = None
        self.stop = False
        self.stamp = time.monotonic()


class Placement:
    """The device and stream of every IPU a partition uses.

    Args:
        ipus: the IPU ids in use.
        mapping: ``Options.ipu_devices`` (None: the default mapping).

    Example:
        >>> p = Placement([0], {0: "cpu"})
        >>> p.device(0)
        device(type='cpu')
        >>> p.close()
    """

    def __init__(self, ipus: Sequence[int], mapping: Optional[dict]):
        self.devices = resolve_devices(sorted(set(ipus)), mapping)
        self.streams = {}
        cpu_streams = sum(dev.type == "cpu" for dev in self.devices.values())
        threads = max(1, torch.get_num_threads() // cpu_streams) if cpu_streams else None
        for ipu, dev in self.devices.items():
            name = f"poptorch_lite-ipu{ipu}"
            self.streams[ipu] = (CudaStream(name, dev) if dev.type == "cuda" else
                                 CpuStream(name, threads))
        # Garbage collection may run this on any thread, even one that is starting and holds
        # threading's internal locks: it must not join, so it only tells the workers to exit.
        self._finalizer = weakref.finalize(self, _close_all, list(self.streams.values()), False)

    def device(self, ipu: int) -> torch.device:
        return self.devices[ipu]

    def run_lists(self, lists: dict, waits: Callable, call: Callable,
                  watchdog: Optional[float] = None, in_order: Optional[list] = None) -> None:
        """Run every stream's action list concurrently ([Note: streams]).

        Args:
            lists: IPU id -> the actions its stream runs, in order.
            waits: action -> the actions on other streams it must wait for.
            call: runs one action (on its stream's worker thread).
            watchdog: seconds without any action finishing before giving up
                (None or 0: wait forever).
            in_order: ``(ipu, action)`` for every action, when the schedule is a total
                order: with CPU streams only, the caller's thread runs them so.

        Raises:
            ActionFailed: the first action that raised (the others stopped).
            ActionStuck: the watchdog fired; the stuck streams were abandoned.
            KeyboardInterrupt: on the caller's thread; the workers stopped first.
        """
        used = [ipu for ipu, actions in lists.items() if actions]
        if len(used) == 1 and type(self.streams[used[0]]) is CpuStream:
            return self._run_here([(used[0], a) for a in lists[used[0]]], call,
                                  self.streams[used[0]].threads)
        if in_order is not None and all(type(self.streams[k]) is CpuStream for k in used):
            return self._run_here(in_order, call, None)
        progress = _Progress()
        total = sum(len(actions) for actions in lists.values())
        futures = {ipu: self.streams[ipu].submit(
            functools.partial(self._work, ipu, actions, waits, call, progress))
            for ipu, actions in lists.items() if actions}
        try:
            with progress.cond:
                while len(progress.done) < total and progress.failure is None:
                    progress.cond.wait(timeout=0.25 if watchdog else None)
                    idle = time.monotonic() - progress.stamp
                    if watchdog and progress.failure is None and idle > watchdog:
                        progress.failure = ActionStuck(dict(progress.running), watchdog)
                progress.stop = progress.failure is not None
                progress.cond.notify_all()
        except BaseException as exc:  # KeyboardInterrupt while waiting: stop the workers, re-raise
            with progress.cond:
                running = dict(progress.running)
                progress.stop = True
                progress.cond.notify_all()
            exc.add_note("poptorch_lite: interrupted while running " + (", ".join(
                f"{a} on stream {ipu}" for ipu, a in sorted(running.items())) or "no action")
                + "; every stream stopped before its next action")
            concurrent.futures.wait(futures.values())
            raise
        if isinstance(progress.failure, ActionStuck):
            stuck = progress.failure.running
            for ipu in stuck:
                self.streams[ipu].abandon()
            concurrent.futures.wait([f for ipu, f in futures.items() if ipu not in stuck])
            raise progress.failure
        concurrent.futures.wait(futures.values())
        for ipu in futures:
            self.streams[ipu].synchronize()
        if progress.failure is not None:
            raise progress.failure

    def _run_here(self, actions: list, call: Callable, threads: Optional[int]) -> None:
        """``(ipu, action)`` pairs in order, on the caller's thread ([Note: streams])."""
        ours = torch.get_num_threads()
        if threads is not None and threads != ours:
            torch.set_num_threads(threads)
        try:
            for ipu, a in actions:
                try:
                    call(a)
                except KeyboardInterrupt as exc:
                    exc.add_note(f"poptorch_lite: interrupted while running {a} on stream {ipu}; "
                                 f"every stream stopped before its next action")
                    raise
                except BaseException as exc:
                    raise ActionFailed(a, exc) from None
        finally:
            if threads is not None and threads != ours:
                torch.set_num_threads(ours)

    def _work(self, ipu: int, actions: list, waits: Callable, call: Callable,
              progress: _Progress) -> None:
        stream = self.streams[ipu]
        with stream.context():
            for a in actions:
                needs = waits(a)
                if any(d not in progress.done for d in needs):
                    with progress.cond:
                        while not progress.stop and any(d not in progress.done for d in needs):
                            progress.cond.wait()
                if progress.stop:
                    return
                stream.wait([progress.events[d] for d in needs if d in progress.events])
                progress.running[ipu] = a
                try:
                    call(a)
                except BaseException as exc:  # reported by the caller's thread
                    with progress.cond:
                        if progress.failure is None:
                            progress.failure = ActionFailed(a, exc)
                        progress.stop = True
                        progress.cond.notify_all()
                    return
                event = stream.record()
                if event is not None:
                    progress.events[a] = event
                with progress.cond:
                    del progress.running[ipu]
                    progress.done.add(a)
                    progress.stamp = time.monotonic()
                    progress.cond.notify_all()

    def close(self) -> None:
        """Stop every worker thread; a later run starts them again (idempotent)."""
        _close_all(list(self.streams.values()))


def _close_all(streams: list, wait: bool = True) -> None:
    for s in streams:
        s.close(wait)
