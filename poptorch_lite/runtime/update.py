"""The reduction and the update: the arithmetic of one optimizer step, and where it commits.

[Note: gradient arithmetic]
Autograd sums the gradients of all micro-batches (accumulation steps and
replicas run in turn) into ``.grad``, or, with an accumulator dtype (the
optimizer's ``accum_type``, e.g. float32 for bfloat16 parameters), into an
accumulator of that dtype after each backward. The reduction of stage s
(``sG``) divides that sum once by ``loss_scaling`` (undoing the scaled loss)
and by ``StepArithmetic.divisor``: for ``ReductionType.Mean`` the number of
micro-batches ``G·R``; for ``Sum`` 1. With ``inputReplicaGrouping(g)`` the g
replicas of a group share one input, so each micro-batch run stands for g of
them: Mean divides by ``G·R/g`` and Sum by ``1/g``. With several processes the
update first sums a weight used by stages in several processes over them, then
all-reduces each gradient over the P data-parallel replicas of its stage (Mean:
/P; ``distributed``). It then clips to ``max_grad_norm`` if finite (the norm of the
parameters the optimizer holds, over a pipeline's processes), then calls
``optimizer.step()`` on the parameters' homes ([Note: weight homes] in ``weights``).
After a training call the host parameters' ``.grad`` are the user's again; the
gradient each last step used stays on its home ([Note: host gradients] in ``weights``).

[Note: commit point]
Parameters and optimizer state change only in the update action (``U``), the
last action of a run. A run that fails before it changes neither; the
update counts the updates that completed (``steps_applied``), so the wrapper
knows how far a failed call got. An optimizer step that raises part-way
leaves parameters or optimizer state half-updated: that is an
``UnrecoverableError`` (reload a checkpoint), unless the wrapper took a full
snapshot (``Options.allOrNothingCalls(True)``) and can undo the whole call.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Optional

import _signal  # signal's C half: the same handlers, without signal's enum conversions

import torch
import torch.optim.optimizer as torch_optimizer  # its global step hooks

from ..optim import precision
from ..optim.loss_scale import LossScale
from ..optim.optimizers import Optimizer as PopTorchOptimizer
from . import after_step
from .schedule import Action
from .run import Run

_SIGINT = int(signal.SIGINT)


@dataclasses.dataclass
class StepArithmetic:
    """The numbers of one optimizer step ([Note: gradient arithmetic]).

    Attributes:
        optimizer: the optimizer to step.
        loss_scale: the loss scale ([Note: loss scaling]); the update action
            adapts it when it is automatic, so later runs of a call use the new one.
        divisor: what the summed micro-batch gradients are divided by (besides
            the loss scaling) to give the reduced gradient.
        max_grad_norm: clip the global gradient norm to this (inf: no clipping).
        accum_dtype: accumulate gradients in this dtype (None: the parameter's).
        check_loss: stop at a non-finite loss (``Training.stopOnNonFiniteLoss``).
    """

    optimizer: torch.optim.Optimizer
    loss_scale: LossScale = dataclasses.field(default_factory=LossScale)
    divisor: float = 1
    max_grad_norm: float = math.inf
    accum_dtype: Optional[torch.dtype] = None
    check_loss: bool = False

    @property
    def loss_scaling(self) -> float:
        """The factor the loss is multiplied by before backward, now."""
        return self.loss_scale.scale


class PartialUpdate(Exception):
    """The optimizer's step raised part-way ([Note: commit point]); ``.exc`` is what it raised."""

    def __init__(self, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.exc = exc


class Update:
    """The ``sG`` (reduce) and ``U`` (update) actions of one executor's runs, and the count of
    the updates that completed ([Note: commit point]).

    Args:
        weights: the tensors the stages compute with; owned: per stage, the parameters it
            reduces; stepped: name -> the parameters this process steps.
        channels, processes: the executor's (None: every stage and replica runs here).
        describe: run -> what failed in this process that run, or None; result: the
            executor's value of ``(run, micro-batch, name)`` (both for other processes).

    Attributes:
        steps_applied: the updates completed; ctrl_c: the call's :class:`CtrlC` on the main
            thread, else None.
    """

    def __init__(self, weights, owned: list, stepped: dict, channels, processes, describe,
                 result, overlapped: Optional[dict] = None, sparse: frozenset = frozenset()):
        self.weights, self.owned, self._stepped = weights, owned, stepped
        self.channels, self.processes = channels, processes
        self._describe, self._result = describe, result
        self.steps_applied = 0
        self.ctrl_c: Optional[CtrlC] = None
        # [Note: overlapped all-reduce]: the parameters it may overlap, and its buckets
        self._overlapped, self._overlap = overlapped, None
        self.sparse = sparse  # the parameters whose gradients are sparse (sparse_gradients)

    def begin_run(self, plan, step: Optional[StepArithmetic], microbatches: int) -> None:
        """A training run starts: its gradient all-reduce overlaps the backward where it can
        ([Note: overlapped all-reduce] in ``distributed/overlap``)."""
        if self._overlapped is None or step is None or plan.split or \
                self.processes.layout.pipelines < 2:
            return
        trainable = {n: p for n, p in self._overlapped.items() if p.requires_grad}
        if step.accum_dtype is not None and any(p.dtype != step.accum_dtype
                                                for p in trainable.values()):
            return  # gradients move to accumulators after each backward
        shards = self.processes.shards(step.optimizer)
        if shards is not None:  # the sharded step reduce-scatters the optimizer's own
            held = {id(p) for g in step.optimizer.param_groups for p in g["params"]}
            trainable = {n: p for n, p in trainable.items() if id(p) in held}
        if not trainable:
            return
        overlap = self._overlap
        if overlap is None or overlap.params.keys() != trainable.keys() or \
                (shards is not None and overlap.reducer is not shards) or \
                not overlap.hooked_last():  # a user's hook registered since: ours after it
            if overlap is not None:
                overlap.remove()
            overlap = self._overlap = self.processes.overlap(
                trainable, shards, frozenset(id(p) for n, p in trainable.items()
                                             if n in self.sparse))
        overlap.begin(microbatches, step.loss_scaling * step.divisor)

    def guard_call(self) -> None:
        """A call begins: on the main thread, a Ctrl-C is held while a step runs
        ([Note: commit point]; :class:`CtrlC`)."""
        self.ctrl_c = CtrlC.install()

    def unguard_call(self, ended_normally: bool) -> None:
        """The call ended: Python's handler is back (a Ctrl-C it swallowed raises now:
        :meth:`CtrlC.uninstall`)."""
        guard, self.ctrl_c = self.ctrl_c, None
        if guard is not None:
            guard.uninstall(ended_normally)

    def release(self) -> None:
        """The program is dropped: its hooks leave the parameters."""
        if self._overlap is not None:
            self._overlap.remove()
            self._overlap = None

    def end_run(self) -> None:
        """A run ended (its update took the overlap's gradients, or it failed)."""
        if self._overlap is not None:
            self._overlap.end()

    def reduce(self, a: Action, run: Run, step: StepArithmetic) -> None:
        """``sG``: stage ``a.stage``'s gradients, summed over the micro-batches, reduced."""
        # [Note: gradient arithmetic] sum over micro-batches -> mean (or sum), unscaled.
        divisor = step.loss_scaling * step.divisor
        if divisor == 1 and not run.work.accum and not self.weights.shared():
            return  # the sum is the reduced gradient, already where the optimizer reads it
        overlap = self._overlap
        final = overlap.final if overlap is not None and overlap.active else ()
        for name in self.owned[a.stage]:
            if name in final:  # reduced as its backward made it: [Note: overlapped all-reduce]
                continue
            held = run.work.accum.pop(name, None)
            if held is not None:  # divide in the accumulator's dtype, then cast once
                p, acc = held
                p.grad = (acc.div_(divisor) if divisor != 1 else acc).to(p.dtype)
                self.weights.gather_grad(name)
                continue
            grad = self.weights.gather_grad(name)
            if grad is not None and divisor != 1:
                grad.div_(divisor)

    def step(self, a: Action, run: Run, step: StepArithmetic) -> None:
        """``U``: the optimizer's step, whole or not begun (with other processes: all of
        them, or none)."""
        if self.channels is not None:  # [Note: stages in other processes]: all step, or none
            run.messages.remote_failure = self.channels.settle(run, self._describe(run),
                                                               self._result)
            if run.messages.failed is not None or run.messages.remote_failure is not None:
                return
        guard = self.ctrl_c  # [Note: commit point]: a step is whole, or not begun
        if guard is None:
            self._commit(step)
            return
        guard.in_step = True
        try:
            self._commit(step)
        finally:
            guard.in_step = False
        guard.raise_held()

    def _commit(self, step: StepArithmetic) -> None:
        # Inside stepping(), the host parameters stand for their homes ([Note: weight homes]).
        weights = self.weights
        averages = after_step.take(weights)  # [Note: after-step averages], checked first
        with weights.stepping():
            stepped = self._update(step)
            after_step.apply(weights, averages)  # the teacher follows, stepped or not
        if stepped or averages:
            weights.after_step()
        self.steps_applied += 1  # a skipped step counts as taken

    def _update(self, step: StepArithmetic) -> bool:
        """The step on the homes: [Note: gradient arithmetic] clip, then one optimizer update;
        False where [Note: loss scaling] skips it (automatic loss scaling found a non-finite
        gradient)."""
        weights = self.weights
        if self.channels is not None:  # a weight used in several processes: one gradient
            self.channels.reduce_tied(weights.params)
        shards = self.processes.shards(step.optimizer) if self.processes is not None else None
        if shards is not None:  # [Note: sharded optimizer state] in distributed/sharding.py
            return self._sharded_update(step, shards)
        if self.processes is not None:  # [Note: replicas across processes] global gradient first
            self.processes.all_reduce_grads(self._stepped, self._overlap)
        spread = self.channels is not None  # the stages' gradients are in several processes
        if step.loss_scale.automatic:  # one sync per step
            params = [p for p in weights.params.values() if p.grad is not None]
            bad = torch.stack([(~torch.isfinite(p.grad)).any().to(params[0].device)
                               for p in params]).sum().cpu() if params else torch.zeros(())
            if spread:  # a non-finite gradient in any of the pipeline's processes
                bad = self.processes.pipeline_sum(bad.reshape(1).float())[0]
            if not step.loss_scale.update(not bool(bad)):
                return False
        if math.isfinite(step.max_grad_norm):
            held = _held(weights.params, step.optimizer)
            if spread:  # the global norm, over the pipeline's processes
                self.channels.clip_grad_norm_(held, step.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in held.values() if p.grad is not None], step.max_grad_norm)
        try:  # [Note: commit point]: from here parameters and optimizer state change
            step.optimizer.step()
        except Exception as exc:
            raise PartialUpdate(exc) from exc
        return True

    def _sharded_update(self, step: StepArithmetic, shards) -> bool:
        """:meth:`_update` with each process stepping its chunks of the state: the same
        arithmetic on the reduced gradients' chunks, then the weights gathered."""
        held = _held(self.weights.params, step.optimizer)
        stepped = {n: p for n, p in self._stepped.items() if n in held}
        self.processes.reduce_scatter_grads(stepped, shards, self._overlap)
        if step.loss_scale.automatic:
            bad = torch.tensor([float(shards.nonfinite())])
            if self.channels is not None:  # in any of the pipeline's processes
                bad = self.processes.pipeline_sum(bad)
            if not step.loss_scale.update(not bool(bad[0])):
                return False
        if math.isfinite(step.max_grad_norm):
            if self.channels is not None:  # the global norm, over the pipeline's processes
                norms = shards.norms()
                shards.scale(self.channels.clip_coefficient(held, step.max_grad_norm, {
                    n: norms[id(p)] for n, p in stepped.items() if id(p) in norms}))
            else:
                shards.clip(step.max_grad_norm)
        if shards.anchored:  # what Gradient___ anchors read: the step's gradient, whole
            shards.gather_grads([p for n, p in stepped.items() if n in shards.anchored])
        try:  # [Note: commit point]: from here parameters and optimizer state change
            shards.step_whole(step.optimizer)
        except Exception as exc:
            raise PartialUpdate(exc) from exc
        return True


class CtrlC:
    """A SIGINT handler for one call on the main thread: Ctrl-C raises KeyboardInterrupt at
    once, as Python's own handler does, except inside an update, where it is held until the
    step is counted and then raised (:meth:`raise_held`).

    An update on the caller's thread (a run on one stream, or Sequential) is where Ctrl-C
    lands: raised inside ``optimizer.step()`` it left some parameters or momenta updated and
    others not, with nothing to put them back from (``benchmarks/soak.py`` found it). Held,
    it leaves the model as after that step, as a Ctrl-C anywhere else leaves it as after the
    last completed one. Installed once per call (two ``signal.signal`` calls, about 1 µs),
    not per step; only over Python's own handler (a user's stays in force), and only on the
    main thread (a worker's update is never interrupted: the caller stops the workers before
    their next action).

    A KeyboardInterrupt raised where Python swallows exceptions (a finalizer or weakref
    callback that a freed tensor ran, reported as "Exception ignored in ...") would let the
    call run on as if no Ctrl-C came: a call that ends normally after one was raised raises
    it again at its end, with a note, the model as after the call's last step."""

    __slots__ = ("in_step", "held", "raised")  # one per call: no ``__dict__`` made

    def __init__(self):
        self.in_step = False
        self.held = False
        self.raised = False

    def __call__(self, signum, frame) -> None:
        if self.in_step:
            self.held = True
            return
        self.raised = True
        raise KeyboardInterrupt

    def raise_held(self) -> None:
        if self.held:
            self.held = False
            raise KeyboardInterrupt

    @staticmethod
    def install() -> Optional["CtrlC"]:
        """Install a handler for a call and return it, or None where none is installed (not
        on the main thread, or over a user's handler); :meth:`uninstall` when the call ends.
        ``_signal``'s functions, not ``signal``'s: those wrap each call in enum conversions,
        15 µs a call's three against 1 µs (a tenth of a small step's tax on a 2-core CPU).
        Which thread is the main one is Python's own rule: ``signal`` refuses a handler from
        any other (ValueError), with no thread looked up when it is the main one."""
        if _signal.getsignal(_SIGINT) is not signal.default_int_handler:
            return None
        guard = CtrlC()
        try:
            _signal.signal(_SIGINT, guard)
        except ValueError:  # not the main thread (of the main interpreter)
            return None
        return guard

    def uninstall(self, ended_normally: bool) -> None:
        """Put Python's handler back; a call that ended normally after its Ctrl-C was
        swallowed raises it now.

        Raises:
            KeyboardInterrupt: a Ctrl-C landed where it was swallowed, in a call that then
                ended normally.
        """
        _signal.signal(_SIGINT, signal.default_int_handler)
        if self.raised and ended_normally:
            exc = KeyboardInterrupt()
            exc.add_note("poptorch_lite: a Ctrl-C during the call was swallowed where it "
                         "landed (a finalizer or callback that ignores exceptions), so the call "
                         "ran to its end; raised here, with the model as after the call")
            raise exc


def _held(params: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The model's parameters (name -> parameter) that ``optimizer`` steps, in its groups'
    order: what clipping takes the norm of. PopART clips the weights it updates, so a
    parameter outside the groups keeps its gradient and adds nothing; and the order is the
    one a plain loop over ``optimizer.param_groups`` (Lightning's, for one) hands
    ``clip_grad_norm_``, which sums the norms in it."""
    names = {id(p): n for n, p in params.items()}
    return {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]
            if id(p) in names}


def graph_refusal(step: StepArithmetic) -> Optional[str]:
    """Why the optimizer's step of ``step`` cannot be captured in a CUDA graph, or None where
    it can ([Note: step graphs] in ``step_graph``).

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> graph_refusal(StepArithmetic(torch.optim.SGD(net.parameters(), lr=0.1))) is None
        True
        >>> graph_refusal(StepArithmetic(torch.optim.Adam(net.parameters())))[:39]
        'Adam was built with capturable=False, w'
    """
    opt = step.optimizer
    name = type(opt).__name__
    if step.loss_scale.automatic:
        return "automatic loss scaling decides on the host whether each step applies"
    if (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks):
        return "the optimizer has step hooks, whose Python runs at every step"
    if isinstance(opt, PopTorchOptimizer) and precision.differs(opt):
        return (f"{name} keeps its state in dtypes of its own (PopTorch's accumulator types), "
                f"stepped by poptorch_lite's Python")
    if isinstance(opt, torch.optim.SGD) or (
            opt.param_groups and all(g.get("capturable") for g in opt.param_groups)):
        return None
    if "capturable" in opt.defaults:
        return (f"{name} was built with capturable=False, which keeps its step count on the "
                f"host; build it with capturable=True to capture its step")
    return (f"{name}'s step is not known to be graph-safe (SGD's is, and that of torch's "
            f"optimizers built with capturable=True)")


def check_loss(loss: torch.Tensor, i: int) -> None:
    """``Training.stopOnNonFiniteLoss(True)``: a non-finite loss stops the call (a debugging aid)."""
    if not bool(torch.isfinite(loss).all()):
        value = loss.item() if loss.numel() == 1 else loss.detach().cpu().tolist()
        raise FloatingPointError(
            f"the loss of micro-batch {i} is {value}, not finite, so its gradients would be "
            f"too; check that micro-batch's inputs and the learning rate, or, for float16, "
            f"turn on opts.Training.setAutomaticLossScaling(True), which skips such steps "
            f"(opts.Training.stopOnNonFiniteLoss(False) lets such losses through, as PopTorch does)")


def overlappable(stepped: dict, weights, stages) -> Optional[dict]:
    """The stepped parameters whose all-reduce may overlap the backward, or None where that
    does not apply to this program ([Note: overlapped all-reduce] in ``distributed/overlap``):
    each must be its own home on the CPU and a leaf of exactly one graph of the lowered
    ``stages`` (one backward adds into it a micro-batch).

    Example:
        >>> import types
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> weights = types.SimpleNamespace(shared=lambda: False, offload=False,
        ...                                 home=lambda name: p)
        >>> stage = types.SimpleNamespace(recompute=False, param_names=("w",))
        >>> overlappable({"w": p}, weights, [stage]) == {"w": p}, overlappable(
        ...     {"w": p}, weights, [stage, stage])
        (True, None)
    """
    if not stepped or weights.shared() or weights.offload:
        return None
    for name, p in stepped.items():
        if weights.home(name) is not p or p.device.type != "cpu" or _graphs(name, stages) != 1:
            return None
    return dict(stepped)


def sparse_gradients(stages) -> frozenset:
    """The names of the parameters whose gradients are sparse: the weight of an op of the
    partition's ``stages`` traced with ``sparse=True`` (``Embedding`` and ``EmbeddingBag``
    with ``sparse=True``, or their functional forms), as DDP expects a sparse gradient of such
    a module's weight. The processes' gradient all-reduce sums them as sparse tensors, each
    on its own ([Note: overlapped all-reduce] in ``distributed/overlap``).

    Example:
        >>> import types
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda w, i: torch.nn.functional.embedding(i, w, sparse=True))(
        ...     torch.zeros(4, 2), torch.tensor([1]))
        >>> stage = types.SimpleNamespace(module=graph, inputs=("param:emb.weight", "input:0"))
        >>> sorted(sparse_gradients([stage]))
        ['emb.weight']
    """
    names = set()
    for st in stages:
        nodes = st.module.graph.nodes
        param_of = {node: value.split(":", 1)[1] for node, value in zip(
            (n for n in nodes if n.op == "placeholder"), st.inputs) if value.startswith("param:")}
        for node in nodes:
            schema = getattr(node.target, "_schema", None)
            if schema is None or all(a.name != "sparse" for a in schema.arguments):
                continue
            given = {a.name: node.args[k] if k < len(node.args)
                     else node.kwargs.get(a.name, a.default_value)
                     for k, a in enumerate(schema.arguments)}
            if given.get("sparse") is True and given.get("weight") in param_of:
                names.add(param_of[given["weight"]])
    return frozenset(names)


def _graphs(name: str, stages) -> int:
    """How many graphs of ``stages`` take parameter ``name``: a stage is one graph, a
    recomputed stage one per segment that reads it."""
    key = f"param:{name}"
    return sum(sum(key in seg.inputs for seg in st.segments) if st.recompute
               else name in st.param_names for st in stages)
