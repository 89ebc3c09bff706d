"""The IPU options of the Keras face: the strategy scope, pipeline stages and the rules.

``IPUConfig`` / ``IPUStrategy`` choose how many IPUs a model uses,
``PipelineStage`` places ops on a stage, and :class:`IpuSettings` holds what
``set_pipelining_options`` sets, checks the tutorials' rules against the number
of stages, and turns it all into the PopTorch ``Options`` of one wrapper
([Note: Keras face] in ``keras``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Optional

from ..annotations import Block
from ..enums import OutputMode, PipelineSchedule
from ..errors import OptionsError, PipelineError, warn_once
from ..options.base import check_positive_int
from ..options.ipu import TensorLocationSettings
from ..options.options import Options
from ..strategies import PipelinedExecution


class RecomputationMode(enum.Enum):
    """IPU Keras' recomputation modes. Each recomputes every stage's forward in its
    backward (``_Popart.set("autoRecomputation", 3)``); the numbers are the same."""

    Auto = "auto"
    RecomputeThenBackpropagate = "recompute_then_backpropagate"
    RecomputeAndBackpropagateInterleaved = "recompute_and_backpropagate_interleaved"


class PipelineStage:
    """``with PipelineStage(k):`` puts the ops that follow in ``forward`` on stage (IPU) k.

    The functional-model route of the tutorials. As in IPU Keras, what runs after
    the scope (the loss, when the last stage's scope closes) stays on stage k until
    the next ``PipelineStage``.

    Raises:
        BlockError: k is not an int >= 0.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        ...     def forward(self, x):
        ...         with PipelineStage(0):
        ...             x = torch.relu(self.a(x))
        ...         with PipelineStage(1):
        ...             return self.b(x)
    """

    def __init__(self, stage: int):
        Block(f"stage{stage}", ipu_id=stage)  # checks the id
        self.stage = stage

    def __enter__(self):
        Block.start(f"stage{self.stage}", ipu_id=self.stage)
        return self

    def __exit__(self, *exc):
        return False


class IPUConfig:
    """IPU Keras' system configuration: ``auto_select_ipus`` IPUs for the strategy's models.

    ``configure_ipu_system()`` makes this configuration the process's IPU system, as
    TF's does: an ``IPUStrategy()`` made afterwards without an argument uses it.
    ``selection_order`` and ``device_connection`` are accepted, with one IPU-only
    warning each when set (they choose and attach physical IPUs).

    Example:
        >>> config = IPUConfig()
        >>> config.auto_select_ipus = 4       # as the tutorials write it; or IPUConfig(4)
        >>> config.configure_ipu_system()
        >>> IPUStrategy().config.auto_select_ipus
        4
        >>> reset_ipu_system()
    """

    def __init__(self, auto_select_ipus: int = 1):
        self.auto_select_ipus = auto_select_ipus
        self.selection_order = None
        self.device_connection = _DeviceConnection()

    def configure_ipu_system(self) -> None:
        """Check the configuration and make it the process's IPU system (a snapshot: later
        edits of this object need another ``configure_ipu_system()``).

        Raises:
            OptionsError: ``auto_select_ipus`` is not a positive int.
        """
        check_positive_int(self.auto_select_ipus, "IPUConfig.auto_select_ipus",
                           "config.auto_select_ipus = 1")
        if self.selection_order is not None:
            warn_once("IPUConfig.selection_order", "IPUConfig.selection_order is IPU-only (the "
                      "order of physical IPUs); ignored")
        if self.device_connection.type is not None or self.device_connection.version is not None:
            warn_once("IPUConfig.device_connection", "IPUConfig.device_connection is IPU-only "
                      "(when to attach to the IPUs); ignored")
        snapshot = IPUConfig(self.auto_select_ipus)
        _SYSTEM[:] = [snapshot]


class _DeviceConnection:
    """``config.device_connection.type`` / ``.version``: IPU-only, accepted."""

    def __init__(self):
        self.type = self.version = self.enable_remote_buffers = None


_SYSTEM: list = []  # the configuration of the last configure_ipu_system(), if any


def reset_ipu_system() -> None:
    """Forget the configured IPU system (``IPUStrategy()`` then uses one IPU per stage).

    Example:
        >>> reset_ipu_system()
    """
    _SYSTEM.clear()


_SCOPE: list = []  # the IPUStrategy scopes entered, innermost last

# The porting table's keywords of compile / set_pipelining_options /
# set_gradient_accumulation_options that only tune IPU memory or Poplar: accepted, one
# IpuOnlyWarning each (W-IPU-10).
IPU_ONLY_KEYWORDS = frozenset({
    "batch_serialization_iterations", "replicated_optimizer_state_sharding",
    "offload_activations", "offload_gradient_accumulation_buffers",
    "replicated_weight_sharding", "offload_weights",
    "forward_propagation_stages_poplar_options", "backward_propagation_stages_poplar_options",
    "weight_update_poplar_options", "device_mapping"})


class IPUStrategy:
    """Models created inside ``strategy.scope()`` use ``config.auto_select_ipus`` IPUs:
    ``auto_select_ipus / stages`` replicas of the pipeline.

    Args:
        config: the configuration to use; None (the tutorials' ``IPUStrategy()``): the
            one of the last ``config.configure_ipu_system()``, or one IPU per stage when
            none was configured. A configuration given here is used by this strategy
            only (it does not configure the system).

    Raises:
        OptionsError: ``auto_select_ipus`` is not a positive int.

    Example:
        >>> config = IPUConfig()
        >>> config.auto_select_ipus = 2
        >>> import torch
        >>> from poptorch_lite import keras
        >>> with IPUStrategy(config).scope():
        ...     model = keras.Sequential([torch.nn.Linear(4, 2)])
    """

    def __init__(self, config: Optional[IPUConfig] = None):
        if config is None:
            self.config = _SYSTEM[0] if _SYSTEM else None
        else:  # this project's shortcut: this configuration, the system unchanged
            check_positive_int(config.auto_select_ipus, "IPUConfig.auto_select_ipus",
                               "config.auto_select_ipus = 1")
            self.config = IPUConfig(config.auto_select_ipus)

    @contextlib.contextmanager
    def scope(self):
        _SCOPE.append(None if self.config is None else self.config.auto_select_ipus)
        try:
            yield self
        finally:
            _SCOPE.pop()


def current_ipus() -> Optional[int]:
    """``auto_select_ipus`` of the innermost ``IPUStrategy.scope()``; None outside any
    (a model made outside a scope takes one IPU per stage: one replica)."""
    return _SCOPE[-1] if _SCOPE else None


@dataclasses.dataclass(frozen=True)
class IpuSettings:
    """A Keras model's IPU options: IPUs, G, schedule, recomputation, offloading.

    Example:
        >>> IpuSettings(ipus=4, G=4).replicas(stages=2)
        2
    """

    ipus: Optional[int] = None  # None: one per stage
    G: int = 1
    schedule: PipelineSchedule = PipelineSchedule.Grouped
    recompute: Optional[RecomputationMode] = None
    offload: bool = False

    def replicas(self, stages: int) -> int:
        """``ipus / stages``, the replicas of a ``stages``-stage pipeline.

        Raises:
            OptionsError: ``ipus`` is not a multiple of ``stages``.
        """
        S = stages
        ipus = S if self.ipus is None else self.ipus
        if ipus % S:
            raise OptionsError(
                f"auto_select_ipus ({ipus}) must be a multiple of the model's {S} pipeline "
                f"stages: select {S * max(1, ipus // S)} or another multiple of {S} IPUs "
                f"(each replica of the pipeline takes {S})")
        return ipus // S

    def check(self, stages: int, spe: int, R: int, training: bool) -> None:
        """The tutorials' rules on the steps per execution and G ([Note: Keras steps]).

        Raises:
            OptionsError: ``spe`` not a multiple of G × replicas.
            PipelineError: G does not suit the schedule (training with stages > 1).
        """
        G = self.G if training else 1
        if spe % (G * R):
            raise OptionsError(
                f"steps_per_execution ({spe}) must be a multiple of "
                f"gradient_accumulation_steps_per_replica ({G}) x replicas ({R}) = {G * R}: "
                f"compile(..., steps_per_execution={G * R * -(-spe // (G * R))})")
        if training and stages > 1:
            self._check_schedule(stages)

    def _check_schedule(self, S: int) -> None:
        G = self.G
        if self.schedule is PipelineSchedule.Grouped and G % (2 * S):
            raise PipelineError(
                f"the Grouped pipeline schedule needs gradient_accumulation_steps_per_replica "
                f"to be a multiple of 2 x stages = {2 * S}, got {G}: call set_pipelining_options("
                f"gradient_accumulation_steps_per_replica={2 * S * -(-G // (2 * S))})")
        if self.schedule is PipelineSchedule.Interleaved and (G % S or G < 2 * S - 1):
            fix = max(S * -(-(2 * S - 1) // S), S * -(-G // S))
            raise PipelineError(
                f"the Interleaved pipeline schedule needs gradient_accumulation_steps_per_replica "
                f"to be a multiple of the {S} stages and at least 2 x stages - 1 = {2 * S - 1}, "
                f"got {G}: call set_pipelining_options(gradient_accumulation_steps_per_replica="
                f"{fix})")

    def options(self, kind: str, spe: int, R: int) -> Options:
        """The PopTorch Options of the ``kind`` wrapper (train, evaluate, predict).

        Example:
            >>> IpuSettings(G=2).options("train", spe=8, R=1).device_iterations
            4
        """
        G = self.G if kind == "train" else 1
        opts = Options().deviceIterations(spe // (G * R)).replicationFactor(R)
        if R > 1:  # [Note: Keras face]: each replica's own buffers, as TF's variables
            opts.broadcastBuffers(False)
        opts.Training.gradientAccumulation(G)
        opts.outputMode(OutputMode.All)
        opts.setExecutionStrategy(PipelinedExecution(schedule=self.schedule))
        if kind == "train" and self.recompute is not None:
            opts._Popart.set("autoRecomputation", 3)
        if kind == "train" and self.offload:
            opts.TensorLocations.setOptimizerLocation(
                TensorLocationSettings().useOnChipStorage(False))
        return opts

    def with_pipelining(self, G=None, schedule=None, recompute=None, offload=None) -> IpuSettings:
        """A copy with the given options changed (None: unchanged), each checked first.

        Raises:
            OptionsError: G is not a positive int, the schedule is unknown or not one of
                Grouped, Interleaved, Sequential, ZeroBubble, or ``recompute`` not a RecomputationMode
                (or the name of one).
        """
        G = self.G if G is None else check_positive_int(
            G, "gradient_accumulation_steps_per_replica",
            "set_pipelining_options(gradient_accumulation_steps_per_replica=1)")
        schedule = self.schedule if schedule is None else PipelineSchedule.parse(schedule)
        if schedule not in (PipelineSchedule.Grouped, PipelineSchedule.Interleaved,
                            PipelineSchedule.Sequential, PipelineSchedule.ZeroBubble):
            raise OptionsError(f"IPU Keras pipelines with the Grouped, Interleaved, Sequential or "
                               f"ZeroBubble schedule, got {schedule.name}; pass one of them to "
                               f"set_pipelining_options")
        if isinstance(recompute, str):  # the mode's name or value, as pipeline() takes it
            key = recompute.lower().replace("_", "")
            recompute = next((m for m in RecomputationMode if key in (
                m.name.lower(), m.value.replace("_", ""))), recompute)
        if recompute is not None and not isinstance(recompute, RecomputationMode):
            raise OptionsError(f"recomputation_mode must be a keras.RecomputationMode or its "
                               f"name, got {recompute!r}; pass e.g. RecomputationMode.Auto or "
                               f"'Auto'")
        return dataclasses.replace(
            self, G=G, schedule=schedule, recompute=recompute or self.recompute,
            offload=self.offload if offload is None else bool(offload))
