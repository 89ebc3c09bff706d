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
``<path>.shard<k>-of-<N>`` (:func:`shard_path`). Loading needs the same N, sharded; a whole
state (saved unsharded) loads into a sharded run, which cuts it at its next step.

When the processes are data-parallel replicas of one whole pipeline, they hold the same
weights and optimizer state (every step all-reduces their gradients), so one file holds
the training state: whichever processes call ``save_checkpoint(path, ...)`` (every one, or
only the main one, as ``is_main_process`` suggests), the main process alone writes it, so
no two processes write one file. It holds the main process's buffers, which are its
replica 0's where replicas keep their own ([Note: running statistics on replicas] in
``compiler/running_stats``), its random state (the processes share one under
``Options.randomSeed``, as the sharded shuffle requires) and its loader position (the same
batch in every process: every process calls the model as often). Every process loads that
file, and every replica starts again from those buffers. A position inside an epoch
continues only with the process count it was saved with, since the rest of the epoch is
split between the processes; at an epoch's end any count may go on
(``DataLoader._check_position``); a refusal comes before anything loads.

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
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> save_checkpoint(path, model)
    >>> load_checkpoint(path, model).steps
    1
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import random
import tempfile
from typing import Any, Optional

import torch

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
    if shards is not None:  # [Note: checkpoints]: each process's chunks of the state
        state["shards"] = shards.size
        if shards.rank != 0:
            _write({"format": FORMAT, "version": VERSION, "steps": model._steps,
                    "optimizer": state["optimizer"]}, shard_path(path, shards.rank, shards.size))
            return
    if layout is None and model._processes is not None and model._processes.rank != 0:
        return  # data-parallel processes: the main process writes the one file
    if layout is not None:  # [Note: checkpoints]: this process's part
        own = _own_keys(model)
        if not own:
            raise CheckpointError(
                "this model's pipeline spans processes, and which stages are this process's "
                "is known from its first call: call the model (or compile() it) before "
                "save_checkpoint")
        state["model"] = {k: v for k, v in state["model"].items() if k in own}
        state["part"] = _part(layout, _shards(model))
        path = part_path(path, layout.rank, layout.size)
    _write(state, path)


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

    Everything is checked first; on any error nothing has been loaded. When the
    model's pipeline spans processes, every process calls it with the same ``path``
    and loads its own part ([Note: checkpoints]); a part that is missing, unfitting
    or from another step than the others is refused in every process.

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
    layout = _spread(model)
    if layout is None:
        state = _read(pathlib.Path(path), model, dataloader, None)
        _own_chunks(path, state, _shards(model))
    else:  # every process reads its part; all of them agree before any loads
        try:
            state, problem = _read(part_path(path, layout.rank, layout.size), model, dataloader,
                                   layout), None
        except CheckpointError as e:
            state, problem = None, str(e)
        _agree_on_parts(model, path, problem, None if state is None else int(state["steps"]))
    undo = _current(model, dataloader)
    loader = state["dataloader"]
    try:
        model.load_state_dict(state["model"], strict=layout is None)
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
    """Put this process's chunks of a sharded checkpoint's optimizer state into ``state``;
    refuse a checkpoint whose state is sharded otherwise than this run's. A whole state
    loads anywhere (a sharded run cuts it at its next step)."""
    saved = state.get("shards")
    if saved is None:
        return
    mine = None if shards is None else shards.size
    if saved != mine:
        raise CheckpointError(
            f"{str(path)!r} holds an optimizer state sharded over {saved} processes "
            f"(useReplicatedTensorSharding), but this run "
            f"{'holds it whole' if mine is None else f'shards it over {mine}'}; resume with "
            f"{saved} data-parallel processes and the state sharded")
    if shards.rank == 0:
        return
    chunk_file = shard_path(path, shards.rank, shards.size)
    try:
        chunks = torch.load(chunk_file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(
            f"no chunk of the optimizer state at {str(chunk_file)!r}: with "
            f"useReplicatedTensorSharding every process calls save_checkpoint and writes its "
            f"own chunks beside {str(path)!r}") from None
    if not isinstance(chunks, dict) or chunks.get("format") != FORMAT or \
            chunks.get("steps") != state["steps"]:
        raise CheckpointError(
            f"{str(chunk_file)!r} is not process {shards.rank}'s chunk of the optimizer state "
            f"of {str(path)!r} (of step {state['steps']}): a process stopped while saving; "
            f"resume from an earlier checkpoint")
    state["optimizer"] = chunks["optimizer"]


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


def _read(path: pathlib.Path, model: PoplarExecutor, dataloader, layout) -> dict:
    """The checkpoint at ``path``, checked against the model (and, for a part, the layout)."""
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
    saved = _saved_part(state)
    mine = None if layout is None else _part(layout, _shards(model))
    if layout is not None and saved != mine:
        raise CheckpointError(
            f"{str(path)!r} was written by {_describe_part(saved)}, but this is "
            f"{_describe_part(mine)}; resume with the processes, "
            f"Options.Distributed.set_ipu_processes and set_process_order it was saved with, "
            f"and its optimizer state sharded or whole as it was")
    _check_fits(path, state, model, dataloader)
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


def _describe_part(part) -> str:
    if not isinstance(part, dict):
        return "one process running every stage"
    order = "" if part["process_order"] == "pipeline_inner" else f" in {part['process_order']} order"
    shards = "" if part["shards"] is None else f", its optimizer state sharded over {part['shards']}"
    return (f"process {part['rank']} of {part['processes']} with set_ipu_processes"
            f"({part['ipu_processes']}){order}{shards}")


def _agree_on_parts(model: PoplarExecutor, path, problem, steps) -> None:
    """Every process of a spread model reports on its part; any problem, or parts of
    different steps, is refused in every process before any of them loads."""
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
