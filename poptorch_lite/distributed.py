"""Replicas in other processes: training across processes and hosts on ``torch.distributed``.

[Note: replicas across processes]
PopTorch users run several instances with ``poprun``; poptorch_lite users run
several processes with ``torchrun`` (or any launcher that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``). ``Options.Distributed``
picks up the process id and count ([Note: process ids] in ``option_groups``).
Each process runs its own R replicas (``replicationFactor``) on its own
slice of the data, so there are R·P global replicas and an optimizer step
sees micro-batch × gradientAccumulation × R × P samples.

A training wrapper whose options name more than one process
(:class:`ProcessReplicas`):

1. joins the process group lazily, at its first call or ``compile()``, before
   tracing: ``init_process_group(init_method="env://")`` with gloo for CPU
   parameters or NCCL for CUDA ones (``LOCAL_RANK`` picks the CUDA device), and
   the collective timeout of ``POPTORCH_LITE_DIST_TIMEOUT`` (seconds, default
   300, below the 600 s default watchdog). A group the user initialised already
   is used as it is. A group poptorch_lite made is destroyed at interpreter exit.
2. all-gathers the options every process must agree on and refuses
   (``OptionsError``, on every process) when they differ;
3. broadcasts the parameters and buffers of process 0 when it first attaches,
   as DDP does, so that every process starts identical;
4. in every optimizer step (the U action, one thread per process), after every
   stage's reduction and before clipping, all-reduces (sums) the gradients over
   the processes (tensors of 1 MB or more in place, smaller ones flattened in
   buckets of at most 25 MB per dtype and device; see :func:`_buckets`), and divides
   by P for ``ReductionType.Mean``: with the local division by G·R
   ([Note: gradient arithmetic] in ``executor``) that divides by G·R·P in all.
   A gradient that is None in one process counts as zeros there; it stays None
   only where it is None in every process.

A failed or hung collective raises ``ExecutionError`` naming the processes and
the timeout. Every process must call the model the same number of times.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .enums import ReductionType
from .errors import ExecutionError, OptionsError
from .placement import process_gpu

TIMEOUT_ENV = "POPTORCH_LITE_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
ALONE_BYTES = 1024 * 1024  # tensors this large are reduced in place, unflattened

_owned_group = False  # whether poptorch_lite initialised the default group (and destroys it)


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints progress and writes files.

    True in a single process. In several processes it reads the joined group's
    rank, else torchrun's ``RANK`` (or mpirun's ``OMPI_COMM_WORLD_RANK``).

    Example:
        >>> import poptorch_lite as poptorch
        >>> poptorch.is_main_process()
        True
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))) == 0


def collective_timeout() -> float:
    """Seconds a collective waits for the other processes (``POPTORCH_LITE_DIST_TIMEOUT``).

    Raises:
        OptionsError: the variable is not a positive number.

    Example:
        >>> collective_timeout()
        300.0
    """
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise OptionsError(f"environment variable {TIMEOUT_ENV}={text!r} is not a positive "
                           f"number of seconds; set it to e.g. {DEFAULT_TIMEOUT_S:g} or unset it")
    return seconds


def shutdown() -> None:
    """Destroy the process group if poptorch_lite made it (registered with ``atexit``)."""
    global _owned_group
    if _owned_group and dist.is_initialized():
        dist.destroy_process_group()
    _owned_group = False


def agreed_options(options, optimizer, model) -> dict:
    """The settings every process must share, by the name a user sets them with.

    Example:
        >>> from poptorch_lite.options import Options
        >>> agreed_options(Options(), None, torch.nn.Linear(2, 1))["Options.replicationFactor"]
        1
    """
    o = options
    params = [p for p in model.parameters() if p.requires_grad]
    return {
        "Options.Distributed.numProcesses": o.Distributed.num_processes,
        "Options.deviceIterations": o.device_iterations,
        "Options.replicationFactor": o.replication_factor,
        "Options.inputReplicaGrouping": o.input_group_size,
        "Options.Training.gradientAccumulation": o.Training.gradient_accumulation,
        "Options.Training.accumulationAndReplicationReductionType": o.Training.reduction_type.name,
        "Options.outputMode": (o.output_mode.name, o.output_return_period),
        "Options.randomSeed": o.random_seed,
        "Options.broadcastBuffers": o.broadcast_buffers,
        "Options.setExecutionStrategy": repr(o.execution_strategy),
        "optimizer": type(optimizer).__name__,
        "model parameters (count, elements)": (len(params), sum(p.numel() for p in params)),
    }


class ProcessReplicas:
    """The replicas of one training wrapper that run in the other processes.

    Args:
        options: the wrapper's options (``Options.Distributed`` gives rank and count).

    Example:
        >>> from poptorch_lite.options import Options
        >>> ProcessReplicas.for_options(Options(), training=True) is None  # one process
        True
    """

    def __init__(self, options):
        self.options = options
        self.rank = options.Distributed.process_id
        self.size = options.Distributed.num_processes
        self.mean = options.Training.reduction_type == ReductionType.Mean
        self.timeout = collective_timeout()
        self._joined = self._broadcast = False

    @classmethod
    def for_options(cls, options, training: bool) -> Optional["ProcessReplicas"]:
        """The replicas for these options, or None when the wrapper runs in one process."""
        initialized = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not training or (options.Distributed.num_processes == 1 and not initialized):
            return None
        return cls(options)

    def join(self, model: torch.nn.Module, optimizer) -> None:
        """Join (or adopt) the process group and check the options agree; once.

        Raises:
            OptionsError: the group and the options disagree on rank or count, or
                the options differ between processes (on every process).
            ExecutionError: the other processes did not join within the timeout.
        """
        if self._joined:
            return
        global _owned_group
        if not dist.is_available():
            raise OptionsError(f"Options.Distributed names {self.size} processes but this torch "
                               f"build has no torch.distributed; run one process or install "
                               f"a torch with distributed support")
        if dist.is_initialized():
            rank, size = dist.get_rank(), dist.get_world_size()
            if (rank, size) != (self.rank, self.size):
                raise OptionsError(
                    f"torch.distributed is initialised as rank {rank} of {size} but "
                    f"Options.Distributed says process {self.rank} of {self.size}; call "
                    f"opts.Distributed.configureProcessId({rank}, {size})")
        else:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise OptionsError(
                    f"Options.Distributed names {self.size} processes but {' and '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not set; launch with torchrun "
                    f"(torchrun --nproc_per_node {self.size} script.py) or set MASTER_ADDR and "
                    f"MASTER_PORT to process 0's address and a free port")
            if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # this process's GPU
                torch.cuda.set_device(process_gpu())  # [Note: GPUs of a process]
            cuda = any(p.is_cuda for p in model.parameters())  # where the gradients meet
            try:
                dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                                        rank=self.rank, world_size=self.size,
                                        timeout=datetime.timedelta(seconds=self.timeout))
            except Exception as exc:
                raise self._failed("joining the process group", exc) from exc
            if not _owned_group:
                atexit.register(shutdown)
            _owned_group = True
        self._joined = True
        self._check_same(agreed_options(self.options, optimizer, model))

    def broadcast_from_main(self, model: torch.nn.Module) -> None:
        """Copy process 0's parameters and buffers into this process's model; once."""
        if self._broadcast:
            return
        tensors = [t.data for t in (*model.parameters(), *model.buffers())]
        with torch.no_grad():
            for bucket in _buckets(tensors):
                flat = _flat(bucket)
                self._collective("broadcasting process 0's weights", dist.broadcast, flat, 0)
                _unflat(flat, bucket)
        self._broadcast = True

    def all_reduce_grads(self, params: dict) -> None:
        """Sum every parameter's gradient over the processes; Mean also divides by P.

        Call it from one thread per process, with the same ``params`` everywhere.
        """
        trainable = [p for p in params.values() if p.requires_grad]
        if not trainable:
            return
        present = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32,
                               device=trainable[0].device)
        self._collective("the gradient all-reduce", dist.all_reduce, present)
        used = [p for p, n in zip(trainable, present.tolist()) if n > 0]
        with torch.no_grad():
            for p in used:
                if p.grad is None:  # unused here, used elsewhere: contributes zeros
                    p.grad = torch.zeros_like(p)
            for bucket in _buckets([p.grad for p in used]):
                flat = _flat(bucket)
                self._collective("the gradient all-reduce", dist.all_reduce, flat)
                if self.mean:
                    flat.div_(self.size)
                _unflat(flat, bucket)

    # -- internals ------------------------------------------------------------------------

    def _check_same(self, mine: dict) -> None:
        everyone = [None] * self.size
        self._collective("comparing options", dist.all_gather_object, everyone, mine)
        for rank, theirs in enumerate(everyone):
            for name, value in mine.items():
                if theirs.get(name) != value:
                    raise OptionsError(
                        f"{name} differs between processes: {value!r} in this process "
                        f"(rank {self.rank}) but {theirs.get(name)!r} in rank {rank}; every "
                        f"process must use the same options, optimizer and model")

    def _collective(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> ExecutionError:
        return ExecutionError(
            f"{what} across {self.size} processes failed in process {self.rank}: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            f". Another process failed or exited (see its own error), or did not reach the same "
            f"call within the collective timeout of {self.timeout:g} s; every process must call "
            f"the model the same number of times with the same options (raise the timeout with "
            f"{TIMEOUT_ENV}=seconds)")


def _flat(bucket: list) -> torch.Tensor:
    """One tensor to communicate: a lone contiguous tensor itself, else a flat copy."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        return bucket[0]
    return _flatten_dense_tensors(bucket)


def _unflat(flat: torch.Tensor, bucket: list) -> None:
    """Copy a communicated flat tensor back into its bucket (nothing to do if it is one)."""
    if flat is not bucket[0]:
        for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(v)


def _buckets(tensors: list) -> list:
    """Group tensors by (dtype, device) into lists of at most BUCKET_BYTES.

    A tensor of ALONE_BYTES or more is a bucket of its own: it is reduced in
    place, without the two copies that flattening costs (measured in
    docs/PERFORMANCE.md); buckets amortise the per-collective latency of the
    small ones.

    Example:
        >>> [len(b) for b in _buckets([torch.zeros(2), torch.zeros(2, dtype=torch.int64),
        ...                            torch.zeros(3)])]
        [2, 1]
    """
    out, open_ = [], {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes >= ALONE_BYTES:
            out.append([t])
            continue
        key = (t.dtype, t.device)
        bucket, size = open_.get(key, ([], 0))
        if bucket and size + nbytes > BUCKET_BYTES:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        open_[key] = (bucket, size + nbytes)
    return out + [b for b, _ in open_.values() if b]
