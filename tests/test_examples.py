"""Examples smoke-run for a few steps on a small subset of MNIST (never downloaded here).

Each runs in its own process, as a user runs it. The deterministic lines (batch
arithmetic, the layer and stage listing) are compared exactly; timings and
accuracy by their format, the accuracy also against chance.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from patience import limit
from processes import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("MNIST_DATA", ROOT.parent / "shared" / "data"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (DATA / "MNIST" / "raw").is_dir(),
                                 reason=f"MNIST not found under {DATA} (set MNIST_DATA)")]

SPEED = r"([0-9.]+) s \([0-9]+ samples/s\)"


def run_example(name, *args):
    """Run examples/``name`` on the shared data; return its stdout lines (tqdm bars go to stderr)."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "examples" / name), "--data-dir", str(DATA),
         "--epochs", "1", *args],
        capture_output=True, text=True, timeout=limit(600), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def assert_trained_and_tested(lines, trained, tested, above=20.0, trained_at=-3):
    """Training throughput (by default 3rd from last), inference throughput, test accuracy."""
    assert re.fullmatch(rf"trained on {trained} images in {SPEED}", lines[trained_at])
    assert re.fullmatch(rf"tested on {tested} images in {SPEED}", lines[-2]), lines[-2]
    accuracy = re.fullmatch(r"Accuracy on test set: ([0-9]+\.[0-9]{2})%", lines[-1])
    assert accuracy, lines[-1]
    assert above < float(accuracy.group(1)) <= 100.0  # a few steps learn far above chance (10%)


def test_mnist_one_device_reports_the_speed_of_device_iterations():
    lines = run_example("mnist.py", "--limit", "640", "--device-iterations", "4")
    # 640 images are 40 steps of 16; the first call of each model is not timed.
    assert re.fullmatch(r"device iterations 4: [0-9]+\.[0-9]{2}x the speed of 1 "
                        r"\([0-9]+ vs [0-9]+ images/s over 36 timed steps\)", lines[0]), lines[0]
    assert len(lines) == 4
    assert_trained_and_tested(lines, 640, 600)  # the test loader drops the last partial batch


def test_mnist_replicated_prints_the_effective_batch():
    lines = run_example("mnist_replicated.py", "--limit", "640")
    assert lines[0] == "effective batch: 16 x 2 replicas = 32 per step, 32 per call (deviceIterations 1)"
    assert len(lines) == 4
    assert_trained_and_tested(lines, 640, 600)


def test_mnist_pipelined_two_stages_with_defaults():
    lines = run_example("mnist_pipelined.py", "--limit", "1280", "--device-iterations", "2")
    assert lines[0] == ("effective batch: 8 x 8 accumulation x 1 replicas = 64 per step, "
                        "128 per call (deviceIterations 2)")
    assert len(lines) == 4
    assert_trained_and_tested(lines, 1280, 1200)


def test_mnist_pipelined_runs_its_stages_in_two_processes_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2``: a stage per process; process 0 alone prints, and
    both processes' pipeline trains and tests the whole subset."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--log-dir", str(tmp_path),  # torchrun's folder, which it would leave in TMPDIR
         "--master_port", str(free_port()), str(ROOT / "examples" / "mnist_pipelined.py"),
         "--data-dir", str(DATA), "--epochs", "1", "--limit", "1280", "--device-iterations",
         "2"], capture_output=True, text=True, timeout=limit(600), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == ("effective batch: 8 x 8 accumulation x 1 replicas = 64 per step, "
                        "128 per call (deviceIterations 2)")
    assert len(lines) == 4
    assert_trained_and_tested(lines, 1280, 1200)


