"""Executor: runs a schedule's actions on a partition's stages.

The executor interprets a :class:`~poptorch_lite.schedule.Schedule` row by row
and has one dispatch on the action kind; it holds no scheduling logic.

[Note: autograd boundary]
A stage's inputs that another stage computed arrive detached and, when the
producer's value requires grad, as fresh leaves that require grad (a stage that
writes such an input in place gets a clone of the leaf, so the gradient still
reaches the leaf and the producer's value stays intact). Backward of
a stage is ``torch.autograd.backward(outputs, grad_tensors)`` with the
gradients its consumers left for its outputs (the loss gets the loss-scaling
factor); afterwards the gradients of its boundary inputs go upstream. Each
stage keeps a FIFO stash of what its backward needs, in micro-batch order.

[Note: gradient arithmetic]
Autograd sums the gradients of all micro-batches (accumulation steps and
replicas run in turn) into ``.grad``. The reduction of stage s (``sG``)
divides that sum once by ``loss_scaling`` (undoing the scaled loss) and by
``StepArithmetic.divisor``: for ``ReductionType.Mean`` the number of
micro-batches ``G·R``; for ``Sum`` 1. With ``inputReplicaGrouping(g)`` the g
replicas of a group share one input, so each micro-batch run stands for g of
them: Mean divides by ``G·R/g`` and Sum by ``1/g``. The update
(``U``) clips to ``max_grad_norm`` if finite, then calls ``optimizer.step()``.
After a training call, each parameter's ``.grad`` holds the gradient its last
step used.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch

from .errors import Error, ExecutionError
from .partition import Partition
from .placement import Placement, Weights
from .schedule import Action, Kind, Schedule


@dataclasses.dataclass
class StepArithmetic:
    """The numbers of one optimizer step ([Note: gradient arithmetic]).

    Attributes:
        optimizer: the optimizer to step.
        loss_scaling: the factor the loss is multiplied by before backward.
        divisor: what the summed micro-batch gradients are divided by (besides
            the loss scaling) to give the reduced gradient.
        max_grad_norm: clip the global gradient norm to this (inf: no clipping).
    """

    optimizer: torch.optim.Optimizer
    loss_scaling: float = 1.0
    divisor: float = 1
    max_grad_norm: float = math.inf


class _Run:
    """The state of one run of a schedule: values, stashes and gradients per micro-batch."""

    def __init__(self, partition: Partition, microbatches: Sequence[Sequence[torch.Tensor]],
                 replica_of: Callable):
        S = partition.num_stages
        self.inputs = microbatches
        self.replica_of = replica_of
        self.values = [dict() for _ in microbatches]      # value name -> tensor, per micro-batch
        self.grads = [dict() for _ in microbatches]       # value name -> gradient, per micro-batch
        self.results = [dict() for _ in microbatches]     # returned values, detached
        self.stash = [collections.deque() for _ in range(S)]  # per stage: (i, boundary, outputs)


class Executor:
    """Runs schedules over the stages of one partition.

    Args:
        partition: the stages.
        placement: devices and streams of their IPUs.
        weights: the tensors the stages compute with.

    Example:
        See ``wrapper.PoplarExecutor``, which builds one per traced input signature.
    """

    def __init__(self, partition: Partition, placement: Placement, weights: Weights):
        self.partition = partition
        self.placement = placement
        self.weights = weights
        # Each stage's inputs as (name, kind, key), parsed once: [Note: partition] names them.
        self.sources = [[(n, *n.split(":", 1)) for n in st.inputs] for st in partition.stages]
        # The parameters whose gradient each stage reduces: those it is the first to use.
        self.owned = [[] for _ in partition.stages]
        seen: set = set()
        for st in partition.stages:
            for name in st.param_names:
                if name not in seen:
                    seen.add(name)
                    self.owned[st.index].append(name)
        self.wanted = {o for o in partition.outputs if isinstance(o, str)}
        self.handlers = {Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
                         Kind.REDUCE: self._reduce, Kind.STEP: self._step}

    def run(self, schedule: Schedule, microbatches: Sequence[Sequence[torch.Tensor]],
            replica_of: Callable, step: Optional[StepArithmetic]) -> list:
        """Run ``schedule`` over ``microbatches`` (the tensor leaves of each).

        Args:
            schedule: the grid to run; ``schedule.num_microbatches == len(microbatches)``.
            microbatches: per micro-batch, its tensor leaves (``input:k`` values).
            replica_of: micro-batch index -> the replica it belongs to.
            step: the optimizer step's arithmetic, for training schedules.

        Returns:
            Per micro-batch, the model's tensor outputs (detached, on the host).

        Raises:
            ExecutionError: an action failed; names stream, stage, micro-batch and
                action and shows the grid with the failing row marked.
        """
        p = self.partition
        run = _Run(p, microbatches, replica_of)
        if schedule.training:
            self.weights.zero_grads()
        for t, row in enumerate(schedule.rows):
            work = [(self._ipu(a), self._bind(a, run, step, schedule.training))
                    for a in row if a is not None]
            results = self.placement.run_row(work)
            for a, (_, exc) in zip([a for a in row if a is not None], results):
                if exc is not None:
                    self._fail(schedule, t, a, exc)
        self.placement.finish()
        out = []
        for i in range(len(microbatches)):
            out.append([self._result(run, i, o) for o in p.outputs if isinstance(o, str)])
        return out

    # -- dispatch -------------------------------------------------------------------------

    def _bind(self, a: Action, run: _Run, step: Optional[StepArithmetic], training: bool):
        handler = self.handlers.get(a.kind)
        if handler is None:
            raise Error(f"action {a} ({a.kind.name}) has no handler in this executor")

        def action():
            with torch.set_grad_enabled(training):  # grad mode is per thread
                return handler(a, run, step)
        return action

    def _ipu(self, a: Action) -> int:
        return self.partition.stages[a.stage if a.stage is not None else 0].ipu

    # -- actions --------------------------------------------------------------------------

    def _forward(self, a: Action, run: _Run, step) -> None:
        st = self.partition.stages[a.stage]
        i = a.microbatch
        device = self.placement.device(st.ipu)
        args, boundary = [], {}
        for name, kind, key in self.sources[a.stage]:
            if kind == "param":
                v = self.weights.param(key, device)
            elif kind == "buffer":
                v = self.weights.buffer(key, run.replica_of(i), device)
            elif kind == "input":
                v = run.inputs[i][int(key)].to(device)
            else:  # computed by an earlier stage: [Note: autograd boundary]
                produced = run.values[i][name]
                v = produced.detach().to(device)
                if torch.is_grad_enabled() and produced.requires_grad:
                    v.requires_grad_(True)
                    boundary[name] = v
                if name in st.written_inputs:  # written in place: leave the producer's value
                    v = v.clone()
            args.append(v)
        outs = st.module(*args)
        for name, o in zip(st.outputs, outs):
            run.values[i][name] = o
            if name in self.wanted:
                run.results[i][name] = o.detach()
        if torch.is_grad_enabled():
            run.stash[a.stage].append((i, boundary, outs))

    def _backward(self, a: Action, run: _Run, step: StepArithmetic) -> None:
        st = self.partition.stages[a.stage]
        i, boundary, outs = run.stash[a.stage].popleft()
        if i != a.microbatch:
            raise Error(f"stage {a.stage}'s stash holds micro-batch {i} where {a} needs "
                        f"{a.microbatch}: the schedule broke FIFO order")
        tensors, grads = [], []
        for name, o in zip(st.outputs, outs):
            g = run.grads[i].pop(name, None)
            if name == self.partition.loss:
                seed = torch.full_like(o, step.loss_scaling)  # loss scaling: the one place
                g = seed if g is None else g + seed
            if g is not None and o.requires_grad:
                tensors.append(o)
                grads.append(g.to(o.device))
            run.values[i].pop(name, None)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for name, leaf in boundary.items():  # input gradients go upstream
            if leaf.grad is not None:
                prev = run.grads[i].get(name)
                run.grads[i][name] = leaf.grad if prev is None else prev + leaf.grad.to(prev.device)

    def _reduce(self, a: Action, run: _Run, step: StepArithmetic) -> None:
        # [Note: gradient arithmetic] sum over micro-batches -> mean (or sum), unscaled.
        divisor = step.loss_scaling * step.divisor
        for name in self.owned[a.stage]:
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

    def _fail(self, schedule: Schedule, row: int, a: Action, exc: Exception) -> None:
        stage = self.partition.stages[a.stage] if a.stage is not None else None
        where = (f"stream {self._ipu(a)} (IPU {self._ipu(a)}, "
                 f"{self.placement.device(self._ipu(a))}), stage "
                 f"{'-' if stage is None else stage.index}"
                 f"{'' if stage is None else ' ' + str(list(stage.blocks))}, micro-batch "
                 f"{'-' if a.microbatch is None else a.microbatch}")
        raise ExecutionError(
            f"action {a} ({a.kind.name.lower()}) failed on {where}: {type(exc).__name__}: {exc}\n"
            f"schedule '{schedule.name}', failing row marked:\n{schedule.render(mark_row=row)}",
            location=where) from exc
