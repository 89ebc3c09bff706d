"""PopTorch's DataLoader: combined batches for one call of a wrapped model."""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

from .. import errors
from ..distributed.layout import Layout
from ..enums import DataLoaderMode
from ..options.options import Options, combined_batch_size
from .async_data import AsynchronousDataAccessor

_ASYNC_OPTION_KEYS = ("buffer_size", "miss_sleep_time_in_ms", "load_indefinitely",
                      "early_preload", "sharing_strategy")


class _ProcessBlockSampler(torch.utils.data.Sampler):
    """Process p's contiguous block of the dataset, optionally of one global shuffle.

    With P processes and combined batch C (drop_last=True) each process reads
    ``per_proc = C * (n // (C * P))`` items; the L = n - P * per_proc leftovers
    are read by nobody that epoch::

        position  0 ......... per_proc ........ 2*per_proc ..... n
                  [  process 0  ][  process 1  ][ leftovers L ]

    With shuffle, position k holds ``randperm(n)[k]`` drawn from a generator
    seeded with ``seed + epoch`` (the same in every process), and on odd epochs
    every block shifts right by L so leftovers get used (PopTorch's swap_range).
    With drop_last=False the n items are split as evenly as possible instead.
    """

    def __init__(self, n: int, step: int, p: int, P: int, drop_last: bool, shuffle: bool,
                 seed: Optional[int]):
        if drop_last:
            per_proc = step * (n // (step * P))
            self._start, self._length, self._leftovers = p * per_proc, per_proc, n - P * per_proc
        else:
            sizes = [n // P + (n % P > q) for q in range(P)]
            self._start, self._length, self._leftovers = sum(sizes[:p]), sizes[p], 0
        self._n, self._shuffle, self._seed = n, shuffle, seed
        self.epoch = 0

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[int]:
        if not self._shuffle:
            return iter(range(self._start, self._start + self._length))
        order = torch.randperm(self._n, generator=torch.Generator().manual_seed(self._seed + self.epoch))
        start = self._start + (self._leftovers if self.epoch % 2 else 0)
        return iter(order[start:start + self._length].tolist())

    @classmethod
    def steps(cls, n: int, combined: int, P: int, shuffle: bool, seed: Optional[int],
              epoch: int) -> list:
        """Epoch ``epoch`` of P processes' blocks (drop_last) as the steps read it: step t is
        the t-th combined batch of process 0, then of process 1, ... ([Note: global loader
        position]).

        Example:
            >>> _ProcessBlockSampler.steps(10, 2, 2, False, None, 0)
            [[0, 1, 4, 5], [2, 3, 6, 7]]
        """
        blocks = []
        for p in range(P):
            sampler = cls(n, combined, p, P, True, shuffle, seed)
            sampler.epoch = epoch
            blocks.append(list(sampler))
        return [[i for block in blocks for i in block[t * combined:(t + 1) * combined]]
                for t in range(len(blocks[0]) // combined)]


class _CombinedBatchSampler(torch.utils.data.Sampler):
    """Concatenates every ``factor`` consecutive batches of a user's batch sampler."""

    def __init__(self, batch_sampler: Iterable[list], factor: int, drop_last: bool):
        self.batch_sampler, self._factor, self._drop_last = batch_sampler, factor, drop_last

    def __len__(self) -> int:
        full, rest = divmod(len(self.batch_sampler), self._factor)
        return full + int(rest > 0 and not self._drop_last)

    def __iter__(self) -> Iterator[list]:
        group, count = [], 0
        for batch in self.batch_sampler:
            group, count = group + list(batch), count + 1
            if count == self._factor:
                yield group
                group, count = [], 0
        if count and not self._drop_last:
            yield group


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` whose batch is the combined batch of one model call.

    The torch batch size is ``combined_batch_size(options, batch_size)``
    (B·D·(R/g)·G; POPTORCH_REFERENCE §1, §8). Unlike torch: ``drop_last``
    defaults to True; ``options`` are frozen; with ``Distributed.numProcesses``
    P > 1 each process reads its own contiguous block (see ``set_epoch``); mode
    Async/AsyncRebatched loads ahead in a thread through an
    :class:`AsynchronousDataAccessor` (the same batches in the same order as
    Sync). ``terminate()`` stops an Async loader's thread and its worker processes;
    so does dropping the loader, and the interpreter's exit ([Note: workers outlive
    no loader] in ``async_data``).

    Args:
        options: the ``Options`` the model is wrapped with.
        dataset: a map-style or iterable dataset.
        batch_size: the micro-batch size B (None: no batching, as in torch).
        shuffle, num_workers: as torch (shuffle defaults to False).
        drop_last: drop a short last combined batch (default True); False warns.
        persistent_workers: defaults to ``num_workers > 0``.
        auto_distributed_partitioning: split the dataset between processes.
        mode: a ``DataLoaderMode``; Async with drop_last=False acts as AsyncRebatched.
        async_options: keyword arguments of the accessor (not ``rebatched_size``).
        rebatched_worker_size: AsyncRebatched: an IterableDataset's torch batch
            size before the accessor rebatches (default: the combined batch); ignored in
            the other modes, as PopTorch does.
        batch_sampler: yields micro-batches of indices; a combined batch joins
            ``combined_batch_size(options, 1)`` consecutive ones.
        **kwargs: passed to ``torch.utils.data.DataLoader``.

    Raises:
        errors.DataLoaderError: an argument is invalid or arguments conflict.

    Example:
        >>> opts = Options().deviceIterations(2)
        >>> loader = DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=2)
        >>> loader.combinedBatchSize, len(loader)
        (4, 2)
    """

    def __init__(self, options: Options, dataset: torch.utils.data.Dataset, batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None, num_workers: int = 0, drop_last: bool = True,
                 persistent_workers: Optional[bool] = None, auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync, async_options: Optional[dict] = None,
                 rebatched_worker_size: Optional[int] = None, batch_sampler: Optional[Iterable] = None,
                 **kwargs: Any):
        self._accessor: Optional[AsynchronousDataAccessor] = None
        if not isinstance(options, Options):
            raise errors.DataLoaderError(f"DataLoader's first argument must be poptorch_lite.Options, "
                                         f"got {type(options).__name__}; call DataLoader(opts, dataset, ...)")
        mode, async_options = _check_mode(mode, async_options)
        shuffle = bool(shuffle)
        is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        # The n processes of one pipeline read the same data ([Note: stages in other processes]
        # in distributed): the loader shards over the W/n pipelines ([Note: process layout]).
        d = options.Distributed
        layout = Layout(d.process_id, d.num_processes, d.ipu_processes, d.process_order)
        P, p = max(layout.pipelines, 1), layout.pipeline if layout.pipelines else 0
        distributed = P > 1 and auto_distributed_partitioning
        self._processes = P  # the data-parallel processes an epoch is split between
        self._pipeline = p if distributed else 0  # this process's share of the epoch
        self._epoch_sampler: Optional[_ProcessBlockSampler] = None
        self._rebatched_size: Optional[int] = None
        self._rebatched_drop_last = drop_last
        args: dict[str, Any] = dict(shuffle=shuffle, drop_last=drop_last)

        if batch_sampler is not None:
            if batch_size not in (1, None) or shuffle:
                raise errors.DataLoaderError(
                    f"batch_sampler is mutually exclusive with batch_size and shuffle (got batch_size="
                    f"{batch_size}, shuffle={shuffle}); leave them unset, the sampler chooses batches")
            if distributed:
                raise errors.DataLoaderError(
                    f"a batch_sampler cannot be split between {P} processes; give each process its "
                    f"own batch_sampler and pass auto_distributed_partitioning=False")
            micro = getattr(batch_sampler, "batch_size", None)
            self._combined = combined_batch_size(options, micro) if isinstance(micro, int) else None
            args = dict(batch_sampler=_CombinedBatchSampler(
                batch_sampler, combined_batch_size(options, 1), drop_last))
        else:
            if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
                raise errors.DataLoaderError(f"batch_size must be a positive int or None, got {batch_size!r}")
            self._combined = None if batch_size is None else combined_batch_size(options, batch_size)
            args.update(batch_size=self._combined, drop_last=drop_last and batch_size is not None)

        if is_iterable:
            if distributed:
                raise errors.DataLoaderError(
                    f"auto_distributed_partitioning cannot split an IterableDataset between {P} "
                    f"processes; shard it yourself and pass auto_distributed_partitioning=False")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                warnings.warn(f"IterableDataset with num_workers={num_workers} and no worker_init_fn: "
                              f"every element comes {num_workers} times; pass a worker_init_fn that "
                              f"shards the dataset", errors.PoptorchLiteWarning, stacklevel=2)
        elif batch_sampler is None and self._combined is not None:
            n, step = len(dataset), self._combined * (P if distributed else 1)
            if drop_last and n < step:
                raise errors.DataLoaderError(
                    f"the dataset has {n} items, fewer than the {step} one step reads (combined batch "
                    f"{self._combined} x {P if distributed else 1} processes), so the loader would be "
                    f"empty; use a smaller batch_size or options, or drop_last=False")
            if not drop_last and n % step:
                warnings.warn(f"the dataset has {n} items, not a multiple of the {step} one step reads, "
                              f"and drop_last=False: the last batch has {n % step} items; pass "
                              f"drop_last=True to avoid it", errors.PoptorchLiteWarning, stacklevel=2)
            if distributed:
                if shuffle and options.random_seed is None:
                    raise errors.DataLoaderError(
                        "shuffle=True with auto_distributed_partitioning needs the same order in every "
                        "process: call options.randomSeed(N) with the same N in every process")
                if "sampler" in kwargs:
                    raise errors.DataLoaderError("a sampler cannot be combined with auto_distributed_"
                                                 "partitioning; pass auto_distributed_partitioning=False")
                self._epoch_sampler = _ProcessBlockSampler(n, self._combined, p, P, drop_last, shuffle,
                                                           options.random_seed)
                args.update(sampler=self._epoch_sampler, shuffle=False)
        elif distributed and batch_sampler is None:
            raise errors.DataLoaderError("batch_size=None cannot be split between processes; pass a "
                                         "batch_size or auto_distributed_partitioning=False")

        if mode == DataLoaderMode.Async and not drop_last:
            mode = DataLoaderMode.AsyncRebatched
        # PopTorch reads rebatched_worker_size only in AsyncRebatched mode; elsewhere it is
        # ignored (optimum-graphcore passes it with Sync loaders).
        if mode == DataLoaderMode.AsyncRebatched and rebatched_worker_size is not None and (
                self._combined is None or not 1 <= rebatched_worker_size <= self._combined):
            raise errors.DataLoaderError(
                f"rebatched_worker_size ({rebatched_worker_size}) must be 1 <= it <= the "
                f"combined batch ({self._combined}) with mode=DataLoaderMode.AsyncRebatched; "
                f"pass a size in that range, or none")
        if mode == DataLoaderMode.AsyncRebatched and is_iterable and self._combined is not None:
            # Workers send what they have; the accessor cuts exact combined batches from it.
            self._rebatched_size = self._combined
            args.update(batch_size=rebatched_worker_size or self._combined, drop_last=False)

        # [Note: global loader position]: how to rebuild an epoch's order in another split
        self._order = None
        if (batch_sampler is None and self._combined is not None and drop_last and not is_iterable
                and not {"sampler", "generator"} & kwargs.keys() and (distributed or P == 1)):
            self._order = {"n": len(dataset), "shuffle": shuffle, "seed": options.random_seed,
                           "blocks": distributed}
        options._freeze()  # only once every argument is accepted
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        super().__init__(dataset, num_workers=num_workers, persistent_workers=persistent_workers,
                         **args, **kwargs)
        self._options = options
        self._next_epoch = 0
        # [Note: loader position]: the epoch being read, its batches handed out, the random
        # state its sampler started from, and a pending resume from load_state_dict().
        self._epoch, self._consumed, self._epoch_rng = 0, 0, None
        self._resume: Optional[tuple] = None
        # [Note: global loader position]: the rest of an epoch saved in another split, read
        # by the next epoch (pending) or by this one: (origin, samples of it read, my batches)
        self._rest_next: Optional[tuple] = None
        self._rest: Optional[tuple] = None
        if mode != DataLoaderMode.Sync:
            self._accessor = AsynchronousDataAccessor(self, **async_options,
                                                      rebatched_size=self._rebatched_size,
                                                      _loader_owned=True)

    @property
    def combinedBatchSize(self) -> Optional[int]:
        """Items one model call consumes from the dataset (None if unbatched)."""
        return self._combined

    # PopTorch's own attribute, which programs read (speech/conformer's trainer): read-only
    _combined_batch_size = combinedBatchSize

    @property
    def options(self) -> Options:
        """The (frozen) options this loader was built with."""
        return self._options

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next iteration uses; later iterations count up from it.

        Only the distributed shuffle depends on it: its order is drawn from
        ``randomSeed + epoch``, identically in every process. Without calls,
        iterations are epochs 0, 1, 2, ... (every epoch differs, as in
        PopTorch); calling ``set_epoch(e)`` before epoch e, as with torch's
        DistributedSampler, gives the same orders. In Async mode an epoch
        already preloaded under the old number is discarded.

        Example:
            >>> loader.set_epoch(3)  # doctest: +SKIP
        """
        self._next_epoch = epoch
        if self._accessor is not None:
            self._accessor._discard_preloaded()

    def terminate(self) -> None:
        """Stops the Async worker thread and the worker processes it used (no effect in Sync
        mode), as PopTorch's ``terminate()`` and ``__del__`` do; collecting the loader stops
        them too ([Note: workers outlive no loader] in ``async_data``).

        Example:
            >>> loader.terminate()  # doctest: +SKIP
        """
        if self._accessor is not None:
            self._accessor.terminate()
            workers, self._iterator = self._iterator, None  # torch's persistent workers
            if workers is not None and hasattr(workers, "_shutdown_workers"):
                workers._shutdown_workers()

    def __len__(self) -> int:
        if self._rebatched_size is None:
            return super().__len__()
        full, rest = divmod(len(self.dataset), self._rebatched_size)
        return full + int(rest > 0 and not self._rebatched_drop_last)

    def __iter__(self) -> Iterator[Any]:
        if self._accessor is not None:
            return iter(self._accessor)
        return self._counted(self._sync_iter())

    def _sync_iter(self, own_iterator: bool = False) -> Iterator[Any]:
        """One epoch of the torch loader (the Async accessor calls this as it opens one). With
        ``own_iterator`` (a user's accessor over this loader) a torch iterator of its own, with
        worker processes of its own for the epoch, so that iterating the loader directly at
        the same time does not reset it under the accessor's thread."""
        if self._epoch_sampler is not None:
            self._epoch_sampler.epoch = self._next_epoch
        self._epoch, self._consumed = self._next_epoch, 0
        self._rest, self._rest_next = self._rest_next, None
        if self._resume is not None:  # [Note: loader position]: restore after the skip
            self._consumed = self._resume[1]  # the skipped batches were handed out before
            self._resume = (*self._resume[:2], torch.get_rng_state())
        self._next_epoch += 1
        return self._get_iterator() if own_iterator else super().__iter__()

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._consumed += 1
            yield batch

    @property
    def _index_sampler(self):
        # torch's iterators read their indices from here at the start of every epoch.
        return _EpochIndices(super()._index_sampler, self)

    def state_dict(self) -> dict:
        """The loader's position: the epoch, the batches of it handed out, the random state
        its shuffle started from, and how the epoch was split (the processes, the combined
        batch, the batches per epoch) ([Note: loader position]; saved in checkpoints).

        Raises:
            errors.DataLoaderError: the loader is not in Sync mode.

        Example:
            >>> opts = Options()
            >>> loader = DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(6.0)), 2)
            >>> batches = iter(loader)
            >>> _ = next(batches)
            >>> {k: v for k, v in loader.state_dict().items() if k not in ("rng", "order")}
            {'epoch': 0, 'batches': 1, 'processes': 1, 'combined': 2, 'batches_per_epoch': 3, 'rest': None}
        """
        if self._accessor is not None:
            raise errors.DataLoaderError(
                "the position of an Async-mode DataLoader cannot be saved: it reads ahead in a "
                "thread, so its position is not the training's; use mode=DataLoaderMode.Sync")
        rest = self._rest_next or self._rest
        return {"epoch": self._epoch, "batches": self._consumed, "rng": self._epoch_rng,
                "processes": self._processes, "combined": self._combined,
                "batches_per_epoch": self._batches_per_epoch(), "order": self._order,
                "rest": None if rest is None else {"origin": rest[0], "skip": rest[1]}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict`): the next iteration reads the rest of
        that epoch, in the same order, without loading the batches it skips. Where the epoch
        was split otherwise (another data-parallel process count or combined batch), the
        processes share out the samples of the epoch that no process has read yet, step by
        step in the order the saving processes would have read them ([Note: global loader
        position]).

        Raises:
            errors.DataLoaderError: the state is not a loader position, the loader is not
                in Sync mode, an IterableDataset would have to skip batches, or the position
                is inside an epoch that this loader cannot continue in another split.
        """
        epoch, batches, rng, total, finished, rest = self._check_position(state)
        self.set_epoch(epoch + 1 if finished else epoch)
        if rest is not None:
            self._epoch, self._consumed, self._epoch_rng = epoch, 0, rng
            self._resume, self._rest_next = None, (*rest, self._share(*rest))
            return
        self._epoch, self._consumed, self._epoch_rng = epoch, total if finished else batches, rng
        self._resume = (rng, batches) if 0 < batches < total and not finished else None

    def _check_position(self, state: dict) -> tuple:
        """``(epoch, batches, rng, batches per epoch here, finished, rest)`` of a position that
        this loader can continue (it changes nothing; raises as :meth:`load_state_dict`);
        ``rest`` is ``(origin, samples read)`` where the rest of the epoch is shared out anew.

        A position inside an epoch continues in the same split by skipping the batches read;
        in another split ([Note: global loader position]) only where both loaders read whole
        combined batches (drop_last) of the same dataset through the epoch's own order
        (no sampler of the user's); elsewhere samples would be read twice or never. A
        finished epoch continues anywhere. A position saved before its split was recorded is
        taken to be this one's.
        """
        self.state_dict()  # refuses Async mode
        try:
            epoch, batches, rng = int(state["epoch"]), int(state["batches"]), state["rng"]
        except (KeyError, TypeError, ValueError) as e:
            raise errors.DataLoaderError(
                f"not a DataLoader position: {state!r} ({type(e).__name__}: {e}); pass what "
                f"DataLoader.state_dict() returned") from None
        if batches and isinstance(self.dataset, torch.utils.data.IterableDataset):
            raise errors.DataLoaderError(
                f"an IterableDataset cannot skip to batch {batches} of epoch {epoch}; save "
                f"checkpoints at epoch ends (or make the dataset resumable yourself)")
        saved_rest = state.get("rest")
        total = len(self) if batches or saved_rest else 0  # an IterableDataset may have no len()
        saved = state.get("batches_per_epoch", total)
        finished = 0 < batches == saved
        split = (state.get("processes", self._processes), state.get("combined", self._combined))
        inside = not finished and (0 < batches or saved_rest is not None)
        if inside and (saved_rest is not None or (*split, saved) != (
                self._processes, self._combined, total)):
            return epoch, batches, rng, total, False, self._rest_of(state, split, saved)
        if not finished and (not 0 <= batches <= total or (0 < batches < total and rng is None)):
            raise errors.DataLoaderError(
                f"the position {batches} of epoch {epoch} does not fit this loader of {total} "
                f"batches per epoch; load a position saved from a loader of the same dataset, "
                f"batch size and options")
        return epoch, batches, rng, total, finished, None

    def _rest_of(self, state: dict, split: tuple, saved) -> tuple:
        """``(origin, samples of its rest read)`` of a position inside an epoch saved in
        another split, once this loader can share out its rest ([Note: global loader
        position])."""
        rest = state.get("rest")
        origin = rest["origin"] if rest is not None else state
        order = origin.get("order")
        if self._order is None or state.get("order") is None or order is None or \
                order["n"] != self._order["n"] or (order["shuffle"] and not order["blocks"]
                                                   and origin.get("rng") is None):
            procs = f"{split[0]} process{'es' if split[0] != 1 else ''}"
            why = (f": its dataset had {order['n']} samples, this loader's has "
                   f"{self._order['n']}" if self._order is not None and order is not None and
                   order["n"] != self._order["n"] else
                   ": this loader or the saving one reads through a sampler of the user's, "
                   "drop_last=False, unbatched or unsplit data")
            raise errors.DataLoaderError(
                f"the position (batch {state['batches']} of {saved} of epoch {state['epoch']}) "
                f"was saved in the middle of an epoch by {procs}, each reading combined batches "
                f"of {split[1]}, but this loader reads {len(self)} combined batches of "
                f"{self._combined} in {self._processes} process"
                f"{'es' if self._processes != 1 else ''}, and the rest of that epoch cannot be "
                f"shared out anew{why}: samples would be read twice or never. Resume "
                f"with {procs} and the same dataset, batch size and options, or from a position "
                f"saved at an epoch's end (the next epoch may use any)")
        if rest is None:  # the origin itself: its batches are counted in it
            return origin, 0
        return origin, int(rest["skip"]) + int(state["batches"]) * split[0] * split[1]

    def _share(self, origin: dict, read: int) -> list:
        """This process's batches of the rest of ``origin``'s epoch after ``read`` samples of
        it ([Note: global loader position])."""
        samples = [i for step in _epoch_steps(origin)[int(origin["batches"]):] for i in step]
        samples = samples[read:]
        width, mine = self._processes * self._combined, self._pipeline * self._combined
        return [samples[t * width + mine:t * width + mine + self._combined]
                for t in range(len(samples) // width)]

    def _batches_per_epoch(self) -> Optional[int]:
        if self._rest_next is not None or self._rest is not None:
            return len((self._rest_next or self._rest)[2])
        try:
            return len(self)
        except TypeError:  # an IterableDataset without a length
            return None


class _EpochIndices(torch.utils.data.Sampler):
    """One epoch of a loader's index sampler, recording where its random order came from.

    [Note: loader position]
    A loader's position is (epoch, batches handed out, random state). The random
    state is torch's default generator's state just before the sampler's first
    index, when a shuffling sampler draws its seed, so one epoch's order follows
    from it. Resuming sets that state, skips the batches already handed out
    (indices only: nothing is loaded), and then puts back the state the caller
    had when the iteration began, so the random numbers drawn after a resume
    (dropout, say) are those of the uninterrupted run. Transforms that draw
    random numbers in worker processes are seeded per iteration and are not
    replayed.

    [Note: global loader position]
    The position is also global: it says which samples of the epoch every
    data-parallel process has read, so that another split (other processes, or
    another combined batch per process) can read the rest of that epoch, each
    sample once. An epoch's order is rebuilt from the position: with P processes
    each reading its block of the epoch (``_ProcessBlockSampler``: from
    ``randomSeed + epoch``), step t reads the t-th combined batch of process 0,
    then of process 1, ...; in one process, torch's ``RandomSampler`` from the
    generator state the epoch began with (or the dataset in order). The samples
    of the steps not yet taken, in that order, are the rest; a loader of another
    split takes them P' × C' at a time (its processes × its combined batch) and
    reads the p'-th C' of each, so a step after the change reads the samples of
    the uninterrupted run's step wherever P' × C' = P × C. A rest that does not
    fill a last step leaves those samples unread, as ``drop_last`` does. A
    position saved inside such a rest records where it came from (the position
    it began at, and the samples of it read before), so the rest can change
    split again. This needs both loaders to read whole combined batches
    (``drop_last``) of the same dataset through its own order (no sampler,
    batch sampler or generator of the user's): elsewhere a position inside an
    epoch continues only in the split it was saved in (E-DL-22).
    """

    def __init__(self, inner: Iterable, loader: "DataLoader"):
        # Weak: torch's iterator keeps this sampler, and an Async loader's thread keeps the
        # iterator; a strong reference would keep the loader, and its workers, alive for ever
        # ([Note: workers outlive no loader] in async_data).
        self.inner, self.loader = inner, weakref.ref(loader)

    def __len__(self) -> int:
        loader = self.loader()
        if loader is not None and loader._rest_next is not None:  # the next epoch's
            return len(loader._rest_next[2])
        if loader is not None and loader._rest is not None and \
                loader._consumed < len(loader._rest[2]):  # this epoch's, still being read
            return len(loader._rest[2])
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader()
        if loader is None:  # collected: its thread is stopping
            return
        if loader._rest is not None:  # [Note: global loader position]: a shared-out rest
            loader._epoch_rng = torch.get_rng_state()
            batches = loader._rest[2]
            del loader
            yield from (list(batch) for batch in batches)
            return
        resume, loader._resume = loader._resume, None
        if resume is not None:
            torch.set_rng_state(resume[0])
        loader._epoch_rng = torch.get_rng_state()
        del loader  # not held while the epoch runs
        indices = itertools.islice(iter(self.inner), resume[1] if resume else 0, None)
        first = next(indices, _END)
        if resume is not None and len(resume) > 2:
            torch.set_rng_state(resume[2])
        if first is not _END:
            yield first
            yield from indices


_END = object()


def _epoch_steps(position: dict) -> list:
    """The epoch of ``position`` (a loader's :meth:`DataLoader.state_dict`) as its steps read
    it, each step its processes' combined batches in process order ([Note: global loader
    position]).

    Example:
        >>> _epoch_steps({"epoch": 0, "processes": 1, "combined": 2, "rng": None,
        ...               "order": {"n": 5, "shuffle": False, "seed": None, "blocks": False}})
        [[0, 1], [2, 3]]
    """
    order, P, C = position["order"], int(position["processes"]), int(position["combined"])
    if order["blocks"]:
        return _ProcessBlockSampler.steps(order["n"], C, P, order["shuffle"], order["seed"],
                                          int(position["epoch"]))
    if order["shuffle"]:  # torch's RandomSampler, from the generator state it started from
        now = torch.get_rng_state()
        try:
            torch.set_rng_state(position["rng"])
            indices = list(torch.utils.data.RandomSampler(range(order["n"])))
        finally:
            torch.set_rng_state(now)
    else:
        indices = list(range(order["n"]))
    return [indices[t * C:(t + 1) * C] for t in range(len(indices) // C)]


def _check_mode(mode: Any, async_options: Optional[dict]) -> tuple[DataLoaderMode, dict]:
    """Validates ``mode`` and the keys of ``async_options``."""
    try:
        mode = DataLoaderMode(mode)
    except ValueError:
        raise errors.DataLoaderError(f"mode must be a DataLoaderMode (Sync, Async, AsyncRebatched), "
                                     f"got {mode!r}") from None
    unknown = sorted(set(async_options or {}) - set(_ASYNC_OPTION_KEYS))
    if unknown:
        raise errors.DataLoaderError(f"unknown async_options {unknown}: the valid keys are "
                                     f"{list(_ASYNC_OPTION_KEYS)} (AsyncRebatched sets rebatched_size)")
    return mode, dict(async_options or {})
