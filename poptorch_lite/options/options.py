"""PopTorch's ``Options``: batch arithmetic, execution strategy and device mapping.

``Options`` keeps PopTorch's setter names (camelCase, chaining) and reads back
as snake_case attributes (POPTORCH_REFERENCE.md §4). The core options here
change what a call computes; the IPU-only ones live in ``options/device.py`` and
``options/ipu.py`` (stored and ignored with one warning each). The machinery
(attribute access, freezing) is ``options/base.py``; see [Note: frozen options].
:func:`combined_batch_size` is the one place that computes the combined batch.

Example:
    >>> opts = Options().deviceIterations(2).replicationFactor(2)
    >>> opts.Training.gradientAccumulation(3).gradient_accumulation
    3
    >>> combined_batch_size(opts, 8)
    96
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .. import errors
from ..enums import CommGroupType, OutputMode
from ..strategies import ExecutionStrategy, PipelinedExecution
from . import config
from .base import OptionGroup, check_bool, check_positive_int, coerce_enum, setter, via_setter
from .compile import CompileOptions
from .device import DEVICE_ATTRIBUTES, DEVICE_DEFAULTS, DeviceOptions, IpuDeviceMap, _device
from .groups import _DistributedOptions, _TrainingOptions
from .ipu import _JitOptions, _PopartOptions, _PrecisionOptions, _TensorLocationOptions

DeviceLike = Union[str, torch.device]


def _options_attributes() -> dict:
    attributes = dict(DEVICE_ATTRIBUTES)
    attributes.update({
        "device_iterations": via_setter("deviceIterations"),
        "replication_factor": via_setter("replicationFactor"),
        "input_group_size": lambda g, v: g.inputReplicaGrouping(v, g.input_group_type),
        "input_group_type": lambda g, v: g.inputReplicaGrouping(g.input_group_size, v),
        "output_mode": lambda g, v: g.outputMode(
            v, g.output_return_period if coerce_enum(v, OutputMode, "outputMode")
            == OutputMode.EveryN else None),
        "output_return_period": lambda g, v: g.outputMode(g.output_mode, v),
        "random_seed": via_setter("randomSeed"),
        "execution_strategy": via_setter("setExecutionStrategy"),
        "broadcast_buffers": via_setter("broadcastBuffers"),
        "auto_recomputation": lambda g, v: g._Popart.set("autoRecomputation", v),
        "ipu_devices": via_setter("set_ipu_devices"),
        "watchdog_timeout": via_setter("watchdogTimeout"),
        "all_or_nothing_calls": via_setter("allOrNothingCalls"),
        "compile_stages": via_setter("compileStages"),
        "compile_backend": lambda g, v: g.compileStages(g.compile_stages, v,
                                                        g.compile_cuda_graph),
        "compile_cuda_graph": lambda g, v: g.compileStages(g.compile_stages, g.compile_backend,
                                                           v),
    })
    return attributes


class Options(DeviceOptions, CompileOptions, OptionGroup):
    """Everything that controls how a wrapped model runs (PopTorch's ``poptorch.Options``).

    Every setter returns ``self``; values read back as snake_case attributes;
    ``opts.replication_factor = 4`` calls the setter. ``POPTORCH_DEFAULT_OPTIONS``
    (JSON of ``{"accessor.path": value}``) is applied at construction.

    Attributes:
        device_iterations, replication_factor, input_group_size, output_mode,
        output_return_period, random_seed (None until ``randomSeed``),
        execution_strategy, broadcast_buffers, auto_recomputation, ipu_devices,
        watchdog_timeout, all_or_nothing_calls, compile_stages, compile_backend,
        compile_cuda_graph, use_model: see their setters.

    Example:
        >>> opts = Options().deviceIterations(20).replicationFactor(2).randomSeed(123)
        >>> opts.device_iterations, opts.replication_factor, opts.random_seed
        (20, 2, 123)
    """

    _PATH = "Options"
    _ATTRIBUTES = _options_attributes()
    _GROUPS = ("Training", "Distributed", "Precision", "TensorLocations", "Jit", "_Popart")

    def __init__(self):
        super().__init__(
            device_iterations=1, replication_factor=1, input_group_size=1,
            input_group_type=CommGroupType.Consecutive, output_mode=OutputMode.Default,
            output_return_period=1, random_seed=None,
            execution_strategy=PipelinedExecution(), broadcast_buffers=True,
            ipu_devices=None, watchdog_timeout=600.0, all_or_nothing_calls=False,
            compile_stages=False, compile_backend=None, compile_cuda_graph=True,
            **copy.deepcopy(DEVICE_DEFAULTS))
        self._popart = _PopartOptions()
        self._training = _TrainingOptions()
        self._distributed = _DistributedOptions()
        self._precision = _PrecisionOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._jit = _JitOptions()
        env = os.environ.get("POPTORCH_DEFAULT_OPTIONS")
        if env:
            config.apply_json(self, env, source="POPTORCH_DEFAULT_OPTIONS")

    Training = property(lambda self: self._training, doc="Training options.")
    Distributed = property(lambda self: self._distributed, doc="Multi-process options.")
    Precision = property(lambda self: self._precision, doc="IPU numerics (IPU-only).")
    TensorLocations = property(lambda self: self._tensor_locations,
                               doc="IPU tensor placement (IPU-only).")
    Jit = property(lambda self: self._jit, doc="Tracing options (only traceModel(False)).")
    _Popart = property(lambda self: self._popart, doc="Raw PopART options.")

    @property
    def auto_recomputation(self) -> int:
        """``_Popart.set("autoRecomputation", n)``: 0 off, 3 recompute every forward stage."""
        return self._popart.options.get("autoRecomputation", 0)

    # -- batch arithmetic (POPTORCH_REFERENCE.md §1) ---------------------------------

    @setter
    def deviceIterations(self, device_iterations: int):
        """D: optimizer steps (training) or batches (inference) per call.

        Example:
            >>> Options().deviceIterations(4).device_iterations
            4
        """
        self._store(device_iterations=check_positive_int(device_iterations, "deviceIterations"))

    @setter
    def replicationFactor(self, replication_factor: int):
        """R: data-parallel replicas; their gradients are reduced every step.

        Example:
            >>> Options().replicationFactor(2).replication_factor
            2
        """
        self._store(replication_factor=check_positive_int(replication_factor, "replicationFactor"))

    @setter
    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: CommGroupType = CommGroupType.Consecutive):
        """Replicas in a group of ``input_group_size`` share inputs (combined batch
        divides R by it; it must divide R, checked by :func:`batch_factor`).

        Example:
            >>> Options().replicationFactor(4).inputReplicaGrouping(2, CommGroupType.Orthogonal).input_group_size
            2
        """
        size = check_positive_int(input_group_size, "inputReplicaGrouping")
        kind = coerce_enum(input_group_type, CommGroupType, "inputReplicaGrouping")
        if kind == CommGroupType.All or (kind == CommGroupType.NoGrouping and size != 1):
            raise errors.OptionsError(
                f"inputReplicaGrouping({size}, {kind!r}) is invalid: "
                f"{kind.name} cannot group inputs of size {size}; use "
                f"CommGroupType.Consecutive or CommGroupType.Orthogonal")
        self._store(input_group_size=size, input_group_type=kind)

    # -- outputs (§3) -------------------------------------------------------------------

    @setter
    def outputMode(self, output_mode: OutputMode, output_return_period: Optional[int] = None):
        """Which outputs a call returns; EveryN needs a positive period.

        Example:
            >>> o = Options().outputMode(OutputMode.EveryN, 5)
            >>> o.output_mode, o.output_return_period
            (<OutputMode.EveryN: 1>, 5)
        """
        mode = coerce_enum(output_mode, OutputMode, "outputMode")
        if mode == OutputMode.EveryN:
            check_positive_int(output_return_period, "outputMode(OutputMode.EveryN, period) period",
                               "opts.outputMode(poptorch.OutputMode.EveryN, 1)")
        elif output_return_period is not None:
            warnings.warn(f"outputMode({mode!r}, {output_return_period!r}): the return "
                          f"period is only used with OutputMode.EveryN and is ignored",
                          errors.PoptorchLiteWarning, stacklevel=3)
            output_return_period = None
        self._store(output_mode=mode, output_return_period=output_return_period or 1)

    @setter
    def anchorMode(self, anchor_mode: OutputMode, anchor_return_period: Optional[int] = None):
        """Pre-2.4 name of :meth:`outputMode`.

        Example:
            >>> Options().anchorMode(OutputMode.Sum).output_mode
            <OutputMode.Sum: 3>
        """
        self.outputMode(anchor_mode, anchor_return_period)

    def defaultOutputMode(self) -> bool:
        """True while the output mode is ``OutputMode.Default``.

        Example:
            >>> Options().defaultOutputMode()
            True
        """
        return self.output_mode == OutputMode.Default

    # -- execution ---------------------------------------------------------------------

    @setter
    def randomSeed(self, random_seed: int):
        """Seed the random ops of wrapped models; also calls ``torch.manual_seed``.

        Example:
            >>> Options().randomSeed(42).random_seed
            42
        """
        if isinstance(random_seed, bool) or not isinstance(random_seed, int) \
                or not 0 <= random_seed < 2**64:
            raise errors.OptionsError(
                f"randomSeed needs an int in [0, 2**64), got {random_seed!r}; call "
                f"e.g. opts.randomSeed(42)")
        torch.manual_seed(random_seed)
        self._store(random_seed=random_seed)

    @property
    def _execution_strategy(self) -> ExecutionStrategy:
        """PopTorch's private name of :attr:`execution_strategy` (its own tests read it)."""
        return self.execution_strategy

    @setter
    def setExecutionStrategy(self, strategy: ExecutionStrategy):
        """How blocks become stages: Pipelined (default), Sharded or phased.

        Example:
            >>> from poptorch_lite.strategies import ShardedExecution
            >>> Options().setExecutionStrategy(ShardedExecution("A", "B")).execution_strategy
            ShardedExecution(Stage('A'), Stage('B'))
        """
        if not isinstance(strategy, ExecutionStrategy):
            raise errors.OptionsError(
                f"setExecutionStrategy needs a poptorch execution strategy, got "
                f"{strategy!r} ({type(strategy).__name__}); pass e.g. "
                f"poptorch.PipelinedExecution('B1', 'B2') or poptorch.ShardedExecution()")
        self._store(execution_strategy=strategy)

    @setter
    def broadcastBuffers(self, broadcast_buffers: bool = True):
        """With R > 1: True (default) keeps buffers identical across replicas;
        False lets each replica keep its own (replicated BatchNorm).

        Example:
            >>> Options().broadcastBuffers(False).broadcast_buffers
            False
        """
        self._store(broadcast_buffers=check_bool(broadcast_buffers, "broadcastBuffers"))

    @setter
    def watchdogTimeout(self, seconds: Optional[float]):
        """Fail a call whose actions make no progress for ``seconds`` (poptorch_lite's own).

        A stuck action (a deadlocked data source, a hung collective) then raises
        ``ExecutionError`` naming the stuck actions instead of hanging. Default
        600 s; ``None`` or 0 waits forever. A run on a single CPU stream executes on
        the caller's thread, as plain PyTorch does ([Note: streams] in ``placement``):
        there the watchdog has nothing to watch from, and a stuck op hangs as it would
        without poptorch_lite (Ctrl-C still stops it).

        Raises:
            OptionsError: a negative or non-numeric value.

        Example:
            >>> Options().watchdogTimeout(30).watchdog_timeout
            30.0
        """
        if seconds is not None and (isinstance(seconds, bool) or
                                    not isinstance(seconds, (int, float)) or seconds < 0):
            raise errors.OptionsError(f"watchdogTimeout needs a number of seconds >= 0 or None, got "
                               f"{seconds!r}; call e.g. opts.watchdogTimeout(60)")
        self._store(watchdog_timeout=None if not seconds else float(seconds))

    @setter
    def allOrNothingCalls(self, enabled: bool = True):
        """Undo a whole failed call, not just back to its last step (poptorch_lite's own).

        By default parameters and optimizer state change only in a step's update
        ([Note: commit point] in ``update``), so a failed call leaves them as
        after its last completed step, at no cost on the success path. With this
        on, every training call first copies every parameter and the optimizer
        state (one extra copy of each, per call), so that a failure in any of its
        ``deviceIterations`` steps, even inside the optimizer's step, puts back the
        state from before the call.

        Example:
            >>> Options().allOrNothingCalls().all_or_nothing_calls
            True
        """
        self._store(all_or_nothing_calls=check_bool(enabled, "allOrNothingCalls"))

    @setter
    def set_ipu_devices(self, mapping: Union[DeviceLike, Sequence[DeviceLike],
                                             Mapping[int, DeviceLike]]):
        """Choose the torch device of each IPU id (poptorch_lite's own option).

        Args:
            mapping: a dict ``{ipu_id: device}``, a list/tuple (index = IPU id),
                or one device for every IPU; devices as ``str`` or
                ``torch.device``. Stored in ``ipu_devices`` as an
                :class:`IpuDeviceMap`. Left unset (``ipu_devices`` None), the
                placement module uses the CUDA devices round-robin when CUDA is
                available, else the CPU.

        Raises:
            errors.OptionsError: an IPU id that is not a non-negative int, or a
                device that torch does not parse.

        Example:
            >>> Options().set_ipu_devices(["cpu", "cpu"]).ipu_devices
            {0: device(type='cpu'), 1: device(type='cpu')}
            >>> Options().set_ipu_devices("cpu").ipu_devices[7]
            device(type='cpu')
        """
        if isinstance(mapping, (str, torch.device)):
            self._store(ipu_devices=IpuDeviceMap({}, _device(mapping, "every IPU")))
            return
        if isinstance(mapping, (list, tuple)):
            mapping = dict(enumerate(mapping))
        if not isinstance(mapping, Mapping) or not mapping:
            raise errors.OptionsError(
                f"set_ipu_devices needs a device, a non-empty list of devices or a "
                f"dict {{ipu_id: device}}, got {mapping!r}; call e.g. "
                f"opts.set_ipu_devices(['cuda:0', 'cuda:1'])")
        devices = {}
        for ipu, device in mapping.items():
            if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
                raise errors.OptionsError(
                    f"set_ipu_devices: IPU ids must be non-negative ints, got "
                    f"{ipu!r}; call e.g. opts.set_ipu_devices({{0: 'cuda:0'}})")
            devices[ipu] = _device(device, f"IPU {ipu}")
        self._store(ipu_devices=IpuDeviceMap(dict(sorted(devices.items()))))

    # -- files, copies, export ---------------------------------------------------------

    @setter
    def loadFromFile(self, filepath: Union[str, os.PathLike]):
        """Apply an options file: one setter call per line, without ``options.``.

        Lines are parsed, never executed (see ``options/config.py``). Repeated
        calls accumulate.

        Raises:
            errors.ConfigFileError: naming the file, line and text.

        Example:
            >>> Options().loadFromFile("poptorch.conf")  # doctest: +SKIP
        """
        config.load_file(self, filepath)

    @setter
    def from_json(self, string: str):
        """Set options from JSON ``{"accessor.path": value}``.

        Example:
            >>> Options().from_json('{"replicationFactor": 2}').replication_factor
            2
        """
        config.apply_json(self, string)

    def clone(self) -> Options:
        """An unfrozen deep copy.

        Example:
            >>> o = Options(); o._freeze(); o.clone().deviceIterations(2).is_frozen
            False
        """
        twin = copy.deepcopy(self)
        twin._set_frozen(False)
        return twin


def batch_arithmetic(options: Options) -> str:
    """How :func:`batch_factor` comes about, in the options' own words (for a refusal).

    Example:
        >>> batch_arithmetic(Options().deviceIterations(2))[:27]
        'Options.deviceIterations(2)'
    """
    return (f"Options.deviceIterations({options.device_iterations}) * "
            f"(Options.replicationFactor({options.replication_factor}) / "
            f"Options.inputReplicaGrouping.input_group_size({options.input_group_size})) * "
            f"Options.Training.gradientAccumulation({options.Training.gradient_accumulation})")


def batch_factor(options: Options) -> int:
    """``D * (R / g) * G``: micro-batches in one call's combined batch.

    See :func:`combined_batch_size`.

    Raises:
        errors.OptionsError: ``input_group_size`` does not divide R.

    Example:
        >>> batch_factor(Options().deviceIterations(2).replicationFactor(4).inputReplicaGrouping(2))
        4
    """
    r, g = options.replication_factor, options.input_group_size
    if r % g:
        raise errors.OptionsError(
            f"inputReplicaGrouping({g}) must divide replicationFactor({r}); call "
            f"opts.inputReplicaGrouping(k) with k a divisor of {r}")
    return options.device_iterations * (r // g) * options.Training.gradient_accumulation


def combined_batch_size(options: Options, micro_batch_size: int) -> int:
    """The rows of one call's input: ``B * D * (R / g) * G``.

    PopTorch lays a combined batch out as ``[D, G, R, B, ...]`` flattened on
    dim 0: consecutive micro-batches of B rows; micro-batch k belongs to device
    iteration ``k // (G*R)``, then accumulation step, then replica (replicas in
    an input group of size g share rows, hence ``R / g``). In inference G is 1.

    Args:
        options: the options.
        micro_batch_size: B, the DataLoader's ``batch_size``.

    Raises:
        errors.BatchSizeError: B is not a positive int.

    Example:
        >>> combined_batch_size(Options().deviceIterations(3).replicationFactor(2), 4)
        24
    """
    check = isinstance(micro_batch_size, int) and not isinstance(micro_batch_size, bool)
    if not check or micro_batch_size < 1:
        raise errors.BatchSizeError(
            f"micro_batch_size must be a positive int, got {micro_batch_size!r}; pass "
            f"the DataLoader's batch_size, e.g. 16")
    return micro_batch_size * batch_factor(options)
