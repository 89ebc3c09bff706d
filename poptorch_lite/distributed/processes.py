"""Other processes: replicas and pipeline stages across processes and hosts on ``torch.distributed``.

[Note: replicas across processes]
PopTorch users run several instances with ``poprun``; poptorch_lite users run
several processes with ``torchrun`` (or any launcher that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``). ``Options.Distributed``
picks up the process id and count ([Note: process ids] in ``options/groups.py``).
The W processes form W/n pipelines of n processes (``layout.Layout``; n is 1
unless ``Options.Distributed.set_ipu_processes`` spreads a pipeline's stages
over n processes: [Note: stages in other processes] in ``distributed``).
The pipelines are data-parallel replicas: each runs its own R replicas
(``replicationFactor``) on its own slice of the data, so there are R·W/n global
replicas and an optimizer step sees micro-batch × gradientAccumulation × R × W/n
samples.

A wrapper whose options name more than one process (:class:`Processes`; a
training wrapper, or any wrapper whose pipeline spans processes):

1. joins the process group lazily, at its first call or ``compile()``, before
   tracing: ``init_process_group(init_method="env://")`` with gloo for CPU
   parameters or NCCL for CUDA ones (``LOCAL_RANK`` picks the CUDA device;
   with stages in other processes, gloo for CPU tensors and NCCL for CUDA
   ones), and the collective timeout of ``POPTORCH_LITE_DIST_TIMEOUT`` (seconds,
   default 300, below the 600 s default watchdog). A group the user initialised
   already is used as it is. The groups poptorch_lite made are destroyed at
   interpreter exit ([Note: process groups at exit]).
2. all-gathers the options every process must agree on and refuses
   (``OptionsError``, on every process) when they differ;
3. a training wrapper broadcasts each parameter and buffer from the process of
   pipeline 0 that runs it (process 0 when every process runs every stage) when
   it first attaches, as DDP does, so that every replica starts identical;
4. in every optimizer step (the U action, one thread per process), after every
   stage's reduction and before clipping, all-reduces (sums) the gradients over
   the processes that run the same stages (all of them with n = 1; tensors of
   1 MB or more in place, smaller ones flattened in buckets of at most 25 MB per
   dtype and device; see :func:`_buckets`), and divides by W/n for
   ``ReductionType.Mean``: with the local division by G·R ([Note: gradient
   arithmetic] in ``update``) that divides by G·R·W/n in all. A gradient that
   is None in one process counts as zeros there; it stays None only where it is
   None in every process. Where it can, each bucket goes as soon as the
   backward has made its gradients instead ([Note: overlapped all-reduce] in
   ``overlap``).

A failed or hung collective raises ``ExecutionError`` naming the processes and
the timeout. Every process must call the model the same number of times.

[Note: process groups at exit]
A gloo group's worker threads let go of each collective's work after it
completes. Where Python dropped the work's tensors first, letting go of them
takes the GIL; a worker that does so while the interpreter finalizes is ended
by Python (``pthread_exit``) inside a C++ destructor, and the process aborts
with "terminate called without an active exception" (pytorch issue 190489; a
CI run of the multi-node test died so, at its exit, after the run had passed).
The threads stop only when the group's C++ object is destroyed:
``destroy_process_group`` shuts a group down but leaves its threads running
while any Python object still holds it. So poptorch_lite holds every group it
makes (its own ``new_group``s and the mesh's) in one registry, ``_GROUPS``,
and nowhere else: every other object asks :meth:`Processes.group` (or the
mesh's accessors) for a group each time it uses one. At exit, before the
interpreter finalizes (``atexit``), :func:`shutdown` destroys those groups, and
the default group where poptorch_lite made it, then empties the registry:
their threads are joined while the interpreter is whole, whatever objects of
the program are still alive. A default group the user made is the user's to
destroy, as torch asks of every program (``destroy_process_group``).
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..enums import ReductionType
from ..errors import ExecutionError, OptionsError, warn_once
from ..runtime import anchors
from ..runtime.devices import process_gpu
from .layout import Layout
from .overlap import Overlap, buckets_in_backward_order, zero_gradient
from .sharding import Shards, refuse_host_steps, shardable

TIMEOUT_ENV = "POPTORCH_LITE_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
ALONE_BYTES = 1024 * 1024  # tensors this large are reduced in place, unflattened

_owned_group = False  # whether poptorch_lite initialised the default group (and destroys it)
_at_exit = False  # whether shutdown() is registered with atexit
# (ranks, purpose) or (grid, mesh dimension) -> process group, made by every process in one
# order; the only reference poptorch_lite keeps to a group ([Note: process groups at exit])
_GROUPS: dict = {}


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
    """Destroy the process groups poptorch_lite made, and the default group where it made it,
    and let go of them, so that their threads end now (registered with ``atexit``, which
    runs before the interpreter finalizes: [Note: process groups at exit])."""
    global _owned_group
    made = list(_GROUPS.values())
    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        if _owned_group:
            dist.destroy_process_group()
        else:
            default = dist.group.WORLD
            for group in made:
                if group is default:  # a mesh dimension of every process: the user's group
                    continue
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # destroyed already (the user's destroy_process_group())
                    pass
    _owned_group = False
    del made  # the last references: each group's threads are joined here


def _destroy_at_exit() -> None:
    """Register :func:`shutdown` with ``atexit``, once."""
    global _at_exit
    if not _at_exit:
        atexit.register(shutdown)
        _at_exit = True


def join_default_group(rank: int, size: int, backend: Optional[str]) -> None:
    """Initialise torch.distributed's default group as process ``rank`` of ``size`` (from
    ``MASTER_ADDR`` and ``MASTER_PORT``), with the collective timeout; poptorch_lite destroys
    it at exit. Nothing when a group exists already.

    Args:
        backend: None for both, gloo for CPU tensors and NCCL for CUDA ones where there
            are GPUs (activations of stages in other processes; ``popdist.init``, before any
            model is known); else where the gradients meet, "gloo" or "nccl".

    Raises:
        OptionsError: ``MASTER_ADDR`` or ``MASTER_PORT`` is not set.
        ExecutionError: the other processes did not join within the timeout.
    """
    global _owned_group
    if dist.is_initialized():
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise OptionsError(
            f"Options.Distributed names {size} processes but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; launch with torchrun "
            f"(torchrun --nproc_per_node {size} script.py) or set MASTER_ADDR and "
            f"MASTER_PORT to process 0's address and a free port")
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # this process's GPU
        torch.cuda.set_device(process_gpu())  # [Note: GPUs of a process]
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = collective_timeout()
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise failed("joining the process group", rank, size, timeout, exc) from exc
    _owned_group = True
    _destroy_at_exit()


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
        "Options.Distributed.set_ipu_processes": o.Distributed.ipu_processes,
        "Options.Distributed.set_process_order": o.Distributed.process_order,
        "Options.TensorLocations.setOptimizerLocation": o.TensorLocations.location_optimizer,
        "optimizer": type(optimizer).__name__,
        "model parameters (count, elements)": (len(params), sum(p.numel() for p in params)),
    }


class Processes:
    """The other processes of one wrapper: its replicas and the stages they run.

    Args:
        options: the wrapper's options (``Options.Distributed`` gives rank, count and
            the IPUs of each process of a pipeline).

    Raises:
        OptionsError: the process count is not a multiple of the pipeline's (:class:`Layout`).

    Example:
        >>> from poptorch_lite.options import Options
        >>> Processes.for_options(Options(), training=True) is None  # one process
        True
    """

    def __init__(self, options):
        self.options = options
        self.layout = Layout.from_options(options)
        self.rank, self.size = self.layout.rank, self.layout.size
        self.mean = options.Training.reduction_type == ReductionType.Mean
        self.timeout = collective_timeout()
        self._grid = None  # the pipelines × stages grid of ranks, when a pipeline spans processes
        self._joined = self._broadcast = False
        self._shards: dict = {}  # id(optimizer) -> its Shards, or None where it is not sharded

    @classmethod
    def for_options(cls, options, training: bool) -> Optional["Processes"]:
        """The other processes for these options, or None when the wrapper runs alone:
        one process, or an inference wrapper whose stages all run in this one."""
        d = options.Distributed
        initialized = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        spread = d.ipu_processes is not None and len(d.ipu_processes) > 1
        if not spread and (not training or (d.num_processes == 1 and not initialized)):
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
            join_default_group(self.rank, self.size, None if self.layout.spans_processes else (
                "nccl" if any(p.is_cuda for p in model.parameters()) else "gloo"))
        self._joined = True
        self._check_same(agreed_options(self.options, optimizer, model))
        if self.layout.spans_processes:
            self._grid = _mesh(self.layout, self._failed)

    def group(self, ranks: tuple, purpose: str):
        """The process group of ``ranks`` for ``purpose`` (made on first use).

        Every process must ask for every group, members or not, in the same order
        (``torch.distributed.new_group``); a group asked for again is the one made.
        """
        key = (tuple(ranks), purpose)
        if key not in _GROUPS:
            try:
                _GROUPS[key] = dist.new_group(list(ranks), timeout=datetime.timedelta(
                    seconds=self.timeout))
            except Exception as exc:
                raise self._failed(f"making the process group {list(ranks)}", exc) from exc
            _destroy_at_exit()
        return _GROUPS[key]

    def _replicas_group(self):
        """The processes that run this process's stages: all of them with n = 1 (None:
        the default group)."""
        return self._mesh_group("replica") if self._grid is not None else None

    def broadcast_from_main(self, model: torch.nn.Module,
                            owner: Optional[Callable[[str], Optional[int]]] = None) -> None:
        """Give every process pipeline 0's parameters and buffers; once.

        Args:
            model: the user's model.
            owner: tensor name -> the position of the pipeline's process that runs it (None:
                no stage uses it); without, process 0 is the source of every tensor.
        """
        if self._broadcast:
            return
        by_source: dict = {}
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            position = owner(name) if owner is not None else None
            by_source.setdefault(self.layout.rank_of(0, position or 0), []).append(t.data)
        with torch.no_grad():
            for src in sorted(by_source):
                for bucket in _buckets(by_source[src]):
                    flat = _flat(bucket)
                    self._collective(f"broadcasting process {src}'s weights", dist.broadcast,
                                     flat, src)
                    _unflat(flat, bucket)
        self._broadcast = True

    def all_reduce_grads(self, params: dict, overlap=None) -> None:
        """Sum every parameter's gradient over the processes that run the same stages;
        Mean also divides by their count (W/n).

        Call it from one thread per process, with the same ``params`` in every process
        of the group.
        """
        replicas = self.layout.pipelines
        if replicas == 1:
            return
        if overlap is not None and overlap.active:  # [Note: overlapped all-reduce]
            overlap.finish(replicas if self.mean else 1)
            return
        used = self._used(params)
        self.all_reduce([p.grad for p in used], self._replicas_group(),
                        "the gradient all-reduce", replicas if self.mean else 1)

    def overlap(self, params: dict, shards: Optional[Shards] = None,
                sparse: frozenset = frozenset()):
        """An :class:`~poptorch_lite.distributed.overlap.Overlap` of ``params`` (name ->
        trainable parameter) over the replicas ([Note: overlapped all-reduce]): an
        all-reduce, or ``shards``' reduce-scatter. ``sparse``: the ids of the parameters whose
        gradients are sparse, each summed on its own (not with ``shards``: E-OPTIM-16)."""
        if shards is None:
            return Overlap(params, buckets_in_backward_order(
                params, lambda ps: _buckets(ps, alone=sparse)), self._replicas_group,
                           self._collective, _AllReduce(self), sparse)
        return Overlap(params, buckets_in_backward_order(
            params, lambda ps: shards.buckets(ps, _buckets)), self._replicas_group,
                       self._collective, shards)

    def shards(self, optimizer) -> Optional[Shards]:
        """The chunks of ``optimizer``'s state this process holds, or None where its state is
        whole: [Note: sharded optimizer state] in ``sharding``."""
        key = id(optimizer)
        if key not in self._shards:
            wanted = (self.options.TensorLocations.location_optimizer or {}).get(
                "useReplicatedTensorSharding") and self.layout.pipelines > 1
            made = None
            if wanted and not shardable(optimizer):
                warn_once(f"sharding {type(optimizer).__name__}", (
                    f"useReplicatedTensorSharding: {type(optimizer).__name__} is not one of "
                    f"the optimizer classes poptorch_lite steps in chunks (a subclass may change "
                    f"the update), so its state is not sharded: every process holds it whole, "
                    f"and the numbers are the same"))
            elif wanted:
                # over the processes that run the same stages (all of them with n = 1)
                made = Shards(self._replicas_group, self.layout.pipeline,
                              self.layout.pipelines, self._collective, ALONE_BYTES,
                              anchors.gradients(self.options.anchored_tensors,
                                                anchors.scope_of(self.options)))
                refuse_host_steps(optimizer, self.layout.pipelines)
            self._shards[key] = made
        return self._shards[key]

    def check_sharded_state(self, optimizer, sparse: frozenset = frozenset()) -> None:
        """Where ``optimizer``'s state is sharded, refuse chunks that are not this process's,
        a step pre-hook and sparse gradients (``sparse``: the names of the parameters that get
        them), in every process alike (``Shards.check_state``)."""
        shards = self.shards(optimizer)
        if shards is not None:
            shards.check_state(optimizer, sparse)

    def reduce_scatter_grads(self, params: dict, shards: Shards, overlap=None) -> None:
        """As :meth:`all_reduce_grads`, but each process keeps only its chunk of each sum
        (``shards``: [Note: sharded optimizer state])."""
        if overlap is not None and overlap.active:  # [Note: overlapped all-reduce]
            overlap.finish(self.layout.pipelines if self.mean else 1)
            return
        used = self._used(params)
        if used:
            shards.reduce_scatter(used, self.layout.pipelines if self.mean else 1)

    def _used(self, params: dict) -> list:
        """The trainable parameters that have a gradient in any of the processes that run the
        same stages; one where this process has none gets zeros (sparse ones where another
        process's gradient is sparse). Where one process's is sparse and another's dense, each
        sums a dense one, as autograd's accumulation of both in one process would."""
        trainable = [p for p in params.values() if p.requires_grad]
        if not trainable:
            return []
        present = torch.tensor([[p.grad is not None for p in trainable],
                                [p.grad is not None and p.grad.is_sparse for p in trainable]],
                               dtype=torch.int32, device=trainable[0].device)
        self._collective("the gradient all-reduce", dist.all_reduce, present,
                         group=self._replicas_group())
        had, sparse = present.tolist()
        used = []
        with torch.no_grad():
            for p, n, s in zip(trainable, had, sparse):
                if not n:
                    continue
                if p.grad is None:  # unused here, used elsewhere: contributes zeros
                    p.grad = zero_gradient(p, sparse=s == n)
                elif p.grad.is_sparse and s < n:  # dense in another process
                    p.grad = p.grad.to_dense()
                used.append(p)
        return used

    def all_reduce(self, tensors: list, group, what: str, divisor: int = 1) -> None:
        """Sum ``tensors`` in place over ``group`` (in buckets: :func:`_buckets`), then
        divide by ``divisor``."""
        with torch.no_grad():
            for bucket in _buckets(tensors):
                flat = _flat(bucket)
                self._collective(what, dist.all_reduce, flat, group=group)
                if divisor != 1:
                    flat.div_(divisor)
                _unflat(flat, bucket)

    def pipeline_group(self):
        """This process's pipeline: the "stage" dimension of the mesh."""
        return self._mesh_group("stage")

    def _mesh_group(self, dimension: str):
        """A dimension's group of the mesh; made again where :func:`shutdown` let go of it
        (``popdist.finalizeBackend()``), which fails clearly (E-PROC-05) without a default
        group."""
        if (self._grid, dimension) not in _GROUPS:
            _mesh(self.layout, self._failed)
        return _GROUPS[self._grid, dimension]

    def pipeline_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the processes of this pipeline (in place; returned)."""
        group = self.pipeline_group()
        self._collective("summing over the pipeline's processes", dist.all_reduce, values,
                         group=group)
        return values

    def pipeline_broadcast(self, t: torch.Tensor, position: int) -> None:
        """Broadcast ``t`` in place from the pipeline's process at ``position``."""
        group = self.pipeline_group()
        self._collective("handing the outputs to the pipeline's processes", dist.broadcast, t,
                         self.layout.rank_of(self.layout.pipeline, position), group=group)

    def from_owners(self, model: torch.nn.Module, owner: Callable) -> list:
        """Every weight and buffer of ``model`` from the process of the pipeline that runs it
        (``owner``: name -> its position, None where no stage does); returns the tensors
        that arrived from another process."""
        mine, arrived = self.layout.position, []
        with torch.no_grad():
            for name, t in (*model.named_parameters(), *model.named_buffers()):
                position = owner(name)
                if position is not None:
                    self.pipeline_broadcast(t.data, position)
                    if position != mine:
                        arrived.append(t)
        return arrived

    def gather(self, mine: dict) -> dict:
        """The union of every process's ``mine`` (one all-gather of Python objects)."""
        everyone = [None] * self.size
        self._collective("exchanging the stages' devices", dist.all_gather_object, everyone,
                         mine)
        merged: dict = {}
        for theirs in everyone:
            merged.update(theirs)
        return merged

    def agree(self, failure: Optional[str], seen: Optional[bool] = None) -> Optional[tuple]:
        """Whether any process failed this run: ``(rank, its description)`` of the first
        that did (in rank order), or None. The descriptions travel only when one failed.

        Args:
            failure: what failed in this process, or None.
            seen: whether this process already knows if any process of its pipeline failed
                (from their messages: ``Channels.settle``); with one pipeline that is every
                process, and no collective is needed to agree. None: one small all-reduce
                over every process tells.
        """
        failed = failure is not None or bool(seen)
        if seen is None or self.layout.pipelines > 1:
            flag = torch.tensor([int(failed)], dtype=torch.int32)
            self._collective("agreeing on the run's outcome", dist.all_reduce, flag)
            failed = bool(int(flag))
        if not failed:
            return None
        everyone = [None] * self.size
        self._collective("gathering the failures", dist.all_gather_object, everyone, failure)
        return next((r, text) for r, text in enumerate(everyone) if text is not None)

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

    def _collective(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a collective, or a wait), its result; a failure raised
        as the processes' error (:meth:`_failed`)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> ExecutionError:
        return failed(what, self.rank, self.size, self.timeout, exc)


def failed(what: str, rank: int, size: int, timeout: float, exc: BaseException) -> ExecutionError:
    """The error of a collective ``what`` that ``exc`` ended (E-PROC-05)."""
    return ExecutionError(
        f"{what} across {size} processes failed in process {rank}: "
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        f". Another process failed or exited (see its own error), or did not reach the same "
        f"call within the collective timeout of {timeout:g} s; every process must call "
        f"the model the same number of times with the same options (raise the timeout with "
        f"{TIMEOUT_ENV}=seconds)")


def _mesh(layout: Layout, failed: Callable) -> tuple:
    """Make the pipelines × stages ``DeviceMesh`` of ``layout`` (once per grid and process
    group); returns the grid, whose groups are then ``_GROUPS[grid, "replica"]`` and
    ``_GROUPS[grid, "stage"]``.

    Its "stage" dimension's group is this process's pipeline and its "replica" dimension's
    the processes that run the same stages as this one. torch makes them: one
    ``split_group`` per dimension where the default group is bound to a GPU, else one
    ``new_group`` per pipeline and per position in every process (gloo's, and torch
    2.14's only way: only the members build a communicator; the others only count the
    group, microseconds each: docs/PERFORMANCE.md (p)). The mesh itself is not kept: it
    would hold the groups too ([Note: process groups at exit]).
    """
    grid = layout.grid()
    if (grid, "stage") not in _GROUPS:
        try:
            # "cpu": the mesh's groups take the default group's backends, NCCL included;
            # a "cuda" mesh would also pick this process's GPU, which is process_gpu's.
            mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("replica", "stage"))
            groups = {dim: mesh.get_group(dim) for dim in ("replica", "stage")}
        except Exception as exc:
            raise failed(f"making the process mesh {[list(r) for r in grid]}", exc) from exc
        for dim, group in groups.items():
            _GROUPS[grid, dim] = group
        _destroy_at_exit()
    return grid


