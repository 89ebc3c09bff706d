"""Execution strategies as data: which blocks form which stage, phase and IPU.

These classes only record the user's choices (PopTorch's ``Stage``,
``PipelinedExecution``, ``ShardedExecution``; the phased strategies are in
``phases``; POPTORCH_REFERENCE.md §5.2). The partition module
resolves traced blocks to stages through :meth:`ExecutionStrategy.stage_index`,
``auto_stage`` and :attr:`Stage.ipu_id`; the schedule comes from ``.schedule``.
This module does not import torch.

Example:
    >>> strategy = PipelinedExecution("B1", ["B2", "B3"], Stage("B4").ipu(1))
    >>> [s.blocks for s in strategy.stages], strategy.stage_index("B3")
    ([['B1'], ['B2', 'B3'], ['B4']], 1)
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from . import errors
from .enums import AutoStage, PipelineSchedule

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
