"""A pytest plugin: every test leaves the process as it found it.

The state is read before each test's setup and after its teardown; a difference is an error in
that test's teardown, which names what was left behind:

- a live Python thread or a child process that was not there before (a thread gets a
  garbage collection and a moment to exit first: a wrapper nobody destroyed stops its stream
  workers when it is collected, as in a user's program);
- a changed signal handler, a signal blocked in (or pending for) the main thread;
- a changed torch global: default dtype, intra-op threads, grad mode, inference mode,
  deterministic algorithms, anomaly mode; and Python's automatic garbage collection;
- a file descriptor opened and not closed (except by the test that made CUDA's context);
- a changed ``os.environ``;
- a file or folder left in the temporary directory.

Each process of the suite (pytest's, each xdist worker) gets a temporary directory of its own
when it starts, ``TMPDIR`` for it and every process it starts, removed when it ends: what a
test's processes make there and do not remove (torchrun's log folders, a checkpoint in a
``mkdtemp``) is named, and nothing the suite makes outlives it. pytest's own ``tmp_path``
folders stay where they were (``PYTEST_DEBUG_TEMPROOT``: the last three runs kept), and so
does Inductor's cache (a link to it), which lasts from one session to the next.

Reading it costs about 0.1 ms a test (a listing of ``/proc/self/fd``, nothing on a clean pass
that takes longer). ``-p no:hygiene`` turns it off, for instance to see a test's own failure
first.
"""

from __future__ import annotations

import gc
import getpass
import os
import re
import shutil
import signal
import tempfile
import threading
import time

import pytest
import torch

from patience import limit

# What libraries set up once per process, on first use, and keep by design: not a leak of the
# test that happened to use them first.
LONG_LIVED_THREADS = (
    "tqdm_monitor",  # tqdm's monitor of slow bars, started with the first bar
)
SET_ONCE_ENV = (
    "TORCHINDUCTOR_CACHE_DIR",  # set by Inductor at its first compile
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",  # set by Inductor when it loads its C++ helpers
)
SET_ONCE_TEMP = (
    "pymp-",  # multiprocessing's folder, made at its first use, removed when the process ends
)
SET_ONCE_HANDLERS = (
    "_set_SIGCHLD_handler.<locals>.handler",  # torch's DataLoader, at its first worker process
)
# How long leftover threads get to exit after a garbage collection (tests/support/patience.py): only
# a leak waits that long, a thread that is ending is seen gone at once.
SETTLE_S = limit(30.0)


def _threads() -> dict:
    return {t.ident: t.name for t in threading.enumerate()
            if t.is_alive() and not t.name.startswith(LONG_LIVED_THREADS)}


def _children() -> set:
    """The process's live children. A zombie (exited, not yet reaped) is not counted: it holds
    nothing, and multiprocessing reaps it when it next starts or lists a process (torch 2.11's
    DataLoader leaves its workers so after a worker raised)."""
    pids = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return pids
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return {pid for pid in pids if _state(pid) not in ("Z", "X", None)}


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _fds() -> dict:
    fds = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, already closed
            pass
    return fds


def _handlers() -> dict:
    out = {}
    for s in signal.valid_signals():
        try:
            handler = signal.getsignal(s)
            name = signal.Signals(s).name
        except (ValueError, OSError):  # real-time signals without a name
            continue
        # torch's handler chains to the one it found, which stays in force: not a change
        out[name] = "<torch's, set once>" if getattr(handler, "__qualname__", None) in \
            SET_ONCE_HANDLERS else handler
    return out


