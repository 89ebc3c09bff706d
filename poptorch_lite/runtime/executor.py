"""Executor: runs a schedule's actions on a partition's stages.

The executor interprets a :class:`~poptorch_lite.runtime.schedule.Schedule`: each
stream gets its action list and runs it on its worker, waiting only for the
actions on other streams that it depends on ([Note: streams]). It has one
dispatch on the action kind and holds no scheduling logic.

The reduction and the update are ``update``'s ([Note: gradient arithmetic],
[Note: commit point]).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ..compiler import rng
from ..compiler.lowered import Lowered
from ..compiler.partition import Partition
from . import after_step
from .channels import Channels, Messages
from ..errors import Error, ExecutionError, UnrecoverableError
from ..profiling.timeline import Recorder
from .gpu import copy_out_all
from .inputs import InputPlacement
from .placement import Placement
from .plan import Call, Plan, make_plan
from .schedule import Action, Kind, Schedule
from .run import Run
from .stage_work import StageWork, WorkState
from .streams import ActionFailed, ActionStuck, StreamFailed, on_caller
from .update import PartialUpdate, StepArithmetic, Update, overlappable, sparse_gradients
from .weights import Weights


class Executor:
    """Runs schedules over the stages of one partition.

    Args:
        partition: the stages; lowered: their lowered form, what the stages run ([Note:
            lowered stages] in ``compiler/lowered``).
        placement: devices and streams of their IPUs.
        weights: the tensors the stages compute with.
        processes: the replicas in other processes, whose gradients the step
            all-reduces with this one's (None: one process; ``distributed``).
        channels: the messages to the stages that other processes run (None: every
            stage runs here; [Note: stages in other processes] in ``distributed``).

    Example:
        See ``wrapper.PoplarExecutor``, which builds one per traced input signature.
    """

    def __init__(self, partition: Partition, lowered: Lowered, placement: Placement,
                 weights: Weights, processes=None, channels: Optional[Channels] = None):
        self.partition = partition
        self.processes = processes
        self.channels = channels
        self.placement = placement
        self.weights = weights
        self.work = StageWork(lowered, placement, weights,
                              channels.remote_inputs if channels is not None else None)
        self.random = any(st.random for st in partition.stages)
        # The stages this process runs (all of them unless a pipeline spans processes).
        self.local = [st.ipu in placement.devices for st in partition.stages]
        self.step_ipu = next(st.ipu for st in partition.stages if self.local[st.index])
        self.broken: Optional[str] = None  # why messages to other processes went astray
        # The parameters whose gradient each stage reduces: those it is the first here to use.
        self.owned = [[] for _ in partition.stages]
        seen: set = set()
        for st in partition.stages:
            for name in st.param_names if self.local[st.index] else ():
                if name not in seen:
                    seen.add(name)
                    self.owned[st.index].append(name)
        # Where a buffer that the model returns is read: the IPU of its first user.
        self.buffer_ipu = {}
        for st in partition.stages:
            for name in st.inputs:
                if name.startswith("buffer:"):
                    self.buffer_ipu.setdefault(name.split(":", 1)[1], st.ipu)
        self.gpu = placement.gpu  # [Note: the GPU seam] in ``gpu``
        # The IPUs whose actions are timed on the GPU, and where each IPU reads the inputs.
        self.gpu_ipus = placement.gpu_ipus
        self.inputs = InputPlacement(lowered.stages, self.local, placement,
                                     weights.separate_memories)
        # The parameters this process steps (all of them unless stages run elsewhere).
        here = {n for st in partition.stages if self.local[st.index] for n in st.param_names}
        stepped = {n: p for n, p in weights.params.items() if n in here}
        self._failure_lock = threading.Lock()
        # The reduction and the update ([Note: gradient arithmetic], [Note: commit point]).
        overlapped = overlappable(stepped, weights, lowered.stages) \
            if processes is not None and channels is None else None
        self.update = Update(weights, self.owned, stepped, channels, processes, self._describe,
                             self._result, overlapped, sparse_gradients(partition.stages)
                             if processes is not None else frozenset())
        self.undoable = False   # the caller snapshots whole calls (allOrNothingCalls)
        self.handlers = {Kind.FORWARD: self.work.forward, Kind.BACKWARD: self.work.backward,
                         Kind.BACKWARD_INPUT: self.work.backward_input,
                         Kind.BACKWARD_WEIGHT: self.work.backward_weight,
                         Kind.RECOMPUTE: self.work.recompute_action,
                         Kind.REDUCE: self.update.reduce, Kind.STEP: self.update.step}
        self._plans: dict = {}
        self._launched = False  # the caller's thread launches every GPU action (``launched``)
        self.names = [o for o in partition.outputs if isinstance(o, str)]  # returned values
        self.made_on_gpu = frozenset(name for st in partition.stages
                                     if self.local[st.index] and st.ipu in self.gpu_ipus
                                     for name in st.outputs if name in self.names)

    def run(self, schedule: Schedule, microbatches: Sequence[Sequence[torch.Tensor]],
            replica_of: Callable, step: Optional[StepArithmetic],
            recorder: Optional[Recorder] = None, run_index: int = 0,
            watchdog: Optional[float] = None, keep: Optional[Sequence[bool]] = None,
            base: Optional[int] = None) -> tuple:
        """Run ``schedule`` over ``microbatches`` (the tensor leaves of each).

        Args:
            schedule: the grid to run; ``schedule.num_microbatches == len(microbatches)``.
            microbatches: per micro-batch, its tensor leaves (``input:k`` values).
            replica_of: micro-batch index -> the replica it belongs to.
            step: the optimizer step's arithmetic, for training schedules.
            recorder: where to record each action's span (None: not recorded).
            run_index: this run's number within the call, for the recorder.
            watchdog: seconds without progress before the run is declared stuck.
            keep: per micro-batch, whether its outputs are returned (None: all);
                only those are copied to the host.
            base: the base of the micro-batches' random streams (``rng.draw_bases``;
                None: drawn here, when the stages have random ops).

        Returns:
            ``(outputs, stats)``: per micro-batch, the model's tensor outputs
            (detached, on the host; None for a micro-batch not kept), and the
            run's :class:`~poptorch_lite.runtime.run.RunStats`.

        Raises:
            ExecutionError: an action failed or got stuck; names stream, stage,
                micro-batch and action and shows the grid with the failing row marked.
        """
        with self.open_call(schedule, step, recorder, watchdog) as call:
            return self.run_call(call, microbatches, replica_of, run_index, keep, base)

    def open_call(self, schedule: Schedule, step: Optional[StepArithmetic],
                  recorder: Optional[Recorder] = None, watchdog: Optional[float] = None,
                  guarded: bool = False) -> Call:
        """A call's runs of ``schedule``, set up once ([Note: one setup per call] in ``plan``):
        ``with ex.open_call(...) as call: ex.run_call(call, microbatches, replica_of, index, keep,
        base)`` for each run (arguments and result as :meth:`run`'s). ``guarded``: a wrapper's
        call, which holds the host gradients while it trains ([Note: host gradients] in
        ``weights``) and a Ctrl-C while a step runs (``update.CtrlC``).

        Raises:
            ExecutionError: an earlier call left this model's processes out of step.
        """
        if self.broken is not None:
            raise ExecutionError(
                f"this model's processes went out of step in an earlier call ({self.broken}): "
                f"messages between them may be half delivered, so no further call can run; "
                f"restart every process (from the last checkpoint: poptorch_lite.load_checkpoint)")
        return Call(self._plan(schedule), step, recorder, watchdog,
                    self.weights if guarded and schedule.training else None,
                    self.update if guarded else None)

    def run_call(self, call: Call, microbatches: Sequence[Sequence[torch.Tensor]],
                 replica_of: Callable, run_index: int = 0, keep: Optional[Sequence[bool]] = None,
                 base: Optional[int] = None, watch: Optional[Callable] = None) -> tuple:
        """One run of ``call``'s schedule (:meth:`run`'s arguments and result; ``watch``:
        action -> a context its launch runs in, where the caller's thread launches them)."""
        streams = None
        if self.random:  # [Note: micro-batch RNG]
            base = rng.draw_base() if base is None else base
            streams = [rng.Stream(rng.microbatch_seed(base, i)) for i in range(len(microbatches))]
        begun = self.placement.begin() if self.gpu_ipus else None  # before the inputs' copies
        run = self.start_run(call, microbatches, replica_of, streams, run_index, keep)
        try:
            spans = self._launch(call, run, begun, watch)
        finally:
            self.update.end_run()
        for a, span in spans.items() if call.recorder is not None else ():  # [Note: GPU timeline]
            call.recorder.add_gpu(self._ipu(a), a.stage, a.microbatch, a.kind.value, *span,
                                  run_index)
        if self.channels is not None:  # weights returned, values of data-dependent shape,
            self.channels.share_outputs(run, self.names, self._result, self.weights)
            self.channels.share_edited(run)  # and the call's arguments written in place
        return self.outputs(run), run.work.stats

    def start_run(self, call: Call, microbatches: Sequence[Sequence[torch.Tensor]],
                  replica_of: Callable, streams: Optional[list], run_index: int = 0,
                  keep: Optional[Sequence[bool]] = None, placed: Optional[dict] = None) -> Run:
        """The state of a run of ``call``'s schedule, ready to launch: its inputs placed
        (``placed``: where a captured step reads them, instead of copies of them), the
        gradients cleared.

        Args:
            streams: per micro-batch, its random stream (None: the stages draw nothing);
                the other arguments are :meth:`run`'s.
        """
        schedule = call.plan.schedule
        run = Run(microbatches, replica_of, streams, WorkState(len(self.partition.stages)),
                  Messages() if self.channels is not None else None, run_index,
                  schedule.training,
                  list(range(len(microbatches))) if keep is None else
                  list(itertools.compress(range(len(microbatches)), keep)),
                  call.plan.ahead)
        if placed is None:
            self.inputs.place(run)
        else:
            run.placed.update(placed)
        if schedule.training:
            self.weights.zero_grads()
            self.update.begin_run(call.plan, call.step, len(microbatches))
            after_step.forget(self.weights)  # [Note: after-step averages]: this run's only
            if self.work.measures():  # only the stash's byte count reads it: skip the storages
                run.work.excluded = self.weights.storages() | {
                    t.untyped_storage().data_ptr() for t in (
                        *(t for mb in microbatches for t in mb), *run.placed.values())}
        return run

    def capture_run(self, call: Call, run: Run, into, step_in_graph: bool) -> None:
        """Record ``run``'s actions into the CUDA graph being captured on the stream ``into``,
        with the launch loop that ran the program's warm-up runs (``Placement.run_in_order``),
        the optimizer's step among them where ``step_in_graph``; nothing runs, so no step is
        counted ([Note: step graphs] in ``step_graph``).

        Raises:
            Exception: what an action raised while being captured, with a note of the action.
        """
        plan = call.plan
        pairs = [(ipu, a) for ipu, a in plan.ordered if step_in_graph or a.kind is not Kind.STEP]
        update = self.update
        applied = update.steps_applied
        try:
            self.placement.run_in_order(pairs, plan.waits.__getitem__,
                                        self._actor(run, call.step, None), into=into)
        except ActionFailed as failure:
            failure.exc.add_note(f"poptorch_lite: raised by action {failure.action} while its "
                                 f"step was captured")
            raise failure.exc from None
        finally:
            update.steps_applied = applied  # nothing ran: a replay counts its step

    def replayed(self, call: Call, run: Run, step_in_graph: bool) -> list:
        """After a replay of ``run``'s captured actions: count its step (applied in the graph,
        or taken now, eagerly), and the outputs as :meth:`run` returns them."""
        if call.step is not None:
            if step_in_graph:
                self.update.steps_applied += 1
                self.weights.stepped_on_device()
            else:
                self.update.step(call.plan.step, run, call.step)
        return self.outputs(run)

    def _launch(self, call: Call, run: Run, begun: Optional[dict],
                watch: Optional[Callable] = None) -> dict:
        """Run ``run``'s actions as ``call``'s plan says (:meth:`run`'s spans and errors)."""
        plan, step, recorder = call.plan, call.step, call.recorder
        schedule, lists, waits, rows = plan.schedule, plan.lists, plan.waits, plan.rows
        channels = self.channels
        spans: dict = {}
        try:
            if plan.here is not None:  # the caller's thread runs it all
                self._run_here(call, run)
            elif plan.launch is not None:  # the caller's thread launches it all on the GPU
                spans = self.placement.run_in_order(plan.launch, waits.__getitem__,
                                                    self._actor(run, step, recorder),
                                                    begun=begun, watch=watch)
            else:
                spans = self.placement.run_lists(lists, waits.__getitem__,
                                                 self._actor(run, step, recorder),
                                                 call.watchdog, plan.in_order, begun)
            if channels is not None:
                self._settle(schedule, run, rows, run.index)
        except StreamFailed as failed:
            ipu = failed.ipu
            raise ExecutionError(
                f"the run of schedule '{schedule.name}' failed on stream {ipu} (IPU {ipu}, "
                f"{self.placement.device(ipu)}) with an error the GPU reported only when the "
                f"run waited for it: {type(failed.exc).__name__}: {failed.exc}. CUDA reports a "
                f"kernel's failure late, so it came from one of that stream's actions "
                f"({', '.join(str(a) for a in lists[ipu])}); run with the environment variable "
                f"CUDA_LAUNCH_BLOCKING=1 to have the action that launched it raise it",
                location=f"stream {ipu}") from failed.exc
        except ActionFailed as failure:
            if channels is not None:  # a message went astray, or Ctrl-C: out of step
                self.broken = f"{failure.action}: {type(failure.exc).__name__}"
            if not isinstance(failure.exc, Exception):  # KeyboardInterrupt, SystemExit
                failure.exc.add_note(f"poptorch_lite: raised by action {failure.action}")
                raise failure.exc from None
            self._fail(schedule, rows[failure.action], failure.action, failure.exc, run.index)
        except ActionStuck as stuck:
            if channels is not None:
                self.broken = "the watchdog fired"
            a = next(iter(stuck.running.values()), None)
            self._fail(schedule, rows.get(a), a, TimeoutError(
                f"no action finished for {stuck.seconds} s (Options.watchdogTimeout); "
                f"still running: {', '.join(str(x) for x in stuck.running.values()) or 'none'}"),
                run.index)
        return spans

    def _run_here(self, call: Call, run: Run) -> None:
        """Run the plan's actions in order on the caller's thread ([Note: streams] in
        ``placement``), inside the call's thread count and grad mode.

        Raises:
            ActionFailed: an action raised (KeyboardInterrupt and SystemExit go through,
                with a note of the action).
        """
        a = where = None
        step, recorder, handlers = call.step, call.recorder, self.handlers
        try:
            if recorder is None:
                for a, where in call.plan.here:
                    handlers[a.kind](a, run, step)
            else:
                clock, records, index = time.perf_counter, recorder.records, run.index
                for a, where in call.plan.here:
                    start = clock()
                    handlers[a.kind](a, run, step)
                    records.append((*where, start, clock(), index))
        except BaseException as exc:
            raised = on_caller(a, where[0] if where else None, exc)
            if raised is exc:
                raise
            raise raised from None

    def _actor(self, run: Run, step: Optional[StepArithmetic],
               recorder: Optional[Recorder]) -> Callable:
        """What a stream's worker calls for each action of ``run``: its handler in the run's
        grad mode (exchanging messages across processes), its span recorded."""
        training, handlers, channels = run.training, self.handlers, self.channels
        timed = () if recorder is None else self.gpu_ipus  # [Note: GPU timeline]
        # Inference mode is per thread too: an inference call made in it (Lightning validates
        # so) runs its stages in it, as plain PyTorch's forward runs there.
        inference = torch.inference_mode if (
            not training and channels is None and torch.is_inference_mode_enabled()) else None

        def act(a: Action) -> None:
            start = time.perf_counter()
            if inference is not None:
                with inference():
                    handlers[a.kind](a, run, step)
            elif torch.is_grad_enabled() == training and channels is None:
                handlers[a.kind](a, run, step)  # already in the run's grad mode: no context
            else:
                with torch.set_grad_enabled(training):  # grad mode is per thread
                    if channels is None:
                        handlers[a.kind](a, run, step)
                    else:
                        self._exchange(a, run, step)
            if recorder is not None:
                ipu = self._ipu(a)
                if ipu not in timed:
                    recorder.add(ipu, a.stage, a.microbatch, a.kind.value, start,
                                 time.perf_counter(), run.index)
        return act

    # -- stages in other processes --------------------------------------------------------

    def _exchange(self, a: Action, run: Run, step: Optional[StepArithmetic]) -> None:
        """An action of a pipeline that spans processes: receive what it needs, compute
        (nothing once this process failed, except the update's agreement), send what it made
        ([Note: stages in other processes] in ``distributed``)."""
        channels = self.channels
        channels.before(a, run)
        channels.post(run.ahead.get(a), run)  # the stream's next receives, while it computes
        if a.kind is Kind.STEP:  # the agreement first; a failure here is the processes' own
            self.handlers[a.kind](a, run, step)
        elif run.messages.failed is None:
            try:
                self.handlers[a.kind](a, run, step)
            except Exception as exc:  # the others run on; every process stops at the update
                with self._failure_lock:
                    if run.messages.failed is None:
                        run.messages.failed = (a, exc)
        channels.after(a, run)

    def _describe(self, run: Run) -> Optional[str]:
        """What failed in this process this run, for the others' errors."""
        if run.messages.failed is None:
            return None
        a, exc = run.messages.failed
        return (f"action {a} ({a.kind.name.lower()}) failed on "
                f"{self._where(a, run.index, run.training)}: {type(exc).__name__}: {exc}")

    def _settle(self, schedule: Schedule, run: Run, rows: dict, run_index: int) -> None:
        """After a run's lists: wait for its messages, agree on its outcome (inference; a
        training run agreed in its update), and raise where any process failed."""
        try:
            self.channels.finish(run)
            if not schedule.training:
                run.messages.remote_failure = self.channels.settle(run, self._describe(run),
                                                                   self._result)
        except Error as exc:  # a message to or from another process went astray: out of step
            self.broken = f"the end of the run: {type(exc).__name__}"
            self._fail(schedule, None, None, exc, run_index)
        if run.messages.failed is not None:
            a, exc = run.messages.failed
            self._fail(schedule, rows[a], a, exc, run_index)
        if run.messages.remote_failure is not None:
            rank, text = run.messages.remote_failure
            raise ExecutionError(
                f"process {rank} failed this run of schedule '{schedule.name}', so process "
                f"{self.processes.rank} stopped with it: {text}. No process applied this run's "
                f"step", location=f"process {rank}")

    def launched(self) -> None:
        """From now on the caller's thread launches every action on the GPU streams, in row
        order, where workers would run the streams' lists: a program whose steps are captured
        runs its warm-up runs with the launches it captures ([Note: step graphs] in
        ``step_graph``)."""
        self._launched = True
        self._plans.clear()

    def _plan(self, schedule: Schedule) -> Plan:
        """How this process runs ``schedule`` (``plan.make_plan``, cached per schedule)."""
        plan = self._plans.get(id(schedule))
        if plan is None or plan.schedule is not schedule:
            plan = self._plans[id(schedule)] = make_plan(
                schedule, self.placement, self._ipu, self._here, self.channels, self._launched)
        return plan

    def _ipu(self, a: Action) -> int:
        """The IPU (stream) that runs ``a``; the update runs on this process's first."""
        return self.partition.stages[a.stage].ipu if a.stage is not None else self.step_ipu

    def _here(self, a: Action) -> bool:
        """Whether this process runs ``a`` (the update runs in every process)."""
        return a.stage is None or self.local[a.stage]

    # -- results and failures -------------------------------------------------------------

    def outputs(self, run: Run) -> list:
        """Per micro-batch, its returned values on the host (None where not kept); a small
        value a GPU computed in one copy for all the kept micro-batches (``gpu.copy_out_all``)."""
        kept, results = run.kept, run.results
        for (i, k), edited in run.edited.items():  # [Note: edited arguments] in stage_work
            run.inputs[i][k].copy_(edited)
        out = [None] * len(run.inputs)
        for i in kept:
            out[i] = []
        for name in self.names:
            copied = (copy_out_all([results[i].get(name) for i in kept])
                      if len(kept) > 1 and name in self.made_on_gpu else None)
            if copied is not None:
                for i, value in zip(kept, copied):
                    out[i].append(value)
            else:
                for i in kept:
                    out[i].append(self._result(run, i, name))
        return out

    def _result(self, run: Run, i: int, name: str) -> torch.Tensor:
        if name in run.results[i]:
            v = run.results[i][name]
        else:
            kind, key = name.split(":", 1)
            if kind == "input":
                v = run.inputs[i][int(key)]
            elif kind == "param":
                v = self.weights.home(key).detach().clone()
            elif key in self.buffer_ipu:
                v = self.weights.buffer(key, run.replica_of(i), self.buffer_ipu[key]).detach().clone()
            else:
                v = self.weights.buffers[key].detach().clone()
        return v if v.is_cpu else v.cpu()  # after the run: the GPU is idle

    def _where(self, a: Action, run_index: int, training: bool) -> str:
        """Where ``a`` ran: process (when stages span processes), stream, stage, micro-batch."""
        stage = self.partition.stages[a.stage] if a.stage is not None else None
        ipu = self._ipu(a)
        process = f"process {self.processes.rank}, " if self.channels is not None else ""
        return (f"{process}stream {ipu} (IPU {ipu}, {self.placement.device(ipu)}), stage "
                f"{'-' if stage is None else stage.index}"
                f"{'' if stage is None else ' ' + str(list(stage.blocks))}, micro-batch "
                f"{'-' if a.microbatch is None else a.microbatch}"
                f"{f' of device iteration {run_index}' if training else ''}")

    def _fail(self, schedule: Schedule, row: Optional[int], a: Optional[Action],
              exc: BaseException, run_index: int = 0) -> None:
        if a is None:
            raise ExecutionError(f"the run of schedule '{schedule.name}' failed: "
                                 f"{type(exc).__name__}: {exc}\n{schedule.render()}") from exc
        where = self._where(a, run_index, schedule.training)
        if isinstance(exc, PartialUpdate) and not self.undoable:  # [Note: commit point]
            raise UnrecoverableError(
                f"action {a} ({a.kind.name.lower()}) failed on {where}: the optimizer's step "
                f"raised part-way ({exc}), so parameters and optimizer state may be half "
                f"updated and cannot be put back; reload the last checkpoint "
                f"(poptorch_lite.load_checkpoint) or the weights you saved, and fix the optimizer. "
                f"Options.allOrNothingCalls(True) snapshots every call so that even this can "
                f"be undone") from exc.exc
        if isinstance(exc, PartialUpdate):
            exc = exc.exc
        raise ExecutionError(
            f"action {a} ({a.kind.name.lower()}) failed on {where}: {type(exc).__name__}: {exc}\n"
            f"schedule '{schedule.name}', failing row marked:\n{schedule.render(mark_row=row)}",
            location=where) from exc
