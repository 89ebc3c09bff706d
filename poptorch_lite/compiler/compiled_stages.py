"""Compiled stages: each stage's graphs compiled once, forward and backward.

[Note: compiled stages]
PopTorch compiles a model's program once; poptorch_lite's default path runs each traced
op eagerly, bit-exact to plain PyTorch. With ``Options.compileStages(True)`` the lowered
stages ([Note: lowered stages] in ``lowered``) keep their tables, and their graphs (the
forward, and a recomputed stage's segments) become :class:`CompiledGraph`: on its first
call each graph is compiled straight from the traced ATen graph, without TorchDynamo
(there is no Python left to capture): AOTAutograd splits it into a forward and a backward
graph and Inductor (``compile_fx``) compiles both, or, with ``aot_eager``, they run as
they are. The compiled function is an autograd function, so the runtime (``stage_work``)
calls it exactly as it calls the eager graph: the autograd boundary between stages, the
stash, recomputation and the schedules are unchanged.

- **Numbers.** Fused kernels reassociate float sums: within 1e-4 relative of plain
  PyTorch over 20 steps, not bit-exact. Random ops keep plain PyTorch's masks: the graph
  is compiled with Inductor's ``fallback_random`` (its random ops are eager ATen calls),
  without the per-op stream wrappers of [Note: micro-batch RNG]; instead the whole call
  draws from the micro-batch's stream (``rng.call_in_stream``, which holds the stream lock
  for the call), and compiling draws from generators put back after (``fork_rng``, under
  that lock: another stage's random op on another thread never sees them).
- **Guards.** A stage's arguments have one signature per program (``batch``'s signature
  picks the program), so a graph is compiled once per grad mode (a function compiled
  without grad would give outputs no gradient reaches), and Inductor's code checks each
  input's size and stride itself. The compiled functions are kept per process, keyed by
  the graph's code, the functions it calls, its constants, the arguments' signature, the
  grad mode, the backend and the device: a second wrapper of the same model structure
  reuses them. A graph compiled for its second grad mode is a recompile, counted and logged.
- **When it pays.** A compiled call has a fixed cost (the AOTAutograd function, the
  wrapper code) that a stage of a few dozen FLOPs never earns back. Before compiling, a
  stage's forward runs once on fake tensors to count its work: matmul/conv FLOPs plus the
  elements its ops produce. Under :data:`PAYS_FROM` it stays eager, and the log says so.
- **What cannot be compiled runs eagerly.** Compiling runs nothing (AOTAutograd traces on
  fake tensors) and compiles the backward with the forward, so a stage the backend refuses
  is caught before any of its ops ran, runs eagerly from then on, and the log names it and
  the reason. A training trace that recorded a CPU-only kernel AOTAutograd compiles but
  cannot run (:func:`uncompilable`: oneDNN's LSTM layer) is traced again without them, as
  for a GPU ([Note: graphs on their devices] in ``retarget``): torch.compile too trains an
  LSTM as its composite ops.
- **Zero bubble.** Under a schedule that splits backwards, each graph's backward is split
  once, when it compiles (:func:`split_backward`): an input half that I runs, and a weight
  half for W that starts from the output gradients I computed on the way, not the
  per-micro-batch walk over autograd's graph of [Note: split backward].
- **A backward draws nothing.** Under a gradient penalty through attention, AOTAutograd's
  default partitioner (``aot_eager``'s) recomputed a chain of the forward's ops in the
  backward (``bmm``, ``softmax``, ``empty_like``) and with it the dropout's ``bernoulli``,
  whose result nothing there reads: ``torch.fx`` keeps a random op as impure. It drew from
  torch's generator outside every micro-batch's stream: a later call's bases moved, and on
  streams another micro-batch's masks (gradients 2e-3 apart from run to run of one program,
  torch 2.14.1). A compiled backward's dead random ops are removed with the ops only they
  read (:func:`_without_draws`); one whose result the backward reads would draw outside the
  stream, and the stage runs eagerly.
- **Python inside an op** (a custom op's autograd formula) runs when the graph is traced
  for compiling, not per call, as under ``torch.compile``.
- **Custom Functions' outputs are copies.** AOTAutograd returns an output that is a view
  of one of its graph's intermediates as that intermediate, and makes the view again
  outside, a plain view whose gradient goes straight to the intermediate. Where a custom
  autograd Function's output is such a view (``x.view_as(x)`` in a gradient reversal
  layer) and another output shares its base, the Function's own backward is then skipped:
  plain AOTAutograd gave gradients 1.2 away from eager on three ops (torch 2.14.1; the
  fuzzer found it as a gradient penalty through a gradient reversal layer, 0.0245 off).
  So the graph that compiles reads each Function's outputs through a copy
  (:func:`_functions_copied`): views of the copy are made again from the copy, whose
  gradient goes through the Function's backward inside the compiled graph. It costs one
  copy of each Function output a micro-batch.
- **Outputs that view one intermediate are copies.** Where several outputs view the same
  intermediate (two splits of a value, one of them after a ``detach``, that a later stage
  reads), AOTAutograd made them again outside its graph from the wrong base and the stage
  failed ("split_with_sizes expects split_sizes to sum exactly to 2", torch 2.14.1); each
  such view is returned as a copy (:func:`_views_apart`), the rest as they are.
- **Views of arguments keep their gradients.** An output that views one of the graph's
  arguments (a parameter's ``weight.t()``, an activation's transpose, that a later stage
  reads) is made again outside the graph from the argument itself, and its gradient
  reaches the argument that way, not through the compiled backward; such an argument is
  never given detached as one no gradient reaches (:func:`_viewed_arguments`; it was: the
  layer trained as if frozen after its first stage).

The first call of a wrapper logs what it compiled and how long it took
(:meth:`CompileReport.flush`); ``benchmarks/tax.py --compiled`` measures the speed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import threading
import time
from typing import Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..options.options import BACKENDS  # noqa: F401 - the backends, read here too
from . import compile_cache, grad_semantics, rng, tracing
from .lowered import Lowered
from .split_graphs import SplitState, split_backward
from .subgraphs import base_op, written_in_place
from .work import forget_real_tensors, work

_LOG = logging.getLogger("poptorch_lite")

#: A stage whose forward does less work than this (matmul/conv FLOPs plus the elements its
#: ops produce, per micro-batch) stays eager: a compiled call's fixed cost outweighs what
#: fusing its ops saves (the user guide's Linear(6, 2) stage, forward and backward on one
#: CPU core: 62 µs compiled against 38 µs eager; [Note: compiled stages]).
#: ``POPTORCH_LITE_PAYS_FROM`` sets it (0: compile every stage, as the test sweeps do).
PAYS_FROM = int(os.environ.get("POPTORCH_LITE_PAYS_FROM", 50_000))
_compile_lock = threading.Lock()


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


def compile_lowered(lowered: Lowered, devices: dict, backend: Optional[str],
                    split: bool = False) -> tuple:
    """``lowered`` with every stage's graphs compiled on their first call, and its report.

    Args:
        devices: IPU -> torch device (the stages of other processes are left as they are).
        backend: one of :data:`BACKENDS`, or None for each device's default.
        split: the schedule splits backwards (zero bubble): each graph's backward is compiled
            as an input half and a weight half (:func:`split_backward`).
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

        def weights(names):  # the positions of the parameters, whose gradients W computes
            return tuple(k for k, n in enumerate(names) if n.startswith("param:")
                         and n.split(":", 1)[1] not in lowered.replica_values) if split else ()
        module = CompiledGraph(st.module, device, chosen, st.random, decision, "forward",
                               weights(st.inputs))
        segments = tuple(dataclasses.replace(seg, module=CompiledGraph(
            seg.module, device, chosen, st.random, decision, f"segment {k}", weights(seg.inputs)))
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
    graph is, with the same arguments and results.

    Args:
        weights: the positions of the parameters among its arguments, when its backward is
            to be split (zero bubble); empty: not split.
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device, backend: str, random: bool,
                 decision: _Decision, part: str, weights: tuple = ()):
        self.gm, self.device, self.backend, self.random = gm, device, backend, random
        self.decision, self.part, self.weights = decision, part, weights
        self.fns: dict = {}  # grad mode -> the compiled function
        self.eager = False  # runs ``gm`` (too small to pay, or refused)
        # The split backward's switch and what its I halves left for their W (shared by the
        # wrappers that share the compiled function); None: the backward is not split.
        self.split: Optional[SplitState] = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self.eager:
            return self.gm(*args)
        fn = self.fns.get(torch.is_grad_enabled())
        if fn is None:
            return self._first(args)
        return rng.call_in_stream(fn, args, self.device) if self.random else fn(*args)

    def _first(self, args: tuple):
        info = self.decision.info
        with self._lock:
            grad = torch.is_grad_enabled()
            if not self.eager and grad not in self.fns:
                started = time.perf_counter()
                keys: list = []  # the sources torch.fx keeps of the graphs made here
                # One compile at a time in the process: Inductor's and AOTAutograd's settings
                # for a compile (``fallback_random``) are process-wide, and two stages' first
                # calls come on two streams at once.
                with _compile_lock, tracing.generated_sources(keys):
                    made = self._made(args, grad)
                if made is None:
                    tracing.forget_sources(keys)
                    return self.gm(*args)
                fn, split, reused, key, plain, cut = made
                if reused:
                    tracing.forget_sources(keys)
                else:  # ``plain`` kept too: what its key names by identity stays alive
                    compile_cache.put(key, (fn, split, keys, plain, cut))
                if self.fns:  # compiled before, for the other grad mode
                    self._recompiled(reused)
                elif info.state == "waiting":
                    info.state = "reused" if reused else "compiled"
                elif info.state == "reused" and not reused:
                    info.state = "compiled"
                self.fns[grad] = _cutting(fn, cut) if cut else fn
                if split is not None:
                    self.split = split
                info.seconds += time.perf_counter() - started
        return self(*args)

    def _made(self, args: tuple, grad: bool) -> Optional[tuple]:
        """``(function, SplitState or None, reused, cache key, graph, cut)`` for ``args`` in
        grad mode ``grad``: another wrapper's, or compiled now; None where the stage runs
        eagerly. ``cut``: the positions of the arguments no gradient reaches (:func:`_cutting`)."""
        plain = _views_apart(_functions_copied(_without_seeding(self.gm)))
        d = self.decision
        if d.compile is None:
            d.compile = self._pays(plain, args)
        if not d.compile:
            self.eager = True
            return None
        key = compile_cache.key(plain, self.backend, self.device, self.random, args, grad,
                                self.weights)
        cached = compile_cache.get(key)
        if cached is not None:
            return cached[0], cached[1], True, key, cached[3], cached[4]
        try:  # Compiling may draw random numbers (Inductor benchmarks its choices on random
            # inputs): from generators put back after, not from the run's (the next bases),
            # while no other stage's random op has its micro-batch's state in them (the
            # first call of a model whose stages run on several threads: [Note: micro-batch
            # RNG] in ``rng``)
            with rng.exclusive(), torch.random.fork_rng(devices=_cuda_devices(args)):
                fn, split, cut = self._compile(plain, args)
        except Exception as exc:  # noqa: BLE001 - any refusal: run eagerly
            self._refused(exc)
            return None
        return fn, split, False, key, plain, cut

    def _compile(self, plain: fx.GraphModule, args: tuple) -> tuple:
        """``(function, SplitState or None, cut)``: ``plain`` compiled for ``args``, forward
        and backward, nothing run (AOTAutograd traces it on fake tensors); ``cut``: the
        positions of the arguments that require grad and get none from its backward."""
        split = SplitState() if self.weights and torch.is_grad_enabled() else None
        positions = self.weights
        cut: list = []

        written = {k for k, ph in enumerate(n for n in plain.graph.nodes if n.op == "placeholder")
                   if written_in_place(ph)}
        viewed = _viewed_arguments(plain)

        lifted = [0]  # the graph's own tensors AOTAutograd lifts ahead of the arguments
        made: list = []  # the graphs AOTAutograd hands the compilers

        def unreached(bw: fx.GraphModule) -> None:  # its outputs: one per forward argument
            outs = bw.graph.output_node().args[0]
            # a tensor the graph holds (a tensor attribute of the model: get_attr) is
            # lifted as an input before the arguments, and has a gradient slot there
            lifted[0] = max(0, len(outs) - len(args))
            outs = outs[lifted[0]:]
            if len(outs) == len(args):
                cut.extend(k for k, (o, a) in enumerate(zip(outs, args))
                           if isinstance(a, torch.Tensor) and a.requires_grad and k not in viewed
                           and (o is None or k in written and _tangent(o)))

        def reached() -> tuple:  # the weights W gives gradients (in the backward's outputs,
            # after the lifted tensors'): a cut one gets none
            return tuple(lifted[0] + k for k in positions if k not in cut)

        # The backward compiles now too, not at its first call: its time is counted, and a
        # refusal comes before anything ran. A split backward's saved values are not the
        # input half's to reuse ("donated buffers"): the weight half reads them later.
        import torch._functorch.config as functorch_config
        patches = {"force_non_lazy_backward_lowering": True,
                   **({"donated_buffer": False} if split is not None else {})}
        with functorch_config.patch(
                **{k: v for k, v in patches.items() if hasattr(functorch_config, k)}):
            if self.backend == "inductor":
                from torch._inductor.compile_fx import compile_fx, compile_fx_inner

                def inner(gm, example_inputs, **kw):
                    made.append(gm)
                    if kw.get("is_backward"):
                        _without_draws(gm, self.part)
                        unreached(gm)
                    if kw.get("is_backward") and split is not None:
                        def one(g, ex, first):
                            more = dict(kw) if first else {**kw, "static_input_idxs": ()}
                            return compile_fx_inner(g, ex, **more)
                        return split_backward(gm, example_inputs, reached(), one, split,
                                              lifted[0])
                    return compile_fx_inner(gm, example_inputs, **kw)
                fn = compile_fx(plain, list(args), inner_compile=inner,
                                config_patches={"fallback_random": True} if self.random else None)
            else:  # aot_eager: AOTAutograd's forward and backward graphs, run as they are
                from torch._functorch.aot_autograd import aot_module_simplified

                def backward(gm, example_inputs):
                    made.append(gm)
                    _without_draws(gm, self.part)
                    unreached(gm)
                    if split is not None:
                        return split_backward(gm, example_inputs, reached(),
                                              lambda g, ex, first: _boxed(g), split, lifted[0])
                    return _boxed(gm)
                fn = aot_module_simplified(
                    plain, list(args), fw_compiler=lambda g, _: (made.append(g), _boxed(g))[1],
                    bw_compiler=backward)
        _forget_real_tensors(made)
        return fn, split, tuple(cut)

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
        self.eager = True
        info.state = "failed"
        inner = getattr(exc, "inner_exception", None) or exc  # the backend's own error
        text = str(inner).strip()
        reason = f"{self.part}: {type(inner).__name__}: {text.splitlines()[0][:300] if text else ''}"
        info.why = f"{info.why}; {reason}" if info.why else (
            f"{self.backend} could not compile its {reason}")

    def _recompiled(self, reused: bool) -> None:
        info = self.decision.info
        info.recompiles += 1
        self.decision.report.recompiles += 1
        _LOG.warning(
            "compileStages: stage %d's %s %s for grad mode %s (%d recompiles so far): a graph "
            "compiles once per grad mode (a training and an inference wrapper of one model)",
            info.stage, self.part, "took another wrapper's graph" if reused else "recompiled",
            torch.is_grad_enabled(), info.recompiles)


