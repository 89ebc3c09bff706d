"""Executor: runs a schedule's actions on a partition's stages.

The executor interprets a :class:`~poptorch_lite.schedule.Schedule`: each
stream gets its action list and runs it on its worker, waiting only for the
actions on other streams that it depends on ([Note: streams]). It has one
dispatch on the action kind and holds no scheduling logic.

[Note: autograd boundary]
A stage's inputs that another stage computed arrive detached and, when the
producer's value requires grad, as fresh leaves that require grad (a stage that
writes such an input in place gets a clone of the leaf, so the gradient still
reaches the leaf and the producer's value stays intact). Backward of a stage
is ``torch.autograd.backward(outputs, grad_tensors)`` with the gradients its
consumers left for its outputs (the loss gets the loss-scaling factor);
afterwards the gradients of its boundary inputs go upstream.

[Note: activation stash]
Each stage keeps a FIFO of :class:`_Entry`, one per micro-batch forwarded and
not yet backwarded; the schedule runs each stage's backwards in forward order,
so the head is always the micro-batch a backward needs. Without recomputation
an entry holds the stage's autograd graph (its saved activations); with it,
only what recomputation starts from: the boundary inputs, the values at the
stage's ``recomputationCheckpoint`` cuts, the pre-forward values of buffers the
stage writes, and the micro-batch's random state. The run records each
stage's peak depth and peak bytes (distinct storages, parameters and the
call's inputs excluded), so tests can hold a schedule to its promise.

[Note: recomputation]
A recomputed stage's forward runs without keeping activations (a saved-tensor
hook drops them). Its recompute action, in the backward slot, re-runs each
segment between checkpoints from the kept values with gradients on, replaying
the micro-batch's random state (same dropout masks) on copies of the written
buffers (BatchNorm statistics move once). Each segment starts from leaves, so
the backward runs segment by segment, last first, and hands each segment's
input gradients to the one before; without recomputation the stage is one
segment.

[Note: gradient arithmetic]
Autograd sums the gradients of all micro-batches (accumulation steps and
replicas run in turn) into ``.grad``, or, with an accumulator dtype (the
optimizer's ``accum_type``, e.g. float32 for bfloat16 parameters), into an
accumulator of that dtype after each backward. The reduction of stage s
(``sG``) divides that sum once by ``loss_scaling`` (undoing the scaled loss)
and by ``StepArithmetic.divisor``: for ``ReductionType.Mean`` the number of
micro-batches ``G·R``; for ``Sum`` 1. With ``inputReplicaGrouping(g)`` the g
replicas of a group share one input, so each micro-batch run stands for g of
them: Mean divides by ``G·R/g`` and Sum by ``1/g``. The update (``U``) clips
to ``max_grad_norm`` if finite, then calls ``optimizer.step()``. After a
training call, each parameter's ``.grad`` holds the gradient its last step
used.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import torch

from . import rng
from .errors import Error, ExecutionError
from .partition import Partition
from .placement import ActionFailed, ActionStuck, Placement, Weights
from .schedule import Action, Kind, Schedule
from .timeline import Recorder


@dataclasses.dataclass
class StepArithmetic:
    """The numbers of one optimizer step ([Note: gradient arithmetic]).

    Attributes:
        optimizer: the optimizer to step.
        loss_scaling: the factor the loss is multiplied by before backward.
        divisor: what the summed micro-batch gradients are divided by (besides
            the loss scaling) to give the reduced gradient.
        max_grad_norm: clip the global gradient norm to this (inf: no clipping).
        accum_dtype: accumulate gradients in this dtype (None: the parameter's).
    """

    optimizer: torch.optim.Optimizer
    loss_scaling: float = 1.0
    divisor: float = 1
    max_grad_norm: float = math.inf
    accum_dtype: Optional[torch.dtype] = None


@dataclasses.dataclass
class RunStats:
    """What one run measured ([Note: activation stash]): per stage, peak stash depth and bytes."""

    peak_stash_depth: list
    peak_stash_bytes: list


class _Entry:
    """One micro-batch in a stage's stash ([Note: activation stash])."""

    __slots__ = ("i", "boundary", "segments", "args", "kept", "buffers", "rng", "nbytes")

    def __init__(self, i: int, boundary: dict):
        self.i = i
        self.boundary = boundary   # value name -> the leaf this stage computed from
        self.segments = None       # [(outputs, output names, {name: leaf})], in forward order
        self.args = None           # recomputation: the forward's arguments
        self.kept = None           # recomputation: value name -> (tensor, requires_grad)
        self.buffers = None        # recomputation: buffer name -> value before the forward
        self.rng = None            # recomputation: the random state the forward started from
        self.nbytes = 0


class _Run:
    """The state of one run of a schedule: values, stashes and gradients per micro-batch."""

    def __init__(self, partition: Partition, microbatches: Sequence[Sequence[torch.Tensor]],
                 replica_of: Callable, streams: Optional[list]):
        S = partition.num_stages
        self.inputs = microbatches
        self.replica_of = replica_of
        self.rng = streams                                 # per micro-batch, or None
        self.values = [dict() for _ in microbatches]      # value name -> tensor, per micro-batch
        self.grads = [dict() for _ in microbatches]       # value name -> gradient, per micro-batch
        self.results = [dict() for _ in microbatches]     # returned values, detached
        self.stash = [collections.deque() for _ in range(S)]
        self.accum: dict = {}                              # param name -> (tensor, accumulator)
        self.stats = RunStats([0] * S, [0] * S)
        self.excluded: set = set()                         # storages not counted as stash


def _drop(t: torch.Tensor) -> None:
    return None


def _gone(_) -> torch.Tensor:
    raise Error("a recomputed stage's forward activations were dropped; its backward must "
                "follow its recompute action (a schedule error)")


class Executor:
    """Runs schedules over the stages of one partition.

    Args:
        partition: the stages.
        placement: devices and streams of their IPUs.
        weights: the tensors the stages compute with.
        recompute: per stage, whether it is recomputed ([Note: recomputation]).

    Example:
        See ``wrapper.PoplarExecutor``, which builds one per traced input signature.
    """

    def __init__(self, partition: Partition, placement: Placement, weights: Weights,
                 recompute: Optional[Sequence[bool]] = None):
        self.partition = partition
        self.placement = placement
        self.weights = weights
        self.recompute = tuple(recompute or [False] * partition.num_stages)
        self.random = any(st.random for st in partition.stages)
        # Each stage's inputs as (name, kind, key), parsed once: [Note: partition] names them.
        self.sources = [[(n, *n.split(":", 1)) for n in st.inputs] for st in partition.stages]
        # The parameters whose gradient each stage reduces: those it is the first to use;
        # and those only it uses (their gradient may go to an accumulator after each backward).
        self.owned = [[] for _ in partition.stages]
        users: dict = collections.Counter(n for st in partition.stages for n in st.param_names)
        self.exclusive = [[n for n in st.param_names if users[n] == 1] for st in partition.stages]
        seen: set = set()
        for st in partition.stages:
            for name in st.param_names:
                if name not in seen:
                    seen.add(name)
                    self.owned[st.index].append(name)
        self.written_buffers = [[n for n in st.inputs if n.startswith("buffer:")
                                 and n.split(":", 1)[1] in partition.mutated_buffers]
                                for st in partition.stages]
        self.wanted = {o for o in partition.outputs if isinstance(o, str)}
        self.handlers = {Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
                         Kind.RECOMPUTE: self._recompute, Kind.REDUCE: self._reduce,
                         Kind.STEP: self._step}
        self._plans: dict = {}

    def run(self, schedule: Schedule, microbatches: Sequence[Sequence[torch.Tensor]],
            replica_of: Callable, step: Optional[StepArithmetic],
            recorder: Optional[Recorder] = None, run_index: int = 0,
            watchdog: Optional[float] = None) -> tuple:
        """Run ``schedule`` over ``microbatches`` (the tensor leaves of each).

        Args:
            schedule: the grid to run; ``schedule.num_microbatches == len(microbatches)``.
            microbatches: per micro-batch, its tensor leaves (``input:k`` values).
            replica_of: micro-batch index -> the replica it belongs to.
            step: the optimizer step's arithmetic, for training schedules.
            recorder: where to record each action's span (None: not recorded).
            run_index: this run's number within the call, for the recorder.
            watchdog: seconds without progress before the run is declared stuck.

        Returns:
            ``(outputs, stats)``: per micro-batch, the model's tensor outputs
            (detached, on the host), and the run's :class:`RunStats`.

        Raises:
            ExecutionError: an action failed or got stuck; names stream, stage,
                micro-batch and action and shows the grid with the failing row marked.
        """
        p = self.partition
        streams = None
        if self.random:  # [Note: micro-batch RNG]
            base = rng.draw_base()
            streams = [rng.Stream(rng.microbatch_seed(base, i)) for i in range(len(microbatches))]
        run = _Run(p, microbatches, replica_of, streams)
        if schedule.training:
            self.weights.zero_grads()
            run.excluded = self.weights.storages()
        lists, waits, rows = self._plan(schedule)
        training = schedule.training
        handlers = self.handlers

        def call(a: Action) -> None:
            start = time.perf_counter()
            with torch.set_grad_enabled(training):  # grad mode is per thread
                handlers[a.kind](a, run, step)
            if recorder is not None:
                recorder.add(self._ipu(a), a.stage, a.microbatch, a.kind.value, start,
                             time.perf_counter(), run_index)

        try:
            self.placement.run_lists(lists, waits.__getitem__, call, watchdog)
        except ActionFailed as failure:
            self._fail(schedule, rows[failure.action], failure.action, failure.exc)
        except ActionStuck as stuck:
            a = next(iter(stuck.running.values()), None)
            self._fail(schedule, rows.get(a), a, TimeoutError(
                f"no action finished for {stuck.seconds} s (Options.watchdogTimeout); "
                f"still running: {', '.join(str(x) for x in stuck.running.values()) or 'none'}"))
        out = []
        for i in range(len(microbatches)):
            out.append([self._result(run, i, o) for o in p.outputs if isinstance(o, str)])
        return out, run.stats

    def _plan(self, schedule: Schedule) -> tuple:
        """Per stream its actions; per action what it waits for on other streams; rows."""
        cached = self._plans.get(id(schedule))
        if cached is None or cached[0] is not schedule:
            lists = {ipu: [] for ipu in self.placement.devices}
            rows = {}
            for t, row in enumerate(schedule.rows):
                for a in row:
                    if a is not None:
                        lists[self._ipu(a)].append(a)
                        rows[a] = t
            waits = {a: [d for d in schedule.dependencies(a) if self._ipu(d) != self._ipu(a)]
                     for a in rows}
            order = schedule.actions()
            if all(sum(a is not None for a in row) == 1 for row in schedule.rows):
                # One action per row (Sequential): a total order, run as one.
                for prev, a in zip(order, order[1:]):
                    if self._ipu(prev) != self._ipu(a):
                        waits[a] = [prev]
            cached = self._plans[id(schedule)] = (schedule, (lists, waits, rows))
        return cached[1]

    def _ipu(self, a: Action) -> int:
        return self.partition.stages[a.stage if a.stage is not None else 0].ipu

    # -- forward, recompute, backward ---------------------------------------------------------

    def _args(self, s: int, run: _Run, i: int, device: torch.device) -> tuple:
        """The stage's arguments for micro-batch i, and its boundary leaves."""
        st = self.partition.stages[s]
        args, boundary = [], {}
        for name, kind, key in self.sources[s]:
            if kind == "param":
                v = self.weights.param(key, device)
            elif kind == "buffer":
                v = self.weights.buffer(key, run.replica_of(i), device)
            elif kind == "input":
                v = run.inputs[i][int(key)].to(device)
            else:  # computed by an earlier stage: [Note: autograd boundary]
                produced = run.values[i][name]
                v = produced.detach().to(device)
                if device.type == "cuda" and produced.device == device:
                    v.record_stream(torch.cuda.current_stream(device))  # used on this stream too
                if torch.is_grad_enabled() and produced.requires_grad:
                    v.requires_grad_(True)
                    boundary[name] = v
                if name in st.written_inputs:  # written in place: leave the producer's value
                    v = v.clone()
            args.append(v)
        return args, boundary

    def _forward(self, a: Action, run: _Run, step) -> None:
        s, i = a.stage, a.microbatch
        st = self.partition.stages[s]
        args, boundary = self._args(s, run, i, self.placement.device(st.ipu))
        stream = run.rng[i] if run.rng is not None and st.random else None
        if not torch.is_grad_enabled():  # inference
            with rng.use(stream):
                self._keep_outputs(st, run, i, st.module(*args))
            return
        entry = _Entry(i, boundary)
        counted: dict = {}
        if self.recompute[s]:  # [Note: recomputation]
            entry.args = args
            entry.rng = stream.snapshot() if stream is not None else None
            entry.buffers = {n: args[st.inputs.index(n)].detach().clone()
                             for n in self.written_buffers[s]}
            env = dict(zip(st.inputs, args))
            with rng.use(stream), torch.autograd.graph.saved_tensors_hooks(_drop, _gone):
                for seg in st.segments:
                    env.update(zip(seg.outputs, seg.module(*[env[n] for n in seg.inputs])))
            entry.kept = self._kept(st, env)
            outs = tuple(env[n] for n in st.outputs)
            for t in (*boundary.values(), *(v for v, _ in entry.kept.values()),
                      *entry.buffers.values()):
                self._count(t, counted, run.excluded)
        else:
            def pack(t: torch.Tensor) -> torch.Tensor:
                self._count(t, counted, run.excluded)
                return t
            with rng.use(stream), torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                outs = st.module(*args)
            entry.segments = [(outs, st.outputs, {})]
        entry.nbytes = sum(counted.values())
        self._keep_outputs(st, run, i, outs)
        stash = run.stash[s]
        stash.append(entry)
        stats = run.stats
        stats.peak_stash_depth[s] = max(stats.peak_stash_depth[s], len(stash))
        stats.peak_stash_bytes[s] = max(stats.peak_stash_bytes[s], sum(e.nbytes for e in stash))

    @staticmethod
    def _kept(st, env: dict) -> dict:
        """Values that cross a checkpoint cut inside the stage: what recompute starts from."""
        produced_inside = {n for seg in st.segments for n in seg.outputs}
        return {n: (env[n].detach(), env[n].requires_grad)
                for seg in st.segments[1:] for n in seg.inputs if n in produced_inside}

    @staticmethod
    def _count(t: torch.Tensor, counted: dict, excluded: set) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            counted[ptr] = storage.nbytes()

    def _keep_outputs(self, st, run: _Run, i: int, outs: tuple) -> None:
        values, wanted = run.values[i], self.wanted
        for name, o in zip(st.outputs, outs):
            values[name] = o
            if name in wanted:
                run.results[i][name] = o.detach()

    def _head(self, a: Action, run: _Run) -> _Entry:
        entry = run.stash[a.stage][0]
        if entry.i != a.microbatch:
            raise Error(f"stage {a.stage}'s stash holds micro-batch {entry.i} where {a} needs "
                        f"{a.microbatch}: the schedule broke FIFO order")
        return entry

    def _recompute(self, a: Action, run: _Run, step) -> None:
        # [Note: recomputation] re-run each segment from the kept values, gradients on.
        st = self.partition.stages[a.stage]
        entry = self._head(a, run)
        env = {}
        for name, v in zip(st.inputs, entry.args):
            if name in entry.buffers:
                v = entry.buffers[name].clone()  # writes land in a copy: statistics move once
            elif name in entry.boundary:
                v = entry.boundary[name]
                if name in st.written_inputs:
                    v = v.clone()
            env[name] = v
        segments = []
        with rng.use(entry.rng.snapshot() if entry.rng is not None else None):
            for seg in st.segments:
                leaves, args = {}, []
                for name in seg.inputs:
                    if name in entry.kept:
                        value, requires_grad = entry.kept[name]
                        v = value.detach().requires_grad_(requires_grad)
                        if requires_grad:
                            leaves[name] = v
                        args.append(v.clone() if requires_grad and name in seg.written else v)
                    else:
                        args.append(env[name])
                segments.append((seg.module(*args), seg.outputs, leaves))
        entry.segments, entry.args, entry.kept, entry.buffers = segments, None, None, None

    def _backward(self, a: Action, run: _Run, step: StepArithmetic) -> None:
        st = self.partition.stages[a.stage]
        entry = self._head(a, run)
        run.stash[a.stage].popleft()
        i = entry.i
        grads_in = run.grads[i]
        pending: dict = {}  # value name -> gradient from a later segment's leaf
        for outs, names, leaves in reversed(entry.segments):
            tensors, grads = [], []
            for name, o in zip(names, outs):
                g = grads_in.pop(name, None)
                if name == self.partition.loss:
                    seed = torch.full_like(o, step.loss_scaling)  # loss scaling: the one place
                    g = seed if g is None else g + seed
                later = pending.pop(name, None)
                if later is not None:
                    g = later if g is None else g + later
                if g is not None and o.requires_grad:
                    tensors.append(o)
                    grads.append(g.to(o.device))
            if tensors:
                torch.autograd.backward(tensors, grads)
            for name, leaf in leaves.items():
                if leaf.grad is not None:
                    prev = pending.get(name)
                    pending[name] = leaf.grad if prev is None else prev + leaf.grad
        for name in st.outputs:
            run.values[i].pop(name, None)
        for name, leaf in entry.boundary.items():  # input gradients go upstream
            if leaf.grad is not None:
                prev = grads_in.get(name)
                grads_in[name] = leaf.grad if prev is None else prev + leaf.grad.to(prev.device)
        if step.accum_dtype is not None:
            self._accumulate(a.stage, run, step.accum_dtype)

    def _accumulate(self, s: int, run: _Run, dtype: torch.dtype) -> None:
        """Move this backward's gradients into accumulators of ``dtype`` ([Note: gradient arithmetic])."""
        device = self.placement.device(self.partition.stages[s].ipu)
        for name in self.exclusive[s]:
            p = self.weights.param(name, device)
            if p.grad is None or p.grad.dtype == dtype:
                continue
            held = run.accum.get(name)
            g = p.grad.to(dtype)
            run.accum[name] = (p, g if held is None else held[1].add_(g))
            p.grad = None

    # -- reduction and update -------------------------------------------------------------

    def _reduce(self, a: Action, run: _Run, step: StepArithmetic) -> None:
        # [Note: gradient arithmetic] sum over micro-batches -> mean (or sum), unscaled.
        divisor = step.loss_scaling * step.divisor
        for name in self.owned[a.stage]:
            held = run.accum.pop(name, None)
            if held is not None:  # divide in the accumulator's dtype, then cast once
                p, acc = held
                p.grad = (acc.div_(divisor) if divisor != 1 else acc).to(p.dtype)
                self.weights.gather_grad(name)
                continue
            grad = self.weights.gather_grad(name)
            if grad is not None and divisor != 1:
                grad.div_(divisor)

    def _step(self, a: Action, run: _Run, step: StepArithmetic) -> None:
        # [Note: gradient arithmetic] clip, then one optimizer update.
        if math.isfinite(step.max_grad_norm):
            params = [p for p in self.weights.params.values() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, step.max_grad_norm)
        step.optimizer.step()
        self.weights.after_step()

    # -- results and failures -------------------------------------------------------------

    def _result(self, run: _Run, i: int, name: str) -> torch.Tensor:
        if name in run.results[i]:
            v = run.results[i][name]
        else:
            kind, key = name.split(":", 1)
            if kind == "input":
                v = run.inputs[i][int(key)]
            elif kind == "param":
                v = self.weights.params[key].detach().clone()
            else:
                v = self.weights.buffer(key, run.replica_of(i), self.weights.buffers[key].device)
                v = v.detach().clone()
        return v.cpu() if v.device.type != "cpu" else v

    def _fail(self, schedule: Schedule, row: Optional[int], a: Optional[Action],
              exc: BaseException) -> None:
        if a is None:
            raise ExecutionError(f"the run of schedule '{schedule.name}' failed: "
                                 f"{type(exc).__name__}: {exc}\n{schedule.render()}") from exc
        stage = self.partition.stages[a.stage] if a.stage is not None else None
        ipu = self._ipu(a)
        where = (f"stream {ipu} (IPU {ipu}, {self.placement.device(ipu)}), stage "
                 f"{'-' if stage is None else stage.index}"
                 f"{'' if stage is None else ' ' + str(list(stage.blocks))}, micro-batch "
                 f"{'-' if a.microbatch is None else a.microbatch}")
        raise ExecutionError(
            f"action {a} ({a.kind.name.lower()}) failed on {where}: {type(exc).__name__}: {exc}\n"
            f"schedule '{schedule.name}', failing row marked:\n{schedule.render(mark_row=row)}",
            location=where) from exc


def _identity(t):
    return t
