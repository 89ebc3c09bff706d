"""Backward hooks a forward sets up or a module carries, kept in the traced graph.

The hooks part of [Note: gradients the forward shapes] in ``grad_semantics``: a module's
``register_full_backward_hook``/``register_full_backward_pre_hook`` is set up afresh on the
stage's values in every micro-batch by two nodes (where ``Module.__call__`` sets up its
``BackwardHook``), and ``t.register_hook(fn)`` in the forward is a node that registers ``fn``
on the stage's value of ``t``.
"""

from __future__ import annotations

import itertools
import operator
import threading

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, track_tensor_tree

from ..errors import BlockError, TraceError
from . import markers


def _hook_node(fn):
    def register_hook(t):
        # Once per value: a recomputed stage runs this node again on its boundary leaves.
        done = t.__dict__.setdefault("_poptorch_lite_hooks", set())
        if t.requires_grad and register_hook not in done:
            done.add(register_hook)
            t.register_hook(fn)
    register_hook.__name__ = register_hook.__qualname__ = (
        f"register_hook_{getattr(fn, '__name__', 'fn').replace('<', '').replace('>', '')}")
    return register_hook


def refuse_legacy_backward_hooks(model: torch.nn.Module) -> None:
    """Refuse a module hook registered with the deprecated ``register_backward_hook``: it sees
    the gradients of whichever op made the module's output, which a traced graph does not
    keep (``register_full_backward_hook`` is kept: [Note: gradients the forward shapes]).

    Raises:
        TraceError: naming the module and the fix.
    """
    for name, m in model.named_modules():
        if m._backward_hooks and m._is_full_backward_hook is False:
            raise TraceError(
                f"module {name or type(m).__name__} has a hook registered with "
                f"register_backward_hook, which PyTorch deprecates: it sees the gradients of "
                f"the last op of the module's forward, not the module's, and a traced graph "
                f"keeps no such op boundary. Use register_full_backward_hook (or "
                f"register_full_backward_pre_hook), which poptorch_lite keeps")


def stages_sharing(stages) -> dict:
    """Parameter name -> the stages that use it, for those several stages use."""
    users: dict = {}
    for st in stages:
        for name in st.param_names:
            users.setdefault(name, []).append(st)
    return {name: sts for name, sts in users.items() if len(sts) > 1}


def refuse_hooks_on_shared_parameters(shared: dict, params: dict) -> None:
    """Refuse a gradient hook on a parameter that several stages use (``shared``:
    :func:`stages_sharing`). Each stage's backward computes its part of the parameter's
    gradient, at its own time and on its own copy where memories are separate, so the hook
    would run on each part, where plain PyTorch runs it once per backward on their sum: the
    same for a hook that scales, not for one that clamps. Checked at every training call
    (a hook may be registered between calls), before anything runs.

    Raises:
        BlockError: naming the parameter, its hooks, the stages and the fix.
    """
    for name, sts in shared.items():
        p = params.get(name)
        kinds = [] if p is None else [k for k, hooks in (
            ("register_hook", p._backward_hooks),
            ("register_post_accumulate_grad_hook",
             getattr(p, "_post_accumulate_grad_hooks", None))) if hooks]
        if kinds:
            where = " and ".join(f"{st.index} ({st.named_blocks})" for st in sts)
            raise BlockError(
                f"parameter '{name}' has a gradient hook ({' and '.join(kinds)}) and stages "
                f"{where} use it: each stage's backward computes its own part of the "
                f"parameter's gradient, so the hook would run on each part ({len(sts)} times a "
                f"micro-batch), where plain PyTorch runs it once on their sum. Put every use "
                f"of '{name}' in one stage (one block), or remove the hook")


_module_calls = itertools.count()  # tells a module call's input hook from another's
_setups = threading.local()          # call key -> the BackwardHook of the call running here


def _traced_input_hook(original):
    """``BackwardHook.setup_input_hook`` while a training trace records: also a node that sets
    up, in every micro-batch, a fresh BackwardHook of the module on the stage's values."""
    def setup_input_hook(self, args):
        tracer = markers.training_tracer()
        if tracer is None:
            return original(self, args)
        key = next(_module_calls)
        self._poptorch_lite_key = key
        return _hook_setup(tracer, args, lambda *a: original(self, a),
                           _module_input_node(self.module, key))
    return setup_input_hook


