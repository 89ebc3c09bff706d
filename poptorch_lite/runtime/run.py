"""The state of one run of a schedule: values, stashes and gradients per micro-batch.

``stage_work`` fills it ([Note: activation stash] in ``stage_work``); the executor
makes one per run and reads its ``RunStats``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence

import torch

from ..compiler.partition import Partition


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
    """The state of one run of a schedule: values, stashes and gradients per micro-batch."""

    __slots__ = ("inputs", "placed", "ready", "replica_of", "rng", "values", "grads", "results",
                 "stash", "stash_bytes", "waiting", "accum", "stats", "excluded", "inbox", "outbox",
                 "shapes", "sends", "posted", "failed", "remote_failure", "index", "training",
                 "kept", "keeps", "ahead", "edited")

    def __init__(self, partition: Partition, microbatches: Sequence[Sequence[torch.Tensor]],
                 replica_of: Callable, streams: Optional[list], index: int = 0,
                 training: bool = True, kept: Sequence[int] = (), ahead: Optional[dict] = None):
        S, M = len(partition.stages), len(microbatches)
        self.inputs = microbatches
        self.placed: dict = {}                             # (ipu, i, k) -> input k in ipu's memory
        self.ready: dict = {}                              # (device, i) -> CUDA event: copied
        self.replica_of = replica_of
        self.rng = streams                                 # per micro-batch, or None
        self.values = [{} for _ in range(M)]              # value name -> tensor, per micro-batch
        self.grads = [{} for _ in range(M)]               # value name -> gradient, per micro-batch
        self.results = [{} for _ in range(M)]             # returned values, detached
        self.stash = [collections.deque() for _ in range(S)]
        self.stash_bytes = [0] * S                         # the bytes each stash holds now
        self.waiting = [collections.deque() for _ in range(S)]  # entries between I and W
        self.accum: dict = {}                              # param name -> (tensor, accumulator)
        self.stats = RunStats([0] * S, [0] * S)
        self.excluded: set = _NOTHING                      # storages not counted as stash
        # [Note: stages in other processes] in distributed
        self.inbox: dict = {}     # (stage, i) -> {value name: tensor} from another process
        self.outbox: dict = {}    # (stage, i) -> {value name: gradient} for another process
        self.shapes: dict = {}    # (stage, i, name) -> the shape of a received dynamic value
        self.sends: list = []     # (work, tensor, peer, what) of the messages sent, until received
        self.posted: dict = {}    # action -> the receives posted for it ahead of time
        self.failed = None        # (action, exception): the first action that raised here
        self.remote_failure = None  # (rank, description): a process that failed this run
        self.index, self.training = index, training  # the run's number in its call; its kind
        self.kept = kept          # the micro-batches whose outputs the call returns
        self.keeps = frozenset(kept)
        self.ahead = ahead or {}  # action -> the next action of its stream that receives
        self.edited: dict = {}    # (i, k) -> micro-batch i's argument k, edited by a stage


_NOTHING: frozenset = frozenset()
