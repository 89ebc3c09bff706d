"""The optimizer state sharded over the replicas (ZeRO-1): PopTorch's replicated tensor sharding.

[Note: sharded optimizer state]
``opts.TensorLocations.setOptimizerLocation(TensorLocationSettings()
.useReplicatedTensorSharding(True))`` with N > 1 data-parallel processes gives each
process 1/N of the optimizer state of every parameter it steps: the N are the
processes that run the same stages (all of them without ``set_ipu_processes``;
with it, the "replica" dimension of the layout's mesh, one process per pipeline).
Parameter p, flattened to L elements, is cut into N chunks of c = ceil(L/N)
elements; process k (its rank among the N) owns elements [k·c, min(L, (k+1)·c)).
Each optimizer step:

1. the gradients are reduce-scattered (``reduce_scatter_single``: a weight of
   1 MB or more that N divides evenly on its own, from its gradient; the others
   through one buffer per dtype and device holding every chunk, padded to c): process
   k gets the sum over the processes of its own chunks, divided by N for
   ``ReductionType.Mean``, as the all-reduce gives every process the whole sum (bucket
   by bucket while the backward runs, where it can: [Note: overlapped all-reduce] in
   ``overlap``);
2. automatic loss scaling's check for non-finite gradients and the clipping norm
   are taken over the chunks: each process adds its chunks' squares per
   parameter, one all-reduce sums them, and the norm of the per-parameter
   norms is ``clip_grad_norm_``'s (the same within fp32 rounding; over a
   pipeline's processes, ``Channels.clip_coefficient`` combines them);
3. the user's optimizer steps the chunks: for the step its ``param_groups`` hold
   one tensor per chunk (the parameter's current values there, with the chunk
   of the gradient) and its ``state`` is keyed by them, so the state it makes is
   chunk-sized; afterwards the groups and the state are the parameters' again;
4. the new values are all-gathered (``all_gather_single``) into every
   process's parameters (a large weight straight into itself). Each element is then
   what its owner stepped, in every process: a weight the forward writes in place,
   each process its own way (an ``Embedding(max_norm=...)``'s renormalised rows), is
   left with the owners' values, as torch's ``ZeroRedundancyOptimizer`` leaves it,
   where DDP leaves each process its own (the fuzzer's oracle does the same).

A reduce-scatter and an all-gather send (N-1)/N of the padded gradients each: an
all-reduce's bytes, plus the padding. This is right only for optimizers whose
update of an element reads that element alone (its gradient and state) and
scalars: of the optimizers ``trainingModel`` accepts, torch's SGD, Adam, AdamW and
RMSprop, and poptorch_lite.optim's (the classes themselves: a subclass may change
the update, and is not sharded, with one warning).
LAMB's trust ratio is the norm of each whole weight and of its whole update: LAMB
steps its chunks and asks for those norms, summed from every process's chunks
([Note: LAMB on chunks] in ``optim/rules.py``; within fp32 rounding of the
unsharded norms; with float16 moments the rounding of a moment can differ by one
float16 ulp, which later steps carry into the weights: 1.6e-5 after 5 steps in the
tests). An optimizer state
the size of the parameter (one loaded from an unsharded checkpoint, or by
``load_state_dict``) is cut to the chunk at the next step. With the parameter's
whole state gone, ``optimizer.state_dict()`` holds this process's chunks;
``save_checkpoint`` writes each process's chunks beside the checkpoint, or in its
part where a pipeline spans processes ([Note: checkpoints] in ``checkpoint``).
The whole reduced gradient is in no process either: each weight's ``.grad`` holds the
process's own gradient after the step, except where ``Options.anchorTensor`` anchors it
(``Gradient___<name>``, the gradient the step used): those chunks are all-gathered at
each step, an all-gather of their buckets more.
Each chunked state says whose chunks it holds (the key :data:`CHUNK`: the process, N and
the elements), and travels with ``optimizer.state_dict()``. Graphcore's BERT saves
``optimizer.state_dict()`` on instance 0 alone and every instance loads that file: instance
1 would step instance 0's momenta, silently where the chunks have the same size. So each
training call first checks, in every process, that the chunks it holds are its own, and
the processes agree on it (one all-reduce of N flags a call): otherwise every process
refuses the call before anything runs (E-OPTIM-14), naming the processes and the fix
(``save_checkpoint`` writes every process's chunks; a whole state loads anywhere).
The user's optimizer cannot step on the host while its state holds chunks: its
``step()`` is refused (E-OPTIM-13, a step pre-hook, :func:`refuse_host_steps`) before it
changes anything, where torch would fail on the shapes or, for a chunk that broadcasts,
step wrong.
The optimizer's step hooks read and write whole weights in plain PyTorch (a post-hook that
clips every weight after the step, as WGAN's critic is clipped): its post-hooks, and torch's
global ones, run after the gather (``Shards.step_whole``), where inside the chunks' step a
write to a weight would be overwritten by the gather. A pre-hook would see chunks, or the
process's own unreduced gradients, where plain PyTorch's sees each whole reduced gradient:
each training call refuses one, in every process alike, with the check above (E-OPTIM-15).
So does a parameter whose gradient is sparse (E-OPTIM-16): its chunk would be cut from a dense
sum, where plain PyTorch's optimizer steps the sparse gradient or refuses it.
Within one process the replicas (``replicationFactor``) already share one copy of
the state: N counts processes.
"""