def _tangent(value) -> bool:
    """Whether a backward graph's output is one of its incoming gradients, passed on as it
    came: for an argument the forward writes in place, the gradient of the written value,
    an output of AOTAutograd's forward that nothing reads with a gradient (the runtime
    copies it into the argument), so autograd gives zeros where plain PyTorch's graph has no
    path to the argument."""
    return isinstance(value, fx.Node) and value.op == "placeholder" and \
        value.name.startswith("tangents")


def _root(value, position: dict):
    """What ``value`` views: the first value up its chain of views (``t``, ``split``'s
    items, ``detach``, ``alias``: an op whose result aliases its first argument) that is
    not one; ``position``: the graph's arguments, where a chain stops too."""
    while isinstance(value, fx.Node) and value not in position:
        if value.target is operator.getitem:  # an item of a split, a chunk, an unbind
            value = value.args[0]
            continue
        schema = getattr(base_op(value.target), "_schema", None)
        returns = schema.returns if schema is not None else ()
        if value.op != "call_function" or not value.args or not returns \
                or returns[0].alias_info is None:
            break
        value = value.args[0]
    return value


def _views_apart(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a copy, changed in place) with each output that views an intermediate another
    output views too, or is, returned as a copy ([Note: compiled stages]): AOTAutograd makes
    such views again outside its graph from one base, and with a ``detach`` among them it
    made them from the wrong one (a split of 2 columns where 6 were split)."""
    position = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    output = gm.graph.output_node()
    leaves = [v for v in pytree.tree_leaves(output.args[0]) if isinstance(v, fx.Node)]
    roots: dict = {}
    for v in leaves:
        root = _root(v, position)
        if root not in position:
            roots.setdefault(root, []).append(v)
    views = {v for root, vs in roots.items() if len(vs) > 1 for v in vs if v is not root}
    if not views:
        return gm
    copies = {}
    with gm.graph.inserting_before(output):
        for v in views:
            copies[v] = gm.graph.call_function(torch.ops.aten.clone.default, (v,))
    output.args = fx.node.map_arg(output.args, lambda n: copies.get(n, n))
    gm.recompile()
    return gm


def _viewed_arguments(gm: fx.GraphModule) -> set:
    """The positions of ``gm``'s arguments that one of its outputs views (a parameter's
    ``weight.t()`` that a later stage multiplies by): AOTAutograd makes such an output again
    outside its graph, from the argument itself, so the argument's gradient comes through
    that view, not from the compiled backward, and it must not be cut (:func:`_cutting`)."""
    position = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    roots = (_root(v, position) for v in pytree.tree_leaves(gm.graph.output_node().args[0]))
    return {position[r] for r in roots if isinstance(r, fx.Node) and r in position}


def _cutting(fn, cut: tuple):
    """``fn`` given the arguments at ``cut``, which its backward gives no gradient (a
    parameter before a ``detach``), detached: autograd would call a hook on one (its
    ``register_hook``) with None, where plain PyTorch's graph has no path to it."""
    def call(*args):
        args = list(args)
        for k in cut:
            args[k] = args[k].detach()
        return fn(*args)
    return call


