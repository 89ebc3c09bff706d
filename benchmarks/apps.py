"""Graphcore's applications on poptorch_lite: each program's own tests, unmodified, and closer
checks of our own, run from a checkout of graphcore/examples; pass or fail per step, with why.

    python benchmarks/apps.py --examples ~/examples                 # every program
    python benchmarks/apps.py --examples ~/examples --only dino mae  # some
    python benchmarks/apps.py --list                                 # what each exercises

--examples      a checkout of github.com/graphcore/examples (nothing is fetched)
--only          program names (default: all)
--timeout       seconds a step may take (default 1800)
--path          a folder put on every step's PYTHONPATH, for an app's pinned packages
                (pip install --target DIR timm==0.5.4); repeatable

Each step runs in a process of its own, in the app's folder, under ``python -m poptorch_lite
run`` (``import poptorch`` is poptorch_lite, also in the processes the app starts). Nothing in
the checkout is edited, but for two things a build would make:

- An app that loads its custom-op library (``ctypes.cdll.LoadLibrary``) and asserts that the
  file exists finds an empty shared library, compiled with ``cc`` where its Makefile would put
  the PopART one ([Note: custom ops]); its ops run from their Python registrations.
- An app's ``conftest.py`` that builds that C++ or downloads weights at session start is not
  loaded (``pytest --noconftest``); what it set is set here (``env``).

Stand-ins for wandb and examples_utils, which the apps import at the top and a
single-process run never calls, for attrdict (broken on Python 3.10), for Horovod (the few
calls of the CNNs' popdist path, on torch.distributed) and, where a program sets
``APPS_GENERATED_CIFAR10=N``, a generated CIFAR-10 of N images
(``stand_ins/sitecustomize.py``) come first on the path
(``app_checks.stand_ins``). A step
fails on a non-zero exit; the reason printed is the last error line of its output. The
programs take minutes to an hour on a 2-core CPU, so this is kept out of the test command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class Program:
    """One application: its folder in the checkout, what it exercises, and its steps, each
    ``(label, argv after "poptorch_lite run")``; ``pytest`` in an argv is pytest's own
    ``__main__``, ``checks`` this folder's ``app_checks.py``; an argv that starts ``poprun``
    is ``poptorch-lite poprun``'s, where ``python`` is this Python."""

    name: str
    folder: str
    exercises: str
    steps: list
    libraries: tuple = ()  # custom-op libraries the app asserts exist, relative to folder
    env: dict = dataclasses.field(default_factory=dict)
    flags: tuple = ()  # of poptorch-lite run
    paths: tuple = ()  # folders of the checkout its tests import from, relative to its root


def _test(*args):
    return ["pytest", "-q", "-p", "no:cacheprovider", *args]


def _train(*args):
    """The CNNs' ``tests/test_train.py::test_synthetic`` run (32.32), and ``args``."""
    return ["train/train.py", "--data", "synthetic", "--model", "resnet18", "--epoch", "1",
            "--precision", "32.32", "--validation-mode", "none", "--optimizer", "sgd_combined",
            "--lr", "0.001", "--gradient-accumulation", "64", "--micro-batch-size", "1",
            "--dataloader-worker", "4", "--seed", "0", *args]


