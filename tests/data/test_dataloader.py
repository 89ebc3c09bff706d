"""Tests of poptorch_lite.data.dataloader: combined batches, partitioning, the async accessor."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, SequentialSampler, TensorDataset

from poptorch_lite import errors
from poptorch_lite.data.dataloader import AsynchronousDataAccessor, DataLoader
from poptorch_lite.enums import DataLoaderMode
from poptorch_lite.options.options import Options

from patience import limit, wait_until

THREAD_NAME = "poptorch_lite.AsynchronousDataAccessor"


def data(n: int) -> TensorDataset:
    """Row i is (features [3i, 3i+1, 3i+2], label i): a batch's labels are its indices."""
    return TensorDataset(torch.arange(3 * n, dtype=torch.float32).view(n, 3), torch.arange(n))


def labels(loader) -> list[list[int]]:
    return [y.tolist() for _, y in loader]


def opts(D: int = 1, R: int = 1, G: int = 1) -> Options:
    o = Options()
    o.deviceIterations(D)
    o.replicationFactor(R)
    o.Training.gradientAccumulation(G)
    return o


def process_opts(p: int, P: int, D: int = 1, seed: int | None = None) -> Options:
    o = opts(D)
    o.Distributed.configureProcessId(p, P)
    if seed is not None:
        o.randomSeed(seed)
    return o


def accessor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    assert accessor_threads() == [], "a test left an AsynchronousDataAccessor thread running"


@pytest.fixture
def loaders():
    """Collects Async loaders and accessors and terminates them after the test."""
    made = []
    yield made
    for item in made:
        item.terminate()


# -- combined batches ---------------------------------------------------------------------------


@pytest.mark.parametrize("D,R,G", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 3), (2, 2, 2), (3, 1, 2)])
def test_combined_batch_shape_and_count(D, R, G):
    B, n = 2, 50
    combined = B * D * R * G
    loader = DataLoader(opts(D, R, G), data(n), batch_size=B)
    assert loader.combinedBatchSize == loader._combined_batch_size == combined  # PopTorch's too
    batches = list(loader)
    assert len(loader) == len(batches) == n // combined
    for x, y in batches:
        assert x.shape == (combined, 3) and y.shape == (combined,)


def test_batch_size_none_has_no_combined_batch():
    loader = DataLoader(opts(D=2), data(4), batch_size=None)
    assert loader.combinedBatchSize is None
    assert [y.item() for _, y in loader] == [0, 1, 2, 3]


def test_first_batch_is_first_combined_rows_in_order():
    ds = data(20)
    x, y = next(iter(DataLoader(opts(D=2, G=2), ds, batch_size=2)))
    torch.testing.assert_close(x, ds.tensors[0][:8])
    assert labels(DataLoader(opts(D=2, G=2), ds, batch_size=2)) == [list(range(0, 8)), list(range(8, 16))]


def test_drop_last_true_drops_short_batch():
    loader = DataLoader(opts(D=2), data(10), batch_size=2)
    assert len(loader) == 2
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_drop_last_false_warns_and_yields_short_last_batch():
    with pytest.warns(errors.PoptorchLiteWarning, match=r"10 items.*last batch has 2 items"):
        loader = DataLoader(opts(D=2), data(10), batch_size=2, drop_last=False)
    assert len(loader) == 3
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_dataset_smaller_than_one_combined_batch_raises():
    with pytest.raises(errors.DataLoaderError, match="has 3 items, fewer than the 4"):
        DataLoader(opts(D=2), data(3), batch_size=2)


def test_shuffle_same_seed_same_order():
    def epoch(seed):
        torch.manual_seed(seed)
        return labels(DataLoader(opts(), data(16), batch_size=4, shuffle=True))

    first = epoch(0)
    assert first == epoch(0)
    assert first != epoch(1)
    assert first != labels(DataLoader(opts(), data(16), batch_size=4))
    assert sorted(sum(first, [])) == list(range(16))


def test_options_frozen_after_construction():
    o = opts(D=2)
    DataLoader(o, data(8), batch_size=1)
    assert o.is_frozen
    with pytest.raises(errors.FrozenOptionsError):
        o.deviceIterations(4)


