"""Partition: split a traced model's graph into stages.

[Note: partition]
PopTorch traces a model on the first call's inputs: Python control flow and
side effects run at trace time, tensor ops (in-place buffer updates included)
land in the graph, each op in the block active when it ran. We do the same
with ``make_fx`` (dispatcher-level tracing on concrete inputs), passing the
parameters and buffers in as graph inputs (``functional_call``), so stage
graphs run on whatever tensors they are given: the user's own ``Parameter``
objects, or a replica's copy of the buffers. Annotations leave marker nodes
(``markers``) in the graph; every op belongs to the block of the last
``begin_block`` before it. A stage is a maximal run of ops on one IPU;
consecutive blocks on the same IPU merge, as in PopTorch. The ZeroBubble
schedule, which PopTorch never had, also begins a stage where the stage id
changes (``AutoStage.AutoIncrement`` or explicit ``Stage``s): blocks on IPUs
``0, 1, 1, 0`` are then four virtual stages in a V, the middle two on IPU 1
([Note: zero bubble] in ``runtime/schedule_kinds``).

A value is named by where it comes from: ``param:<name>``, ``buffer:<name>``,
``input:<k>`` (the k-th tensor leaf of the call's arguments), or
``node:<name>`` (computed by a stage). Sources are handed to any stage that
needs them; a computed value travels from its stage to every later stage
that uses it (skip connections, labels, the loss inputs).

The loss, and the returned value that trains, are ``losses``' ([Note: loss provenance],
[Note: the trained loss]).

[Note: stages by data flow]
Under ``PipelinedExecution`` a block's stage id need not ascend in the order the forward
runs: PopART pipelines by data flow, so blocks on IPUs ``0, 1, 0, 1`` with ``AutoStage.
SameAsIpu`` are two stages wherever the later IPU-0 ops use nothing of IPU 1's (DINO's
teacher, in IPU 0's and IPU 1's blocks after the student's). Each stage's ops run in the
order the trace ran them, and the stages in id order; that is the same arithmetic as the
trace's order wherever every pair of ops whose order matters keeps it: an op and a user of
its value, two ops that touch memory one of them writes in place, and two random ops (a
micro-batch's stages draw from one stream in stage order: [Note: micro-batch RNG] in
``rng``). Where such a pair would run in the other order (``0, 1, 0`` with the second
IPU-0 block using IPU 1's output), the model is refused, as PopART refuses it. Shared
state read and written by several stages is then ``state``'s to check.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from ..enums import AutoStage, PipelineSchedule
from ..errors import BlockError, PipelineError, hide_when_refused as __tracebackhide__
from ..strategies import ExecutionStrategy
from . import backward_hooks, grad_semantics, losses as losses_, markers, rng, state
from .subgraphs import segment_groups, subgraphs
from .trace_modes import node_line
from .tracing import trace
from .value_info import value_infos


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of a stage between recomputation checkpoints: a graph and its value names."""

    module: fx.GraphModule
    inputs: tuple
    outputs: tuple
    written: frozenset = frozenset()


@dataclasses.dataclass
class Stage:
    """One stage of a partitioned model: a graph that runs on one IPU.

    Attributes:
        index: the stage's position s in execution order.
        ipu: the IPU it runs on (its stream and device come from the placement).
        blocks: the user block ids it holds, in order of appearance.
        module: the stage graph; called with the values named by ``inputs``,
            returns the values named by ``outputs`` as a tuple.
        inputs: value names ([Note: partition]) of its arguments.
        outputs: value names it produces for later stages or for the caller.
        written_inputs: inputs from earlier stages, or of the call, that an op of
            this stage writes in place (``nn.ReLU(inplace=True)`` opening a stage,
            ``x += 1`` on an argument); the executor gives the stage a copy of them
            (and copies a call's edited argument back: [Note: edited arguments] in
            ``runtime/stage_work``); and the parameters it writes in place (a
            ``clamp_`` under ``no_grad``), which a recompute reads as they were.
        segments: the stage cut after each ``recomputationCheckpoint`` value,
            for recomputation (one segment when it has none).
        random: whether it has random ops ([Note: micro-batch RNG]).
    """

    index: int
    ipu: int
    blocks: tuple
    module: fx.GraphModule
    inputs: tuple
    outputs: tuple
    written_inputs: frozenset = frozenset()
    segments: tuple = ()
    random: bool = False

    @property
    def param_names(self) -> list:
        return [v.split(":", 1)[1] for v in self.inputs if v.startswith("param:")]

    @property
    def named_blocks(self) -> str:
        """Its blocks as messages name them: ``block 'b0'``, ``blocks 'b0', 'b1'``."""
        return f"block{'s' if len(self.blocks) > 1 else ''} {', '.join(map(repr, self.blocks))}"


