"""What a forward says about its own gradients, kept in the traced graph.

[Note: gradients the forward shapes]
The trace records ops below autograd (``make_fx``), so what a forward says about its own
gradients does not show in the ops themselves: ``h.detach()`` and ``h.data`` record as
``aten.alias``, ops under ``torch.no_grad()`` record as any other op, a custom
``torch.autograd.Function`` records as the ops of its forward, and a hook registered with
``h.register_hook`` records nothing. Replayed as they are, every one of them would let
gradients through that plain PyTorch stops, or drop the gradient code the model brings
(a straight-through estimator, a gradient reversal layer, a hand-written backward). So a
training trace keeps them, and the stages replay them as plain PyTorch ran them:

- **Grad mode.** Every op records whether grad mode was on when it ran
  (``meta["grad_enabled"]``): ``torch.no_grad()``, ``torch.inference_mode()``,
  ``set_grad_enabled(False)`` and autograd's own no-grad work (a backward the forward
  runs itself). A stage runs such an op under ``torch.no_grad()`` (:func:`run_without_grad`;
  a view detached, :func:`view_without_grad`) where its value could otherwise carry a
  gradient; elsewhere it costs nothing.
- **Detach.** ``t.detach()``, in the model's code or a library's (``F.gumbel_softmax``'s
  hard sample), is kept as ``aten.detach`` (``make_fx``'s default would record an alias),
  and so is ``t.data``. Autograd's own detaches are not stops: when it saves an op's
  output for the backward, and when a backward the forward runs itself unpacks it, it
  records ``aten.detach`` too, but the value it unpacks is the op's output again, with its
  history. So a detach that only detaches read (an output autograd saved) and the
  detaches of it (its unpackings) replay as the value itself, with its history and no
  node between, as plain PyTorch unpacks it (a saved-tensor hook, as
  ``torch.utils.checkpoint``'s recomputation sets, packs under no grad;
  :func:`autograd_detaches_pass`; the model's own, :func:`traced_detach` and ``.data``,
  never count): a gradient penalty
  (``torch.autograd.grad(..., create_graph=True)`` in the forward, as in WGAN-GP) is then
  differentiated through the activations its inner backward read, as plain PyTorch does,
  summing the gradients that reach each of them in plain PyTorch's order.
- **Custom Functions.** ``Function.apply`` is one node of the graph that calls the
  Function at run time (:func:`traced_apply`), so its own forward and backward run, and
  ``ctx`` is its own. Its arguments are tensors of the trace and constants; a module or
  an object that holds tensors is refused, since the node could not give it the stage's
  weights. ``torch.utils.checkpoint``'s reentrant Function is traced through: it is the
  forward of the function it checkpoints (recomputation is poptorch_lite's own). A
  Function that draws random numbers draws from the micro-batch's stream ([Note:
  micro-batch RNG] in ``rng``). The Functions that ``torch.library`` makes for a custom
  op's ``register_autograd`` are traced through: the op itself lands in the graph, and
  its registered backward with it.
- **Module backward hooks.** ``register_full_backward_hook`` and
  ``register_full_backward_pre_hook``: where ``Module.__call__`` sets them up, two nodes set
  up a fresh ``BackwardHook`` of the module on the stage's values in every micro-batch,
  with the module's hooks of the time (the deprecated ``register_backward_hook`` is refused).
  A hook registered on a parameter outside the forward (``register_hook``,
  ``register_post_accumulate_grad_hook``) is the parameter's own; its copies on other devices
  share it (``Weights.share_hooks``).
- **Tensor hooks.** ``t.register_hook(fn)`` in the forward is a node that registers
  ``fn`` on the stage's value of ``t`` (:func:`traced_register_hook`), in every micro-batch,
  as plain PyTorch registers it in every forward (once, where a recompute runs the forward
  again on the same leaf).

[Note: writes to activations]
A write in place to an activation that autograd tracks (``nn.Dropout(inplace=True)`` after a
ReLU, whose backward reads its output, as Conformer's feed-forward does) moves the version
that autograd saved, and plain PyTorch's backward raises. PopART's graph has no versions:
the write is a new value, and the ReLU's backward reads the value before it, which gives
the same gradient (the write zeroes where the dropout's own gradient is zero). A training
trace does the same (:func:`functional_writes_pass`): each such write becomes its
functional form, and the ops after it read its value; the values and gradients are those of
the same model with ``inplace=False``, and plain PyTorch's refusal is not reproduced. A
write under ``no_grad`` (autograd does not see it: the gradient passes as if it were not
there), to a parameter or buffer, to a view, or to a value a view was taken of stays a write
(``state``: [Note: state across stages]).

The trace also records, for the values the model's own code saw, whether they required
grad (``meta["requires_grad"]``): what ``value_info`` tells other processes ([Note:
value info] in ``value_info``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import (disable_proxy_modes_tracing, get_proxy_slot,
                                                track_tensor_tree)
from torch.utils import _pytree as pytree

from ..errors import TraceError
from . import backward_hooks, markers, state, structures
from .subgraphs import base_op, rewrap, wrap_target

_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod (C++'s in newer torch)
DATA_GET = torch.Tensor.data.__get__


# -- run time ----------------------------------------------------------------------------

def run_without_grad(op):
    """``op`` run under ``torch.no_grad()``: a node traced without grad ([Note: gradients
    the forward shapes])."""
    def call(*args, **kwargs):
        with torch.no_grad():
            return op(*args, **kwargs)
    call.rewrap = run_without_grad
    return wrap_target(op, call, "no_grad_")


def view_without_grad(op):
    """A view op traced without grad: run so, and detached. A view made under ``no_grad``
    carries no gradient, yet reports its base's ``requires_grad``; as a stage's output it
    would ask for a gradient that its backward could not take."""
    def call(*args, **kwargs):
        with torch.no_grad():
            return op(*args, **kwargs).detach()
    call.rewrap = view_without_grad
    return wrap_target(op, call, "no_grad_")


def stop_gradients(gm: fx.GraphModule) -> None:
    """Run the nodes marked ``meta["no_grad"]`` under ``torch.no_grad()``."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get("no_grad"):
            schema = _schema(node)
            view = (schema is not None and not _in_place(node) and len(schema.returns) == 1
                    and schema.returns[0].alias_info is not None)
            node.target = (view_without_grad if view else run_without_grad)(node.target)
            changed = True
    if changed:
        gm.recompile()


