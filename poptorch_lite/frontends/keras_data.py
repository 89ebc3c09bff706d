"""Keras inputs cut into executions: tensors, NumPy arrays, Datasets and DataLoaders.

One execution consumes ``steps_per_execution`` batches of ``batch_size``
samples, which is exactly one combined batch of the PopTorch face
([Note: batch layout]): batch k of the execution is micro-batch k. The rules
of the Keras tutorials are checked here, before anything runs: the number of
samples must be a multiple of ``batch_size × replicas`` (or
``drop_remainder=True`` drops the rest, with one warning), and the number of
batches per epoch a multiple of ``steps_per_execution``.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

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


class Data:
    """A data set as Keras' ``fit``/``evaluate``/``predict`` receive it, cut into executions.

    Args:
        x, y: tensors or NumPy arrays (``y`` None for ``predict``), a ``Dataset`` of
            ``(x, y)`` items (or ``x`` items for ``predict``), or a ``DataLoader`` of
            such batches (its own ``batch_size`` and order are used).
        batch_size: samples per batch (ignored for a DataLoader).
        labels: whether targets are needed (``fit``, ``evaluate``).
        what: the method's name, for messages.

    Raises:
        InputError: another type, or x and y of different lengths.

    Example:
        >>> d = Data(torch.zeros(8, 2), torch.zeros(8), 4, True, "fit")
        >>> d.samples, d.batch_size
        (8, 4)
    """

    def __init__(self, x, y, batch_size: int, labels: bool, what: str):
        self.what, self.labels, self.loader = what, labels, None
        self.x = self.y = self.dataset = None
        if isinstance(x, (DataLoader, Dataset)):
            if y is not None:
                raise InputError(f"{what}: y must be None when x is a {type(x).__name__}; its "
                                 f"items hold the targets")
            if isinstance(x, DataLoader):
                self.loader, self.batch_size = x, x.batch_size
                if self.batch_size is None:
                    raise InputError(f"{what}: the DataLoader has batch_size=None; give it a "
                                     f"batch_size")
                # a loader that drops its last partial batch holds whole batches only
                self.samples = len(x) * x.batch_size if x.drop_last else len(x.dataset)
            else:
                self.dataset, self.batch_size, self.samples = x, batch_size, len(x)
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
        self.samples = len(self.x)

    def batches(self, replicas: int, spe: int, steps: Optional[int], drop_remainder: bool,
                steps_name: str) -> int:
        """Batches per epoch, after the tutorials' rules.

        Raises:
            BatchSizeError: the samples are not a multiple of ``batch_size × replicas``
                (without ``drop_remainder``), ``steps`` asks for more batches than there
                are, or the batches are not a multiple of ``steps_per_execution``.
        """
        n, b = self.samples, self.batch_size
        k = b * replicas
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
        if steps is not None and steps > available:
            raise BatchSizeError(f"{self.what}: {steps_name}={steps} asks for more batches than "
                                 f"the {available} of batch_size {b} the data set holds; pass "
                                 f"{steps_name}={available} or less")
        count = available if steps is None else steps
        if count % spe:
            fewer = f"pass {steps_name}={count - count % spe}, " if count > spe else ""
            raise BatchSizeError(
                f"{self.what}: {count} batches per epoch is not a multiple of steps_per_execution "
                f"({spe}); {fewer}trim the data set to a "
                f"multiple of batch_size x steps_per_execution = {b * spe} samples, or compile "
                f"with a steps_per_execution that divides {count}")
        return count

    def first(self, rows: int) -> tuple:
        """The first ``rows`` samples as ``(x, y)`` (``y`` None without labels), for tracing."""
        return next(self.executions(None, 1, rows, 1))

    def executions(self, order: Optional[torch.Tensor], spe: int, batch_size: int,
                   count: int) -> Iterator[tuple]:
        """``count // spe`` combined batches ``(x, y)`` of ``spe × batch_size`` samples each.

        ``order`` permutes the samples (None: in order; a DataLoader keeps its own).
        """
        rows = spe * batch_size
        if self.loader is not None:
            yield from self._from_loader(spe, count)
            return
        for e in range(count // spe):
            lo, hi = e * rows, (e + 1) * rows
            idx = slice(lo, hi) if order is None else order[lo:hi]
            if self.dataset is not None:
                yield self._split(default_collate([self.dataset[int(i)] for i in (
                    range(lo, hi) if order is None else idx)]))
            else:
                yield self.x[idx], (self.y[idx] if self.labels else None)

    def _split(self, batch) -> tuple:
        if self.labels:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise InputError(f"{self.what}: the data set's items must be (x, y) pairs")
            return batch[0], batch[1]
        return (batch[0] if isinstance(batch, (tuple, list)) else batch), None

    def _from_loader(self, spe: int, count: int) -> Iterator[tuple]:
        group = []
        for k, batch in enumerate(self.loader):
            if k == count:
                break
            group.append(self._split(batch))
            if len(group) == spe:
                xs, ys = zip(*group)
                yield torch.cat(xs), (torch.cat(ys) if self.labels else None)
                group = []
