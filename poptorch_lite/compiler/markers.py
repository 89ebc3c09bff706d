"""Marker ops: how annotations appear as nodes of a traced graph.

Tracing records every op that runs; these ops do nothing at run time, but they
leave a node in the graph at the point where the user's code called them (as
``torch.distributed.pipelining``'s ``pipe_split()`` does), so the partition
reads block boundaries, the loss and recomputation checkpoints from the graph
itself.

- ``begin_block(user_id, ipu_id)``: ops after this node belong to the block
  (``ipu_id`` -1 when the block names no IPU);
- ``end_block()``: a ``Block`` scope closed; no block is active until the next;
- ``mark_loss(x)``: ``x`` is a loss (the output of a torch loss function or of
  ``identity_loss``); :func:`mark_loss` also tells the trace where the value sits in
  autograd's graph ([Note: the trained loss] in ``losses``);
- ``mark_checkpoint(x)``: ``x`` is a recomputation checkpoint.
- ``print_tensor(x, title)`` is not a marker: it stays in the stage graph and
  prints ``x`` each time the stage runs (``ipu_print_tensor``).

[Note: trace context]
``trace_context()`` is the one switch between "plain PyTorch" and "being
traced"; only the partition enters it, for the duration of one trace. It holds
the auto-id counter of id-less blocks, which restarts at every trace, so the
same model always traces to the same block ids. It lives here, below the
annotations that read it, so that ``print_tensor`` can ask it too. A training
trace also records on its nodes the grad mode each op ran in and whether the
values the model saw required grad (``training_records``: [Note: gradients the
forward shapes] in ``grad_semantics``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils import _pytree as pytree

_lib = torch.library.Library("poptorch_lite", "DEF")
_lib.define("begin_block(str user_id, int ipu_id) -> ()")
_lib.define("end_block() -> ()")
_lib.define("mark_loss(Tensor x) -> ()")
_lib.define("mark_checkpoint(Tensor x) -> ()")
_lib.define("print_tensor(Tensor x, str title) -> ()")


# Every torch loss function: its output is a loss by provenance ([Note: loss provenance]).
LOSS_FUNCTIONS = frozenset(
    getattr(F, name) for name in dir(F)
    if name.endswith("_loss") or name in {"cross_entropy", "kl_div", "binary_cross_entropy",
                                           "binary_cross_entropy_with_logits"})


# -- the trace context ([Note: trace context]) ------------------------------------------

@dataclasses.dataclass
class _TraceState:
    active: bool = False
    next_auto_id: int = 0
    current_block: Optional[str] = None  # for stage summaries only; the graph is the truth
    on_loss: Optional[Callable] = None  # told of each loss marked: [Note: the trained loss]


_state = threading.local()


def _current() -> _TraceState:
    if not hasattr(_state, "value"):
        _state.value = _TraceState()
    return _state.value


@contextlib.contextmanager
def trace_context():
    """Mark the current thread as tracing a wrapped model (used by the partition)."""
    previous = _current()
    _state.value = _TraceState(active=True)
    try:
        yield _state.value
    finally:
        _state.value = previous


def is_tracing() -> bool:
    """True while a wrapper traces a model on this thread."""
    return _current().active


def _nothing(*args):
    return None


def _print(x, title):
    if not is_tracing():  # the trace runs the forward once; only real runs print
        print(f"{title}{x}" if title else x)


for _name in ("begin_block", "end_block", "mark_loss", "mark_checkpoint"):
    _lib.impl(_name, _nothing, "CompositeExplicitAutograd")
_lib.impl("print_tensor", _print, "CompositeExplicitAutograd")

ops = torch.ops.poptorch_lite
BEGIN_BLOCK = ops.begin_block.default
END_BLOCK = ops.end_block.default
MARK_LOSS = ops.mark_loss.default
MARK_CHECKPOINT = ops.mark_checkpoint.default
PRINT_TENSOR = ops.print_tensor.default
MARKERS = frozenset({BEGIN_BLOCK, END_BLOCK, MARK_LOSS, MARK_CHECKPOINT})


def mark_loss(x: torch.Tensor) -> None:
    """Mark ``x`` as a loss in the graph being traced ([Note: loss provenance] in
    ``losses``), and tell the trace (``_TraceState.on_loss``) where it sits in autograd's
    graph, which decides the returned value that trains ([Note: the trained loss])."""
    MARK_LOSS(x)
    state = _current()
    if state.on_loss is not None:
        state.on_loss(x)


# -- what a training trace records on its nodes ------------------------------------------
# ([Note: gradients the forward shapes] in ``grad_semantics``: grad mode, requires grad)

_training = threading.local()  # this thread's training trace: .active, .grad_mode


@contextlib.contextmanager
def _this_thread(attribute: str, value):
    """``_training.<attribute>`` set to ``value`` while inside, then what it was."""
    outer = getattr(_training, attribute, None)
    setattr(_training, attribute, value)
    try:
        yield
    finally:
        setattr(_training, attribute, outer)


def training_records():
    """Mark this thread as recording a training trace (``grad_semantics.recording``)."""
    return _this_thread("active", True)


def grad_mode_recorded(enabled: bool):
    """Record the ops run inside as run with grad mode ``enabled`` (autograd runs a custom
    op's Function without grad; the op replays in its caller's grad mode)."""
    return _this_thread("grad_mode", enabled)


def training_tracer():
    """The tracer recording this thread's training trace, or None."""
    if not getattr(_training, "active", False):
        return None
    mode = get_proxy_mode()
    return mode.tracer if mode is not None else None


def record_requires_grad(out) -> None:
    """Note on the nodes of ``out``'s traced tensors whether they required grad."""
    tracer = training_tracer()
    if tracer is None:
        return
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            proxy = get_proxy_slot(t, tracer, None)
            if proxy is not None:
                proxy.proxy.node.meta["requires_grad"] = t.requires_grad


def record_grad_mode(tracer) -> None:
    """Make ``tracer`` note on each op node whether grad mode was on when it ran."""
    create_node = tracer.create_node

    def create(kind, target, *args, **kwargs):
        node = create_node(kind, target, *args, **kwargs)
        if kind == "call_function":
            mode = getattr(_training, "grad_mode", None)
            node.meta["grad_enabled"] = torch.is_grad_enabled() if mode is None else mode
        return node
    tracer.create_node = create
