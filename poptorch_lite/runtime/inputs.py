"""Inputs: where each IPU reads a run's input leaves, and the copies that put them there.

Before a run, on the caller's thread, each input leaf a stage reads is put in the memory of
its IPU: as it is where it already lies, else copied (to a GPU asynchronously, from pinned
memory; [Note: values crossing streams] in ``streams``).

[Note: copies keep their alignment]
torch's CPU kernels take paths that depend on where a tensor's first element lies in its
64-byte line: ``F.linear`` of rows 3..5 of a (6, 6) float tensor (a view 72 bytes into it)
and of a copy of those rows (64-byte aligned, as torch allocates) differ in the last bit
(2.98e-08 in the fuzzer's finding). Plain PyTorch computes a micro-batch on a view of the
user's batch, so a copy into an IPU's own memory (``useIpuModel``: inputs, and values
crossing between IPUs) and a copy that the forward writes in place instead of the value it
was given ([Note: edited arguments] in ``stage_work``: ``x.mul_(0.5)`` on a micro-batch) are
made at the same offset in their line as the tensor they copy (:func:`memory_copy`), and the
kernels round as they do in plain PyTorch.
"""

from __future__ import annotations

import operator

import torch

from .gpu import joinable

_HOST = torch.device("cpu")
_IS_CPU = operator.attrgetter("is_cpu")
_LINE = 64  # bytes: torch's CPU allocator aligns every allocation to this


def memory_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``t`` whose first element lies at the same offset in its 64-byte
    line as ``t``'s ([Note: copies keep their alignment]); a copy of a tensor that is not
    contiguous keeps its strides instead, and a GPU tensor's is its clone.

    Example:
        >>> x = torch.arange(18.).view(6, 3)[1:3]
        >>> y = memory_copy(x)
        >>> torch.equal(x, y), y.data_ptr() % 64 == x.data_ptr() % 64, y.data_ptr() != x.data_ptr()
        (True, True, True)
    """
    offset = t.data_ptr() % _LINE if t.is_cpu else 0
    if not offset or not t.is_contiguous() or offset % t.element_size():
        return t.clone()
    skip = offset // t.element_size()
    line = torch.empty(skip + t.numel(), dtype=t.dtype)
    return line[skip:].view(t.shape).copy_(t)


class InputPlacement:
    """Where the IPUs of this process read the input leaves.

    Args:
        stages: the lowered stages ([Note: lowered stages] in ``compiler/lowered``); local:
            per stage, whether this process runs it; placement: devices and streams;
            separate: every IPU has a memory of its own (``useIpuModel``).
    """

    def __init__(self, stages, local: list, placement, separate: bool):
        self.keys: dict = {}  # IPU -> the input leaves it reads
        for st in stages:
            keys = [key for _, kind, key in st.sources if kind == "input"]
            if keys and local[st.index]:
                self.keys.setdefault(st.ipu, set()).update(keys)
        self.placement, self.separate = placement, separate
        self.gpu = placement.gpu  # [Note: the GPU seam] in ``gpu``
        self.gpu_ipus = placement.gpu_ipus
        self.devices = [(k, placement.device(ipu)) for ipu, keys in self.keys.items()
                        for k in keys]
        self.on_cpu = all(dev == _HOST for _, dev in self.devices)
        self._keys = tuple(k for k, _ in self.devices)

    def place(self, run) -> None:
        """Put each IPU's input leaves in its memory, on the caller's thread, before the run.

        Each micro-batch gets its own copy in each memory that lacks its inputs, shared
        by the IPUs there (under ``useIpuModel`` every IPU gets a copy of its own). On a
        GPU the copy is asynchronous, on the caller's current stream, from pinned
        memory: one transfer per input for all the run's micro-batches where they can
        be joined (``gpu.joinable``), each micro-batch reading its own rows of it, and
        one event per GPU after the copies that the readers wait on (``Run.ready``).
        Inputs already where an IPU computes are used as they are.
        """
        separate = self.separate
        if not separate and run.inputs:  # a call's micro-batches share their devices
            first = run.inputs[0]
            if (all(map(_IS_CPU, map(first.__getitem__, self._keys))) if self.on_cpu  # no frame
                    else all(first[k].device == dev for k, dev in self.devices)):
                return
        gpu, placed, inputs = self.gpu, run.placed, run.inputs
        joined = {}  # (GPU, k) -> every micro-batch's input k there, made by one transfer
        for ipu, keys in self.keys.items() if not separate else ():
            device = self.placement.device(ipu)
            for k in keys if ipu in self.gpu_ipus else ():
                leaves = [mb[k] for mb in inputs] if (device, k) not in joined else ()
                if joinable(leaves):
                    joined[device, k] = gpu.copy_in_all(leaves, device)
        copied = {}  # GPU -> the micro-batches copied there
        for i, mb in enumerate(inputs):
            copies = {}  # (device, k) -> micro-batch i's input k there: one per micro-batch
            for ipu, keys in self.keys.items():
                device = self.placement.device(ipu)
                on_gpu = ipu in self.gpu_ipus
                for k in keys:
                    t = mb[k]
                    if t.device == device and not separate:
                        continue
                    held = None if separate else copies.get((device, k))
                    if held is None:
                        together = joined.get((device, k))
                        held = copies[device, k] = (
                            together[i] if together is not None else
                            gpu.copy_in(t, device) if on_gpu else
                            memory_copy(t) if device == _HOST and t.is_cpu else
                            t.to(device, copy=True))
                        if on_gpu:
                            copied.setdefault(device, set()).add(i)
                    placed[ipu, i, k] = held
        for device, microbatches in copied.items():  # after every copy to it was enqueued
            event = gpu.Event()
            event.record(gpu.current_stream(device))
            for i in microbatches:
                run.ready[device, i] = event
