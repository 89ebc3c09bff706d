"""Keras inputs cut into executions: tensors, NumPy arrays, Datasets, loaders and streams.

One execution consumes ``steps_per_execution`` batches of ``batch_size``
samples, which is exactly one combined batch of the PopTorch face
([Note: batch layout]): batch k of the execution is micro-batch k. The rules
of the Keras tutorials are checked here, before anything runs: the number of
samples must be a multiple of ``batch_size × replicas`` (or
``drop_remainder=True`` drops the rest, with one warning), and the number of
batches per epoch a multiple of ``steps_per_execution``.

[Note: Keras data streams]
A ``DataLoader``, an ``IterableDataset`` (batched here by ``batch_size``) or an
``AsynchronousDataAccessor`` (loading ahead in a thread) is a stream of
batches, as a ``tf.data`` data set is to Keras. Without ``steps_per_epoch``
each epoch is one pass over it. With ``steps_per_epoch`` the epochs take their
batches from one iterator that continues from epoch to epoch, as TF's does;
where TF stops with "your input ran out of data" at the end of a finite data
set, this face starts a new pass (TF's ``dataset.repeat()``, which the
tutorials write anyway). A stream with no length (an infinite
``IterableDataset``) needs ``steps_per_epoch``. Tensors, arrays and map-style
Datasets are read whole each epoch, in a fresh (shuffled) order.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..data.async_data import AsynchronousDataAccessor
from ..errors import BatchSizeError, InputError, PoptorchLiteWarning, warn_once


def _tensor(value, what: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
        if value.is_floating_point():  # Keras casts float inputs to the model's float32
            value = value.to(torch.get_default_dtype())
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{what} must be a tensor, a NumPy array, a torch Dataset or a "
                         f"DataLoader of (x, y) batches, got {type(value).__name__}")
    if value.dim() == 0:
        raise InputError(f"{what} is a 0-dim tensor; give one row per sample")
    return value


def _rows(batch) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return len(first)


class Data:
    """A data set as Keras' ``fit``/``evaluate``/``predict`` receive it, cut into executions.

    Args:
        x, y: tensors or NumPy arrays (``y`` None for ``predict``), a ``Dataset`` of
            ``(x, y)`` items (or ``x`` items for ``predict``), or a stream of such
            batches ([Note: Keras data streams]).
        batch_size: samples per batch (a DataLoader's own is used instead).
        labels: whether targets are needed (``fit``, ``evaluate``).
        what: the method's name, for messages.
        sample_weight: a weight per sample (tensors only), or None.

    Raises:
        InputError: another type, or x and y of different lengths.

    Example:
        >>> d = Data(torch.zeros(8, 2), torch.zeros(8), 4, True, "fit")
        >>> d.samples, d.batch_size
        (8, 4)
    """

    def __init__(self, x, y, batch_size: int, labels: bool, what: str, sample_weight=None):
        self.what, self.labels, self.loader = what, labels, None
        self.x = self.y = self.dataset = self.weight = None
        self._iterator, self._held, self.continuing = None, [], False
        if isinstance(x, (DataLoader, Dataset, AsynchronousDataAccessor)):
            if y is not None:
                raise InputError(f"{what}: y must be None when x is a {type(x).__name__}; its "
                                 f"items hold the targets")
            if sample_weight is not None:
                raise InputError(f"{what}: sample_weight goes with tensors x and y; for a "
                                 f"{type(x).__name__}, weight the loss yourself")
            self._stream(x, batch_size)
            return
        self.x, self.batch_size = _tensor(x, f"{what}: x"), batch_size
        if labels:
            if y is None:
                raise InputError(f"{what}: y is missing; pass the targets as y, or x as a "
                                 f"Dataset of (x, y) items")
            self.y = _tensor(y, f"{what}: y")
            if len(self.y) != len(self.x):
                raise InputError(f"{what}: x has {len(self.x)} samples but y has {len(self.y)}; "
                                 f"give one target per sample")
        if sample_weight is not None:
            self.weight = _tensor(sample_weight, f"{what}: sample_weight").to(
                torch.get_default_dtype())
            if self.weight.shape != (len(self.x),):
                raise InputError(f"{what}: sample_weight has shape {tuple(self.weight.shape)}; "
                                 f"give one weight per sample, shape ({len(self.x)},)")
        self.samples = len(self.x)

    def _stream(self, x, batch_size: int) -> None:
        """A DataLoader, IterableDataset, accessor, or map-style Dataset."""
        if isinstance(x, IterableDataset):
            x = DataLoader(x, batch_size=batch_size)  # a stream of samples, batched here
        if isinstance(x, DataLoader):
            self.loader, self.batch_size = x, x.batch_size
            if self.batch_size is None:
                raise InputError(f"{self.what}: the DataLoader has batch_size=None; give it a "
                                 f"batch_size")
            try:  # a loader that drops its last partial batch holds whole batches only
                self.samples = len(x) * x.batch_size if x.drop_last else len(x.dataset)
            except TypeError:  # an IterableDataset without a length
                self.samples = None
        elif isinstance(x, AsynchronousDataAccessor):
            self.loader = x
            self.batch_size = _rows(self._split(self.peek()))
            self.samples = len(x) * self.batch_size
        else:
            self.dataset, self.batch_size, self.samples = x, batch_size, len(x)

    def batches(self, replicas: int, steps: Optional[int], drop_remainder: bool,
                steps_name: str) -> int:
        """Batches per epoch, after the tutorials' rules.

        Raises:
            BatchSizeError: the samples are not a multiple of ``batch_size × replicas``
                (without ``drop_remainder``), ``steps`` asks for more batches than there
                are, or a stream without a length comes without ``steps``.
        """
        n, b = self.samples, self.batch_size
        k = b * replicas
        if n is None:
            self.require_steps(steps, steps_name)
            self.continuing = True
            return steps
        if n % k:
            if not drop_remainder:
                raise BatchSizeError(
                    f"{self.what}: the data set has {n} samples, not a multiple of batch_size "
                    f"({b}) x replicas ({replicas}) = {k}; trim it as the tutorial's "
                    f"make_divisible does (x = x[:{n - n % k}], y = y[:{n - n % k}]), or pass "
                    f"drop_remainder=True to drop the last {n % k}")
            warn_once(f"keras.{self.what}.drop_remainder",
                      f"{self.what}: drop_remainder=True drops {n % k} of the {n} samples (not a "
                      f"multiple of batch_size x replicas = {k})", PoptorchLiteWarning)
        available = (n - n % k) // b
        if steps is not None and steps > available and self.loader is None:
            raise BatchSizeError(f"{self.what}: {steps_name}={steps} asks for more batches than "
                                 f"the {available} of batch_size {b} the data set holds; pass "
                                 f"{steps_name}={available} or less")
        self.continuing = self.loader is not None and steps is not None
        return available if steps is None else steps

    def check_executions(self, count: int, spe: int, steps_name: str) -> None:
        """Refuse ``count`` batches that are not a multiple of ``steps_per_execution``.

        Raises:
            BatchSizeError: as it says, with the ways out.
        """
        if count % spe:
            b = self.batch_size
            fewer = f"pass {steps_name}={count - count % spe}, " if count > spe else ""
            raise BatchSizeError(
                f"{self.what}: {count} batches per epoch is not a multiple of steps_per_execution "
                f"({spe}); {fewer}trim the data set to a "
                f"multiple of batch_size x steps_per_execution = {b * spe} samples, or compile "
                f"with a steps_per_execution that divides {count}")

    def first(self, rows: int) -> tuple:
        """The first ``rows`` samples as ``(x, y, weight)`` (``y`` None without labels,
        ``weight`` without sample weights), for tracing."""
        if self.loader is not None:
            x, y = self._split(self.peek())
            return x[:rows], (None if y is None else y[:rows]), None
        return next(self.executions(None, 1, rows, 1))

    def require_steps(self, steps, steps_name: str) -> None:
        """The checks of a stream that come before reading it ([Note: Keras data streams]).

        Raises:
            BatchSizeError: a stream without a length and no ``steps``.
            InputError: ``steps`` would read a loader past its partial last batch.
        """
        n, b = self.samples, self.batch_size
        if n is None and steps is None:
            raise BatchSizeError(f"{self.what}: the data has no length (an infinite "
                                 f"IterableDataset); pass {steps_name}=N, the batches of "
                                 f"one epoch")
        if self.loader is not None and n is not None and steps is not None and n % b and \
                steps > n // b:
            raise InputError(f"{self.what}: the data's last batch has {n % b} samples, not "
                             f"batch_size {b}, and {steps_name}={steps} reads past it; give the "
                             f"DataLoader drop_last=True")

    def peek(self):
        """The stream's next batch, left in it."""
        if not self._held:
            self._held.append(self._next_batch(fresh_pass=self._iterator is None))
        return self._held[0]

    def _next_batch(self, fresh_pass: bool = False):
        if self._held:
            return self._held.pop(0)
        if fresh_pass or self._iterator is None:
            self._iterator = iter(self.loader)
        for restart in (False, True):
            if restart:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:
                continue
        raise InputError(f"{self.what}: the data yields no batch")

    def executions(self, order: Optional[torch.Tensor], spe: int, batch_size: int,
                   count: int) -> Iterator[tuple]:
        """``count // spe`` combined batches ``(x, y, weight)`` of ``spe × batch_size`` samples.

        ``order`` permutes the samples (None: in order; a stream keeps its own).
        """
        rows = spe * batch_size
        if self.loader is not None:
            yield from self._from_loader(spe, count)
            return
        for e in range(count // spe):
            lo, hi = e * rows, (e + 1) * rows
            idx = slice(lo, hi) if order is None else order[lo:hi]
            if self.dataset is not None:
                yield (*self._split(default_collate([self.dataset[int(i)] for i in (
                    range(lo, hi) if order is None else idx)])), None)
            else:
                yield (self.x[idx], (self.y[idx] if self.labels else None),
                       None if self.weight is None else self.weight[idx])

    def _split(self, batch) -> tuple:
        if self.labels:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise InputError(f"{self.what}: the data set's items must be (x, y) pairs")
            return batch[0], batch[1]
        return (batch[0] if isinstance(batch, (tuple, list)) else batch), None

    def _from_loader(self, spe: int, count: int) -> Iterator[tuple]:
        """``count`` batches from the stream ([Note: Keras data streams])."""
        group = []
        for k in range(count):
            batch = self._next_batch(fresh_pass=k == 0 and not self.continuing and
                                     not self._held)
            x, y = self._split(batch)
            if len(x) != self.batch_size:
                raise InputError(f"{self.what}: batch {k} of an epoch has {len(x)} samples, "
                                 f"not batch_size {self.batch_size}; give the DataLoader "
                                 f"drop_last=True")
            group.append((x, y))
            if len(group) == spe:
                xs, ys = zip(*group)
                yield torch.cat(xs), (torch.cat(ys) if self.labels else None), None
                group = []
        if not self.continuing:
            self._iterator = None  # the next epoch is a new pass