class _AllReduce:
    """The overlap's reducer of whole gradients ([Note: overlapped all-reduce] in ``overlap``):
    a bucket summed in place (:func:`_flat`), started by :meth:`launch`, finished in order
    by :meth:`land`, as :meth:`Processes.all_reduce` sums its buckets."""

    def __init__(self, processes: Processes):
        self._processes = processes

    def carries(self, bucket: list) -> bool:
        """Whether the flags of the weights that had a gradient can ride in ``bucket``'s
        all-reduce (its flat copy made anyway, of a dtype whose sums of 0 and 1 over the
        processes are exact), saving a collective a step."""
        return bucket[0].dtype in (torch.float32, torch.float64) and not \
            bucket[0].grad.is_sparse and (
                len(bucket) > 1 or bucket[0].numel() * bucket[0].element_size() < ALONE_BYTES)

    def launch(self, bucket: list, flags: Optional[torch.Tensor] = None) -> tuple:
        """Start the sum of ``bucket``'s gradients, and of ``flags`` after them where
        :meth:`carries` allowed it."""
        grads = [p.grad for p in bucket]
        with torch.no_grad():
            flat = _flat(grads) if flags is None else _flatten_dense_tensors(
                [*grads, flags.to(grads[0].dtype)])
        work = self._processes._collective("the gradient all-reduce", dist.all_reduce, flat,
                                           group=self._processes._replicas_group(),
                                           async_op=True)
        return work, flat, grads, flags

    def land(self, launched: list, divisor: int, absent: frozenset = frozenset()) -> None:
        """Wait for the buckets in order; divide, and copy each flat sum back (the flags
        that rode in one, summed, into ``flags``)."""
        for work, flat, grads, flags in launched:
            self._processes._collective("the gradient all-reduce", work.wait)
            if flags is not None:
                flags.copy_(flat[-flags.numel():])
                flat = flat[:-flags.numel()]
            if divisor != 1:
                flat.div_(divisor)
            _unflat(flat, grads)