# oneDNN's LSTM layer (a CPU trace's nn.LSTM), run without grad as a compiled forward runs,
# leaves undefined the workspace its backward reads: "expected all tensors_saved_with_vc_check
# to be Tensors" on the first call.
_TRAINS_UNCOMPILED = (torch.ops.aten.mkldnn_rnn_layer.default,)


def uncompilable(stages) -> list:
    """The ops of a training trace's ``stages`` that compile but cannot run compiled: the
    compile step traces again without CPU-only kernels (``tracing.trace``'s ``generic``)."""
    return sorted({str(op) for st in stages for n in st.module.graph.nodes
                   if n.op == "call_function" and (op := base_op(n.target)) in _TRAINS_UNCOMPILED})


def _without_draws(gm: fx.GraphModule, part: str) -> None:
    """``gm``, a compiled backward graph, changed in place to draw no random numbers, as
    eager autograd's backward draws none ([Note: compiled stages])."""
    dead = [n for n in gm.graph.nodes if rng.is_random(n) and not n.users]
    for node in reversed(dead):
        gm.graph.erase_node(node)
    live = [str(n.target) for n in gm.graph.nodes if rng.is_random(n)]
    if live:
        raise NotImplementedError(
            f"its {part}'s backward draws random numbers ({', '.join(live)}), which a "
            f"compiled backward would draw outside the micro-batch's stream")
    if dead:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _boxed(gm: fx.GraphModule):
    """``gm`` called AOTAutograd's boxed way (a list of arguments)."""
    def call(args):
        return gm(*args)
    call._boxed_call = True
    return call


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