def test_options_must_be_options():
    with pytest.raises(errors.DataLoaderError, match="must be poptorch_lite.Options, got dict"):
        DataLoader({}, data(8))


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_bad_batch_size_raises(bad):
    with pytest.raises(errors.DataLoaderError, match="batch_size must be a positive int"):
        DataLoader(opts(), data(8), batch_size=bad)


def test_persistent_workers_default_follows_num_workers():
    assert DataLoader(opts(), data(8)).persistent_workers is False
    assert DataLoader(opts(), data(8), num_workers=1).persistent_workers is True


# -- batch_sampler --------------------------------------------------------------------------------


def test_batch_sampler_batches_are_concatenated():
    irregular = [[3], [0, 1], [5, 6, 7], [2], [4]]
    loader = DataLoader(opts(D=2), data(8), batch_sampler=irregular)
    assert labels(loader) == [[3, 0, 1], [5, 6, 7, 2]]  # [4] alone is dropped (drop_last=True)
    assert len(loader) == 2
    loader = DataLoader(opts(D=2), data(8), batch_sampler=irregular, drop_last=False)
    assert labels(loader) == [[3, 0, 1], [5, 6, 7, 2], [4]]
    assert len(loader) == 3
    sampler = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=False)
    loader = DataLoader(opts(D=2), data(8), batch_sampler=sampler)
    assert loader.combinedBatchSize == 4
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("kwargs", [dict(batch_size=2), dict(shuffle=True)])
def test_batch_sampler_is_exclusive_with_batch_size_and_shuffle(kwargs):
    with pytest.raises(errors.DataLoaderError, match="mutually exclusive"):
        DataLoader(opts(), data(8), batch_sampler=[[0, 1]], **kwargs)


# -- distributed partitioning ---------------------------------------------------------------------


def test_distributed_blocks_are_contiguous_and_cover_every_index_once():
    per_process = [sum(labels(DataLoader(process_opts(p, 2, D=2), data(24), batch_size=1)), [])
                   for p in range(2)]
    assert per_process == [list(range(0, 12)), list(range(12, 24))]
    # 22 items, combined 2, 2 processes: 2 * (22 // 4) = 10 each, leftovers 20 and 21 unread.
    per_process = [sum(labels(DataLoader(process_opts(p, 2, D=2), data(22), batch_size=1)), [])
                   for p in range(2)]
    assert per_process == [list(range(0, 10)), list(range(10, 20))]


def test_distributed_drop_last_false_splits_evenly():
    with pytest.warns(errors.PoptorchLiteWarning):
        loader = DataLoader(process_opts(1, 2, D=2), data(11), batch_size=1, drop_last=False)
    assert labels(loader) == [[6, 7], [8, 9], [10]]


def test_distributed_shuffle_is_global_and_set_epoch_changes_it_deterministically():
    def epoch(e: int) -> list[list[int]]:
        out = []
        for p in range(2):
            loader = DataLoader(process_opts(p, 2, D=2, seed=7), data(24), batch_size=1, shuffle=True)
            loader.set_epoch(e)
            out.append(sum(labels(loader), []))
        return out

    e0, e1 = epoch(0), epoch(1)
    for parts in (e0, e1):
        assert len(parts[0]) == len(parts[1]) == 12
        assert sorted(parts[0] + parts[1]) == list(range(24))
    assert e0 != e1
    assert e0 != [list(range(12)), list(range(12, 24))]
    assert epoch(1) == e1
    # Without set_epoch, successive iterations are epochs 0, 1, ...
    loader = DataLoader(process_opts(0, 2, D=2, seed=7), data(24), batch_size=1, shuffle=True)
    assert [sum(labels(loader), []) for _ in range(2)] == [e0[0], e1[0]]


def test_distributed_shuffle_uses_leftovers_on_odd_epochs():
    seen = set()
    for e in range(2):
        for p in range(2):
            loader = DataLoader(process_opts(p, 2, seed=3), data(5), batch_size=2, shuffle=True)
            loader.set_epoch(e)
            seen.update(sum(labels(loader), []))
    assert seen == set(range(5))


def test_distributed_shuffle_needs_random_seed():
    with pytest.raises(errors.DataLoaderError, match="randomSeed"):
        DataLoader(process_opts(0, 2), data(8), batch_size=1, shuffle=True)


