"""Checkpoints: the whole training state of a wrapped model, saved atomically, resumed exactly.

[Note: checkpoints]
A checkpoint holds everything the next step depends on: the model's
``state_dict`` (parameters and buffers), the optimizer's ``state_dict``
(its state and every group's hyper-parameters, PopTorch's attributes such as
``loss_scaling``, ``accum_type`` and ``velocity_scaling`` included), the loss
scale and its counters, torch's CPU and CUDA generators and Python's
``random`` state, the optimizer steps taken, and, when given, the
DataLoader's position (epoch, batches handed out, the random state its shuffle
came from). ``load_checkpoint`` puts all of it back, so training continues
bit-identically to a run that never stopped.

When a model's pipeline spans processes ([Note: stages in other processes] in
``distributed``), every process calls ``save_checkpoint(path, ...)`` and
writes its own part, ``<path>.process<r>-of-<W>`` (:func:`part_path`): its
stages' parameters and buffers, the optimizer state it holds, and its own
random state and loader position. Every process calls ``load_checkpoint(path,
...)`` too, and loads its part; the processes first agree that every part is
there, fits, and is of the same step, so a refusal happens in all of them.

With the optimizer state sharded over N data-parallel processes ([Note: sharded optimizer
state] in ``distributed/sharding``), every process calls ``save_checkpoint``: the main
process writes the file with its own chunks of the state, and process k its chunks to
``<path>.shard<k>-of-<N>`` (:func:`shard_path`).

When the processes are data-parallel replicas of one whole pipeline, they hold the same
weights and optimizer state (every step all-reduces their gradients), so one file holds
the training state: whichever processes call ``save_checkpoint(path, ...)`` (every one, or
only the main one, as ``is_main_process`` suggests), the main process alone writes it, so
no two processes write one file. It holds the main process's buffers, which are its
replica 0's where replicas keep their own ([Note: running statistics on replicas] in
``compiler/running_stats``), its random state (the processes share one under
``Options.randomSeed``, as the sharded shuffle requires) and its loader position (the same
batch in every process: every process calls the model as often). Every process loads that
file, and every replica starts again from those buffers. The loader's position is global
([Note: global loader position] in ``data/dataloader``): another process count continues
the epoch, each sample read once; a refusal comes before anything loads.

[Note: resharding checkpoints]
A checkpoint loads at any process layout: other process counts, stages per process
(``set_ipu_processes``), process order, replicas, its optimizer state sharded or whole.
Where the files at ``path`` are of this run's layout, each process reads its own file
or part. Elsewhere every process reads them all and puts the whole state together, as
one process running every stage holds it: the weights of every part (of pipeline 0,
where replicas keep their own buffers), the optimizer state of every parameter, its
chunks joined in chunk order (chunk k is the replica k's: [Note: sharded optimizer
state]), and the main process's random state, loss scale, step count and loader
position; then it keeps what it runs (a process of a spread pipeline, the state of its
own stages, once it knows them from a call; a sharded run cuts its chunks at its next
step). Every process then agrees before any loads, so another model or optimizer is
refused in every process. This reads every file in every process: a shared file system
(as any restart on other hosts needs) and, for the moment it takes, the whole state in
each process's host memory.

One file set is at ``path``: the main process of a save removes the files that a save
at another layout left there. Should two sets be found (a save that stopped before
removing), the one written last is loaded, by the time its main file was written.

Why not ``torch.distributed.checkpoint``: its planners reshard DTensors and
ShardedTensors, but this state is neither: a weight's chunks of optimizer state are
slices of its flattened elements, each process's random state and loader position are
its own, and a checkpoint of one process is one ``torch.save`` file that is renamed into
place whole. Expressing all of that in DCP would change the file format for every user
for one benefit, reading only the bytes a process needs, which matters past host memory.

The file is written to a temporary file in the same folder, flushed to disk
and renamed over the target, so a crash leaves either the old checkpoint or
the new one, never half of one. It is read with ``torch.load(weights_only=True)``
(no code runs on load) into host memory, wherever it was saved: a checkpoint
written on GPUs loads on a machine with fewer GPUs or none. The weights then go
to the model's devices and the optimizer state to the weights' homes ([Note:
weight homes] in ``weights``); the random state of each GPU that exists here is
restored (no op here can draw from the others). Everything that can be checked
is checked before anything is loaded, and a load that still fails part-way
puts back what it had changed, so a refused checkpoint leaves the model, the
optimizer, the loader and the random state as they were.

Example:
    >>> import os, tempfile, torch
    >>> import poptorch_lite as poptorch
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(2, 1)
    ...     def forward(self, x, y):
    ...         out = self.fc(x)
    ...         return out, torch.nn.functional.mse_loss(out, y)
    >>> model = poptorch.trainingModel(Net())
    >>> _ = model(torch.ones(4, 2), torch.zeros(4, 1))
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = os.path.join(folder.name, "ckpt.pt")
    >>> save_checkpoint(path, model)
    >>> load_checkpoint(path, model).steps
    1
    >>> folder.cleanup()
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import os
import pathlib
import random
import tempfile
from typing import Any, Optional

import torch

from .distributed.layout import Layout
from .distributed.sharding import CHUNK
from .errors import CheckpointError, DataLoaderError
from .wrapper import PoplarExecutor

FORMAT = "poptorch_lite checkpoint"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` restored besides the state itself.

    Attributes:
        steps: optimizer steps the model had taken (skipped ones included).
        epoch: the DataLoader's epoch at saving (None: no loader was saved); the
            next iteration of the loader continues it.
        extra: the ``extra`` given to :func:`save_checkpoint`.
    """

    steps: int
    epoch: Optional[int]
    extra: Any


