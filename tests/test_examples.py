"""Examples smoke-run for a few steps on a small subset of MNIST (never downloaded here)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("MNIST_DATA", ROOT.parent / "shared" / "data"))

needs_mnist = pytest.mark.skipif(not (DATA / "MNIST" / "raw").is_dir(),
                                 reason=f"MNIST not found under {DATA} (set MNIST_DATA)")


@needs_mnist
def test_mnist_example_trains_and_reports_test_accuracy():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mnist.py"), "--data-dir", str(DATA),
         "--limit", "1280", "--device-iterations", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "effective batch: 8 x 8 accumulation = 64 per step, 128 per call (2 steps)"
    assert re.fullmatch(r"trained on 1280 images in [0-9.]+ s \([0-9]+ images/s\)", lines[-2])
    accuracy = re.fullmatch(r"Accuracy on test set: ([0-9]+\.[0-9]{2})%", lines[-1])
    assert accuracy, lines[-1]
    assert 50.0 < float(accuracy.group(1)) <= 100.0  # 20 steps of SGD learn far above chance
