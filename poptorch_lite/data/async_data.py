"""Asynchronous data loading: batches produced ahead in a background thread.

[Note: loader threads at exit]
A loader thread is a daemon thread, so a script that ends (or raises) without
``terminate()`` does not wait for it. But the interpreter must not finalize
while such a thread is still inside torch's C++ code (or parked on its queue):
the thread is torn down mid-call and the process aborts with ``terminate called
without an active exception`` (exit status 134). So every live epoch is
stopped *and joined* by an ``atexit`` handler, which runs before finalization;
a thread polls its stop flag every ``_POLL_S`` seconds, so the wait is at most
one item's loading time.

[Note: workers outlive no loader]
A ``DataLoader`` with ``num_workers`` keeps torch's iterator, and so its worker
processes, for as long as the loader lives (persistent workers). In Async mode
the loader thread holds that iterator, so nothing the thread holds may hold the
loader: its sampler (``dataloader._EpochIndices``) refers to the loader weakly.
Then a loader dropped without ``terminate()`` is collected as in Sync mode; the
accessor's finalizer stops the thread, and the thread, as it ends, drops the
iterator, whose workers torch shuts down. ``terminate()`` (and the exit
handler) stops and joins the thread; ``DataLoader.terminate()`` then shuts the
workers down at once, as PopTorch's ``terminate()`` and ``__del__`` do.
"""

from __future__ import annotations

import atexit
import queue
import signal
import threading
import types
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import errors
from ..runtime.plan import collection_paused

_POLL_S = 0.05  # how often a blocked loader thread or consumer re-checks for a stop


def _opens_own_epochs(dataset: Any) -> bool:
    """True for a poptorch_lite ``DataLoader``, recognised by the hooks it gives the accessor.

    A DataLoader opens each epoch through ``_sync_iter`` (which numbers the epochs),
    says through ``_rebatched_drop_last`` whether a short rebatched batch is kept,
    and holds its own accessor in ``_accessor``. Imports flow one way (dataloader
    imports this module), so the accessor looks for the hook, not the class.
    """
    return callable(getattr(dataset, "_sync_iter", None))