def test_mnist_pipelined_four_stages_1f1b_recompute_replicas_and_trace(tmp_path):
    trace = tmp_path / "trace.json"
    lines = run_example("mnist_pipelined.py", "--limit", "640", "--device-iterations", "1",
                        "--stages", "4", "--schedule", "interleaved", "--recompute",
                        "--replicas", "2", "--trace", str(trace))
    assert lines[0] == ("effective batch: 8 x 8 accumulation x 2 replicas = 128 per step, "
                        "128 per call (deviceIterations 1)")
    assert lines[2].startswith("schedule interleaved: makespan")
    assert [line[:11] for line in lines[3:7]] == [f"ipu{s} (cpu) " for s in range(4)]
    assert lines[-3] == f"timeline of the last call written to {trace}"
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["cat"] for e in spans} >= {"forward", "recompute", "backward"}
    assert {e["args"]["stage"] for e in spans if e["cat"] == "recompute"} == {0, 1, 2, 3}
    # 5 steps: only the format; the test is 1 call of 4 x 100 (inference needs D >= 4 stages)
    assert_trained_and_tested(lines, 640, 400, above=0.0, trained_at=1)


def test_mnist_pipelined_trace_svg_draws_the_last_call(tmp_path):
    import xml.etree.ElementTree as ET
    picture = tmp_path / "pipeline.svg"
    lines = run_example("mnist_pipelined.py", "--limit", "640", "--device-iterations", "1",
                        "--schedule", "gpipe", "--trace", str(picture))
    assert lines[-3] == f"timeline of the last call written to {picture}"
    root = ET.parse(picture).getroot()
    rows = [e for e in root.iter() if e.get("class") == "row"]
    assert [r.get("data-name") for r in rows] == ["ipu0 (cpu)", "ipu1 (cpu)"]
    labels = [e.get("data-label") for e in root.iter() if e.get("class") == "span"]
    # one step of 8 micro-batches through 2 stages: 16 F, 16 B, 2 G, 1 U
    assert sorted(labels) == sorted([f"{s}{k}{i}" for s in (0, 1) for k in "FB" for i in range(8)]
                                    + ["0G", "1G", "U"])


SPLITS_TABLES = {  # the stage table of each route of mnist_splits.py --splits dense128 dense64
    "split_at": [
        "layer    | block    | stage | ipu | device | parameters",
        "---------+----------+-------+-----+--------+-----------",
        "flatten  | -        | 0     | 0   | cpu    | 0",
        "dense256 | -        | 0     | 0   | cpu    | 200,960",
        "dense128 | dense128 | 1     | 1   | cpu    | 32,896",
        "dense64  | dense64  | 2     | 2   | cpu    | 8,256",
        "dense32  | dense64  | 2     | 2   | cpu    | 2,080",
        "logits   | dense64  | 2     | 2   | cpu    | 330",
        "loss     | dense64  | 2     | 2   | cpu    | 0",
    ],
    "--functional": [  # TF1's stage functions through poptorch.pipeline
        "layer           | block  | stage | ipu | device | parameters",
        "----------------+--------+-------+-----+--------+-----------",
        "stage0.flatten  | stage0 | 0     | 0   | cpu    | 0",
        "stage0.dense256 | stage0 | 0     | 0   | cpu    | 200,960",
        "stage0.relu256  | stage0 | 0     | 0   | cpu    | 0",
        "stage1.dense128 | stage1 | 1     | 1   | cpu    | 32,896",
        "stage1.relu128  | stage1 | 1     | 1   | cpu    | 0",
        "stage2.dense64  | stage2 | 2     | 2   | cpu    | 8,256",
        "stage2.relu64   | stage2 | 2     | 2   | cpu    | 0",
        "stage2.dense32  | stage2 | 2     | 2   | cpu    | 2,080",
        "stage2.relu32   | stage2 | 2     | 2   | cpu    | 0",
        "stage2.logits   | stage2 | 2     | 2   | cpu    | 330",
        "loss            | stage2 | 2     | 2   | cpu    | 0",
    ],
}


