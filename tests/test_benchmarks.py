"""The benchmark scripts run: a short smoke run of each side, and the GPU script without a GPU."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import torch

from patience import limit

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_distributed_runs_rounds_of_each_job_in_turn_and_prints_the_ratio_to_ddp():
    """benchmarks/distributed.py on a tiny MLP: the 1-process, 2-process, 2-process DDP
    and 2-process sharded jobs take turns for 2 rounds of a block of 1 step; the rows and
    the medians (timings are not checked). Adam's two moments of the 2 × 16 × 17 weights,
    and 4 step counts: a process holds half the moments and every count; it sends the
    all-reduce's bytes (no padding)."""
    done = subprocess.run([sys.executable, str(BENCH / "distributed.py"), "--model", "mlp",
                           "--width", "16", "--layers", "2", "--rounds", "2", "--steps", "1",
                           "--warmup", "1"], capture_output=True, text=True,
                          timeout=limit(300))
    assert done.returncode == 0, done.stderr
    header, blocks, *rows, totals, medians = done.stdout.strip().splitlines()
    assert header == (f"torch {torch.__version__}; G = 8, B = 32, 2 rounds of a block of 1 "
                      f"timed steps per job after 1")
    assert blocks == "mlp: blocks of 1 steps"
    assert [row.split(":")[0] for row in rows] == ["mlp round 1", "mlp round 2"]
    assert all(" 2 processes " in row and "x DDP), sharded state " in row for row in rows)
    weights = 2 * 16 * 17 * 4  # bytes
    assert totals.startswith("mlp: all-reduce ")
    assert totals.endswith(
        f"Adam's state {(weights + 16) / 1e6:.4g} MB a process against "
        f"{(2 * weights + 16) / 1e6:.4g} MB, sent {weights / 1e6:.4g} MB a step against the "
        f"all-reduce's {weights / 1e6:.4g} MB")
    ratio = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)x"
    assert re.fullmatch(f"mlp median \\(min-max\\) of 2: scaling {ratio} \\(ideal 2.00x\\), "
                        f"poptorch_lite's 2-process step / DDP's {ratio}, sharded / whole "
                        f"state {ratio}", medians), medians