def _functions_copied(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a copy, changed in place) with each custom autograd Function's tensor outputs
    read through a copy ([Note: compiled stages]: AOTAutograd makes a view output again
    outside the graph, without the Function's backward)."""
    copies = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not grad_semantics.calls_function(node.target):
            continue
        items = [u for u in node.users if u.target is operator.getitem]
        copies.extend(items if items and len(items) == len(node.users) else [node])
    for value in copies:
        with gm.graph.inserting_after(value):
            copy = gm.graph.call_function(_copy, (value,))
        value.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    if copies:
        gm.recompile()
    return gm


def _copy(value):
    """A tensor's copy; anything else (a Function's None or constant output) as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _strip(target):
    if not hasattr(target, "wrapped_op"):
        return target
    inner = _strip(target.wrapped_op)
    return inner if target.rewrap is rng.seeded else target.rewrap(inner)


def _forget_real_tensors(graphs: list) -> None:
    """Empty the tables in which the fake-tensor modes of ``graphs`` (AOTAutograd's, reached
    through the fake values their nodes keep in ``meta["val"]``) describe the real tensors
    they were made from (``work.forget_real_tensors``): the graphs live as long as the
    compiled stage."""
    from torch._subclasses.fake_tensor import FakeTensor

    modes = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, FakeTensor):
                modes[id(value.fake_mode)] = value.fake_mode
                break
    for mode in modes.values():
        forget_real_tensors(mode)
