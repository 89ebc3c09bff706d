"""Options for IPU attachment, compilation and profiling: stored, ignored, warned once.

PopTorch's ``Options`` has a row of setters that only steer the IPU device,
the Poplar compiler or its logs (POPTORCH_REFERENCE.md §4: ``useIpuModel``,
``connectionType``, ``enableProfiling``, ...). ``Options`` inherits them from
:class:`DeviceOptions`: each validates as PopTorch does, stores its value
(read back as the snake_case attribute listed in :data:`DEVICE_DEFAULTS`) and
warns once per process (``errors.warn_once``) that it has no effect. Two have
a consequence here and say so: ``connectionType(ConnectionType.Never)`` (and
``useOfflineIpuTarget``) make a wrapped model refuse to run, and
``enableSyntheticData`` does *not* replace the inputs.

Example:
    >>> from poptorch_lite.options import Options
    >>> Options().logDir("/tmp/logs").log_dir  # doctest: +SKIP
    '/tmp/logs'
"""

from __future__ import annotations

from typing import Any, Optional

from . import errors
from .enums import ConnectionType, OutputMode, SyncPattern
from .options_base import check_bool, coerce_enum, setter, warn_ipu_only

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


def _attr(method: str):
    return lambda group, value: getattr(group, method)(value)


#: snake_case attribute -> setter, for ``opts.<attribute> = value``.
DEVICE_ATTRIBUTES = {
    "auto_round_num_ipus": _attr("autoRoundNumIPUs"), "use_model": _attr("useIpuModel"),
    "executable_cache_dir": _attr("enableExecutableCaching"),
    "connection_type": _attr("connectionType"), "ipu_id": _attr("useIpuId"),
    "ipu_version": _attr("useOfflineIpuTarget"), "sync_pattern": _attr("syncPattern"),
    "log_cycle_count": _attr("logCycleCount"), "profile_dir": _attr("enableProfiling"),
    "log_dir": _attr("logDir"), "max_repeat_logs": _attr("maxRepeatLogs"),
    "model_name": _attr("modelName"), "stable_norm": _attr("enableStableNorm"),
    "show_compilation_progress_bar": _attr("showCompilationProgressBar"),
    "relax_optimizer_attributes_checks": _attr("relaxOptimizerAttributesChecks"),
    "source_location_excludes": _attr("sourceLocationExcludes"),
    "updatable_named_buffers": _attr("updatableNamedBuffers"),
    "synthetic_data": _attr("enableSyntheticData"),
    "available_memory_proportion": _attr("setAvailableMemoryProportion"),
}