@dataclasses.dataclass
class Partition:
    """A traced model split into stages, with everything needed to run and merge it.

    Attributes:
        stages: in execution order.
        loss: the value name of the final loss (None in inference, or if none).
        outputs: one entry per leaf of the model's return value: a value name
            (str) for tensor leaves, or ``("const", value)`` for other leaves.
        out_spec: the pytree spec to rebuild the return value.
        mutated_buffers: names of buffers the forward changes in place.
        statistics: those of them that only normalisations update, their running
            statistics ([Note: running statistics on replicas] in ``running_stats``).
        checkpoints: value names marked by ``recomputationCheckpoint``.
        module_blocks: layer name -> block id active when it ran (for summaries).
        values: value name -> :class:`~poptorch_lite.compiler.value_info.ValueInfo` of every
            value a stage computes for later stages or the caller ([Note: value info]).
        replica_values: parameter name -> the value (index along dim 0) each replica computes
            with, for per-replica variables ([Note: per-replica variables] in
            ``runtime/replica_groups``); traced as one value.
        shared_state: the buffers and parameters that several stages write, or that a
            stage reads before its writer (``state.follow_state``; [Note: state across
            stages] in ``state``).
        reads: the model's plain Python attributes the forward read, and their values
            (``python_attributes.Reads``): what the program is kept for ([Note: Python
            attributes of the model] in ``python_attributes``).
    """

    stages: list
    loss: Optional[str]
    outputs: list
    out_spec: Any
    mutated_buffers: frozenset
    checkpoints: frozenset
    module_blocks: dict
    values: dict = dataclasses.field(default_factory=dict)
    replica_values: dict = dataclasses.field(default_factory=dict)
    statistics: frozenset = frozenset()
    shared_state: dict = dataclasses.field(default_factory=dict)
    reads: Any = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_ipus(self) -> list:
        return [st.ipu for st in self.stages]


def _block_stage_ids(blocks: list, strategy: ExecutionStrategy) -> dict:
    """Block id -> (stage id, ipu), following PopTorch's rules (see POPTORCH_REFERENCE §5.2).

    ``blocks`` lists (user_id, ipu_id or None) in order of first appearance.
    """
    ids = [b for b, _ in blocks]
    ipu_of = dict(blocks)
    resolved = {}
    if strategy.stages:
        named = [b for st in strategy.stages for b in st.blocks]
        for b in named:
            if b not in ipu_of:
                raise BlockError(f"a Stage names block '{b}', but the model has no such block "
                                 f"(its blocks: {ids}); fix the Stage or the block's user_id")
        for b in ids:
            s = strategy.stage_index(b)
            if s is None:
                raise BlockError(f"Unknown Block '{b}' list of expected Blocks: {named}; "
                                 f"add '{b}' to a Stage of the execution strategy")
            st = strategy.stages[s]
            ipu = st.ipu_id if st.ipu_id is not None else (ipu_of[b] if ipu_of[b] is not None else s)
            resolved[b] = (s, ipu)
        return resolved
    if strategy.auto_stage == AutoStage.AutoIncrement:
        for s, b in enumerate(ids):
            resolved[b] = (s, ipu_of[b] if ipu_of[b] is not None else s)
        return resolved
    for b in ids:
        if ipu_of[b] is None:
            raise BlockError(f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified "
                             f"for block {b}; give it an ipu_id, or use "
                             f"PipelinedExecution(AutoStage.AutoIncrement) or explicit Stages")
        resolved[b] = (ipu_of[b], ipu_of[b])
    return resolved


