"""Stage graphs moved to the device their stage runs on.

[Note: graphs on their devices]
A model is traced once, on the host model's device (``partition``), and its
stages then run wherever their IPUs are placed: a graph traced on the CPU may
run on a GPU, one traced on a GPU on the CPU. The trace bakes in three things
that belong to the trace device, and :func:`to_device` rewrites each of them
for the stage's device:

- **devices named by ops**: factory ops (``arange``, ``zeros``,
  ``rand(..., device=x.device)``, ``full``) and copies (``_to_copy``) carry
  the trace device as an argument; every ``torch.device`` in a node's
  arguments becomes the stage's device (a stage runs wholly on its device, as
  a PopTorch stage runs wholly on its IPU);
- **tensor constants**: a tensor made inside ``forward`` from Python data
  (``torch.tensor([...])``) is lifted into the graph module as an attribute on
  the trace device; the stage's module gets a copy on its device;
- **kernels chosen for the trace device**: below autograd, torch has already
  picked a device's kernel for some ops. Scaled dot-product attention is
  recorded as the trace device's variant (``_scaled_dot_product_flash_attention_for_cpu``
  on the CPU; the flash, memory-efficient or cuDNN variant on a GPU); it is
  put back as ``aten.scaled_dot_product_attention``, which picks the best
  kernel of the stage's device at run time, as plain PyTorch does there.
  Batch norm is recorded as the CPU's ``native_batch_norm``; plain PyTorch on
  a GPU runs cuDNN's (``torch.batch_norm`` chooses it), whose sums are
  rounded differently, so on a GPU it is put back as ``torch.batch_norm``
  (found on an H200: a ResNet's first loss differed in its 7th digit). An
  op that is left with no kernel for the stage's device is found before
  anything runs (:func:`missing_kernels`): the wrapper then traces again with
  oneDNN's CPU-only kernels turned off (an LSTM traced on the CPU records
  ``mkldnn_rnn_layer`` otherwise) and, if an op still lacks a kernel, refuses
  the placement naming the op, its line and the stage.

Random ops keep drawing from the micro-batch's stream ([Note: micro-batch RNG]
in ``rng``): a rewritten random op is routed through it again. One that draws from a
generator of the model's own on another kind of device runs there, its tensors copied
there and back ([Note: a user's generator] in ``rng``).
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from ..errors import TraceError
from .subgraphs import base_op, rewrap

aten = torch.ops.aten

# Device-specific variants of scaled dot-product attention; each takes query, key, value
# and returns the attention output first (what the composite op returns).
_ATTENTION = tuple(op for op in (
    getattr(aten, name, None) for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable"))
    if op is not None)
_ATTENTION_OVERLOADS = {op.default for op in _ATTENTION}


def _dispatch_key(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else "CPU"


def _op(node: fx.Node):
    """The aten op a node calls (seen through the random-stream wrapper), or None."""
    if node.op != "call_function":
        return None
    target = base_op(node.target)  # what rng.seeded or a no-grad wrapper wraps
    return target if isinstance(target, torch._ops.OpOverload) else None


def _has_kernel(op, device: torch.device) -> bool:
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(),
                                                                   _dispatch_key(device))


def _line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return " / ".join(ln.strip() for ln in trace[-2:]) if trace else "(no source line)"


def missing_kernels(modules: Iterable[fx.GraphModule], device: torch.device) -> list:
    """``(op name, source line)`` of each op in ``modules`` with no kernel for ``device``.

    Attention variants are not listed: :func:`to_device` replaces them.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> missing_kernels([gm], torch.device("cpu"))
        []
    """
    missing = []
    for gm in modules:
        for node in gm.graph.nodes:
            op = _op(node)
            if op is not None and op not in _ATTENTION_OVERLOADS and not _has_kernel(op, device):
                missing.append((op.name(), _line(node)))
    return missing


def constants(gm: fx.GraphModule) -> list:
    """``(node, tensor)`` of each tensor constant ``gm`` holds (``get_attr``): a tensor the
    model keeps as a plain attribute, or one the forward made from Python data (which the
    graph copies afresh before any write, ``lift_fresh_copy``, as plain PyTorch makes it
    anew)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            value = getattr(gm.get_submodule(owner) if owner else gm, name)
            if isinstance(value, torch.Tensor):
                found.append((node, value))
    return found


