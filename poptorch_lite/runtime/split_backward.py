"""Split backward: a stage's input gradients now (I), its weight gradients later (W).

[Note: split backward]
Zero-bubble schedules ([Note: zero bubble] in ``schedule_kinds``) run a
backward as two actions. I computes only the gradients of the segment's
leaves (the stage's boundary inputs, the checkpoint cuts), which the stage
upstream waits for; W computes the parameters' gradients, which nothing waits
for but the reduction. The split is made on the autograd graph that the
traced stage graph recorded, the way torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight`` do, not by running
the backward twice with ``retain_graph``:

- the *frontier* of each parameter is where its path to the outputs first
  meets a path from the leaves (an ``addmm`` node: ``x @ w.T + b``); I runs
  ``autograd.grad`` to the leaves only, keeping the graph, and a hook on
  each frontier node keeps the gradient that reached it;
- W runs ``autograd.grad`` from the frontier nodes, seeded with those kept
  gradients, to the parameters, one call per group of parameters sharing a
  frontier (one call for all would run the chain from an upper frontier
  down to a lower layer's weights again): only the weight-gradient edges
  run (``grad_w = dy.T @ x``), never the chain back to the leaves. A frontier
  node that another one feeds is clamped to its kept gradient, so no
  gradient counts twice. A parameter whose path to an output never meets a
  leaf's (stage 0, whose inputs need no gradient) is reached from that
  output itself, seeded with the output's gradient: then W is that part of
  the backward whole. A segment with no leaf that needs a gradient (stage 0)
  skips the walk over its graph: its W is one backward from the outputs to
  the parameters. The walk is made once per stage segment, on its first
  micro-batch: every micro-batch records the same graph, so later ones find
  the frontier nodes by their paths from the outputs (:class:`SplitPlan`).

Both halves are ``autograd.backward(..., inputs=...)`` (``run_backward``): autograd itself
accumulates into ``.grad``, under its lock, so a weight that two stages
share (their W's on two streams at once) loses no gradient. Each call sums
its contributions in autograd's own order, so the gradients equal a joint
backward's up to float reassociation (within the contract's 1e-5).
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import has_torch_function as _has_torch_function

try:  # the engine's entry that torch.autograd.backward calls (torch 2.3 and later)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a torch that moved it: the documented path, a few microseconds slower
    _engine_run_backward = None


def _node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient (a leaf's AccumulateGrad)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _towards_outputs(roots: Sequence[torch.Tensor]) -> tuple:
    """``(feeds, found)`` over the graph below the nodes ``roots``: node -> the nodes it feeds
    (forward direction), and node -> ``(the node it was first reached from, or None for a
    root, the edge's index there, or the root's)``, which makes its path from a root."""
    feeds: dict = collections.defaultdict(list)
    found: dict = {}
    queue = collections.deque()
    for j, n in enumerate(roots):
        if n is not None and n not in found:
            found[n] = (None, j)
            queue.append(n)
    while queue:
        node = queue.popleft()
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is not None:
                feeds[nxt].append(node)
                if nxt not in found:
                    found[nxt] = (node, k)
                    queue.append(nxt)
    return feeds, found


def _path(node, found: dict) -> tuple:
    """``(root index, edge indices)`` that lead from a root to ``node`` (:func:`_towards_outputs`)."""
    steps = []
    while True:
        parent, k = found[node]
        if parent is None:
            return k, tuple(reversed(steps))
        steps.append(k)
        node = parent


def _follow(roots: list, path: tuple):
    """The node at ``path`` below ``roots`` (None where the graph has no such edge)."""
    root, steps = path
    node = roots[root]
    for k in steps:
        edges = node.next_functions
        if k >= len(edges) or edges[k][0] is None:
            return None
        node = edges[k][0]
    return node


class SplitPlan:
    """Where one stage segment's split falls, found on its first micro-batch and kept: every
    micro-batch records the same autograd graph (the same traced graph, the same arguments'
    ``requires_grad``), so each group's frontier nodes are found again by their paths from
    the outputs, without walking the graph ([Note: split backward]).

    Attributes:
        groups: ``(parameter positions, frontier paths, seeding outputs, node kinds)`` per group.
        shape: which parameters needed a gradient, and how many outputs and leaves there
            were: a graph of another shape (a weight frozen since) is walked again.
    """

    __slots__ = ("groups", "shape")

    def __init__(self, groups: list, shape: tuple):
        self.groups, self.shape = groups, shape

    def frontiers(self, out_nodes: list, shape: tuple) -> Optional[list]:
        """Each group's frontier nodes in this micro-batch's graph; None where the graph has
        another shape or a path leads elsewhere than on the first micro-batch (then the graph
        is walked again)."""
        if shape != self.shape:
            return None
        located = []
        for _, paths, _, kinds in self.groups:
            nodes = [_follow(out_nodes, p) for p in paths]
            if any(n is None or type(n).__name__ != kind for n, kind in zip(nodes, kinds)):
                return None
            located.append(nodes)
        return located


def _closure(starts, feeds: dict, stop: frozenset = frozenset()) -> tuple:
    """The nodes reached from ``starts`` towards the outputs, and those of ``stop`` met."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for nxt in feeds.get(queue.popleft(), ()):
            if nxt in stop:
                met.add(nxt)
            elif nxt not in reached:
                reached.add(nxt)
                queue.append(nxt)
    return reached, met