def _traced_output_hook(original):
    """``BackwardHook.setup_output_hook`` while a training trace records: also a node that
    finishes the micro-batch's BackwardHook that the call's input node made."""
    def setup_output_hook(self, args):
        tracer = markers.training_tracer()
        key = getattr(self, "_poptorch_lite_key", None)
        if tracer is None or key is None:
            return original(self, args)
        single = not isinstance(args, tuple)
        values = (args,) if single else args
        out = _hook_setup(tracer, values, lambda *a: original(self, a),
                          _module_output_node(self.module, key))
        return out[0] if single else out
    return setup_output_hook


def _hook_setup(tracer, args: tuple, real, node_fn) -> tuple:
    """Run ``real`` (torch's own setup) on the trace's tensors with the proxy off, and record
    ``node_fn`` over the tensors of ``args`` as the node that makes the results."""
    at = [k for k, v in enumerate(args) if isinstance(v, torch.Tensor)]
    with disable_proxy_modes_tracing():
        out = real(*args)
    proxy = tracer.create_proxy("call_function", node_fn,
                                tuple(tracer.unwrap_proxy(args[k]) for k in at), {})
    tensors = tuple(out[k] for k in at)
    with disable_proxy_modes_tracing():  # its meta would record the copies it makes
        track_tensor_tree(tensors, proxy, constant=None, tracer=tracer)
    markers.record_requires_grad(tensors)
    return out


def _module_input_node(module, key: int):
    def module_backward_hook_inputs(*tensors):
        hooks, _ = module._get_backward_hooks()
        bw = torch.utils.hooks.BackwardHook(module, hooks, module._get_backward_pre_hooks())
        _setups.__dict__[key] = bw
        return tuple(bw.setup_input_hook(tensors))
    module_backward_hook_inputs.module_hook = (module, key)
    return module_backward_hook_inputs


def _module_output_node(module, key: int):
    def module_backward_hook_outputs(*tensors):
        return tuple(_setups.__dict__.pop(key).setup_output_hook(tensors))
    module_backward_hook_outputs.module_hook = (module, key)
    return module_backward_hook_outputs


def passes_on(node: fx.Node):
    """The node whose values ``node`` passes on when it is a module backward hook's setup or
    a pick of its results, else None: such a node belongs to its input's block (the setup of
    a module's output runs after the module returned, past the end of a ``with Block``)."""
    target = node.target
    if target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0] if hasattr(node.args[0].target, "module_hook") else None
    if hasattr(target, "module_hook") and node.all_input_nodes:
        return node.all_input_nodes[0]
    return None


def check_module_hooks(groups: list) -> None:
    """Refuse a module with backward hooks whose input and output land in different stages
    (``groups``: each stage's nodes): one BackwardHook ties them within a micro-batch.

    Raises:
        TraceError: naming the module and the fix.
    """
    stage_of: dict = {}
    for s, nodes in enumerate(groups):
        for n in nodes:
            module, key = getattr(n.target, "module_hook", (None, None))
            if module is not None and stage_of.setdefault(key, s) != s:
                raise TraceError(
                    f"{type(module).__name__} has backward hooks (register_full_backward_hook) "
                    f"and its forward spans stages {stage_of[key]} and {s}: a module's hooks "
                    f"need its input and its output in one stage; move the BeginBlock that "
                    f"splits it to the module itself, or out of it")


def traced_register_hook(func, t, hook):
    """``t.register_hook(hook)`` while a training trace records: also a node that registers
    it on the stage's value at run time."""
    tracer = markers.training_tracer()
    if tracer is None and not t.requires_grad:  # an inference trace: no gradient comes
        return torch.utils.hooks.RemovableHandle({})
    handle = func(t, hook)
    if tracer is not None:
        tracer.create_proxy("call_function", _hook_node(hook), (tracer.unwrap_proxy(t),), {})
    return handle


def patches() -> dict:
    """(owner, name) -> what replaces it while a training trace records: the setup of a
    module's ``BackwardHook`` (``grad_semantics.recording`` puts them in place)."""
    hook = torch.utils.hooks.BackwardHook
    return {(hook, "setup_input_hook"): _traced_input_hook(hook.__dict__["setup_input_hook"]),
            (hook, "setup_output_hook"): _traced_output_hook(hook.__dict__["setup_output_hook"])}
