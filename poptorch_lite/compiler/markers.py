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
  ``identity_loss``);
- ``mark_checkpoint(x)``: ``x`` is a recomputation checkpoint.
- ``print_tensor(x, title)`` is not a marker: it stays in the stage graph and
  prints ``x`` each time the stage runs (``ipu_print_tensor``).

[Note: trace context]
``trace_context()`` is the one switch between "plain PyTorch" and "being
traced"; only the partition enters it, for the duration of one trace. It holds
the auto-id counter of id-less blocks, which restarts at every trace, so the
same model always traces to the same block ids. It lives here, below the
annotations that read it, so that ``print_tensor`` can ask it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional

import torch
import torch.nn.functional as F

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
