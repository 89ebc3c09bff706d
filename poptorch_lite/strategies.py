"""Execution strategies as data: which blocks form which stage, phase and IPU.

These classes only record the user's choices (PopTorch's ``Stage``, ``Phase``,
``PipelinedExecution``, ``ShardedExecution``, ``SerialPhasedExecution``,
``ParallelPhasedExecution``; POPTORCH_REFERENCE.md §5.2). The partition module
resolves traced blocks to stages through :meth:`ExecutionStrategy.stage_index`,
``auto_stage`` and :attr:`Stage.ipu_id`; the schedule comes from ``.schedule``.
This module does not import torch.

Example:
    >>> strategy = PipelinedExecution("B1", ["B2", "B3"], Stage("B4").ipu(1))
    >>> [s.blocks for s in strategy.stages], strategy.stage_index("B3")
    ([['B1'], ['B2', 'B3'], ['B4']], 1)
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

from . import errors
from .enums import AutoStage, Liveness, PipelineSchedule

BlockId = str


class Stage:
    """One or more blocks that run together on one IPU.

    Args:
        *block_ids: the ``user_id`` strings given to ``BeginBlock``/``Block``.

    Raises:
        errors.OptionsError: no id, or an id that is not a ``str``.

    Example:
        >>> Stage("B1", "B2").ipu(1)
        Stage('B1', 'B2').ipu(1)
    """

    def __init__(self, *block_ids: BlockId):
        if not block_ids:
            raise errors.OptionsError(
                "Stage() needs at least one block id; pass the user_id strings "
                "given to BeginBlock/Block, e.g. Stage('B1', 'B2')")
        for b in block_ids:
            if not isinstance(b, str):
                raise errors.OptionsError(
                    f"Block IDs are supposed to be strings but got {b!r} "
                    f"({type(b).__name__}) in Stage{tuple(block_ids)!r}; pass the "
                    f"user_id strings given to BeginBlock/Block, e.g. Stage('B1')")
        self._blocks = list(block_ids)
        self._ipu: Optional[int] = None
        self._recompute: Optional[bool] = None

    @property
    def blocks(self) -> list[BlockId]:
        """The block ids of this stage, in the order given."""
        return list(self._blocks)

    @property
    def ipu_id(self) -> Optional[int]:
        """The IPU set with :meth:`ipu`, or None (then the block's, else the stage id)."""
        return self._ipu

    def ipu(self, n: int) -> Stage:
        """Run this stage on IPU ``n`` (a non-negative int); returns the stage.

        Raises:
            errors.OptionsError: ``n`` is not a non-negative int.

        Example:
            >>> Stage("B1").ipu(2).ipu_id
            2
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise errors.OptionsError(
                f"Stage{tuple(self._blocks)!r}.ipu() needs a non-negative int, "
                f"got {n!r}; call e.g. .ipu(0)")
        self._ipu = n
        return self

    @property
    def recompute_enabled(self) -> Optional[bool]:
        """Set by :meth:`recompute`; None follows ``autoRecomputation``."""
        return self._recompute

    def recompute(self, enabled: bool = True) -> Stage:
        """Recompute this stage's forward in its backward slot (or not); returns the stage.

        Overrides ``opts._Popart.set("autoRecomputation", 3)`` (which recomputes
        every stage) for this stage. Only the stage's inputs and its
        ``recomputationCheckpoint`` values are kept between forward and backward.

        Raises:
            errors.OptionsError: ``enabled`` is not a bool.

        Example:
            >>> Stage("B1").recompute().recompute_enabled
            True
        """
        if not isinstance(enabled, bool):
            raise errors.OptionsError(
                f"Stage{tuple(self._blocks)!r}.recompute() needs a bool, got {enabled!r}; "
                f"call .recompute(True) or .recompute(False)")
        self._recompute = enabled
        return self

    def __repr__(self) -> str:
        ids = ", ".join(repr(b) for b in self._blocks)
        return (f"Stage({ids})" + (f".ipu({self._ipu})" if self._ipu is not None else "")
                + (f".recompute({self._recompute})" if self._recompute is not None else ""))


def _as_stage(arg, where: str) -> Stage:
    """One strategy argument as a Stage: a Stage, a block id, or a list of ids."""
    if isinstance(arg, Stage):
        return arg
    if isinstance(arg, str):
        return Stage(arg)
    if isinstance(arg, (list, tuple)) and all(isinstance(b, str) for b in arg):
        return Stage(*arg)
    raise errors.OptionsError(
        f"{where} arguments must be poptorch.Stage objects, block-id strings or "
        f"lists of block ids, got {arg!r} ({type(arg).__name__}); write e.g. "
        f"{where}('B1', ['B2', 'B3'], Stage('B4').ipu(1))")


class Phase:
    """The stages of one execution phase (they run in parallel within it).

    Args:
        *stages: :class:`Stage` objects (one stage each), or block-id strings
            (together one stage, as in PopTorch: ``Phase("A", "B")`` is one stage
            of two blocks).

    Raises:
        errors.OptionsError: no argument, a mix of Stages and strings, or another type.

    Example:
        >>> Phase(Stage("A"), Stage("B")).ipus(0, 2).stages
        [Stage('A').ipu(0), Stage('B').ipu(2)]
    """

    def __init__(self, *stages: Union[Stage, BlockId]):
        if stages and all(isinstance(s, Stage) for s in stages):
            self.stages: list[Stage] = list(stages)
        elif stages and all(isinstance(s, str) for s in stages):
            self.stages = [Stage(*stages)]
        else:
            raise errors.OptionsError(
                f"All arguments of Phase must either be block ids (strings) or "
                f"Stages, got {[type(s).__name__ for s in stages]}; write "
                f"Phase(Stage('A'), Stage('B')) or Phase('A', 'B')")

    def stage(self, idx: int) -> Stage:
        """Return the ``idx``-th stage of this phase.

        Example:
            >>> Phase("A", "B").stage(0).blocks
            ['A', 'B']
        """
        return self.stages[idx]

    def ipus(self, *ipus: int) -> Phase:
        """Assign one IPU to each stage of this phase, in order; returns the phase.

        Raises:
            errors.OptionsError: the number of IPUs differs from the number of
                stages, or an IPU is not a non-negative int.

        Example:
            >>> Phase(Stage("A"), Stage("B")).ipus(1, 3).stage(1).ipu_id
            3
        """
        if len(ipus) != len(self.stages):
            raise errors.OptionsError(
                f"Phase contains {len(self.stages)} stages but you provided "
                f"{len(ipus)} ipus {ipus}; pass exactly one IPU per stage, "
                f"e.g. .ipus({', '.join(str(i) for i in range(len(self.stages)))})")
        for stage, ipu in zip(self.stages, ipus):
            Stage(*stage.blocks).ipu(ipu)  # check every id before any stage changes
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)
        return self

    def __repr__(self) -> str:
        return f"Phase({', '.join(repr(s) for s in self.stages)})"


class ExecutionStrategy:
    """Base of the execution strategies: an ordered list of stages.

    The stage id of a stage is its index in :attr:`stages`. ``auto_stage`` is
    set (and ``stages`` empty) when the stages come from the traced blocks.

    Attributes:
        stages: the explicit stages, in order.
        auto_stage: the :class:`AutoStage` rule, or None with explicit stages.
        schedule: the :class:`PipelineSchedule` the executor uses.
        pipelined: True when stages run concurrently on micro-batches.

    Example:
        >>> isinstance(ShardedExecution("A"), ExecutionStrategy)
        True
    """

    pipelined = False

    def __init__(self, stages: Sequence[Stage], auto_stage: Optional[AutoStage],
                 schedule: PipelineSchedule):
        self.stages: list[Stage] = list(stages)
        self.auto_stage = auto_stage
        self.schedule = schedule
        self._index: dict[BlockId, int] = {}
        for s, stage in enumerate(self.stages):
            for block in stage.blocks:
                if block in self._index:
                    raise errors.BlockError(
                        f"'{block}' associated with more than one stage (stages "
                        f"{self._index[block]} and {s} of {self!r}); name each "
                        f"block in exactly one Stage")
                self._index[block] = s

    def stage(self, block_id: BlockId) -> Stage:
        """Return the :class:`Stage` that ``block_id`` belongs to.

        Raises:
            errors.BlockError: no stage names ``block_id``.

        Example:
            >>> PipelinedExecution("B1", "B2").stage("B2").ipu(0)
            Stage('B2').ipu(0)
        """
        s = self.stage_index(block_id)
        if s is None:
            if self.auto_stage is not None:
                raise errors.BlockError(
                    f"Unknown Block '{block_id}': {self!r} uses "
                    f"AutoStage.{self.auto_stage.name}, so stages are only known "
                    f"once the model is traced; to look stages up, name them, "
                    f"e.g. PipelinedExecution('{block_id}', ...)")
            raise errors.BlockError(
                f"Unknown Block '{block_id}' list of expected Blocks: "
                f"{list(self._index)}; use one of those ids or add a Stage for it")
        return self.stages[s]

    def stage_index(self, block_id: BlockId) -> Optional[int]:
        """Return the stage id (index in :attr:`stages`) of ``block_id``, or None.

        Example:
            >>> PipelinedExecution("B1", ["B2", "B3"]).stage_index("B3")
            1
        """
        return self._index.get(block_id)

    def _stage_args(self) -> str:
        if self.auto_stage is not None:
            return f"AutoStage.{self.auto_stage.name}"
        return ", ".join(repr(s) for s in self.stages)


class PipelinedExecution(ExecutionStrategy):
    """Pipeline the stages: stage ``s`` works on micro-batch ``i`` while stage
    ``s+1`` works on micro-batch ``i-1``.

    Args:
        *args: :class:`Stage` objects, block-id strings (one stage each), lists
            of block ids (one stage each), or a single :class:`AutoStage`. No
            argument means ``AutoStage.SameAsIpu`` (PopTorch's default).
        schedule: a :class:`PipelineSchedule` or its name (default ``Grouped``).

    Raises:
        errors.OptionsError: an argument of another type, or AutoStage mixed
            with explicit stages, or an unknown schedule.
        errors.BlockError: a block named in two stages.

    Example:
        >>> PipelinedExecution("A", "B", schedule="interleaved")
        PipelinedExecution(Stage('A'), Stage('B'), schedule=PipelineSchedule.Interleaved)
    """

    pipelined = True

    def __init__(self, *args, schedule: Union[PipelineSchedule, str] = PipelineSchedule.Grouped):
        name = type(self).__name__
        autos = [a for a in args if isinstance(a, AutoStage)]
        if autos and len(args) > 1:
            raise errors.OptionsError(
                f"{name}{args!r} mixes {autos[0]!r} with explicit stages; pass "
                f"either a single AutoStage or only stages/block ids")
        auto_stage = autos[0] if autos else (AutoStage.SameAsIpu if not args else None)
        stages = [] if auto_stage is not None else [_as_stage(a, name) for a in args]
        super().__init__(stages, auto_stage, PipelineSchedule.parse(schedule))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._stage_args()}, "
                f"schedule=PipelineSchedule.{self.schedule.name})")


class ShardedExecution(PipelinedExecution):
    """Run the stages one after another, one IPU busy at a time (no pipelining,
    no minimum on gradient accumulation or device iterations; good for
    debugging). Takes the same stage arguments as :class:`PipelinedExecution`;
    the schedule is always ``PipelineSchedule.Sequential``.

    Example:
        >>> s = ShardedExecution("A", "B")
        >>> s.schedule, s.pipelined
        (<PipelineSchedule.Sequential: 'sequential'>, False)
    """

    pipelined = False

    def __init__(self, *args):
        super().__init__(*args, schedule=PipelineSchedule.Sequential)

    def __repr__(self) -> str:
        return f"ShardedExecution({self._stage_args()})"


def _as_phase(arg) -> Phase:
    """One phased-strategy argument as a Phase."""
    if isinstance(arg, Phase):
        return arg
    if isinstance(arg, (Stage, str)):
        return Phase(arg)
    if isinstance(arg, (list, tuple)):
        return Phase(*arg)
    raise errors.OptionsError(
        f"Phases must be poptorch.Phase objects or lists of Stages or block ids, "
        f"got {arg!r} ({type(arg).__name__}); write e.g. "
        f"SerialPhasedExecution(Phase(Stage('A'), Stage('B')), ['C'])")


class _PhasedExecution(ExecutionStrategy):
    """Common part of the phased strategies: one phase after another, and the
    model's own numerics. Placement and liveness options are IPU-only."""

    def __init__(self, *phases):
        name = type(self).__name__
        if len(phases) == 1 and isinstance(phases[0], (list, tuple)) and phases[0] \
                and all(isinstance(p, Phase) for p in phases[0]):
            phases = tuple(phases[0])  # PopTorch's documented form: one list of Phases
        if not phases:
            raise errors.OptionsError(
                f"There is currently no AutoStage for {name}: please explicitly "
                f"specify the phases, e.g. {name}(Phase(Stage('A')), ['B'])")
        self.phases: list[Phase] = [_as_phase(p) for p in phases]
        super().__init__([s for p in self.phases for s in p.stages], None,
                         PipelineSchedule.Sequential)
        self.separate_backward_phase = False
        self.tensors_liveness = Liveness.AlwaysLive

    def phase(self, i: int) -> Phase:
        """Return phase ``i``.

        Raises:
            errors.OptionsError: ``i`` is not an index of a phase.

        Example:
            >>> SerialPhasedExecution(["A"], ["B"]).phase(1)
            Phase(Stage('B'))
        """
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.phases):
            raise errors.OptionsError(
                f"Phases are identified by integers 0..{len(self.phases) - 1}, "
                f"got {i!r}; call .phase(0) to .phase({len(self.phases) - 1})")
        return self.phases[i]

    def useSeparateBackwardPhase(self, use: bool = True) -> _PhasedExecution:
        """Give the backward pass phases of its own (IPU-only: accepted, ignored).

        Example:
            >>> SerialPhasedExecution(["A"]).useSeparateBackwardPhase().separate_backward_phase
            True
        """
        if not isinstance(use, bool):
            raise errors.OptionsError(
                f"useSeparateBackwardPhase needs a bool, got {use!r}; call "
                f".useSeparateBackwardPhase(True)")
        _warn_ipu_only(f"{type(self).__name__}.useSeparateBackwardPhase")
        self.separate_backward_phase = use
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(repr(p) for p in self.phases)})"