def save_checkpoint(path, model: PoplarExecutor, dataloader=None, extra: Any = None) -> None:
    """Write the complete training state of ``model`` to ``path``, atomically.

    Of data-parallel processes the main one alone writes ``path``; of a pipeline spread
    over processes each writes its own part ([Note: checkpoints]).

    Args:
        path: the file to write (replaced if it exists).
        model: a model wrapped by ``trainingModel``.
        dataloader: a ``poptorch_lite.DataLoader`` (Sync mode) whose position to save.
        extra: anything else to keep (tensors, numbers, strings, lists, dicts).

    Raises:
        CheckpointError: ``model`` is not a training wrapper.
        DataLoaderError: the loader's position cannot be saved (Async mode).
    """
    _check_model(model)
    layout = _spread(model)
    state = {
        "format": FORMAT, "version": VERSION,
        "model": model.model.state_dict(),
        "optimizer": model._optimizer.state_dict(),
        "optimizer_class": type(model._optimizer).__name__,
        "loss_scale": model._loss_scale.state_dict(),
        "steps": model._steps,
        "rng": _random_state(model),
        "dataloader": dataloader.state_dict() if dataloader is not None else None,
        "extra": extra,
    }
    path = pathlib.Path(path)
    shards = _shards(model) if layout is None else None  # (a part holds its own chunks)
    files = {path}  # the file set of this checkpoint
    if shards is not None:  # [Note: checkpoints]: each process's chunks of the state
        state["shards"] = shards.size
        if shards.rank != 0:
            _write({"format": FORMAT, "version": VERSION, "steps": model._steps,
                    "optimizer": state["optimizer"]}, shard_path(path, shards.rank, shards.size))
            return
        files |= {shard_path(path, k, shards.size) for k in range(1, shards.size)}
    if layout is None and model._processes is not None and model._processes.rank != 0:
        return  # data-parallel processes: the main process writes the one file
    target = path
    if layout is not None:  # [Note: checkpoints]: this process's part
        own = _own_keys(model)
        if not own:
            raise CheckpointError(
                "this model's pipeline spans processes, and which stages are this process's "
                "is known from its first call: call the model (or compile() it) before "
                "save_checkpoint")
        state["model"] = {k: v for k, v in state["model"].items() if k in own}
        state["part"] = _part(layout, _shards(model))
        files = {part_path(path, r, layout.size) for r in range(layout.size)}
        target = part_path(path, layout.rank, layout.size)
    _write(state, target)
    if model._processes is None or model._processes.rank == 0:
        _remove_other_sets(path, files)


