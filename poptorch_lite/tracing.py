"""Tracing: run a model once on real inputs and record its ops as an aten graph.

See [Note: partition] in ``partition.py``: PopTorch traces on the first call's
inputs, so Python control flow and side effects run at trace time and tensor
ops (in-place buffer updates included) land in the graph. ``make_fx`` does
that at the dispatcher level on concrete tensors; parameters and buffers are
passed in as graph inputs through ``functional_call``. A TorchFunctionMode
marks the result of every torch loss function ([Note: loss provenance]) and
watches values read while tracing ([Note: values read while tracing]).

[Note: inference session]
PopTorch compiles an ``inferenceModel`` as a PopART *inference session*, in
which a dropout is the identity whatever the module's ``training`` flag
(PopTorch lowers ``aten::dropout`` with ``train=True`` to a PopART Dropout,
``poptorch/source/popart_canonicalization/DropoutOps.cpp``, and an inference
session turns that op into an identity). Scripts rely on it: they train, then
wrap the same model with ``inferenceModel`` without calling ``model.eval()``.
So an inference trace runs every dropout as the identity: ``F.dropout``,
``F.dropout1d/2d/3d``, ``F.alpha_dropout``, ``F.feature_alpha_dropout`` (hence
``nn.Dropout*``, ``nn.AlphaDropout``, the Transformer layers) and the dropout
inside ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``
(``dropout_p`` = 0). Every other op follows the module's own flag, as PopTorch's
lowering does: BatchNorm passes ``training`` on
(``NormalizationOps.cpp``: a training BatchNorm becomes a 5-output PopART
BatchNormalization, which normalises with the batch statistics and updates the
running ones, in inference sessions too: PopTorch's ``test_batchNorm3D`` compares
an ``inferenceModel`` of a training-mode BatchNorm with the native training-mode
output). The user's modules keep their ``training`` flags.

[Note: values read while tracing]
Some ops read a tensor's value to do their work: ``F.one_hot`` checks its
classes, ``torch.bincount``, ``nonzero``, boolean-mask indexing, ``unique`` and
``repeat_interleave`` size their outputs by the data. ``make_fx`` refuses every
such read by default ("trying to get value out of a tracing tensor"); the trace
here allows them (``_error_on_data_dependent_ops=False``): the op itself lands
in the graph, so every micro-batch recomputes it from its own data, as plain
PyTorch does. What is refused is a value read *into Python* from a traced
tensor (``t.item()``, ``if t:``, ``int(t)``, ``float(t)``, ``t.tolist()``,
indexing a list with ``t``): it would be fixed at the first micro-batch's
value for every later one (PopTorch's tracer fixes it the same way, silently).
``F.one_hot(x)`` without ``num_classes`` is refused as PopTorch refuses it: its
width would be the first micro-batch's largest class. A tensor passed where
torch wants a Python number (``torch.arange(t)``) is converted inside torch's
C++ and cannot be told apart from an op's own read; it is fixed at trace time.

[Note: an export-style trace]
The trace records one graph that every later micro-batch and call replays, which
is what ``torch.export`` does, and its non-strict mode records it the same way,
with ``make_fx`` on the module's own Python. So the trace says so through torch's
public signals, as non-strict export does (``torch._export.utils.
_compiling_state_context``): ``torch.compiler.is_compiling()`` and
``torch.compiler.is_exporting()`` are True while it runs. Libraries written to be
exported ask exactly these (transformers' ``is_tracing`` and
``is_torchdynamo_exporting``, timm's ``is_exporting``) and then keep data-dependent
shortcuts out of the forward: transformers' masks skip their "every position is
attended" test (``padding_mask.all()``), which would otherwise be read into Python
and fix micro-batch 0's branch for all; the mask is then computed as tensor ops, so
a micro-batch with padding gets its own mask, as in plain PyTorch. A model that
still reads a traced value into Python is refused as before. The flags are
torch's module globals (as export's are), set only for the trace; the stages run
recorded graphs, never the module's Python, so nothing else reads them.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import sysconfig
import traceback

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from . import markers, structures
from .annotations import _current, trace_context
from .errors import Error, TraceError
from .ops import LOSS_FUNCTIONS


# Reading a tensor's value into Python ([Note: values read while tracing]).
_PYTHON_READS = {torch.Tensor.item: "t.item()", torch.Tensor.tolist: "t.tolist()",
                 torch.Tensor.__bool__: "bool(t) (an if or while on a tensor)",
                 torch.Tensor.__int__: "int(t)", torch.Tensor.__float__: "float(t)",
                 torch.Tensor.__index__: "t used as an index or size",
                 torch.Tensor.__complex__: "complex(t)"}


def _user_line(frames) -> str:
    """The innermost frame of user code, for messages.

    Library frames are recognised by the folder they come from (torch's, this
    package's, the standard library's, pytest's and pluggy's), never by a name in the
    path: a clone of this project lives in a folder called ``poptorch_lite`` too, and
    its tests are user code. Frames of generated code (``<string>``: a dataclass's
    ``__init__``, code that ``exec`` made; ``<eval_with_key>``: an fx graph) name no
    file a user can open, so they are skipped as well.
    """
    library = _library_folders()
    for fr in reversed(frames):
        if fr.filename.startswith("<"):
            continue
        path = os.path.realpath(fr.filename)
        if not path.startswith(library):
            return f'{fr.filename}:{fr.lineno}: {fr.line}'
    return "(no line of user code in the traceback)"


def _library_folders() -> tuple:
    """The folders whose code runs the user's code but is not it (each ending in a separator)."""
    folders = [sysconfig.get_paths()["stdlib"]]
    for name in ("torch", __name__.split(".")[0], "_pytest", "pluggy"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            folders.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders)


