"""The phased execution strategies as data.

``Phase``, ``SerialPhasedExecution`` and ``ParallelPhasedExecution``
(POPTORCH_REFERENCE.md §5.2).

A phased strategy is a list of phases, each a list of stages; poptorch_lite runs the
phases one after another (the Sequential schedule), so their placement and liveness
options are IPU-only (accepted with one warning, stored and ignored). This module does
not import torch.

Example:
    >>> s = SerialPhasedExecution(Phase(Stage("A"), Stage("B")), ["C"])
    >>> [p.stages for p in s.phases]
    [[Stage('A'), Stage('B')], [Stage('C')]]
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

from . import errors
from .enums import Liveness, PipelineSchedule
from .strategies import BlockId, ExecutionStrategy, Stage


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