class Deferred:
    """What a W needs: per group of parameters that share a frontier, the frontier and the
    outputs that seed it; per frontier node the gradient tuple that reached it in I."""

    __slots__ = ("groups", "outputs", "grads")

    def __init__(self, groups: list, outputs: list):
        self.groups = groups    # [(params, frontier nodes, indices of seeding outputs)]
        self.outputs = outputs  # output index -> (output, its gradient), those that seed W
        self.grads: dict = {}   # frontier node -> the gradient tuple that reached it in I

    def nbytes(self) -> int:
        """The bytes of the kept gradients (distinct storages), held until W."""
        held = [g for kept in self.grads.values() for g in kept if g is not None]
        held += [g for _, g in self.outputs.values()]
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in held}
        return sum(storages.values())


def backward_input(outputs: list, grads: list, leaves: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor], plans: Optional[list] = None) -> Deferred:
    """I: add the gradients of ``outputs`` (seeded with ``grads``) to each leaf's ``.grad``;
    return what :func:`backward_weight` needs for ``params``' gradients.

    Example:
        >>> w = torch.ones(2, 2, requires_grad=True)
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> y = x @ w
        >>> later = backward_input([y], [torch.ones(1, 2)], [x], [w])
        >>> x.grad.tolist(), w.grad
        ([[2.0, 2.0]], None)
        >>> backward_weight(later); w.grad.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    leaves = [t for t in leaves if t.requires_grad]
    if not leaves:  # nothing upstream waits for an I: W is the whole backward, one call
        ps = [p for p in params if p.requires_grad]
        seeding = tuple(range(len(outputs))) if ps else ()
        return Deferred([(ps, [], seeding)] if ps else [],
                        {j: (outputs[j], grads[j]) for j in seeding})
    out_nodes = [_node(o) for o in outputs]
    plan = plans[0] if plans else None
    shape = (tuple(p.requires_grad for p in params), len(outputs), len(leaves))
    located = plan.frontiers(out_nodes, shape) if plan is not None else None
    if located is not None:  # the first micro-batch's split, found again by position
        groups = [([params[k] for k in at], nodes, seeding)
                  for (at, _, seeding, _), nodes in zip(plan.groups, located)]
    else:
        groups = _walk(out_nodes, leaves, params, plans, shape)
    deferred = Deferred(groups, {j: (outputs[j], grads[j]) for _, _, seeding in groups
                                 for j in seeding})
    frontier = {n for _, met, _ in deferred.groups for n in met}
    handles = [n.register_prehook(_keep(deferred.grads, n)) for n in frontier]
    try:
        if leaves:
            run_backward(outputs, grads, retain_graph=bool(groups), inputs=leaves)
    finally:
        for h in handles:
            h.remove()
    return deferred


def _walk(out_nodes: list, leaves: list, params: Sequence[torch.Tensor],
          plans: Optional[list], shape: tuple) -> list:
    """The groups of ``params`` that share a frontier, found by walking the graph below
    ``out_nodes``: ``(params, frontier nodes, seeding outputs)`` each. With ``plans`` (a
    one-element list), the split is kept there as a :class:`SplitPlan` for the next
    micro-batches."""
    feeds, found = _towards_outputs(out_nodes)
    from_leaves, _ = _closure([_node(t) for t in leaves], feeds)
    stop = frozenset(from_leaves)
    groups: dict = {}  # (frontier, seeding outputs) -> the positions of the parameters
    for at, p in enumerate(params):
        node = _node(p) if p.requires_grad else None
        if node not in feeds:
            continue  # no output of this segment depends on it
        reached, met = _closure([node], feeds, stop)
        seeding = tuple(k for k, n in enumerate(out_nodes) if n in reached and n not in stop)
        groups.setdefault((tuple(sorted(met, key=id)), seeding), []).append(at)
    if plans is not None:
        plans[:] = [SplitPlan([(tuple(at), [_path(n, found) for n in met], seeding,
                                [type(n).__name__ for n in met])
                               for (met, seeding), at in groups.items()], shape)]
    return [([params[k] for k in at], list(met), seeding) for (met, seeding), at in groups.items()]


def run_backward(tensors: Sequence, grads: Sequence, retain_graph: bool = False,
                 inputs: Sequence[torch.Tensor] = ()) -> None:
    """``torch.autograd.backward(tensors, grads, retain_graph, inputs=inputs)``, straight to
    autograd's engine (``inputs`` empty: every leaf).

    ``torch.autograd.backward`` first checks and normalises its arguments in Python
    (``_make_grads``: a gradient per output, of its shape and dtype), which costs some
    15 µs a call on a 2-core machine: most of a small stage's backward, paid every
    micro-batch (``benchmarks/tax.py --case tiny``). The stages pass a gradient for
    every output (what later stages sent back, the loss's seed), and the engine itself
    still refuses one of the wrong shape and casts one of another dtype. Tensor
    subclasses with ``__torch_function__`` take the documented path, which honours it.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> run_backward([w * 3], [torch.ones(2)]); w.grad.tolist()
        [3.0, 3.0]
    """
    if _engine_run_backward is None or _has_torch_function(tensors) or _has_torch_function(grads):
        torch.autograd.backward(tensors, grads, retain_graph=retain_graph,
                                inputs=list(inputs) or None)
    else:
        _engine_run_backward(tuple(tensors), tuple(grads), retain_graph, False, tuple(inputs),
                             allow_unreachable=True, accumulate_grad=True)


def _keep(into: dict, node):
    def hook(grad_outputs):
        into[node] = grad_outputs
    return hook


def compiled_input(state, tensors: list, grads: list, params: list) -> list:
    """I of a compiled graph whose backward is split once, when it compiled ([Note: compiled
    split backward] in ``compiler/split_graphs``): the backward of ``tensors`` runs the input
    half, and the weight halves it leaves (``state``: the graph's ``SplitState``) come back
    for W, told the parameters by argument position (``params``). A weight with a hook runs
    its backward whole here: the hook sees its gradient whole, as in plain PyTorch (a
    post-accumulate hook would otherwise run in the input half, where the compiled backward
    gives the weight no gradient, and its ``.grad`` is None or last micro-batch's)."""
    if any(p._backward_hooks or p._post_accumulate_grad_hooks for p in params if p is not None):
        run_backward(tensors, grads)
        return []
    with state.lock:
        state.splitting = True
        try:
            run_backward(tensors, grads)
        finally:
            state.splitting = False
            halves, state.deferred = state.deferred, []
    for half in halves:
        half.params = params
    return halves


def backward_weight(deferred) -> None:
    """W: add the parameters' gradients to their ``.grad`` from what I kept (a
    :class:`Deferred`, or a compiled graph's ``WeightHalf``), one group of parameters at a
    time, so each call runs only the edges down to its own parameters; frees the graph."""
    if not isinstance(deferred, Deferred):  # a compiled graph's weight half
        tensors, seeds = deferred.gradients()
        if tensors:
            run_backward(tensors, seeds)
        return
    kept = deferred.grads
    for k, (params, frontier, seeding) in enumerate(deferred.groups):
        edges, seeds = [], []
        for j in seeding:
            edges.append(deferred.outputs[j][0])
            seeds.append(deferred.outputs[j][1])
        for node in frontier:
            for n, g in enumerate(kept.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, n))
                    seeds.append(g)
        if not edges:
            continue
        handles = [n.register_prehook(lambda _, held=kept[n]: held)
                   for n in frontier if n in kept] if len(edges) > 1 else []
        try:  # autograd accumulates: a weight two stages share is added to under its lock
            run_backward(edges, seeds, retain_graph=k < len(deferred.groups) - 1, inputs=params)
        finally:
            for h in handles:
                h.remove()
    kept.clear()
    deferred.groups, deferred.outputs = [], {}
