"""One CUDA graph per step: a warm program's runs captured once, then replayed.

[Note: step graphs]
A small model's step on a GPU is bound by its launches: Python hands the GPU one kernel
at a time. PopTorch compiles a step once and runs it without returning to Python; with
``Options.compileStages`` on a GPU (``cuda_graph=True``, the default) a program does
the same with a CUDA graph. Its first ``WARM_RUNS`` runs are eager (the stages compile,
the optimizer makes its state, cuBLAS and the autograd engine start). The next run is
captured: every action of the schedule, in the order of its rows, launched by the
caller's thread on the stages' own streams (forked from a capture stream and joined
back to it), into one graph; that run and every later one is then a replay. The capture
wraps the launch loop that ran the warm-ups (``Placement.run_in_order``, given the capture's
stream): a program that may be captured has its caller's thread launch every action in row
order from its first run on (``Executor.launched``), never the streams' workers, so whatever
a launch makes on first use for its thread and stream (a cuBLAS or cuDNN handle and
workspace, which CUDA refuses to make inside a capture) exists before the capture (like a
replay, such a run has no watchdog: one thread launches it all). When
workers ran a pipeline's warm-ups, the caller's first cuBLAS call came inside the capture
and the capture could not be ended (an H200, torch 2.11, 2026-11-28: every multi-stream
step); the GPU twin now refuses that ([Note: library state on first use] in
``tests/support/gpu_twin.py``). The executor's run and the step graph's replay are the one
interface a program calls (``run_call``):

- **Inputs** are read from static slots in GPU memory made at the capture; before each
  replay the run's micro-batches are copied into them on the capture stream (one
  transfer per input for all micro-batches, from pinned memory).
- **Random ops.** Micro-batch i draws from a generator of its own that the graph reads
  at each replay, seeded before it with the run's ``microbatch_seed(base, i)``: the masks
  are those of the eager path ([Note: micro-batch RNG] in ``compiler/rng``), replay
  after replay. While capturing, a random op takes it through ``rng.capturing``.
- **Values baked in.** A capture records Python numbers as constants: the learning rate
  and the optimizer's other hyperparameters, the loss scale, the divisor. Before each
  replay they (and which tensors hold the optimizer's state) are compared with the
  capture's; a change captures again (counted, logged). An optimizer whose
  hyperparameters changed twice (a learning-rate schedule) leaves the graph: its step
  runs eagerly after each replay. A tensor learning rate (``capturable=True``) is read
  from device memory: changed in place, it needs no new capture. Floats are not moved
  to device tensors: torch's SGD reads a tensor learning rate with ``.item()`` (refused
  in a capture), and a device-tensor operand changes the kernels (CUDA divides by a host
  scalar as a multiplication by its reciprocal), so replays would leave the eager bits.
- **Trainable parameters.** A capture bakes in which parameters get a gradient; a
  training program is compiled per set of them ([Note: trainable parameters] in
  ``compiled``), so a layer frozen between calls runs another program and its capture.
- **The optimizer's step** is in the graph where it is graph-safe: SGD (its state is
  device tensors only), or an optimizer built with ``capturable=True``. Otherwise the
  graph ends with the reduction and the step runs eagerly after the replay: Adam with
  ``capturable=False`` keeps its step count on the host, automatic loss scaling decides
  on the host whether a step applies, step hooks and PopTorch's state dtypes run Python.
- **Not captured** (the runs stay eager; the log says why, once): stages on more than
  one device, or not on a GPU; stages or replicas in other processes; ``useIpuModel``;
  offloaded optimizer state; ``stopOnNonFiniteLoss`` (a host read per micro-batch); a
  recomputed stage with random ops (its recompute restarts a generator mid-stream);
  gradient hooks on parameters (their Python would run at the capture only); an action that
  makes the host wait for the GPU (a value read on the host, an op whose output size depends
  on the data: inside a capture it would invalidate it, and the capture could not be ended),
  which the last warm-up run looks for with CUDA's sync debug mode (in the optimizer's step
  it only takes the step out of the graph); a BatchNorm
  with ``momentum=None`` (a host read per micro-batch: [Note: cumulative averages] in
  ``compiler/running_stats``). A capture
  that raises leaves the program eager (its streams are
  joined back, so the capture ends); one that cannot be ended stops the call
  (``ExecutionError``): torch's CUDA state is then unknown.
- **After a replay** the stream is synchronized, as an eager run's streams are; the
  outputs, in the graph's memory, are copied to the host; after a training replay the
  parameters' ``.grad`` are cleared, as an eager run's start clears them, and are the
  capture's tensors again where the graph made them (a parameter no stage reads has none,
  not the user's; a call hands the host's back to the user after), and after an inference
  replay they are the user's, untouched; the step is counted. A replay is one launch: the
  timeline has one span of it ("C", timed on the GPU) in place of its actions', and the
  watchdog does not watch it.

The GPU twin records a capture op by op and replays it on the same tensors, running
nothing while capturing (``tests/support/gpu_twin.py``), so the CPU suite tests what is
captured, the slots and the replays.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch

from ..compiler import markers, rng
from ..compiler.compiled_stages import CompiledGraph
from ..compiler.running_stats import reads_count
from ..errors import ExecutionError
from . import after_step
from .gpu import CaptureFailed, joinable
from .run import RunStats
from .schedule import Kind
from .update import graph_refusal

_LOG = logging.getLogger("poptorch_lite")

WARM_RUNS = 2  # eager runs of a program before its step is captured
_ON_THE_HOST = (markers.PRINT_TENSOR, after_step.AVERAGE)  # ops that run Python when they run
_RESTLESS = 2  # captures for a changed optimizer before its step leaves the graph


class GraphReport:
    """What a program's step graph did.

    Attributes:
        refused: why its runs are not captured (None: they are, once warm).
        parts: what the graph holds; eager: what runs eagerly after each replay, and why.
        captures, recaptures, replays, eager_runs: counts over the program's runs.
    """

    def __init__(self, refused: Optional[str] = None):
        self.refused = refused
        self.parts: tuple = ()
        self.eager: dict = {}
        self.captures = self.recaptures = self.replays = self.eager_runs = 0


class StepGraph:
    """The captured step of one program on one GPU ([Note: step graphs]).

    Args:
        executor: the program's; device: the GPU of all its stages; refused: why its runs
            cannot be captured (None: they can).
    """

    def __init__(self, executor, device: torch.device, refused: Optional[str]):
        self.ex, self.device = executor, device
        self.report = GraphReport(refused)
        self.stream = executor.gpu.Stream(device) if refused is None else None
        if refused is None:  # the warm-up runs launch what the capture launches
            executor.launched()
        self.captured: Optional[_Captured] = None
        self.warm = 0
        self.step_out: Optional[str] = None  # why the optimizer's step left the graph
        self.restless = 0
        if refused is not None:
            _LOG.info("compileStages: the steps on %s are not captured as a CUDA graph: %s",
                      device, refused)

    def run_call(self, call, microbatches: list, replica_of, index: int = 0, keep=None,
                 base: Optional[int] = None) -> tuple:
        """One run of ``call``'s schedule, ``Executor.run_call``'s arguments and result: a
        replay of the captured step (captured first if need be), or, while the program warms
        up or where it is not captured, the executor's eager run."""
        report, step = self.report, call.step
        if report.refused is None:
            why = self._refusal(step)
            if why is not None:
                self._refuse(why)
        if report.refused is not None or self.warm < WARM_RUNS:
            last = report.refused is None and self.warm == WARM_RUNS - 1
            self.warm += 1
            report.eager_runs += 1
            found: list = []  # the last warm-up run's host syncs, which a capture forbids
            gpu = self.ex.gpu
            done = self.ex.run_call(call, microbatches, replica_of, index, keep, base,
                                    watch=(lambda a: gpu.host_syncs(found, a)) if last else None)
            if last:
                self._synced(found, call.step)
            return done
        in_graph = self._step_in_graph(step)
        key = self._key(step, in_graph)
        cap = self.captured
        if cap is not None and (cap.key != key or cap.plan is not call.plan):
            in_graph = self._changed(cap, key, step)
            key = self._key(step, in_graph)
            cap = self.captured = None
        how = "replayed"
        slots, placed = self._slots(microbatches) if cap is None else (cap.slots, None)
        self._fill(slots, microbatches)  # what the capture records and the replay reads
        if cap is None:
            try:
                cap = self.captured = self._capture(call, microbatches, replica_of, in_graph,
                                                    key, slots, placed)
            except CaptureFailed as exc:  # the GPU's state is unknown: nothing more runs
                self._refuse(f"its capture could not be ended: {exc}")
                raise ExecutionError(
                    f"the CUDA graph capture of the step on {self.device} could not be ended "
                    f"({exc}), which may leave torch's CUDA state inconsistent; nothing of "
                    f"this run was applied. Restart the process with Options().compileStages("
                    f"True, cuda_graph=False)", location=str(self.device)) from exc
            except Exception as exc:  # nothing ran: the run goes eagerly, and the rest
                self._refuse(f"its capture failed: {type(exc).__name__}: {exc}")
                report.eager_runs += 1
                return self.ex.run_call(call, microbatches, replica_of, index, keep, base)
            how = "captured"
        return self._replay(cap, call, microbatches, index, keep, base, how)

    # -- what may be captured -------------------------------------------------------------

    def _refusal(self, step) -> Optional[str]:
        """Why this run cannot be captured, or None (what may change between calls)."""
        if step is not None and step.check_loss:
            return ("Training.stopOnNonFiniteLoss reads every micro-batch's loss on the host; "
                    "turn it off to capture the steps")
        if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
               for p in self.ex.weights.params.values()):
            return ("a parameter has gradient hooks, whose Python would run at the capture "
                    "only")
        return None

    def _synced(self, found: list, step) -> None:
        """After the last warm-up run, its host syncs (``(action, what)``): one in a stage's
        action keeps the program eager, since inside a capture it would invalidate it, and the
        capture could then not be ended; one in the optimizer's step only takes the step out
        of the graph (saying why it is not graph-safe where that is known)."""
        staged = [(a, what) for a, what in found if a.kind is not Kind.STEP]
        if staged:
            a, what = staged[0]
            self._refuse(f"action {a} makes the host wait for the GPU ({what}), which a capture "
                         f"forbids")
        elif found and self.step_out is None:
            self._leave(graph_refusal(step) or f"it makes the host wait for the GPU "
                        f"({found[0][1]}), which a capture forbids")

    def _refuse(self, why: str) -> None:
        self.report.refused = why
        self.captured = None
        _LOG.warning("compileStages: the steps on %s run eagerly from now on: %s", self.device,
                     why)

    def _step_in_graph(self, step) -> bool:
        if step is None or self.step_out is not None:
            return False
        why = graph_refusal(step)
        if why is not None:
            self._leave(why)
            return False
        return True

    def _leave(self, why: str) -> None:
        """The optimizer's step leaves the graph: it runs eagerly after each replay."""
        self.step_out = why
        self.report.eager["optimizer step"] = why
        _LOG.info("compileStages: the optimizer's step runs eagerly after each replay of the "
                  "CUDA graph: %s", why)

    def _key(self, step, in_graph: bool) -> tuple:
        """What a capture bakes in: where the weights are (their memory), the step's numbers,
        and with the optimizer's step its hyperparameters and the tensors of its state."""
        weights = self.ex.weights
        key: tuple = ((weights.placements, tuple(t.data_ptr() for t in weights.param_tensors())),)
        if step is None:
            return key
        key += ((step.loss_scaling, step.divisor, step.accum_dtype, step.max_grad_norm),)
        if in_graph:
            opt = step.optimizer
            key += ((tuple(tuple(sorted((k, _frozen(v)) for k, v in g.items() if k != "params"))
                           + (len(g["params"]),) for g in opt.param_groups),
                     tuple(id(v) for v in _state_tensors(opt))),)
        return key

    def _changed(self, cap, key: tuple, step) -> bool:
        """The captured step no longer fits (``key`` differs, or a new schedule): log it, and
        whether the optimizer's step stays in the next graph."""
        self.report.recaptures += 1
        what = ("the schedule" if cap.key == key else "the weights' memory" if
                cap.key[0] != key[0] else "the loss scale, divisor, accumulator or clipping"
                if cap.key[1] != key[1] else "the optimizer's hyperparameters or state tensors")
        if cap.step_in_graph and cap.key[2:] != key[2:]:
            self.restless += 1
            if self.restless >= _RESTLESS:
                self._leave("its hyperparameters changed between runs (a learning-rate "
                            "schedule?), and a capture bakes them in")
        _LOG.info("compileStages: capturing the step on %s again: %s changed", self.device, what)
        return self._step_in_graph(step)

    # -- capture --------------------------------------------------------------------------

    def _capture(self, call, microbatches: list, replica_of, in_graph: bool, key: tuple,
                 slots: list, placed: dict):
        ex, gpu, device, step = self.ex, self.ex.gpu, self.device, call.step
        unrecorded = [m.backend for st in ex.work.stages for m in (st.module, *(
            seg.module for seg in st.segments)) if isinstance(m, CompiledGraph) and m.fns
            and not gpu.records(m.backend)]
        if unrecorded:
            raise ExecutionError(f"this GPU cannot record stages compiled by {unrecorded[0]}")
        plan = call.plan
        training, M = plan.schedule.training, len(microbatches)
        streams = [rng.Stream(i) for i in range(M)] if ex.random else None
        run = ex.start_run(call, microbatches, replica_of, streams, 0, None, placed)
        self.stream.synchronize()  # the inputs landed in their slots: the capture starts clean
        graph = gpu.graph()
        with gpu.device(device):  # the generators' state on their GPU
            generators = [gpu.graph_generator(graph, device) for _ in range(M)] if (
                ex.random) else []
        started = time.perf_counter()
        self.stream.wait_stream(gpu.current_stream(device))  # the caller's work so far
        draws = rng.capturing(rng.GraphDraws(gpu, device, streams, generators)) if ex.random else (
            contextlib.nullcontext())
        with torch.set_grad_enabled(training), draws, gpu.device(device), gpu.capture(
                graph, self.stream):
            ex.capture_run(call, run, self.stream, in_graph)
        cap = _Captured(graph, run, slots, generators, key, in_graph, plan,
                        [(t, t.grad) for t in ex.weights.param_tensors()])
        if in_graph:  # what the key names by identity stays alive while the graph does
            cap.held = list(_state_tensors(step.optimizer))
        parts = (f"{'every stage action' if training else 'the forwards'} of {M} micro-batch"
                 f"{'es' if M > 1 else ''}",) + (("the reduction",) if training else ()) + (
                     ("the optimizer's step",) if in_graph else ())
        report = self.report
        report.parts, report.captures = parts, report.captures + 1
        if in_graph:
            report.eager.pop("optimizer step", None)
        _LOG.info("compileStages: captured the step on %s as one CUDA graph in %.2f s: %s%s",
                  device, time.perf_counter() - started, ", ".join(parts), "".join(
                      f"; eager after each replay: {part} ({why})"
                      for part, why in report.eager.items()))
        return cap

    def _slots(self, microbatches: list) -> tuple:
        """Static memory on the device for the run's inputs, which the stages read: ``(slots,
        placed)``, where a slot is ``(target, input, micro-batch or None for all)``, what
        :meth:`_fill` copies each run's inputs into, and ``placed`` is ``Run.placed``'s
        ``(ipu, micro-batch, input) -> view of a slot``."""
        ex, device = self.ex, self.device
        slots, placed = [], {}
        for k in sorted({k for keys in ex.inputs.keys.values() for k in keys}):
            sources = [mb[k] for mb in microbatches]
            if joinable(sources):
                joined = torch.empty((sum(len(t) for t in sources), *sources[0].shape[1:]),
                                     dtype=sources[0].dtype, device=device)
                views = list(joined.split([len(t) for t in sources]))
                slots.append((joined, k, None))
            else:
                views = [torch.empty_like(t, device=device) for t in sources]
                slots += [(v, k, i) for i, v in enumerate(views)]
            for ipu, keys in ex.inputs.keys.items():
                if k in keys:
                    for i, v in enumerate(views):
                        placed[ipu, i, k] = v
        return slots, placed

    def _fill(self, slots: list, microbatches: list) -> None:
        """Copy a run's inputs into the slots, on the capture stream after the caller's work so
        far (inputs already on the GPU may come from it)."""
        gpu = self.ex.gpu
        self.stream.wait_stream(gpu.current_stream(self.device))
        with gpu.stream(self.stream):
            for target, k, i in slots:
                gpu.copy_rows_into(target, [mb[k] for mb in microbatches] if i is None
                                   else [microbatches[i][k]], self.device)

    # -- replay ---------------------------------------------------------------------------

    def _replay(self, cap, call, microbatches: list, index: int, keep, base: Optional[int],
                how: str):
        ex, gpu, stream = self.ex, self.ex.gpu, self.stream
        run = cap.run
        run.inputs = microbatches
        run.kept = [i for i in range(len(microbatches)) if keep is None or keep[i]]
        run.keeps = frozenset(run.kept)
        if cap.generators:
            base = rng.draw_base() if base is None else base
            with gpu.device(self.device):
                for m, gen in enumerate(cap.generators):
                    gen.manual_seed(rng.microbatch_seed(base, m))
        stream.wait_stream(gpu.current_stream(self.device))  # weights pushed, the last step
        begun, ended = gpu.Event(enable_timing=True), gpu.Event(enable_timing=True)
        begun.record(stream)
        launched = time.perf_counter()
        gpu.replay(cap.graph, stream)
        ended.record(stream)
        try:
            stream.synchronize()
        except RuntimeError as exc:  # an asynchronous CUDA error
            raise ExecutionError(f"the replay of the step captured on {self.device} failed: "
                                 f"{type(exc).__name__}: {exc}; run with compileStages("
                                 f"cuda_graph=False) to find the action that fails",
                                 location=str(self.device)) from exc
        # A training run's gradients as the eager run leaves them: cleared as it starts (a
        # parameter no stage reads keeps none, not the user's), the graph's where it made
        # them (a call hands the host's back to the user after); an inference run's, the
        # user's, untouched
        if call.step is not None:
            ex.weights.zero_grads()
            for t, grad in cap.grads:
                t.grad = grad
        held = {r.untyped_storage().data_ptr() for rs in run.results for r in rs.values()}
        outputs = [None if out is None else [  # none may be the graph's memory: copies
            o.clone() if o.untyped_storage().data_ptr() in held else o for o in out]
            for out in ex.replayed(call, run, cap.step_in_graph)]
        self.report.replays += 1
        if call.recorder is not None:  # one span: the whole run, measured on the GPU
            call.recorder.add_gpu(ex.step_ipu, None, None, "C", begun, launched, begun, ended,
                                  index)
        stats = cap.run.work.stats
        return outputs, RunStats(list(stats.peak_stash_depth), list(stats.peak_stash_bytes), how)