from __future__ import annotations

import collections
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer  # its global step hooks

from ..errors import OptimizerError
from ..optim import optimizers as poptorch_optim
from ..runtime.channels import clip_coefficient

#: The key, in a parameter's optimizer state that holds chunks, of whose chunks they are:
#: ``(process, N, start, end)``, the elements [start, end) of the flattened weight that
#: process ``process`` of ``N`` steps ([Note: sharded optimizer state]).
CHUNK = "poptorch_lite.chunk"

# The optimizers trainingModel accepts, by their exact classes (a subclass may change the
# update): element-wise ones, and LAMB, which asks for its whole norms.
SHARDABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
             poptorch_optim.SGD, poptorch_optim.Adam, poptorch_optim.AdamW,
             poptorch_optim.RMSprop, poptorch_optim.LAMB)
# torch 2.14 renamed the tensor forms of the two collectives (the old names warn)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shardable(optimizer) -> bool:
    """Whether ``optimizer`` can step chunks of weights ([Note: sharded optimizer state]):
    its update of an element reads that element alone, or it is LAMB, which asks for its
    whole norms ([Note: LAMB on chunks] in ``optim/rules.py``).

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> shardable(torch.optim.Adam(net.parameters())), shardable(
        ...     poptorch_optim.LAMB(net.parameters())), shardable(
        ...     type("Mine", (torch.optim.SGD,), {})(net.parameters(), lr=0.1))
        (True, True, False)
    """
    return type(optimizer) in SHARDABLE


