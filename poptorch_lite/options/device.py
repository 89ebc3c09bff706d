"""Options for IPU attachment, compilation and profiling: stored, ignored, warned once.

PopTorch's ``Options`` has a row of setters that only steer the IPU device,
the Poplar compiler or its logs (POPTORCH_REFERENCE.md §4: ``useIpuModel``,
``connectionType``, ``enableProfiling``, ...). ``Options`` inherits them from
:class:`DeviceOptions`: each validates as PopTorch does, stores its value
(read back as the snake_case attribute listed in :data:`DEVICE_DEFAULTS`) and
warns once per process (``errors.warn_once``) that it has no effect. Two have
a consequence here and say so: ``connectionType(ConnectionType.Never)`` (and
``useOfflineIpuTarget``) make a wrapped model refuse to run, and
``enableSyntheticData`` replaces the inputs by synthetic data as PopART does
([Note: synthetic data] in ``runtime/batch.py``).

Example:
    >>> from poptorch_lite.options import Options
    >>> Options().logDir("/tmp/logs").log_dir
    '/tmp/logs'
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .. import errors
from ..enums import ConnectionType, OutputMode, SyncPattern, SyntheticDataMode
from .base import check_bool, coerce_enum, setter, via_setter, warn_ipu_only

#: Defaults of the values the setters below store on ``Options``.
DEVICE_DEFAULTS: dict[str, Any] = dict(
    auto_round_num_ipus=False, use_model=False, executable_cache_dir=None,
    connection_type=ConnectionType.Always, ipu_id=None, ipu_version=None,
    sync_pattern=SyncPattern.Full, log_cycle_count=False, profile_dir=None,
    log_dir=".", max_repeat_logs=None, model_name=None, stable_norm=False,
    show_compilation_progress_bar=True, relax_optimizer_attributes_checks=False,
    source_location_excludes=["install/poptorch", "site-packages/torch",
                              "site-packages/poptorch"],
    module_namescope_enabled=True, updatable_named_buffers=[], synthetic_data=False,
    available_memory_proportion={}, anchored_tensors={})



#: snake_case attribute -> setter, for ``opts.<attribute> = value``.
DEVICE_ATTRIBUTES = {
    "auto_round_num_ipus": via_setter("autoRoundNumIPUs"), "use_model": via_setter("useIpuModel"),
    "executable_cache_dir": via_setter("enableExecutableCaching"),
    "connection_type": via_setter("connectionType"), "ipu_id": via_setter("useIpuId"),
    "ipu_version": via_setter("useOfflineIpuTarget"), "sync_pattern": via_setter("syncPattern"),
    "log_cycle_count": via_setter("logCycleCount"), "profile_dir": via_setter("enableProfiling"),
    "log_dir": via_setter("logDir"), "max_repeat_logs": via_setter("maxRepeatLogs"),
    "model_name": via_setter("modelName"), "stable_norm": via_setter("enableStableNorm"),
    "show_compilation_progress_bar": via_setter("showCompilationProgressBar"),
    "relax_optimizer_attributes_checks": via_setter("relaxOptimizerAttributesChecks"),
    "source_location_excludes": via_setter("sourceLocationExcludes"),
    "updatable_named_buffers": via_setter("updatableNamedBuffers"),
    "synthetic_data": via_setter("enableSyntheticData"),
    "available_memory_proportion": via_setter("setAvailableMemoryProportion"),
}


class DeviceOptions:
    """The IPU device/compile/profiling setters of ``Options`` (a mixin).

    Example:
        >>> from poptorch_lite.options import Options
        >>> Options().useIpuModel(True).use_model
        True
    """

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


def normalize_device(device) -> torch.device:
    """``device`` with an index: ``"cuda"`` is the current CUDA device ([Note: GPUs of a process]).

    Two spellings of one GPU must compare equal, or a stage would take a tensor on
    its own GPU for one on another (and copy it, or skip the stream bookkeeping).

    Example:
        >>> normalize_device("cpu")
        device(type='cpu')
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


class IpuDeviceMap(dict):
    """``Options.ipu_devices``: a dict ``{ipu_id: torch.device}``.

    Built by :meth:`Options.set_ipu_devices`. From a single device, it has no
    keys but answers every IPU id with that device (``in``, ``[]``, ``get``).

    Example:
        >>> m = IpuDeviceMap({}, torch.device("cpu"))
        >>> 5 in m, m.get(5)
        (True, device(type='cpu'))
    """

    def __init__(self, devices: Mapping[int, torch.device],
                 every: Optional[torch.device] = None):
        super().__init__(devices)
        self.every = every

    def __contains__(self, ipu: object) -> bool:
        return self.every is not None or super().__contains__(ipu)

    def __missing__(self, ipu: int) -> torch.device:
        if self.every is None:
            raise KeyError(ipu)
        return self.every

    def get(self, ipu: int, default: Any = None) -> Any:
        """The device of ``ipu``, or ``default``.

        Example:
            >>> IpuDeviceMap({0: torch.device("cpu")}).get(1, "default")
            'default'
        """
        return self[ipu] if ipu in self else default

    def __repr__(self) -> str:
        return f"IpuDeviceMap(every IPU: {self.every!r})" if self.every is not None \
            else super().__repr__()


def _device(value: Any, what: str) -> torch.device:
    try:
        if not isinstance(value, (str, torch.device)):
            raise TypeError(type(value).__name__)
        return normalize_device(value)  # "cuda" -> "cuda:<current>" ([Note: GPUs of a process])
    except (RuntimeError, TypeError, ValueError) as e:
        raise errors.OptionsError(
            f"set_ipu_devices: {value!r} for {what} is not a torch device ({e}); "
            f"use a string such as 'cpu', 'cuda' or 'cuda:1', or a torch.device") from None