def _torch_globals() -> dict:
    return {"default dtype": torch.get_default_dtype(),
            "intra-op threads": torch.get_num_threads(),
            "grad mode": torch.is_grad_enabled(),
            "inference mode": torch.is_inference_mode_enabled(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "anomaly mode": torch.is_anomaly_enabled(), "automatic gc": gc.isenabled()}


_TEMP: list = []  # this process's temporary directory, once pytest_configure made it


def _temp_files() -> set:
    if not _TEMP:  # hygiene.snapshot() outside a session the plugin configured
        return set()
    return {os.path.join(_TEMP[0], n) for n in os.listdir(_TEMP[0])
            if not n.startswith(SET_ONCE_TEMP)}


def inductor_cache_name() -> str:
    """The folder of the temporary directory where Inductor keeps its caches: the rule of
    torch's ``default_cache_dir`` (``torch/_inductor/runtime/cache_dir_utils.py``), written out
    because importing ``torch._inductor`` costs 1.6 s a process."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # a uid with no name, as in a container
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def snapshot() -> dict:
    main = threading.current_thread() is threading.main_thread()
    return {"cuda": torch.cuda.is_initialized(),
            "threads": _threads(), "children": _children(), "open files": _fds(),
            "signal handlers": _handlers(),
            "blocked signals": set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) if main
            else set(),
            "pending signals": signal.sigpending(),
            "torch globals": _torch_globals(),
            "os.environ": {k: v for k, v in os.environ.items() if k not in SET_ONCE_ENV},
            "temp files": _temp_files()}


def pytest_configure(config):
    """Give the process a temporary directory of its own (the module's doc), and make
    torch.distributed's store's event-loop pipe, which its first store opens and keeps for the
    process's life, before any test can be blamed for it."""
    # The machine's temporary directory, where a worker's goes too: beside its parent's, not
    # in it (a Unix socket's path, as multiprocessing's listeners make there, has at most 107
    # bytes, which three nested folders used up).
    root = os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _TEMP.append(tempfile.mkdtemp(prefix="poptorch-lite-tests-", dir=root))
    # Inductor keeps its caches (compiled code, precompiled headers) in the temporary
    # directory's torchinductor_<user>, some whatever TORCHINDUCTOR_CACHE_DIR says: a link to
    # the machine's keeps them from one session to the next, as they were.
    inductor = inductor_cache_name()
    os.makedirs(os.path.join(root, inductor), exist_ok=True)
    os.symlink(os.path.join(root, inductor), os.path.join(_TEMP[0], inductor))
    os.environ["TMPDIR"] = _TEMP[0]
    tempfile.tempdir = None  # read again from TMPDIR
    try:
        import torch.distributed as dist
        if dist.is_available():
            dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: any free one; dropped at once
    except Exception:  # noqa: BLE001 - no distributed support: nothing to make
        pass


def pytest_unconfigure(config):
    if _TEMP:
        shutil.rmtree(_TEMP.pop(), ignore_errors=True)


def _added(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if k not in before or before[k] != v}


def left_behind(before: dict, after: dict) -> list[str]:
    """What ``after`` has that ``before`` did not, one line each."""
    lines = []
    # CUDA's context, made by the first test of the process that touches a GPU, holds the
    # driver's files (/dev/nvidia*, event fds, a pipe) until the process ends: the files that
    # test opened are not counted (its threads and everything else still are).
    first_cuda = after.get("cuda") and not before.get("cuda")
    for key in ("threads",) + (() if first_cuda else ("open files",)):
        for k, v in _added(before[key], after[key]).items():
            lines.append(f"{key[:-1] if key == 'threads' else 'open file'} {k}: {v}")
    for pid in sorted(after["children"] - before["children"]):
        lines.append(f"child process {pid}: {_cmdline(pid)}")
    for path in sorted(after["temp files"] - before["temp files"]):
        lines.append(f"temp file {path}")
    for key in ("blocked signals", "pending signals"):
        for s in sorted(after[key] - before[key]):
            lines.append(f"{key[:-1]} {signal.Signals(s).name}")
    for key in ("signal handlers", "torch globals", "os.environ"):
        b, a = before[key], after[key]
        for k in sorted(set(b) | set(a)):
            if a.get(k) == "<torch's, set once>":
                continue
            if b.get(k, "<unset>") != a.get(k, "<unset>"):
                lines.append(f"{key}: {k} was {b.get(k, '<unset>')!r}, now "
                             f"{a.get(k, '<unset>')!r}")
    return lines


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "<gone>"


def _settled(before: dict) -> dict:
    """The state once leftover threads and children had a garbage collection and up to
    SETTLE_S to end."""
    after = snapshot()
    if not (_added(before["threads"], after["threads"]) or
            after["children"] - before["children"] or
            _added(before["open files"], after["open files"])):
        return after
    gc.collect()
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        after = snapshot()
        if not (_added(before["threads"], after["threads"]) or
                after["children"] - before["children"]):
            # What survived that collection is the session's (caches, lazily imported
            # modules): out of later collections' walk, which it made slow (conftest's
            # pytest_collection_finish).
            gc.freeze()
            break
        time.sleep(0.02)
    return after


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_BEFORE] = snapshot()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:  # its traceback holds the test's objects: its own failure says enough
        item.stash[_FAILED] = True
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    before = item.stash.get(_BEFORE, None)
    if before is not None and not item.stash.get(_FAILED, False):
        # The fixtures are finalized; pytest drops their values only after this hook, and
        # what they hold (a loader, a wrapper) would otherwise look left behind.
        getattr(item, "funcargs", {}).clear()
        left = left_behind(before, _settled(before))
        if left:
            raise LeftBehind(f"{item.nodeid} left the process changed:\n  " +
                             "\n  ".join(left))
    return result


class LeftBehind(Exception):
    """A test left a thread, a process, a handler, a global, a file or a variable behind."""


_BEFORE = pytest.StashKey[dict]()
_FAILED = pytest.StashKey[bool]()
