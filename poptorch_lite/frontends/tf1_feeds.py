"""TF1's feeds and optimizer output for ``pipeline``: infeed, outfeed, ``OptimizerFunctionOutput``.

[Note: TF1 feeds]
TF1 streams a ``tf.data`` data set into a pipeline through an
``IPUInfeedQueue`` and reads results back from an ``IPUOutfeedQueue``. The
nearest torch equivalent, kept under TF1's names:

* ``IPUInfeedQueue(iterable)`` holds an iterator over any iterable of
  micro-batches (a ``torch.utils.data.DataLoader`` whose ``batch_size`` is the
  micro-batch, or a list of ``(x, y)`` tuples). A pipeline call with no
  arguments takes the next ``repeat_count x G x replicas`` micro-batches from it
  and concatenates them into one call's combined batch. The iterator continues
  across calls, as TF's does; at its end it starts a new pass over the iterable
  (TF1's ``dataset.repeat()``, which the tutorials use).
* ``IPUOutfeedQueue()`` collects what each call returns; ``dequeue()`` gives
  everything enqueued since the last ``dequeue()``, concatenated along dim 0
  (TF1 stacks one entry per micro-batch; see [Note: TF1 loss and labels]).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import InputError


class OptimizerFunctionOutput:
    """What TF1's ``optimizer_function(*last_stage_outputs)`` returns: the optimizer and the loss.

    Args:
        optimizer: a torch optimizer, or a function from parameters to one
            (``lambda params: torch.optim.SGD(params, lr=learning_rate)``: the
            pipeline's parameters are found by running the stages, so a function
            is the natural translation of ``tf.train.GradientDescentOptimizer``).
        loss: the scalar loss tensor to minimise.

    Example:
        >>> out = OptimizerFunctionOutput(lambda params: torch.optim.SGD(params, lr=0.1),
        ...                               torch.tensor(1.0))
        >>> float(out.loss)
        1.0
    """

    def __init__(self, optimizer, loss):
        self.optimizer, self.loss = optimizer, loss


class IPUInfeedQueue:
    """An iterator over micro-batches that continues across pipeline calls ([Note: TF1 feeds]).

    Args:
        dataset: an iterable of micro-batches: tensors, or tuples of tensors
            (``(images, labels)``), e.g. a ``DataLoader``.

    Raises:
        InputError: ``dataset`` is not iterable.

    Example:
        >>> feed = IPUInfeedQueue([(torch.zeros(2, 3), torch.zeros(2)) for _ in range(3)])
        >>> [t.shape for t in feed.take(2)]
        [torch.Size([4, 3]), torch.Size([4])]
    """

    def __init__(self, dataset: Iterable, feed_name: str = "infeed"):
        try:
            iter(dataset)
        except TypeError:
            raise InputError(f"IPUInfeedQueue needs an iterable of micro-batches (a DataLoader, "
                             f"a list of (x, y) tuples), got {type(dataset).__name__}") from None
        self.dataset, self.name = dataset, feed_name
        self._iterator, self._held = None, []

    def _next(self):
        if self._held:
            return self._held.pop(0)
        for fresh in (False, True):
            if self._iterator is None or fresh:
                self._iterator = iter(self.dataset)
            try:
                return next(self._iterator)
            except StopIteration:
                continue
        raise InputError("the IPUInfeedQueue's data set yields no micro-batch; give it a "
                         "non-empty iterable")

    def peek(self):
        """The next micro-batch, left in the queue (the pipeline's dry run reads it)."""
        if not self._held:
            self._held.append(self._next())
        return self._held[0]

    def take(self, n: int) -> tuple:
        """The next ``n`` micro-batches concatenated along dim 0, as a call's arguments."""
        items = [self._next() for _ in range(n)]
        if isinstance(items[0], torch.Tensor):
            return (torch.cat(items),)
        return tuple(torch.cat([item[k] for item in items]) for k in range(len(items[0])))


class IPUOutfeedQueue:
    """Collects each pipeline call's results ([Note: TF1 feeds]).

    Example:
        >>> q = IPUOutfeedQueue()
        >>> q.enqueue(torch.ones(2)); q.enqueue(torch.zeros(2))
        >>> q.dequeue()
        tensor([1., 1., 0., 0.])
        >>> q.dequeue()
        []
    """

    def __init__(self, feed_name: str = "outfeed"):
        self.name, self._pending = feed_name, []

    def enqueue(self, value) -> None:
        self._pending.append(value)

    def dequeue(self):
        """Everything enqueued since the last ``dequeue()``, concatenated along dim 0
        (element by element for tuples; an empty list when nothing is pending)."""
        pending, self._pending = self._pending, []
        return _merge(pending) if pending else []


def _merge(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([v[k] for v in values]) for k in range(len(first)))
    return list(values)
