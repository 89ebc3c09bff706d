"""optimum-graphcore 0.7.1's IPUTrainer trains and evaluates through `poptorch-lite run`.

Skipped without optimum-graphcore: it pins transformers==4.29.2, which conflicts with the
newer transformers of the `hf` test extra, so CI does not install it. To run it, in a venv of
its own: `pip install transformers==4.29.2 typeguard scipy coloredlogs` and
`pip install --no-deps optimum==1.6.1 optimum-graphcore==0.7.1` (README, "optimum-graphcore").
"""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

from patience import limit

try:  # not imported here: `import optimum.graphcore` needs `poptorch`, the alias gives it
    importlib.metadata.version("optimum-graphcore")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("optimum-graphcore is not installed (it pins transformers==4.29.2)",
                allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ipu_trainer_trains_and_evaluates_like_plain_pytorch(tmp_path):
    """See tests/support/optimum_graphcore_script.py for what runs."""
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "poptorch_lite", "run",
                           str(ROOT / "tests" / "support" / "optimum_graphcore_script.py"),
                           str(out)],
                          capture_output=True, text=True, timeout=limit(600), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    # 64 samples / (2 per micro-batch x 4 accumulated x 2 device iterations) = 4 calls an epoch
    assert result["steps"] == 12 and len(result["losses"]) == 12
    first, last = result["losses"][:3], result["losses"][-3:]
    assert max(last) < min(first) - 0.2, result["losses"]  # the loss falls
    # the same training replayed in plain PyTorch ends with the same weights, and the trained
    # model's evaluation is plain PyTorch's on the same weights and batches
    assert result["max_weight_difference"] < 1e-5, result
    assert abs(result["eval_loss"] - result["plain_eval_loss"]) < 1e-5, result
