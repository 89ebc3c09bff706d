"""The model's loss: found by provenance, and the returned value that trains.

[Note: loss provenance]
The loss is the value marked by a torch loss function or ``identity_loss``
(``mark_loss`` nodes), never a position in the return value. Marked values
that feed another marked value are not final; exactly one must remain. A
marked value that cannot carry a gradient (a metric computed with a loss
function under ``torch.no_grad()``, or on detached values) is not a loss: it
could not train anything. (When no marked value carries one, say every weight
is frozen, they all count, as in PopTorch.)

[Note: the trained loss]
What trains is what plain PyTorch's ``loss.backward()`` would train: the value
the model returns as its loss, arithmetic after the loss function included
(``2 * F.cross_entropy(...)``, ``ce / 4``, ``F.cross_entropy(...,
reduction="none").mean()``, a masked mean, ``ce + 0.5 * (w ** 2).sum()``). That
is the returned value whose autograd graph holds the final loss: read off the
traced micro-batch's own autograd graph (``tracing``: ``meta["trains"]``), so a
``detach`` or a ``no_grad`` on the way cuts it, as it would cut a backward. Its
gradient is seeded with ones (times the loss scale), as ``identity_loss`` is.

- No returned value holds it: the loss itself trains (and a warning says that
  it is not returned).
- Several distinct returned values hold it (``return total, ce`` where
  ``total = ce + kl``): which one a training loop would call ``backward()`` on
  cannot be told, so the call is refused, naming them; wrapping the one to
  train in ``identity_loss(value, reduction="mean")`` makes it the final loss.

PopTorch on an IPU backpropagates only the loss function's output: it lowers a
torch loss to a PopART loss, and what follows is not differentiated. Where the
returned value trains differently from the loss function's output (more than a
view, copy or cast of it), the log says so once, naming the user's line, so
that a program meant for both wraps it in ``identity_loss``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_slot

from ..errors import (LossError, PoptorchLiteWarning, first_time,
                      hide_when_refused as __tracebackhide__, warn_once)
from .subgraphs import aliases
from .trace_modes import node_line, node_source, user_caller

_LOG = logging.getLogger("poptorch_lite")


def final_loss(losses: list) -> fx.Node:
    """The one loss that feeds no other loss ([Note: loss provenance]); only those that can
    carry a gradient count, unless none can."""
    marked = list(dict.fromkeys(n for n in losses if isinstance(n, fx.Node)))
    candidates = [n for n in marked if n.meta.get("requires_grad", True)] or marked
    ancestors: dict = {}

    def upstream(n: fx.Node) -> set:
        if n not in ancestors:
            seen, stack = set(), list(n.all_input_nodes)
            while stack:
                m = stack.pop()
                if m not in seen:
                    seen.add(m)
                    stack.extend(m.all_input_nodes)
            ancestors[n] = seen
        return ancestors[n]

    final = [c for c in candidates if not any(c in upstream(d) for d in candidates if d is not c)]
    if not final:
        raise LossError("Couldn't find a loss in graph! A training model must compute its loss "
                        "with a torch loss function (F.cross_entropy, nn.MSELoss, ...) or mark "
                        "it with poptorch_lite.identity_loss(x, reduction)")
    if len(final) > 1:
        lines = "; ".join(node_line(c) for c in final)
        raise LossError(f"Multiple independent losses found in graph. Graph must have one final "
                        f"loss. Wrap final graph loss in poptorch.identity_loss, e.g. "
                        f"identity_loss(l1 + l2, reduction='none'). The {len(final)} losses: "
                        f"{lines}")
    return final[0]


# Ops that leave a loss's gradient as it is: what PopTorch would train the same.
_SAME_GRADIENT = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.squeeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.flatten.using_ints})


def trained_loss(loss: fx.Node, outputs: list) -> fx.Node:
    """The returned value that trains: the one whose gradient holds ``loss``, else ``loss``
    ([Note: the trained loss]).

    Raises:
        LossError: several distinct returned values hold the loss's gradient.
    """
    holders = list(dict.fromkeys(o for o in outputs if isinstance(o, fx.Node)
                                 and loss in o.meta.get("trains", ())))
    if not holders:
        return loss
    if len(holders) > 1:
        lines = "; ".join(node_line(h) for h in holders)
        raise LossError(
            f"{len(holders)} returned values carry the gradient of the loss "
            f"({node_line(loss)}): {lines}. A training loop would call backward() on one of "
            f"them, and which one cannot be told: wrap the value to train in "
            f"poptorch.identity_loss(value, reduction='mean') (or return only it with a "
            f"gradient: detach the others)")
    trained = holders[0]
    step = trained
    while step is not loss and step.target in _SAME_GRADIENT and step.all_input_nodes:
        step = step.all_input_nodes[0]
    if step is not loss:
        source = node_source(trained)
        at = f"{source[0]}:{source[1]}" if source else str(trained.target)
        if first_time(f"loss.trained:{at}"):
            _LOG.warning(
                "the loss the model returns (%s) is computed from the loss function's output "
                "(%s): poptorch_lite trains on the returned value, as plain PyTorch's "
                "loss.backward() would, but PopTorch on an IPU backpropagates only the loss "
                "function's output. Wrap the returned value in poptorch.identity_loss(value, "
                "reduction='mean') for both to train alike", node_line(trained), node_line(loss))
    return trained


def note_trained(outputs: list, marked: list, tracer) -> None:
    """Note on each output's node the losses whose gradient it carries ([Note: the trained
    loss]): ``meta["trains"]``, the loss nodes of ``marked`` (``(node,
    grad_fn)`` at the time each was marked) whose autograd node the output's graph reaches.
    Read off the traced micro-batch's own autograd graph, so a ``detach``, a ``no_grad``
    region, a custom Function's backward or a hook decide it as they would in a backward."""
    if not marked:
        return
    for t in outputs:
        proxy = get_proxy_slot(t, tracer, None)
        if proxy is None:
            continue
        node = proxy.proxy.node
        reached = _autograd_nodes(t.grad_fn) if t.requires_grad else set()
        node.meta["trains"] = frozenset(
            n for n, fn in marked if n is node or (fn is not None and fn in reached))


def _autograd_nodes(fn) -> set:
    """Every node of autograd's graph that ``fn`` reaches (``fn`` included)."""
    seen, stack = set(), [fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        stack.extend(g for g, _ in f.next_functions)
    return seen


def warn_if_not_returned(loss: fx.Node, returned: set) -> None:
    """Warn once when the model computes its loss but returns no value of it (it still
    trains on it)."""
    if any(aliases(n, loss) for n in returned):
        return
    source = node_source(loss)  # the warning points at the line of the loss
    warn_once("loss.not_returned",
              f"the training model computes its loss"
              f"{f' ({source[2]})' if source else ''} but does not return it: it trains on "
              f"it, but you cannot watch it; return it from forward (e.g. return output, "
              f"loss)", PoptorchLiteWarning, at=source[:2] if source else user_caller())
