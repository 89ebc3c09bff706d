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
  forward shapes] in ``grad_semantics``: a stop makes it False); of an op's
  several outputs, those autograd differentiates (the op run once on meta
  tensors: a batch norm's saved statistics are not, and a stage that read them
  as requiring grad failed in a second-order backward). It is a
  superset of what autograd decides (an op without a derivative, such as
  ``zeros_like``, gives a value that does not require grad): for such a value
  a gradient of zeros travels and the producer drops it, which costs a message
  but never a gradient.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from .subgraphs import base_op


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
    outputs: dict = {}  # a node of several outputs -> which of them autograd differentiates
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
        if n.target is operator.getitem and n.args[0] in outputs:  # one of several outputs
            derived = derived and outputs[n.args[0]][n.args[1]]
        differentiable[n] = derived and (isinstance(val, (tuple, list)) or _can_have_grad(val))
        if differentiable[n] and isinstance(val, (tuple, list)):
            flags = _differentiable_outputs(n, differentiable)
            if flags is not None:
                outputs[n] = flags
        name = value_name(n)
        if name in wanted and isinstance(val, torch.Tensor):
            infos[name] = ValueInfo(tuple(val.shape), val.dtype, differentiable[n], dynamic[n])
    return infos


def _differentiable_outputs(n: fx.Node, differentiable: dict) -> Optional[tuple]:
    """Which outputs of ``n``, an op of several, autograd gives a gradient: the op run on meta
    tensors of the traced shapes, its differentiable inputs requiring grad (a batch norm's
    saved mean and inverse deviation are not, and a stage that read them as requiring grad
    failed in a second-order backward: "the derivative for 'native_batch_norm_backward
    save_invstd' is not implemented"). Only an ATen op runs (through the stream wrappers:
    on meta tensors nothing is drawn), never Python of the model's (a custom Function). None
    where that cannot be told (all may then)."""
    op = base_op(n.target)
    if not isinstance(op, torch._ops.OpOverload):
        return None

    def meta(a):
        if not isinstance(a, fx.Node):
            return a
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise TypeError("not a tensor")
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return t.requires_grad_(True) if differentiable.get(a) and _can_have_grad(t) else t
    try:
        args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), meta)
        with torch.enable_grad():
            out = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: keep the superset
        return None
    if not isinstance(out, (tuple, list)):
        return None
    return tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in out)