class DeviceOptions:
    """The IPU device/compile/profiling setters of ``Options`` (a mixin).

    Example:
        >>> from poptorch_lite.options import Options
        >>> Options().useIpuModel(True).use_model  # doctest: +SKIP
        True
    """

    def _ipu_only(self, name: str, detail: str = "", **values: Any) -> None:
        self._store(**values)
        warn_ipu_only(f"Options.{name}", detail)

    @setter
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True):
        """Round the IPU count up to a power of 2 (any count works here)."""
        self._ipu_only("autoRoundNumIPUs", auto_round_num_ipus=auto_round_num_ipus)

    @setter
    def useIpuModel(self, use_model: bool):
        """Run on the IPU Model simulator."""
        self._ipu_only("useIpuModel", use_model=use_model)

    @setter
    def enableExecutableCaching(self, path: Optional[str]):
        """Cache compiled executables in ``path`` (None disables)."""
        self._ipu_only("enableExecutableCaching", executable_cache_dir=path)

    @setter
    def connectionType(self, connection_type: ConnectionType):
        """When to attach to the IPU; ``Never`` = compile only (calls are refused)."""
        ct = coerce_enum(connection_type, ConnectionType, "connectionType")
        self._ipu_only("connectionType", "With ConnectionType.Never a wrapped model "
                       "compiles but refuses to run, as in PopTorch", connection_type=ct)

    @setter
    def useIpuId(self, ipu_id: int):
        """Use the IPU device with this ``gc-info`` id."""
        if isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0:
            raise errors.OptionsError(
                f"useIpuId needs a non-negative int, got {ipu_id!r}; call e.g. "
                f"opts.useIpuId(0)")
        self._ipu_only("useIpuId", ipu_id=ipu_id)

    @setter
    def useOfflineIpuTarget(self, ipu_version: int = 2):
        """Compile for an offline IPU target; sets ``connectionType(Never)``."""
        self._ipu_only("useOfflineIpuTarget", "It sets connectionType(Never): a "
                       "wrapped model compiles but refuses to run",
                       ipu_version=ipu_version, connection_type=ConnectionType.Never)

    @setter
    def syncPattern(self, sync_pattern: SyncPattern):
        """IPU synchronisation pattern."""
        sp = coerce_enum(sync_pattern, SyncPattern, "syncPattern")
        self._ipu_only("syncPattern", sync_pattern=sp)

    @setter
    def logCycleCount(self, log_cycle_count: bool):
        """Log IPU cycle counts."""
        self._ipu_only("logCycleCount", log_cycle_count=log_cycle_count)

    @setter
    def enableProfiling(self, profile_dir: Optional[str] = None):
        """Write Poplar profiling reports to ``profile_dir`` (default ``.``)."""
        self._ipu_only("enableProfiling", profile_dir=profile_dir or ".")

    @setter
    def logDir(self, log_dir: str):
        """Directory for PopTorch's log files."""
        self._ipu_only("logDir", log_dir=log_dir)

    @setter
    def maxRepeatLogs(self, number_repeats: int):
        """Cap on repeats of a repeated log message."""
        self._ipu_only("maxRepeatLogs", max_repeat_logs=number_repeats)

    @setter
    def modelName(self, name: str):
        """Model name used for profile sub-directories."""
        self._ipu_only("modelName", model_name=name)

    @setter
    def enableStableNorm(self, enabled: bool):
        """Use the slower, more stable IPU norm kernels."""
        self._ipu_only("enableStableNorm", stable_norm=enabled)

    @setter
    def showCompilationProgressBar(self, show: bool = True):
        """Show the Poplar compilation progress bar."""
        self._ipu_only("showCompilationProgressBar", show_compilation_progress_bar=show)

    @setter
    def relaxOptimizerAttributesChecks(self, relax: bool = True):
        """Turn PopTorch's unexpected-optimizer-attribute warnings into debug logs."""
        self._ipu_only("relaxOptimizerAttributesChecks",
                       relax_optimizer_attributes_checks=relax)

    @setter
    def sourceLocationExcludes(self, excludes: list):
        """Replace the frames skipped in IR source locations."""
        self._ipu_only("sourceLocationExcludes", source_location_excludes=list(excludes))

    @setter
    def appendToLocationExcludes(self, *excludes: str):
        """Add frames skipped in IR source locations."""
        self._ipu_only("appendToLocationExcludes", source_location_excludes=[
            *self.source_location_excludes, *excludes])

    @setter
    def disableModuleNamescope(self):
        """Drop module names from PopART op names."""
        self._ipu_only("disableModuleNamescope", module_namescope_enabled=False)

    @setter
    def updatableNamedBuffers(self, buffers: list):
        """Buffers that ``copyNamedBuffersToDevice`` may update."""
        self._ipu_only("updatableNamedBuffers", updatable_named_buffers=list(buffers))

    @setter
    def enableSyntheticData(self, enabled: bool):
        """IPU benchmarking without host I/O: here the inputs are NOT replaced."""
        self._ipu_only("enableSyntheticData", "poptorch_lite does NOT replace the "
                       "inputs by random data: the model runs on the real host "
                       "inputs and its numerics stay real", synthetic_data=enabled)

    @setter
    def setAvailableMemoryProportion(self, available_memory_proportion: dict):
        """Temporary memory per IPU, e.g. ``{"IPU0": 0.5}``."""
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
        """Anchor a PopART tensor by name (PopART names do not exist here)."""
        anchors = dict(self.anchored_tensors)
        anchors[short_name] = [long_name, output_mode, output_return_period]
        self._ipu_only("anchorTensor", anchored_tensors=anchors)
