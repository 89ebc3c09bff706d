"""Stage work: one stage's forward, recompute and backward of one micro-batch.

The executor dispatches a schedule's F, R and B actions here; this module owns the
autograd boundary between stages and the activation stash; a recompute rebuilds with
``recompute``.

[Note: autograd boundary]
A stage's inputs that another stage computed arrive detached and, when the
producer's value requires grad, as fresh leaves that require grad (a stage that
writes such an input in place gets a clone of the leaf, so the gradient still
reaches the leaf and the producer's value stays intact). Backward of a stage
is ``torch.autograd.backward(outputs, grad_tensors)`` with the gradients its
consumers left for its outputs (the loss gets the loss-scaling factor);
afterwards the gradients of its boundary inputs go upstream.

[Note: activation stash]
Each stage keeps a FIFO of :class:`Entry`, one per micro-batch forwarded and
not yet backwarded; the schedule runs each stage's backwards in forward order,
so the head is always the micro-batch a backward needs. Without recomputation
an entry holds the stage's autograd graph (its saved activations); with it,
only what recomputation starts from: the boundary inputs, the values at the
stage's ``recomputationCheckpoint`` cuts, the pre-forward values of buffers the
stage writes, and the micro-batch's random state. The run records each
stage's peak depth and peak bytes (distinct storages, parameters and the
call's inputs excluded), so tests can hold a schedule to its promise. With a
split backward an entry stays counted from its I to its W, with the output
gradients its W starts from and, for a recomputed stage, the activations its
recompute rebuilt, which W's graph holds ([Note: split backward] in
``split_backward``).

[Note: buffers written in forward]
A stage that writes a buffer in place (``self.queue.copy_(t)``, ``t`` carrying a
gradient) writes through a detached alias of it: the write lands in the buffer's
storage and the alias carries the micro-batch's autograd history, so a read later
in the same forward backpropagates into ``t`` as in plain PyTorch, while the
buffer itself stays a tensor without history. Otherwise the next micro-batch's
write would chain its graph to this one's, already freed by its backward
("backward through the graph a second time"). A buffer is state, not a weight:
a later micro-batch (or call) reads its value, never its history; plain PyTorch
would fail, or leak gradients across micro-batches, where a later micro-batch
reads it with gradients on. What the stage's own later ops and later stages read
is a snapshot taken after the last write ([Note: state across stages] in
compiler/state), which the next micro-batch's write leaves alone.

[Note: edited arguments]
A forward that writes an argument in place (``x += 1``) edits the caller's tensor once
per call, as plain PyTorch does (the trace undoes its own write). Each micro-batch's
stage writes a copy of its rows (views of one tensor share a version counter, which
would fail an earlier micro-batch's backward in a pipeline); the executor copies them
back into the caller's tensor after the run, from whichever memory the stage ran in. A
recompute starts from the value before the write, as for a written buffer. Where the
pipeline spans processes, the process that runs the writing stage broadcasts the written
rows to the others after each run (``Channels.share_edited``), since plain PyTorch writes
the argument of every process.

Recomputation: [Note: recomputation] in ``recompute``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from typing import Optional, Sequence

import torch

from ..compiler import rng
from ..compiler.compiled_stages import CompiledGraph
from ..compiler.lowered import Lowered
from ..errors import Error
from . import recompute
from .inputs import memory_copy
from .placement import Placement
from .run import Entry, Run, RunStats
from .schedule import Action
from .split_backward import backward_input, backward_weight, compiled_input, run_backward
from .update import check_loss
from .streams import arrive
from .weights import Weights


class WorkState:
    """The stage work's state in one run ([Note: activation stash]): per stage its stash, the
    entries between a split backward's I and W, the bytes they hold and the run's peaks
    (``stats``); the gradient accumulators of an accumulator dtype (parameter name ->
    ``(parameter, accumulator)``), which the reduction takes; and the storages that no stash
    counts (``excluded``)."""

    __slots__ = ("stash", "waiting", "nbytes", "stats", "accum", "excluded")

    def __init__(self, stages: int):
        self.stash = list(map(collections.deque, itertools.repeat((), stages)))  # no frame
        self.waiting = list(map(collections.deque, itertools.repeat((), stages)))
        self.nbytes = [0] * stages                          # the bytes each stash holds now
        self.stats = RunStats([0] * stages, [0] * stages)
        self.accum: dict = {}
        self.excluded: frozenset | set = _NOTHING


_NOTHING: frozenset = frozenset()


class StageWork:
    """The F, R and B actions of a partition's stages.

    Args:
        partition: the stages.
        placement: devices of their IPUs.
        weights: the tensors the stages compute with.
        recompute: per stage, whether it is recomputed ([Note: recomputation]).
    """

    def __init__(self, lowered: Lowered, placement: Placement, weights: Weights,
                 remote_inputs: Optional[Sequence[frozenset]] = None):
        # The compile step's tables and graphs ([Note: lowered stages] in compiler/lowered).
        self.stages = lowered.stages
        self.producer, self.wanted, self.loss = lowered.producer, lowered.wanted, lowered.loss
        self.replica_values = lowered.replica_values
        self.any_recompute = any(st.recompute for st in self.stages)
        self.placement = placement
        self.gpu = placement.gpu  # [Note: the GPU seam] in ``gpu``
        self.weights = weights
        # Per stage, its inputs that another process computes: they arrive in the run's
        # inbox, and their gradients leave by its outbox ([Note: stages in other processes]).
        self.remote = list(remote_inputs or [frozenset()] * len(self.stages))
        # Per stage, the parameters' tensors, looked up on its first forward.
        self._params: list = [None] * len(self.stages)
        # Per stage, its device when that is a GPU (None: not here, or not a GPU).
        self.gpu_device = [placement.devices[st.ipu] if st.ipu in placement.devices
                           and self.gpu.is_gpu(placement.devices[st.ipu]) else None
                           for st in self.stages]
        # Per stage, the bytes one micro-batch's stash entry holds without recomputation,
        # measured with a saved-tensor hook on the first forward (a Python hook on every
        # saved tensor would otherwise take the GIL in every backward).
        self._entry_bytes: dict = {}
        # Per recomputed stage, the bytes its recompute rebuilds beyond what the entry kept
        # (the activations of one micro-batch), measured on its first recompute the same way:
        # a split backward holds them from I until W.
        self._rebuilt_bytes: dict = {}
        # Per (stage, segment) of a compiled split backward, its parameters by argument
        # position (what its W halves add their gradients to).
        self._graph_params: dict = {}
        # Per (stage, segment) of an eager split backward, where its split falls, found on the
        # first micro-batch (``split_backward.SplitPlan``).
        self._split_plans: dict = {}

    def args(self, s: int, run: Run, i: int, device: torch.device) -> tuple:
        """Stage s's arguments for micro-batch i, and its boundary leaves ([Note: autograd boundary])."""
        st = self.stages[s]
        ipu, weights, separate = st.ipu, self.weights, self.weights.separate_memories
        args = self._params[s]
        if args is None:  # a parameter's tensor on an IPU never changes once placed
            args = self._params[s] = [weights.param(key, ipu) if kind in ("param", "value")
                                      else None for _, kind, key in st.sources]
        args, boundary = list(args), {}
        received = run.messages.inbox.pop((s, i), {}) if self.remote[s] else {}
        for at, name, kind, key, edited in st.varying:
            if kind == "buffer":
                v = weights.buffer(key, run.replica_of(i), ipu)
                if name in st.written:  # [Note: buffers written in forward]
                    v = v.detach()
            elif kind == "value":  # [Note: per-replica variables] in ``replica_groups``
                v = args[at][self.replica_values[key][run.replica_of(i)]]
            elif kind == "input":  # placed in this IPU's memory when the run began
                v = run.placed.get((ipu, i, key)) if run.placed else None
                if v is None:
                    v = run.inputs[i][key]
                ready = run.ready.get((device, i)) if run.ready else None
                if ready is not None:  # its copy to this GPU, enqueued by the caller
                    self.gpu.current_stream(device).wait_event(ready)
                if edited:  # [Note: edited arguments]
                    v = run.edited[i, key] = memory_copy(v)
            else:  # computed by an earlier stage: [Note: autograd boundary]
                produced = received[name] if name in received else run.values[i][name]
                v = self.gpu.arrive(produced.detach(), device)  # [Note: values crossing streams]
                if separate and self.producer[name] != ipu and v.device == produced.device:
                    v = memory_copy(v)  # useIpuModel: into another IPU's memory
                if torch.is_grad_enabled() and produced.requires_grad:
                    v.requires_grad_(True)
                    boundary[name] = v
                if edited:  # written in place: leave the producer's value
                    v = memory_copy(v)
            args[at] = v
        return args, boundary

    def forward(self, a: Action, run: Run, step) -> None:
        """``sFi``: run the stage, hand its outputs on, stash what its backward needs."""
        s, i = a.stage, a.microbatch
        st = self.stages[s]
        args, boundary = self.args(s, run, i, self.placement.devices[st.ipu])
        stream = run.rng[i] if run.rng is not None and st.random else None
        if not torch.is_grad_enabled():  # inference
            with rng.use(stream):
                self._keep_outputs(st, run, i, st.module(*args))
            return
        entry = Entry(i, boundary)
        counted: dict = {}
        if st.recompute:  # [Note: recomputation]
            entry.args = args
            entry.rng = stream.snapshot() if stream is not None else None
            entry.buffers = {n: memory_copy(args[st.inputs.index(n)].detach())
                             for n in st.written_state}  # as plain PyTorch's view lies
            env = dict(zip(st.inputs, args))
            with rng.use(stream), recompute.dropping():
                for seg in st.segments:
                    env.update(zip(seg.outputs, seg.module(*[env[n] for n in seg.inputs])))
            entry.kept = {n: (env[n].detach(), env[n].requires_grad) for n in st.cuts}
            outs = tuple(env[n] for n in st.outputs)
            for t in (*boundary.values(), *(v for v, _ in entry.kept.values()),
                      *entry.buffers.values()):
                self._count(t, counted, run.work.excluded)
            entry.nbytes = sum(counted.values())
        else:
            measure = s not in self._entry_bytes  # once: every micro-batch has the same shapes
            if measure:
                # The hook lives on in the graph's saved tensors: a split backward
                # (zero_bubble) leaves the input half's nodes retained until the run ends, and
                # a hook that held this object or the run would make a cycle through
                # autograd's graph that Python's collector cannot see (the wrapper, its
                # placement and workers leaked). Nor may it return the tensor: a node saving
                # its own output would hold itself through the grad_fn for ever (soak.py:
                # zero_bubble wrappers leaked them).
                def pack(t: torch.Tensor, count=StageWork._count, excluded=run.work.excluded):
                    count(t, counted, excluded)
                    return t.detach()
                with rng.use(stream), torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                    outs = st.module(*args)
            elif stream is not None:
                with rng.use(stream):
                    outs = st.module(*args)
            else:
                outs = st.module(*args)
            entry.segments = [(outs, st.outputs, {})]
            if measure:
                for t in boundary.values():
                    self._count(t, counted, run.work.excluded)
                self._entry_bytes[s] = sum(counted.values())
            entry.nbytes = self._entry_bytes[s]
        if st.loss_at is not None and step.check_loss:  # opt-in: a sync per micro-batch
            check_loss(outs[st.loss_at], i)
        self._keep_outputs(st, run, i, outs)
        stash = run.work.stash[s]
        stash.append(entry)
        held = run.work.nbytes[s] = run.work.nbytes[s] + entry.nbytes
        stats = run.work.stats
        depth = len(stash) + len(run.work.waiting[s])  # with those between I and W
        if depth > stats.peak_stash_depth[s]:
            stats.peak_stash_depth[s] = depth
        if held > stats.peak_stash_bytes[s]:
            stats.peak_stash_bytes[s] = held

    def measures(self) -> bool:
        """Whether a forward will count stash bytes (then ``WorkState.excluded`` must be set)."""
        return self.any_recompute or len(self._entry_bytes) < len(self.stages)

    @staticmethod
    def _count(t: torch.Tensor, counted: dict, excluded: set) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            counted[ptr] = storage.nbytes()

    def _keep_outputs(self, st, run: Run, i: int, outs: tuple) -> None:
        values, wanted = run.values[i], self.wanted
        for name, o in zip(st.outputs, outs):
            values[name] = o
            if name in wanted and i in run.keeps:  # only returned values are read
                run.results[i][name] = o.detach()
        if self.gpu_device[st.index] is not None:
            self.gpu.made(outs, self.gpu_device[st.index])

    def _head(self, a: Action, run: Run) -> Entry:
        entry = run.work.stash[a.stage][0]
        if entry.i != a.microbatch:
            raise Error(f"stage {a.stage}'s stash holds micro-batch {entry.i} where {a} needs "
                        f"{a.microbatch}: the schedule broke FIFO order")
        return entry

    def recompute_action(self, a: Action, run: Run, step) -> None:
        """``sRi``: rebuild the stash head's graph from what it kept ([Note: recomputation]
        in ``recompute``), counting the bytes it holds the first time."""
        st = self.stages[a.stage]
        entry = self._head(a, run)
        measure = a.stage not in self._rebuilt_bytes  # once, as for the forward's entry
        counted: dict = {}
        if measure:  # what the entry already counts is not counted again
            held = {t.untyped_storage().data_ptr() for t in (
                *entry.boundary.values(), *(v for v, _ in entry.kept.values()))}

            def pack(t: torch.Tensor, count=StageWork._count, excluded=run.work.excluded | held):
                count(t, counted, excluded)
                return t.detach()  # as in forward(): no cycle through a saved output
        with (torch.autograd.graph.saved_tensors_hooks(pack, _identity) if measure
              else contextlib.nullcontext()):
            entry.segments = recompute.rebuild(st, entry)
        entry.args, entry.kept, entry.buffers = None, None, None
        if measure:
            self._rebuilt_bytes[a.stage] = sum(counted.values())

    def backward(self, a: Action, run: Run, step) -> None:
        """``sBi``: backward of the stash head, segment by segment; input gradients go upstream.

        ``step`` is the executor's ``StepArithmetic`` (loss scaling, accumulator dtype).
        """
        self._backward(a, run, step, split=False)

    def backward_input(self, a: Action, run: Run, step) -> None:
        """``sIi``: as ``sBi`` but only the input gradients; the entry waits for its W
        ([Note: split backward] in ``split_backward``)."""
        self._backward(a, run, step, split=True)

    def backward_weight(self, a: Action, run: Run, step) -> None:
        """``sWi``: the weight gradients of the oldest entry whose I ran; frees its graph."""
        waiting = run.work.waiting[a.stage]
        if not waiting or waiting[0].i != a.microbatch:
            raise Error(f"{a} found no input-gradient half of micro-batch {a.microbatch} "
                        f"waiting: the schedule broke I-before-W order")
        entry = waiting.popleft()
        for deferred in entry.later:
            backward_weight(deferred)
        entry.later = None
        run.work.nbytes[a.stage] -= entry.nbytes
        if step.accum_dtype is not None:
            self._accumulate(a.stage, run, step.accum_dtype)

    def _backward(self, a: Action, run: Run, step, split: bool) -> None:
        st = self.stages[a.stage]
        entry = self._head(a, run)
        run.work.stash[a.stage].popleft()
        if split:  # still held: counted until its W
            run.work.waiting[a.stage].append(entry)
            entry.later = []
            params = [p for p in self._params[a.stage] if p is not None]
        else:
            run.work.nbytes[a.stage] -= entry.nbytes
        i = entry.i
        grads_in, gpu = run.grads[i], self.gpu_device[a.stage]
        crossing = st.crossing if self.weights.separate_memories else ()
        pending: dict = {}  # value name -> gradient from a later segment's leaf
        for k in range(len(entry.segments) - 1, -1, -1):
            outs, names, leaves = entry.segments[k]
            tensors, grads = [], []
            for name, o in zip(names, outs):
                g = grads_in.pop(name, None)
                if g is not None:  # made by a later stage: [Note: values crossing streams]
                    g = self.gpu.arrive(g, o.device if gpu is None else gpu)
                    if name in crossing:
                        g = memory_copy(g)  # useIpuModel: back into this IPU's memory
                if name == self.loss:
                    seed = torch.full_like(o, step.loss_scaling)  # loss scaling: the one place
                    g = seed if g is None else g + seed
                later = pending.pop(name, None)
                if later is not None:
                    g = later if g is None else g + later
                if g is not None and o.requires_grad:
                    tensors.append(o)
                    grads.append(g)
            compiled = None
            if split and tensors:  # a compiled graph is split once, when it compiled
                graph = st.segments[k].module if st.recompute else st.module
                compiled = graph if isinstance(graph, CompiledGraph) and graph.fns else None
            if compiled is not None and compiled.split is not None:
                entry.later += self._split_compiled(compiled, tensors, grads, a.stage, k)
            elif split and tensors and compiled is None:
                entry.later.append(backward_input(
                    tensors, grads, [*leaves.values(), *entry.boundary.values()], params,
                    self._split_plans.setdefault((a.stage, k), [])))
            elif tensors:  # (a compiled graph with no weight half: its I runs it whole)
                run_backward(tensors, grads)
            if leaves:
                _collect_grads(leaves, pending)
        values = run.values[i]
        for name in st.outputs:
            values.pop(name, None)
        boundary, remote = entry.boundary, self.remote[a.stage]
        if remote:  # to the stages of other processes: [Note: stages in other processes]
            run.messages.outbox[a.stage, i] = {n: boundary[n].grad for n in remote if n in boundary}
            boundary = {n: leaf for n, leaf in boundary.items() if n not in remote}
        if boundary:
            _collect_grads(boundary, grads_in)  # input gradients go upstream
            if gpu is not None:
                self.gpu.made([grads_in[n] for n in boundary if n in grads_in], gpu)
        if split:  # the output gradients W starts from are held until then too, and what
            # a recompute rebuilt (the autograd graph that W still runs on)
            kept = sum(d.nbytes() for d in entry.later) + self._rebuilt_bytes.get(a.stage, 0)
            entry.nbytes += kept
            held = run.work.nbytes[a.stage] = run.work.nbytes[a.stage] + kept
            if held > run.work.stats.peak_stash_bytes[a.stage]:
                run.work.stats.peak_stash_bytes[a.stage] = held
        elif step.accum_dtype is not None:
            self._accumulate(a.stage, run, step.accum_dtype)

    def _split_compiled(self, graph, tensors: list, grads: list, s: int, k: int) -> list:
        """I of a compiled graph whose backward is split (``split_backward.compiled_input``),
        told where segment k's parameters are (by argument position)."""
        params = self._graph_params.get((s, k))
        if params is None:
            st = self.stages[s]
            names = st.segments[k].inputs if st.recompute else st.inputs
            params = self._graph_params[s, k] = [
                self.weights.param(n.split(":", 1)[1], st.ipu) if at in graph.weights else None
                for at, n in enumerate(names)]
        return compiled_input(graph.split, tensors, grads, params)

    def _accumulate(self, s: int, run: Run, dtype: torch.dtype) -> None:
        """Move this backward's gradients into accumulators of ``dtype`` ([Note: gradient
        arithmetic]); a weight with a post-accumulate hook keeps summing in ``.grad``, in its
        own dtype, as in plain PyTorch, where the hook edits the running sum."""
        ipu = self.stages[s].ipu
        for name in self.stages[s].exclusive:
            p = self.weights.param(name, ipu)
            if p.grad is None or p.grad.dtype == dtype or p._post_accumulate_grad_hooks:
                continue
            held = run.work.accum.get(name)
            g = p.grad.to(dtype)
            run.work.accum[name] = (p, g if held is None else held[1].add_(g))
            p.grad = None


def _identity(t):
    return t


def _collect_grads(leaves: dict, into: dict) -> None:
    """Add each leaf's ``.grad`` to ``into[name]`` (on the leaf's device)."""
    for name, leaf in leaves.items():
        if leaf.grad is not None:
            prev = into.get(name)  # another stage's: [Note: values crossing streams]
            into[name] = leaf.grad if prev is None else arrive(prev, leaf.grad.device) + leaf.grad
