"""Keras callbacks: the hook base class, ``History``, ``LearningRateScheduler``.

[Note: Keras batch hooks]
One execution runs ``steps_per_execution`` batches, and its results come back
together. As IPU Keras does, the batch hooks then fire once per execution:
``on_train_batch_begin(first)`` before it and ``on_train_batch_end(last, logs)``
after it, where ``first`` and ``last`` are the indices (within the epoch) of its
first and last batches. With ``model.set_asynchronous_callbacks(True)`` they fire
for every batch instead, ``begin(k)`` then ``end(k, logs)``, as soon as the
execution holding batch k is back. ``logs`` hold the epoch's running means up to
that batch (``loss`` and each metric), as Keras' logs do.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import OptionsError


class Callback:
    """Base class of Keras callbacks: override the hooks you need.

    ``self.model`` is the ``keras.Model`` and ``self.params`` holds ``epochs``,
    ``steps`` (batches per epoch) and ``verbose`` once ``fit`` starts.

    Example:
        >>> class Print(Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print(epoch, logs["loss"])
    """

    def __init__(self):
        self.model = None
        self.params: dict = {}

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def on_train_begin(self, logs: Optional[dict] = None): pass
    def on_train_end(self, logs: Optional[dict] = None): pass
    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None): pass
    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None): pass
    def on_batch_begin(self, batch: int, logs: Optional[dict] = None): pass
    def on_batch_end(self, batch: int, logs: Optional[dict] = None): pass

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None):
        self.on_batch_begin(batch, logs)  # Keras' older name, as Keras forwards it

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None):
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: Optional[dict] = None): pass
    def on_test_end(self, logs: Optional[dict] = None): pass
    def on_test_batch_begin(self, batch: int, logs: Optional[dict] = None): pass
    def on_test_batch_end(self, batch: int, logs: Optional[dict] = None): pass
    def on_predict_begin(self, logs: Optional[dict] = None): pass
    def on_predict_end(self, logs: Optional[dict] = None): pass
    def on_predict_batch_begin(self, batch: int, logs: Optional[dict] = None): pass
    def on_predict_batch_end(self, batch: int, logs: Optional[dict] = None): pass


class History(Callback):
    """Records each epoch's logs: ``history.history["loss"]`` lists the epochs' losses.

    ``fit`` adds one and returns it (also as ``model.history``).

    Example:
        >>> h = History()
        >>> h.on_train_begin()
        >>> h.on_epoch_end(0, {"loss": 0.5})
        >>> h.history, h.epoch
        ({'loss': [0.5]}, [0])
    """

    def __init__(self):
        super().__init__()
        self.history: dict = {}
        self.epoch: list = []

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


class LearningRateScheduler(Callback):
    """Sets the optimizer's learning rate at each epoch's start to ``schedule(epoch, lr)``.

    ``schedule`` may also take the epoch alone. The rate is written into every
    parameter group and logged as ``lr`` at the epoch's end (tf.keras' name).

    Raises:
        OptionsError: ``schedule`` is not callable, or returns something that is not
            a float.

    Example:
        >>> cb = LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    """

    def __init__(self, schedule: Callable, verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise OptionsError(f"LearningRateScheduler needs a callable schedule(epoch, lr), got "
                               f"{type(schedule).__name__}")
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.model.optimizer
        lr = optimizer.param_groups[0]["lr"]
        try:
            new = self.schedule(epoch, lr)
        except TypeError:  # Keras accepts schedule(epoch) too
            new = self.schedule(epoch)
        if isinstance(new, bool) or not isinstance(new, (int, float)):
            raise OptionsError(f"the LearningRateScheduler's schedule returned {new!r} for epoch "
                               f"{epoch}; it must return a float")
        for group in optimizer.param_groups:
            group["lr"] = float(new)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {new}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self.model.optimizer.param_groups[0]["lr"]


class CallbackList:
    """Calls a hook on every callback in order (``fit``'s, ``evaluate``'s, ``predict``'s)."""

    def __init__(self, callbacks, model, params: dict):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise OptionsError(f"callbacks must be keras.callbacks.Callback objects, got "
                                   f"{type(cb).__name__}; subclass keras.callbacks.Callback")
        for cb in self.callbacks:
            cb.set_model(model)
            cb.set_params(params)

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args):
            for cb in self.callbacks:
                getattr(cb, hook)(*args)
        return call


class RunningLogs:
    """The logs of a pass over the data: the running mean of ``loss`` over batches, and of
    each metric over samples, as Keras' logs hold them ([Note: Keras batch hooks]).

    Example:
        >>> logs = RunningLogs([], True)
        >>> logs.add(torch.tensor(2.0), torch.zeros(4, 1), torch.zeros(4, 1))
        >>> logs.add(torch.tensor(1.0), torch.zeros(4, 1), torch.zeros(4, 1))
        >>> logs.logs()
        {'loss': 1.5}
    """

    def __init__(self, metrics: list, with_loss: bool):
        self.metrics, self.with_loss = metrics, with_loss
        self.loss, self.batches, self.sums, self.samples = 0.0, 0, [0.0] * len(metrics), 0

    def add(self, loss, y_pred, y_true) -> None:
        self.batches += 1
        self.samples += y_pred.shape[0]
        if self.with_loss:
            self.loss += float(loss)
        for k, (_, fn) in enumerate(self.metrics):
            v = fn(y_true, y_pred).detach().double()
            self.sums[k] += float(v.sum() if v.dim() else v * y_pred.shape[0])

    def logs(self) -> dict:
        logs = {"loss": self.loss / self.batches} if self.with_loss else {}
        logs.update({name: s / self.samples for (name, _), s in zip(self.metrics, self.sums)})
        return logs


def format_logs(logs: dict) -> str:
    """``"loss: 0.1234 - accuracy: 0.9876"``, as Keras' progress lines show logs."""
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())