class _Captured:
    """A captured step: its graph, the run whose tensors it holds, its slots, generators and
    key, the parameters' gradients it left."""

    __slots__ = ("graph", "run", "slots", "generators", "key", "step_in_graph", "plan",
                 "grads", "held")

    def __init__(self, graph, run, slots, generators, key, step_in_graph, plan, grads):
        self.graph, self.run, self.slots, self.generators = graph, run, slots, generators
        self.key, self.step_in_graph, self.plan = key, step_in_graph, plan
        self.grads, self.held = grads, ()


def for_program(executor, options) -> Optional[StepGraph]:
    """The step graph of a program whose stages are on a GPU, under ``compileStages``
    (None: no stage is on a GPU, or the option is off); one that refuses to capture says
    why ([Note: step graphs])."""
    if not (options.compile_stages and options.compile_cuda_graph):
        return None
    ex = executor
    devices = list(dict.fromkeys(ex.placement.device(st.ipu) for st in ex.partition.stages
                                 if ex.local[st.index]))
    on_gpu = [d for d in devices if ex.gpu.is_gpu(d)]
    if not on_gpu:
        return None
    refused = (
        "stages or replicas run in other processes" if ex.channels is not None
        or ex.processes is not None else
        f"the stages run on {len(devices)} devices ({', '.join(map(str, devices))}); one "
        f"graph holds one GPU's work" if len(devices) > 1 else
        "useIpuModel gives every IPU a memory of its own" if ex.weights.separate_memories else
        "the optimizer's state is offloaded to host memory" if ex.weights.offload else
        "a recomputed stage has random ops" if any(
            st.recompute and st.random for st in ex.work.stages) else
        "a stage draws from a torch.Generator of the model's own, whose draws on the host a "
        "graph would not replay" if rng.user_generators(ex.partition.stages) else
        "a BatchNorm with momentum=None reads its count on the host in every micro-batch"
        if reads_count(gm for st in ex.partition.stages
                       for gm in (st.module, *(seg.module for seg in st.segments))) else
        "a stage runs Python in every micro-batch (ipu_print_tensor, or ExpMovAvg noting its "
        "factor), which a replay would not run" if after_step.in_graphs(
            (st.module for st in ex.partition.stages), _ON_THE_HOST) else None)
    return StepGraph(ex, on_gpu[0], refused)


def _state_tensors(opt):
    """The tensors of ``opt``'s state and hyperparameters (a tensor learning rate)."""
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    for group in opt.param_groups:
        yield from (v for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor))


def _frozen(v):
    """A hyperparameter as a key can hold it: a tensor by identity (a host read would sync)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)