def _schema(node: fx.Node):
    return getattr(base_op(node.target), "_schema", None)


def _in_place(node: fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments)


def mark_stops(gm: fx.GraphModule, carries_grad) -> None:
    """Mark ``meta["no_grad"]`` on the nodes traced without grad whose value could carry a
    gradient if they ran with it (``carries_grad(placeholder)``: that input may require
    grad). Out-of-place ones then carry none; an in-place one writes without history."""
    carries: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            carries[n] = carries_grad(n)
            continue
        derived = any(carries.get(m, False) for m in n.all_input_nodes)
        if n.op == "call_function" and derived and n.meta.get("grad_enabled") is False:
            n.meta["no_grad"] = True
            derived = _in_place(n)  # an out-of-place result has no history at run time
        carries[n] = derived


class _FunctionCall:
    """A custom autograd Function's ``apply`` with the call's constant arguments bound."""

    def __init__(self, cls, leaves: list, spec, tensor_at: list):
        self.cls, self.leaves, self.spec, self.tensor_at = cls, leaves, spec, tensor_at

    def __call__(self, *tensors):
        leaves = list(self.leaves)
        for k, t in zip(self.tensor_at, tensors):
            leaves[k] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return _original_apply(self.cls, *args, **kwargs)


def _original_apply(cls, *args, **kwargs):
    return _APPLY.__get__(None, cls)(*args, **kwargs)


def _function_node(call: _FunctionCall, random: bool):
    def apply(*tensors):
        return call(*tensors)
    apply.__name__ = apply.__qualname__ = f"apply_{call.cls.__name__}"
    apply.autograd_function = call.cls
    if random:  # rng.seed_random_ops gives it the micro-batch's stream
        apply.tags = (torch.Tag.nondeterministic_seeded,)
    return apply


def calls_function(target) -> bool:
    """Whether a graph node's ``target`` calls a custom autograd Function (:func:`traced_apply`)."""
    return hasattr(target, "autograd_function")


# -- trace time ----------------------------------------------------------------------------

def _random_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return [torch.get_rng_state(), *cuda]


def traced_apply(cls, *args, **kwargs):
    """``Function.apply`` while a training trace records: one node that calls it at run time
    ([Note: gradients the forward shapes])."""
    tracer = markers.training_tracer()
    if tracer is None:
        return _original_apply(cls, *args, **kwargs)
    if cls is torch.utils.checkpoint.CheckpointFunction:  # the forward it checkpoints
        run_function, _preserve, *inputs = args
        return run_function(*inputs)
    if cls.__module__.startswith("torch._library."):  # a custom op's own autograd: the op
        # lands in the graph and replays with it, in the caller's grad mode (autograd runs
        # a Function's forward without grad)
        with markers.grad_mode_recorded(torch.is_grad_enabled()):
            return _original_apply(cls, *args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    for v in leaves:
        if not isinstance(v, torch.Tensor) and (
                isinstance(v, torch.nn.Module) or structures.tensor_holder(v)
                or isinstance(getattr(v, "__self__", None), torch.nn.Module)):
            raise TraceError(
                f"the custom autograd Function {cls.__qualname__} is given a "
                f"{type(v).__name__} that holds tensors: the Function runs as one step of the "
                f"traced graph, which hands it only tensor arguments (the stage's own weights "
                f"and values). Pass the tensors it needs as arguments of apply()")
    constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]
    call = _FunctionCall(cls, constants, spec, tensor_at)
    before = _random_state()
    with disable_proxy_modes_tracing():
        out = _original_apply(cls, *args, **kwargs)
    after = _random_state()
    random = any(not torch.equal(a, b) for a, b in zip(before, after))
    proxies = [tracer.unwrap_proxy(leaves[k]) for k in tensor_at]
    proxy = tracer.create_proxy("call_function", _function_node(call, random), tuple(proxies), {})
    with disable_proxy_modes_tracing():  # its meta would record the copies it makes
        track_tensor_tree(out, proxy, constant=None, tracer=tracer)
    markers.record_requires_grad(out)
    return out