PROGRAMS = [
    Program("gpt2", "nlp/gpt2/pytorch",
            "serializedMatMul, recomputationCheckpoint, BeginBlock and AutoStage, tied weights, "
            "poptorch.optim.AdamW; sharded and pipelined (needs transformers==4.26.1)",
            [("sharded, against its CPU wrapper", ["checks", "gpt2", ".", "sharded"]),
             ("pipelined, against its CPU wrapper", ["checks", "gpt2", ".", "pipelined"])]),
    Program("bert", "nlp/bert/pytorch",
            "parallelize() over 2 IPUs, the app's PopART options, embedding serialization, "
            "recomputation (needs transformers==4.18 to 4.26)",
            [("against its unparallelized model", ["checks", "bert", "."]),
             ("tests/bert_tiny_test.py: loss falls, MLM accuracy rises (1 replica)",
              _test("tests/bert_tiny_test.py", "-k", "loss_down_accuracy_up and 1-1"))]),
    Program("conformer", "speech/conformer/pytorch",
            "anchorTensor(Gradient___) and getAnchoredTensor, its layers against the CPU; "
            "training: custom_op Ctc and RemapCE, 4 pipelined stages, poptorch.DataLoader "
            "(needs fire and editdistance)",
            [("tests/test_forward_grad.py", _test("-s", "tests/test_forward_grad.py")),
             ("main.py train, generated data: 2 steps of 8 in float32",
              ["main.py", "train", "--train_dataset.use_generated_data", "true",
               "--trainer.num_epochs", "1", "--ipu_options.gradient_accumulation", "8",
               "--train_iterator.batch_size", "1", "--train_iterator.num_workers", "1",
               "--train_dataset.dtype", "FLOAT32", "--val_dataset.dtype", "FLOAT32",
               "--trainer.dtype", "FLOAT32"])],
            flags=("--without-op-libraries",)),
    Program("clip", "multimodal/CLIP/pytorch",
            "parallelize() over 8 IPUs, accumulation 15, a feature queue written in forward",
            [("tests/cpu_ipu_test.py", _test("-s", "tests/cpu_ipu_test.py"))]),
    Program("dino", "vision/dino/pytorch",
            "custom_op ExpMovAvg (the teacher averaged after each step), blocks on IPUs 0,1,0,1 "
            "pipelined by data flow, float16, identity_loss",
            [("tests/test_dino.py (alignment; 50 steps in float16)",
              _test("--noconftest", "tests/test_dino.py")),
             ("every weight against its CPU reference", ["checks", "dino", "."])],
            libraries=("ema/build/exp_avg_custom_op.so",)),
    Program("mae", "vision/mae/pytorch",
            "custom_op RemapCE, getTensorNames and anchored gradients under SDK 2's names "
            "(Jit.traceModel(True)), sharded over 2 IPUs (needs timm==0.5.4: --path)",
            [("tests/test_mae.py::TestMAE::test_alignment",
              _test("--noconftest", "tests/test_mae.py", "-k", "alignment")),
             ("its gradients; 5 steps of its IPU path against plain",
              ["checks", "mae", "."])],
            libraries=("remap/remap_ops.so",),
            env={"POPTORCH_DEFAULT_OPTIONS": '{"Jit.traceModel": true}'}),
    Program("yolo_v4", "vision/yolo_v4/pytorch",
            "custom_op CopyTensor and Nms, inference and training models, uint8 inputs",
            [("tests/head_test.py", _test("--noconftest", "tests/head_test.py")),
             ("nms, model and loss tests (generated image, initial weights)",
              ["checks", "yolo", "."])],
            libraries=("utils/custom_ops/build/copy_tensor_custom_op.so",
                       "utils/custom_ops/build/nms_custom_op.so"),
            env={"PYTORCH_APPS_DETECTION_PATH": "."}),
    Program("fastpitch", "speech/fastpitch/pytorch",
            "its layers' and model's gradients against the CPU, anchored (needs librosa, "
            "cloudpickle)",
            [("tests/test_layers.py", _test("tests/test_layers.py"))]),
    Program("tgn", "gnn/tgn/pytorch", "a buffer written in place with index_put_",
            [("test/test_buffer.py", _test("test/test_buffer.py"))]),
    Program("nbfnet", "gnn/nbfnet/pytorch_geometric", "its utilities (needs torch_geometric)",
            [("tests/test_utils.py", _test("tests/test_utils.py"))]),
    Program("cnns", "vision/cnns/pytorch",
            "its configurations compile and run on generated data (MobileNet v3 small: its "
            "conftest downloads CIFAR-10 and models; needs PyTurboJPEG, timm==0.5.4)",
            [("tests/test_config.py, MobileNet v3 small",
              _test("--noconftest", "tests/test_config.py", "-k", "mobilenet-v3-small")),
             ("tests/test_config.py, EfficientNet-B0 pod16 training",
              _test("--noconftest", "tests/test_config.py", "-k",
                    "train_config_compile and efficientnet-b0")),
             ("train.py: test_synthetic's run, 32.32, 4 steps",
              _train("--iterations", "4")),
             ("train.py: the same, 2 replicas",
              _train("--iterations", "2", "--replicas", "2")),
             ("train.py: the same, --pipeline-splits layer3/0",
              _train("--iterations", "4", "--pipeline-splits", "layer3/0")),
             ("its popdist path: poprun, 2 instances, the same run",
              ["poprun", "--num-instances", "2", "--num-replicas", "2", "python",
               *_train("--iterations", "4")])]),
    Program("popdist", "tutorials/feature_examples/pytorch/popdist",
            "poprun --num-instances 2 --num-replicas 4, popdist.poptorch.Options, a DataLoader "
            "partitioned over the instances (generated CIFAR-10 of 512 images)",
            [("tests/test_popdist_training.py: both instances end equal",
              _test("tests/test_popdist_training.py"))],
            env={"APPS_GENERATED_CIFAR10": "512"}, paths=("tutorials/utils",)),
    Program("vit", "vision/vit/pytorch",
            "pretraining pipelined over 4 IPUs with 2 replicas, on generated data (needs "
            "randaugment; its test_vit.py's attrdict, broken since Python 3.10, stood in for)",
            [("pretrain.py: its test's run, micro-batches of 1, 2 steps",
              ["pretrain.py", "--micro-batch-size", "1", "--config", "b16_in1k_pretrain",
               "--gradient-accumulation", "8", "--training-steps", "2", "--epochs", "0",
               "--replication-factor", "2", "--iterations", "2", "--dataset", "generated"]),
             ("test_vit.py: its pretraining test (micro-batches of 8, 5 steps)",
              _test("test_vit.py", "-k", "pretraining"))]),
]


