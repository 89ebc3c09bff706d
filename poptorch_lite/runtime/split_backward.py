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
  the parameters.

Both halves are ``autograd.backward(..., inputs=...)`` (``run_backward``): autograd itself
accumulates into ``.grad``, under its lock, so a weight that two stages
share (their W's on two streams at once) loses no gradient. Each call sums
its contributions in autograd's own order, so the gradients equal a joint
backward's up to float reassociation (within the contract's 1e-5).
"""

from __future__ import annotations

import collections
from typing import Sequence

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


def _towards_outputs(roots: Sequence[torch.Tensor]) -> dict:
    """node -> the nodes it feeds (forward direction), over the graph below ``roots``."""
    feeds: dict = collections.defaultdict(list)
    queue = collections.deque(n for n in roots if n is not None)
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                feeds[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return feeds


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
                   params: Sequence[torch.Tensor]) -> Deferred:
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
    feeds = _towards_outputs(out_nodes)
    from_leaves, _ = _closure([_node(t) for t in leaves], feeds)
    stop = frozenset(from_leaves)
    groups: dict = {}  # (frontier, seeding outputs) -> the parameters that have them
    for p in params:
        node = _node(p) if p.requires_grad else None
        if node not in feeds:
            continue  # no output of this segment depends on it
        reached, met = _closure([node], feeds, stop)
        seeding = tuple(k for k, n in enumerate(out_nodes) if n in reached and n not in stop)
        groups.setdefault((frozenset(met), seeding), []).append(p)
    deferred = Deferred([(ps, list(met), seeding) for (met, seeding), ps in groups.items()],
                        {j: (outputs[j], grads[j]) for _, seeding in groups for j in seeding})
    frontier = {n for _, met, _ in deferred.groups for n in met}
    handles = [n.register_prehook(_keep(deferred.grads, n)) for n in frontier]
    try:
        if leaves:
            run_backward(outputs, grads, retain_graph=bool(groups), inputs=leaves)
    finally:
        for h in handles:
            h.remove()
    return deferred


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


def backward_weight(deferred: Deferred) -> None:
    """W: add the parameters' gradients to their ``.grad`` from what I kept, one group of
    parameters at a time, so each call runs only the edges down to its own parameters;
    frees the graph."""
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
