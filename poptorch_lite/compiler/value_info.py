"""What the values computed by stages look like: shape, dtype, gradient, from the trace.

[Note: value info]
A value that one stage computes and a stage in another process reads travels
as a message whose receiver allocates it before it arrives ([Note: stages in
other processes] in ``distributed``), and a gradient goes back only for
values that can have one. Both are read off the traced graph, identically in
every process:

- ``shape`` and ``dtype``: the value on the traced micro-batch (every
  micro-batch of a call has the same shapes);
- ``dynamic``: the shape may depend on the data (an op tagged
  ``dynamic_output_shape``, such as ``nonzero`` or a boolean mask, or anything
  computed from one): such a value travels after a header with its shape;
- ``differentiable``: the value may require grad, because it is a floating
  point (or complex) value computed from a trainable parameter, and the trace
  saw it require grad where the model's own code held it ([Note: gradients the
  forward shapes] in ``grad_semantics``: a stop makes it False). It is a
  superset of what autograd decides (an op without a derivative, such as
  ``zeros_like``, gives a value that does not require grad): for such a value
  a gradient of zeros travels and the producer drops it, which costs a message
  but never a gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """One stage-computed value of one micro-batch ([Note: value info]).

    Example:
        >>> ValueInfo((2, 3), torch.float32, True, False).numel
        6
    """

    shape: tuple
    dtype: torch.dtype
    differentiable: bool
    dynamic: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _can_have_grad(val) -> bool:
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def value_infos(gm: fx.GraphModule, source_name: dict, trainable: Callable[[str], bool],
                value_name: Callable[[fx.Node], str], wanted: set) -> dict:
    """``{value name: ValueInfo}`` for the nodes of ``gm`` whose names are in ``wanted``.

    Args:
        gm: the traced graph (nodes carry ``meta["val"]``).
        source_name: placeholder node -> its value name (``param:``, ``buffer:``, ``input:``).
        trainable: parameter name -> whether it requires grad.
        value_name: node -> its value name.
        wanted: the value names to describe.
    """
    differentiable: dict = {}
    dynamic: dict = {}
    infos = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind, _, key = source_name[n].partition(":")
            differentiable[n] = kind == "param" and trainable(key)
            dynamic[n] = False
            continue
        if n.op != "call_function":
            differentiable[n] = dynamic[n] = False
            continue
        inputs = n.all_input_nodes
        val = n.meta.get("val")
        tags = getattr(n.target, "tags", ())
        dynamic[n] = torch.Tag.dynamic_output_shape in tags or any(dynamic.get(m) for m in inputs)
        derived = any(differentiable.get(m) for m in inputs) and n.meta.get("requires_grad", True)
        differentiable[n] = derived and (isinstance(val, (tuple, list)) or _can_have_grad(val))
        name = value_name(n)
        if name in wanted and isinstance(val, torch.Tensor):
            infos[name] = ValueInfo(tuple(val.shape), val.dtype, differentiable[n], dynamic[n])
    return infos