def test_distributed_without_auto_partitioning_reads_everything():
    loader = DataLoader(process_opts(1, 2), data(4), batch_size=2, auto_distributed_partitioning=False)
    assert labels(loader) == [[0, 1], [2, 3]]


class Count(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))

    def __len__(self):
        return self.n


def test_iterable_dataset_cannot_be_distributed():
    with pytest.raises(errors.DataLoaderError, match="IterableDataset"):
        DataLoader(process_opts(0, 2), Count(8), batch_size=1)


def test_iterable_dataset_with_workers_and_no_worker_init_fn_warns():
    with pytest.warns(errors.PoptorchLiteWarning, match="num_workers=2 and no worker_init_fn"):
        DataLoader(opts(), Count(8), batch_size=1, num_workers=2)


# -- async ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched])
@pytest.mark.parametrize("drop_last", [True, False])
def test_async_yields_exactly_the_sync_batches(loaders, mode, drop_last):
    def make(m):
        return DataLoader(process_opts(1, 2, D=2, seed=5), data(30), batch_size=2, shuffle=True,
                          drop_last=drop_last, mode=m)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # drop_last=False warns; not under test here
        sync, asyn = make(DataLoaderMode.Sync), make(mode)
    loaders.append(asyn)
    assert len(asyn) == len(sync)
    for _ in range(3):  # epochs: the preloaded next epoch has the same order as Sync's
        expected, got = list(sync), list(asyn)
        assert len(got) == len(expected) > 0
        for (xe, ye), (xg, yg) in zip(expected, got):
            torch.testing.assert_close(xg, xe)
            torch.testing.assert_close(yg, ye)


def test_async_set_epoch_discards_preloaded_epoch(loaders):
    def make(m):
        return DataLoader(process_opts(0, 2, seed=5), data(16), batch_size=2, shuffle=True, mode=m)

    sync, asyn = make(DataLoaderMode.Sync), make(DataLoaderMode.Async)
    loaders.append(asyn)
    assert labels(asyn) == labels(sync)  # epoch 0; the Async loader preloads epoch 1
    sync.set_epoch(6)
    asyn.set_epoch(6)
    assert labels(asyn) == labels(sync)


def test_async_break_then_iterate_again_starts_a_new_epoch(loaders):
    loader = DataLoader(opts(), data(12), batch_size=2, mode=DataLoaderMode.Async,
                        async_options=dict(buffer_size=2))
    loaders.append(loader)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    batches = iter(loader)
    assert next(batches)[1].tolist() == [0, 1]
    assert len(accessor_threads()) == 1  # the broken-off epoch's thread was stopped
    assert [y.tolist() for _, y in batches] == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert labels(loader) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


@pytest.mark.parametrize("drop_last,expected", [(True, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                                                (False, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])])
def test_async_rebatched_iterable_dataset_cuts_exact_combined_batches(loaders, drop_last, expected):
    loader = DataLoader(opts(D=2), Count(10), batch_size=2, drop_last=drop_last,
                        mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=3)
    loaders.append(loader)
    assert len(loader) == len(expected)
    assert [b.tolist() for b in loader] == expected


def test_rebatched_worker_size_is_validated():
    with pytest.raises(errors.DataLoaderError, match=r"rebatched_worker_size \(5\).*combined batch \(4\)"):
        DataLoader(opts(D=2), Count(10), batch_size=2, mode=DataLoaderMode.AsyncRebatched,
                   rebatched_worker_size=5)
    with pytest.raises(errors.DataLoaderError, match=r"rebatched_worker_size \(0\)"):
        DataLoader(opts(), data(8), mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=0)


@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async])
def test_rebatched_worker_size_is_ignored_outside_async_rebatched(loaders, mode):
    """PopTorch reads it only with AsyncRebatched (optimum-graphcore passes it to Sync
    loaders): the batches are those of a loader without it, even out of range."""
    loader = DataLoader(opts(D=2), data(8), batch_size=2, mode=mode, rebatched_worker_size=99)
    loaders.append(loader)
    plain = DataLoader(opts(D=2), data(8), batch_size=2)
    assert [[t.tolist() for t in b] for b in loader] == [[t.tolist() for t in b] for b in plain]


