"""Tracing: run a model once on real inputs and record its ops as an aten graph.

See [Note: partition] in ``partition.py``: PopTorch traces on the first call's
inputs, so Python control flow and side effects run at trace time and tensor
ops (in-place buffer updates included) land in the graph. ``make_fx`` does
that at the dispatcher level on concrete tensors; parameters and buffers are
passed in as graph inputs through ``functional_call``. A TorchFunctionMode
marks the result of every torch loss function ([Note: loss provenance]) and
watches values read while tracing; an inference trace runs dropout as the identity
(``trace_modes``: [Note: values read while tracing], [Note: inference session]); ops
mixing float16 and float32 are cast as PopTorch casts them ([Note: implicit casting] in
``casting``).

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

An export runs the Python of TorchScript code (a ``torch.jit.script`` function runs
its original function while ``is_exporting()``), so the trace runs a scripted
submodule's (``torch.jit.script(module)``) own Python methods too, and the trace's
watches see into it as into any module. torch's own switch fails for a scripted
module's ``forward`` (it hands the method to the Python function as an argument:
"forward() takes 2 positional arguments but 3 were given"), so the trace binds the
module's Python methods on it for the trace's length. The scripted code computes what
its Python does; ``torch.jit.is_scripting()`` is False there, as in an export.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import keyword
import linecache
import logging
import operator
import os
import types

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..errors import RAISED_IN_TRACE, Error, TraceError, hide_when_refused as __tracebackhide__
from . import backward_hooks, grad_semantics, losses, markers, structures
from .casting import _ImplicitCasting, ambient_autocast
from .markers import _current, trace_context
from .python_attributes import AttributeWatch, Hooks
from .running_stats import (StatisticsWatch, cumulative_averages, same_values,
                            unread_by_training_backwards)
from .subgraphs import wrap_target
from .trace_state import UserGenerators, WrittenParameters, preserved_state, version_of
from .trace_modes import (PlainFastPaths, PythonDraws, _InferenceSession, _TraceMode,
                          user_file_test)


@contextlib.contextmanager
def _export_style(model: torch.nn.Module):
    """Say to the model's code that it is being exported, and run its scripted submodules'
    Python ([Note: an export-style trace]).

    The flags are the ones ``torch.compiler.is_compiling``/``is_exporting`` return (and
    non-strict ``torch.export`` sets); a torch without them traces as before.
    """
    compiler = torch.compiler
    flags = [f for f in ("_is_compiling_flag", "_is_exporting_flag") if hasattr(compiler, f)]
    saved = {f: getattr(compiler, f) for f in flags}
    bound: list = []
    try:
        _bind_scripted_python(model, bound)
        for f in flags:
            setattr(compiler, f, True)
        yield
    finally:
        for f, value in saved.items():
            setattr(compiler, f, value)
        for m, name, before in bound:
            if before is None:
                del m.__dict__[name]
            else:
                m.__dict__[name] = before


def _bind_scripted_python(model: torch.nn.Module, bound: list) -> None:
    """Bind each scripted submodule's compiled methods to its Python class's functions, in the
    instance (a scripted module keeps its ``ScriptMethod``s there, so a bound function found
    there first is what calling it runs); each goes in ``bound`` as ``(module, name, what was
    there or None)``."""
    for m in model.modules():
        kind = getattr(m, "_concrete_type", None) if isinstance(
            m, torch.jit.RecursiveScriptModule) else None
        source = getattr(kind, "py_class", None)
        if source is None:  # a traced module: its graph runs, as in plain PyTorch
            continue
        for name in m._c._method_names():
            function = inspect.getattr_static(source, name, None)
            if isinstance(function, types.FunctionType) and not name.startswith("__"):
                bound.append((m, name, m.__dict__.get(name)))
                m.__dict__[name] = types.MethodType(function, m)


@functools.lru_cache(maxsize=None)
def _callable_overload(op):
    """``op``, callable by name from a graph's code where its overload's name is a Python
    keyword (``aten.random_.from``: FX would write ``torch.ops.aten.random_.from(...)``)."""
    def call(*args, **kwargs):
        return op(*args, **kwargs)
    call.tags, call._schema, call.rewrap = op.tags, op._schema, _callable_overload
    return wrap_target(op, call, "")


def _keyword_safe(tracer) -> None:
    """Make ``tracer`` record ops whose overload is a keyword through :func:`_callable_overload`."""
    create_node = tracer.create_node

    def create(kind, target, *args, **kwargs):
        if kind == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and keyword.iskeyword(target._overloadname):
            target = _callable_overload(target)
        return create_node(kind, target, *args, **kwargs)
    tracer.create_node = create


def _forget_tensors(tracer) -> None:
    """Empty ``tracer``'s tables of the tensors it saw (``tensor_tracker`` and the like), once
    the graph is made. make_fx's tracer lives on in reference cycles until Python's collector
    runs, and its tables hold a weak reference to each parameter of the model, which
    ``torch.utils.swap_tensors`` refuses to swap ("Cannot swap t1 because it has weakref
    associated with it"): ``Module.to()`` under ``torch.__future__``'s swap of parameters on
    conversion, between calls, would fail or not by when the collector last ran."""
    for name, table in list(vars(tracer).items()):
        if name.endswith("_tracker") and hasattr(table, "clear"):
            table.clear()


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


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` with only the user's frames ([Note: frames a user sees] in ``errors``); ``tb``
    whole when none of its frames is the user's (then nothing would be left to show)."""
    is_user, frames, t = user_file_test(), [], tb
    while t is not None:
        if is_user(t.tb_frame.f_code.co_filename):
            frames.append(t)
        t = t.tb_next
    kept = None
    for t in reversed(frames):
        kept = types.TracebackType(kept, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return kept or tb


@contextlib.contextmanager
def _quiet_torch_trace_log():
    """Keep torch's structured trace log (``torch.__trace``) quiet during the trace, unless
    asked for with ``TORCH_TRACE``: make_fx interns every stack trace it records there, and
    pytest, which listens to every logger, prints the empty DEBUG records of a failed test."""
    log = logging.getLogger("torch.__trace")
    asked = any(os.environ.get(v) for v in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"))
    if asked:
        yield
        return
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.setLevel(level)


def trace(model: torch.nn.Module, modes: dict, args: tuple, kwargs: dict, training: bool,
          generic: bool = False, sliced: frozenset = frozenset()):
    """Trace ``model(*args, **kwargs)`` into an aten-level graph.

    Args:
        model: the user's model (its state is restored after the trace).
        modes: module -> train/eval flag to trace with (the model's own, as wrapped; the
            others as they are: [Note: train and eval modes] in ``runtime/compiled``).
        args, kwargs: one micro-batch of the call's arguments.
        training: trace with autograd enabled; otherwise trace an inference
            session, where dropout is the identity ([Note: inference session] in ``trace_modes``).
        generic: record no CPU-only kernels (oneDNN's are turned off while tracing),
            for stages that run on another kind of device ([Note: graphs on their
            devices] in ``retarget``).
        sliced: parameters traced as their first value along dim 0 (per-replica variables:
            [Note: per-replica variables] in ``runtime/replica_groups``).

    Returns:
        ``(graph_module, param_names, buffer_names, out_spec, const_outputs,
        module_blocks, mutated_buffers, statistics, reads)``; the graph takes params, buffers, then
        the tensor leaves of (args, kwargs), and returns the tensor leaves of the
        output. ``const_outputs`` has one entry per output leaf: None for a
        tensor, ``("const", value)`` for anything else (``None`` included).
        ``mutated_buffers`` names the buffers the forward wrote in place:
        their version counter moved or their values changed (op schemas do not
        announce every write: ``native_batch_norm`` updates its running
        statistics without bumping a version), or a normalisation in training mode
        was given them to update (an update can leave a value as it was).
        ``statistics`` names those of them that only normalisations updated
        ([Note: running statistics on replicas] in ``running_stats``). ``reads``:
        the model's plain Python attributes the forward read
        (``python_attributes.Reads``: [Note: Python attributes of the model]).

    Raises:
        TraceError: the forward deleted or reassigned a registered buffer, or did what
            the trace refuses (the model is left as it was).
        Exception: whatever the forward itself raised, with its own type and message, its
            traceback the user's frames (the model is left as it was).
    """
    if training:
        backward_hooks.refuse_legacy_backward_hooks(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    names = list(params) + list(buffers)
    leaves, in_spec = structures.flatten((args, kwargs))
    tensor_pos = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    result: dict = {}
    module_blocks: dict = {}
    written = WrittenParameters()  # the parameters the forward writes, put back after it

    def run(*flat):
        tracers.append(get_proxy_mode().tracer)
        _keyword_safe(get_proxy_mode().tracer)
        written.watch(get_proxy_mode().tracer, list(flat[:len(params)]))
        if training:  # [Note: gradients the forward shapes] in ``grad_semantics``
            markers.record_grad_mode(get_proxy_mode().tracer)
        values = dict(zip(names, flat[:len(names)]))
        call_leaves = list(leaves)
        for k, t in zip(tensor_pos, flat[len(names):]):
            call_leaves[k] = t
        a, kw = pytree.tree_unflatten(call_leaves, in_spec)
        buffer_values = {n: values[n] for n in buffers}
        # a global hook, not one of the model's own: torch's fused fast paths decline a
        # module with hooks ([Note: fused fast paths] in trace_modes)
        check = torch.nn.modules.module.register_module_forward_hook(
            lambda m, *_: _check_buffers_kept(model, buffer_values) if m is model else None)
        cached = torch.is_autocast_cache_enabled()
        if ambient_autocast():  # [Note: autocast around a call] in casting: make_fx
            # turns autocast's cache off, and a forward under it casts each weight once
            torch.set_autocast_cache_enabled(True)
        try:
            out = functional_call(model, values, a, kw)
        finally:
            check.remove()
            if cached is not torch.is_autocast_cache_enabled():
                torch.clear_autocast_cache()  # the casts of the trace's tensors
                torch.set_autocast_cache_enabled(cached)
        lifted = structures.lift(out)
        out_leaves, result["spec"] = pytree.tree_flatten(lifted)
        _check_output(lifted, out_leaves)
        result["leaves"] = out_leaves
        tensors = [v for v in out_leaves if isinstance(v, torch.Tensor)]
        if training:
            losses.note_trained(tensors, marked, get_proxy_mode().tracer)
        return tensors

    marked: list = []  # (node, grad_fn) of each loss marked ([Note: the trained loss])
    tracers: list = []  # make_fx's tracer, whose tables are emptied once it has traced

    def on_loss(t: torch.Tensor) -> None:
        proxy = get_proxy_slot(t, get_proxy_mode().tracer, None)
        if proxy is not None:
            marked.append((proxy.proxy.node, t.grad_fn))

    def record_block(module, inputs, output):
        state = _current()
        module_blocks[module] = state.current_block

    flat = [p[0] if n in sliced else p for n, p in params.items()] + list(buffers.values()) + \
        [leaves[k] for k in tensor_pos]
    grad = torch.enable_grad() if training else torch.no_grad()
    session = contextlib.nullcontext() if training else _InferenceSession()
    hooks = Hooks({m: name for name, m in model.named_modules()})  # the user's, before ours
    hook = torch.nn.modules.module.register_module_forward_hook(record_block)
    onednn = torch._C._get_mkldnn_enabled()
    if generic:
        torch._C._set_mkldnn_enabled(False)
    try:
        # The session is entered last, so it sees a dropout first ([Note: inference session]):
        # _TraceMode would otherwise turn F.dropout into native_dropout before it could.
        # Mixed float16/float32 ops are resolved as PopTorch does ([Note: implicit casting]).
        given, generators = [leaves[k] for k in tensor_pos], UserGenerators()
        with PlainFastPaths(), \
                preserved_state(model, modes, given, generators, written) as before, \
                AttributeWatch(model, hooks) as attributes, PythonDraws(model.forward), \
                trace_context() as state, _export_style(model), \
                grad, _quiet_torch_trace_log(), grad_semantics.recording(training), \
                _TraceMode(generators.saw, generic), _ImplicitCasting(), session, \
                StatisticsWatch(buffers, before) as watch, cumulative_averages(model):
            state.on_loss = on_loss
            versions = {n: version_of(b) for n, b in buffers.items()}
            # A table of its own (empty) keeps detach an op: make_fx's default turns it
            # into an alias, which gradients pass ([Note: gradients the forward shapes]).
            gm = make_fx(run, decomposition_table={}, tracing_mode="real",
                         record_stack_traces=True, _error_on_data_dependent_ops=False)(*flat)
            mutated = frozenset(n for n, b in buffers.items() if version_of(b) != versions[n]
                                or not same_values(b, before[id(b)])) | watch.updated()
            statistics = watch.statistics(mutated)
    except Error as exc:
        raise exc.with_traceback(_user_traceback(exc.__traceback__))
    except Exception as exc:  # the forward's own exception, as PopTorch re-raises it: its
        # type and message unchanged, its traceback ending at the forward's line
        try:  # [Note: frames a user sees]
            setattr(exc, RAISED_IN_TRACE, True)
        except AttributeError:  # an exception type without a __dict__
            pass
        raise exc.with_traceback(_user_traceback(exc.__traceback__))
    finally:
        hook.remove()
        torch._C._set_mkldnn_enabled(onednn)
        marked.clear()  # autograd's nodes of the traced micro-batch: its activations
        for tracer in tracers:
            _forget_tensors(tracer)
    generators.check()
    _drop_unused_getitems(gm)
    if training:  # [Note: gradients the forward shapes] in ``grad_semantics``
        grad_semantics.autograd_detaches_pass(gm)
        grad_semantics.functional_writes_pass(gm)  # [Note: writes to activations]
        unread_by_training_backwards(gm)
    consts = _constant_outputs(gm, [None if isinstance(v, torch.Tensor) else ("const", v)
                                    for v in result["leaves"]])
    layer_blocks = {name: module_blocks[m] for name, m in model.named_modules()
                    if m in module_blocks and name}
    return (gm, list(params), list(buffers), result["spec"], consts, layer_blocks, mutated,
            statistics, attributes.reads)


@contextlib.contextmanager
def generated_sources(keys: list):
    """Collect into ``keys`` the names under which torch.fx keeps the source of every graph
    module made inside (``torch.fx.graph_module._loader``, which feeds ``linecache`` so that
    tracebacks show the generated code). torch keeps them for the process's life, some 15 KB
    a wrapper, so :func:`forget_sources` drops them once those graphs are gone
    (``benchmarks/soak.py``: 200 wrappers made and destroyed grew by 3 MiB). A torch without
    that cache collects nothing."""
    cache = getattr(getattr(torch.fx.graph_module, "_loader", None), "eval_cache", None)
    before = set(cache) if isinstance(cache, dict) else None
    try:
        yield keys
    finally:
        if before is not None:
            keys.extend(k for k in list(cache) if k not in before)


def forget_sources(keys: list) -> None:
    """Drop the sources :func:`generated_sources` collected from torch.fx's cache and
    ``linecache``."""
    cache = getattr(getattr(torch.fx.graph_module, "_loader", None), "eval_cache", None)
    for key in keys:
        if isinstance(cache, dict):
            cache.pop(key, None)
        linecache.cache.pop(key, None)
    keys.clear()
