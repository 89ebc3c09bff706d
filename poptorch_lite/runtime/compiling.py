"""The compile step: what one input signature of a wrapped model compiles to.

[Note: the compile step]
:func:`compile_program` is its one entry and a :class:`~poptorch_lite.runtime.program.Program`
its one product: the model is traced and split into stages (``compiler.partition``), the
stages' IPUs get devices and streams (``placement``), their graphs are rewritten for those
devices (``compiler.retarget``), every parameter gets its home (``weights``), and an
executor is built to run the program's schedules (``executor``). The program carries the
weights and placement it was placed with (``program.executor``); a wrapper's programs share
them. Everything here is refused before any weight, buffer, optimizer state or random state
changes.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..compiler import compiled_stages, retarget, rng, trace_modes, tracing
from ..compiler.lowered import lower
from ..compiler.partition import Partition, check_pipeline_minimums, partition
from ..compiler.running_stats import tracks_statistics
from ..enums import PipelineSchedule
from ..errors import BlockError, OptionsError, hide_when_refused as __tracebackhide__
from ..options.options import Options
from .batch import MicroBatches
from . import after_step
from .channels import Channels
from .devices import resolve_devices
from .executor import Executor
from .placement import Placement
from .program import Program
from .step_graph import for_program
from .weights import Weights


def compile_program(model: torch.nn.Module, modes: dict, options: Options, training: bool,
                    mbs: MicroBatches, replicas: int, weights: Optional[Weights],
                    placement: Optional[Placement], processes,
                    replica_values: Optional[dict] = None) -> Program:
    """Trace, split, place and plan the program of ``mbs``'s signature.

    Args:
        model: the user's model; modes: module -> the train/eval flag it is traced with
            (the model's own as wrapped: [Note: train and eval modes] in ``compiled``).
        options: the wrapper's frozen options; training: a training wrapper.
        mbs: the call's micro-batches (micro-batch 0 is traced).
        replicas: the in-process replicas R / g (R with per-replica variables).
        weights, placement: the wrapper's, None before its first program.
        processes: the replicas in other processes (``distributed``), or None.
        replica_values: per-replica variables ([Note: per-replica variables] in
            ``replica_groups``), name -> each replica's value.

    Returns:
        The program. Its weights and placement (``program.executor``) are the
        wrapper's, shared by all its programs: ``weights`` and ``placement`` when
        given, else new ones (a new placement, too, when the program uses IPUs the old
        one lacks).

    Raises:
        TraceError, BlockError, LossError, PipelineError, OptionsError: refused
            before any state changes.
    """
    keys: list = []  # the generated graphs' sources torch.fx keeps, forgotten with them
    drawn = trace_modes.host_random()  # what a second trace starts from
    try:
        with tracing.generated_sources(keys):
            made = _compiled(model, modes, options, training, mbs, weights, placement, replicas,
                             processes, replica_values, drawn)
    except BaseException:
        tracing.forget_sources(keys)
        raise
    weakref.finalize(made, tracing.forget_sources, keys)
    return made


def _compiled(model, modes, options, training, mbs, weights, placement, replicas, processes,
              replica_values, drawn):
    o = options
    a, kw = mbs.args_kwargs(0)
    part = partition(model, modes, a, kw, o.execution_strategy, training,
                     replica_values=replica_values)
    check_pipeline_minimums(part.num_stages, o.execution_strategy, training,
                            o.Training.gradient_accumulation, o.device_iterations)
    check_mapped(part, o.ipu_devices)
    spans = processes is not None and processes.layout.spans_processes
    check_shared_state(part, model, o, processes.layout.runs if spans else lambda ipu: True)
    if spans and after_step.in_graphs(st.module for st in part.stages):
        raise BlockError(
            "custom_op 'ExpMovAvg' averages a teacher's weights after each step, and this "
            "pipeline's stages run in several processes, where the teacher's copies in the "
            "other processes would not follow ([Note: after-step averages]); run its stages "
            "in one process (replicas may span processes)")
    P = processes.layout.pipelines if processes is not None else 1  # data-parallel processes
    recompute = tuple(recomputed(o, st) for st in part.stages) if training else ()
    retarget.check_written_constants(part.stages, recompute,
                                     o.compile_stages and o.compile_backend != "eager")
    rng.check_user_generators(part.stages, recompute,
                              o.execution_strategy.schedule is PipelineSchedule.Sequential,
                              o.replication_factor, processes is not None)
    # [Note: running statistics on replicas] in ``compiler/running_stats``: normalisations'
    # statistics are kept per replica; a write of the model's own is PopTorch's refusal.
    kept = part.statistics if weights is None or weights.separate_buffers or replicas == 1 \
        else frozenset()  # replicas sharing buffers since an earlier signature's program
    own = part.mutated_buffers - kept
    if replicas * P > 1 and own and o.broadcast_buffers:
        raise OptionsError(
            f"PopTorch does not support broadcasting buffers. If your model is able to "
            f"tolerate buffers becoming out of sync between replicas, you can disable buffer "
            f"broadcasting using poptorch.Options.broadcastBuffers(False). (The model changes "
            f"buffers {sorted(own)} and replicationFactor is "
            f"{o.replication_factor}{f' in each of {P} processes' if P > 1 else ''}.)")
    if spans:
        check_process_layout(processes.layout, part)
    mine = [st for st in part.stages if not spans or processes.layout.runs(st.ipu)]
    if weights is None:  # buffers per replica where the model keeps running statistics
        separate = not o.broadcast_buffers or bool(part.statistics) or tracks_statistics(model)
        weights = Weights(model, replicas, separate_buffers=separate,
                          separate_memories=o.use_model,
                          offload=training and o.TensorLocations.offload_optimizer)
    ipus = {st.ipu for st in mine}
    if placement is None or not ipus <= set(placement.devices):
        if placement is not None:
            placement.close()
        placement = Placement(sorted(ipus), o.ipu_devices)
    # [Note: graphs on their devices]: a kernel a stage's device lacks asks for a trace
    # without CPU-only kernels, as does a training kernel that cannot run compiled
    # ([Note: compiled stages] in compiler/compiled_stages); then every graph is rewritten
    # for its device.
    compiles = o.compile_stages and o.compile_backend != "eager"
    if retarget.lacking(mine, placement.devices) or (
            compiles and training and compiled_stages.uncompilable(mine)):
        trace_modes.set_host_random(drawn)  # the same Python draws as the first trace's
        part = partition(model, modes, a, kw, o.execution_strategy, training, generic=True,
                         replica_values=replica_values)
        mine = [part.stages[st.index] for st in mine]
    retarget.place(mine, placement.devices)
    weights.place(placement.devices, [(st.ipu, st.param_names) for st in mine])
    weights.written.update({n.split(":", 1)[1]: st.ipu for st in mine for n in st.written_inputs
                            if n.startswith("param:")})
    weights.place_buffers([(st.ipu, [n.split(":", 1)[1] for n in st.inputs
                                     if n.startswith("buffer:")]) for st in mine])
    channels = Channels(part, processes, {ipu: placement.device(ipu) for ipu in ipus}, training,
                        any(st.random for st in part.stages)) if spans else None
    lowered, report = lower(part, recompute), None
    if compiles:  # [Note: compiled stages]
        lowered, report = compiled_stages.compile_lowered(
            lowered, {st.ipu: placement.device(st.ipu) for st in mine}, o.compile_backend,
            split=training and o.execution_strategy.schedule is PipelineSchedule.ZeroBubble)
    executor = Executor(part, lowered, placement, weights, processes, channels)
    return Program(part, executor, o.execution_strategy.schedule, recompute, report,
                   for_program(executor, o))


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
        blocks = "; ".join(f"IPU {st.ipu} ({st.named_blocks})" for st in missing)
        raise OptionsError(
            f"Options.set_ipu_devices maps IPUs {sorted(mapping)} only, but the model places "
            f"blocks on {blocks}; give every IPU a device, e.g. opts.set_ipu_devices("
            f"{{{', '.join(f'{i}: {str(mapping[i])!r}' for i in sorted(mapping))}"
            f"{', ' if mapping else ''}{missing[0].ipu}: 'cpu'}}), or change the block's "
            f"ipu_id")


def check_shared_state(part: Partition, model: torch.nn.Module, options: Options,
                       runs_here) -> None:
    """Refuse state that several stages write, or that a stage reads before its writer, where
    a read would not see the write before it ([Note: state across stages] in
    ``compiler/state``): micro-batch i's read needs micro-batch i-1's write in a later stage.

    Args:
        runs_here: IPU -> whether this process runs it.

    Raises:
        BlockError: under a schedule that overlaps micro-batches (every one but Sequential),
            or where those stages compute with separate copies of it (``useIpuModel``, GPUs,
            stages in other processes).
    """
    strategy = options.execution_strategy
    for name, (writers, readers, known) in part.shared_state.items():
        kind, key = name.split(":", 1)
        ipus = sorted({part.stages[s].ipu for s in (*writers, *readers)})
        if strategy.schedule is not PipelineSchedule.Sequential:
            why = (f"the {strategy.schedule.name} schedule runs stages of different "
                   f"micro-batches at once, so a read sees whichever writes have run by then")
        elif not all(map(runs_here, ipus)):
            why = "those stages run in different processes, each with its own copy of it"
        else:
            host = dict(model.named_parameters() if kind == "param" else model.named_buffers())
            devices = list(resolve_devices(ipus, options.ipu_devices).values())
            if _one_tensor(host[key], devices, options.use_model, kind == "param"):
                continue
            memory = ("useIpuModel: a memory per IPU" if options.use_model
                      else f"on {', '.join(map(str, devices))}")
            why = (f"IPUs {', '.join(map(str, ipus))} each compute with their own copy of it "
                   f"({memory}), so a read never sees another IPU's write")

        raise BlockError(
            f"{_state_use(part, kind, key, writers, readers, known)}: plain PyTorch's "
            f"micro-batch i reads it after micro-batch i-1's writes, but {why}. Move the "
            f"{kind}'s reads and writes into one stage (one block, or blocks on one IPU), or "
            f"use ShardedExecution (or PipelinedExecution(schedule=PipelineSchedule."
            f"Sequential)) on IPUs that share one memory")


def _one_tensor(host: torch.Tensor, devices: list, separate_memories: bool,
                param: bool) -> bool:
    """Whether stages on IPUs with ``devices`` (one per IPU) compute with one tensor of the
    host parameter (``param``) or buffer ``host``, as ``Weights`` places them ([Note:
    weight homes] in ``weights``: the host's own where its memory is shared, and a
    parameter's on one GPU user only)."""
    return len(devices) <= 1 or (not separate_memories and all(d == host.device for d in devices)
                                 and (not param or host.device.type == "cpu"))


def _state_use(part: Partition, kind: str, key: str, writers: tuple, readers: tuple,
               known: bool) -> str:
    """Which stages write state and which read it before them, for a refusal."""
    def where(stages) -> str:
        return f"stage{'s' if len(stages) > 1 else ''} " + ", ".join(
            f"{s} (blocks {list(part.stages[s].blocks)}, IPU {part.stages[s].ipu})"
            for s in stages)
    if not known:
        return (f"{kind} '{key}' changes in forward in an op that does not say where "
                f"(BatchNorm's statistics), and {where(writers)} use it")
    early = [t for t in readers if t < min(writers)]
    return (f"{kind} '{key}' is written in forward by {where(writers)}"
            + (f" and read before that by {where(early)}" if early else ""))


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


def recomputed(options: Options, stage) -> bool:
    """Whether a stage is recomputed: its Stage's ``recompute()``, else autoRecomputation."""
    strategy = options.execution_strategy
    chosen = [strategy.stages[i].recompute_enabled for i in
              (strategy.stage_index(b) for b in stage.blocks) if i is not None]
    chosen = [c for c in chosen if c is not None]
    if chosen:
        return any(chosen)
    return options.auto_recomputation >= 3  # PopART's RecomputationType.Pipeline
