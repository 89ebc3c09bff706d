"""Placement: each IPU id on a torch device and an execution stream.

[Note: streams]
A stream runs its actions in submission order. On CUDA it is a
``torch.cuda.Stream``; on the CPU it is a worker thread (a "CPU stream").
The executor runs a schedule's rows in order: when a row has one action it runs
on the caller's thread (inside the CUDA stream's context on a GPU); when it
has several, each goes to its stream's worker and the row ends when all have
finished, so work across streams is ordered row by row. On the GPU, launching
is asynchronous: each CUDA stream first waits for the events that the previous
row's streams recorded, and ``finish()`` waits for the last row before the
host reads results. Workers start on first
use and stop on ``close()`` or when the placement is garbage collected.

[Note: weight homes]
A stage uses a parameter where it lives: on the same device, the user's own
``Parameter`` object (one home for the weights). A stage on another device
uses a copy that ``Weights`` keeps in step: gradients are gathered on the
host parameter before the optimizer step, and copies are refreshed after it.
Replicas beyond the first keep their own buffers when
``broadcastBuffers(False)``.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from typing import Callable, Optional, Sequence

import torch


def default_device(ipu: int) -> torch.device:
    """IPU ``ipu``'s device when no mapping is given: CUDA round-robin, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", ipu % torch.cuda.device_count())
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


class CpuStream:
    """A worker thread that runs submitted actions in order ([Note: streams])."""

    def __init__(self, name: str):
        self.name = name
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def _launch(self, fn: Callable):
        return fn()

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn`` on this stream's worker thread (started on first use)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        return self._pool.submit(self._launch, fn)

    def run_here(self, fn: Callable):
        """Run ``fn`` on the caller's thread, as this stream's next action."""
        return self._launch(fn)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class CudaStream(CpuStream):
    """A ``torch.cuda.Stream`` that actions are launched on ([Note: streams]).

    Before each action the stream waits for the events recorded by the previous
    row's actions; after it, it records an event of its own, so rows are ordered
    across streams on the GPU without the host waiting.
    """

    def __init__(self, name: str, device: torch.device):
        super().__init__(name)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.waits: list = []   # events of the previous row, set by the placement
        self.done = None        # the event recorded after this stream's last action

    def _launch(self, fn: Callable):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for event in self.waits:
                self.stream.wait_event(event)
            result = fn()
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
            return result


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
        for ipu, dev in self.devices.items():
            name = f"poptorch_lite-ipu{ipu}"
            self.streams[ipu] = CudaStream(name, dev) if dev.type == "cuda" else CpuStream(name)
        self._finalizer = weakref.finalize(self, _close_all, list(self.streams.values()))
        self._row_events: list = []  # CUDA events recorded by the last row's actions

    def device(self, ipu: int) -> torch.device:
        return self.devices[ipu]

    def run_row(self, work: Sequence[tuple]) -> list:
        """Run ``[(ipu, fn), ...]`` together, one per stream, after everything of the last row.

        Returns one ``(value, None)`` or ``(None, exception)`` per item, in ``work`` order.
        """
        for ipu, _ in work:
            stream = self.streams[ipu]
            if isinstance(stream, CudaStream):
                stream.waits = self._row_events
        if len(work) == 1:
            ipu, fn = work[0]
            try:
                results = [(self.streams[ipu].run_here(fn), None)]
            except Exception as exc:  # reported by the executor with its context
                results = [(None, exc)]
        else:
            futures = [self.streams[ipu].submit(fn) for ipu, fn in work]
            results = []
            for f in futures:
                try:
                    results.append((f.result(), None))
                except Exception as exc:
                    results.append((None, exc))
        self._row_events = [self.streams[ipu].done for ipu, _ in work
                            if isinstance(self.streams[ipu], CudaStream)]
        return results

    def finish(self) -> None:
        """Wait on the host for the last row's GPU work (before results are read)."""
        for event in self._row_events:
            event.synchronize()
        self._row_events = []

    def close(self) -> None:
        """Stop every worker thread; a later row starts them again (idempotent)."""
        _close_all(list(self.streams.values()))


def _close_all(streams: list) -> None:
    for s in streams:
        s.close()


class Weights:
    """The tensors each stage computes with ([Note: weight homes]).

    Args:
        model: the user's model (its parameters and buffers are the host copy).
        replicas: R.
        separate_buffers: replicas r > 0 keep their own buffers.
    """

    def __init__(self, model: torch.nn.Module, replicas: int, separate_buffers: bool):
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.replicas = replicas
        self.separate_buffers = separate_buffers and replicas > 1
        self._param_copies: dict = {}
        self._buffer_copies: dict = {}
        self._replica_buffers: list = []
        self.to_device()

    def param(self, name: str, device: torch.device) -> torch.Tensor:
        p = self.params[name]
        if p.device == device:
            return p
        key = (name, device)
        if key not in self._param_copies:
            self._param_copies[key] = p.detach().to(device).requires_grad_(p.requires_grad)
        return self._param_copies[key]

    def buffer(self, name: str, replica: int, device: torch.device) -> torch.Tensor:
        b = self._replica_buffers[replica - 1][name] if self.separate_buffers and replica else \
            self.buffers[name]
        if b.device == device:
            return b
        key = (name, replica, device)
        if key not in self._buffer_copies:
            self._buffer_copies[key] = b.detach().to(device)
        return self._buffer_copies[key]

    def to_device(self) -> None:
        """Refresh every copy from the host model (``copyWeightsToDevice``)."""
        with torch.no_grad():
            self._replica_buffers = [{n: b.detach().clone() for n, b in self.buffers.items()}
                                     for _ in range(self.replicas - 1)] if self.separate_buffers else []
            for (name, device), c in self._param_copies.items():
                c.copy_(self.params[name])
            self._buffer_copies.clear()

    def to_host(self) -> None:
        """Copy device-side buffers of replica 0 back to the host model (``copyWeightsToHost``)."""
        with torch.no_grad():
            for (name, replica, device), c in self._buffer_copies.items():
                if replica == 0:
                    self.buffers[name].copy_(c)

    def zero_grads(self) -> None:
        for p in self.params.values():
            p.grad = None
        for c in self._param_copies.values():
            c.grad = None

    def gather_grad(self, name: str) -> Optional[torch.Tensor]:
        """Sum the gradient of parameter ``name`` over its device copies onto the host parameter."""
        p = self.params[name]
        for (n, device), c in self._param_copies.items():
            if n == name and c.grad is not None:
                g = c.grad.to(p.device)
                p.grad = g if p.grad is None else p.grad + g
                c.grad = None
        return p.grad

    def after_step(self) -> None:
        """The optimizer changed the host parameters: refresh their device copies."""
        with torch.no_grad():
            for (name, device), c in self._param_copies.items():
                c.copy_(self.params[name])