@pytest.mark.parametrize("route", sorted(SPLITS_TABLES))
def test_mnist_splits_lists_the_layers_then_the_stages(route):
    table = SPLITS_TABLES[route]
    functional = ["--functional"] if route == "--functional" else []
    lines = run_example("mnist_splits.py", "--limit", "640", "--device-iterations", "3",
                        "--splits", "dense128", "dense64", *functional)
    assert lines[:3] == [
        "layers: flatten, dense256, dense128, dense64, dense32, logits",
        "effective batch: 8 x 5 accumulation = 40 per step",
        "stages (3):",
    ]
    assert [line.rstrip() for line in lines[3:3 + len(table)]] == table
    # 640 images make 5 calls of 8 x 5 x 3 = 120; 15 SGD steps are too few for this narrow
    # MLP to leave chance, so only the format is checked
    assert_trained_and_tested(lines, 600, 600, above=0.0)


def test_mnist_mlp_pipeline_trains_with_recomputation_and_a_decaying_learning_rate():
    lines = run_example("mnist_mlp_pipeline.py", "--limit", "640", "--device-iterations", "2",
                        "--recompute", "--epochs", "2")  # the second epoch runs at lr / 10
    assert lines[0] == "effective batch: 8 x 8 accumulation = 64 per step"
    assert len(lines) == 4
    assert_trained_and_tested(lines, 1280, 600)


def test_keras_mnist_fits_and_evaluates_with_steps_per_execution():
    lines = run_example("keras_mnist.py", "--limit", "1536")
    # 1536 images: 2 executions of 24 batches of 32; the test set is trimmed to 1440 (9 x 160)
    assert lines[0] == ("effective batch: 32 x 1 accumulation x 1 replicas = 32 per step, "
                        "768 per execution (steps_per_execution 24: 24 steps on each replica)")
    assert re.fullmatch(r"loss per epoch: [0-9]+\.[0-9]{4}", lines[1])
    assert len(lines) == 5
    assert_trained_and_tested(lines, 1536, 1440)


def test_keras_mnist_two_stage_pipeline_with_replicas():
    lines = run_example("keras_mnist.py", "--limit", "768", "--pipeline", "--replicas", "2",
                        "--schedule", "interleaved", "--steps-per-execution", "8")
    assert lines[:9] == [
        "layer | type      | stage | parameters",
        "------+-----------+-------+-----------",
        "0     | ConvLayer | 0     | 260",
        "1     | ConvLayer | 0     | 5,020",
        "2     | Flatten   | 0     | 0",
        "3     | Linear    | 1     | 81,920",
        "4     | ReLU      | 1     | 0",
        "5     | Linear    | 1     | 2,570",
        "6     | Softmax   | 1     | 0",
    ]
    assert lines[9] == ("effective batch: 32 x 4 accumulation x 2 replicas = 256 per step, "
                        "256 per execution (steps_per_execution 8: 4 steps on each replica)")
    # 768 images: 3 executions of 8 steps of 32 (4 on each replica), 3 optimizer steps:
    # only the format is checked.
    assert_trained_and_tested(lines, 768, 640, above=0.0)


def test_mnist_failing_to_download_points_at_data_dir(tmp_path, monkeypatch):
    import torchvision
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import mnist

    def offline(self):  # what torchvision raises once every mirror failed
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", offline)
    with pytest.raises(SystemExit, match=re.escape(
            f"MNIST is not in '{tmp_path}' and could not be downloaded (Error downloading "
            f"train-images-idx3-ubyte.gz). Offline, point --data-dir (or $MNIST_DATA) at a folder "
            f"that holds MNIST/raw, e.g. --data-dir ../shared/data")):
        mnist.open_mnist(str(tmp_path), True)


