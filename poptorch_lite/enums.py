"""The enumerations of PopTorch's API, plus poptorch_lite's pipeline schedules.

Every IntEnum below has PopTorch's name, member names and integer values
(pt:python/enums.py), so ``import poptorch_lite as poptorch`` keeps scripts that
write ``poptorch.OutputMode.All`` or pass the integer working. Only
:class:`PipelineSchedule` is poptorch_lite's own. This module does not import
torch.

Example:
    >>> OutputMode.All == 2, AnchorMode is OutputMode
    (True, True)
"""

from __future__ import annotations

import enum

from . import errors


class OutputMode(enum.IntEnum):
    """Which outputs a call returns (POPTORCH_REFERENCE.md §3).

    ``Final``: the last micro-batch; ``EveryN``: every N-th device iteration
    (N = ``output_return_period``); ``All``: every micro-batch; ``Sum``: the
    element-wise sum over micro-batches; ``Default``: ``Final`` for
    ``trainingModel``, ``All`` for ``inferenceModel``.

    Example:
        >>> OutputMode(2).name
        'All'
    """

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


#: Pre-2.4 name of :class:`OutputMode` (same class, same values), for old scripts.
AnchorMode = OutputMode


class ReductionType(enum.IntEnum):
    """How gradients are reduced over accumulation steps and replicas.

    ``Sum`` adds them, ``Mean`` (the default) averages them; ``NoReduction`` is
    refused by ``Training.accumulationAndReplicationReductionType``.

    Example:
        >>> ReductionType.Mean.value
        1
    """

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the mean reduction divides (IPU-only: numerically equal in fp32).

    Example:
        >>> MeanReductionStrategy.Post.value
        1
    """

    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    """How ``poptorch.DataLoader`` loads: in the caller (``Sync``), in a
    separate process (``Async``), or in a separate process that also rebatches
    (``AsyncRebatched``).

    Example:
        >>> DataLoaderMode.Async.value
        1
    """

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How an ``AsynchronousDataAccessor`` shares data with its worker process.

    Example:
        >>> SharingStrategy.ForkServer.value
        3
    """

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class ConnectionType(enum.IntEnum):
    """When to attach to the device. ``Never`` means compile only: a wrapped
    model with ``connectionType(ConnectionType.Never)`` refuses to run.

    Example:
        >>> ConnectionType.Never.value
        2
    """

    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.IntEnum):
    """IPU synchronisation pattern (IPU-only).

    Example:
        >>> SyncPattern.Full.value
        0
    """

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class SyntheticDataMode(enum.IntEnum):
    """PopART's ``SyntheticDataMode`` (``popart.SyntheticDataMode``), the values PopTorch's
    ``enableSyntheticData`` documents: what a model sees instead of the host's inputs.

    Example:
        >>> int(SyntheticDataMode.RandomNormal)
        2
    """

    Off = 0
    Zeros = 1
    RandomNormal = 2


class CommGroupType(enum.IntEnum):
    """How replicas are grouped, e.g. in ``Options.inputReplicaGrouping``.

    ``Consecutive``: groups ``{0..k-1}, {k..2k-1}, ...``; ``Orthogonal``: groups
    ``{0, m, 2m, ...}, {1, m+1, ...}`` with ``m = R / k``; ``NoGrouping``: every
    replica on its own; ``All``: one group of every replica (not valid for
    inputs).

    Example:
        >>> CommGroupType.Orthogonal.value
        2
    """

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """What the host holds of a per-replica variable (``replicaGrouping``): ``OnePerGroup``
    one value per group of replicas, along dim 0; ``AllReplicas`` one per replica.

    Example:
        >>> VariableRetrievalMode.OnePerGroup.value
        0
    """

    OnePerGroup = 0
    AllReplicas = 1


class Liveness(enum.IntEnum):
    """Where phased execution keeps tensors between phases (IPU-only).

    Example:
        >>> Liveness.OffChipAfterFwd.value
        1
    """

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class AutoStage(enum.IntEnum):
    """How blocks get stages when an execution strategy names no stages.

    ``SameAsIpu`` (the default): stage id = the block's ``ipu_id``;
    ``AutoIncrement``: each new block gets the next stage id.

    Example:
        >>> AutoStage.AutoIncrement.value
        1
    """

    SameAsIpu = 0
    AutoIncrement = 1


class HalfFloatCastingBehavior(enum.IntEnum):
    """Casting of mixed float16/float32 ops (``Precision.halfFloatCasting``, IPU-only).

    Example:
        >>> HalfFloatCastingBehavior.HalfUpcastToFloat.value
        1
    """

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class MatMulSerializationMode(enum.Enum):
    """Which dimension ``serializedMatMul`` splits (IPU memory tuning only).

    Example:
        >>> MatMulSerializationMode.OutputChannels.value
        'output_channels'
    """

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class OverlapMode(enum.Enum):
    """Host/IPU I/O overlap for ``set_overlap_for_input/output`` (IPU-only).

    Example:
        >>> OverlapMode.NoOverlap.value
        'no_overlap'
    """

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class MultiConvPlanType(enum.IntEnum):
    """How ``poptorch.MultiConv`` plans its convolutions (IPU-only).

    Example:
        >>> MultiConvPlanType.Serial.value
        1
    """

    Parallel = 0
    Serial = 1


class PipelineSchedule(enum.Enum):
    """The order in which pipeline stages run their actions (poptorch_lite's own).

    Graphcore's documentation names its pipelining kinds; poptorch_lite adds
    GPipe for comparison with ``torch.distributed.pipelining``:

    - ``Sequential``: one action at a time, scheduled like a sharded model (a
      debug mode; what ``ShardedExecution`` and the phased strategies use).
    - ``Grouped``: Graphcore's default. In the steady state all stages run their
      forwards together, then all run their backwards together (more
      activations in flight).
    - ``Interleaved``: a stage runs a backward as soon as its forward has produced
      what it needs, one forward then one backward (1F1B): fewest stashed
      activations.
    - ``GPipe``: fill-drain: every forward of the step, then every backward.
    - ``ZeroBubble``: 1F1B with each backward split into its input gradients and its
      weight gradients, the latter run where a stage would wait (ZB-H1: 1F1B's
      peak stash, a smaller bubble). Stages whose ``ipu_id``s repeat become
      virtual stages interleaved on their IPUs (the V of ZBV, or a loop).

    The timelines themselves live in the schedule module.

    Example:
        >>> PipelineSchedule.parse("Interleaved")
        <PipelineSchedule.Interleaved: 'interleaved'>
    """

    Sequential = "sequential"
    Grouped = "grouped"
    Interleaved = "interleaved"
    GPipe = "gpipe"
    ZeroBubble = "zero_bubble"

    @classmethod
    def parse(cls, name: PipelineSchedule | str) -> PipelineSchedule:
        """Return the schedule named by a member or a case-insensitive string.

        Args:
            name: a :class:`PipelineSchedule`, or its value or member name in
                any case (``"gpipe"``, ``"GPipe"``, ``"INTERLEAVED"``).

        Returns:
            The member.

        Raises:
            errors.OptionsError: ``name`` names no schedule.

        Example:
            >>> PipelineSchedule.parse("gpipe") is PipelineSchedule.GPipe
            True
        """
        if isinstance(name, cls):
            return name
        if isinstance(name, str):
            wanted = name.strip().lower()
            for member in cls:
                if wanted in (member.value, member.name.lower()):
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise errors.OptionsError(
            f"Unknown pipeline schedule {name!r}; valid choices are {choices} "
            f"(or poptorch_lite.PipelineSchedule.<Name>); pass e.g. "
            f"schedule='grouped'")
