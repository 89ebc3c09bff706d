"""Programs: what one input signature of a wrapped model compiles to, and its runs.

A :class:`Program` is the compile step's product ([Note: the compile step] in
``compiling``): the partition, the executor that runs its stages, and its schedules, one
per micro-batch count. :meth:`Program.run` runs one call: D runs of the schedule when
training (an optimizer step each), one otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Optional

import torch

from ..compiler import backward_hooks, rng
from ..compiler.partition import Partition
from ..enums import ReductionType
from ..optim.accepted import accum_dtype, max_grad_norm
from ..options.options import Options
from ..profiling.timeline import Recorder
from .batch import MicroBatches
from .executor import Executor
from .replica_groups import every_replica
from .schedule_kinds import build
from .undo import capture
from .update import CtrlC, StepArithmetic
from .weights import Weights


class Program:
    """What one input signature compiles to: the partition, its executor, its schedules."""

    def __init__(self, partition: Partition, executor: Executor, kind, recompute: tuple,
                 compiled=None, graph=None):
        self.partition = partition
        self.executor = executor
        self.kind = kind
        self.recompute = recompute
        # What its stages' graphs became under compileStages (``compiled_stages``), or None.
        self.compiled = compiled
        # Its captured step on a GPU under compileStages (``step_graph.StepGraph``), or None.
        self.graph = graph
        # The model's own generators its stages draw from ([Note: a user's generator]).
        self.generators = tuple(g for g, _, _ in rng.user_generators(partition.stages).values())
        # The parameters several stages use, whose gradient hooks a call refuses.
        self.shared = backward_hooks.stages_sharing(partition.stages)
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
        (buffers, the loss scale, the model's own generators) and puts it back if the run fails before its
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
        # One interface, two implementations: the executor's eager run, or the step graph's
        # replay, which warms up with and captures that same run ([Note: step graphs]).
        run_call = (self.graph if self.graph is not None else ex).run_call
        grads = weights.host_grads_kept() if training else contextlib.nullcontext()
        if training:  # a hook registered on a parameter since the last call reaches its copies
            weights.share_hooks()
        with grads, ex.open_call(schedule, step, recorder, options.watchdog_timeout) as call, \
                collection_paused(), CtrlC.installed() as ex.update.ctrl_c:
            for d, ks in enumerate(runs):
                undo = capture(weights, None, loss_scale, False, rng=False,
                               generators=self.generators) if per_run else None
                before = ex.update.steps_applied
                weights.buffers_move()
                try:
                    inputs, kept_here = tensors[ks.start:ks.stop], keep[ks.start:ks.stop]
                    out, run_stats = run_call(call, inputs, replica_of, d, kept_here, bases[d])
                except BaseException:
                    committed = ex.update.steps_applied != before
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
