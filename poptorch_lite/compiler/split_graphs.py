"""A compiled stage's backward split in two: the input half for I, the weight half for W.

[Note: compiled split backward]
Under a zero-bubble schedule ([Note: split backward] in ``runtime/split_backward``) a
compiled stage graph ([Note: compiled stages] in ``compiled_stages``) has its backward
split once, when it compiles, on AOTAutograd's backward graph, as torchtitan splits its
traced stages: :func:`split_backward` makes the input half (the gradients of every argument
but the parameters) and the weight half (the parameters' gradients, from the saved values
and the gradients the input half computed on the way), and a :class:`SplitState` switches
each backward between running both halves (other schedules, or a weight with a hook) and
leaving a :class:`WeightHalf` for the W action.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
import torch.fx as fx


class SplitState:
    """A compiled graph's split backward (:func:`split_backward`): while ``splitting`` (an I
    action of a zero-bubble schedule), each backward computes the input gradients and leaves
    a :class:`WeightHalf` in ``deferred`` for the W action; otherwise it computes both halves
    at once. ``lock``: held from setting ``splitting`` until the halves are taken (wrappers
    that share the graph take turns)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.splitting = False
        self.deferred: list = []


class WeightHalf:
    """The weight half of one backward: its graph and the values it reads, kept from I."""

    __slots__ = ("graph", "inputs", "positions", "params")

    def __init__(self, graph, inputs: list, positions: tuple):
        self.graph, self.inputs, self.positions = graph, inputs, positions
        self.params: Optional[Sequence] = None  # argument position -> tensor, given at I

    def nbytes(self) -> int:
        """The bytes of what it keeps (distinct storages), held until W."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.inputs if isinstance(t, torch.Tensor)}
        return sum(storages.values())

    def gradients(self) -> tuple:
        """W: ``(parameters, their gradients)``, for autograd to add to their ``.grad``
        (``run_backward``: under its lock, so a parameter two stages share loses nothing)."""
        with torch.no_grad():  # as inside autograd's backward, where I ran
            grads = self.graph(list(self.inputs))
        self.inputs = []
        tensors, seeds = [], []
        for at, g in zip(self.positions, grads):
            p = self.params[at]
            if g is not None and p is not None and p.requires_grad:
                tensors.append(p)
                seeds.append(g)
        return tensors, seeds


def split_backward(bw: fx.GraphModule, example_inputs, positions: tuple, compile_one,
                   state: SplitState, lifted: int = 0):
    """AOTAutograd's backward graph ``bw`` (its outputs: one gradient per forward argument)
    as two graphs: I, the gradients of the arguments but the parameters at ``positions``,
    and W, the parameters' gradients from the saved values and what I computed on the way
    (the gradient of each value a weight multiplies: ``dW = dy.T @ x`` reads I's ``dy``), so
    W never runs the chain back to the inputs again. Each is compiled by
    ``compile_one(graph, example inputs, is_i)``. ``positions`` index the backward's
    outputs, whose first ``lifted`` are the gradients of tensors the graph holds, which
    AOTAutograd lifts ahead of the arguments; a deferred :class:`WeightHalf` names argument
    positions. Returns the backward AOTAutograd calls (boxed: a list of the saved values and
    the output gradients)."""
    outs = list(bw.graph.output_node().args[0])
    w_at = tuple(k for k in positions if k < len(outs) and isinstance(outs[k], fx.Node))
    i_at = tuple(k for k, o in enumerate(outs) if isinstance(o, fx.Node) and k not in w_at)
    if not w_at:  # nothing to defer
        return compile_one(bw, example_inputs, True)
    for_i = _ancestors([outs[k] for k in i_at])
    w_only = [n for n in bw.graph.nodes if n in _ancestors([outs[k] for k in w_at])
              and n not in for_i and n.op != "placeholder"]
    inside = set(w_only)
    read = list(dict.fromkeys(
        [a for n in w_only for a in n.all_input_nodes if a not in inside]
        + [outs[k] for k in w_at if outs[k] not in inside]))
    held = [n for n in read if n.op == "placeholder"]
    boundary = [n for n in read if n.op != "placeholder"]
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]

    g_i, env = fx.Graph(), {}
    for n in bw.graph.nodes:
        if n.op != "output":
            env[n] = g_i.node_copy(n, env.__getitem__)
    g_i.output(tuple(env[outs[k]] for k in i_at) + tuple(env[n] for n in boundary))
    g_i.eliminate_dead_code()
    g_w, env = fx.Graph(), {}
    for n in held + boundary:
        env[n] = g_w.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in w_only:
        env[n] = g_w.node_copy(n, env.__getitem__)
    g_w.output(tuple(env[outs[k]] for k in w_at))
    half_i = compile_one(fx.GraphModule(bw, g_i), example_inputs, True)
    half_w = compile_one(fx.GraphModule(bw, g_w),
                         [example_inputs[placeholders.index(n)] for n in held]
                         + [n.meta["val"] for n in boundary], False)
    take = tuple(placeholders.index(n) for n in held)
    return _SplitBackward(half_i, half_w, len(outs), i_at, w_at, take, state, lifted)


class _SplitBackward:
    """The boxed backward of :func:`split_backward`."""

    def __init__(self, half_i, half_w, n, i_at, w_at, take, state, lifted):
        # On the instance: wrappers (functools.wraps) copy an instance's attributes only.
        self._boxed_call = True
        self.half_i, self.half_w, self.n, self.i_at, self.w_at = half_i, half_w, n, i_at, w_at
        self.take, self.state = take, state
        self.arguments = tuple(k - lifted for k in w_at)  # W's positions among the arguments

    def __call__(self, args: list):
        kept = [args[k] for k in self.take]
        got = self.half_i(list(args))
        args.clear()  # AOTAutograd's boxed convention: the saved values go when done
        grads = [None] * self.n
        for k, g in zip(self.i_at, got):
            grads[k] = g
        inputs = kept + list(got[len(self.i_at):])
        if self.state.splitting:
            self.state.deferred.append(WeightHalf(self.half_w, inputs, self.arguments))
        else:
            for k, g in zip(self.w_at, self.half_w(inputs)):
                grads[k] = g
        return tuple(grads)


def _ancestors(roots) -> set:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