def written_constants(gm: fx.GraphModule) -> list:
    """``(tensor, source line, sent)`` of each in-place write in ``gm`` into a tensor
    constant; ``sent``: the graph returns the tensor itself (the constant, or the write's
    result, which is it), for a later stage to read.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> count = torch.zeros(())
        >>> gm = make_fx(lambda x: (x * count.add_(1),))(torch.ones(2))
        >>> [(t is count, sent) for t, _, sent in written_constants(gm)]
        [(True, False)]
    """
    found = []
    returned = set(gm.graph.output_node().all_input_nodes)
    for node, value in constants(gm):
        for user in node.users:
            schema = getattr(_op(user), "_schema", None)
            if schema is None:
                continue
            for argument, given in zip(schema.arguments, user.args):
                if given is node and argument.alias_info is not None \
                        and argument.alias_info.is_write:
                    found.append((value, _line(user), bool({node, user} & returned)))
    return found


def check_written_constants(stages: Iterable, recompute: tuple, compiled: bool) -> None:
    """Refuse a write into a tensor constant that would not be plain PyTorch's: in a stage
    that is recomputed (the recompute would write it again) or compiled, or into a tensor
    that another stage holds too, or is sent as it is (a pipeline would hand it the write
    of another micro-batch).
    Such a tensor belongs in a buffer, whose writes the runtime orders ([Note: state across
    stages] in ``state``). ``recompute``: per stage, whether it is recomputed.

    Raises:
        TraceError: E-PART-28.
    """
    stages = list(stages)
    held = {}  # id(tensor) -> the stages whose graphs hold it
    for st in stages:
        for gm in _graphs(st):
            for _, t in constants(gm):
                held.setdefault(id(t), set()).add(st.index)
    for st in stages:
        for gm in _graphs(st):
            for t, line, sent in written_constants(gm):
                if recompute and recompute[st.index]:
                    raise _constant_written(st, line, "the stage is recomputed, which would "
                                                      "write it again")
                if compiled:
                    raise _constant_written(st, line, "the stage is compiled "
                                                      "(compileStages), which keeps no such "
                                                      "write")
                if len(held[id(t)]) > 1 or (sent and len(stages) > 1):
                    raise _constant_written(st, line, "a later stage reads it as it is, "
                                                      "which a pipeline runs out of step")


def _constant_written(st, line: str, reason: str) -> TraceError:
    return TraceError(
        f"stage {st.index}'s forward writes in place into a tensor the model keeps as a "
        f"plain attribute rather than a buffer ({line}), and {reason}: plain PyTorch's "
        f"forward writes it once per micro-batch, where the model keeps it. Register it as "
        f"a buffer (self.register_buffer(name, tensor)), whose writes every call makes "
        f"where the stage runs, or make it anew in the forward")


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """``aten.scaled_dot_product_attention`` in the shape of its device variants: a tuple
    whose first item is the output (the graph reads only that one)."""
    return (aten.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale),)