def _rebatch(batches: Iterable[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """Cuts a stream of batches (tensors, tuples, dicts of them) into batches of ``size`` rows."""
    pending, rows, spec = [], 0, None
    for batch in batches:
        leaves, spec = tree_flatten(batch)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise errors.DataLoaderError(
                f"rebatching needs batches whose leaves are tensors with a batch dimension, got "
                f"{[type(t).__name__ for t in leaves]}; use DataLoaderMode.Async or rebatched_size=None")
        pending, rows = pending + [leaves], rows + len(leaves[0])
        while rows >= size:
            columns = [torch.cat(column) for column in zip(*pending)]
            yield tree_unflatten([c[:size] for c in columns], spec)
            pending, rows = [[c[size:] for c in columns]], rows - size
    if rows and not drop_last:
        yield tree_unflatten([torch.cat(column) for column in zip(*pending)], spec)


class _End:
    """Marks the end of an epoch in an accessor's queue."""


class _Failure:
    """Carries an exception raised while loading to the consumer."""

    def __init__(self, error: BaseException, index: int):
        self.error, self.index = error, index


def _failing(error: BaseException) -> Iterator[Any]:
    """An iterator that raises ``error`` (opening an epoch failed)."""
    raise error
    yield  # pragma: no cover (makes this a generator)


# Every epoch whose thread may still run, for the exit handler ([Note: loader threads at exit]).
_LIVE: "weakref.WeakSet[_Epoch]" = weakref.WeakSet()
_exit_handler_registered = False


def _join_live_epochs() -> None:
    """The exit handler: stop and join every loader thread still running."""
    _stop_all(set(_LIVE))


class _Epoch:
    """One epoch, loaded ahead by a daemon thread into a bounded queue.

    The thread loads the first item at once and the rest once ``go`` is set (by the first
    ``iter()``, or at once with ``early_preload``), as PopTorch's worker loads its first
    element while it starts and waits for an iterator before it fills its buffer. ``ready``
    is set once the first item, the end or a failure is in the queue; ``first_failure`` is
    the failure when loading the first item failed."""

    def __init__(self, source: Iterator[Any], buffer_size: int, go: bool,
                 owns_source: bool = True):
        global _exit_handler_registered
        if not _exit_handler_registered:  # registered on first use: no import-time side effect
            atexit.register(_join_live_epochs)
            _exit_handler_registered = True
        self.queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self.stopping = False
        self.go, self.ready = threading.Event(), threading.Event()
        if go:
            self.go.set()
        self.first_failure: Optional[_Failure] = None
        self.owns_source = owns_source  # not a loader's persistent iterator
        self.thread = threading.Thread(target=self._run, args=(source,), daemon=True,
                                       name="poptorch_lite.AsynchronousDataAccessor")
        _LIVE.add(self)
        self.thread.start()

    def _run(self, source: Iterator[Any]) -> None:
        # Ctrl-C is the main thread's. The worker processes torch's iterator forks from this
        # thread inherit its signal mask, so a Ctrl-C cannot land in one still starting up
        # (before torch's worker loop handles it), which printed the worker's traceback.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        index = 0
        try:
            for item in source:
                if not self._put(item):
                    return
                index += 1
                if index == 1:
                    self.ready.set()
                    if not self._wait_for_go():
                        return
            self._put(_End)
        except BaseException as error:  # forwarded to the consumer
            # The error's traceback holds this frame: without the source, so that torch's
            # iterator, and its worker processes, end now, not when the caller drops the error.
            # (A loader's persistent workers stay for its next epoch, as in torch.)
            shutdown = getattr(source, "_shutdown_workers", None) if self.owns_source else None
            del source
            if shutdown is not None:  # joined here (torch 2.11 leaves failed workers unjoined)
                shutdown()
            failure = _Failure(error, index)
            if index == 0:
                self.first_failure = failure
            self._put(failure)
        finally:
            self.ready.set()

    def _wait_for_go(self) -> bool:
        while not self.stopping:
            if self.go.wait(_POLL_S):
                return True
        return False

    def _put(self, item: Any) -> bool:
        while not self.stopping:
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def get(self) -> Any:
        """The next item (or ``_End`` / a ``_Failure``), waiting for the thread; no automatic
        garbage collection meanwhile, where a Ctrl-C could land in a finalizer and be lost
        (``runtime.plan.collection_paused``)."""
        with collection_paused():
            while True:
                try:
                    return self.queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if not self.thread.is_alive() and self.queue.empty():
                        raise errors.DataLoaderError(
                            "the AsynchronousDataAccessor's thread stopped mid-epoch; create a "
                            "new accessor") from None

    def stop(self, join: bool = True) -> None:
        """Stops the thread and, with ``join``, waits for it (idempotent)."""
        self.stopping = True
        while not self.queue.empty():
            self.queue.get_nowait()
        if join and self.thread is not threading.current_thread():
            self.thread.join()


def _stop_all(epochs: set, join: bool = True) -> None:
    for epoch in list(epochs):
        epoch.stop(join)
    epochs.clear()


class AsynchronousDataAccessor:
    """Loads ahead from any iterable in a background thread; yields the same items in order.

    PopTorch loads in a separate process into a shared-memory ring buffer;
    poptorch_lite loads each epoch in a daemon thread into a bounded
    ``queue.Queue`` of ``buffer_size`` items (not reused buffers: no need to
    clone). Every ``iter()`` starts a new epoch (also after a ``break``) and
    stops the thread of the one it replaces. An exception while loading is
    re-raised by the consumer's ``next()`` as ``errors.DataLoaderError`` with
    the original as ``__cause__``. ``terminate()`` stops and joins the thread;
    garbage collection stops it, and the interpreter's exit stops and joins it
    ([Note: loader threads at exit]).

    Args:
        dataset: any iterable (a Sync ``DataLoader``, a Dataset, a list).
        buffer_size: items loaded ahead.
        miss_sleep_time_in_ms: accepted and ignored (the thread blocks on the queue).
        load_indefinitely: start loading the next epoch as soon as one ends.
        early_preload: fill the buffer at construction (the first item is loaded then in any
            case; the rest waits for the first ``iter()`` without it).
        sharing_strategy: accepted and ignored (no process, nothing to share).
        rebatched_size: cut the loaded batches into batches of this many rows
            (a short last one is dropped unless ``dataset`` is a DataLoader
            with drop_last=False).

    PopTorch's accessor starts its worker, which loads the first item, when it is made; so
    does this one, and a first item that cannot be loaded is refused there. A user's accessor
    over a Sync ``DataLoader`` reads it through torch iterators of its own (PopTorch's worker
    process reads a copy), so the loader can still be iterated directly beside it.

    Raises:
        errors.DataLoaderError: ``dataset`` is a DataLoader with its own
            accessor, or an argument is invalid, or loading the first item failed
            (the original exception is chained as ``__cause__``).

    Example:
        >>> accessor = AsynchronousDataAccessor([1, 2, 3])
        >>> list(accessor), len(accessor)
        ([1, 2, 3], 3)
        >>> accessor.terminate()
    """

    def __init__(self, dataset: Iterable[Any], buffer_size: int = 3, miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True, early_preload: bool = False, sharing_strategy: Any = None,
                 rebatched_size: Optional[int] = None, *, _loader_owned: bool = False):
        self._epochs: set[_Epoch] = set()
        self._current: Optional[_Epoch] = None
        self._next: Optional[_Epoch] = None
        self._terminated = False
        if _opens_own_epochs(dataset) and dataset._accessor is not None:
            raise errors.DataLoaderError(
                "this DataLoader already uses an AsynchronousDataAccessor internally; iterate the "
                "DataLoader itself, or build it with mode=DataLoaderMode.Sync to wrap it")
        for name, value in (("buffer_size", buffer_size), ("rebatched_size", rebatched_size or 1)):
            if not isinstance(value, int) or value < 1:
                raise errors.DataLoaderError(f"{name} must be an int >= 1, got {value!r}; "
                                             f"pass e.g. {name}=1")
        if sharing_strategy is not None or miss_sleep_time_in_ms != 0.1:
            errors.warn_once("AsynchronousDataAccessor.sharing_strategy",
                             "sharing_strategy and miss_sleep_time_in_ms tune PopTorch's loader "
                             "process; poptorch_lite loads in a thread and ignores them")
        self._dataset, self.rebatched_size = dataset, rebatched_size
        self._buffer_size, self._load_indefinitely = buffer_size, load_indefinitely
        # Garbage collection may run this on a thread that holds threading's internal locks
        # (one that is starting): it must not join, so it only tells the threads to stop.
        self._finalizer = weakref.finalize(self, _stop_all, self._epochs, False)
        self._loader_owned = _loader_owned  # the Async DataLoader's own accessor
        self._next = self._open(go=early_preload)
        self._next.ready.wait()
        failure = self._next.first_failure
        if failure is not None:
            self.terminate()
            raise errors.DataLoaderError(
                f"AsynchronousDataAccessor worker thread failed to start: loading the first item "
                f"failed: {type(failure.error).__name__}: {failure.error} (the original is chained "
                f"as __cause__; iterate the dataset directly to debug it)") from failure.error

    def _open(self, go: bool = True) -> _Epoch:
        """Opens the next epoch here (so a DataLoader's epoch number is read in order)."""
        is_loader = _opens_own_epochs(self._dataset)
        # torch's iterator forks its worker processes here, on the caller's thread: with Ctrl-C
        # held (pending, raised here once they are forked), so that none lands in a worker
        # still starting up (logging's at-fork handler printed "Exception ignored in" it),
        # as the loading thread's own mask does for what it forks (_Epoch._run)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            source = (self._dataset._sync_iter(own_iterator=not self._loader_owned) if is_loader
                      else iter(self._dataset))
            if self.rebatched_size is not None:
                drop_last = self._dataset._rebatched_drop_last if is_loader else True
                source = _rebatch(source, self.rebatched_size, drop_last)
        except Exception as error:  # reported by the first next(); Ctrl-C goes through now
            source = _failing(error)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        epoch = _Epoch(source, self._buffer_size, go, owns_source=not (is_loader and
                                                                      self._loader_owned))
        self._epochs.add(epoch)
        return epoch

    @property
    def _worker(self) -> Optional[types.SimpleNamespace]:
        """What PopTorch's tests read of its worker: ``_worker._data_buffers.indices_mem``, a
        flag per slot of the buffer, 1 where a loaded item waits to be read (None once
        terminated)."""
        if self._terminated:
            return None
        epoch = self._current or self._next
        loaded = min(epoch.queue.qsize(), self._buffer_size) if epoch is not None else 0
        flags = [1] * loaded + [0] * (self._buffer_size - loaded)
        return types.SimpleNamespace(_data_buffers=types.SimpleNamespace(indices_mem=flags))

    def _close(self, epoch: Optional[_Epoch]) -> None:
        if epoch is not None:
            epoch.stop()
            self._epochs.discard(epoch)

    def _discard_preloaded(self) -> None:
        """Drops an epoch opened ahead (the DataLoader's epoch number changed)."""
        self._close(self._next)
        self._next = None

    def terminate(self) -> None:
        """Stops the thread and waits for it; iterating afterwards raises.

        Example:
            >>> AsynchronousDataAccessor(range(3)).terminate()
        """
        self._terminated = True
        self._current = self._next = None
        self._finalizer.detach()
        _stop_all(self._epochs)

    def __len__(self) -> int:
        if self.rebatched_size is None or getattr(self._dataset, "_accessor", None) is self:
            return len(self._dataset)
        rows = len(self._dataset) * (getattr(self._dataset, "batch_size", None) or 1)
        return rows // self.rebatched_size

    def __iter__(self) -> Iterator[Any]:
        self._check_live()
        self._close(self._current)
        self._current, self._next = self._next or self._open(), None
        self._current.go.set()
        return self._items(self._current)

    def _items(self, epoch: _Epoch) -> Iterator[Any]:
        """One epoch's items; ends early if a later ``iter()`` replaced the epoch."""
        while epoch is self._current:
            item = epoch.get()
            if item is _End or isinstance(item, _Failure):
                self._close(epoch)
                self._current = None
                if item is _End and self._load_indefinitely:
                    self._next = self._open()
            if isinstance(item, _Failure):
                raise errors.DataLoaderError(
                    f"loading item {item.index} of an epoch failed in the AsynchronousDataAccessor's "
                    f"thread: {type(item.error).__name__}: {item.error} (the original is chained as "
                    f"__cause__; use DataLoaderMode.Sync to debug it in the main thread)") from item.error
            if item is _End:
                return
            yield item
        self._check_live()

    def _check_live(self) -> None:
        if self._terminated:
            raise errors.DataLoaderError("this AsynchronousDataAccessor (or its DataLoader) was "
                                         "terminated; create a new one")
