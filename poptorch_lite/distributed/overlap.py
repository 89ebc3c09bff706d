"""The gradient all-reduce (or reduce-scatter) overlapped with the backward, in buckets, as DDP.

[Note: overlapped all-reduce]
Without it, the data-parallel processes sum their gradients in the update (``U``), after
every stage's backward of every micro-batch: the all-reduce waits for the whole backward,
and the backward for nothing. DDP instead all-reduces each bucket of gradients as soon as
the last micro-batch's backward has made them, on gloo's (or NCCL's) own thread, while the
backward goes on. This does the same:

- the parameters this process steps are cut into buckets in the reverse of the model's
  order (about the order the backward makes their gradients, as DDP's buckets): a tensor of
  1 MB or more alone, reduced in place; smaller ones flattened together, up to 25 MB a
  bucket (``processes._buckets``); a weight whose gradient is sparse (an embedding traced
  with ``sparse=True``: ``update.sparse_gradients``, as DDP expects one of a sparse
  ``Embedding``) alone, summed as a sparse tensor (gloo's sparse all-reduce, in place), an
  empty sparse tensor standing in where a process got none; it carries no flags;
- a hook on each parameter (``register_post_accumulate_grad_hook``) counts the gradients
  autograd adds into its ``.grad`` in a run: one per micro-batch (every micro-batch of every
  replica runs its stage's backward once). After the last, the sum is final: the hook divides
  it as the stage's reduction (``sG``) would have (loss scaling, Mean's G·R), which then
  leaves it alone, and marks it ready. It is the parameter's last post-accumulate hook, so a
  user's runs first, on this process's gradient, as in plain PyTorch: one registered between
  calls has the run make the overlap again, its hooks after the user's (``hooked_last``);
- a bucket is launched (``all_reduce(async_op=True)``; with the optimizer state sharded,
  the reduce-scatter of [Note: sharded optimizer state], its large weights alone and in
  place as there) once it and every bucket before it are ready, so every process launches
  the buckets in the same order whatever the order its stages' threads finish in (buckets
  in the order of their last parameter);
- with the last bucket goes which parameters got a gradient here: in its all-reduce, after
  its gradients, where that bucket is a flat copy of a float32 or float64 sum (one
  collective a step, as DDP's), else as one small all-reduce beside it;
- the update launches the buckets not launched yet (a parameter that got no gradient here
  gives zeros), waits for every bucket, divides by the processes for Mean, leaves a
  parameter that got no gradient in any process without one (as without overlap), and
  steps.

Each element is the same sum, of the same values, as the all-reduce in the update makes;
only which elements travel together differs (and, with more than 2 processes, which rank a
ring starts an element's sum at: fp32 rounding). It is used where a gradient is final after
its last accumulation: every stage in this process, parameters that are their own homes on
the CPU (gloo), each a leaf of exactly one graph of one stage (a weight shared by stages, or
by two segments of a recomputed stage, gets several accumulations a micro-batch), no
accumulator of another dtype (``accum_type``) and a schedule without split backward
(zero-bubble's W). Elsewhere the update all-reduces (or reduce-scatters) as before. GPUs
are left out until a GPU run checks NCCL's streams here.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import ExecutionError


class Overlap:
    """The buckets of this process's stepped parameters and the state of one run's reduction.

    Args:
        params: name -> the parameter (its own home) whose gradient is reduced.
        buckets: the parameters in buckets, in launch order.
        group: () -> the process group of the replicas (None: every process).
        collective: ``(what, fn, *args, **kwargs)`` -> ``fn``'s result (a work, or a wait's),
            raising the processes' error.
        reducer: ``launch(bucket[, flags]) -> handle`` starts a bucket's collective (with
            ``flags`` summed after its gradients where ``carries(bucket)``) and
            ``land(handles, divisor[, absent])`` finishes them in order: the processes'
            all-reduce, or the sharded state's ``Shards`` (its reduce-scatter).
    """

    def __init__(self, params: dict, buckets: list, group: Callable, collective: Callable,
                 reducer, sparse: frozenset = frozenset()):
        self.params = params
        self.buckets = buckets
        self.sparse = sparse  # the ids of the parameters whose gradients are sparse
        self._group, self._collective = group, collective
        self.reducer = reducer
        self._bucket_of = {id(p): k for k, bucket in enumerate(buckets) for p in bucket}
        self._name = {id(p): n for n, p in params.items()}
        self._lock = threading.Lock()
        self.active = False
        self.final: set = set()  # names whose gradient the hooks reduced this run
        # The hooks hold the overlap weakly: a wrapper that is dropped takes its hooks off
        # the user's parameters with it.
        mine = weakref.ref(self)

        def accumulated(p: torch.Tensor) -> None:
            overlap = mine()
            if overlap is not None and overlap.active:
                overlap._accumulated(p)
        self._hooks = [p.register_post_accumulate_grad_hook(accumulated)
                       for p in params.values()]
        self._finalizer = weakref.finalize(self, _remove, self._hooks)

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        self._finalizer()

    def hooked_last(self) -> bool:
        """Whether its hook is still each parameter's last post-accumulate hook. A user's
        hook registered after it (between calls) would edit a gradient its bucket has already
        launched, where plain PyTorch's hooks edit each process's gradient before the sum:
        the update then makes the overlap again, its hooks after the user's."""
        return all(p._post_accumulate_grad_hooks and  # (None: a user reset the table)
                   next(reversed(p._post_accumulate_grad_hooks)) == handle.id
                   for p, handle in zip(self.params.values(), self._hooks))

    def begin(self, microbatches: int, divisor: float) -> None:
        """A run of ``microbatches`` backward passes starts; its gradients are divided by
        ``divisor`` (the reduction's) once final."""
        with self._lock:
            self._left = {id(p): microbatches for p in self.params.values()}
            self._waiting = [len(bucket) for bucket in self.buckets]
            self._launched: list = []
            self._had: set = set()  # the parameters that had a gradient here
            self._present = None
            self._divisor = divisor
            self.final = set()
            self.active = True

    def end(self) -> None:
        """The run ended without its update (it failed): the hooks do nothing until the
        next :meth:`begin`."""
        self.active = False

    def _accumulated(self, p: torch.Tensor) -> None:
        """A gradient was added into ``p.grad``: after the run's last, reduce it, and launch
        every bucket that is ready in order."""
        key = id(p)
        left = self._left[key] - 1
        self._left[key] = left
        if left:
            return
        if self._divisor != 1:
            with torch.no_grad():
                p.grad.div_(self._divisor)
        with self._lock:
            self.final.add(self._name[key])
            self._waiting[self._bucket_of[key]] -= 1
            while len(self._launched) < len(self.buckets) and \
                    self._waiting[len(self._launched)] == 0:
                self._launch()

    def _launch(self) -> None:
        """Reduce the next bucket, asynchronously (under the lock); after the last, the
        flags of the parameters that had a gradient here."""
        bucket = self.buckets[len(self._launched)]
        with torch.no_grad():
            for p in bucket:
                if p.grad is None:  # no gradient here: zeros, as without overlap
                    p.grad = zero_gradient(p, sparse=id(p) in self.sparse)
                elif p.grad.is_sparse != (id(p) in self.sparse):
                    raise ExecutionError(
                        f"parameter '{self._name[id(p)]}' got a "
                        f"{'sparse' if p.grad.is_sparse else 'dense'} gradient where its "
                        f"graph makes a {'dense' if p.grad.is_sparse else 'sparse'} one "
                        f"(only an embedding traced with sparse=True makes a sparse one), so "
                        f"the gradient all-reduce over the processes, which every process "
                        f"launches alike, cannot sum it; give its gradient one layout")
                else:
                    self._had.add(id(p))
        if len(self._launched) < len(self.buckets) - 1:
            self._launched.append(self.reducer.launch(bucket))
            return
        # The last bucket: the flags of the parameters that had a gradient here ride in it
        # where the reducer can carry them, else go beside it (not after it).
        flags = torch.tensor([id(p) in self._had for p in self.params.values()],
                             dtype=torch.int32)
        if self.reducer.carries(bucket):
            self._launched.append(self.reducer.launch(bucket, flags))
            self._present = (None, flags)
        else:
            self._launched.append(self.reducer.launch(bucket))
            self._present = (_all_reduce(flags, self._group, self._collective), flags)

    def finish(self, divisor: int) -> None:
        """The update: launch what is left, wait, divide by ``divisor``; a parameter with no
        gradient in any process keeps none."""
        with self._lock:
            while len(self._launched) < len(self.buckets):
                self._launch()
            self.active = False
        work, flags = self._present
        with torch.no_grad():
            if work is None:  # the flags rode in the last bucket: summed when it lands
                self.reducer.land(self._launched, divisor)
            else:
                self._collective("the gradient all-reduce", work.wait)
        absent = frozenset(id(p) for p, anywhere in zip(self.params.values(), flags.tolist())
                           if not anywhere)
        if work is not None:
            with torch.no_grad():
                self.reducer.land(self._launched, divisor, absent)
        for p in self.params.values():
            if id(p) in absent:
                p.grad = None
        self._launched, self._present = [], None


