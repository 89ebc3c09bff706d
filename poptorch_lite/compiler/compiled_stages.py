"""Compiled stages: each stage's graphs compiled once by a ``torch.compile`` backend.

[Note: compiled stages]
PopTorch compiles a model's program once; poptorch_lite's default path runs each traced
op eagerly, bit-exact to plain PyTorch. With ``Options.compileStages(True)`` the lowered
stages ([Note: lowered stages] in ``lowered``) keep their tables, and their graphs (the
forward, and a recomputed stage's segments) become :class:`CompiledGraph`: on its first
call each graph is compiled by ``torch.compile(fullgraph=True, dynamic=False)`` with the
stage device's backend (Inductor by default), whose AOTAutograd also compiles the backward
that the stage's ``autograd.backward`` then runs. The runtime (``stage_work``) calls a
compiled graph exactly as it calls the eager one: the autograd boundary between stages,
the stash, recomputation, split backwards and the schedules are unchanged.

- **Numbers.** Fused kernels reassociate float sums: within 1e-4 relative of plain
  PyTorch over 20 steps, not bit-exact. Random ops keep plain PyTorch's masks: the graph
  is compiled with Inductor's ``fallback_random`` (its random ops are eager ATen calls),
  without the per-op stream wrappers of [Note: micro-batch RNG] (a graph break each);
  instead the whole call draws from the micro-batch's stream (``rng.call_in_stream``,
  which holds the stream lock for the call).
- **When it pays.** A compiled call has a fixed cost (guards, the AOTAutograd function,
  the wrapper code) that a stage of a few dozen FLOPs never earns back. Before compiling,
  a stage's forward is run once on fake tensors to count its work: matmul/conv FLOPs plus
  the elements its ops produce. Under :data:`PAYS_FROM` it stays eager, and the log says
  so with its count.
- **What cannot be compiled runs eagerly.** A stage the backend refuses (a construct
  torch.compile does not capture, an in-place write to an input that needs a gradient)
  is caught on its first call, before any of its ops ran (``fullgraph``: the whole graph
  is captured and compiled before it runs), and runs eagerly from then on; the log says
  which stage and why.
- **Once.** Compiled graphs are kept per process, keyed by the graph's code and
  constants, the backend and the device: a second wrapper of the same model structure
  reuses them (torch.compile's guards still check every call's arguments). A compile
  after a graph's first (new shapes, a new grad mode) is a recompile: counted, and logged
  with what changed.

The first call of a wrapper logs what it compiled and how long it took
(:meth:`CompileReport.flush`); ``benchmarks/tax.py --compiled`` measures the speed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Optional

import torch
import torch.fx as fx

from . import rng
from .lowered import Lowered
from .subgraphs import base_op

_LOG = logging.getLogger("poptorch_lite")

#: The backends ``Options.compileStages`` takes (``torch.compile``'s names).
BACKENDS = ("inductor", "aot_eager", "eager")
#: A stage whose forward does less work than this (matmul/conv FLOPs plus the elements its
#: ops produce, per micro-batch) stays eager: a compiled call's fixed cost (some 30 µs on
#: a CPU core) outweighs what fusing its ops saves ([Note: compiled stages]).
#: ``POPTORCH_LITE_PAYS_FROM`` sets it (0: compile every stage, as the test sweeps do).
PAYS_FROM = int(os.environ.get("POPTORCH_LITE_PAYS_FROM", 50_000))
_CACHE_SIZE = 64

_compiles = threading.local()  # backend compiles made on this thread (dynamo compiles here)
_cache: "collections.OrderedDict" = collections.OrderedDict()  # key -> compiled function
_cache_lock = threading.Lock()


def default_backend(device: torch.device) -> str:
    """The backend a stage on ``device`` is compiled with when none is chosen."""
    return "inductor"


@dataclasses.dataclass
class Compiled:
    """What became of one stage's graphs ([Note: compiled stages])."""

    stage: int
    backend: str
    state: str = "waiting"  # waiting, compiled, reused, eager, failed
    why: str = ""
    seconds: float = 0.0
    recompiles: int = 0
    logged: bool = False


class CompileReport:
    """The compiled stages of one program: what each became, and the log lines about it."""

    def __init__(self):
        self.stages: dict = {}  # stage index -> Compiled
        self.recompiles = 0

    def flush(self) -> None:
        """Log what the stages became since the last flush (a wrapper's first call: every
        stage's compile, its time, and which stay eager and why)."""
        new = [c for c in self.stages.values() if c.state != "waiting" and not c.logged]
        if not new:
            return
        for c in new:
            c.logged = True
        done = [c for c in new if c.state in ("compiled", "reused")]
        if done:
            _LOG.info("compileStages: %s in %.1f s (first calls)", ", ".join(
                f"stage {c.stage} {'reused' if c.state == 'reused' else 'compiled'} "
                f"({c.backend}, {c.seconds:.1f} s)" for c in done),
                sum(c.seconds for c in done))
        for c in new:
            if c.state in ("eager", "failed"):
                (_LOG.warning if c.state == "failed" else _LOG.info)(
                    "compileStages: stage %d runs eagerly: %s", c.stage, c.why)

    def summary(self) -> dict:
        """Stage index -> its state ("compiled", "reused", "eager", "failed", "waiting")."""
        return {s: c.state for s, c in sorted(self.stages.items())}