def test_process_groups_counts_each_orders_groups_and_host_traffic():
    """benchmarks/process_groups.py at W = 8 processes of n = 2 stages, 4 per host: P = 4
    pipelines; each process makes the mesh's 4 + 2 groups and 2 per pipeline for the one
    stage edge (14), and joins its 2 mesh groups and its edge's 2. Pipeline-inner: a
    pipeline on a host (ranks 0-3 hold pipelines 0, 1), each position's ring of 4 replicas
    leaves host 0 once, the link carrying 2 · 3/4 · G/2 = 6 MB (G = 8 MB): 12 MB for the two
    positions. Data-parallel-inner:
    the rings stay on a host; host 0 holds stage 0 of all 4 pipelines and sends m · A = 2 MB
    forward for each."""
    done = subprocess.run([sys.executable, str(BENCH / "process_groups.py"), "--world", "8",
                           "--stages", "2", "--rank", "5", "--per-host", "4", "--gradients-mb",
                           "8", "--activation-mb", "1", "--micro-batches", "2"],
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"W = 8 processes, n = 2 per pipeline, 4 per host; torch {torch.__version__}"
    rows = {cells[0]: cells[1:3] + cells[4:] for cells in map(str.split, lines[2:])}
    assert rows == {"pipeline_inner": ["14", "4", "12.0", "0.0", "12.0"],
                    "data_parallel_inner": ["14", "4", "0.0", "8.0", "8.0"]}


@pytest.mark.parametrize("side", ["plain", "lite", "lite --twin"])
def test_tax_runs_one_side_and_reports_its_step_time_and_memory(side):
    done = subprocess.run([sys.executable, str(BENCH / "tax.py"), "--side", *side.split(),
                           "--case", "conv16", "--threads", "1", "--calls", "2"],
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"step_ms", "rss_mib", "threads", "calls"}
    assert report["threads"] == 1 and report["calls"] == 2
    assert report["step_ms"] > 0 and report["rss_mib"] > 0


def test_tax_compiled_takes_turns_between_four_sides():
    """``--compiled``: plain, plain torch.compile, lite and lite compileStages take turns; the
    row gives each side's step and compiled lite's ratio to the other three (one pair of two
    blocks; the tiny case, whose stage stays eager, so only the plain side compiles)."""
    done = subprocess.run([sys.executable, str(BENCH / "tax.py"), "--compiled", "--case", "tiny",
                           "--threads", "1", "--pairs", "1", "--blocks", "2", "--calls", "1",
                           "--backend", "aot_eager"],  # the turns, not Inductor's codegen
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.strip().splitlines()
    assert header.split()[:10] == ["case", "thr", "plain", "plain-c", "lite", "lite-c",
                                   "lite-c/plain", "lite-c/plain-c", "lite-c/lite", "(ms"]
    cells = row.split()
    assert cells[:2] == ["tiny", "1"] and all(float(c) > 0 for c in cells[2:6])
    for ratio, spread in zip(cells[6::2], cells[7::2]):  # one pair: its own spread, printed
        assert spread == f"({ratio}-{ratio})"  # from the same value by the same format


def test_tax_pairs_the_two_sides_block_by_block_and_the_lean_call_beside_them():
    """The parent keeps a plain and a poptorch_lite process side by side and asks each for
    blocks in turn; with ``--lean`` a third process, the lean call (which checks its step
    against the wrapped call's first, and exits otherwise), takes its turns too. One pair of
    two blocks of one call each (figures are not checked)."""
    done = subprocess.run([sys.executable, str(BENCH / "tax.py"), "--case", "conv16", "--lean",
                           "--threads", "1", "--pairs", "1", "--blocks", "2", "--calls", "1"],
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.strip().splitlines()
    assert header.split() == ["case", "threads", "plain", "ms", "lite", "ms", "ratio", "spread",
                              "RSS", "ratio", "lean", "ms", "lean", "spread"]
    case, threads, plain_ms, lite_ms, ratio, spread, rss, lean_ms, lean, lean_spread = row.split()
    assert (case, threads) == ("conv16", "1")
    assert float(plain_ms) > 0 and float(lite_ms) > 0 and float(rss) > 0 and float(lean_ms) > 0
    assert spread == f"{float(ratio):.3f}-{float(ratio):.3f}"  # one pair: its own spread
    assert lean_spread == f"{float(lean):.3f}-{float(lean):.3f}"


def test_tax_refuses_the_lean_call_where_it_does_not_apply():
    done = subprocess.run([sys.executable, str(BENCH / "tax.py"), "--case", "tiny", "--lean"],
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (
        "tax.py: error: --lean measures one step a call on one stage: --case conv16, eager, on "
        "the CPU (got --case tiny)")


def test_tax_ab_pairs_two_checkouts_block_by_block():
    """The same checkout on both sides: one pair of two blocks of one call each, whose line
    names both sides' times and their ratio (figures are not checked)."""
    root = str(BENCH.parent)
    done = subprocess.run([sys.executable, str(BENCH / "tax_ab.py"), "--base", root, "--case",
                           "tiny", "--pairs", "1", "--blocks", "2", "--calls", "1"],
                          capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["tiny", "base"] and words[4:5] == ["head"] and words[7] == "head/base"
    assert float(words[2]) > 0 and float(words[5]) > 0 and float(words[8]) > 0


def test_machinery_compares_the_wrapped_model_with_a_bare_loop_of_its_stage_graph():
    """A smoke run of one round with the layer timers (figures are not checked)."""
    done = subprocess.run([sys.executable, str(BENCH / "machinery.py"), "--model", "tiny",
                           "--rounds", "1", "--timers"], capture_output=True, text=True,
                          timeout=limit(300))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith("tiny: per step (us, median of 1 rounds, 1 thread): plain ")
    assert "lite - bare" in first
    assert second.strip().startswith("own time per step (us): Program.run ")
    assert "handlers: forward" in second


def test_machinery_at_one_step_a_call_runs_the_lean_call_after_checking_its_step():
    """``--conv16``: the lean call (the mechanisms without the layers) runs beside the other
    three only after one lean and one wrapped call, from the same state, left the same
    weights and momenta to the bit (the script exits otherwise); figures are not checked."""
    done = subprocess.run([sys.executable, str(BENCH / "machinery.py"), "--model", "conv",
                           "--conv16", "--rounds", "1"], capture_output=True, text=True,
                          timeout=limit(300))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith("conv: per step (us, median of 1 rounds, 1 thread): plain ")
    assert re.fullmatch(r"  lean [\d.]+ \([\d.]+x plain, bare [\d.]+x\): mechanisms \(lean - bare\) "
                        r"-?[\d.]+, layers \(lite - lean\) -?[\d.]+", second), second


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_the_gpu_benchmark_says_there_is_no_gpu_and_exits_0():
    done = subprocess.run([sys.executable, str(BENCH / "gpu.py")], capture_output=True,
                          text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "benchmarks/gpu.py: no CUDA device here; nothing to measure\n"


def test_the_gpu_benchmarks_overlap_is_the_time_two_streams_were_busy_at_once():
    sys.path.insert(0, str(BENCH))
    import doctest
    import gpu
    assert doctest.testmod(gpu).failed == 0
    from poptorch_lite.profiling.spans import Span
    from poptorch_lite.profiling.timeline import Timeline
    # stream 0 busy 0-2 and 3-4, stream 1 busy 1-3.5: both at once 1-2 and 3-3.5, of 0-4
    spans = [Span(0, 0, 0, "F", 0, 2), Span(0, 0, 1, "F", 3, 4), Span(1, 1, 0, "F", 1, 3.5)]
    assert gpu.both_busy(Timeline(spans, ["a", "b"], "x")) == 1.5 / 4
    assert gpu.both_busy(Timeline(spans[:2], ["a", "b"], "x")) == 0.0


def test_the_gpu_checks_mnist_match_agrees_with_plain_pytorch_on_the_cpu():
    """benchmarks/gpu_check.sh's step-for-step comparison of the pipelined MNIST example with
    plain PyTorch, run here on the CPU for 10 steps (one call)."""
    data = os.environ.get("MNIST_DATA", str(BENCH.parent.parent / "shared" / "data"))
    done = subprocess.run([sys.executable, str(BENCH / "gpu_mnist_match.py"), "--data-dir", data,
                           "--steps", "10"], capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "the same numbers within 0.001"


def test_pipeline_benchmark_runs_the_conv_net_with_a_stage_per_process():
    """A smoke run: every kind of row, one timed step each (figures are not checked)."""
    done = subprocess.run([sys.executable, str(BENCH / "pipeline.py"), "--model", "conv",
                           "--repeats", "1", "--warmup", "0", "--schedules",
                           "grouped,zero_bubble+compiled", "--process-schedules", "interleaved",
                           "--torch-schedules", "1f1b",
                           "--microbatches", "8"],
                          capture_output=True, text=True, timeout=limit(300), cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("  ")[0] for line in done.stdout.splitlines()]
    for row in ("plain PyTorch, micro-batched (8 x 8 rows)", "poptorch_lite grouped",
                "poptorch_lite zero_bubble + compiled",
                "poptorch_lite interleaved (2 processes)", "torch Schedule1F1B (2 processes)"):
        assert row in rows, done.stdout


def test_gpt2_benchmark_runs_every_kind_of_row():
    """A smoke run of benchmarks/gpt2.py on a 4-layer GPT-2 (needs transformers), with a torch
    schedule of two stages per rank (a loop: torch 2.11's ZBVZeroBubble and DualPipeV fail in
    their own first step over gloo, "Pair is not connected"; 2.14 runs them)."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-W", "ignore", str(BENCH / "gpt2.py"), "--layers", "4",
                           "--width", "32", "--repeats", "1", "--warmup", "0", "--schedules",
                           "sequential,zero_bubble", "--torch-schedules", "1f1b,interleaved1f1b",
                           "--microbatches", "8"],
                          capture_output=True, text=True, timeout=limit(300), cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("  ")[0] for line in done.stdout.splitlines()]
    for row in ("plain PyTorch, micro-batched (8 x 4)", "plain PyTorch, 2 threads (the ceiling)",
                "poptorch_lite sequential", "poptorch_lite zero_bubble",
                "torch Schedule1F1B (2 processes)", "torch ScheduleInterleaved1F1B (2 processes)"):
        assert row in rows, done.stdout
    assert "the best poptorch_lite row (" in done.stdout
    assert "the machine's two-thread ceiling: " in done.stdout


def test_the_short_soak_leaves_threads_files_and_processes_as_after_its_warm_up():
    """benchmarks/soak.py --short: every phase (tiny calls, wrappers through every schedule,
    the loaders, Ctrl-C at random moments in one process and under torchrun, pipelines across
    processes) ends with no more threads, files or children than after the warm-up."""
    done = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--short"],
                          capture_output=True, text=True, timeout=limit(600))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "targets met"
    table = {line[:18].strip(): line[18:].split() for line in lines[2:9]}
    assert list(table) == ["start", "warm-up", "after tiny", "after wrappers", "after loaders",
                           "after interrupts", "end"]
    warm, end = table["warm-up"][1:], table["end"][1:]  # threads, OS threads, files, children
    assert [int(e) <= int(w) for w, e in zip(warm, end)] == [True] * 4
    assert int(end[3]) == 0  # no child process at the end
    ctrl_c = next(line for line in lines if line.startswith("interrupts:"))
    assert "'call': " in ctrl_c  # a Ctrl-C landed inside a call, on every schedule
    assert sorted(line[:9] for line in lines if line.startswith("process") and " RSS MiB " in line
                  ) == ["process 0", "process 1"]


def test_the_fuzzers_long_profile_runs_and_reports():
    """benchmarks/fuzz.py for a few seconds: examples run, outcomes and coverage printed, and
    no finding (the PENDING ones are left out, as in the short profile)."""
    done = subprocess.run([sys.executable, str(BENCH / "fuzz.py"), "--minutes", "0.05",
                           "--seed", "1"], capture_output=True, text=True, timeout=limit(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " examples in " in done.stdout and "0 findings" in done.stdout
    assert "grammar: " in done.stdout and "config: " in done.stdout


@pytest.mark.skipif(shutil.which("cc") is None, reason="the stand-in library needs cc")
def test_the_apps_harness_says_per_step_what_it_could_not_run(tmp_path):
    """benchmarks/apps.py on a checkout that has one app, whose test passes, and lacks the
    others: a line per step, pass for it, FAIL with why for the rest, exit 1; the app's
    custom-op library stood in for where it asserts one."""
    app = tmp_path / "vision" / "dino" / "pytorch"
    (app / "tests").mkdir(parents=True)
    (app / "tests" / "test_dino.py").write_text(
        "import ctypes, poptorch\n"
        "def test_alignment():\n"
        "    ctypes.cdll.LoadLibrary('ema/build/exp_avg_custom_op.so')\n"
        "    assert poptorch.custom_op([poptorch.identity_loss(__import__('torch').ones(2),"
        " 'none')], 'CopyTensor', 'ai.graphcore', 1, [__import__('torch').ones(2)])\n")
    listed = subprocess.run([sys.executable, str(BENCH / "apps.py"), "--list"],
                            capture_output=True, text=True, timeout=limit(60))
    assert listed.returncode == 0 and listed.stdout.split()[0] == "gpt2"
    done = subprocess.run([sys.executable, str(BENCH / "apps.py"), "--examples", str(tmp_path),
                           "--only", "dino", "tgn"], capture_output=True, text=True,
                          timeout=limit(300))
    rows = [line.split(None, 1) for line in done.stdout.splitlines()[1:]]
    assert done.returncode == 1, done.stdout + done.stderr
    assert [name for name, _ in rows] == ["dino", "dino", "tgn"]
    assert "tests/test_dino.py" in rows[0][1] and " pass " in rows[0][1]
    assert "1 passed" in rows[0][1]
    assert " FAIL " in rows[1][1]  # its closer check needs the app's own scripts
    assert rows[2][1].endswith("no gnn/tgn/pytorch in the checkout")
    assert (app / "ema" / "build" / "exp_avg_custom_op.so").stat().st_size > 0