def _in_stage_order(ops: list, stage_of: Callable, owner: dict) -> list:
    """``ops`` in stage order, each stage's in trace order ([Note: stages by data flow]).

    Raises:
        BlockError: an op must follow one of a later stage: it uses its value, one of them
            writes in place memory that the other reads, or both draw random numbers.
    """
    if all(stage_of(a) <= stage_of(b) for a, b in zip(ops, ops[1:])):
        return ops
    here = set(ops)
    roots: dict = {}

    def root(n: fx.Node) -> fx.Node:  # the memory a value is: follow views and in-place results
        if n not in roots:
            up = state.aliased_input(n)
            roots[n] = n if up is None else root(up)
        return roots[n]

    touches: dict = {}  # memory -> the ops that read or write it, in trace order
    writes: dict = {}   # op -> the memory it writes in place
    for n in ops:
        for u in dict.fromkeys(n.all_input_nodes):
            touches.setdefault(root(u), []).append(n)
        writes[n] = {root(w) for w in state.written(n)}
    written = set().union(*writes.values())
    ordered = [(u, n, "uses a value of") for n in ops for u in n.all_input_nodes if u in here]
    for m in written:  # each write keeps its place among the ops touching its memory
        seq = touches[m]
        for k, w in enumerate(seq):
            if m in writes[w]:
                ordered += [(t, w, "writes in place what is read by") for t in seq[:k]]
                ordered += [(w, t, "reads what is written in place by") for t in seq[k + 1:]]
    random = [n for n in ops if rng.is_random(n)]
    ordered += [(a, b, "draws random numbers after") for a, b in zip(random, random[1:])]
    for first, then, how in ordered:
        if stage_of(first) > stage_of(then):
            raise BlockError(
                f"stage ids must ascend along the data flow under PipelinedExecution, but "
                f"block '{owner[then]}' (stage {stage_of(then)}) {how} block '{owner[first]}' "
                f"(stage {stage_of(first)}), which runs after it: {then.target} at "
                f"{node_line(then)}. Use PipelinedExecution(AutoStage.AutoIncrement), reorder "
                f"the Stages, or use ShardedExecution")
    return sorted(ops, key=stage_of)


