"""The Keras face's stage assignment: layers in call order, their stages, the summaries' tables.

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

from typing import Optional

import torch



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