def _read_into_python(func, args: tuple, kwargs: dict):
    """Run a read of a tensor's value into Python: a constant's is fine, a traced one's refused."""
    tracer = get_proxy_mode()
    if tracer is None:
        return func(*args, **kwargs)
    allowed = tracer._error_on_data_dependent_ops
    tracer._error_on_data_dependent_ops = True  # make_fx refuses traced values, computes constants
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        if "value out of a tracing tensor" not in str(exc):
            raise
        raise TraceError(
            f"the forward reads a tensor's value into Python with {_PYTHON_READS[func]} at "
            f"{_user_line(traceback.extract_stack()[:-1])}: the model is traced once, so that "
            f"value would be the first micro-batch's for every micro-batch. Keep it a tensor "
            f"(torch.where(cond, a, b) instead of an if, tensor arithmetic instead of "
            f".item())") from None
    finally:
        tracer._error_on_data_dependent_ops = allowed


class _TraceMode(TorchFunctionMode):
    """Marks torch losses' results; refuses values read into Python and ``one_hot`` without a width."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PYTHON_READS:
            return _read_into_python(func, args, kwargs)
        if func is F.one_hot and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:
            raise TraceError(
                f"OneHot num classes must be specified and must be constant: F.one_hot at "
                f"{_user_line(traceback.extract_stack()[:-1])} has no num_classes, so its width "
                f"would be the first micro-batch's largest class; pass num_classes=<classes>")
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            markers.MARK_LOSS(out)
        return out


def _dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as the one op that both devices' plain PyTorch agree with.

    On a GPU, ``F.dropout`` runs the fused ``native_dropout`` kernel; on the CPU it
    decomposes into ``bernoulli_`` and a multiply, which draws different numbers on a
    GPU. A graph traced on the CPU and run on a GPU would then mask differently from
    plain PyTorch there. ``native_dropout`` on the CPU draws and computes exactly what
    the decomposition does, so the trace records it wherever plain PyTorch would fuse.
    """
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return F.dropout(input, p, training, inplace)


def _input_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["input"]


def _without_dropout_p(func, args: tuple, kwargs: dict, position: int):
    """Call ``func`` with its ``dropout_p`` argument (keyword, or at ``position``) set to 0."""
    if len(args) > position:
        args = (*args[:position], 0.0, *args[position + 1:])
    else:
        kwargs = {**kwargs, "dropout_p": 0.0}
    return func(*args, **kwargs)


# How an inference session runs each dropout ([Note: inference session]).
_INFERENCE_DROPOUT = {
    **{f: lambda f, a, k: _input_of(a, k)
       for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                 F.feature_alpha_dropout)},
    F.scaled_dot_product_attention: lambda f, a, k: _without_dropout_p(f, a, k, 4),
    F.multi_head_attention_forward: lambda f, a, k: _without_dropout_p(f, a, k, 10),
}


