"""Front ends from the Keras and TF1 tutorials that produce the same block records.

- ``set_pipeline_stage_assignment(seq, [0, 0, 1, 1])``: the children of an
  ``nn.Sequential`` by a list (Keras' method of the same name);
- ``split_at(model, ["dense128", "dense64"])``: new stages start at named
  layers chosen at run time (the TF1 tutorial's ``--splits``);
- ``stage_summary(poptorch_model)``: the table of layer, block, stage,
  device and parameters (Keras' ``print_pipeline_stage_assignment_summary``).

Both assignment helpers only call ``BeginBlock``: the model partitions exactly
as if it had been annotated by hand.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..annotations import BeginBlock, removeBlocks
from ..errors import BlockError


def set_pipeline_stage_assignment(model: torch.nn.Sequential, assignment: Sequence[int]):
    """Put child k of ``model`` on stage (and IPU) ``assignment[k]``.

    Each change of stage starts a block named after the stage (``"stage1"``).

    Raises:
        BlockError: ``model`` is not an ``nn.Sequential``, the list's length differs
            from the number of children, or the stages decrease.

    Example:
        >>> seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> _ = set_pipeline_stage_assignment(seq, [0, 0, 1])
    """
    if not isinstance(model, torch.nn.Sequential):
        raise BlockError(f"set_pipeline_stage_assignment needs an nn.Sequential, got "
                         f"{type(model).__name__}; annotate other models with BeginBlock or Block")
    return assign_stages(model, list(model.children()), assignment)


def assign_stages(model: torch.nn.Module, layers: Sequence[torch.nn.Module],
                  assignment: Sequence[int]):
    """Put ``layers[k]`` (modules of ``model``, in the order they run) on stage ``assignment[k]``.

    The blocks ``model`` had are removed first. Used by
    :func:`set_pipeline_stage_assignment` and by the Keras face's models.

    Raises:
        BlockError: the list's length differs from the number of layers, a stage is
            not an int >= 0, or the stages decrease.

    Example:
        >>> seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = assign_stages(seq, list(seq.children()), [0, 1])
    """
    children = list(layers)
    if len(assignment) != len(children):
        raise BlockError(f"the assignment has {len(assignment)} entries for {len(children)} "
                         f"layers; give one stage per layer")
    for k, s in enumerate(assignment):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise BlockError(f"assignment[{k}] is {s!r}; stages are non-negative ints")
        if k and s < assignment[k - 1]:
            raise BlockError(f"assignment {list(assignment)} goes from stage {assignment[k - 1]} "
                             f"back to {s} at layer {k}; stages must not decrease")
    removeBlocks(model)
    previous = None
    for child, s in zip(children, assignment):
        if s != previous:
            BeginBlock(child, f"stage{s}", ipu_id=s)
            previous = s
    return model


def split_at(model: torch.nn.Module, names: Sequence[str]):
    """Start a new stage at each named layer: stage k+1 begins at ``names[k]``.

    Layers before the first name form stage 0 (IPU 0).

    Raises:
        BlockError: a name is not a layer of ``model`` (the message lists them),
            or a name repeats.

    Example:
        >>> seq = torch.nn.Sequential()
        >>> seq.add_module("dense1", torch.nn.Linear(2, 2))
        >>> seq.add_module("dense2", torch.nn.Linear(2, 1))
        >>> _ = split_at(seq, ["dense2"])
    """
    layers = dict(model.named_modules())
    for n in names:
        if n not in layers or n == "":
            known = [k for k in layers if k]
            raise BlockError(f"split_at: no layer named {n!r}; the layers are {known}")
    if len(set(names)) != len(names):
        raise BlockError(f"split_at: {list(names)} names a layer twice; name each layer once")
    removeBlocks(model)
    for k, n in enumerate(names):
        BeginBlock(layers[n], n, ipu_id=k + 1)
    return model


def stage_summary(poptorch_model) -> str:
    """A table of every layer the compiled model ran: block, stage, IPU, device, parameters.

    Args:
        poptorch_model: a wrapped model that has been called or compiled.

    Example:
        >>> print(stage_summary(model))  # doctest: +SKIP
        layer   | block  | stage | ipu | device | parameters
        ...
    """
    program = _last_program(poptorch_model)
    part = program.partition
    placement = program.executor.placement
    stage_of_block = {b: st.index for st in part.stages for b in st.blocks}
    modules = dict(poptorch_model.model.named_modules())
    rows = [("layer", "block", "stage", "ipu", "device", "parameters")]
    for name, block in part.module_blocks.items():
        m = modules[name]
        if any(True for _ in m.children()):
            continue
        s = stage_of_block.get(block, 0)
        n_params = sum(p.numel() for p in m.parameters(recurse=False))
        ipu = part.stages[s].ipu
        rows.append((name, "-" if block is None else block, str(s), str(ipu),
                     str(placement.device(ipu)), f"{n_params:,}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def num_stages(poptorch_model) -> int:
    """The number of stages the wrapped model's last compiled input signature has.

    Example:
        >>> num_stages(model)  # doctest: +SKIP
        2
    """
    return _last_program(poptorch_model).partition.num_stages


def _last_program(poptorch_model):
    poptorch_model._require_compiled()
    return next(reversed(poptorch_model._programs.values()))


def print_pipeline_stage_assignment_summary(poptorch_model) -> None:
    """Print ``stage_summary(poptorch_model)`` (Keras' name)."""
    print(stage_summary(poptorch_model))
