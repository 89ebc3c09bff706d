"""A twin of the GPU for the CPU suite ([Note: the GPU seam] in ``poptorch_lite/runtime/gpu.py``).

``TwinGpu`` takes every branch the runtime takes for a GPU, with CPU tensors: its GPU is
``TWIN`` (``torch.device("cpu", 0)``, which is not the host's ``cpu``), its streams and
events are stand-ins that keep CUDA's ordering rules, and a copy into it is asynchronous
as on a GPU: it holds NaN (integers: a value out of any range) until something waits for
an event recorded after it, or for its stream. A run that reads a copy without waiting
computes on NaN; a run that reads the wrong micro-batch's copy computes wrong numbers.

Example:
    >>> twin = TwinGpu()
    >>> host = torch.ones(2)
    >>> copy = twin.copy_in(host, TWIN)
    >>> bool(copy.isnan().all())  # launched, not landed
    True
    >>> event = twin.Event()
    >>> event.record(twin.current_stream(TWIN))
    >>> twin.Stream(TWIN).wait_event(event)  # a reader's stream waits for it
    >>> copy
    tensor([1., 1.])
"""

import contextlib
import threading
import time
import weakref

import torch

from poptorch_lite.runtime.gpu import CaptureFailed

TWIN = torch.device("cpu", 0)


class TwinStream:
    """A stand-in CUDA stream: work launched on it runs when something waits for it."""

    def __init__(self, device):
        self.device = device
        self.pending = []    # (sequence number, work) launched and not yet run
        self.launched = 0    # work launched so far
        self.ops = 0         # launches, waits and event records so far (their order)
        self.waits = []      # (op of the wait, other stream, its work up to, its op up to)
        self.waited = {}     # other stream -> how far this one waited for it itself
        self.synced = 0      # how far the host waited for this stream
        self.lock = threading.RLock()

    def launch(self, work) -> None:
        with self.lock:
            self.launched += 1
            self.ops += 1
            self.pending.append((self.launched, work))

    def _waited(self, other, mark: int, op: int) -> None:
        with self.lock:
            self.ops += 1
            self.waits.append((self.ops, other, mark, op))
            self.waited[other] = max(self.waited.get(other, 0), mark)

    def run_until(self, mark: int) -> None:
        """Run the work launched up to ``mark``, in order (what a wait on an event needs)."""
        with self.lock:
            while self.pending and self.pending[0][0] <= mark:
                _, work = self.pending.pop(0)
                _paused.on = True  # queued before a capture: not part of it
                try:
                    work()
                finally:
                    _paused.on = False

    def wait_event(self, event) -> None:
        if event.stream is not None:  # the device waits: the host learns nothing
            event.stream.run_until(event.mark)
            self._waited(event.stream, event.mark, event.op)
            _joins(self, event.stream)

    def wait_stream(self, other) -> None:
        mark, op = other.launched, other.ops
        other.synchronize(host=False)
        self._waited(other, mark, op)
        _joins(self, other)

    def synchronize(self, host: bool = True) -> None:
        if host:
            _no_host_wait()
        mark = self.launched
        self.run_until(mark)
        self.synced = max(self.synced, mark)

    def sees(self, other, mark: int) -> bool:
        """Whether work launched on ``other`` up to ``mark`` is visible to this stream's work
        now: the host waited for it, or this stream waited for it, directly or through
        streams that had waited for it before the point this one waited for (CUDA's waits
        are transitive: a wait orders what follows it after all the waited stream's work
        before the event, its own waits included)."""
        if other is self or other.synced >= mark:
            return True
        ops, work, todo = {self: self.ops}, {}, [self]
        while todo:  # how far each stream's work and waits are ordered before this one's
            s = todo.pop()
            for op, o, m, o_op in list(s.waits):
                if op <= ops[s]:
                    work[o] = max(work.get(o, 0), m)
                    if o_op > ops.get(o, 0):
                        ops[o] = o_op
                        todo.append(o)
        return work.get(other, 0) >= mark


