"""Where ``Options`` maps IPUs to torch devices, and the defaults of its IPU-only values.

``Options.set_ipu_devices`` takes devices as strings or ``torch.device``s
(:func:`normalize_device`, :func:`_device`) and keeps the mapping as an
:class:`IpuDeviceMap`. PopTorch's IPU-only setters (``useIpuModel``, ``connectionType``,
``enableProfiling``, ...; [Note: IPU-only options] in ``options/options.py``) store the values
whose defaults are :data:`DEVICE_DEFAULTS`, read back and set through
:data:`DEVICE_ATTRIBUTES`.

Example:
    >>> normalize_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .. import errors
from ..enums import ConnectionType, SyncPattern
from .base import via_setter

#: Defaults of the values the IPU-only setters store on ``Options``.
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