class _InferenceSession(TorchFunctionMode):
    """Runs every dropout as the identity while an inference model is traced."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        session = _INFERENCE_DROPOUT.get(func)
        return func(*args, **kwargs) if session is None else session(func, args, kwargs)


@contextlib.contextmanager
def _preserved_state(model: torch.nn.Module, modes: dict):
    """Run the trace with the wrap-time train/eval modes; undo every change it makes.

    The trace really runs the forward once, so RNG draws and buffer updates
    (BatchNorm statistics, counters) are rolled back afterwards: tracing must
    change no state ([Note: partition]).
    """
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # Which tensors each module registers: a refused forward may delete or reassign one.
    tables = {m: (list(m._buffers.items()), set(m._non_persistent_buffers_set))
              for m in model.modules()}
    current = {m: m.training for m in model.modules()}
    for m in model.modules():
        m.training = modes.get(m, m.training)
    try:
        yield {id(b): saved for b, saved in buffers}
    finally:
        for m, flag in current.items():
            m.training = flag
        for m, (table, non_persistent) in tables.items():
            if [(k, id(v)) for k, v in m._buffers.items()] != [(k, id(v)) for k, v in table]:
                for name, _ in table:
                    m.__dict__.pop(name, None)  # functional_call's restore of a deleted buffer
                m._buffers.clear()
                m._buffers.update(table)
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
                if b.grad_fn is not None and not b._is_view():
                    b.detach_()  # a write with gradients left the trace's history on it
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _export_style():
    """Say to the model's code that it is being exported ([Note: an export-style trace]).

    The flags are the ones ``torch.compiler.is_compiling``/``is_exporting`` return (and
    non-strict ``torch.export`` sets); a torch without them traces as before.
    """
    compiler = torch.compiler
    flags = [f for f in ("_is_compiling_flag", "_is_exporting_flag") if hasattr(compiler, f)]
    saved = {f: getattr(compiler, f) for f in flags}
    for f in flags:
        setattr(compiler, f, True)
    try:
        yield
    finally:
        for f, value in saved.items():
            setattr(compiler, f, value)


def _check_buffers_kept(model: torch.nn.Module, values: dict) -> None:
    """Refuse a forward that deleted or replaced a registered buffer, as PopTorch does.

    The graph takes each buffer as an input and writes in-place updates back to
    it; a buffer deleted or rebound to a new tensor has no such place.
    """
    for name, traced in values.items():
        owner, _, local = name.rpartition(".")
        table = model.get_submodule(owner)._buffers
        if local not in table:
            raise TraceError(
                f"Buffer {name} is removed from the model when calling the forward method. "
                f"This is not supported: keep the buffer registered (update it in place, or "
                f"use a local variable for the value the forward needs)")
        if table[local] is not traced:
            raise TraceError(
                f"Buffer {name} is reassigned within the model when calling the forward method. "
                f"This is not supported. Consider using self.{local}.copy_(src) to copy data "
                f"from a source tensor, where src is the name of the source tensor.")


def _constant_outputs(gm: torch.fx.GraphModule, consts: list) -> list:
    """Take the outputs that are constants of the trace out of the graph.

    A tensor the forward returns as it is, made outside the graph (a global, a
    ``torch.tensor`` of Python numbers), is a constant of the trace: no stage computes
    it, and every call returns it, as every call of the plain forward does.

    Args:
        consts: per output leaf, ``("const", value)`` or None for a tensor.

    Returns:
        ``consts`` with such tensors as ``("const", tensor)``; the graph then outputs
        only the tensors its stages compute.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values, kept = iter(out.args[0]), []
    result = []
    for c in consts:
        v = next(values) if c is None else None
        if isinstance(v, torch.fx.Node) and v.op == "get_attr":
            result.append(("const", getattr(gm, v.target)))
            continue
        result.append(c)
        if c is None:
            kept.append(v)
    if len(kept) < len(out.args[0]):
        out.args = (kept,)
        gm.recompile()
    return result


def _check_output(lifted, leaves: list) -> None:
    """Refuse an output that would come back frozen ([Note: container subclasses]).

    ``lifted`` is the output as ``structures.lift`` gives it; ``leaves`` its leaves.
    """
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and structures.tensor_holder(leaf):
            kind = structures.describe_type(type(leaf))
            raise TraceError(
                f"the forward returns a {kind} that holds tensors, which cannot be flattened: "
                f"it is not a tuple, list or dict, nor a type registered with "
                f"torch.utils._pytree, so every call would return the traced object with the "
                f"first micro-batch's tensors. Return its tensors in a tuple, list or dict, or "
                f"register {type(leaf).__name__} (torch.export.register_dataclass for a "
                f"dataclass, torch.utils._pytree.register_pytree_node otherwise)")
    broken = structures.unrebuildable(lifted)
    if broken is not None:
        raise TraceError(
            f"the forward returns a {broken[0]}, which cannot be built again from its items "
            f"({broken[1]}): every call rebuilds it as PopTorch does, type(x)({{key: value}}) "
            f"for a dict subclass and type(x)(items) for a list or tuple subclass. Give it a "
            f"constructor that takes that, or register it with "
            f"torch.utils._pytree.register_pytree_node")


