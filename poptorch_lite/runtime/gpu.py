"""The GPU seam: every call the runtime makes to CUDA, behind one object a test can replace.

[Note: the GPU seam]
What a run does differently on a GPU (which devices get a stream of their own,
the streams and events that order work across them, the asynchronous copies of
a call's inputs into GPU memory) goes through a :class:`Gpu`, never through
``torch.cuda`` directly. A :class:`~poptorch_lite.runtime.placement.Placement`
takes the one in force when it is made (:func:`current`), and the executor,
its stage work and its streams ask that placement's. CUDA's is the only one the
package has. The test suite installs a twin (``tests/support/gpu_twin.py``) that takes
the same branches with CPU tensors (:func:`copy_out_all`, the outputs' way back, is plain
torch that it runs as it is): its "GPU" is ``torch.device("cpu", 0)``
(distinct from the host's ``cpu``, so inputs are copied into it and weights get
homes of their own there), its streams and events are stand-ins, and a copy
into it lands only when something waits for it, as on a GPU; until then the
copy holds NaN. A stage's activations and its inputs' gradients, handed to
another stream (:meth:`Gpu.made`, :meth:`Gpu.arrive`), read as NaN there unless
that stream waited for an event recorded after the action that made them. So a
bug of the GPU path that has a shape on the CPU (a copy read by the wrong
micro-batch, a read that does not wait for its copy, a stage that does not wait
for the stage before it) fails the CPU suite, which CI runs without a GPU. A
CUDA graph's twin records a capture op by op and replays it on the same memory
([Note: step graphs] in ``step_graph``), and keeps CUDA's rules for it: no host wait or
read inside a capture (one invalidates it, so that ending it fails), every stream forked into
it joined back, a thread's first cuBLAS or cuDNN call on a stream not inside it, no random op
launched outside it while it is under way; :meth:`Gpu.host_syncs` names the host waits and
reads of the actions it watches, as CUDA's sync debug mode does.
Not twinned: ``record_stream``, the
optimizer step's reads of parameter gradients made on other streams (a tied
weight's included), copies between two GPUs, a generator left in capture mode by a
capture that could not be ended (torch's ``capture_end`` raises before its generators'
epilogue, so their every later draw fails; the program stops the call and asks for a
restart), and GPU arithmetic itself (the CUDA tests and ``benchmarks/gpu_check.sh`` run those
on a real GPU).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional

import torch


class Gpu:
    """CUDA, as the runtime uses it ([Note: the GPU seam]).

    The method names are ``torch.cuda``'s, so the code that calls them reads as
    CUDA code.

    Example:
        >>> CUDA.is_gpu(torch.device("cpu"))
        False
    """

    def is_gpu(self, device: torch.device) -> bool:
        """Whether stages on ``device`` take the GPU's branches (a stream of their own,
        events, asynchronous input copies)."""
        return device.type == "cuda"

    def Stream(self, device: torch.device):  # noqa: N802 (torch.cuda's name)
        return torch.cuda.Stream(device=device)

    def Event(self, enable_timing: bool = False):  # noqa: N802 (torch.cuda's name)
        return torch.cuda.Event(enable_timing=enable_timing)

    def current_stream(self, device: torch.device):
        """This thread's current stream on ``device``."""
        return torch.cuda.current_stream(device)

    def stream(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` this thread's current stream on its device, while inside."""
        return torch.cuda.stream(stream)

    def device(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Make ``device`` this thread's current GPU, while inside."""
        return torch.cuda.device(device)

    def made(self, tensors: list, device: torch.device) -> None:
        """``tensors``, just computed on this thread's current stream on ``device``, are handed
        to other stages (a stage's outputs, its inputs' gradients). CUDA needs nothing: a
        reader on another stream waits for the event recorded after the action ([Note: values
        crossing streams] in ``streams``). The twin lets them land only then."""

    def arrive(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t``, made on another stream, for use on this thread's stream on ``device``.

        Called in the worker of the stream that reads ``t``, after it waited for the
        action that made ``t`` ([Note: values crossing streams] in ``streams``).

        Example:
            >>> CUDA.arrive(torch.ones(2), torch.device("cpu"))
            tensor([1., 1.])
        """
        if t.device.type == "cuda":  # read on this thread's stream: keep its memory until then
            t.record_stream(torch.cuda.current_stream(t.device))
        if t.device == device:
            return t
        return t.to(device, non_blocking=device.type == "cuda")

    def copy_in(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of ``t`` on ``device``, enqueued on this thread's current stream there:
        from the host through pinned memory, so the copy is asynchronous. Its readers on
        other streams must wait for an event recorded after it."""
        if t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(device, non_blocking=True, copy=True)

    def copy_in_all(self, ts: list, device: torch.device) -> list:
        """Copies of the host tensors ``ts`` on ``device`` in one transfer (:func:`joinable`
        ones: one input's micro-batches): joined in pinned memory, copied asynchronously on
        this thread's current stream there, and split into views of ``ts``' rows. One
        transfer costs what one of a micro-batch costs (pinning and a copy's launch, about
        50 µs on an H100's host), so a call of 8 micro-batches saves 7."""
        joined = torch.empty((sum(len(t) for t in ts), *ts[0].shape[1:]), dtype=ts[0].dtype,
                             pin_memory=True)
        torch.cat(ts, out=joined)
        return list(joined.to(device, non_blocking=True).split([len(t) for t in ts]))

    # -- one CUDA graph per step ([Note: step graphs] in ``step_graph``) -------------------

    def records(self, backend: str) -> bool:
        """Whether a captured step can hold stages compiled by ``backend`` (CUDA: every one)."""
        return True

    def graph(self):
        """A new, empty CUDA graph."""
        return torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self, graph, stream) -> Iterator[None]:
        """While inside, what this thread launches on ``stream`` (and on the streams that
        waited for it) is recorded into ``graph``, not run. Only this thread is held to the
        capture's rules (a data loader's thread pinning memory meanwhile is not an error).

        Raises:
            CaptureFailed: the capture could not be ended (a stream not joined back, a call a
                capture forbids): torch's CUDA state may be left inconsistent."""
        capturing = torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")
        capturing.__enter__()
        try:
            yield
        except BaseException as exc:
            _end(capturing, exc)
            raise
        _end(capturing, None)

    @contextlib.contextmanager
    def host_syncs(self, found: list, tag) -> Iterator[None]:
        """While inside, each operation that makes the host wait for the GPU (``.item()``, a
        copy to the host, an op whose output size depends on the data, a stream's
        synchronize) is appended to ``found`` as ``(tag, what)``: a capture forbids them,
        and one inside it invalidates the capture ([Note: step graphs] in ``step_graph``).
        CUDA's sync debug mode names them; it is the process's, so a sync of another thread
        meanwhile counts too (it only keeps a step eager)."""
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
        found += [(tag, str(w.message).splitlines()[0]) for w in caught
                  if "synchronizing" in str(w.message)]

    def replay(self, graph, stream) -> None:
        """Launch ``graph``'s work on ``stream``, after what ``stream`` has queued."""
        with torch.cuda.stream(stream):
            graph.replay()

    def graph_generator(self, graph, device: torch.device) -> torch.Generator:
        """A generator on ``device`` whose state ``graph`` reads at each replay: what it is
        seeded with before a replay is what the replay's random ops draw from."""
        gen = torch.Generator(device)
        graph.register_generator_state(gen)
        return gen

    def draw_from(self, default: torch.Generator, gen: torch.Generator):
        """Make ``default`` draw from ``gen``'s state while capturing (the random ops of a
        graph take the device's default generator); returns what :meth:`drawn` takes to put
        ``default`` back. ``gen``'s state advances with the draws."""
        saved = default.graphsafe_get_state()
        default.graphsafe_set_state(gen.graphsafe_get_state())
        return saved

    def drawn(self, default: torch.Generator, saved) -> None:
        default.graphsafe_set_state(saved)

    def copy_rows_into(self, target: torch.Tensor, sources: list, device: torch.device) -> None:
        """``target`` (on ``device``) <- the concatenation of ``sources`` along rows, on this
        thread's current stream there: host tensors joined in pinned memory and copied
        asynchronously, device tensors copied on the device."""
        if all(t.device.type == "cpu" for t in sources):
            joined = torch.empty(target.shape, dtype=target.dtype, pin_memory=True)
            if len(sources) > 1:
                torch.cat(sources, out=joined)
            else:
                joined.copy_(sources[0])
            target.copy_(joined, non_blocking=True)
        elif len(sources) == 1:
            target.copy_(sources[0], non_blocking=True)
        else:
            target.copy_(torch.cat([t.to(target.device, non_blocking=True) for t in sources]))


class CaptureFailed(Exception):
    """Ending a CUDA graph's capture failed ([Note: step graphs] in ``step_graph``)."""


def _end(capturing, exc: Optional[BaseException]) -> None:
    """End ``capturing`` (a ``torch.cuda.graph``) after its body raised ``exc`` (or None);
    an error of the end itself is :class:`CaptureFailed`."""
    try:
        capturing.__exit__(type(exc) if exc is not None else None, exc,
                           exc.__traceback__ if exc is not None else None)
    except Exception as failed:
        raise CaptureFailed(f"{type(failed).__name__}: {failed}") from failed


def joinable(ts: list) -> bool:
    """Whether :meth:`Gpu.copy_in_all` can copy ``ts`` in one transfer: two or more host
    tensors of one dtype and layout, with rows of one shape, none needing a gradient.

    Example:
        >>> joinable([torch.zeros(2, 3), torch.ones(1, 3)])
        True
        >>> joinable([torch.zeros(2), torch.zeros(())]), joinable([torch.zeros(2, 3)])
        (False, False)
    """
    if len(ts) < 2:
        return False
    first = ts[0]
    return first.dim() > 0 and all(
        t.device.type == "cpu" and t.dtype == first.dtype and t.layout == torch.strided
        and t.dim() == first.dim() and t.shape[1:] == first.shape[1:] and not t.requires_grad
        for t in ts)


JOIN_BYTES = 1 << 22  # the largest output that :func:`copy_out_all` joins on a GPU


def copy_out_all(values: list) -> Optional[list]:
    """Host copies of one output's values (one per kept micro-batch, made on one GPU) in one
    copy: joined there, copied back once and split into views of the host copy, where one
    blocking copy per micro-batch would each cost a launch and a wait. ``batch.merge`` then
    concatenates or sums the views into what the call returns, so none outlives the call.
    None where they cannot be joined: not all computed, of several dtypes or devices, not
    strided, or more than ``JOIN_BYTES`` in all (such copies are bandwidth-bound, and
    joining them would hold a second copy on the GPU).

    Example:
        >>> copy_out_all([torch.zeros(2), torch.ones(1, 1)])
        [tensor([0., 0.]), tensor([[1.]])]
        >>> copy_out_all([torch.zeros(2), None]) is None
        True
    """
    first = values[0]
    if first is None or not all(
            v is not None and v.dtype == first.dtype and v.device == first.device
            and v.layout == torch.strided for v in values) or sum(
            v.numel() for v in values) * first.element_size() > JOIN_BYTES:
        return None
    copied = torch.cat([v.reshape(-1) for v in values]).cpu()
    return [piece.view(v.shape) for v, piece in zip(values, copied.split(
        [v.numel() for v in values]))]


CUDA = Gpu()
_current = [CUDA]


def current() -> Gpu:
    """The GPU backend in force ([Note: the GPU seam]): CUDA's unless a test installed another."""
    return _current[-1]


@contextlib.contextmanager
def installed(backend: Gpu) -> Iterator[Gpu]:
    """Put ``backend`` in force for the placements made while inside (tests' twin).

    Example:
        >>> with installed(CUDA) as gpu:
        ...     current() is gpu
        True
    """
    _current.append(backend)
    try:
        yield backend
    finally:
        _current.remove(backend)
