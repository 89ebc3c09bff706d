"""Tests that start several processes on loopback with torchrun's variables (gloo)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from patience import limit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_s(seconds: int = 60) -> int:
    """The processes' collective timeout for ``seconds`` at patience 1 (tests/support/patience.py):
    a process that waits this long for a message calls its peer gone."""
    return round(limit(seconds))


def start(script, args, W: int, timeout: float = 240, timeout_s: int = 60) -> list:
    """Run ``script args`` in W processes (ranks 0..W-1, one intra-op thread each);
    ``[(return code, stdout, stderr)]`` by rank. A run past ``limit(timeout)`` fails the test.

    ``collective_s(timeout_s)`` is the processes' collective timeout
    (``POPTORCH_LITE_DIST_TIMEOUT``).
    """
    timeout, timeout_s = limit(timeout), collective_s(timeout_s)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(W), "LOCAL_WORLD_SIZE": str(W),
           "POPTORCH_LITE_DIST_TIMEOUT": str(timeout_s), "OMP_NUM_THREADS": "1",
           # a process that aborts prints every thread's Python stack into the stderr a
           # failing test shows (how the exit-time abort of [Note: process groups at exit]
           # was first narrowed down: no Python frame, a thread of gloo's)
           "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(W)]
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{pathlib.Path(script).name} {' '.join(map(str, args))}: the processes "
                        f"hung for {timeout:.0f} s")
        results.append((p.returncode, stdout, stderr))
    return results


def ranks_results(script: str, out, W: int, args=(), name: str = "rank{r}.pt") -> list:
    """Run ``tests/support/<script> [*args] out`` in W processes (:func:`start`), every one
    exiting 0, and load what each wrote to ``out/<name>`` (``{r}``: its rank)."""
    for rank, (code, _, stderr) in enumerate(start(ROOT / "tests" / "support" / script,
                                                   [*args, out], W)):
        assert code == 0, f"{script} {' '.join(map(str, args))} rank {rank}:\n{stderr[-4000:]}"
    return [torch.load(pathlib.Path(out) / name.format(r=r), weights_only=False)
            for r in range(W)]