@pytest.mark.parametrize("bad", [dict(buffer_sise=2), dict(rebatched_size=2)])
def test_unknown_async_option_raises(bad):
    with pytest.raises(errors.DataLoaderError, match=f"unknown async_options \\['{next(iter(bad))}'\\]"):
        DataLoader(opts(), data(8), mode=DataLoaderMode.Async, async_options=bad)


def test_accessor_over_a_dataset_yields_its_items_in_order(loaders):
    ds = data(5)
    accessor = AsynchronousDataAccessor(ds, buffer_size=1, early_preload=True)
    loaders.append(accessor)
    assert len(accessor) == 5
    for _ in range(2):
        assert [y.item() for _, y in accessor] == [0, 1, 2, 3, 4]


class Recording(Dataset):
    """Records which rows were read (from the accessor's thread)."""

    def __init__(self, n: int):
        self.n, self.seen = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        self.seen.append(i)
        return i


def test_early_preload_fills_the_buffer_before_iteration(loaders):
    # Both load their first item as they are made (PopTorch's worker does as it starts); only
    # early_preload goes on before the first iter(). PopTorch's test_early_preload reads the
    # buffer's slots through the private _worker._data_buffers.indices_mem.
    lazy, eager = Recording(10), Recording(10)
    loaders.append(AsynchronousDataAccessor(lazy, buffer_size=2))
    assert lazy.seen == [0]  # already loaded when the constructor returns
    loaders.append(AsynchronousDataAccessor(eager, buffer_size=2, early_preload=True))
    wait_until(lambda: len(eager.seen) == 3, 60, "3 items loaded")  # 2 queued, 1 to be put
    time.sleep(0.05)
    assert lazy.seen == [0] and eager.seen == [0, 1, 2]
    assert loaders[0]._worker._data_buffers.indices_mem == [1, 0]
    assert loaders[1]._worker._data_buffers.indices_mem == [1, 1]
    assert next(iter(loaders[0])) == 0
    wait_until(lambda: len(lazy.seen) == 4, 60, "4 items loaded")  # iterating fills the buffer
    loaders[0].terminate()
    assert loaders[0]._worker is None


def test_a_first_item_that_cannot_be_loaded_is_refused_by_the_constructor(loaders):
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, index):
            raise AssertionError("Broken dataset")

    loader = DataLoader(Options(), Broken(), batch_size=1, num_workers=2)
    with pytest.raises(errors.Error, match=r"^AsynchronousDataAccessor worker thread failed "
                       r"to start: loading the first item failed: AssertionError: Caught "
                       r"AssertionError in DataLoader worker process 0") as info:
        AsynchronousDataAccessor(loader)
    assert "Broken dataset" in str(info.value.__cause__)
    with pytest.raises(errors.Error, match=r"failed to start: loading the first item failed: "
                       r"AssertionError: Broken dataset \(the original"):
        DataLoader(Options(), Broken(), batch_size=1,
                   mode=DataLoaderMode.Async)


@pytest.mark.parametrize("load_indefinitely", [True, False])
def test_load_indefinitely_preloads_the_next_epoch(loaders, load_indefinitely):
    ds = Recording(4)
    accessor = AsynchronousDataAccessor(ds, buffer_size=2, load_indefinitely=load_indefinitely)
    loaders.append(accessor)
    assert list(accessor) == [0, 1, 2, 3]
    if load_indefinitely:
        wait_until(lambda: len(ds.seen) == 7, 60, "the next epoch's 3 items loaded")
    time.sleep(0.05)
    assert ds.seen == [0, 1, 2, 3] + ([0, 1, 2] if load_indefinitely else [])
    assert list(accessor) == [0, 1, 2, 3]


def test_accessor_over_a_sync_loader(loaders):
    loader = DataLoader(opts(D=2), data(12), batch_size=2)
    accessor = AsynchronousDataAccessor(loader, load_indefinitely=False)
    loaders.append(accessor)
    assert len(accessor) == len(loader) == 3
    assert labels(accessor) == labels(loader)


def test_ctrl_c_while_an_epoch_opens_stays_a_keyboard_interrupt():
    # Opening an epoch (torch's iterator waking its workers) runs on the caller's thread, where
    # Ctrl-C lands: it must go through, not become a loading failure raised later.
    class Interrupted:
        def __iter__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        AsynchronousDataAccessor(Interrupted())


