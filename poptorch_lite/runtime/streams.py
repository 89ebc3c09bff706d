"""Streams: where a stage's actions run, and how tensors cross between them.

A :class:`CpuStream` is a worker thread; a :class:`CudaStream` is a worker thread
launching on a ``torch.cuda.Stream`` of its own (with side streams on the other
GPUs). :class:`~poptorch_lite.runtime.placement.Placement` gives each IPU one and
runs the schedule's lists on them ([Note: streams] in ``placement``).

[Note: values crossing streams]
On the GPU, "done" means launched, so every read of a tensor that another
stream made must be ordered on the device, and its memory must outlive the
read:

- Before its first action every stream waits for the caller's work on every
  GPU of the placement (one event per GPU, recorded on the caller's current
  stream when the run starts): the inputs it copied there, weights it pushed,
  an undo's restore copies. A CPU stream waits for such events on the host.
- Before each action the stream waits for the events of the actions it
  depends on; a CPU stream synchronizes on them, so a CPU stage never reads a
  GPU result before it is finished.
- A worker's current stream on every *other* GPU of the placement is a side
  stream of its own that waits on the same events, so whatever an action does
  there (a copy from another GPU, a gradient gathered from a tied weight's
  copy, the optimizer's step on the weights homed there) is ordered after what
  it depends on; after the action the main stream waits for the side streams
  (:meth:`CudaStream.join`), so the action's event covers them too.
- A tensor made on another stream is taken through :func:`arrive`, which
  calls ``record_stream`` for the stream that reads it (the caching allocator
  would otherwise hand its memory to the maker's next allocation while the
  read is still queued) and copies it to the reader's device if it is
  elsewhere (a copy from another GPU runs on the side stream, then the reader's
  stream waits for it).
- Every way out of a run (success, a failed action, the watchdog, Ctrl-C)
  first synchronizes the streams that are not stuck, so nothing a run launched
  lands after an undo or inside the next run. An asynchronous CUDA error that
  surfaces there is raised as :class:`StreamFailed`: CUDA reports a kernel's
  failure late, so the message names the stream, not the action
  (``CUDA_LAUNCH_BLOCKING=1`` makes it raise in the action that launched it).
  A stuck stream is abandoned with its CUDA streams: its late launches land on
  those, and the stream gets new ones.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable, Optional, Sequence

import torch

from .gpu import CUDA, Gpu


def _set_threads(n: int) -> None:
    torch.get_num_threads()  # torch sets a thread's count lazily, from its default: do it now
    torch.set_num_threads(n)


class ActionFailed(Exception):
    """An action raised: ``.action`` and the exception as ``__cause__``-style ``.exc``."""

    def __init__(self, action, exc: BaseException):
        super().__init__(f"{action}: {exc!r}")
        self.action, self.exc = action, exc


def on_caller(a, ipu: int, exc: BaseException) -> BaseException:
    """What the caller's thread raises when action ``a`` of stream ``ipu``, run there, raised
    ``exc``: a KeyboardInterrupt itself, with a note of where; anything else as ActionFailed."""
    if isinstance(exc, KeyboardInterrupt):
        exc.add_note(f"poptorch_lite: interrupted while running {a} on stream {ipu}; every "
                     f"stream stopped before its next action")
        return exc
    return ActionFailed(a, exc)


class ActionStuck(Exception):
    """No action finished for ``.seconds``; ``.running`` maps stream -> its current action."""

    def __init__(self, running: dict, seconds: float):
        super().__init__(f"no progress for {seconds} s; running: {running}")
        self.running, self.seconds = running, seconds


class StreamFailed(Exception):
    """Waiting for stream ``.ipu`` at the end of a run raised (an asynchronous CUDA error)."""

    def __init__(self, ipu: int, exc: BaseException):
        super().__init__(f"stream {ipu}: {exc!r}")
        self.ipu, self.exc = ipu, exc


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

    def context(self) -> contextlib.ExitStack:
        """What the worker runs its list inside (the CUDA streams on a GPU), already entered:
        ``close()`` leaves it, as ``with`` does (``Placement.run_in_order`` switches between
        the streams of a run that mixes the host and a GPU by closing one and taking the next)."""
        return contextlib.ExitStack()

    def wait(self, events: list) -> None:
        """Order this stream's next action after ``events`` ([Note: values crossing streams]).

        A CPU action runs when it is called, so it waits on the host for the GPU
        work of the actions it depends on (a CPU stage reading a GPU stage's result).
        """
        for event in events:
            event.synchronize()

    def join(self) -> None:
        """After an action: fold the work it launched on other GPUs into this stream (CUDA)."""

    def record(self, timing: bool = True):
        """An event marking the end of the work launched so far (CUDA; timed: for the
        timeline), else None."""
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
    """A GPU stream that a worker thread launches actions on ([Note: streams]).

    Args:
        name: the worker thread's name prefix.
        device: its GPU.
        others: the placement's other GPUs: the worker keeps a stream on each
            ([Note: values crossing streams]).
        gpu: the GPU backend (``gpu.CUDA``; a test's twin: [Note: the GPU seam] in ``gpu``).
    """

    def __init__(self, name: str, device: torch.device, others: Sequence[torch.device] = (),
                 gpu: Gpu = CUDA):
        super().__init__(name)
        self.device = device
        self.gpu = gpu
        self.others = [d for d in dict.fromkeys(others) if d != device]
        self._fresh()

    def _fresh(self) -> None:
        self.stream = self.gpu.Stream(self.device)
        self.side = [self.gpu.Stream(d) for d in self.others]

    def context(self):
        stack = contextlib.ExitStack()
        for side in self.side:  # this thread's current stream on each other GPU
            stack.enter_context(self.gpu.stream(side))
        stack.enter_context(self.gpu.device(self.device))
        stack.enter_context(self.gpu.stream(self.stream))
        return stack

    def wait(self, events: list) -> None:
        for event in events:
            self.stream.wait_event(event)
            for side in self.side:
                side.wait_event(event)

    def join(self) -> None:
        for side in self.side:
            self.stream.wait_stream(side)

    def record(self, timing: bool = True):
        """An event after the work launched on this stream so far (timed: for the timeline)."""
        event = self.gpu.Event(enable_timing=timing)
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

    def abandon(self) -> None:
        """Also leave the GPU streams to the stuck action: its late launches land there."""
        super().abandon()
        self._fresh()


def arrive(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, made on another stream, for use on this thread's stream on ``device``
    (:meth:`Gpu.arrive` of CUDA's seam; the stage work asks its placement's).

    Example:
        >>> arrive(torch.ones(2), torch.device("cpu"))
        tensor([1., 1.])
    """
    return CUDA.arrive(t, device)


def _close_all(streams: list, wait: bool = True) -> None:
    for s in streams:
        s.close(wait)
