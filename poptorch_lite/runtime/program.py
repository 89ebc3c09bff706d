"""Programs: what one input signature of a wrapped model compiles to, and its runs.

A :class:`Program` is the compile step's product ([Note: the compile step] in
``compiling``): the partition, the executor that runs its stages, and its schedules, one
per micro-batch count. :meth:`Program.run` runs one call: D runs of the schedule when
training (an optimizer step each), one otherwise.
"""

from __future__ import annotations

import functools
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
from .update import StepArithmetic
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
        self._layout: Optional[CallLayout] = None  # its calls' layout, worked out once

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
        lay = self._layout
        if lay is None or lay.key != (training, replicas) or lay.kept is not kept:
            lay = self._layout = CallLayout(self, options, training, replicas, kept)
        ex, schedule, runs, replica_of, keep = (self.executor, lay.schedule, lay.runs,
                                                lay.replica_of, lay.keep)
        step = StepArithmetic(optimizer, loss_scale, lay.divisor, max_grad_norm(optimizer),
                              accum_dtype(optimizer), lay.check_loss) if training else None
        recorder = Recorder(time.perf_counter())
        outputs, stats = [], []
        # The random state is captured once per call: the runs draw their bases together,
        # and a failure rewinds to the state after the runs that committed.
        rewind = rng.rewinder(generator) if per_run and ex.random else None
        bases = rng.draw_bases(len(runs), generator) if ex.random else lay.no_bases
        tensors = mbs.all_tensors()
        if lay.regroup is not None:  # [Note: per-replica variables] in replica_groups
            tensors = every_replica(tensors, *lay.regroup)
        # One interface, two implementations: the executor's eager run, or the step graph's
        # replay, which warms up with and captures that same run ([Note: step graphs]).
        run_call = (self.graph if self.graph is not None else ex).run_call
        if training:  # a hook registered on a parameter since the last call reaches its copies
            weights.share_hooks()
        with ex.open_call(schedule, step, recorder, lay.watchdog, guarded=True) as call:
            for d, ks in enumerate(runs):
                undo = capture(weights, None, loss_scale, False, rng=False,
                               generators=self.generators) if per_run else None
                before = ex.update.steps_applied
                weights.buffers_move()
                try:
                    out, run_stats = run_call(call, tensors[ks], replica_of, d, keep[ks], bases[d])
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


class CallLayout:
    """What every call of a program does alike under its wrapper's (frozen) options: its
    schedule, its runs' slices of the micro-batches, which ones come back, the gradient's
    divisor ([Note: one setup per call] in ``plan``).

    Args:
        program: the program; options, training, replicas, kept: :meth:`Program.run`'s.
    """

    __slots__ = ("key", "kept", "schedule", "runs", "keep", "divisor", "check_loss", "regroup",
                 "replica_of", "watchdog", "no_bases")

    def __init__(self, program: Program, options: Options, training: bool, replicas: int,
                 kept: set):
        D, R, G = options.device_iterations, replicas, options.Training.gradient_accumulation
        g = options.replication_factor // R  # the replicas each micro-batch run stands for
        self.key, self.kept = (training, replicas), kept
        if training:  # G is 1 for inference models (refused otherwise at wrap time)
            self.schedule = program.schedule(G * R, True)
            # [Note: gradient arithmetic]: each micro-batch run stands for g replicas
            mean = options.Training.reduction_type == ReductionType.Mean
            self.divisor = G * R if mean else 1 / g
            self.runs = [slice(d * G * R, (d + 1) * G * R) for d in range(D)]
        else:  # one run of every micro-batch
            self.schedule, self.divisor, self.runs = program.schedule(D * R, False), 1, [
                slice(0, D * R)]
        self.check_loss = options.Training.stop_on_non_finite_loss
        self.regroup = ((D, G, R, options.input_group_size, options.input_group_type)
                        if g < options.input_group_size else None)
        self.keep = [k in kept for k in range(D * G * R)]  # G is 1 for inference
        self.replica_of = functools.partial(_replica_of, R)  # [Note: batch layout]
        self.watchdog = options.watchdog_timeout
        self.no_bases = [None] * len(self.runs)


def _replica_of(R: int, j: int) -> int:
    """The replica of micro-batch ``j`` of a run ([Note: batch layout])."""
    return j % R
