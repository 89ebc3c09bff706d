"""PopDist on torch.distributed: ``popdist`` answers from the launcher, ``poprun`` launches on
torchrun ([Note: instances], [Note: poprun])."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite import cli
from poptorch_lite.distributed import popdist as pd
from poptorch_lite.poprun import parse
from poptorch_lite.errors import OptionsError

from patience import limit
from processes import ROOT, collective_s

LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE", "RANK",
             *pd.POPRUN_VARIABLES)


@pytest.fixture
def env(monkeypatch):
    """The environment without any launcher's variables; set some with ``env(**vars)``."""
    for var in LAUNCHERS:
        monkeypatch.delenv(var, raising=False)

    def set_(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))
    return set_


def answers(module) -> tuple:
    assert module.isUsingPopdist() == module.isPopdistEnvSet()
    assert module.getReplicationFactor() == module.getNumLocalReplicas()
    return (module.isPopdistEnvSet(), module.getInstanceIndex(), module.getNumInstances(),
            module.getNumLocalReplicas(), module.getNumTotalReplicas(),
            module.getReplicaIndexOffset(), module.getNumIpusPerReplica())


@pytest.mark.parametrize("launch, expected", [
    ({}, (False, 0, 1, 1, 1, 0, 1)),  # python script.py
    ({"WORLD_SIZE": 4, "RANK": 3}, (True, 3, 4, 1, 4, 3, 1)),  # torchrun: an instance each
    ({"WORLD_SIZE": 1, "RANK": 0}, (True, 0, 1, 1, 1, 0, 1)),
    ({"WORLD_SIZE": 2, "RANK": 1, "POPDIST_NUM_TOTAL_REPLICAS": 8,  # poprun -n 2 -r 8
      "POPDIST_NUM_LOCAL_REPLICAS": 4, "POPDIST_NUM_IPUS_PER_REPLICA": 2},
     (True, 1, 2, 4, 8, 4, 2)),
    ({"OMPI_COMM_WORLD_SIZE": 3, "OMPI_COMM_WORLD_RANK": 2, "WORLD_SIZE": 5, "RANK": 0},
     (True, 2, 3, 1, 3, 2, 1)),  # mpirun's first, as Options.Distributed reads them
])
def test_popdist_answers_from_the_launcher_as_the_options_do(env, launch, expected):
    env(**launch)
    popdist, sub = pd.popdist_modules()
    assert answers(popdist) == expected
    opts = sub.Options()
    _, index, count, local, *_ = expected
    assert (opts.replication_factor, opts.Distributed.processId,
            opts.Distributed.numProcesses) == (local, index, count)
    plain = poptorch.Options()  # what a script that never asks popdist gets
    assert (plain.Distributed.processId, plain.Distributed.numProcesses) == (index, count)


def test_a_non_uniform_popdist_environment_is_refused(env):
    env(WORLD_SIZE=2, RANK=0, POPDIST_NUM_TOTAL_REPLICAS=5, POPDIST_NUM_LOCAL_REPLICAS=2)
    popdist, sub = pd.popdist_modules()
    with pytest.raises(OptionsError, match=r"POPDIST_NUM_TOTAL_REPLICAS=5 is not "
                       r"POPDIST_NUM_LOCAL_REPLICAS=2 times the instance count 2.*"
                       r"--num-replicas 4 --num-instances 2"):
        popdist.getNumTotalReplicas()
    with pytest.raises(OptionsError, match="POPDIST_NUM_TOTAL_REPLICAS=5"):
        sub.Options()


def test_execute_on_instances_calls_only_there(env):
    popdist, _ = pd.popdist_modules()
    calls = []

    def call(value, twice=False):
        calls.append(value)
        return value * (2 if twice else 1)
    assert popdist.execute_on_instances({0}, call, "a", twice=True) == "aa"  # its result here
    assert popdist.execute_on_instances([1], call, "b") is None  # None where it did not run
    assert calls == ["a"]


def test_a_bad_instance_variable_is_refused_as_the_options_refuse_it(env):
    env(WORLD_SIZE=2, RANK=2)
    with pytest.raises(OptionsError, match=r"0 <= process_id < 2"):
        pd.instance()
    env(WORLD_SIZE=2, RANK=0, POPDIST_NUM_LOCAL_REPLICAS="two")
    with pytest.raises(OptionsError, match=r"POPDIST_NUM_LOCAL_REPLICAS='two' is not a positive"):
        pd.popdist_modules()[0].getNumLocalReplicas()


# -- poprun's command line ----------------------------------------------------------------

PY = "/usr/bin/python3"