def compile_lowered(lowered: Lowered, devices: dict, backend: Optional[str]) -> tuple:
    """``lowered`` with every stage's graphs compiled on their first call, and its report.

    Args:
        devices: IPU -> torch device (the stages of other processes are left as they are).
        backend: one of :data:`BACKENDS`, or None for each device's default.
    """
    report = CompileReport()
    stages = []
    for st in lowered.stages:
        device = devices.get(st.ipu)
        if device is None:  # another process runs it
            stages.append(st)
            continue
        chosen = backend or default_backend(device)
        info = report.stages[st.index] = Compiled(st.index, chosen)
        decision = _Decision(info, report)
        module = CompiledGraph(st.module, device, chosen, st.random, decision, "forward")
        segments = tuple(dataclasses.replace(seg, module=CompiledGraph(
            seg.module, device, chosen, st.random, decision, f"segment {k}"))
            for k, seg in enumerate(st.segments))
        stages.append(dataclasses.replace(st, module=module, segments=segments))
    return dataclasses.replace(lowered, stages=tuple(stages)), report


class _Decision:
    """Whether a stage compiles: decided once, on its first graph's first call."""

    def __init__(self, info: Compiled, report: CompileReport):
        self.info, self.report = info, report
        self.compile: Optional[bool] = None