class _BlockedSignals(Dataset):
    """Each item: the signal mask (``SigBlk``) of the worker process that loads it."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        status = pathlib.Path("/proc/self/status").read_text()
        return torch.tensor(int(next(line.split()[1] for line in status.splitlines()
                                     if line.startswith("SigBlk:")), 16))


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_worker_forked_as_an_epoch_opens_holds_ctrl_c(loaders):
    # The accessor opens an epoch (torch's iterator forks its workers) on the caller's thread,
    # with Ctrl-C held: a Ctrl-C to the process group must not land in a worker still starting
    # up (logging's at-fork handler printed "Exception ignored in" it); the caller raises it.
    loader = torch.utils.data.DataLoader(_BlockedSignals(), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    accessor = AsynchronousDataAccessor(loader, load_indefinitely=False)
    loaders.append(accessor)
    masks = [int(m) for m in accessor]
    assert len(masks) == 2 and all(m & (1 << (signal.SIGINT - 1)) for m in masks), masks
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # caller's


def test_a_sync_loader_iterates_beside_a_users_accessor_over_it(loaders):
    # PopTorch's test_indexable_dataloader_len[Sync]: the accessor reads the loader through
    # iterators of its own (PopTorch's reads a copy in its process), so the loader's own
    # persistent workers are not reset under the accessor's thread, which is already loading
    # its next epoch (load_indefinitely) while the loader is iterated directly.
    loader = DataLoader(opts(), data(101), batch_size=4, num_workers=2)
    accessor = AsynchronousDataAccessor(loader)
    loaders.append(accessor)
    epoch = [[4 * i + k for k in range(4)] for i in range(25)]
    for _ in range(2):
        assert labels(accessor) == epoch
        assert labels(loader) == epoch
    assert len(accessor) == len(loader) == 25


def test_accessor_refuses_a_loader_that_has_one(loaders):
    loader = DataLoader(opts(), data(8), mode=DataLoaderMode.Async)
    loaders.append(loader)
    with pytest.raises(errors.DataLoaderError, match="already uses an AsynchronousDataAccessor"):
        AsynchronousDataAccessor(loader)


def test_terminate_leaves_no_thread_and_refuses_iteration():
    before = len(threading.enumerate())
    loader = DataLoader(opts(), data(40), batch_size=2, mode=DataLoaderMode.Async,
                        async_options=dict(buffer_size=1, early_preload=True))
    batches = iter(loader)
    next(batches)
    assert accessor_threads()
    loader.terminate()
    assert accessor_threads() == [] and len(threading.enumerate()) == before
    with pytest.raises(errors.DataLoaderError, match="terminated"):
        next(batches)
    with pytest.raises(errors.DataLoaderError, match="terminated"):
        iter(loader)
    loader.terminate()  # idempotent


def test_garbage_collected_accessor_stops_its_thread():
    accessor = AsynchronousDataAccessor(list(range(100)), buffer_size=1)
    next(iter(accessor))
    assert accessor_threads()
    del accessor
    gc.collect()
    wait_until(lambda: accessor_threads() == [], 60, "the accessor's thread ended")  # on its own


def worker_processes(timeout: float = 0.0) -> list:
    """The data-loading worker processes alive, after waiting up to ``limit(timeout)`` for
    them and the accessor threads to end."""
    deadline = time.monotonic() + limit(timeout)
    while ((multiprocessing.active_children() or accessor_threads())
           and time.monotonic() < deadline):
        time.sleep(0.02)
    return multiprocessing.active_children()


def drop(loader, how: str) -> None:
    """Iterate ``loader`` to its end, or break off after 2 batches."""
    for k, _ in enumerate(loader):
        if how == "break" and k == 1:
            break


@pytest.mark.parametrize("how", ["end", "break"])
@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async])
def test_no_worker_process_outlives_its_loader(mode, how):
    """[Note: workers outlive no loader] in async_data: 5 loaders of 2 workers each, dropped
    and collected, leave no worker, in Async mode as in Sync mode and as a torch DataLoader."""
    assert worker_processes(timeout=60) == []
    torch_loader = torch.utils.data.DataLoader(data(40), batch_size=2, num_workers=2,
                                               persistent_workers=True)
    drop(torch_loader, how)
    del torch_loader
    assert worker_processes(timeout=60) == []  # plain torch: the workers end with the loader
    for _ in range(5):
        loader = DataLoader(opts(), data(40), batch_size=2, num_workers=2, mode=mode)
        drop(loader, how)
        assert len(worker_processes()) == 2
        del loader
        gc.collect()
        assert worker_processes(timeout=60) == []


@pytest.mark.parametrize("how", ["end", "break"])
def test_terminate_stops_the_worker_processes_at_once(how):
    """PopTorch's ``DataLoader.terminate()`` stops the accessor's worker."""
    loader = DataLoader(opts(), data(40), batch_size=2, num_workers=2, mode=DataLoaderMode.Async)
    drop(loader, how)
    loader.terminate()
    assert multiprocessing.active_children() == [] and accessor_threads() == []
    with pytest.raises(errors.DataLoaderError, match="terminated"):
        iter(loader)


class FailsAt(Dataset):
    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"row {i} is corrupt")
        return torch.tensor(float(i))


def test_loader_exception_propagates_with_its_cause(loaders):
    loader = DataLoader(opts(), FailsAt(8, bad=5), batch_size=2, mode=DataLoaderMode.Async)
    loaders.append(loader)
    for _ in range(2):  # a new epoch fails the same way
        got = []
        with pytest.raises(errors.DataLoaderError, match="item 2 of an epoch failed.*KeyError") as info:
            for batch in loader:
                got.append(batch.tolist())
        assert got == [[0.0, 1.0], [2.0, 3.0]]
        assert isinstance(info.value.__cause__, KeyError)


# -- a script's exit with a loader thread alive -------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch
    import poptorch_lite as poptorch

    class Ten(torch.utils.data.Dataset):
        def __len__(self):
            return 10
        def __getitem__(self, i):
            return torch.tensor([float(i)]), i

    loader = poptorch.DataLoader(poptorch.Options(), Ten(), batch_size=1, num_workers=0,
                                 mode=poptorch.DataLoaderMode.Async)
    for k, (x, y) in enumerate(loader):
        if sys.argv[1] == "exit" and k == 3:
            sys.exit(0)
        if sys.argv[1] == "raise" and k == 3:
            raise RuntimeError("the script failed mid-epoch")
    print("seen", k + 1)
""")


