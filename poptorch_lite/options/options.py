"""PopTorch's ``Options``: batch arithmetic, execution strategy and device mapping.

``Options`` keeps PopTorch's setter names (camelCase, chaining) and reads back
as snake_case attributes (POPTORCH_REFERENCE.md §4). The core options here
change what a call computes; the IPU-only ones are stored and ignored with one warning
each ([Note: IPU-only options]; the groups' in ``options/ipu.py``). The machinery
(attribute access, freezing) is ``options/base.py``; see [Note: frozen options].
:func:`combined_batch_size` is the one place that computes the combined batch.

[Note: IPU-only options]
PopTorch's ``Options`` has a row of setters that only steer the IPU device,
the Poplar compiler or its logs (POPTORCH_REFERENCE.md §4: ``useIpuModel``,
``connectionType``, ``enableProfiling``, ...). Each validates as PopTorch does, stores its
value (read back as the snake_case attribute listed in ``device.DEVICE_DEFAULTS``) and
warns once per process (``errors.warn_once``) that it has no effect. Two have
a consequence here and say so: ``connectionType(ConnectionType.Never)`` (and
``useOfflineIpuTarget``) make a wrapped model refuse to run, and
``enableSyntheticData`` replaces the inputs by synthetic data as PopART does
([Note: synthetic data] in ``runtime/batch.py``).

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
from ..enums import CommGroupType, ConnectionType, OutputMode, SyncPattern, SyntheticDataMode
from ..strategies import ExecutionStrategy, PipelinedExecution
from . import config
from .base import (OptionGroup, check_bool, check_positive_int, coerce_enum, setter, via_setter,
                   warn_ipu_only)
from .device import DEVICE_ATTRIBUTES, DEVICE_DEFAULTS, IpuDeviceMap, _device
from .groups import _DistributedOptions, _TrainingOptions
from .ipu import _JitOptions, _PopartOptions, _PrecisionOptions, _TensorLocationOptions

#: The backends ``Options.compileStages`` takes (``torch.compile``'s names).
BACKENDS = ("inductor", "aot_eager", "eager")

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


class Options(OptionGroup):
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
    Jit = property(lambda self: self._jit,
                   doc="Tracing options (traceModel: the tensor names before PopTorch 3.0).")
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

    @setter
    def compileStages(self, enabled: bool = True, backend: Optional[str] = None,
                      cuda_graph: bool = True):
        """Compile each stage's graphs once, as PopTorch compiles its program (poptorch_lite's
        own; off by default).

        Off, every op runs eagerly and a call is bit-exact to plain PyTorch. On, each
        stage's forward and backward (and a recomputed stage's segments) are compiled by
        ``backend`` on the stage's first call: fused kernels, the numbers within float
        reassociation of plain PyTorch (1e-4 relative over 20 steps), dropout masks still
        plain PyTorch's (docs/TUTORIAL.md, section 9). A stage too small for compiling to
        pay, or one the backend cannot compile, runs eagerly, and the log says which and
        why ([Note: compiled stages] in ``compiler/compiled_stages``). On a GPU, once the
        program is warm, each optimizer step (every micro-batch's stage actions, the
        reduction and, where it is graph-safe, the optimizer's step) is also captured as
        one CUDA graph and replayed ([Note: step graphs] in ``runtime/step_graph``).

        Args:
            enabled: compile the stages.
            backend: ``"inductor"`` (fused kernels), ``"aot_eager"`` (AOTAutograd's
                forward and backward graphs, run by eager kernels: quick to compile, for
                checking) or ``"eager"`` (no compiler: the stages' own kernels, so a
                captured step replays exactly what the eager path runs); None: the
                default of each stage's device, ``"inductor"`` on CPUs and GPUs.
            cuda_graph: on a GPU, capture each step as one CUDA graph (False: the
                compiled stages run op by op, launched from Python).

        Raises:
            OptionsError: a backend not among those, or a flag that is not a bool.

        Example:
            >>> from poptorch_lite.options import Options
            >>> opts = Options().compileStages(True, backend="aot_eager")
            >>> opts.compile_stages, opts.compile_backend, opts.compile_cuda_graph
            (True, 'aot_eager', True)
        """
        if backend is not None and backend not in BACKENDS:
            raise errors.OptionsError(
                f"compileStages: backend {backend!r} is not one of {list(BACKENDS)}; pass one "
                f"of those, or None for the default of each stage's device (inductor)")
        if not isinstance(cuda_graph, bool):
            raise errors.OptionsError(
                f"compileStages: cuda_graph needs a bool, got {cuda_graph!r} "
                f"({type(cuda_graph).__name__}); pass cuda_graph=True or cuda_graph=False")
        self._store(compile_stages=check_bool(enabled, "compileStages"), compile_backend=backend,
                    compile_cuda_graph=cuda_graph)

    # -- the IPU-only setters: stored, ignored, warned once ([Note: IPU-only options]) ----

    def _ipu_only(self, name: str, detail: str = "", **values: Any) -> None:
        self._store(**values)
        warn_ipu_only(f"Options.{name}", detail)

    @setter
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True):
        """Round the IPU count up to a power of 2 (any count works here).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().autoRoundNumIPUs().auto_round_num_ipus
            True
        """
        self._ipu_only("autoRoundNumIPUs", auto_round_num_ipus=auto_round_num_ipus)

    @setter
    def useIpuModel(self, use_model: bool):
        """Give every IPU id a memory of its own, even on one device (PopTorch's IPU Model).

        PopTorch's IPU Model simulates the hardware on the host. Here every IPU
        keeps its own copies of its parameters, gradients, optimizer state and
        buffers, and values crossing stages are copied, even where several IPUs
        map to the same CPU ([Note: weight homes] in ``weights``): the path that
        separate GPUs take runs, and is tested, on a machine without one. The
        numbers are the same; the host model is brought up to date as on a GPU
        ([Note: weight sync] in ``runtime/host_sync.py``).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().useIpuModel(True).use_model
            True
        """
        self._store(use_model=check_bool(use_model, "useIpuModel"))

    @setter
    def enableExecutableCaching(self, path: Optional[str]):
        """Cache compiled executables in ``path`` (None disables).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().enableExecutableCaching('/tmp/cache').executable_cache_dir
            '/tmp/cache'
        """
        self._ipu_only("enableExecutableCaching", executable_cache_dir=path)

    @setter
    def connectionType(self, connection_type: ConnectionType):
        """When to attach to the IPU; ``Never`` = compile only (calls are refused).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().connectionType(ConnectionType.OnDemand).connection_type
            <ConnectionType.OnDemand: 1>
        """
        ct = coerce_enum(connection_type, ConnectionType, "connectionType")
        self._ipu_only("connectionType", "With ConnectionType.Never a wrapped model "
                       "compiles but refuses to run, as in PopTorch", connection_type=ct)

    @setter
    def useIpuId(self, ipu_id: int):
        """Use the IPU device with this ``gc-info`` id.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().useIpuId(1).ipu_id
            1
        """
        if isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0:
            raise errors.OptionsError(
                f"useIpuId needs a non-negative int, got {ipu_id!r}; call e.g. "
                f"opts.useIpuId(0)")
        self._ipu_only("useIpuId", ipu_id=ipu_id)

    @setter
    def useOfflineIpuTarget(self, ipu_version: int = 2):
        """Compile for an offline IPU target; sets ``connectionType(Never)``.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().useOfflineIpuTarget().connection_type
            <ConnectionType.Never: 2>
        """
        self._ipu_only("useOfflineIpuTarget", "It sets connectionType(Never): a "
                       "wrapped model compiles but refuses to run",
                       ipu_version=ipu_version, connection_type=ConnectionType.Never)

    @setter
    def syncPattern(self, sync_pattern: SyncPattern):
        """IPU synchronisation pattern.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().syncPattern(SyncPattern.SinglePipeline).sync_pattern
            <SyncPattern.SinglePipeline: 1>
        """
        sp = coerce_enum(sync_pattern, SyncPattern, "syncPattern")
        self._ipu_only("syncPattern", sync_pattern=sp)

    @setter
    def logCycleCount(self, log_cycle_count: bool):
        """Log IPU cycle counts.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().logCycleCount(True).log_cycle_count
            True
        """
        self._ipu_only("logCycleCount", log_cycle_count=log_cycle_count)

    @setter
    def enableProfiling(self, profile_dir: Optional[str] = None):
        """Write Poplar profiling reports to ``profile_dir`` (default ``.``).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().enableProfiling('prof').profile_dir
            'prof'
        """
        self._ipu_only("enableProfiling", profile_dir=profile_dir or ".")

    @setter
    def logDir(self, log_dir: str):
        """Directory for PopTorch's log files.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().logDir('logs').log_dir
            'logs'
        """
        self._ipu_only("logDir", log_dir=log_dir)

    @setter
    def maxRepeatLogs(self, number_repeats: int):
        """Cap on repeats of a repeated log message.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().maxRepeatLogs(2).max_repeat_logs
            2
        """
        self._ipu_only("maxRepeatLogs", max_repeat_logs=number_repeats)

    @setter
    def modelName(self, name: str):
        """Model name used for profile sub-directories.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().modelName('mnist').model_name
            'mnist'
        """
        self._ipu_only("modelName", model_name=name)

    @setter
    def enableStableNorm(self, enabled: bool):
        """Use the slower, more stable IPU norm kernels.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().enableStableNorm(True).stable_norm
            True
        """
        self._ipu_only("enableStableNorm", stable_norm=enabled)

    @setter
    def showCompilationProgressBar(self, show: bool = True):
        """Show the Poplar compilation progress bar.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().showCompilationProgressBar(False).show_compilation_progress_bar
            False
        """
        self._ipu_only("showCompilationProgressBar", show_compilation_progress_bar=show)

    @setter
    def relaxOptimizerAttributesChecks(self, relax: bool = True):
        """Turn PopTorch's unexpected-optimizer-attribute warnings into debug logs.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().relaxOptimizerAttributesChecks().relax_optimizer_attributes_checks
            True
        """
        self._ipu_only("relaxOptimizerAttributesChecks",
                       relax_optimizer_attributes_checks=relax)

    @setter
    def sourceLocationExcludes(self, excludes: list):
        """Replace the frames skipped in IR source locations.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().sourceLocationExcludes(['lib/']).source_location_excludes
            ['lib/']
        """
        self._ipu_only("sourceLocationExcludes", source_location_excludes=list(excludes))

    @setter
    def appendToLocationExcludes(self, *excludes: str):
        """Add frames skipped in IR source locations.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().appendToLocationExcludes('lib/').source_location_excludes[-1]
            'lib/'
        """
        self._ipu_only("appendToLocationExcludes", source_location_excludes=[
            *self.source_location_excludes, *excludes])

    @setter
    def disableModuleNamescope(self):
        """Drop module names from PopART op names.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().disableModuleNamescope().module_namescope_enabled
            False
        """
        self._ipu_only("disableModuleNamescope", module_namescope_enabled=False)

    @setter
    def updatableNamedBuffers(self, buffers: list):
        """Buffers that ``copyNamedBuffersToDevice`` may update (checked against the model's
        buffers when it compiles).

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().updatableNamedBuffers(['bn.running_mean']).updatable_named_buffers
            ['bn.running_mean']
        """
        self._store(updatable_named_buffers=list(buffers))

    @setter
    def enableSyntheticData(self, enabled: bool):
        """Run on synthetic data instead of the host's inputs, as PopTorch does.

        PopTorch sets PopART's ``syntheticDataMode`` to 2 (RandomNormal) when
        ``enabled`` is true, else 0 (Off); ``_Popart.set("syntheticDataMode", 1)``
        asks for zeros ([Note: synthetic data] in ``runtime/batch.py``). Warns once
        that the numbers then differ from the inputs'.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().enableSyntheticData(False).synthetic_data_mode
            <SyntheticDataMode.Off: 0>
        """
        self._store(synthetic_data=enabled)
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)

    @property
    def synthetic_data_mode(self) -> SyntheticDataMode:
        """What the model sees instead of the inputs (PopART's ``syntheticDataMode``)."""
        return SyntheticDataMode(self._Popart.options.get("syntheticDataMode", 0))

    @setter
    def setAvailableMemoryProportion(self, available_memory_proportion: dict):
        """Temporary memory per IPU, e.g. ``{"IPU0": 0.5}``.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().setAvailableMemoryProportion({'IPU0': 0.5}).available_memory_proportion
            {0: 0.5}
        """
        if not isinstance(available_memory_proportion, dict):
            raise errors.OptionsError(
                f"setAvailableMemoryProportion needs a dict such as {{'IPU0': 0.5}}, "
                f"got {available_memory_proportion!r}")
        memory = {}
        for key, proportion in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU") and key[3:].isdigit()):
                raise errors.OptionsError(
                    f"Available memory proportions are expected to be in a "
                    f"dictionary of {{\"IPU0\": 0.5}} where the 0 in IPU is the "
                    f"index of the IPU. Invalid key: {key!r}; use keys 'IPU0', 'IPU1', ...")
            if isinstance(proportion, bool) or not isinstance(proportion, (int, float)):
                raise errors.OptionsError(
                    f"setAvailableMemoryProportion: the proportion for {key!r} must "
                    f"be a number between 0 and 1, got {proportion!r}")
            memory[int(key[3:])] = float(proportion)
        self._ipu_only("setAvailableMemoryProportion", available_memory_proportion=memory)

    @setter
    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[OutputMode] = None,
                     output_return_period: Optional[int] = 1):
        """Anchor the tensor ``long_name`` of the model, read after a call with
        ``PoplarExecutor.getAnchoredTensor(short_name)`` ([Note: anchored tensors] in
        ``anchors``: the names are checked against ``getTensorNames()`` on the first call).

        Raises:
            OptionsError: a name is not a string, or the mode not an ``OutputMode``.

        Example:
            >>> from poptorch_lite.options import Options
            >>> Options().anchorTensor('grad', 'Gradient___fc.bias').anchored_tensors
            {'grad': ['Gradient___fc.bias', None, 1]}
        """
        if not isinstance(short_name, str) or not isinstance(long_name, str) or not (
                output_mode is None or isinstance(output_mode, OutputMode)):
            raise errors.OptionsError(
                f"anchorTensor({short_name!r}, {long_name!r}, {output_mode!r}): the names must "
                f"be strings and the mode a poptorch.OutputMode, e.g. anchorTensor('grad', "
                f"'Gradient___fc.bias', poptorch.OutputMode.Final)")
        anchors = dict(self.anchored_tensors)
        anchors[short_name] = [long_name, output_mode, output_return_period]
        self._store(anchored_tensors=anchors)

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
