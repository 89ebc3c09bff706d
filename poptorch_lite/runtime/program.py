"""Programs: what one input signature of a wrapped model compiles to.

A wrapper compiles a program the first time it sees an input signature
(shapes, dtypes, structure): the model is traced and split into stages
(``partition``), the stages' IPUs get devices and streams (``placement``) and
their graphs are rewritten for those devices (``retarget``), every parameter
gets its home (``weights``), and an executor is built to run the program's
schedules (``executor``). Everything here is refused before any weight,
buffer, optimizer state or random state changes.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from typing import Optional

import torch

from ..compiler import retarget, rng, tracing
from ..compiler.partition import Partition, check_pipeline_minimums, partition
from .channels import Channels
from ..enums import ReductionType
from ..errors import OptionsError, hide_when_refused as __tracebackhide__
from ..optim.accepted import accum_dtype, max_grad_norm
from ..options.options import Options
from ..profiling.timeline import Recorder
from .batch import MicroBatches
from .executor import Executor
from .placement import Placement
from .replica_groups import every_replica
from .schedule_kinds import build
from .undo import capture
from .update import CtrlC, StepArithmetic
from .weights import Weights


class Program:
    """What one input signature compiles to: the partition, its executor, its schedules."""

    def __init__(self, partition: Partition, executor: Executor, kind, recompute: tuple):
        self.partition = partition
        self.executor = executor
        self.kind = kind
        self.recompute = recompute
        self._schedules: dict = {}

    def schedule(self, m: int, training: bool):
        """The (validated, cached) schedule for m micro-batches."""
        if (m, training) not in self._schedules:
            ipus = self.partition.stage_ipus()
            self._schedules[m, training] = build(self.kind, len(ipus), m, training, ipus,
                                                 self.recompute if training else None)
        return self._schedules[m, training]

    def run(self, mbs: MicroBatches, options: Options, training: bool, replicas: int,
            optimizer, loss_scale, weights: Weights, kept: set, per_run: bool = True,
            generator: Optional[torch.Generator] = None) -> tuple:
        """The runs of one call: D runs of G·R micro-batches, one optimizer step each, when
        training; one run of every micro-batch otherwise.

        With ``per_run``, each run first captures what its step does not commit
        (buffers, the loss scale) and puts it back if the run fails before its
        update ([Note: commit point]); the random state is put back as after the
        runs that committed.

        Args:
            mbs: the call's micro-batches; replicas: R, the replicas of this process
                that run in turn, one per input slice ([Note: batch layout]);
            kept: the micro-batches whose outputs are copied to the host;
            generator: the model's own random state (``Options.randomSeed``), or None.

        Returns:
            The outputs per micro-batch, and the call's record: (schedule, the runs'
            ``RunStats``, the timeline ``Recorder``).
        """
        D, R, G = options.device_iterations, replicas, options.Training.gradient_accumulation
        ex = self.executor
        g = options.replication_factor // R  # the replicas each micro-batch run stands for
        if training:  # G is 1 for inference models (refused otherwise at wrap time)
            schedule = self.schedule(G * R, True)
            # [Note: gradient arithmetic]: each micro-batch run stands for g replicas
            mean = options.Training.reduction_type == ReductionType.Mean
            step = StepArithmetic(
                optimizer, loss_scale, G * R if mean else 1 / g,
                max_grad_norm(optimizer), accum_dtype(optimizer),
                options.Training.stop_on_non_finite_loss)
            runs = [range(d * G * R, (d + 1) * G * R) for d in range(D)]
        else:  # one run of every micro-batch
            schedule, step, runs = self.schedule(D * R, False), None, [range(D * R)]
        recorder = Recorder(time.perf_counter())
        outputs, stats = [], []
        # The random state is captured once per call: the runs draw their bases together,
        # and a failure rewinds to the state after the runs that committed.
        rewind = rng.rewinder(generator) if per_run and ex.random else None
        bases = rng.draw_bases(len(runs), generator) if ex.random else [None] * len(runs)
        tensors = mbs.all_tensors()
        if g < options.input_group_size:  # [Note: per-replica variables] in replica_groups
            tensors = every_replica(tensors, D, G, R, options.input_group_size,
                                    options.input_group_type)

        def replica_of(j: int) -> int:  # micro-batch j of a run: [Note: batch layout]
            return j % R

        keep = [k in kept for k in range(len(tensors))]
        grads = weights.host_grads_kept() if training else contextlib.nullcontext()
        if training:  # a hook registered on a parameter since the last call reaches its copies
            weights.share_hooks()
        with grads, ex.call(schedule, step, recorder, options.watchdog_timeout) as call, \
                collection_paused(), CtrlC.installed() as ex.ctrl_c:
            for d, ks in enumerate(runs):
                undo = capture(weights, None, loss_scale, False, rng=False) if per_run else None
                before = ex.steps_applied
                weights.buffers_move()
                try:
                    out, run_stats = call.run(tensors[ks.start:ks.stop], replica_of, d,
                                              keep[ks.start:ks.stop], bases[d])
                except BaseException:
                    committed = ex.steps_applied != before
                    if undo is not None and not committed:
                        undo()
                    if rewind is not None:
                        rewind(d + committed)
                    raise
                finally:
                    weights.buffers_move()
                outputs += out
                stats.append(run_stats)
        return outputs, (schedule, stats, recorder)

    def describe(self, training: bool, D: int, R: int, G: int, b: int) -> str:
        """One line on what the program runs: stages, devices, schedule, the batch.

        Args:
            training: a training program; D, R, G: device iterations, the replicas in
                this process, gradient accumulation; b: the micro-batch size.
        """
        part, placement = self.partition, self.executor.placement
        stages = "; ".join(
            f"{st.index}: IPU {st.ipu} on {placement.device(st.ipu)}"
            if st.ipu in placement.devices else f"{st.index}: IPU {st.ipu} in another process"
            for st in part.stages)
        batch = (f"micro-batch {b} x gradientAccumulation {G} x replicas {R} = {b * G * R} per "
                 f"optimizer step, x deviceIterations {D} = {b * G * R * D} per call"
                 if training else
                 f"micro-batch {b} x replicas {R} x deviceIterations {D} = {b * R * D} per call")
        S = part.num_stages
        return (f"{'trainingModel' if training else 'inferenceModel'} compiled: {S} "
                f"stage{'s' if S > 1 else ''} ({stages}), schedule "
                f"{self.schedule(G * R if training else D * R, training).name}; {batch}")


def recomputed(options: Options, stage) -> bool:
    """Whether a stage is recomputed: its Stage's ``recompute()``, else autoRecomputation."""
    strategy = options.execution_strategy
    chosen = [strategy.stages[i].recompute_enabled for i in
              (strategy.stage_index(b) for b in stage.blocks) if i is not None]
    chosen = [c for c in chosen if c is not None]
    if chosen:
        return any(chosen)
    return options.auto_recomputation >= 3  # PopART's RecomputationType.Pipeline