class CompiledGraph:
    """A stage graph, compiled on its first call ([Note: compiled stages]); called as the
    graph is, with the same arguments and results."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, backend: str, random: bool,
                 decision: _Decision, part: str):
        self.gm, self.device, self.backend, self.random = gm, device, backend, random
        self.decision, self.part = decision, part
        self.fn = None  # the compiled function, or ``gm`` once the stage runs eagerly
        self._lock = threading.Lock()

    @property
    def joint_backward(self) -> bool:
        """Whether the stage's backward is compiled: one autograd node, which a split
        backward cannot split ([Note: split backward] in ``runtime/split_backward``)."""
        return self.decision.info.state in ("compiled", "reused")

    def __call__(self, *args):
        fn = self.fn
        if fn is None:
            return self._first(args)
        if fn is self.gm:
            return fn(*args)
        before = getattr(_compiles, "n", 0)
        try:
            out = rng.call_in_stream(fn, args, self.device) if self.random else fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # a recompile refused
            self._refused(exc)
            return self.gm(*args)
        if getattr(_compiles, "n", 0) != before:
            self._recompiled(args)
        return out

    def _first(self, args: tuple):
        info = self.decision.info
        with self._lock:
            if self.fn is None:
                started = time.perf_counter()
                plain = _without_seeding(self.gm)
                d = self.decision
                if d.compile is None:
                    d.compile = self._pays(plain, args)
                if not d.compile:
                    self.fn = self.gm
                    return self.gm(*args)
                key = _key(plain, self.backend, self.device, self.random)
                with _cache_lock:
                    fn = _cache.get(key)
                if fn is not None and info.state in ("waiting", "reused"):
                    info.state = "reused"
                else:
                    fn = torch.compile(plain.forward, backend=_backend(self.backend, self.random),
                                       fullgraph=True, dynamic=False)
                before = getattr(_compiles, "n", 0)
                try:
                    out = rng.call_in_stream(fn, args, self.device) if self.random else fn(*args)
                except torch._dynamo.exc.TorchDynamoException as exc:  # before any op ran
                    self._refused(exc)
                    return self.gm(*args)
                if info.state == "reused" and getattr(_compiles, "n", 0) != before:
                    self._recompiled(args)  # another wrapper's graph, for other arguments
                if info.state == "waiting":
                    info.state = "compiled"
                if info.state == "compiled":
                    with _cache_lock:
                        _cache[key] = fn
                        while len(_cache) > _CACHE_SIZE:
                            _cache.popitem(last=False)
                info.seconds += time.perf_counter() - started
                self.fn = fn
                return out
        return self(*args)

    def _pays(self, plain: fx.GraphModule, args: tuple) -> bool:
        info = self.decision.info
        try:
            flops, elements = work(plain, args)
        except Exception as exc:  # noqa: BLE001 - an estimate that fails is no reason to stop
            _LOG.debug("compileStages: stage %d's work not counted (%s)", info.stage, exc)
            return True
        if flops + elements >= PAYS_FROM:
            return True
        info.state = "eager"
        info.why = (f"its forward does {flops} FLOPs and makes {elements} elements per "
                    f"micro-batch, under the {PAYS_FROM} from which compiling pays (a compiled "
                    f"call's fixed cost outweighs what fusing saves; "
                    f"compiler.compiled_stages.PAYS_FROM)")
        return False

    def _refused(self, exc: BaseException) -> None:
        info = self.decision.info
        self.fn = self.gm
        info.state = "failed"
        inner = getattr(exc, "inner_exception", None) or exc  # the backend's own error
        text = str(inner).strip()
        reason = f"{self.part}: {type(inner).__name__}: {text.splitlines()[0][:300] if text else ''}"
        info.why = f"{info.why}; {reason}" if info.why else (
            f"{self.backend} could not compile its {reason}")

    def _recompiled(self, args: tuple) -> None:
        info = self.decision.info
        info.recompiles += 1
        self.decision.report.recompiles += 1
        _LOG.warning(
            "compileStages: stage %d's %s recompiled (%d recompiles so far): its arguments "
            "changed since it was compiled (now %s, grad mode %s); a new input signature or "
            "grad mode compiles once more", info.stage, self.part, info.recompiles,
            [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args],
            torch.is_grad_enabled())


def _backend(name: str, random: bool):
    """``torch.compile``'s backend ``name``, counting its compiles on this thread; random
    ops stay eager ATen calls (Inductor's ``fallback_random``)."""
    def compile_graph(gm, example_inputs):
        _compiles.n = getattr(_compiles, "n", 0) + 1
        # Compiling may draw random numbers (Inductor benchmarks its choices on random
        # inputs): from generators that are put back after, not from the micro-batch's stream.
        with torch.random.fork_rng(devices=_cuda_devices(example_inputs)):
            if name == "inductor":
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(gm, example_inputs,
                                  config_patches={"fallback_random": True} if random else {})
            from torch._dynamo import lookup_backend
            return lookup_backend(name)(gm, example_inputs)
    return compile_graph


def _cuda_devices(tensors) -> list:
    return sorted({t.device.index or 0 for t in tensors
                   if isinstance(t, torch.Tensor) and t.is_cuda})


def _without_seeding(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose random ops are called directly, not through the per-op stream
    wrappers ([Note: micro-batch RNG]): a compiled graph draws from the stream as a whole."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function":
            node.target = _strip(node.target)
    return fx.GraphModule(gm, graph)


def _strip(target):
    if not hasattr(target, "wrapped_op"):
        return target
    inner = _strip(target.wrapped_op)
    return inner if target.rewrap is rng.seeded else target.rewrap(inner)


def _key(gm: fx.GraphModule, backend: str, device: torch.device, random: bool) -> tuple:
    """What makes two graphs the same compiled graph: the code, what each name in it calls,
    the constants, the backend and the device. Two graphs' code can read alike and call
    different functions (two classes of one name, a closure per trace): a target that is not
    one of torch's ops is known by its identity."""
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "call_function":
            digest.update(repr(_target_key(node.target)).encode())
        elif node.op == "call_module":
            digest.update(repr(("module", id(gm.get_submodule(node.target)))).encode())
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            digest.update(node.target.encode())
            if isinstance(value, torch.Tensor):
                digest.update(repr((value.dtype, tuple(value.shape))).encode())
                digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes())
            else:
                digest.update(repr(("object", id(value))).encode())
    return digest.hexdigest(), backend, str(device), random


def _target_key(target):
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if hasattr(target, "wrapped_op"):  # a wrapper of ``subgraphs``: its kind, and its op
        return getattr(target, "rewrap", None).__qualname__, _target_key(target.wrapped_op)
    if getattr(target, "__module__", None) in ("_operator", "operator", "builtins", "math"):
        return target.__module__, target.__qualname__
    return "object", id(target)  # kept alive by the graph the cache holds


def work(gm: fx.GraphModule, args: tuple) -> tuple:
    """``(FLOPs, elements)`` of one forward of ``gm`` on ``args``' shapes: its matmul and
    conv FLOPs, and the elements of every value its ops produce; run on fake tensors, so
    nothing is computed and nothing changes.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda x, w: x @ w.t())(torch.ones(2, 4), torch.ones(3, 4))
        >>> work(gm, (torch.ones(2, 4), torch.ones(3, 4)))  # 2*4*3 multiply-adds; w.t(), x @ w.t()
        (48, 18)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import flop_registry  # FlopCounterMode's own table

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    counts = [0, 0]

    # Not FlopCounterMode: its module hooks are global, and fire in the stages that other
    # threads run meanwhile.
    class _Count(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function":
                op = base_op(n.target)
                count = flop_registry.get(getattr(op, "overloadpacket", None))
                if count is not None:
                    a, kw = self.fetch_args_kwargs_from_env(n)
                    counts[0] += int(count(*a, **kw, out_val=out))
                counts[1] += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
            return out

    with rng.use(None), torch.no_grad(), mode:
        _Count(gm).run(*fake)
    return counts[0], counts[1]


def clear_cache() -> None:
    """Forget every compiled graph of this process (the next compile starts afresh)."""
    with _cache_lock:
        _cache.clear()