def traced_detach(func, args: tuple, kwargs: dict):
    """``t.detach()`` while a training trace records: noted as the model's own stop
    ([Note: gradients the forward shapes])."""
    out = func(*args, **kwargs)
    tracer = markers.training_tracer()
    proxy = get_proxy_slot(out, tracer, None) if tracer is not None else None
    if proxy is not None:
        proxy.proxy.node.meta["stops"] = True
    return out


def autograd_detaches_pass(gm: fx.GraphModule) -> None:
    """Replay as the values themselves the detaches that autograd recorded, not the model's
    code ([Note: gradients the forward shapes]): an output it saved for a backward (a detach
    that only detaches feed on) and each unpacking of it (a detach of that detach). Plain
    PyTorch's unpacking gives the saved value with its own history, no node between: a node
    between would change the order in which a second-order backward sums the gradients that
    reach the value (bfloat16 rounds differently; fuzzer seed 186)."""
    detach = torch.ops.aten.detach.default

    def autograd_s(n) -> bool:
        return isinstance(n, fx.Node) and n.target is detach and not n.meta.get("stops")
    saved = [n for n in gm.graph.nodes if autograd_s(n) and n.users
             and all(autograd_s(u) for u in n.users)]
    gone = {*saved, *(u for n in saved for u in n.users)}
    for n in reversed(gm.graph.nodes):  # an unpacking before what it unpacks
        if n in gone:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    if saved:
        gm.recompile()


def functional_writes_pass(gm: fx.GraphModule) -> None:
    """Make out of place each write in place to an activation autograd tracks ([Note: writes
    to activations]): the op's functional form (``mul_`` -> ``mul``), whose value the ops after
    it read instead; same values, and no version for autograd to find moved."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    changed = False
    for n in list(gm.graph.nodes):
        op = base_op(n.target) if n.op == "call_function" else None
        schema = getattr(op, "_schema", None)
        if schema is None or not schema.name.endswith("_") or not n.args:
            continue
        x = n.args[0]
        if n.meta.get("grad_enabled") is False or state.written(n) != [x] \
                or not _tracked_activation(x, n):
            continue  # a write under no_grad is invisible to autograd: it stays a write
        functional = getattr(getattr(torch.ops.aten, schema.name.split("::")[-1][:-1], None),
                             op._overloadname, None)
        if functional is None:
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(rewrap(n.target, functional), n.args, n.kwargs)
        new.meta.update(n.meta)
        for u in list(x.users):
            if u is not n and order.get(u, -1) > order[n]:
                u.replace_input_with(x, new)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        order[new] = order[n]
        changed = True
    if changed:
        gm.recompile()


def _tracked_activation(x, writer: fx.Node) -> bool:
    """``x`` is a value of the forward's own that required grad, which nothing else aliases
    (no view of it that is read, and it no view of another) before ``writer`` writes it."""
    return (isinstance(x, fx.Node) and x.op == "call_function" and x.meta.get("requires_grad")
            is True and state.aliased_input(x) is None
            and not any(u is not writer and u.users and state.aliased_input(u) is x
                        for u in x.users))


def traced_data(func, args):
    """``t.data`` while a training trace records: an alias that stops gradients, as
    ``t.detach()`` (make_fx records ``.data`` as a plain alias)."""
    out = func(*args)
    tracer = markers.training_tracer()
    proxy = get_proxy_slot(out, tracer, None) if tracer is not None else None
    if proxy is not None and proxy.proxy.node.target in (torch.ops.aten.alias.default,
                                                         torch.ops.aten.detach.default):
        proxy.proxy.node.target = torch.ops.aten.detach.default
        proxy.proxy.node.meta["stops"] = True
    return out


_PATCH_LOCK = threading.Lock()
_patched = {"traces": 0, "saved": {}}


def _patches() -> dict:
    """(owner, name) -> what replaces it while a training trace records."""
    return {(torch.autograd.Function, "apply"): classmethod(traced_apply),
            **backward_hooks.patches()}


@contextlib.contextmanager
def recording(training: bool):
    """Keep what the forward says about its gradients while a training trace runs on this
    thread ([Note: gradients the forward shapes]); an inference trace keeps nothing.

    ``Function.apply`` and the setup of modules' backward hooks are torch's, replaced while
    any thread traces; each replacement does torch's own on every thread but a tracing one.
    """
    if not training:
        yield
        return
    with _PATCH_LOCK:
        if _patched["traces"] == 0:
            for (owner, name), replacement in _patches().items():
                _patched["saved"][owner, name] = owner.__dict__[name]
                setattr(owner, name, replacement)
        _patched["traces"] += 1
    try:
        with markers.training_records():
            yield
    finally:
        with _PATCH_LOCK:
            _patched["traces"] -= 1
            if _patched["traces"] == 0:
                for (owner, name), original in _patched["saved"].items():
                    setattr(owner, name, original)
