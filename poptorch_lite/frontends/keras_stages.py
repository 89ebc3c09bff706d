"""The Keras face's stage-assignment tooling: layers in call order, get/set, the summaries.

[Note: Keras layer order]
IPU Keras assigns pipeline stages to a model's layers in post order, the order
in which they run. For a ``keras.Sequential`` (an ``nn.Sequential``) that is
the order of the layers. For any other module (the functional route) it is the
order in which ``forward`` first calls each child module, which need not be
the order in which ``__init__`` declared them; it is read off one run of the
module on a batch ([Note: dry run]): the first batch the model saw (a call
``model(x)``, or the first ``fit``/``evaluate``/``predict``). A layer called
twice counts once, at its first call. ``set_pipeline_stage_assignment`` before
any batch is kept and applied to the first one; ``get_pipeline_stage_assignment``
needs the order, so it asks for one call of the model first.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import BlockError, InputError
from .dry_run import module_calls
from .splits import assign_stages


class PipelineStageAssignment:
    """One layer and its pipeline stage (IPU Keras' ``FunctionalLayerPipelineStageAssignment``
    and ``SequentialLayerPipelineStageAssignment``): set ``pipeline_stage`` and pass the list
    back to ``set_pipeline_stage_assignment``.

    Example:
        >>> a = PipelineStageAssignment(torch.nn.Linear(2, 2), None)
        >>> a.pipeline_stage = 1
    """

    def __init__(self, layer: torch.nn.Module, pipeline_stage: Optional[int], name: str = ""):
        self.layer, self.pipeline_stage, self.name = layer, pipeline_stage, name

    def __repr__(self):
        return f"PipelineStageAssignment({self.name or type(self.layer).__name__}, " \
               f"pipeline_stage={self.pipeline_stage})"


class StageTooling:
    """The stage-assignment methods of ``keras.Model`` ([Note: Keras layer order]).

    Uses the model's ``module``, ``name``, ``_assignment``, ``_stages``,
    ``_layer_stages``, ``_example`` and ``_release()``.
    """

    def _order(self) -> Optional[list]:
        """``(name, child)`` in call order, or None while no batch has been seen."""
        children = list(self.module.named_children())
        if isinstance(self.module, torch.nn.Sequential):
            return children
        if self._example is None:
            return None
        if self._call_order is None:
            _, calls = module_calls(self.module, self._example)
            position = {id(m): k for k, (m, _) in enumerate(calls)}
            self._call_order = sorted(children, key=lambda nc: position.get(id(nc[1]),
                                                                            len(calls)))
        return self._call_order

    def _apply_assignment(self) -> None:
        """Put the blocks of a kept assignment on the layers once their order is known."""
        order = self._order()
        if self._assignment is not None and order is not None and not self._applied:
            assign_stages(self.module, [m for _, m in order], self._assignment)
            self._applied = True

    def set_pipeline_stage_assignment(self, assignment: Sequence) -> None:
        """Put the k-th layer in call order on stage (IPU) ``assignment[k]``.

        ``assignment`` holds ints, or the objects of ``get_pipeline_stage_assignment()``
        with their ``pipeline_stage`` set. For a functional model whose call order is
        not known yet, the assignment is applied to the first batch ([Note: Keras layer
        order]).

        Raises:
            BlockError: the list's length differs from the number of layers, a stage
                is not an int >= 0, or the stages decrease.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> model = Sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
            >>> model.set_pipeline_stage_assignment([0, 1])
        """
        stages = [a.pipeline_stage if isinstance(a, PipelineStageAssignment) else a
                  for a in assignment]
        n = len(list(self.module.children()))
        if len(stages) != n:
            raise BlockError(f"the assignment has {len(stages)} entries for {n} layers; give "
                             f"one stage per layer")
        order = self._order()
        if order is not None:
            assign_stages(self.module, [m for _, m in order], stages)
        else:  # checked and applied at the first batch, in call order
            for k, s in enumerate(stages):
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise BlockError(f"assignment[{k}] is {s!r}; stages are non-negative ints")
        self._release()
        self._assignment, self._applied, self._stages = list(stages), order is not None, None
        self._layer_stages = None

    def reset_pipeline_stage_assignment(self) -> None:
        """Drop the stage assignment: the model is no longer pipelined by it.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).reset_pipeline_stage_assignment()
        """
        from ..annotations import removeBlocks
        removeBlocks(self.module)
        self._release()
        self._assignment, self._applied, self._stages, self._layer_stages = None, False, None, None

    def get_pipeline_stage_assignment(self) -> list:
        """The layers in post order (the order they run) with their pipeline stages.

        Each item has ``.layer`` and ``.pipeline_stage`` (None where no stage is set:
        no assignment and no ``PipelineStage`` scope seen in a trace).

        Raises:
            InputError: a functional model that has not run yet (its order is unknown).

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> model = Sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
            >>> model.set_pipeline_stage_assignment([0, 1])
            >>> [a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
            [0, 1]
        """
        order = self._order()
        if order is None:
            raise InputError(f"{self.name} is not an nn.Sequential, so the order in which it "
                             f"calls its layers is read off one run: call the model once on a "
                             f"batch (model(x)), or fit/evaluate/predict, first")
        stages = self._stage_list(order)
        return [PipelineStageAssignment(m, s, name) for (name, m), s in zip(order, stages)]

    def _stage_list(self, order: list) -> list:
        if self._assignment is not None:
            return list(self._assignment)
        known = self._layer_stages or {}
        return [known.get(name) for name, _ in order]

    def print_pipeline_stage_assignment_summary(self, line_length=None, print_fn=None) -> None:
        """Print each layer (in the order they run), its type, stage and parameter count.

        The stages are the assignment's, or for a model with ``PipelineStage`` scopes
        the ones its trace found ("-" until the model has run).

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).print_pipeline_stage_assignment_summary()
            layer | type   | stage | parameters
            ------+--------+-------+-----------
            0     | Linear | 0     | 10
        """
        order = self._order() or list(self.module.named_children())
        if self._assignment is None and self._layer_stages is None and self._example is not None:
            self._trace_stages()
        stages = self._stage_list(order)
        if self._assignment is None and self._layer_stages is None:
            stages = [0 if isinstance(self.module, torch.nn.Sequential) else None] * len(order)
        rows = [(name, type(m).__name__, "-" if s is None else str(s),
                 f"{sum(p.numel() for p in m.parameters()):,}")
                for (name, m), s in zip(order, stages)]
        for line in table(("layer", "type", "stage", "parameters"), rows).splitlines():
            (print_fn or print)(line)

    def summary(self, line_length=None, print_fn=None) -> None:
        """Print the layers and their parameter counts, then the totals.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).summary()
            Model: "Sequential"
            layer | type   | parameters
            ------+--------+-----------
            0     | Linear | 10
            Total params: 10
            Trainable params: 10
            Non-trainable params: 0
        """
        rows = [(name, type(m).__name__, f"{sum(p.numel() for p in m.parameters()):,}")
                for name, m in self.module.named_children()]
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.module.parameters() if not p.requires_grad) + sum(
            b.numel() for b in self.module.buffers() if b.is_floating_point())
        out = print_fn or print
        out(f'Model: "{self.name}"')
        for line in table(("layer", "type", "parameters"), rows).splitlines():
            out(line)
        out(f"Total params: {trainable + frozen:,}\nTrainable params: {trainable:,}\n"
            f"Non-trainable params: {frozen:,}")


def layer_stages(partition, prefix: str, module: torch.nn.Module) -> dict:
    """``{child name: stage}`` of ``module``'s children, from a traced partition."""
    stage_of_block = {b: st.index for st in partition.stages for b in st.blocks}
    found = {}
    for name, _ in module.named_children():
        for layer, block in partition.module_blocks.items():
            if layer == prefix + name or layer.startswith(prefix + name + "."):
                found[name] = stage_of_block.get(block, 0)
                break
    return found


def table(header: tuple, rows: list) -> str:
    """Rows as an ASCII table under ``header``."""
    rows = [header, *rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