def _attention_call(node: fx.Node, op) -> Optional[tuple]:
    """The arguments of :func:`attention` for an attention-variant node, or None when the
    graph reads more than its output (the log-sum-exp of a variant has no composite)."""
    if not _only_output_read(node):
        return None
    _, named = normalize_function(op, tuple(node.args), dict(node.kwargs),
                                  normalize_to_only_use_kwargs=True)
    mask = named.get("attn_mask", named.get("attn_bias"))
    return (named["query"], named["key"], named["value"], mask, named.get("dropout_p", 0.0),
            named.get("is_causal", False), named.get("scale"))


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``aten.native_batch_norm`` as plain PyTorch's ``F.batch_norm`` runs it: through
    ``torch.batch_norm``, which picks cuDNN's kernel on a GPU; a tuple whose first item is
    the output (the graph reads only that one)."""
    return (torch.batch_norm(input, weight, bias, running_mean, running_var, training,
                             momentum, eps, torch.backends.cudnn.enabled),)


def _only_output_read(node: fx.Node) -> bool:
    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _rewritten(node: fx.Node, op, device: torch.device) -> bool:
    """Put a kernel the trace device chose back as the op that chooses at run time (in
    place); whether it did."""
    if op in _ATTENTION_OVERLOADS and not _has_kernel(op, device):
        args = _attention_call(node, op)
        if args is not None:
            node.target = rewrap(node.target, attention)  # keeps its stream, grad mode
            node.args, node.kwargs = args, {}
            return True
    elif op is aten.native_batch_norm.default and device.type == "cuda" and \
            _only_output_read(node):
        _, named = normalize_function(op, tuple(node.args), dict(node.kwargs),
                                      normalize_to_only_use_kwargs=True)
        node.target = rewrap(node.target, batch_norm)
        node.args, node.kwargs = tuple(named[k] for k in (
            "input", "weight", "bias", "running_mean", "running_var", "training",
            "momentum", "eps")), {}
        return True
    return False


def to_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Rewrite ``gm`` in place to run on ``device`` ([Note: graphs on their devices]).

    Example:
        >>> def f(x):
        ...     return x + torch.arange(2, device="cpu")
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(f)(torch.zeros(2))
        >>> to_device(gm, torch.device("meta"))
        >>> gm(torch.zeros(2, device="meta")).device
        device(type='meta')
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            value = getattr(module, name)
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(module, name, value.to(device))
            continue
        if node.op != "call_function":
            continue
        if _rewritten(node, _op(node), device):
            changed = True
        if _drawn_elsewhere(gm, node, device):
            changed = True
            continue
        moved = []

        def on(value):
            if isinstance(value, torch.device) and value != device:
                moved.append(value)
                return device
            return value
        args, kwargs = fx.node.map_aggregate(node.args, on), fx.node.map_aggregate(node.kwargs, on)
        if moved:
            node.args, node.kwargs = args, kwargs
            changed = True
    if changed:
        gm.recompile()


def _drawn_elsewhere(gm: fx.GraphModule, node: fx.Node, device: torch.device) -> bool:
    """A random op that draws from a generator of the model's own on another kind of device
    than ``device`` ([Note: a user's generator] in ``rng``) runs where the generator is: its
    tensor arguments are copied there and its value copied back (into its first argument for
    an in-place op). That is what plain PyTorch's code does to draw from a CPU generator for
    a GPU (``torch.randn(s, generator=g).to(x.device)``, ``h.cpu()``), whose copies the trace
    on the host model's device did not record. Whether it is one (rewritten in place)."""
    given = node.kwargs.get("generator")
    generator = getattr(gm, given.target, None) if isinstance(given, fx.Node) and \
        given.op == "get_attr" else None
    schema = getattr(_op(node), "_schema", None)
    if not isinstance(generator, torch.Generator) or generator.device.type == device.type \
            or schema is None or len(schema.returns) != 1:
        return False
    there, graph = generator.device, gm.graph
    kinds = {a.name: a.type for a in schema.arguments}

    def moved(value, kind):
        if isinstance(value, torch.device):
            return there
        if isinstance(value, fx.Node) and isinstance(kind, torch.TensorType):
            with graph.inserting_before(node):
                return graph.call_function(aten._to_copy.default, (value,), {"device": there})
        return value
    first = node.args[0] if node.args else None
    node.args = tuple(moved(v, a.type) for v, a in zip(node.args, schema.arguments))
    node.kwargs = {k: moved(v, kinds.get(k)) for k, v in node.kwargs.items()}
    written = schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
    with graph.inserting_after(node):
        back = (graph.call_function(aten.copy_.default, (first, node)) if written else
                graph.call_function(aten._to_copy.default, (node,), {"device": device}))
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return True


def _graphs(stage) -> list:
    return [stage.module, *(seg.module for seg in stage.segments)]


def lacking(stages: Iterable, devices: dict) -> list:
    """``(stage, op name, source line)`` for every op without a kernel on its stage's device.

    Args:
        stages: a partition's stages.
        devices: IPU -> torch.device (``Placement.devices``).
    """
    return [(st, op, line) for st in stages
            for op, line in missing_kernels(_graphs(st), devices[st.ipu])]


def place(stages: Iterable, devices: dict) -> None:
    """Rewrite every stage's graphs for its IPU's device ([Note: graphs on their devices]).

    Raises:
        TraceError: an op has no kernel on its stage's device, or a stage on another
            device than the trace's writes into a tensor constant (checked before any
            graph is rewritten).
    """
    stages = list(stages)
    missing = lacking(stages, devices)
    if missing:
        st, op, line = missing[0]
        device = devices[st.ipu]
        raise TraceError(
            f"stage {st.index} runs on {device} (IPU {st.ipu}), but torch has no "
            f"{_dispatch_key(device)} kernel for {op}, which the trace recorded at {line} "
            f"(the model is traced on the host model's device and that op exists only "
            f"there); map IPU {st.ipu} to that device with opts.set_ipu_devices(...), or "
            f"compute that part of the model with ops that {device.type} has")
    for st in stages:
        device = devices[st.ipu]
        for gm in _graphs(st):
            for t, line, _ in written_constants(gm):
                if t.device != device:
                    raise _constant_written(st, line, f"it runs on {device} (IPU {st.ipu}), "
                                                      f"where it would write a copy of its own")
    for st in stages:
        for gm in _graphs(st):
            to_device(gm, devices[st.ipu])