class Shards:
    """This process's chunks of the stepped parameters, their gradients and their state.

    Args:
        group: () -> the group of the N processes that share the state (None: all of
            them); asked at each collective, since the group is made when the processes join.
        rank, size: this process's rank among them, and N.
        collective: ``(what, fn, *args, **kwargs)`` -> runs a collective, its result (a
            work where asynchronous), raising the processes' error on failure.
        alone: a weight of this many bytes or more that N divides evenly is communicated
            on its own, in place; the others together, through one buffer per dtype.
        anchored: the names of the parameters whose gradients are anchored
            (``Gradient___<name>``), gathered whole at each step (:meth:`gather_grads`).
    """

    def __init__(self, group, rank: int, size: int, collective: Callable,
                 alone: float = math.inf, anchored: frozenset = frozenset()):
        self._group, self.rank, self.size, self.alone = group, rank, size, alone
        self.anchored = anchored
        self._collective = collective
        self._chunks: dict = {}   # id(parameter) -> its chunk tensor (the optimizer steps it)
        self._layout: list = []   # (parameters, dtype, device, chunk sizes, offsets, width)
        self._grads: list = []    # per layout entry: the reduced chunks of the gradients
        self.sent_bytes = 0       # what the collectives of the last step sent from here

    def _spans(self, p: torch.Tensor, c: int) -> tuple:
        """``(start, end)`` of this process's chunk of ``p`` (chunks of ``c`` elements)."""
        start = min(self.rank * c, p.numel())
        return start, min(start + c, p.numel())

    def check_state(self, optimizer: torch.optim.Optimizer, sparse: frozenset = frozenset()
                    ) -> None:
        """Refuse a state of chunks that are not this process's (E-OPTIM-14), a step pre-hook
        (E-OPTIM-15) and parameters whose gradients are sparse (``sparse``, their names:
        E-OPTIM-16), in every process alike: one all-reduce of three flags per process
        ([Note: sharded optimizer state])."""
        N, foreign, hooked = self.size, self._foreign(optimizer), pre_hooks(optimizer)
        flags = torch.zeros(3 * N, dtype=torch.int32)
        flags[self.rank] = foreign is not None
        flags[N + self.rank] = bool(hooked)
        flags[2 * N + self.rank] = bool(sparse)
        self._collective("agreeing that each process holds its own chunks of the state",
                         dist.all_reduce, flags, group=self._group())
        if not flags.any():
            return
        if flags[2 * N:].any():
            raise OptimizerError(
                f"the optimizer's state is sharded over {N} processes (useReplicatedTensor"
                f"Sharding(True)), and the gradients of "
                f"{', '.join(map(repr, sorted(sparse))) or 'some parameters in another process'}"
                f" are sparse (an embedding with sparse=True): each process steps a chunk of "
                f"every weight, cut from the dense sum of its gradient, where plain PyTorch's "
                f"optimizer steps the sparse gradient (or refuses it, as Adam does). Use a "
                f"dense embedding (sparse=False), or train without useReplicatedTensorSharding")
        if flags[N:2 * N].any():
            hooking = [k for k, f in enumerate(flags[N:2 * N].tolist()) if f]
            raise OptimizerError(
                f"the optimizer's state is sharded over {N} processes (useReplicatedTensor"
                f"Sharding(True)), and process{'es' if len(hooking) > 1 else ''} {hooking} "
                f"ha{'ve' if len(hooking) > 1 else 's'} a step pre-hook "
                f"({', '.join(hooked) if hooked else 'not this one'}): each process steps "
                f"only its chunk of every weight, with its chunk of the reduced gradient, "
                f"so a pre-hook would see chunks, or this process's own gradients, where in "
                f"plain PyTorch it sees each weight's whole gradient. Remove the hook (scale "
                f"the loss, or clip with the optimizer's max_grad_norm), or train without "
                f"useReplicatedTensorSharding")
        flags = flags[:N]
        bad = [k for k, f in enumerate(flags.tolist()) if f]
        if foreign is not None:
            g, i, held, (k, _, start, end) = foreign
            whose = "chunks of unknown origin" if not isinstance(held, tuple) or len(held) != 4 \
                else f"the chunk of process {held[0]} of {held[1]} (elements {held[2]}..{held[3]})"
            detail = (f"here, in process {k}, param group {g}, parameter {i} holds {whose}, "
                      f"where this process steps elements {start}..{end}")
        else:
            detail = f"this process, {self.rank}, holds its own"
        raise OptimizerError(
            f"the optimizer's state is sharded over {N} processes (useReplicatedTensorSharding"
            f"(True)), and process{'es' if len(bad) > 1 else ''} {bad} hold{'' if len(bad) > 1 else 's'} "
            f"chunks of it that are not {'their' if len(bad) > 1 else 'its'} own ({detail}): an "
            f"optimizer.state_dict() holds the chunks of the process that saved it alone, so "
            f"loading one process's into every process would step the others with the wrong "
            f"state. Save with poptorch.save_checkpoint(path, model) in every process and resume "
            f"with poptorch.load_checkpoint(path, model) (every process's chunks, at any layout), "
            f"or load a whole state (one saved without useReplicatedTensorSharding)")

    def _foreign(self, optimizer: torch.optim.Optimizer) -> Optional[tuple]:
        """The first parameter whose state holds chunks that are not this process's:
        ``(group, index, whose they say they are, this process's (rank, N, start, end))``."""
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                state = optimizer.state.get(p)
                if state and _chunked(state, p):
                    mine = (self.rank, self.size,
                            *self._spans(p, math.ceil(p.numel() / self.size)))
                    if state.get(CHUNK) != mine:
                        return g, i, state.get(CHUNK), mine
        return None

    def reduce_scatter(self, params: list, divisor: int) -> None:
        """Sum each gradient over the processes, this process keeping its chunk (step 1)."""
        self.land([self.launch(ps) for ps in self.buckets(params, _by_kind)], divisor)

    def buckets(self, params: list, make_buckets) -> list:
        """``params`` in buckets by ``make_buckets`` (``processes._buckets``), with each
        weight that is not communicated alone (:meth:`_alone`) in a bucket of the small
        ones: what the overlapped reduce-scatter launches ([Note: overlapped all-reduce] in
        ``overlap``)."""
        small = [p for p in params if not self._alone(p)]
        return [[p] for p in params if self._alone(p)] + (make_buckets(small) if small else [])

    def carries(self, ps: list) -> bool:
        """No flags ride in a reduce-scatter: each process would get a chunk of them
        ([Note: overlapped all-reduce] sends them in their own all-reduce)."""
        return False

    def launch(self, ps: list) -> tuple:
        """Start the reduce-scatter of the gradients of ``ps`` (one dtype and device)."""
        N = self.size
        dtype, device = ps[0].grad.dtype, ps[0].grad.device
        chunks = [math.ceil(p.numel() / N) for p in ps]
        width = sum(chunks)
        offsets = [sum(chunks[:k]) for k in range(len(ps))]
        if len(ps) == 1 and self._alone(ps[0]):  # the gradient itself is the buffer: no copy
            buffer = ps[0].grad.reshape(N, width)
        else:
            buffer = torch.zeros(N, width, dtype=dtype, device=device)
            for p, c, at in zip(ps, chunks, offsets):
                flat, full = p.grad.reshape(-1), p.numel() // c
                buffer[:full, at:at + c] = flat[:full * c].view(full, c)
                if full < N and full * c < flat.numel():
                    buffer[full, at:at + flat.numel() - full * c] = flat[full * c:]
        mine = torch.empty(width, dtype=dtype, device=device)
        work = self._collective("the gradient reduce-scatter", _REDUCE_SCATTER, mine,
                                buffer.view(-1), group=self._group(), async_op=True)
        return work, mine, (ps, chunks, offsets, width), (N - 1) * width * \
            buffer.element_size()

    def land(self, launched: list, divisor: int, absent: frozenset = frozenset()) -> None:
        """Wait for the reduce-scatters :meth:`launch` started, in order; each process's
        chunks, divided by ``divisor``, are what the step uses; a parameter in ``absent``
        (no gradient in any process) is left out."""
        self._layout, self._grads, self.sent_bytes = [], [], 0
        for work, mine, (ps, chunks, offsets, width), sent in launched:
            self._collective("the gradient reduce-scatter", work.wait)
            if divisor != 1:
                mine.div_(divisor)
            self.sent_bytes += sent
            if absent:
                kept = [k for k, p in enumerate(ps) if id(p) not in absent]
                ps, chunks, offsets = ([x[k] for k in kept] for x in (ps, chunks, offsets))
            if ps:
                self._layout.append((ps, chunks, offsets, width))
                self._grads.append(mine)

    def _alone(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is communicated on its own, in place: a large weight that the N
        processes divide evenly (as the all-reduce reduces large tensors in place)."""
        return p.numel() % self.size == 0 and p.numel() * p.element_size() >= self.alone

    def nonfinite(self) -> bool:
        """Whether any process's reduced chunk holds an inf or a NaN."""
        bad = torch.stack([(~torch.isfinite(g)).any().cpu() for g in self._grads]).any() \
            if self._grads else torch.tensor(False)
        flag = bad.to(torch.int32).reshape(1)
        self._collective("agreeing on non-finite gradients", dist.all_reduce, flag,
                         group=self._group())
        return bool(flag)

    def norms(self) -> dict:
        """id(parameter) -> the 2-norm of its whole reduced gradient, from the chunks: each
        process adds its chunks' squares, one all-reduce sums them (step 2)."""
        squares, ids = [], []
        for (ps, chunks, offsets, _), g in zip(self._layout, self._grads):
            for p, c, at in zip(ps, chunks, offsets):
                start, end = self._spans(p, c)
                squares.append((g[at:at + end - start].float() ** 2).sum().cpu())
                ids.append(id(p))
        if not squares:
            return {}
        total = torch.stack(squares)
        self._collective("summing the gradients' squares", dist.all_reduce, total,
                         group=self._group())
        return dict(zip(ids, total.sqrt()))

    def clip(self, max_norm: float) -> None:
        """``clip_grad_norm_`` over the whole gradients, from their chunks (step 2)."""
        norms = list(self.norms().values())
        if norms:
            self.scale(clip_coefficient(torch.stack(norms), max_norm))

    def scale(self, coef: torch.Tensor) -> None:
        """Multiply the reduced chunks by ``coef`` (clipping's)."""
        for g in self._grads:
            g.mul_(coef.to(g.device))

    def step_whole(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` on the chunks (:meth:`step`), gather the weights (:meth:`gather`),
        then run its step post-hooks, torch's global ones first, as ``optimizer.step()`` runs
        them: on the whole weights, which is what they read and write in plain PyTorch (a
        weight clipped after every step), where inside the chunks' step a write to a weight
        would be overwritten by the gather."""
        hooks = (torch_optimizer._global_optimizer_post_hooks,
                 optimizer._optimizer_step_post_hooks)
        held = [dict(h) for h in hooks]
        for h in hooks:
            h.clear()
        try:
            self.step(optimizer)
            self.gather()
        finally:
            for h, kept in zip(hooks, held):
                h.update(kept)
        for kept in held:
            for hook in kept.values():
                hook(optimizer, (), {})

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` on the chunks (step 3); the parameters are unchanged until
        :meth:`gather`."""
        chunk_of, stepped = {}, []
        with torch.no_grad():
            for (ps, chunks, offsets, _), g in zip(self._layout, self._grads):
                for p, c, at in zip(ps, chunks, offsets):
                    start, end = self._spans(p, c)
                    if end == start:
                        continue  # this process owns nothing of it
                    chunk = self._chunks.get(id(p))
                    if chunk is None or chunk.numel() != end - start or \
                            chunk.device != p.device or chunk.dtype != p.dtype:
                        chunk = self._chunks[id(p)] = torch.empty(end - start, dtype=p.dtype,
                                                                  device=p.device)
                    chunk.copy_(p.detach().reshape(-1)[start:end])  # edits between steps count
                    chunk.grad = g[at:at + end - start].to(p.dtype)
                    chunk_of[id(p)] = chunk
                    stepped.append((p, chunk, start, end))
        saved_groups = [group["params"] for group in optimizer.param_groups]
        saved_state, state = optimizer.state, collections.defaultdict(dict)
        grads = []  # the parameters left in the groups step nothing
        for p, chunk, start, end in stepped:
            held = saved_state.get(p)
            if held:
                for key, value in held.items():  # a whole parameter's state: cut to the chunk
                    if torch.is_tensor(value) and value.dim() and value.shape == p.shape:
                        held[key] = value.reshape(-1)[start:end].clone()
                state[chunk] = held
        try:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in chunk_of and p.grad is not None:
                        grads.append((p, p.grad))
                        p.grad = None
                group["params"] = [chunk_of.get(id(p), p) for p in group["params"]]
            optimizer.state = state
            optimizer._chunk_norms = self._whole_squares  # for LAMB: [Note: LAMB on chunks]
            optimizer.step()
        finally:
            del optimizer._chunk_norms
            for group, params in zip(optimizer.param_groups, saved_groups):
                group["params"] = params
            optimizer.state = saved_state
            for p, chunk, start, end in stepped:
                if chunk in state:
                    saved_state[p] = state[chunk]
                    if _chunked(state[chunk], p):  # whose chunks: [Note: sharded optimizer state]
                        state[chunk][CHUNK] = (self.rank, self.size, start, end)
                chunk.grad = None
            for p, g in grads:
                p.grad = g

    def _whole_squares(self, chunks: list) -> list:
        """``[(chunk, ||p_chunk||², ||u_chunk||²)]`` -> each weight's whole squares, summed
        over the processes (one all-reduce, which every process makes)."""
        # every process numbers the weights alike: in the order of the reduce-scatter
        place = {id(p): k for k, p in enumerate(p for ps, *_ in self._layout for p in ps)}
        index = {id(chunk): place[key] for key, chunk in self._chunks.items() if key in place}
        sums = torch.zeros(len(place), 2)
        for chunk, p2, u2 in chunks:
            sums[index[id(chunk)]] = torch.stack([p2.float().cpu(), u2.float().cpu()])
        self._collective("summing LAMB's norms", dist.all_reduce, sums, group=self._group())
        return [(sums[index[id(c)], 0].to(p2.device), sums[index[id(c)], 1].to(u2.device))
                for c, p2, u2 in chunks]

    def gather_grads(self, params: list) -> None:
        """The reduced gradients of ``params``, whole, into their ``.grad`` in every process
        (their buckets' chunks all-gathered), where the rest hold this process's own until
        the next step: what a ``Gradient___`` anchor reads ([Note: sharded optimizer
        state]). Before :meth:`gather`, which drops the chunks."""
        wanted = {id(p) for p in params}
        for (ps, chunks, offsets, width), g in zip(self._layout, self._grads):
            if not any(id(p) in wanted for p in ps):
                continue
            everyone = torch.empty(self.size * width, dtype=g.dtype, device=g.device)
            self._collective("gathering the anchored gradients", _ALL_GATHER, everyone, g,
                             group=self._group())
            rows = everyone.view(self.size, width)
            for p, c, at in zip(ps, chunks, offsets):
                if id(p) in wanted:
                    p.grad = rows[:, at:at + c].reshape(-1)[:p.numel()].view_as(p).clone()

    def gather(self) -> None:
        """Every process's new chunks into every process's parameters (step 4)."""
        N = self.size
        for ps, chunks, offsets, width in self._layout:
            p = ps[0]
            if self._alone(p) and p.is_contiguous() and id(p) in self._chunks:
                with torch.no_grad():  # straight into the weight: no copy
                    self._collective("gathering the stepped weights", _ALL_GATHER,
                                     p.view(-1), self._chunks[id(p)], group=self._group())
                self.sent_bytes += (N - 1) * width * p.element_size()
                continue
            mine = torch.zeros(width, dtype=ps[0].dtype, device=ps[0].device)
            with torch.no_grad():  # (a weight this process owns nothing of adds nothing)
                for p, c, at in zip(ps, chunks, offsets):
                    start, end = self._spans(p, c)
                    if end > start:
                        mine[at:at + end - start] = self._chunks[id(p)]
            everyone = torch.empty(N * width, dtype=mine.dtype, device=mine.device)
            self._collective("gathering the stepped weights", _ALL_GATHER, everyone,
                             mine, group=self._group())
            self.sent_bytes += (N - 1) * width * mine.element_size()
            rows = everyone.view(N, width)
            with torch.no_grad():
                for p, c, at in zip(ps, chunks, offsets):
                    p.copy_(rows[:, at:at + c].reshape(-1)[:p.numel()].view_as(p))
        self._grads = []


def refuse_host_steps(optimizer: torch.optim.Optimizer, processes: int) -> None:
    """Refuse ``optimizer.step()`` on the host while its state holds this process's chunks
    of a sharded state (E-OPTIM-13; the sharded step itself steps chunk parameters, whose
    state fits them)."""
    def pre_hook(opt, args, kwargs):
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                for key, value in opt.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.dim() and value.shape != p.shape:
                        raise OptimizerError(
                            f"{type(opt).__name__}.step() on the host: its state is sharded "
                            f"over {processes} processes (useReplicatedTensorSharding(True)), "
                            f"and this process holds only a chunk of it (param group {g}, "
                            f"parameter {i}: {key!r} has {value.numel()} of the weight's "
                            f"{p.numel()} elements), so no step of the whole weight can run "
                            f"here. Step through the trainingModel (each call steps), or "
                            f"train without useReplicatedTensorSharding to step on the host")
    pre_hook.refuses_host_steps = True  # not a user's hook (pre_hooks)
    optimizer.register_step_pre_hook(pre_hook)


def pre_hooks(optimizer: torch.optim.Optimizer) -> list:
    """The names of the step pre-hooks that ``optimizer.step()`` would run, torch's global
    ones included, but for :func:`refuse_host_steps`' own."""
    return [getattr(hook, "__qualname__", repr(hook))
            for hooks in (torch_optimizer._global_optimizer_pre_hooks,
                          optimizer._optimizer_step_pre_hooks)
            for hook in hooks.values() if not getattr(hook, "refuses_host_steps", False)]


def _chunked(state: dict, p: torch.Tensor) -> bool:
    """Whether a parameter's optimizer ``state`` holds a chunk: a tensor of another shape
    than ``p``'s (a step count is a scalar)."""
    return any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in state.values())


def _by_kind(params: list) -> list:
    """``params`` in one bucket per dtype and device of their gradients."""
    kinds: dict = {}
    for p in params:
        kinds.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    return list(kinds.values())