def test_the_bar_shows_the_epochs_mean_over_every_micro_batch(monkeypatch):
    """examples/mnist.py's train(): the bar's mean loss and accuracy cover every micro-batch
    a call trained (12 a call here: 3 device iterations x 2 accumulated x 2 replicas), not
    the last one that the default output mode returns."""
    import torch
    import torch.nn.functional as F
    import poptorch_lite as poptorch
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import mnist
    torch.manual_seed(0)
    model = mnist.Network()
    opts = poptorch.Options().deviceIterations(3).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    opts.outputMode(poptorch.OutputMode.All)
    # lr 0: the weights stay as they are, so plain PyTorch gives each micro-batch's loss
    training_model = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                            lr=0.0))
    images, labels = torch.randn(96, 1, 28, 28), torch.randint(0, 10, (96,))
    calls = [(images[:48], labels[:48]), (images[48:], labels[48:])]
    seen, _, running = mnist.train(training_model, calls, epochs=1)
    training_model.destroy()
    with torch.no_grad():
        output = model(images)
        losses = [F.nll_loss(output[k:k + 4], labels[k:k + 4]).item() for k in range(0, 96, 4)]
    assert (seen, running.micro_batches, running.images) == (96, 24, 96)
    assert running.loss == pytest.approx(sum(losses) / 24, abs=1e-6)
    assert running.accuracy == 100.0 * (output.argmax(1) == labels).sum().item() / 96


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "examples").glob("*.py")))
def test_help_shows_every_default_and_where_mnist_comes_from(name, monkeypatch):
    import argparse
    import importlib
    import poptorch_lite
    if name == "gpt2_pipelined":
        pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setitem(sys.modules, "poptorch", poptorch_lite)  # as `poptorch-lite run` does
    parser = importlib.import_module(name).parser
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default is not argparse.SUPPRESS:
            assert f"(default: {action.default})" in text, (action.dest, text)
    if "--data-dir" in text:
        assert "$MNIST_DATA if set" in text


def test_mnist_poptorch_without_the_alias_says_how_to_run_it():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "mnist_poptorch.py"), "--help"],
                            capture_output=True, text=True, timeout=limit(600), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("No module named 'poptorch': without an IPU, run this script with "
                             "`poptorch-lite run examples/mnist_poptorch.py ...` (see its "
                             "docstring)\n")


def test_mnist_poptorch_runs_unmodified_through_the_alias():
    """The demo's defaults (calls of 50 x 8 images, test batches of 80) on 1,000 images: 2
    calls train, and the test scores the 12 whole batches, saying that 40 images are left."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "poptorch_lite", "run",
         str(ROOT / "examples" / "mnist_poptorch.py"), "--data-dir", str(DATA), "--epochs", "1",
         "--limit", "1000"],
        capture_output=True, text=True, timeout=limit(600), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "(scored 960 of the 1000 test images: whole batches of 80 only)"
    accuracy = re.fullmatch(r"Accuracy on test set: ([0-9]+\.[0-9]{2})%", lines[1])
    assert accuracy and len(lines) == 2, result.stdout
    assert 20.0 < float(accuracy.group(1)) <= 100.0  # 100 SGD steps learn far above chance
    assert "epoch mean loss=" in result.stderr and "epoch accuracy=" in result.stderr  # the bar


def test_gpt2_pipelined_trains_transformers_gpt2_on_the_standard_library():
    """Needs transformers (the .[hf] extra), not MNIST's images: 64 windows, 2 steps of 32."""
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "examples" / "gpt2_pipelined.py"),
         "--limit", "64", "--stages", "4", "--recompute", "--corpus-bytes", "300000"],
        capture_output=True, text=True, timeout=limit(600), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.strip().splitlines()
             if not line.startswith("[transformers]")]
    assert re.fullmatch(r"corpus: 300000 bytes from [0-9]+ files of the standard library, "
                        r"64 training and 64 held-out windows of 128", lines[0]), lines[0]
    assert lines[1] == "4 stages (recompute on), 842496 parameters, 4 x 8 = 32 windows per step"
    assert re.fullmatch(r"trained 2 steps in [0-9.]+ s: loss [0-9.]+ at the first step, [0-9.]+ "
                        r"at the last \(moving average: 0\.9 old \+ 0\.1 new per step\)",
                        lines[2]), lines[2]
    held = re.fullmatch(r"held-out loss: ([0-9.]+) before training, ([0-9.]+) after "
                        r"\([0-9.]+ bits per byte\)", lines[3])
    assert held and float(held.group(2)) < float(held.group(1)) <= 6.0, lines[3]
    assert "step loss=" in result.stderr and "moving average=" in result.stderr  # the bar
    assert "loss_type" not in result.stdout + result.stderr  # transformers has no loss to guess