def _flat(bucket: list) -> torch.Tensor:
    """One tensor to communicate: a lone sparse or contiguous tensor itself (gloo sums a sparse
    one in place, coalesced), else a flat copy."""
    if len(bucket) == 1 and (bucket[0].is_sparse or bucket[0].is_contiguous()):
        return bucket[0]
    return _flatten_dense_tensors(bucket)


def _unflat(flat: torch.Tensor, bucket: list) -> None:
    """Copy a communicated flat tensor back into its bucket (nothing to do if it is one)."""
    if flat is not bucket[0]:
        for t, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(v)


def _buckets(tensors: list, alone: frozenset = frozenset()) -> list:
    """Group tensors by (dtype, device) into lists of at most BUCKET_BYTES.

    A tensor of ALONE_BYTES or more is a bucket of its own: it is reduced in
    place, without the two copies that flattening costs (measured in
    docs/PERFORMANCE.md); buckets amortise the per-collective latency of the
    small ones. So is a sparse tensor, and a tensor whose id is in ``alone`` (a
    parameter whose gradient will be sparse), which cannot be flattened.

    Example:
        >>> [len(b) for b in _buckets([torch.zeros(2), torch.zeros(2, dtype=torch.int64),
        ...                            torch.zeros(3)])]
        [2, 1]
    """
    out, open_ = [], {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes >= ALONE_BYTES or t.is_sparse or id(t) in alone:
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