def _warn_ipu_only(name: str) -> None:
    errors.warn_once(name, f"{name}() only tunes IPU memory placement and has no "
                           f"effect in poptorch_lite: phases run one after another "
                           f"and the value is stored and ignored")


class SerialPhasedExecution(_PhasedExecution):
    """All phases run one after another on one group of IPUs.

    Args:
        *phases: :class:`Phase` objects or lists of Stages/block ids (one phase
            per argument; a single list of Phases, as in PopTorch's docs, is
            also accepted).

    Raises:
        errors.OptionsError: no phase, or a badly typed argument.
        errors.BlockError: a block named in two stages.

    Example:
        >>> SerialPhasedExecution(Phase(Stage("A"), Stage("A2")), ["B"]).stages
        [Stage('A'), Stage('A2'), Stage('B')]
    """

    def setTensorsLiveness(self, liveness: Liveness) -> SerialPhasedExecution:
        """Choose where tensors live between phases (IPU-only: accepted, ignored).

        Example:
            >>> SerialPhasedExecution(["A"]).setTensorsLiveness(Liveness.OffChipAfterFwd).tensors_liveness
            <Liveness.OffChipAfterFwd: 1>
        """
        if not isinstance(liveness, Liveness):
            raise errors.OptionsError(
                f"setTensorsLiveness needs a poptorch.Liveness, got {liveness!r}; "
                f"call e.g. .setTensorsLiveness(poptorch.Liveness.AlwaysLive)")
        _warn_ipu_only("SerialPhasedExecution.setTensorsLiveness")
        self.tensors_liveness = liveness
        return self