def split(gm: fx.GraphModule, param_names: Sequence[str], buffer_names: Sequence[str],
          strategy: ExecutionStrategy, training: bool,
          trainable: Callable[[str], bool] = lambda name: True,
          mutated: frozenset = frozenset()) -> tuple:
    """Split a traced graph into stages.

    ``trainable`` says whether a parameter requires grad ([Note: value info]); ``mutated``
    names the buffers the trace saw change.

    Returns:
        ``(stages, loss, output_values, checkpoints, block_stage, values, shared_state)``.

    Raises:
        BlockError: an op outside any Block, an unknown or unnamed block, or
            stage ids out of order under PipelinedExecution.
        LossError: training with no loss or several independent losses.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    source_name = {}
    for k, n in enumerate(placeholders):
        if k < len(param_names):
            source_name[n] = f"param:{param_names[k]}"
        elif k < len(param_names) + len(buffer_names):
            source_name[n] = f"buffer:{buffer_names[k - len(param_names)]}"
        else:
            source_name[n] = f"input:{k - len(param_names) - len(buffer_names)}"

    # 1. Which block each op belongs to, from the markers ([Note: partition]).
    block_seq: list = []  # (user_id, ipu or None) in first-appearance order
    seen: dict = {}
    current: Any = "<leading>"
    owner: dict = {}
    losses, checkpoints = [], []
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target is markers.BEGIN_BLOCK:
            uid, ipu = n.args[0], (None if n.args[1] < 0 else n.args[1])
            if uid in seen and ipu is not None and seen[uid] is not None and seen[uid] != ipu:
                raise BlockError(f"block '{uid}' is declared on IPU {seen[uid]} and on IPU {ipu}; "
                                 f"give each block one ipu_id")
            if uid not in seen:
                block_seq.append(uid)
                seen[uid] = ipu
            elif seen[uid] is None:
                seen[uid] = ipu
            current = uid
        elif n.target is markers.END_BLOCK:
            current = None
        elif n.target is markers.MARK_LOSS:
            losses.append(n.args[0])
        elif n.target is markers.MARK_CHECKPOINT:
            checkpoints.append(n.args[0])
        else:
            passed = backward_hooks.passes_on(n)  # a module hook's output after its Block closed
            if current is None and passed in owner:
                owner[n] = owner[passed]
                continue
            if current is None:
                raise BlockError(
                    f"No active Block, all the ops must belong to a Block: {n.target} at "
                    f"{node_line(n)} runs after a Block scope closed. You must declare all the "
                    f"layers inside a Block scope, using either the context manager or BlockFunction")
            owner[n] = current

    # 2. Block -> (stage id, ipu); ops before the first block run on IPU 0.
    block_stage = _block_stage_ids([(b, seen[b]) for b in block_seq], strategy)
    validate_ipus = getattr(strategy, "validate_ipus", None)  # ParallelPhasedExecution's parity
    if validate_ipus is not None:
        validate_ipus({b: ipu for b, (_, ipu) in block_stage.items()})
    block_stage["<leading>"] = (-1, 0)
    ops = [n for n in nodes if n in owner]
    if strategy.pipelined:  # [Note: stages by data flow]
        ops = _in_stage_order(ops, lambda n: block_stage[owner[n]][0], owner)

    # 3. Stages: maximal runs of consecutive ops on one IPU (and of one stage id, for the
    # virtual stages of ZeroBubble: [Note: partition]).
    virtual = strategy.pipelined and strategy.schedule is PipelineSchedule.ZeroBubble
    runs: list = []  # (ipu, ops, blocks)
    run_sid = None   # the stage id of the last run's blocks (None: only ops before any block)
    for n in ops:
        (sid, ipu), block = block_stage[owner[n]], owner[n] != "<leading>"
        if not runs or runs[-1][0] != ipu or (virtual and block and run_sid not in (None, sid)):
            runs.append((ipu, [], []))
            run_sid = None
        runs[-1][1].append(n)
        if block:
            run_sid = sid
            if owner[n] not in runs[-1][2]:
                runs[-1][2].append(owner[n])
    if not runs:
        runs = [(0, [], [])]
    backward_hooks.check_module_hooks([run[1] for run in runs])
    # State written in one stage and read in another ([Note: state across stages]).
    shared_state = state.follow_state(gm, runs, source_name, mutated)

    # 4. The loss, by provenance ([Note: loss provenance]), and the returned value that
    # trains ([Note: the trained loss]).
    loss_node = None
    out_node = next(n for n in nodes if n.op == "output")
    model_outputs = list(out_node.args[0])
    if training:
        loss_node = losses_.trained_loss(losses_.final_loss(losses), model_outputs)

    # 5. One graph per stage; values computed in a stage and needed later become outputs.
    needed_later = {n for n in model_outputs if isinstance(n, fx.Node)}
    if loss_node is not None:
        losses_.warn_if_not_returned(loss_node, needed_later)
    if loss_node is not None:
        needed_later.add(loss_node)
    checkpoint_nodes = {c for c in checkpoints if isinstance(c, fx.Node)}

    def value_name(n: fx.Node) -> str:
        return source_name.get(n, f"node:{n.name}")

    if training:  # [Note: gradients the forward shapes] in ``grad_semantics``
        grad_semantics.mark_stops(gm, lambda n: source_name.get(n, "").startswith("param:")
                                  and trainable(source_name[n].split(":", 1)[1]))
    stages = []
    graphs = subgraphs(gm, [run[1] for run in runs], value_name, needed_later)
    for s, ((ipu, run_nodes, blocks), (module, inputs, outputs, written)) in enumerate(
            zip(runs, graphs)):
        exported = {n for n in run_nodes if value_name(n) in outputs}
        segments = [Segment(*g) for g in subgraphs(
            gm, segment_groups(run_nodes, checkpoint_nodes), value_name, exported)]
        for seg in segments:
            rng.seed_random_ops(seg.module)
            grad_semantics.stop_gradients(seg.module)
        random = rng.seed_random_ops(module)
        grad_semantics.stop_gradients(module)
        stages.append(Stage(s, ipu, tuple(blocks), module, inputs, outputs, written,
                            tuple(segments), random))
    output_values = [value_name(n) for n in model_outputs]
    loss = value_name(loss_node) if loss_node is not None else None
    computed = {v for st in stages for v in st.outputs if v.startswith("node:")}
    values = value_infos(gm, source_name, trainable, value_name, computed)
    return (stages, loss, output_values,
            frozenset(value_name(c) for c in checkpoint_nodes), block_stage, values, shared_state)


def partition(model: torch.nn.Module, modes: dict, args: tuple, kwargs: dict,
              strategy: ExecutionStrategy, training: bool, generic: bool = False,
              replica_values: Optional[dict] = None) -> Partition:
    """Trace ``model`` on one micro-batch and split it into stages ([Note: partition]).

    ``generic``: trace without CPU-only kernels (``tracing.trace``); ``replica_values``: the
    per-replica variables (``Partition.replica_values``).

    Example:
        >>> import torch
        >>> from poptorch_lite.strategies import ShardedExecution
        >>> p = partition(torch.nn.Linear(2, 2), {}, (torch.ones(1, 2),), {},
        ...               ShardedExecution(), training=False)
        >>> p.num_stages
        1
    """
    replica_values = dict(replica_values or {})
    gm, pnames, bnames, spec, consts, layer_blocks, mutated, statistics, reads = trace(
        model, modes, args, kwargs, training, generic, frozenset(replica_values))
    params = dict(model.named_parameters())
    stages, loss, tensor_outputs, checkpoints, _, values, shared = split(
        gm, pnames, bnames, strategy, training, lambda name: params[name].requires_grad, mutated)
    it = iter(tensor_outputs)
    outputs = [next(it) if c is None else c for c in consts]
    return Partition(stages, loss, outputs, spec, mutated, checkpoints, layer_blocks, values,
                     replica_values, statistics, shared, reads)


def check_pipeline_minimums(num_stages: int, strategy: ExecutionStrategy, training: bool,
                            gradient_accumulation: int, device_iterations: int) -> None:
    """PopTorch's minimums for PipelinedExecution (POPTORCH_REFERENCE §5.2).

    They are those of PopTorch's own pipelines, ``Grouped`` and ``Interleaved``. The
    schedules PopTorch never had run any number of micro-batches, as
    torch.distributed.pipelining's do: ``Sequential`` one action at a time, ``GPipe``
    and ``ZeroBubble`` with the ramps that m gives (virtual stages at m = 4 are
    where a V pays most).

    Raises:
        PipelineError: training with gradientAccumulation < 2N-1, or inference
            with deviceIterations < N, for N pipeline stages of a Grouped or
            Interleaved pipeline.
    """
    if not strategy.pipelined or num_stages < 2 or strategy.schedule not in (
            PipelineSchedule.Grouped, PipelineSchedule.Interleaved):
        return
    n = num_stages
    if training and gradient_accumulation < 2 * n - 1:
        raise PipelineError(
            f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
            f"the number of pipeline stages ({2 * n - 1}) when using poptorch.PipelinedExecution. "
            f"Please note that a model with {n} pipeline stages in PopTorch will have an "
            f"additional {n - 1} stages when training. gradientAccumulation("
            f"{gradient_accumulation}) is too small for a {n}-stage pipeline: call "
            f"opts.Training.gradientAccumulation({2 * n - 1}) or more, or use ShardedExecution")
    if not training and device_iterations < n:
        raise PipelineError(
            f"poptorch.Options().deviceIterations must be greater than or equal to the number of "
            f"pipeline stages ({n}) when using PopTorch.PipelinedExecution: deviceIterations"
            f"({device_iterations}) is too small; call opts.deviceIterations({n}) or more, "
            f"or use ShardedExecution")
