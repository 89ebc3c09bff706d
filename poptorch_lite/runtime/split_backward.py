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
  gradients, to the parameters: only the weight-gradient edges run again
  (``grad_w = dy.T @ x``), never the chain back to the leaves. A frontier
  node that another one feeds is clamped to its kept gradient, so no
  gradient counts twice. A parameter whose path to an output never meets a
  leaf's (stage 0, whose inputs need no gradient) is reached from that
  output itself, seeded with the output's gradient: then W is that part of
  the backward whole.

Each ``autograd.grad`` sums its contributions in autograd's own order, so
the gradients equal a joint backward's up to float reassociation (within
the contract's 1e-5). A W accumulates into ``.grad`` as ``backward`` does.
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge


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
    """What a W needs: per frontier node its kept gradient; outputs that seed W directly."""

    __slots__ = ("params", "frontier", "grads", "outputs", "seeds")

    def __init__(self, params: list, frontier: list, outputs: list, seeds: list):
        self.params, self.frontier, self.outputs, self.seeds = params, frontier, outputs, seeds
        self.grads: dict = {}  # frontier node -> the gradient tuple that reached it in I


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
    params = [p for p in params if p.requires_grad]
    leaves = [t for t in leaves if t.requires_grad]
    out_nodes = [_node(o) for o in outputs]
    feeds = _towards_outputs(out_nodes)
    from_leaves, _ = _closure([_node(t) for t in leaves], feeds)
    frontier, seeded = set(), set()
    for p in params:
        node = _node(p)
        if node not in feeds:
            continue  # no output of this segment depends on it
        reached, met = _closure([node], feeds, frozenset(from_leaves))
        frontier |= met
        seeded |= {n for n in reached if n in out_nodes}  # outputs reached without a leaf's path
    seeds = [(o, g) for o, g, n in zip(outputs, grads, out_nodes) if n in seeded]
    deferred = Deferred(params, list(frontier), [o for o, _ in seeds], [g for _, g in seeds])
    handles = [n.register_prehook(_keep(deferred.grads, n)) for n in deferred.frontier]
    try:
        if leaves:
            got = torch.autograd.grad(outputs, leaves, grads, retain_graph=bool(params),
                                      allow_unused=True)
            for leaf, g in zip(leaves, got):
                if g is not None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
    finally:
        for h in handles:
            h.remove()
    return deferred


def _keep(into: dict, node):
    def hook(grad_outputs):
        into[node] = grad_outputs
    return hook


def backward_weight(deferred: Deferred) -> None:
    """W: add the parameters' gradients to their ``.grad`` from what I kept; frees the graph."""
    edges, seeds = list(deferred.outputs), list(deferred.seeds)
    for node in deferred.frontier:
        for k, g in enumerate(deferred.grads.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, k))
                seeds.append(g)
    if not edges or not deferred.params:
        return
    handles = [n.register_prehook(lambda _, kept=deferred.grads[n]: kept)
               for n in deferred.frontier if n in deferred.grads] if len(edges) > 1 else []
    try:
        got = torch.autograd.grad(edges, deferred.params, seeds, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for p, g in zip(deferred.params, got):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
    deferred.grads.clear()