def _remove_other_sets(path: pathlib.Path, files: set) -> None:
    """Remove the files that checkpoints at another layout wrote at ``path``, so that one
    file set is there ([Note: resharding checkpoints])."""
    others = [path] + list(path.parent.glob(glob.escape(path.name) + ".process*-of-*")) + \
        list(path.parent.glob(glob.escape(path.name) + ".shard*-of-*"))
    for other in others:
        if other not in files and other.is_file():
            other.unlink(missing_ok=True)


def _write(state: dict, path: pathlib.Path) -> None:
    """``torch.save`` into ``path`` atomically (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_checkpoint(path, model: PoplarExecutor, dataloader=None) -> CheckpointInfo:
    """Restore the training state saved by :func:`save_checkpoint` into ``model``.

    Everything is checked first; on any error nothing has been loaded. The checkpoint may
    have been saved at another process layout (other process counts, stages per process,
    process order, sharding): the state is then put together from all its files and each
    process takes its own ([Note: resharding checkpoints]). In a model whose pipeline spans
    processes or whose optimizer state is sharded, and wherever the state is put together
    anew, every process calls it with the same ``path``; a problem in any process is
    refused in every process, before any loads.

    Args:
        path: the checkpoint file.
        model: a model wrapped by ``trainingModel`` around a model of the same
            architecture, with an optimizer of the same kind and parameter groups.
        dataloader: the loader to position (its next iteration resumes the saved epoch).

    Raises:
        CheckpointError: the file is missing, truncated, not a checkpoint, or does not
            fit the model, optimizer or loader.
    """
    _check_model(model)
    path = pathlib.Path(path)
    layout, shards, processes = _spread(model), _shards(model), model._processes
    found = _newest_set(path)
    everyone = processes is not None and (  # every process reads the same files: one answer
        layout is not None or shards is not None or (found is not None and found[0] != "whole")
        or any(path.parent.glob(glob.escape(path.name) + ".shard*-of-*")))
    try:
        state, problem = _state_for(path, found, model, dataloader, layout, shards), None
    except CheckpointError as e:
        if not everyone:
            raise
        state, problem = None, str(e)
    if everyone:  # every process agrees before any loads
        _agree(model, path, problem, None if state is None else int(state["steps"]))
    undo = _current(model, dataloader)
    loader = state["dataloader"]
    try:
        model.load_state_dict(state["model"], strict="part" not in state)
        model._optimizer.load_state_dict(state["optimizer"])
        model._loss_scale.load_state_dict(state["loss_scale"])
        model._steps = int(state["steps"])
        _set_random_state(state["rng"], model)
        if dataloader is not None and loader is not None:
            dataloader.load_state_dict(loader)
    except Exception as e:
        undo()
        raise CheckpointError(
            f"the checkpoint {str(path)!r} could not be loaded into this model "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); nothing "
            f"was changed. Load it into the model, optimizer and loader it was saved from") from e
    return CheckpointInfo(model._steps, None if loader is None else int(loader["epoch"]),
                          state["extra"])


def _state_for(path: pathlib.Path, found, model: PoplarExecutor, dataloader, layout,
               shards) -> dict:
    """The state this process loads from the newest file set at ``path``: its own file or
    part where the set is of this layout, else the whole state put together from every
    file ([Note: resharding checkpoints])."""
    if found is None:
        raise CheckpointError(f"no checkpoint at {str(path)!r}; check the path")
    kind, W = found
    main = None
    if kind == "whole" and layout is None:
        state = main = _read(path)
        if state.get("shards") in (None, None if shards is None else shards.size):
            _check_fits(path, state, model, dataloader)
            _own_chunks(path, state, shards)
            return state
    elif kind == "parts" and layout is not None and W == layout.size:
        own = part_path(path, layout.rank, layout.size)
        state = _read(own)
        if _saved_part(state) == _part(layout, shards):
            _check_fits(own, state, model, dataloader)
            return state
    return _mine(_put_together(path, found, model, dataloader, main), model, layout)


def _newest_set(path: pathlib.Path):
    """``("whole", None)`` where the newest checkpoint at ``path`` is one file (with its
    chunk files, where sharded); ``("parts", W)`` where it is the parts of W processes;
    None where there is none. Newest: of the file, or of the part of process 0, the one
    written last ([Note: resharding checkpoints])."""
    sets = []
    if path.is_file():
        sets.append((path.stat().st_mtime_ns, "whole", None))
    for first in path.parent.glob(glob.escape(path.name) + ".process0-of-*"):
        count = first.name.rsplit("-of-", 1)[1]
        if count.isdigit():
            sets.append((first.stat().st_mtime_ns, "parts", int(count)))
    return max(sets)[1:] if sets else None


def _put_together(path: pathlib.Path, found, model: PoplarExecutor, dataloader,
                  main: Optional[dict] = None) -> dict:
    """The whole training state of the file set ``found`` at ``path`` (``main``: its main
    file, if read already), as one process running every stage holds it ([Note: resharding
    checkpoints])."""
    kind, W = found
    if kind == "whole":
        main = main if main is not None else _read(path)
        N = main.get("shards")
        files = [(path, main)] + [(shard_path(path, k, N), _chunks(path, k, N, main["steps"]))
                                  for k in range(1, N or 1)]
        pieces = [(k if N else None, state["optimizer"]) for k, (_, state) in enumerate(files)]
        weights = main["model"]
    else:
        files = [(part_path(path, r, W), _read(part_path(path, r, W))) for r in range(W)]
        main, saved = files[0][1], _saved_part(files[0][1])
        if not isinstance(saved, dict) or saved["processes"] != W:
            raise CheckpointError(f"{str(files[0][0])!r} is not process 0's part of a "
                                  f"checkpoint of {W} processes; use the files "
                                  f"poptorch_lite.save_checkpoint wrote")
        ipus = tuple(map(tuple, saved["ipu_processes"])) if saved["ipu_processes"] else None
        pieces, weights = [], {}
        for r, (_, state) in enumerate(files):
            where = Layout(r, W, ipus, saved["process_order"])
            pieces.append((where.pipeline if saved["shards"] else None, state["optimizer"]))
            for key, value in state["model"].items():
                weights.setdefault(key, value)  # of pipeline 0 first (the main's replica)
    steps = {str(f): int(state["steps"]) for f, state in files}
    if len(set(steps.values())) > 1:
        raise CheckpointError(
            f"the files of the checkpoint {str(path)!r} are of different steps ("
            f"{', '.join(f'{f}: step {s}' for f, s in steps.items())}): a process stopped "
            f"while saving; resume from an earlier checkpoint")
    state = {key: value for key, value in main.items() if key not in ("part", "shards")}
    state["model"] = weights
    state["optimizer"] = {"param_groups": main["optimizer"]["param_groups"],
                          "state": _whole_optimizer_state(path, pieces, model)}
    _check_fits(path, state, model, dataloader)
    return state


def _whole_optimizer_state(path, pieces: list, model: PoplarExecutor) -> dict:
    """The optimizer's state of every parameter, whole, from ``pieces``: ``(chunk, state
    dict)`` per file, ``chunk`` the index of the chunks it holds (None: whole states)."""
    params = [p for group in model._optimizer.param_groups for p in group["params"]]
    held: dict = {}
    for chunk, optimizer in pieces:
        for index, entry in optimizer["state"].items():
            held.setdefault(int(index), {}).setdefault(chunk, entry)
    whole = {}
    for index, by_chunk in sorted(held.items()):
        if index >= len(params):
            raise CheckpointError(
                f"the checkpoint {str(path)!r} holds optimizer state for parameter {index}, "
                f"but the model's optimizer has {len(params)}; build the optimizer the same way")
        p, chunks = params[index], sorted(k for k in by_chunk if k is not None)
        first = by_chunk[chunks[0] if chunks else None]
        whole[index] = {}
        for key, value in first.items():
            if key == CHUNK:  # whose chunks they were: the state is whole now
                continue
            if chunks and torch.is_tensor(value) and value.dim() and value.shape != p.shape:
                value = torch.cat([by_chunk[k][key].reshape(-1) for k in chunks])
                if value.numel() != p.numel():
                    raise CheckpointError(
                        f"the chunks of {key!r} of optimizer parameter {index} in the "
                        f"checkpoint {str(path)!r} hold {value.numel()} of its {p.numel()} "
                        f"elements; use the files poptorch_lite.save_checkpoint wrote")
                value = value.view(p.shape)
            whole[index][key] = value
    return whole


def _mine(state: dict, model: PoplarExecutor, layout) -> dict:
    """``state`` (whole) without the optimizer state of the stages other processes run,
    where the pipeline spans processes and this process knows its stages."""
    own = _own_keys(model) if layout is not None else set()
    if not own:
        return state
    names = {id(p): n for n, p in model.model.named_parameters()}
    params = [p for group in model._optimizer.param_groups for p in group["params"]]
    state["optimizer"]["state"] = {i: entry for i, entry in state["optimizer"]["state"].items()
                                   if names.get(id(params[i])) in own}
    return state


def shard_path(path, rank: int, processes: int) -> pathlib.Path:
    """The file in which process ``rank`` of ``processes`` that share the optimizer state
    writes its chunks of it ([Note: checkpoints]; process 0's are in ``path``).

    Example:
        >>> shard_path("ckpt.pt", 1, 2).name
        'ckpt.pt.shard1-of-2'
    """
    return _beside(path, "shard", rank, processes)


def _beside(path, what: str, rank: int, processes: int) -> pathlib.Path:
    """The file ``<path>.<what><rank>-of-<processes>`` that one of several processes writes."""
    path = pathlib.Path(path)
    return path.with_name(f"{path.name}.{what}{rank}-of-{processes}")


def _shards(model: PoplarExecutor):
    """The chunks of the optimizer state this process holds, or None where it holds it whole
    ([Note: sharded optimizer state] in ``distributed/sharding``)."""
    processes = model._processes
    return processes.shards(model._optimizer) if processes is not None else None


def _own_chunks(path, state: dict, shards) -> None:
    """Put this process's chunks of a checkpoint's optimizer state sharded as this run
    shards it into ``state`` (a whole state loads as it is: a sharded run cuts it at its
    next step)."""
    if state.get("shards") is not None and shards.rank != 0:
        state["optimizer"] = _chunks(path, shards.rank, shards.size, state["steps"])["optimizer"]


def _chunks(path, rank: int, processes: int, steps) -> dict:
    """Process ``rank``'s file of chunks of the sharded optimizer state of the checkpoint
    ``path`` of step ``steps``."""
    chunk_file = shard_path(path, rank, processes)
    try:
        chunks = torch.load(chunk_file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(
            f"no chunk of the optimizer state at {str(chunk_file)!r}: with "
            f"useReplicatedTensorSharding every process calls save_checkpoint and writes its "
            f"own chunks beside {str(path)!r}") from None
    if not isinstance(chunks, dict) or chunks.get("format") != FORMAT or \
            chunks.get("steps") != steps:
        raise CheckpointError(
            f"{str(chunk_file)!r} is not process {rank}'s chunk of the optimizer state "
            f"of {str(path)!r} (of step {steps}): a process stopped while saving; "
            f"resume from an earlier checkpoint")
    return chunks


def part_path(path, rank: int, processes: int) -> pathlib.Path:
    """The file that process ``rank`` of ``processes`` writes for ``path`` when its model's
    pipeline spans processes ([Note: checkpoints]).

    Example:
        >>> part_path("ckpt.pt", 1, 2).name
        'ckpt.pt.process1-of-2'
    """
    return _beside(path, "process", rank, processes)


def _spread(model: PoplarExecutor):
    """The process layout of a model whose pipeline spans processes, else None."""
    processes = model._processes
    return processes.layout if processes is not None and processes.layout.spans_processes \
        else None


def _part(layout, shards) -> dict:
    return {"rank": layout.rank, "processes": layout.size,
            "ipu_processes": [list(ids) for ids in layout.ipu_processes],
            "process_order": layout.order, "shards": None if shards is None else shards.size}


def _own_keys(model: PoplarExecutor) -> set:
    """The parameters and buffers of the stages this process runs (in any program)."""
    keys = set()
    for program in model._programs.values():
        for st in program.partition.stages:
            if program.executor.local[st.index]:
                keys.update(n.split(":", 1)[1] for n in st.inputs
                            if n.startswith(("param:", "buffer:")))
    return keys


def _read(path: pathlib.Path) -> dict:
    """The checkpoint file at ``path``, refused unless it is one of this version."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {str(path)!r}; check the path") from None
    except Exception as e:
        raise CheckpointError(
            f"{str(path)!r} cannot be read as a checkpoint: it is truncated, corrupt or not "
            f"a torch file ({type(e).__name__}: {str(e).splitlines()[0][:200]}); use a file "
            f"written by poptorch_lite.save_checkpoint") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        keys = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{str(path)!r} is not a poptorch_lite checkpoint (found {keys}); for a plain "
            f"state_dict use model.load_state_dict(torch.load(path, weights_only=True))")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{str(path)!r} has checkpoint version {state.get('version')!r}; "
                              f"this poptorch_lite reads version {VERSION}")
    return state