def _all_reduce(t: torch.Tensor, group: Callable, collective: Callable):
    """Start the sum of ``t`` (the flags of the weights that had a gradient) over
    ``group()``; its work."""
    return collective("the gradient all-reduce", dist.all_reduce, t, group=group(),
                      async_op=True)


def buckets_in_backward_order(params: dict, make_buckets: Callable) -> list:
    """The parameters of ``params`` in buckets by ``make_buckets`` (given them last parameter
    first, about the order the backward makes their gradients, as DDP's), in the order they
    are expected to be ready: by their last parameter in that order.

    Example:
        >>> ps = {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(4)}
        >>> [[tuple(p.shape) for p in b] for b in buckets_in_backward_order(
        ...     ps, lambda ts: [[ts[0], ts[2]], [ts[1]]])]
        [[(3,)], [(4,), (2,)]]
    """
    ordered = list(reversed(list(params.values())))
    at = {id(p): k for k, p in enumerate(ordered)}
    return sorted(make_buckets(ordered), key=lambda bucket: max(at[id(p)] for p in bucket))


def zero_gradient(p: torch.Tensor, sparse: bool) -> torch.Tensor:
    """The gradient ``p`` contributes to a sum over the processes where it got none here:
    zeros, or an empty sparse tensor where the others' are sparse (an embedding's: one sparse
    dimension).

    Example:
        >>> zero_gradient(torch.ones(3, 2), sparse=True).to_dense().tolist()
        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if not sparse:
        return torch.zeros_like(p)
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=p.device),
                                   p.new_empty((0, *p.shape[1:])), p.shape,
                                   check_invariants=False, is_coalesced=True)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