class ParallelPhasedExecution(_PhasedExecution):
    """Phases alternate between two groups of IPUs: even phases on even IPUs,
    odd phases on odd IPUs. poptorch_lite runs them one after another.

    PopTorch checks the even/odd rule when it compiles, after blocks have their
    IPUs; likewise construction checks only what PopTorch's constructor checks,
    and the partition module calls :meth:`validate_ipus` once IPUs are resolved.

    Example:
        >>> s = ParallelPhasedExecution(Phase(Stage("A")), Phase(Stage("B")))
        >>> _ = s.phase(0).ipus(0), s.phase(1).ipus(1)
        >>> s.validate_ipus()  # phase 0 on IPU 0, phase 1 on IPU 1: fine
    """

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> ParallelPhasedExecution:
        """Send tensors off chip after the forward pass (IPU-only: accepted, ignored).

        Example:
            >>> ParallelPhasedExecution(["A"]).sendTensorsOffChipAfterFwd().tensors_liveness
            <Liveness.OffChipAfterFwd: 1>
        """
        if not isinstance(off_chip, bool):
            raise errors.OptionsError(
                f"sendTensorsOffChipAfterFwd needs a bool, got {off_chip!r}; call "
                f".sendTensorsOffChipAfterFwd(True)")
        _warn_ipu_only("ParallelPhasedExecution.sendTensorsOffChipAfterFwd")
        self.tensors_liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        return self

    def validate_ipus(self, block_ipus: Optional[Mapping[BlockId, int]] = None) -> None:
        """Check that even phases run on even IPUs and odd phases on odd IPUs.

        Args:
            block_ipus: the IPU the partition resolved for each block, used for
                stages without :meth:`Stage.ipu`; stages with no IPU either way
                are not checked.

        Raises:
            errors.OptionsError: a stage is on an IPU of the wrong parity.

        Example:
            >>> ParallelPhasedExecution(["A"], ["B"]).validate_ipus({"A": 0, "B": 2})
            Traceback (most recent call last):
            ...
            poptorch_lite.errors.OptionsError: When phases are executed in parallel: even phases must run on even IPUs and odd phases on odd IPUs; phase 1 has Stage('B') on IPU 2; put it on an odd IPU (e.g. 3) with Stage.ipu() or Phase.ipus()
        """
        for p, phase in enumerate(self.phases):
            for stage in phase.stages:
                ipu = stage.ipu_id
                if ipu is None and block_ipus is not None:
                    ipu = block_ipus.get(stage.blocks[0])
                if ipu is not None and ipu % 2 != p % 2:
                    raise errors.OptionsError(
                        f"When phases are executed in parallel: even phases must "
                        f"run on even IPUs and odd phases on odd IPUs; phase {p} "
                        f"has {stage!r} on IPU {ipu}; put it on an "
                        f"{'even' if p % 2 == 0 else 'odd'} IPU (e.g. {ipu + 1}) "
                        f"with Stage.ipu() or Phase.ipus()")