def _saved_part(state: dict):
    """The part of a pipeline's checkpoint ``state`` says it is (None: not a part). One
    written before ``set_process_order`` and sharding was pipeline-inner and whole.

    Example:
        >>> part = _saved_part({"part": {"rank": 1, "processes": 2, "ipu_processes": [[0], [1]]}})
        >>> part["process_order"], part["shards"], part["rank"]
        ('pipeline_inner', None, 1)
    """
    saved = state.get("part")
    if isinstance(saved, dict):
        saved = {"process_order": "pipeline_inner", "shards": None, **saved}
    return saved


def _agree(model: PoplarExecutor, path, problem, steps) -> None:
    """Every process reports on what it would load; any problem, or parts of different
    steps, is refused in every process before any of them loads."""
    processes = model._processes
    processes.join(model.model, model._optimizer)
    reports = processes.gather({processes.rank: (problem, steps)})
    if problem is not None:
        raise CheckpointError(problem)
    for rank in sorted(reports):
        theirs, _ = reports[rank]
        if theirs is not None:
            raise CheckpointError(f"process {rank} cannot load its part of the checkpoint "
                                  f"{str(path)!r}: {theirs}")
    taken = {rank: s for rank, (_, s) in sorted(reports.items())}
    if len(set(taken.values())) > 1:
        raise CheckpointError(
            f"the parts of the checkpoint {str(path)!r} are of different steps ("
            f"{', '.join(f'process {r}: step {s}' for r, s in taken.items())}): a process "
            f"stopped while saving; resume from an earlier checkpoint")