def stand_in_library(path: str) -> str | None:
    """An empty shared library at ``path`` where none exists; why not, or None."""
    if os.path.exists(path):
        return None
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return f"needs a C compiler (cc) for the stand-in of {path}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as src:
        src.write("/* stands in for a PopART custom-op library: poptorch_lite runs its ops */\n")
    done = subprocess.run([cc, "-shared", "-fPIC", "-o", path, src.name], capture_output=True,
                          text=True)
    os.unlink(src.name)
    return None if done.returncode == 0 else f"cc failed: {done.stderr.strip()[-200:]}"


def reason(output: str) -> str:
    """The line of ``output`` that says why a step failed, or its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in (r"^(E\s+)?\w*(Error|Exception)\b.*", r"^FAILED .*", r".*\b(failed|error)\b.*"):
        hits = [line for line in lines if re.match(pattern, line)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "(no output)"


def summary(output: str) -> str:
    """pytest's count line, a check's or a training script's last word on its numbers
    (``largest``, ``loss``), or the last line."""
    lines = [line.strip(" =") for line in output.splitlines() if line.strip()]
    for pattern in (r".*\b(passed|failed|error)\b.* in [\d.]+s", r".*\blargest\b",
                    r".*\bloss\b"):
        hits = [line for line in lines if re.match(pattern, line)]
        if hits:
            return hits[-1][-300:]
    return (lines or ["(no output)"])[-1][:300]


def run_step(program: Program, folder: str, argv: list, paths: list, timeout: float,
             stubs: str) -> tuple:
    """``(ok, seconds, text)`` of one step."""
    import pytest
    script = {"pytest": os.path.join(os.path.dirname(pytest.__file__), "__main__.py"),
              "checks": os.path.join(HERE, "app_checks.py")}.get(argv[0], argv[0])
    env = dict(os.environ)
    root = folder[:-len(program.folder)]  # the checkout: its utils hold shared test helpers
    env["PYTHONPATH"] = os.pathsep.join([stubs, folder, *paths, os.path.join(root, "utils"),
                                         *(os.path.join(root, p) for p in program.paths),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update({k: (folder if v == "." else v) for k, v in program.env.items()})
    args = [{".": folder, "python": sys.executable}.get(a, a) for a in argv[1:]]
    launch = ["poprun"] if argv[0] == "poprun" else ["run", *program.flags, script]
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "poptorch_lite", *launch, *args],
                              cwd=folder, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"took more than {timeout:.0f} s"
    seconds = time.perf_counter() - start
    output = done.stdout + "\n" + done.stderr
    return done.returncode == 0, seconds, summary(output) if done.returncode == 0 \
        else reason(output)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", help="a checkout of github.com/graphcore/examples")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="program names")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--path", action="append", default=[], metavar="DIR")
    parser.add_argument("--list", action="store_true", help="list the programs and exit")
    args = parser.parse_args(argv)
    if args.list:
        for p in PROGRAMS:
            print(f"{p.name:10} {p.folder:32} {p.exercises}")
        return 0
    if not args.examples:
        parser.error("give --examples, a checkout of github.com/graphcore/examples")
    names = {p.name for p in PROGRAMS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        parser.error(f"no program named {unknown}; the programs: {sorted(names)}")
    sys.path.insert(0, HERE)
    from app_checks import stand_ins
    stubs = stand_ins()
    failed = 0
    print(f"{'program':10} {'step':52} {'result':6} {'s':>6}  detail", flush=True)
    for program in PROGRAMS:
        if args.only and program.name not in args.only:
            continue
        folder = os.path.join(os.path.abspath(args.examples), program.folder)
        why = None if os.path.isdir(folder) else f"no {program.folder} in the checkout"
        for library in program.libraries if why is None else ():
            why = why or stand_in_library(os.path.join(folder, library))
        for label, step in program.steps:
            ok, seconds, text = (False, 0.0, why) if why else run_step(
                program, folder, step, [os.path.abspath(p) for p in args.path], args.timeout,
                stubs)
            failed += not ok
            print(f"{program.name:10} {label[:52]:52} {'pass' if ok else 'FAIL':6} "
                  f"{seconds:6.0f}  {text}", flush=True)
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