@contextlib.contextmanager
def collection_paused():
    """No automatic garbage collection while a call runs. A collection runs the finalizers of
    the garbage it finds on the thread that happened to allocate, and CPython drops a Ctrl-C
    that lands in a finalizer ("Exception ignored in: <finalize object ...>
    KeyboardInterrupt"), so a call could run on past its Ctrl-C, and after it, a loop
    (``benchmarks/soak.py`` saw both). Collection resumes when the call ends; a caller that
    turned it off keeps it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def compile_program(model: torch.nn.Module, modes: dict, options: Options, training: bool,
                    mbs: MicroBatches, replicas: int, weights: Optional[Weights],
                    placement: Optional[Placement], processes,
                    replica_values: Optional[dict] = None) -> tuple:
    """Trace, split, place and plan the program of ``mbs``'s signature.

    Args:
        model: the user's model; modes: its modules' wrap-time train/eval flags.
        options: the wrapper's frozen options; training: a training wrapper.
        mbs: the call's micro-batches (micro-batch 0 is traced).
        replicas: the in-process replicas R / g (R with per-replica variables).
        weights, placement: the wrapper's, None before its first program.
        processes: the replicas in other processes (``distributed``), or None.
        replica_values: per-replica variables ([Note: per-replica variables] in
            ``replica_groups``), name -> each replica's value.

    Returns:
        ``(program, weights, placement)``: a program's weights and placement are
        the wrapper's, shared by all its programs (a new placement when a program
        uses IPUs the old one lacks).

    Raises:
        TraceError, BlockError, LossError, PipelineError, OptionsError: refused
            before any state changes.
    """
    keys: list = []  # the generated graphs' sources torch.fx keeps, forgotten with them
    try:
        with tracing.generated_sources(keys):
            made = _compiled(model, modes, options, training, mbs, weights, placement, replicas,
                             processes, replica_values)
    except BaseException:
        tracing.forget_sources(keys)
        raise
    weakref.finalize(made[0], tracing.forget_sources, keys)
    return made


def _compiled(model, modes, options, training, mbs, weights, placement, replicas, processes,
              replica_values):
    o = options
    a, kw = mbs.args_kwargs(0)
    part = partition(model, modes, a, kw, o.execution_strategy, training,
                     replica_values=replica_values)
    check_pipeline_minimums(part.num_stages, o.execution_strategy, training,
                            o.Training.gradient_accumulation, o.device_iterations)
    check_mapped(part, o.ipu_devices)
    P = processes.layout.pipelines if processes is not None else 1  # data-parallel processes
    if replicas * P > 1 and part.mutated_buffers and o.broadcast_buffers:
        raise OptionsError(
            f"PopTorch does not support broadcasting buffers. If your model is able to "
            f"tolerate buffers becoming out of sync between replicas, you can disable buffer "
            f"broadcasting using poptorch.Options.broadcastBuffers(False). (The model changes "
            f"buffers {sorted(part.mutated_buffers)} and replicationFactor is "
            f"{o.replication_factor}{f' in each of {P} processes' if P > 1 else ''}.)")
    spans = processes is not None and processes.layout.spans_processes
    if spans:
        check_process_layout(processes.layout, part)
    mine = [st for st in part.stages if not spans or processes.layout.runs(st.ipu)]
    if weights is None:
        weights = Weights(model, replicas, separate_buffers=not o.broadcast_buffers,
                          separate_memories=o.use_model,
                          offload=training and o.TensorLocations.offload_optimizer)
    ipus = {st.ipu for st in mine}
    if placement is None or not ipus <= set(placement.devices):
        if placement is not None:
            placement.close()
        placement = Placement(sorted(ipus), o.ipu_devices)
    # [Note: graphs on their devices]: a kernel a stage's device lacks asks for a trace
    # without CPU-only kernels; then every graph is rewritten for its device.
    if retarget.lacking(mine, placement.devices):
        part = partition(model, modes, a, kw, o.execution_strategy, training, generic=True,
                         replica_values=replica_values)
        mine = [part.stages[st.index] for st in mine]
    retarget.place(mine, placement.devices)
    weights.place(placement.devices, [(st.ipu, st.param_names) for st in mine])
    weights.place_buffers([(st.ipu, [n.split(":", 1)[1] for n in st.inputs
                                     if n.startswith("buffer:")]) for st in mine])
    recompute = tuple(recomputed(o, st) for st in part.stages) if training else ()
    channels = Channels(part, processes, {ipu: placement.device(ipu) for ipu in ipus}, training,
                        any(st.random for st in part.stages)) if spans else None
    program = Program(part, Executor(part, placement, weights, recompute, processes, channels),
                      o.execution_strategy.schedule, recompute)
    return program, weights, placement


def check_mapped(part: Partition, mapping) -> None:
    """Refuse a stage on an IPU that an explicit ``set_ipu_devices`` mapping leaves out.

    Without a mapping every IPU has a default device; with one, an IPU it does not
    name is a typo or a forgotten entry, not a request for the default.

    Raises:
        OptionsError: a block's IPU is not a key of ``Options.ipu_devices``.
    """
    if mapping is None:
        return
    missing = [st for st in part.stages if st.ipu not in mapping]
    if missing:
        blocks = "; ".join(f"IPU {st.ipu} (block{'s' if len(st.blocks) > 1 else ''} "
                           f"{', '.join(map(repr, st.blocks))})" for st in missing)
        raise OptionsError(
            f"Options.set_ipu_devices maps IPUs {sorted(mapping)} only, but the model places "
            f"blocks on {blocks}; give every IPU a device, e.g. opts.set_ipu_devices("
            f"{{{', '.join(f'{i}: {str(mapping[i])!r}' for i in sorted(mapping))}"
            f"{', ' if mapping else ''}{missing[0].ipu}: 'cpu'}}), or change the block's "
            f"ipu_id")


def check_process_layout(layout, part: Partition) -> None:
    """Refuse a pipeline over processes that leaves an IPU or a process without a place.

    Raises:
        OptionsError: an IPU the model uses is in no process of
            ``Options.Distributed.set_ipu_processes``, or a process runs no stage.
    """
    used = sorted(set(part.stage_ipus()))
    missing = [ipu for ipu in used if layout.position_of(ipu) is None]
    if missing:
        raise OptionsError(
            f"the model's stages run on IPUs {used}, but Options.Distributed.set_ipu_processes"
            f"({[list(ids) for ids in layout.ipu_processes]}) gives no process IPU"
            f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}; give every IPU "
            f"the model uses to a process")
    for j, ids in enumerate(layout.ipu_processes):
        if not set(ids) & set(used):
            raise OptionsError(
                f"process {j} of each pipeline runs IPU{'s' if len(ids) > 1 else ''} "
                f"{', '.join(map(str, ids))} (Options.Distributed.set_ipu_processes), but no "
                f"stage of the model runs there (its stages run on IPUs {used}); give it a "
                f"stage or leave it out, with one process fewer per pipeline")