def _random_state(model: PoplarExecutor) -> dict:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "python": random.getstate(),
            "model": model._random.get_state() if model._random is not None else None}


def _set_random_state(saved: dict, model: PoplarExecutor) -> None:
    """Restore the generators; CUDA's for the GPUs this machine has ([Note: checkpoints]);
    the model's own (``Options.randomSeed``) where both have one."""
    torch.set_rng_state(saved["torch"])
    if model._random is not None and saved.get("model") is not None:
        model._random.set_state(saved["model"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, gpu_state in enumerate(saved["cuda"][:gpus]):
        torch.cuda.set_rng_state(gpu_state, index)
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))


def _current(model: PoplarExecutor, dataloader):
    """What loading changes, copied; the returned function puts it back."""
    weights = {k: v.detach().clone() for k, v in model.model.state_dict().items()}
    optimizer = copy.deepcopy(model._optimizer.state_dict())
    loss_scale, steps, rng = model._loss_scale.state_dict(), model._steps, _random_state(model)
    loader = dataloader.state_dict() if dataloader is not None else None

    def undo() -> None:
        model.load_state_dict(weights)
        model._optimizer.load_state_dict(optimizer)
        model._loss_scale.load_state_dict(loss_scale)
        model._steps = steps
        _set_random_state(rng, model)
        if loader is not None:
            dataloader.load_state_dict(loader)
    return undo