def _drop_unused_getitems(gm: torch.fx.GraphModule) -> None:
    """Remove the picks of a multi-output op's results that nothing reads.

    ``make_fx`` records one ``getitem`` per output (``native_dropout``'s mask too);
    an unread one could land past a stage boundary or recomputation checkpoint and
    make its op's whole tuple cross it.
    """
    unused = [n for n in gm.graph.nodes if n.op == "call_function"
              and n.target is operator.getitem and not n.users]
    for n in unused:
        gm.graph.erase_node(n)
    if unused:
        gm.recompile()


def trace(model: torch.nn.Module, modes: dict, args: tuple, kwargs: dict, training: bool,
          generic: bool = False):
    """Trace ``model(*args, **kwargs)`` into an aten-level graph.

    Args:
        model: the user's model (its state is restored after the trace).
        modes: module -> train/eval flag to trace with (the wrap-time modes).
        args, kwargs: one micro-batch of the call's arguments.
        training: trace with autograd enabled; otherwise trace an inference
            session, where dropout is the identity ([Note: inference session]).
        generic: record no CPU-only kernels (oneDNN's are turned off while tracing),
            for stages that run on another kind of device ([Note: graphs on their
            devices] in ``retarget``).

    Returns:
        ``(graph_module, param_names, buffer_names, out_spec, const_outputs,
        module_blocks, mutated_buffers)``; the graph takes params, buffers, then
        the tensor leaves of (args, kwargs), and returns the tensor leaves of the
        output. ``const_outputs`` has one entry per output leaf: None for a
        tensor, ``("const", value)`` for anything else (``None`` included).
        ``mutated_buffers`` names the buffers the forward wrote in place:
        their version counter moved or their values changed (op schemas do not
        announce every write: ``native_batch_norm`` updates its running
        statistics without bumping a version).

    Raises:
        TraceError: the forward failed while tracing (names the user's line), or
            deleted or reassigned a registered buffer (the model is left as it was).
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    names = list(params) + list(buffers)
    leaves, in_spec = structures.flatten((args, kwargs))
    tensor_pos = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    result: dict = {}
    module_blocks: dict = {}

    def run(*flat):
        values = dict(zip(names, flat[:len(names)]))
        call_leaves = list(leaves)
        for k, t in zip(tensor_pos, flat[len(names):]):
            call_leaves[k] = t
        a, kw = pytree.tree_unflatten(call_leaves, in_spec)
        buffer_values = {n: values[n] for n in buffers}
        check = model.register_forward_hook(lambda *_: _check_buffers_kept(model, buffer_values))
        try:
            out = functional_call(model, values, a, kw)
        finally:
            check.remove()
        lifted = structures.lift(out)
        out_leaves, result["spec"] = pytree.tree_flatten(lifted)
        _check_output(lifted, out_leaves)
        result["leaves"] = out_leaves
        return [v for v in out_leaves if isinstance(v, torch.Tensor)]

    def record_block(module, inputs, output):
        state = _current()
        module_blocks[module] = state.current_block

    flat = list(params.values()) + list(buffers.values()) + [leaves[k] for k in tensor_pos]
    grad = torch.enable_grad() if training else torch.no_grad()
    session = contextlib.nullcontext() if training else _InferenceSession()
    hook = torch.nn.modules.module.register_module_forward_hook(record_block)
    onednn = torch._C._get_mkldnn_enabled()
    if generic:
        torch._C._set_mkldnn_enabled(False)
    try:
        # The session is entered last, so it sees a dropout first ([Note: inference session]):
        # _TraceMode would otherwise turn F.dropout into native_dropout before it could.
        with _preserved_state(model, modes) as before, trace_context(), _export_style(), grad, \
                _TraceMode(), session:
            versions = {n: b._version for n, b in buffers.items()}
            gm = make_fx(run, tracing_mode="real", record_stack_traces=True,
                         _error_on_data_dependent_ops=False)(*flat)
            mutated = frozenset(n for n, b in buffers.items() if b._version != versions[n]
                                or not torch.equal(b, before[id(b)]))
    except Error:
        raise
    except Exception as exc:
        raise TraceError(
            f"the model could not be traced at {_user_line(traceback.extract_tb(exc.__traceback__))}: {type(exc).__name__}: {exc}. "
            f"The forward runs once on the first call's real inputs; make it run as plain "
            f"PyTorch on one micro-batch of those inputs") from exc
    finally:
        hook.remove()
        torch._C._set_mkldnn_enabled(onednn)
    _drop_unused_getitems(gm)
    consts = _constant_outputs(gm, [None if isinstance(v, torch.Tensor) else ("const", v)
                                    for v in result["leaves"]])
    layer_blocks = {name: module_blocks[m] for name, m in model.named_modules()
                    if m in module_blocks and name}
    return gm, list(params), list(buffers), result["spec"], consts, layer_blocks, mutated
