"""The benchmark scripts run: a short smoke run of each side, and the GPU script without a GPU."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("side", ["plain", "lite"])
def test_tax_runs_one_side_and_reports_its_step_time_and_memory(side):
    done = subprocess.run([sys.executable, str(BENCH / "tax.py"), "--side", side, "--case",
                           "conv16", "--threads", "1", "--calls", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"step_ms", "rss_mib", "threads", "calls"}
    assert report["threads"] == 1 and report["calls"] == 2
    assert report["step_ms"] > 0 and report["rss_mib"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_the_gpu_benchmark_says_there_is_no_gpu_and_exits_0():
    done = subprocess.run([sys.executable, str(BENCH / "gpu.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "benchmarks/gpu.py: no CUDA device here; nothing to measure\n"