@pytest.mark.parametrize("argv, torchrun", [
    (["--num-replicas", "4", "--num-instances", "2", PY, "t.py", "--lr", "1"],
     ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--no-python", PY,
      "t.py", "--lr", "1"]),
    # the popdist example's own test: --mpi-global-args takes "--tag-output" as its value
    (["--mpi-global-args", "--tag-output", "--num-replicas", "4", "--num-instances", "2",
      PY, "t.py"],
     ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--tee", "3",
      "--log-line-prefix-template", "[1,${rank}]: ", "--no-python", PY, "t.py"]),
    (["--num-replicas", "1", "train.py"],  # a script that is not executable: this Python's
     ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--no-python", PY,
      "train.py"]),
    (["--num-instances=4", "--num-replicas=8", "--host", "a,b", "--only-output-from-instance",
      "3", "run.sh"],
     ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "a", "--nproc-per-node",
      "2", "--max-restarts", "0", "--no-python", PY, "-m", "poptorch_lite.poprun",
      "--instance-output", "3", "run.sh"]),
])
def test_poprun_becomes_torchrun(argv, torchrun, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert parse(argv).torchrun_args(python=PY) == torchrun


def test_several_hosts_meet_at_the_first_ones_master_port(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29577")
    args = parse(["--host", "h1,h2", "--num-instances", "2", "--num-replicas", "2",
                  "p"]).torchrun_args(python=PY)
    assert args[:6] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:29577"]


def test_poprun_reads_mpirun_arguments_and_passes_ipu_only_flags():
    launch = parse(["--mpi-global-args=-x FOO=1 --bind-to none --allow-run-as-root",
                    "--mpi-local-args", '-x "BAR=two words" --tag-output',
                    "--vipu-partition", "p16", "--update-partition=yes", "--num-replicas", "2",
                    "--ipus-per-replica", "4", "prog"])
    assert launch.exports == {"FOO": "1", "BAR": "two words"}
    assert launch.tag_output
    assert launch.ignored == ["--bind-to none", "--allow-run-as-root", "--vipu-partition=p16",
                              "--update-partition=yes"]
    assert launch.environment() == {
        "POPDIST_NUM_TOTAL_REPLICAS": "2", "POPDIST_NUM_LOCAL_REPLICAS": "2",
        "POPDIST_NUM_IPUS_PER_REPLICA": "4", "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
        "FOO": "1", "BAR": "two words"}


@pytest.mark.parametrize("argv, message", [
    (["--num-replicas", "2", "--np", "2", "p"], r"poprun has no flag '--np' here; its flags:"),
    (["--num-replicas", "3", "--num-instances", "2", "p"],
     r"--num-replicas 3 is not a multiple of --num-instances 2.*give --num-replicas 2"),
    (["--num-replicas", "6", "--num-instances", "3", "--host", "a,b", "p"],
     r"--num-instances 3 does not spread evenly over the 2 host\(s\) \['a', 'b'\]"),
    (["--num-replicas", "2", "--num-instances", "2", "--only-output-from-instance", "2", "p"],
     r"--only-output-from-instance '2' is not an instance index \(0 to 1\)"),
    (["--num-replicas", "0", "p"], r"--num-replicas '0' is not a positive integer"),
    (["--num-instances", "2", "p"], r"give --num-replicas"),
    (["--num-replicas", "2"], r"give the PROGRAM to launch"),
    (["--num-replicas"], r"--num-replicas needs a value"),
])
def test_poprun_refuses_a_bad_command_line(argv, message):
    with pytest.raises(OptionsError, match=message):
        parse(argv)


def test_poprun_help_lists_its_flags(capsys):
    assert cli.main(["poprun", "--num-replicas", "2", "--help", "p"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: poprun [--num-instances I] --num-replicas R")
    for flag in ("--ipus-per-replica", "--host", "--tag-output", "--only-output-from-instance",
                 "--mpi-global-args", "--mpi-local-args", "--vipu-*"):
        assert f"\n  {flag}" in out, flag


def test_poprun_exits_2_with_the_reason_before_launching(capsys):
    assert cli.main(["poprun", "--num-replicas", "3", "--num-instances", "2",
                              "p"]) == 2
    assert "poprun: --num-replicas 3 is not a multiple" in capsys.readouterr().err


# -- a launch -----------------------------------------------------------------------------

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "support" / "popdist_script.py"


def test_two_instances_of_two_replicas_train_as_one_process_of_four(tmp_path):
    """``poprun --num-instances 2 --num-replicas 4``: each instance runs 2 replicas on its
    half of every global batch; both end with the weights of one process with 4 replicas
    (within 1e-6: the gradient sum crosses processes). Only instance 1's output is shown,
    tagged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "POPTORCH_LITE_DIST_TIMEOUT": str(collective_s(60)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    done = subprocess.run(
        [sys.executable, "-m", "poptorch_lite", "poprun", "--num-instances", "2",
         "--num-replicas", "4", "--tag-output", "--only-output-from-instance", "1",
         sys.executable, str(SCRIPT), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=limit(180))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines == ["[1,1]: instance 1 of 2, replicas 2 of 4 from 2"]
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from popdist_script import train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    opts = poptorch.Options().replicationFactor(4)
    opts.Distributed.configureProcessId(0, 1)  # whatever launched the suite
    expected = train(poptorch, opts, 0, 1)
    for index in (0, 1):
        got = torch.load(tmp_path / f"instance-{index}.pt")
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.equal(expected["net.0.weight"], torch.nn.Linear(6, 16).weight)  # trained
