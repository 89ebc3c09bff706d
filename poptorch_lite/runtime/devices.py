"""Devices: the torch device each IPU id runs on, from the options or by default.

[Note: GPUs of a process]
Devices are compared as given by ``options.device.normalize_device``: ``"cuda"`` is the
current CUDA device with its index. Without ``Options.set_ipu_devices``,
IPU k of a process runs on a GPU of the process's own block: with torchrun's
``LOCAL_WORLD_SIZE`` = n processes on a host of c GPUs, local process r owns
cuda:r·(c//n) .. cuda:(r+1)·(c//n)-1 and its IPUs go round-robin over them;
one process alone uses every GPU, from the current one on. More processes than
GPUs on a host are refused.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from ..errors import OptionsError
from ..options.device import normalize_device


def local_process() -> tuple:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` of this process on its host (torchrun's variables).

    Under ``torchrun --nproc_per_node 4`` the third process gets ``(2, 4)``; a process
    started without them ``(0, 1)``. A launcher that sets only ``LOCAL_RANK`` r counts
    as r + 1 processes.
    """
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), rank + 1)


def process_gpu() -> int:
    """The first GPU of this process's block ([Note: GPUs of a process]); CUDA must be present."""
    rank, processes = local_process()
    count = torch.cuda.device_count()
    return rank * max(count // processes, 1) % count


def default_device(ipu: int) -> torch.device:
    """IPU ``ipu``'s device when no mapping is given ([Note: GPUs of a process]).

    Raises:
        OptionsError: more processes on this host than it has GPUs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    rank, processes = local_process()
    if processes == 1:  # one process: every GPU, from the current one on
        return torch.device("cuda", (torch.cuda.current_device() + ipu) % count)
    per = count // processes
    if per == 0:
        raise OptionsError(
            f"{processes} processes on this host (LOCAL_WORLD_SIZE) share {count} GPU"
            f"{'s' if count != 1 else ''}, so processes would run IPUs on the same GPU "
            f"and contend for it; start at most {count} processes per host (torchrun "
            f"--nproc_per_node {count}), or map the IPUs yourself with "
            f"opts.set_ipu_devices(...)")
    return torch.device("cuda", rank * per + ipu % per)


def resolve_devices(ipus: Sequence[int], mapping: Optional[dict]) -> dict:
    """IPU id -> torch.device, from ``Options.set_ipu_devices`` or the default.

    Raises:
        OptionsError: an IPU is mapped to a CUDA device this machine does not have.

    Example:
        >>> resolve_devices([0, 1], {0: torch.device("cpu"), 1: torch.device("cpu")})[1]
        device(type='cpu')
    """
    devices = {}
    for ipu in ipus:
        if mapping is not None and ipu in mapping:
            devices[ipu] = normalize_device(mapping[ipu])
        else:
            devices[ipu] = default_device(ipu)
        dev = devices[ipu]
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if dev.index >= count:
                raise OptionsError(
                    f"IPU {ipu} is mapped to {dev}, but this machine has {count} CUDA "
                    f"device{'s' if count != 1 else ''}"
                    f"{'' if count else ' (torch.cuda.is_available() is False)'}; map it to "
                    f"{'cuda:0..cuda:' + str(count - 1) if count else 'the CPU'} with "
                    f"opts.set_ipu_devices(...)")
        elif dev.type != "cpu":
            raise OptionsError(
                f"IPU {ipu} is mapped to {dev}, but poptorch_lite runs stages on 'cpu' or "
                f"'cuda' devices; map it to one of those with opts.set_ipu_devices(...)")
    return devices
