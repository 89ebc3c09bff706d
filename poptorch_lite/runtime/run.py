"""The state of one run of a schedule: its inputs, values and gradients per micro-batch.

The executor makes one per run; ``stage_work`` fills its values and keeps its own state in it
(``WorkState``, whose stashes hold :class:`Entry`: [Note: activation stash] in
``stage_work``), as the channels keep their messages (``Messages``); :class:`RunStats` is what
a run measured.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional, Sequence

import torch


@dataclasses.dataclass
class RunStats:
    """What one run measured ([Note: activation stash]): per stage, peak stash depth and bytes;
    how it ran."""

    peak_stash_depth: list
    peak_stash_bytes: list
    # A run of a step graph ([Note: step graphs] in ``step_graph``): "captured" (its first
    # replay) or "replayed"; None: run eagerly, action by action.
    graph: Optional[str] = None


class Entry:
    """One micro-batch in a stage's stash ([Note: activation stash])."""

    __slots__ = ("i", "boundary", "segments", "args", "kept", "buffers", "rng", "nbytes", "later")

    def __init__(self, i: int, boundary: dict):
        self.i = i
        self.boundary = boundary   # value name -> the leaf this stage computed from
        self.segments = None       # [(outputs, output names, {name: leaf})], in forward order
        self.args = None           # recomputation: the forward's arguments
        self.kept = None           # recomputation: value name -> (tensor, requires_grad)
        self.buffers = None        # recomputation: written buffer or argument -> its value before
        self.rng = None            # recomputation: the random state the forward started from
        self.nbytes = 0
        self.later = None          # split backward: per segment, what its W needs


class Run:
    """The state of one run of a schedule: its inputs, the values and gradients per micro-batch,
    and what it returns. The stage work's state (stashes, accumulators, byte counts) and the
    messages to other processes are owned by those who keep them, and ride along: ``work``
    (``stage_work.WorkState``) and ``messages`` (``channels.Messages``, None when every stage
    runs here)."""

    __slots__ = ("inputs", "placed", "ready", "replica_of", "rng", "values", "grads", "results",
                 "index", "training", "kept", "keeps", "ahead", "edited", "work", "messages")

    def __init__(self, microbatches: Sequence[Sequence[torch.Tensor]], replica_of: Callable,
                 streams: Optional[list], work, messages=None, index: int = 0,
                 training: bool = True, kept: Sequence[int] = (), ahead: Optional[dict] = None):
        M = len(microbatches)
        self.inputs = microbatches
        self.placed: dict = {}                             # (ipu, i, k) -> input k in ipu's memory
        self.ready: dict = {}                              # (device, i) -> CUDA event: copied
        self.replica_of = replica_of
        self.rng = streams                                 # per micro-batch, or None
        # per micro-batch (dict(()) is {}: made without a comprehension's frame, a call's
        # setup runs cold: [Note: one setup per call] in ``plan``)
        self.values = list(map(dict, itertools.repeat((), M)))   # value name -> tensor
        self.grads = list(map(dict, itertools.repeat((), M)))    # value name -> gradient
        self.results = list(map(dict, itertools.repeat((), M)))  # returned values, detached
        self.index, self.training = index, training  # the run's number in its call; its kind
        self.kept = kept          # the micro-batches whose outputs the call returns
        self.keeps = frozenset(kept)
        self.ahead = ahead or {}  # action -> the next action of its stream that receives
        self.edited: dict = {}    # (i, k) -> micro-batch i's argument k, edited by a stage
        self.work = work          # the stage work's state in this run
        self.messages = messages  # this run's messages to other processes, or None
