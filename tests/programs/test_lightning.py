"""Lightning's IPUStrategy trains and evaluates through `poptorch-lite run` like plain PyTorch.

Skipped without Lightning. To run it, in a venv of its own next to the project's:
`pip install --no-deps pytorch-lightning==2.0.9 lightning-graphcore==0.1.0 lightning-utilities
'torchmetrics<1.5'` (the `lightning` extra; README, "Lightning"). Without Lightning,
tests/test_wrapper_private.py makes IPUStrategy's calls on the wrapper in the same order.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from patience import limit

pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed")
pytest.importorskip("lightning_utilities", reason="lightning-graphcore is not installed")
if importlib.util.find_spec("lightning_graphcore") is None:  # importing it needs `poptorch`
    pytest.skip("lightning-graphcore is not installed", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stages, flavour", [(1, "graphcore"), (2, "graphcore"), (2, "lightning")])
def test_ipu_strategy_fits_validates_tests_and_predicts_like_plain_pytorch(stages, flavour, tmp_path):
    """See tests/support/lightning_script.py for what runs (2 epochs, then validate, test,
    predict)."""
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "poptorch_lite", "run",
                           str(ROOT / "tests" / "support" / "lightning_script.py"), str(stages),
                           flavour,
                           str(out)], capture_output=True, text=True, timeout=limit(600), cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    calls = 12 if stages == 1 else 6  # 48 rows / (4 per micro-batch x deviceIterations)
    assert result["moved"] > 1e-3, result  # every weight was trained
    assert result["weights"] < 1e-5, result
    for fn in ("validate", "test", "predict"):
        assert result[fn + "_batches"] == calls and result[fn] < 1e-5, result