class TwinEvent:
    """A stand-in CUDA event: marks a stream's work so far, with the host time it was recorded."""

    def __init__(self, enable_timing: bool = False):
        self.stream, self.mark, self.op, self.time = None, 0, 0, None

    def record(self, stream=None) -> None:
        with stream.lock:
            stream.ops += 1
            self.stream, self.mark, self.op = stream, stream.launched, stream.ops
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        """The host waits for the event: the work before it is visible to all that follows
        (a host stage reads a GPU stage's values after this)."""
        _no_host_wait()
        if self.stream is not None:
            self.stream.run_until(self.mark)
            self.stream.synced = max(self.stream.synced, self.mark)

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1e3


class TwinGpu:
    """The GPU seam's twin (``poptorch_lite.runtime.gpu.Gpu``'s methods); ``copies`` lists
    every ``(source, device)`` copied in, for tests that count copies."""

    def __init__(self):
        self.copies = []
        self.unwaited = []               # (value's shape, maker, reader): read before landing
        self._default = {}               # device -> its default stream, shared by threads
        self._local = threading.local()  # this thread's current stream per device
        self._lock = threading.Lock()
        self._made = {}                  # data_ptr -> (the value, its stream, its work's mark)
        self.captures = []               # the TwinGraphs captured, in order
        self.drawing = []                # the graph generators random ops draw from now
        self.warm = set()                # (thread, stream): its cuBLAS/cuDNN state is made

    def is_gpu(self, device) -> bool:
        return device.type == "cpu" and device.index is not None

    def Stream(self, device):  # noqa: N802
        return TwinStream(device)

    def Event(self, enable_timing: bool = False):  # noqa: N802
        return TwinEvent(enable_timing)

    def current_stream(self, device):
        current = getattr(self._local, "streams", {}).get(device)
        if current is not None:
            return current
        with self._lock:
            return self._default.setdefault(device, TwinStream(device))

    @contextlib.contextmanager
    def stream(self, stream):
        streams = self._local.__dict__.setdefault("streams", {})
        before = streams.get(stream.device)
        streams[stream.device] = stream
        key = (threading.get_ident(), stream)
        # Outside a capture, until this thread's first cuBLAS or cuDNN call on the stream:
        # watch for it ([Note: library state on first use]).
        warming = _Warming(self, key) if key not in self.warm and _CAPTURE.get(
            "thread") != key[0] else contextlib.nullcontext()
        try:
            with warming:
                yield
        finally:
            if before is None:
                del streams[stream.device]
            else:
                streams[stream.device] = before

    def device(self, device):
        return contextlib.nullcontext()

    def made(self, tensors, device) -> None:
        """An action's values for other stages: its work on this thread's current stream, so
        a reader on another stream sees them only after waiting for an event recorded after
        it (or after the host synchronized this stream)."""
        stream = self.current_stream(device)
        stream.launch(lambda: None)  # the action's kernels: its end event comes after them
        for t in tensors:
            # A view of a leaf (``weight.t()`` of a parameter, a buffer, an input) is memory no
            # kernel of the action wrote: nothing to wait for.
            if isinstance(t, torch.Tensor) and t.numel() and not (
                    t._base is not None and t._base.is_leaf):
                self._made[t.data_ptr()] = (weakref.ref(t), stream, stream.launched)

    def arrive(self, t: torch.Tensor, device) -> torch.Tensor:
        """``t`` as this thread's stream on ``device`` reads it: NaN (integers: a value out of
        any range) where it was made on another stream that this one did not wait for."""
        entry = self._made.get(t.data_ptr()) if t.numel() else None
        if entry is not None:
            ref, stream, mark = entry
            made = ref()
            reader = self.current_stream(device)
            if made is not None and made.data_ptr() == t.data_ptr() and not reader.sees(
                    stream, mark):
                self.unwaited.append((tuple(t.shape), stream, reader))
                return _poisoned(t)
        return t

    def copy_in(self, t: torch.Tensor, device) -> torch.Tensor:
        self.copies.append((t, device))
        pinned = t.clone()  # pinning copies the host tensor now; the transfer comes later
        out = _poisoned(t)
        self.current_stream(device).launch(lambda: out.copy_(pinned))
        return out

    # -- CUDA graphs ([Note: step graphs] in poptorch_lite/runtime/step_graph.py) ---------

    def records(self, backend: str) -> bool:
        """Inductor's CPU kernels run outside the dispatcher, where a capture records."""
        return backend != "inductor"

    def graph(self):
        return TwinGraph()

    @contextlib.contextmanager
    def capture(self, graph, stream):
        """As CUDA's: a stream that joined the capture (it waited for the capture stream, or
        for one that joined) must be joined back before it ends, or ending it fails; the host
        waiting for a stream or an event meanwhile is refused."""
        recording = _Recording(graph, self)
        self.captures.append(graph)
        _CAPTURE.update(streams={stream}, thread=threading.get_ident(), invalid=None)
        try:
            with self.stream(stream), recording:
                yield
        finally:  # ending the capture, also after the body raised
            joined, invalid = _CAPTURE.pop("streams"), _CAPTURE.pop("invalid")
            del _CAPTURE["thread"]
            recording.finish()
            if invalid is not None:
                raise CaptureFailed(f"AcceleratorError: CUDA error: operation failed due to a "
                                    f"previous error during capture (the twin: {invalid})")
            unjoined = [s for s in joined
                        if s is not stream and stream.waited.get(s, 0) < s.launched]
            if unjoined:
                raise CaptureFailed(f"RuntimeError: CUDA error: operation not permitted when "
                                    f"stream is capturing ({len(unjoined)} stream(s) forked "
                                    f"into the capture were not joined back)")

    @contextlib.contextmanager
    def host_syncs(self, found, tag):
        """As CUDA's sync debug mode: each host read of a twin tensor ([Note: host syncs]) and
        each host wait for a stream or an event while inside, appended to ``found``."""
        before = getattr(_watching, "found", None)
        _watching.found = (found, tag)
        try:
            with _HostReads(found, tag):
                yield
        finally:
            _watching.found = before

    def replay(self, graph, stream) -> None:
        """Launched on ``stream``: it runs when something waits for the stream."""
        stream.launch(graph.replay)

    def graph_generator(self, graph, device):
        gen = torch.Generator()
        graph.generators.append(gen)
        return gen

    def draw_from(self, default, gen):
        saved = default.get_state()
        default.set_state(gen.get_state())
        self.drawing.append(gen)
        return saved

    def drawn(self, default, saved) -> None:
        gen = self.drawing.pop()
        gen.set_state(default.get_state())
        default.set_state(saved)

    def copy_rows_into(self, target, sources, device) -> None:
        """Launched on this thread's current stream; ``target`` holds NaN until it lands."""
        joined = torch.cat([t.reshape(t.shape) for t in sources]) if len(sources) > 1 else (
            sources[0].clone())
        self.copies.append((joined, device))
        with torch.no_grad():
            target.copy_(_poisoned(target))
        self.current_stream(device).launch(lambda: target.copy_(joined.view(target.shape)))

    def copy_in_all(self, ts, device):
        """One transfer of the joined tensors, landing when waited for; views of its rows."""
        return list(self.copy_in(torch.cat(ts), device).split([len(t) for t in ts]))


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` that no computation can mistake for it: NaN, the largest integer,
    or (booleans) its negation."""
    if t.dtype == torch.bool:
        return ~t
    out = torch.empty_like(t)
    return out.fill_(float("nan") if out.is_floating_point() or out.is_complex()
                     else torch.iinfo(out.dtype).max)


# -- CUDA graphs: a capture records, a replay runs ([Note: step graphs] in step_graph) ------

_CAPTURE: dict = {}  # "streams": the streams in the capture under way; "thread": its thread;
# "invalid": why an error inside it invalidated it (ending it then fails), or None

# [Note: library state on first use]
# cuBLAS and cuDNN keep a handle per thread and GPU (torch's ``DeviceThreadHandlePool``), and
# torch gives each cuBLAS handle a workspace per stream, all made on first use: a thread whose
# first call on a stream comes inside a capture fails there ("CUBLAS_STATUS_NOT_INITIALIZED
# when calling cublasCreate(handle)") and invalidates the capture, so ending it fails too. So
# a capture must come after eager runs of the same launches: the same thread, the same
# streams (``make_graphed_callables`` warms up so). The twin keeps these ops' first use per
# (thread, stream) and refuses the first one inside a capture.
_LIBRARY_OPS = frozenset(f"aten::{name}" for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
    "convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional"))


class _Warming(torch.utils._python_dispatch.TorchDispatchMode):
    """Marks ``key`` (thread, stream) warm at its first cuBLAS or cuDNN op outside a capture."""

    def __init__(self, twin, key):
        super().__init__()
        self.twin, self.key = twin, key

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if op._schema.name in _LIBRARY_OPS:
            self.twin.warm.add(self.key)
        return op(*args, **(kwargs or {}))


def _joins(stream, other) -> None:
    """``stream`` waited for ``other``: it is in the capture if ``other`` is."""
    streams = _CAPTURE.get("streams")
    if streams is not None and other in streams:
        streams.add(stream)


def _no_host_wait() -> None:
    watched = getattr(_watching, "found", None)
    if watched is not None:
        watched[0].append((watched[1], "the host waited for a stream or an event"))
    if "streams" in _CAPTURE and not getattr(_paused, "on", False):
        _invalidate("the host waited for a stream or an event inside a capture")


def _invalidate(why: str) -> None:
    """An operation a capture forbids: it fails, and so does the capture's end (CUDA's
    ``cudaErrorStreamCaptureUnsupported``, then ``cudaErrorStreamCaptureInvalidated``)."""
    _CAPTURE["invalid"] = _CAPTURE.get("invalid") or why
    raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing (the "
                       f"twin: {why})")


# [Note: host syncs]
# What makes the host wait for the GPU: a read of a tensor's value (``.item()``, ``bool(t)``),
# a copy to the host, an op whose output size depends on the data (CUDA reads the size back),
# a stream's or an event's synchronize. Inside a capture each invalidates it; outside, CUDA's
# sync debug mode names them. The twin sees all but the copies (its GPU memory is the host's).
_SIZED_BY_DATA = frozenset(f"aten::{name}" for name in (
    "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
    "repeat_interleave"))


def _host_read(op) -> bool:
    """Whether ``op`` makes the host wait for the GPU ([Note: host syncs]). The twin's GPU
    memory is the host's, so a copy to the host is not seen: what a capture or a watched
    action runs is taken to run on the GPU."""
    name = op._schema.name
    return name == "aten::_local_scalar_dense" or name in _SIZED_BY_DATA


_watching = threading.local()  # this thread's (found, tag) while ``host_syncs`` watches


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Appends ``(tag, op)`` to ``found`` for each host read ([Note: host syncs])."""

    def __init__(self, found, tag):
        super().__init__()
        self.found, self.tag = found, tag

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _host_read(op):
            self.found.append((self.tag, f"{op._schema.name} reads a GPU value on the host"))
        return op(*args, **kwargs)

_paused = threading.local()  # this thread runs a stand-in stream's queued work: not recorded


class TwinGraph:
    """A stand-in CUDA graph. While capturing (``TwinGpu.capture``) it records every aten op
    the capturing thread runs and, as far as anyone can tell, runs nothing: what the capture
    wrote into tensors that existed before it is put back, and the tensors it made hold NaN
    (integers: the largest value; booleans: negated) until a replay. A replay runs the
    recorded ops again on the same tensors, with the Python numbers they were recorded with;
    a random op draws from the graph generator it drew from at the capture (``draw_from``),
    as a CUDA graph's registered generator states do. A host read of a tensor while
    capturing (``.item()``, ``bool(t)``) raises, as CUDA refuses it."""

    def __init__(self):
        self.ops = []        # (kind, op, args, kwargs, outputs, generator, grad mode)
        self.replays = 0
        self.generators = []

    def replay(self) -> None:
        grad_mode = torch.is_grad_enabled()
        with torch._C._AutoDispatchBelowADInplaceOrView():  # below autograd: no graph is made
            try:
                self._run()
            finally:
                torch._C._set_grad_enabled(grad_mode)
        self.replays += 1

    def _run(self) -> None:
        for kind, op, args, kwargs, outs, gen, grad in self.ops:
            if kind == "view":  # the output aliases an input: the data flows through it
                continue
            # in the grad mode it was recorded in: a kernel may read it (mkldnn's RNN
            # writes the workspace its backward reads only with gradients on)
            torch._C._set_grad_enabled(grad)
            if gen is not None:
                saved = torch.default_generator.get_state()
                torch.default_generator.set_state(gen.get_state())
            made = op(*args, **kwargs)
            if gen is not None:
                gen.set_state(torch.default_generator.get_state())
                torch.default_generator.set_state(saved)
            if kind == "made":  # into the tensors the capture made, where readers look
                for old, new in zip(_leaves(outs), _leaves(made)):
                    old.copy_(new)


def _leaves(x) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


# Ops that write arguments their schema does not mark as written: argument positions.
_UNANNOTATED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4)}


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    """Records a capture into a :class:`TwinGraph` (see there)."""

    def __init__(self, graph: TwinGraph, twin):
        super().__init__()
        self.graph, self.twin = graph, twin
        self.made = set()    # storages the capture made
        self.before = {}     # storage -> (storage, a copy of it before the capture wrote it)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_paused, "on", False):
            return op(*args, **kwargs)
        if _host_read(op):  # [Note: host syncs]
            _invalidate(f"a host read of a tensor inside a capture ({op._schema.name})")
        if op._schema.name in _LIBRARY_OPS:  # [Note: library state on first use]
            stream = self.twin.current_stream(TWIN)
            if (threading.get_ident(), stream) not in self.twin.warm:
                why = (f"{op._schema.name} was the first cuBLAS/cuDNN call of thread "
                       f"{threading.current_thread().name} on its stream, inside the capture")
                _CAPTURE["invalid"] = _CAPTURE.get("invalid") or why
                raise RuntimeError(f"CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling "
                                   f"`cublasCreate(handle)` (the twin: {why})")
        if torch.Tag.nondeterministic_seeded in op.tags and (
                self.twin.current_stream(TWIN) not in _CAPTURE["streams"]):
            raise RuntimeError("Offset increment outside graph capture encountered "
                               "unexpectedly. (the twin: a random op launched on a stream "
                               "outside the capture while it is under way)")
        schema = op._schema
        written = []
        for at, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[at] if at < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                written += _leaves(value)
        for at in _UNANNOTATED_WRITES.get(op, ()):
            if args[5]:  # training: the running statistics move
                written += _leaves(args[at])
        for t in written:  # a tensor from before the capture: keep its value to put back
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.made and ptr not in self.before:
                self.before[ptr] = (storage, storage.clone())
        out = op(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _leaves((args, kwargs))}
        aliased = [t.untyped_storage().data_ptr() in inputs for t in _leaves(out) if t.numel()]
        views = any(r.alias_info is not None and not r.alias_info.is_write
                    for r in schema.returns) or not written and any(aliased)  # _unsafe_view
        kind = "view" if views else "write" if written and all(aliased) else "made"
        if kind == "made":
            for t in _leaves(out):
                self.made.add(t.untyped_storage().data_ptr())
        gen = self.twin.drawing[-1] if (
            self.twin.drawing and torch.Tag.nondeterministic_seeded in op.tags) else None
        # A CUDA graph holds memory, not Python objects: aliases of the tensors' storages, so
        # that a later ``p.data = ...`` (the update's binding of a host parameter to its
        # home) does not move what the replay reads and writes.
        memory = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach,
                                                   (args, kwargs, out))
        self.graph.ops.append((kind, op, *memory, gen, torch.is_grad_enabled()))
        return out

    def finish(self) -> None:
        """The capture ran nothing: put back what it wrote, poison what it made."""
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.no_grad():
            for storage, saved in self.before.values():
                storage.copy_(saved)
            for kind, _, _, _, outs, _, _ in self.graph.ops:
                for t in _leaves(outs) if kind == "made" else ():
                    if t.dtype == torch.bool:
                        t.logical_not_()
                    else:
                        t.fill_(float("nan") if t.is_floating_point() or t.is_complex()
                                else torch.iinfo(t.dtype).max)