def _check_model(model) -> None:
    if not isinstance(model, PoplarExecutor) or model._optimizer is None:
        raise CheckpointError(
            f"checkpoints hold a training state: pass the model returned by "
            f"poptorch.trainingModel(...), not {type(model).__name__}")


def _check_fits(path, state: dict, model: PoplarExecutor, dataloader) -> None:
    """Refuse a checkpoint that would load only partly."""
    where = f"the checkpoint {str(path)!r}"
    own = model.model.state_dict()
    saved = state["model"]
    if "part" in state:  # a part holds its process's stages ([Note: checkpoints])
        mine = _own_keys(model) or saved.keys()  # known once the model has been called
        own = {k: v for k, v in own.items() if k in mine}
    if own.keys() != saved.keys():
        raise CheckpointError(
            f"{where} is of another model: missing {sorted(own.keys() - saved.keys())[:5]}, "
            f"unexpected {sorted(saved.keys() - own.keys())[:5]}; wrap the same architecture")
    for k, v in own.items():
        if tuple(v.shape) != tuple(saved[k].shape):
            raise CheckpointError(f"{where} has {k} of shape {tuple(saved[k].shape)}, the "
                                  f"model {tuple(v.shape)}; wrap the same architecture")
    kind = type(model._optimizer).__name__
    if state.get("optimizer_class") != kind:
        raise CheckpointError(f"{where} holds the state of a {state.get('optimizer_class')} "
                              f"optimizer, the model's is a {kind}; use the same optimizer class")
    groups = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
    ours = [len(g["params"]) for g in model._optimizer.param_groups]
    if groups != ours:
        raise CheckpointError(f"{where} has optimizer groups of {groups} parameters, the "
                              f"model's optimizer {ours}; build the optimizer the same way")
    _check_random_state(where, state.get("rng"))
    if dataloader is not None and state["dataloader"] is None:
        raise CheckpointError(f"{where} holds no DataLoader position; save it with "
                              f"save_checkpoint(path, model, dataloader)")
    if dataloader is not None:  # the loader can continue the saved epoch: checked, not loaded
        try:
            dataloader._check_position(state["dataloader"])
        except DataLoaderError as e:
            raise CheckpointError(f"{where} cannot be resumed by this loader: {e}") from None


def _is_generator_state(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1


def _check_random_state(where: str, saved) -> None:
    """Refuse random states that could not be restored, before anything is loaded."""
    problem = None
    if not isinstance(saved, dict) or not {"torch", "cuda", "python"} <= saved.keys():
        problem = f"expected the keys torch, cuda and python, found {saved!r:.80}"
    elif not _is_generator_state(saved["torch"]):
        problem = "the CPU generator's state is not a byte tensor"
    elif not isinstance(saved["cuda"], (list, tuple)) or not all(
            _is_generator_state(t) for t in saved["cuda"]):
        problem = "the CUDA generators' states are not a list of byte tensors"
    elif not (isinstance(saved["python"], (list, tuple)) and len(saved["python"]) == 3):
        problem = "Python's random state is not a (version, state, gauss) triple"
    if problem is not None:
        raise CheckpointError(f"{where} has random states that cannot be restored ({problem}); "
                              f"use a file written by poptorch_lite.save_checkpoint")
