"""Balance by measured time: the ``BeginBlock`` points that make S stages take even time.

``balance_by_time(model, *inputs, stages=S)`` times each layer of ``model`` on
its sample inputs (forward and backward), splits the layers into S runs of
consecutive layers whose largest total time is the least it can be (torchgpipe's
``balance_by_time`` does the same for an ``nn.Sequential``), prints the plan with
each stage's expected time, and applies it on request (``BeginBlock`` at each
stage's first layer, through :func:`~poptorch_lite.frontends.splits.split_at`).

[Note: balance by time]
The layers are the children of an ``nn.Sequential``, else the entries of the
model's longest ``ModuleList`` / ``Sequential`` (a transformer's blocks), or the
modules named. One step of the whole model is timed, ``repeats`` times after a
warm-up: a forward pre-hook stamps each layer's start, and a gradient hook on
each layer's input stamps the end of its backward. Layer k's time is from its
start to the next layer's (its forward, and whatever runs between the two) plus
its share of the backward; what runs before the first layer (embeddings) counts
with it, what runs after the last (the head, the loss) with the last. Each
figure is the median over the repeats. The model is left as it was: gradients,
buffers and the random state are put back.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import BlockError
from .dry_run import _state_restored
from .splits import split_at


@dataclasses.dataclass
class BalancePlan:
    """A proposed split: per layer its name and measured seconds; the first layer of each stage.

    Example:
        >>> plan = BalancePlan(["a", "b", "c"], [1.0, 1.0, 2.0], [0, 2])
        >>> plan.stage_times
        [2.0, 2.0]
        >>> print(plan)
        stage | first layer | layers | expected time
        ------+-------------+--------+--------------
            0 | a           |      2 |  2000.000 ms
            1 | c           |      1 |  2000.000 ms
        slowest stage 2000.000 ms; ideal (total / S) 2000.000 ms
    """

    layers: list
    seconds: list
    starts: list

    @property
    def stage_times(self) -> list:
        ends = self.starts[1:] + [len(self.layers)]
        return [sum(self.seconds[a:b]) for a, b in zip(self.starts, ends)]

    @property
    def begin_blocks(self) -> list:
        """The layers where stages 1..S-1 begin (``split_at``'s names)."""
        return [self.layers[k] for k in self.starts[1:]]

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Annotate ``model``: stage s (IPU s) begins at its first layer (removes old blocks)."""
        return split_at(model, self.begin_blocks)

    def __str__(self) -> str:
        ends = self.starts[1:] + [len(self.layers)]
        w = max(len("first layer"), *(len(self.layers[k]) for k in self.starts))
        lines = [f"stage | {'first layer'.ljust(w)} | layers | expected time",
                 f"------+-{'-' * w}-+--------+--------------"]
        for s, (a, b, t) in enumerate(zip(self.starts, ends, self.stage_times)):
            lines.append(f"{s:>5} | {self.layers[a].ljust(w)} | {b - a:>6} | {t * 1e3:>9.3f} ms")
        ideal = sum(self.seconds) / len(self.starts)
        lines.append(f"slowest stage {max(self.stage_times) * 1e3:.3f} ms; ideal (total / S) "
                     f"{ideal * 1e3:.3f} ms")
        return "\n".join(lines)


def partition_even(seconds: Sequence[float], stages: int) -> list:
    """The first index of each of ``stages`` runs of consecutive items, the largest run sum
    as small as it can be (dynamic programming; ties keep earlier stages lighter).

    Example:
        >>> partition_even([1, 1, 1, 3], 2)
        [0, 3]
    """
    n = len(seconds)
    prefix = [0.0]
    for t in seconds:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[j][k]: the least largest sum of j runs over the first k items; cut[j][k]: last run's start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for k in range(j, n + 1):
            for a in range(j - 1, k):
                cost = max(best[j - 1][a], prefix[k] - prefix[a])
                if cost < best[j][k]:
                    best[j][k], cut[j][k] = cost, a
    starts, k = [], n
    for j in range(stages, 0, -1):
        k = cut[j][k]
        starts.append(k)
    return starts[::-1]


def _layers(model: torch.nn.Module, layers) -> list:
    """(name, module) of the layers to cut between ([Note: balance by time])."""
    names = {m: n for n, m in model.named_modules()}
    if layers is not None:
        found = dict(model.named_modules())
        mods = [found.get(n) if isinstance(n, str) else n for n in layers]
        missing = [n for n, m in zip(layers, mods) if m is None or m not in names]
        if missing:
            raise BlockError(f"balance_by_time: no layer named {missing[0]!r}; the layers "
                             f"are {[n for n in found if n]}")
    elif isinstance(model, torch.nn.Sequential):
        mods = list(model.children())
    else:
        lists = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList,
                                                               torch.nn.Sequential))]
        mods = list(max(lists, key=len, default=[]))
    return [(names[m], m) for m in mods]


def balance_by_time(model: torch.nn.Module, *inputs, stages: int, layers=None,
                    repeats: int = 3, apply: bool = False, verbose: bool = True) -> BalancePlan:
    """Time each layer of ``model`` on ``inputs`` and propose the stages that even out time.

    Args:
        model: the model (not wrapped); inputs: one call's sample arguments (one
            micro-batch, on the device the stages will run on).
        stages: S.
        layers: the layers (names or modules, in call order) to cut between; default
            an ``nn.Sequential``'s children or the longest ``ModuleList``.
        repeats: timed steps after one warm-up; each layer's time is the median.
        apply: annotate ``model`` with the plan (``BalancePlan.apply``).
        verbose: print the plan.

    Returns:
        The :class:`BalancePlan`.

    Raises:
        BlockError: fewer layers than stages, a layer name unknown, or a layer that
            the model does not call.

    Example:
        >>> seq = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        >>> plan = balance_by_time(seq, torch.ones(2, 4), stages=2, verbose=False)
        >>> len(plan.starts), plan.layers
        (2, ['0', '1', '2', '3'])
    """
    named = _layers(model, layers)
    if len(named) < stages or stages < 1:
        raise BlockError(f"balance_by_time: {len(named)} layers cannot make {stages} stages; "
                         f"pass layers=[...] naming at least {stages} modules, or fewer stages")
    runs = [_time_step(model, inputs, [m for _, m in named]) for _ in range(repeats + 1)][1:]
    seconds = [statistics.median(r[k] for r in runs) for k in range(len(named))]
    plan = BalancePlan([n for n, _ in named], seconds, partition_even(seconds, stages))
    if verbose:
        print(plan)
    if apply:
        plan.apply(model)
    return plan


def _time_step(model: torch.nn.Module, inputs: tuple, mods: list) -> list:
    """One forward and backward of ``model``: per layer, its seconds; the model left as it was."""
    L, clock = len(mods), time.perf_counter
    fwd, bwd = [None] * L, [None] * L
    sync = torch.cuda.synchronize if any(
        isinstance(t, torch.Tensor) and t.is_cuda for t in pytree.tree_leaves(inputs)) else None

    def stamp():
        if sync is not None:
            sync()
        return clock()

    def pre(k):
        def hook(_module, args, kwargs=None):
            if fwd[k] is None:
                fwd[k] = stamp()
                x = next((t for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
                if x is not None:
                    x.register_hook(lambda g: bwd.__setitem__(k, stamp()))
        return hook

    grads = {p: p.grad for p in model.parameters()}
    saved = [(m, {n: b.detach().clone() for n, b in m.named_buffers(recurse=False)})
             for m in model.modules()]
    handles = [m.register_forward_pre_hook(pre(k), with_kwargs=True) for k, m in enumerate(mods)]
    try:
        with _state_restored(saved), torch.enable_grad():
            start = stamp()
            out = model(*inputs)
            scalar = sum(t.float().sum() for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.requires_grad)
            forward_end = stamp()
            if isinstance(scalar, torch.Tensor):
                scalar.backward()
            end = stamp()
    finally:
        for h in handles:
            h.remove()
        for p, g in grads.items():
            p.grad = g
    if any(t is None for t in fwd):
        raise BlockError(f"balance_by_time: the model did not call layer "
                         f"{fwd.index(None)} on these inputs; pass layers=[...] it calls")
    starts = fwd + [forward_end]
    seconds = [starts[k + 1] - starts[k] for k in range(L)]
    seconds[0] += fwd[0] - start                     # embeddings: with the first layer
    done = forward_end  # where the backward of the layers after k ended
    for k in reversed(range(L)):  # layer k's backward ends when its input's gradient is made
        if bwd[k] is not None:
            seconds[k] += bwd[k] - done
            done = bwd[k]
    seconds[0] += end - done  # the embeddings' (and an input without gradient's) backward
    return seconds