@pytest.mark.parametrize("how,code", [("end", 0), ("exit", 0), ("raise", 1)])
def test_script_with_an_async_loader_exits_cleanly(tmp_path, how, code):
    """[Note: loader threads at exit]: no abort (status 134) whether the epoch ended or not."""
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                            env=env, timeout=limit(120))
    assert result.returncode == code, result.stderr
    assert "terminate called" not in result.stderr
    if how == "end":
        assert result.stdout.strip() == "seen 10"
    if how == "raise":
        assert result.stderr.rstrip().endswith("RuntimeError: the script failed mid-epoch")


_CTRL_C_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import poptorch_lite as poptorch

    data = torch.utils.data.TensorDataset(torch.randn(100, 1, 8, 8), torch.arange(100))
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), data, batch_size=16,
                                 shuffle=True, drop_last=True, num_workers=2,
                                 mode=poptorch.DataLoaderMode.Async)
    if sys.argv[1] == "iterated":
        for _ in loader:
            pass
    try:  # "ready" inside: a Ctrl-C right after it still lands here
        print("ready", flush=True)
        time.sleep(60)
        print("no Ctrl-C came")
    except KeyboardInterrupt:
        print("KeyboardInterrupt received", flush=True)
""")


@pytest.mark.parametrize("state", ["iterated", "made"])
def test_ctrl_c_beside_an_async_loader_stops_the_script_cleanly(tmp_path, state):
    """PopTorch's test_KeyboardInterrupt_in_async_data_accessor: Ctrl-C, which a terminal sends
    to the script and to every worker process of its group, ends the script at once, with its
    own handling only: no traceback from the loader's thread or torch's workers."""
    import signal
    script = tmp_path / "script.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-u", str(script), state], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert child.stdout.readline() == "ready\n"  # a state the child reports, not a time
        os.killpg(child.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = child.communicate(timeout=limit(120))  # against a hang only
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
    assert (child.returncode, out, err) == (0, "KeyboardInterrupt received\n", "")
