"""Random ops under pipelining: one random stream per micro-batch.

[Note: micro-batch RNG]
In plain PyTorch the random ops of micro-batch i run after those of
micro-batch i-1, drawing from one global generator. A pipeline runs stage 0
of micro-batch i while stage 1 still works on micro-batch i-1, on another
thread, so a shared generator would hand out numbers in an order that
depends on timing. poptorch_lite therefore gives every micro-batch its own
random stream, the same in every schedule:

- each run (one schedule over m micro-batches) that has random ops has one
  62-bit ``base``, drawn from torch's default CPU generator (so
  ``torch.manual_seed`` controls everything), or, for a model whose options set
  ``Options.randomSeed(n)``, from a generator of its own seeded with n, as
  PopTorch seeds each model's device RNG (:func:`model_generator`: two models
  with the same seed draw the same numbers); a call draws the bases of its runs
  together, which gives the same numbers as one draw per run (:func:`draw_bases`);
- micro-batch i draws from a generator state seeded with
  :func:`microbatch_seed` ``(base, i)``, one per kind of device it touches
  (the CPU, CUDA); its stages use that state in stage order (stage s+1
  continues where stage s stopped, also when it runs on another GPU), because
  a stage's forward of micro-batch i always follows the previous stage's. So
  two stages' dropouts draw different masks wherever they run, as they do in
  plain PyTorch on one device;
- a recomputed forward re-runs from the state its first run started from, so
  dropout masks are identical.

Plain PyTorch doing the same arithmetic seeds each micro-batch's forward with
``torch.manual_seed(microbatch_seed(base, i))``; the transparency tests do
exactly that. Random ops in stage graphs are found by the
``nondeterministic_seeded`` tag and wrapped by :func:`seed_random_ops`; each
call briefly swaps the device's default generator state under one lock, so
stages running on several threads never share a stream. Whatever else saves and puts
back a default generator while stages run (a stage's first call compiling it, under
``fork_rng``) holds that lock too (:func:`exclusive`): put back in the middle of another
thread's swap, it would hand that micro-batch's op the wrong state, or leave a stream's
state in the default generator.

[Note: a user's generator]
A random op given a generator of the model's own (``torch.randn(..., generator=self.g)``,
``randperm``, ``multinomial``, ``t.normal_(generator=g)``) draws from that generator, not
from a micro-batch's stream: the trace keeps the generator in the graph (an attribute of
the stage's graph that shares its state), and plain PyTorch's loop draws from it micro-batch
after micro-batch, each forward once through the whole model. The trace puts it back as it
was before its first draw (``trace_state``), so the run's draws are the ones plain PyTorch's
forwards make. That order holds where every draw from it is in one stage, whose forwards run
in micro-batch order on its stream, or where the stages run one at a time in that order
(the ``sequential`` schedule: ShardedExecution). :func:`check_user_generators` refuses what
would draw in another order, at compile time, before any state changes: draws in several
stages of a pipelined schedule, in a recomputed stage (its forward runs again), with
replicas (each draws from it) or with stages or replicas in other processes (each has a copy
of it). A failed run puts the generators back as they were before it (``program``), as it
puts back torch's. The trace also refuses a forward that seeds such a generator or makes one
(plain PyTorch would do that anew in every forward), and a step graph does not capture a
stage that draws from one (a CPU generator's draws would not replay).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.fx as fx

from ..errors import ExecutionError, OptionsError
from .subgraphs import wrap_target

_LOCK = threading.Lock()
_local = threading.local()
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive micro-batch indices over the seed space


def microbatch_seed(base: int, i: int) -> int:
    """The seed of micro-batch ``i``'s random stream in a run whose base is ``base``.

    Example:
        >>> microbatch_seed(7, 0), microbatch_seed(7, 1) != microbatch_seed(7, 0)
        (7, True)
    """
    return (base + i * _GOLDEN) % (1 << 63)


def model_generator(seed: Optional[int]) -> Optional[torch.Generator]:
    """The random state of a model whose options set ``randomSeed(seed)``; None (the model
    draws from torch's default generator) without one ([Note: micro-batch RNG]).

    Example:
        >>> a, b = model_generator(7), model_generator(7)
        >>> draw_bases(2, a) == draw_bases(2, b), model_generator(None)
        (True, None)
    """
    return None if seed is None else torch.Generator().manual_seed(seed)


def draw_base() -> int:
    """One draw from torch's default CPU generator: the base of a run's streams."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def draw_bases(n: int, generator: Optional[torch.Generator] = None) -> list:
    """The bases of a call's ``n`` runs in one draw: the same numbers, and the same generator
    state after, as ``n`` calls of :func:`draw_base` (torch's CPU generator draws one 64-bit
    number per element, in order).

    Example:
        >>> _ = torch.manual_seed(0); one_by_one = [draw_base() for _ in range(3)]
        >>> _ = torch.manual_seed(0); draw_bases(3) == one_by_one
        True
    """
    if not n:
        return []
    # randint's own arithmetic (random_ on a new tensor), into a buffer of this thread's: a
    # call's setup runs cold, where an allocation costs more than the draw
    # ([Note: one setup per call] in ``runtime/plan``)
    buffers = _local.__dict__.setdefault("bases", {})
    buffer = buffers.get(n)
    if buffer is None:
        buffer = buffers[n] = torch.empty(n, dtype=torch.int64)
    return buffer.random_(0, 1 << 62, generator=generator).tolist()


def rewinder(generator: Optional[torch.Generator] = None):
    """A function that puts torch's generators back as they are now, then draws ``k`` bases:
    the state after a call's first ``k`` runs, whose bases were drawn together
    (:func:`draw_bases`). Runs change no generator but by their bases: each random op
    swaps a stream's state in and the generator's back ([Note: micro-batch RNG])."""
    cpu = torch.default_generator.clone_state()  # no tensor made: read only on a failure
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    own = generator.clone_state() if generator is not None else None

    def rewind(k: int) -> None:
        torch.default_generator.set_state(cpu.get_state())
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if own is not None:
            generator.set_state(own.get_state())
        draw_bases(k, generator)
    return rewind


class Stream:
    """The random state of one micro-batch, per device, advanced by its random ops.

    Args:
        seed: the micro-batch's seed (:func:`microbatch_seed`).
    """

    __slots__ = ("seed", "states")  # one per micro-batch and run: no ``__dict__`` made

    def __init__(self, seed: int):
        self.seed = seed
        self.states: dict = {}  # device type ("cpu", "cuda") -> generator state

    def snapshot(self) -> "Stream":
        """A copy to replay from (recomputation)."""
        copy = Stream(self.seed)
        copy.states = dict(self.states)
        return copy


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (its random ops draw from it)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def _device_of(args, kwargs) -> Optional[torch.device]:
    """The device a random op draws on: its ``device`` argument, else its first tensor's;
    None for the CPU (the common case, without making a ``torch.device``)."""
    device = kwargs.get("device") if kwargs else None
    if device is not None:
        return torch.device(device)
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device if a.is_cuda else None
    return None


_ON_CPU = (("cpu", torch.default_generator),)  # what a random op on the CPU swaps


def _swapped(stream: Stream, kinds: tuple, op, args, kwargs):
    """``op(*args, **kwargs)`` with each ``(kind, generator)`` of ``kinds`` holding
    ``stream``'s state of that kind, under the lock; the stream keeps where they stopped."""
    graph = getattr(_local, "graph", None)
    if graph is not None:  # a step being captured ([Note: step graphs] in runtime/step_graph)
        return graph.draw(stream, kinds, op, args, kwargs)
    states = stream.states  # one stream per kind: it moves between GPUs
    with _LOCK:
        saved = []
        for kind, gen in kinds:
            saved.append(gen.get_state())
            state = states.get(kind)
            if state is None:
                gen.manual_seed(stream.seed)
            else:
                gen.set_state(state)
        try:
            return op(*args, **(kwargs or {}))
        finally:
            for (kind, gen), before in zip(kinds, saved):
                states[kind] = gen.get_state()
                gen.set_state(before)


def exclusive():
    """The lock of the swaps, as a context: while it is held no random op of another thread
    has a micro-batch's state in a default generator, and none will put one there."""
    return _LOCK


def call_in_stream(fn, args: tuple, device: torch.device):
    """``fn(*args)`` with all its random ops drawing from this thread's stream, the way
    each op of an eager stage graph does ([Note: micro-batch RNG]): for a compiled graph,
    whose random ops cannot each be wrapped. ``device``: the graph's device (its generator
    and the CPU's are swapped in). Holds the lock for the whole call, so a random op of
    another thread waits for it ([Note: compiled stages] in ``compiled_stages``)."""
    stream: Optional[Stream] = getattr(_local, "stream", None)
    if stream is None:
        return fn(*args)
    kinds = (("cpu", torch.default_generator),)
    if device.type != "cpu":
        kinds += ((device.type, device_generator(device)),)
    return _swapped(stream, kinds, fn, args, None)


# [Note: stages in other processes] in ``distributed``: a micro-batch's stream travels
# with its activations as one byte tensor: its seed, then per device type a presence byte
# and the generator state (torch's CPU and CUDA generators have states of fixed sizes).
_STATE_BYTES = {"cpu": torch.get_rng_state().numel(), "cuda": 16}
PACKED_BYTES = 8 + sum(1 + n for n in _STATE_BYTES.values())


def pack(stream: Stream) -> torch.Tensor:
    """``stream`` as ``PACKED_BYTES`` bytes, for another process to continue it.

    Example:
        >>> s = Stream(7)
        >>> s.states["cpu"] = torch.get_rng_state()
        >>> back = unpack(pack(s))
        >>> back.seed, torch.equal(back.states["cpu"], s.states["cpu"]), "cuda" in back.states
        (7, True, False)
    """
    out = torch.zeros(PACKED_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor([stream.seed], dtype=torch.int64).view(torch.uint8)
    at = 8
    for kind, size in _STATE_BYTES.items():
        state = stream.states.get(kind)
        if state is not None:
            if state.numel() != size:
                raise ValueError(f"a {kind} generator state of {state.numel()} bytes; "
                                 f"poptorch_lite sends {size}")
            out[at] = 1
            out[at + 1:at + 1 + size] = state
        at += 1 + size
    return out


def unpack(packed: torch.Tensor) -> Stream:
    """The stream :func:`pack` packed."""
    packed = packed.cpu()
    stream = Stream(int(packed[:8].view(torch.int64)))
    at = 8
    for kind, size in _STATE_BYTES.items():
        if packed[at]:
            stream.states[kind] = packed[at + 1:at + 1 + size].clone()
        at += 1 + size
    return stream


class _ThreadSetting:
    """Context manager: this thread's ``_local.<NAME>`` is ``value`` while inside (entered
    once per forward: no ``__dict__`` made)."""

    __slots__ = ("value", "previous")
    NAME = ""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.previous = getattr(_local, self.NAME, None)
        setattr(_local, self.NAME, self.value)

    def __exit__(self, *exc):
        setattr(_local, self.NAME, self.previous)


class GraphDraws:
    """Random draws while a step graph is captured ([Note: step graphs] in
    ``runtime/step_graph``): micro-batch i's ops draw from ``generators[i]``, registered with
    the graph, in place of ``device``'s default generator (``gpu``: the GPU seam)."""

    def __init__(self, gpu, device: torch.device, streams: list, generators: list):
        self.gpu, self.default = gpu, device_generator(device)
        self.of = {id(s): g for s, g in zip(streams, generators)}

    def draw(self, stream: Stream, kinds: tuple, op, args, kwargs):
        gen = self.of.get(id(stream))
        if gen is None or not any(g is self.default for _, g in kinds):
            raise ExecutionError("a random op drew from a stream that is not a micro-batch's, "
                                 "or on another device than the step's, while it was captured")
        saved = self.gpu.draw_from(self.default, gen)
        try:
            return op(*args, **(kwargs or {}))
        finally:
            self.gpu.drawn(self.default, saved)


class capturing(_ThreadSetting):
    """Context manager: while a step graph captures on this thread, a random op draws
    through a :class:`GraphDraws` (the graph's generator for that micro-batch's stream),
    not by swapping generator states, which a capture forbids. It holds the lock of the
    swaps meanwhile: no other thread's op finds the device's default generator holding a
    micro-batch's state."""

    __slots__ = ()
    NAME = "graph"

    def __enter__(self):
        _LOCK.acquire()
        super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        _LOCK.release()


class use(_ThreadSetting):
    """Context manager: random ops on this thread draw from ``stream`` (None: unchanged)."""

    __slots__ = ()
    NAME = "stream"


def seeded(op):
    """``op`` drawing from the micro-batch's stream (a wrapper ``subgraphs.base_op`` sees
    through)."""
    def call(*args, **kwargs):
        stream: Optional[Stream] = getattr(_local, "stream", None)
        if stream is None:  # outside a run (a direct call of a stage graph)
            return op(*args, **kwargs)
        device = _device_of(args, kwargs)
        return _swapped(stream, _ON_CPU if device is None else (
            (device.type, device_generator(device)),), op, args, kwargs)
    call.rewrap = seeded
    return wrap_target(op, call, "seeded_")


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (its op's ``nondeterministic_seeded`` tag)."""
    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    return torch.Tag.nondeterministic_seeded in tags


def seed_random_ops(gm: fx.GraphModule) -> bool:
    """Route ``gm``'s random ops through the micro-batch streams; True if it has any. An op
    given a generator of the model's own draws from it ([Note: a user's generator])."""
    found = False
    for node in gm.graph.nodes:
        if is_random(node) and node.kwargs.get("generator") is None:
            node.target = seeded(node.target)
            found = True
    if found:
        gm.recompile()
    return found


# -- a user's generator ([Note: a user's generator]) -------------------------------------------

def user_generators(stages) -> dict:
    """The model's own generators that ``stages``' graphs draw from: ``{id: (the generator
    in the graph, the indices of the stages that draw from it, a node that draws)}``."""
    found: dict = {}
    for st in stages:
        for gm in (st.module, *(seg.module for seg in st.segments)):
            for node in gm.graph.nodes:
                value = _attribute(gm, node.target) if node.op == "get_attr" else None
                if isinstance(value, torch.Generator) and node.users:
                    _, indices, _ = found.setdefault(id(value), (value, [], next(iter(node.users))))
                    if st.index not in indices:
                        indices.append(st.index)
    return found


def _attribute(gm, target: str):
    for name in target.split("."):
        gm = getattr(gm, name, None)
    return gm


def _line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return " / ".join(ln.strip() for ln in trace[-2:]) if trace else f"op {node.target}"


def check_user_generators(stages, recompute: tuple, sequential: bool, replicas: int,
                          other_processes: bool) -> None:
    """Refuse a configuration in which a generator of the model's own would not be drawn
    from in plain PyTorch's order ([Note: a user's generator]).

    Args:
        stages: the partition's stages; recompute: whether each is recomputed (empty:
            inference); sequential: the stages run one at a time, micro-batch by
            micro-batch; replicas: the replicas in this process; other_processes: stages
            or replicas run in other processes.

    Raises:
        OptionsError: naming the draw's line, what is in the way and the fixes.
    """
    default = "or draw with torch's default generator, which gives every micro-batch a stream " \
              "of its own"
    for _, indices, node in user_generators(stages).values():
        recomputed = [s for s in indices if recompute and recompute[s]]
        if len(indices) > 1 and not sequential:
            why = (f"in stages {', '.join(map(str, indices))} of a pipelined schedule",
                   "and a pipeline runs one stage's forward of a micro-batch beside another "
                   "stage's of another micro-batch, so their draws would come in another order",
                   "Draw from it in one stage, run the stages one at a time (ShardedExecution, "
                   "or PipelinedExecution(schedule=\"sequential\")), " + default)
        elif recomputed:
            why = (f"in stage {recomputed[0]}, which is recomputed",
                   "and a recomputed stage runs its forward again, drawing again",
                   "Turn recomputation off for that stage (autoRecomputation, Stage.recompute"
                   "(False)), " + default + " (a recomputation replays its draws)")
        elif replicas > 1 or other_processes:
            why = ("with replicas or stages in other processes" if other_processes else
                   f"with {replicas} replicas", "and every replica (every process) would draw "
                   "from it, or from a copy of its own", "Use replicationFactor(1) in one "
                   "process, " + default)
        else:
            continue
        raise OptionsError(
            f"the forward draws from a torch.Generator of its own ({_line(node)}) {why[0]}: "
            f"plain PyTorch draws from it micro-batch after micro-batch, each forward once "
            f"through the whole model, {why[1]}. {why[2]}")
