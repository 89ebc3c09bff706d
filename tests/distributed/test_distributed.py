"""Replication across processes: 2 processes on loopback with gloo against one plain run.

The processes are started by the test with torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and run tests/support/_distributed_worker.py.
Tolerance: the plain reference sums all G·R·P micro-batch gradients and divides
once; the processes divide their own sums by G·R, add them in the all-reduce
and divide by P. Both are fp32 sums of the same terms in another order, so they
agree to rounding (atol 1e-5, the house tolerance); the two processes agree
with each other exactly (every rank receives the same reduced bytes).
"""

import copy
import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch

from _distributed_worker import (B, BN, CALLS, CONFIGS, NCCL_CONFIGS, bn_call_data, call_data,
                                 optimizer, resumable)
from models import BlockMLP
from patience import limit
from processes import free_port, start

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "_distributed_worker.py"
DATA = pathlib.Path(os.environ.get("MNIST_DATA", ROOT.parent / "shared" / "data"))
P = 2
ATOL = 1e-5


def spawn(scenario, out, timeout=120):
    """Run the worker in P processes; returns their (code, stdout, stderr)."""
    return start(WORKER, [scenario, out], P, timeout, timeout_s=30)


@pytest.fixture(scope="module")
def trained_in(tmp_path_factory):
    """The folder of the ``train`` scenario's results (and of its checkpoints)."""
    out = tmp_path_factory.mktemp("distributed")
    for code, _, stderr in spawn("train", out):
        assert code == 0, stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(trained_in):
    return [torch.load(trained_in / f"rank{r}.pt", weights_only=False) for r in range(P)]


def reference(name):
    """Plain PyTorch on the global batch: per step, every process's G·R micro-batches."""
    blocks, G, R, D, _, reduction, opt_kind = CONFIGS[name]
    torch.manual_seed(100)  # process 0's initial weights, which the broadcast gives everyone
    model = BlockMLP(blocks)
    opt = optimizer(opt_kind, model.parameters())
    losses = [[[] for _ in range(CALLS)] for _ in range(P)]
    for c in range(CALLS):
        batches = [call_data(name, c, p, P) for p in range(P)]
        for d in range(D):
            opt.zero_grad(set_to_none=True)
            for p, (x, y) in enumerate(batches):
                for j in range(G * R):
                    k = (d * G * R + j) * B
                    _, loss = model(x[k:k + B], y[k:k + B])
                    loss.backward()
                    losses[p][c].append(loss.detach())
            if reduction == "mean":
                for q in model.parameters():
                    q.grad.div_(G * R * P)
            opt.step()
    return losses, model.state_dict(), opt.state_dict()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_match_one_plain_run_with_the_same_global_batch(trained, name):
    """Losses of every call, parameters and optimizer state after 3 calls (pipelined too)."""
    losses, params, opt_state = reference(name)
    for r, result in enumerate(trained):
        got = result[name]
        for c in range(CALLS):
            assert_close(got["losses"][c], torch.stack(losses[r][c]), atol=ATOL, rtol=0)
        for k, v in params.items():
            assert_close(got["params"][k], v, atol=ATOL, rtol=0)
        for i, state in opt_state["state"].items():
            for k, v in state.items():
                assert_close(got["opt"]["state"][i][k], v, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_processes_hold_identical_parameters_and_optimizer_state(trained, name):
    a, b = trained[0][name], trained[1][name]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    for i, state in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][i][k]) if torch.is_tensor(v) else
                   v == b["opt"]["state"][i][k] for k, v in state.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < P,
                    reason=f"needs {P} CUDA GPUs")
def test_two_processes_on_gpus_of_their_own_reduce_over_nccl_and_match_one_plain_run(tmp_path):
    """Each process's IPUs take its own GPU ([Note: GPUs of a process]); the gradients meet
    over NCCL. GPU kernels sum in another order than the CPU reference: atol 1e-4."""
    for code, _, stderr in spawn("nccl", tmp_path):
        assert code == 0, stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(P)]
    assert len({result["gpu"] for result in results}) == P
    for r, result in enumerate(results):
        assert result["backend"] == "nccl"
        for name in NCCL_CONFIGS:
            losses, params, opt_state = reference(name)
            got = result[name]
            assert got["devices"] == [result["gpu"]]
            for c in range(CALLS):
                assert_close(got["losses"][c].cpu(), torch.stack(losses[r][c]), atol=1e-4, rtol=0)
            for k, v in params.items():
                assert_close(got["params"][k], v, atol=1e-4, rtol=0)
            for i, state in opt_state["state"].items():
                for k, v in state.items():
                    assert_close(got["opt"]["state"][i][k], v, atol=1e-4, rtol=0)


def test_batchnorm_on_replicas_in_two_processes_keeps_each_replicas_statistics(trained):
    """[Note: running statistics on replicas]: 2 processes of 2 replicas train a BatchNorm model
    as 4 independent copies of it would, each normalising its own slices with its own
    statistics, their gradients averaged; each process's host model holds its replica 0's
    statistics, its replica 1 its own."""
    blocks, G, R, D, b, calls = BN
    torch.manual_seed(100)
    copies = [BlockMLP(blocks, batchnorm=True)]
    copies += [copy.deepcopy(copies[0]) for _ in range(P * R - 1)]  # copy p·R + r: replica r of p
    opt = torch.optim.SGD(copies[0].parameters(), lr=0.02, momentum=0.9)
    losses = [[[] for _ in range(calls)] for _ in range(P)]
    for c in range(calls):
        batches = [bn_call_data(c, p, P) for p in range(P)]
        for d in range(D):
            for m in copies:
                m.zero_grad(set_to_none=True)
            for p, (x, y) in enumerate(batches):
                for j in range(G * R):
                    k = (d * G * R + j) * b
                    _, loss = copies[p * R + j % R](x[k:k + b], y[k:k + b])
                    loss.backward()
                    losses[p][c].append(loss.detach())
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in copies)):
                    ps[0].grad = sum(q.grad for q in ps) / (G * R * P)
            opt.step()
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in copies)):
                    for q in ps[1:]:
                        q.copy_(ps[0])
        for r, result in enumerate(trained):
            got, where = result["batchnorm"], f"process {r}, call {c}"
            assert_close(got["losses"][c], torch.stack(losses[r][c]), atol=ATOL, rtol=0, msg=where)
            for k, v in copies[r * R].state_dict().items():
                assert_close(got["state"][c][k], v, atol=ATOL, rtol=0, msg=f"{k}, {where}")
            for k, v in copies[r * R + 1].named_buffers():
                assert_close(got["replica1"][c][k], v, atol=ATOL, rtol=0,
                             msg=f"replica 1's {k}, {where}")
    assert not torch.equal(copies[0].bn.running_mean, copies[R].bn.running_mean)


def test_a_buffer_write_of_the_models_own_is_refused_in_every_process(trained):
    for result in trained:
        assert result["buffer_write"] == {"refused": (
            "PopTorch does not support broadcasting buffers. If your model is able to tolerate "
            "buffers becoming out of sync between replicas, you can disable buffer broadcasting "
            "using poptorch.Options.broadcastBuffers(False). (The model changes buffers "
            "['steps'] and replicationFactor is 1 in each of 2 processes.)"), "unchanged": True}


def test_a_run_saved_mid_epoch_by_2_processes_is_resumed_by_1_reading_the_rest_once(
        trained_in, trained):
    """Data-parallel processes write one checkpoint file, the main process's (its replica 0's
    BatchNorm statistics, not process 1's, though process 1 saved after it). One process
    resumes its mid-epoch position by reading the rest of that epoch in the order the two
    would have ([Note: global loader position]): each step of theirs, process 0's batch then
    process 1's; from the epoch's end it reads the next epoch whole, every sample once."""
    ranks = [result["resume"] for result in trained]
    assert sorted(ranks[0]["read"] + ranks[1]["read"]) == list(range(64))  # the saved epoch
    for name in ("mid", "end"):
        saved = torch.load(trained_in / f"{name}.pt", weights_only=True)["model"]
        assert all(torch.equal(v, ranks[0]["saved"][name][k]) for k, v in saved.items()), name
        assert not torch.equal(saved["bn.running_mean"], ranks[1]["saved"][name]["bn.running_mean"])
    assert sorted(os.listdir(trained_in)) == ["end.pt", "mid.pt", "rank0.pt", "rank1.pt"]

    torch.manual_seed(5)
    model, wrapped, loader = resumable()  # one process
    info = poptorch.load_checkpoint(trained_in / "mid.pt", wrapped, loader)
    assert info.epoch == 0 and len(loader) == 4  # 2 steps of 2 processes' 8 samples are left
    read = []
    for x, y, index in loader:
        wrapped(x, y)
        read += index.tolist()
    assert read == [i for batch in (2, 3) for rank in ranks
                    for i in rank["read"][8 * batch:8 * batch + 8]]
    assert loader.state_dict()["epoch"] == 0 and len(loader) == 8

    info = poptorch.load_checkpoint(trained_in / "end.pt", wrapped, loader)
    assert info.epoch == 0 and loader.state_dict()["batches"] == len(loader) == 8
    read = []
    for x, y, index in loader:
        wrapped(x, y)
        read += index.tolist()
    assert sorted(read) == list(range(64)) and loader.state_dict()["epoch"] == 1
    wrapped.destroy()


def test_mismatched_options_are_refused_on_every_process_before_any_change(trained):
    for r, result in enumerate(trained):
        mine, theirs = (2, 4) if r == 0 else (4, 2)
        assert result["mismatch"] == (
            f"Options.Training.gradientAccumulation differs between processes: {mine} in this "
            f"process (rank {r}) but {theirs} in rank {1 - r}; every process must use the same "
            f"options, optimizer and model")
        assert result["mismatch_unchanged"]


def test_one_process_raising_ends_both_with_a_clear_error(tmp_path):
    """Rank 1 passes a bad batch on its 2nd call; rank 0's all-reduce fails, no hang."""
    results = spawn("fail", tmp_path, timeout=90)
    assert [code for code, _, _ in results] == [1, 1], [e[-2000:] for _, _, e in results]
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in range(P))
    assert rank1.startswith("BatchSizeError: Invalid batch dimension")
    assert rank0.startswith("ExecutionError: action U (step) failed on stream 0")
    assert "the gradient all-reduce across 2 processes failed in process 0" in rank0
    assert "POPTORCH_LITE_DIST_TIMEOUT" in rank0


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataloader_shards_like_distributed_sampler(shuffle):
    """Disjoint shards covering the dataset each epoch; set_epoch(e) repeats epoch e's order."""
    n, epochs = 48, {}
    for p in range(P):
        opts = poptorch.Options().randomSeed(5)
        opts.Distributed.configureProcessId(p, P)
        opts.Training.gradientAccumulation(2)
        loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(n)),
                                     batch_size=3, shuffle=shuffle)
        for e in (0, 1, 0):
            loader.set_epoch(e)
            epochs.setdefault(e, [[] for _ in range(P)])[p] = [
                int(i) for (batch,) in loader for i in batch]
    for e in (0, 1):
        first, second = epochs[e]
        assert sorted(first + second) == list(range(n)) and not set(first) & set(second)
    assert (epochs[0] != epochs[1]) == shuffle


@pytest.mark.parametrize("order,pipelines", [("pipeline_inner", [[0, 1], [2, 3]]),
                                             ("data_parallel_inner", [[0, 2], [1, 3]])])
def test_the_processes_of_one_pipeline_read_the_same_data_and_pipelines_disjoint_shards(
        order, pipelines):
    """With set_ipu_processes the loader shards over pipelines ([Note: stages in other
    processes]): 4 processes in 2 pipelines of 2; each pipeline's processes read one shard,
    pipeline 0's the first ([Note: process layout]: which ranks those are is the order's)."""
    n, W, seen = 48, 4, []
    for p in range(W):
        opts = poptorch.Options().randomSeed(5)
        opts.Distributed.configureProcessId(p, W)
        opts.Distributed.set_ipu_processes([[0], [1]])
        opts.Distributed.process_order = order  # the attribute goes through the setter
        opts.Training.gradientAccumulation(2)
        loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(n)),
                                     batch_size=3, shuffle=True)
        seen.append([int(i) for (batch,) in loader for i in batch])
    (a, b), (c, d) = pipelines
    assert seen[a] == seen[b] and seen[c] == seen[d] and seen[0] != seen[3]
    assert sorted(seen[a] + seen[c]) == list(range(n))
    single = poptorch.Options().randomSeed(5)
    single.Distributed.configureProcessId(0, 2)
    single.Training.gradientAccumulation(2)
    loader = poptorch.DataLoader(single, torch.utils.data.TensorDataset(torch.arange(n)),
                                 batch_size=3, shuffle=True)
    assert seen[a] == [int(i) for (batch,) in loader for i in batch]  # pipeline 0: shard 0


def test_set_ipu_processes_reads_back_and_counts_processes_per_pipeline():
    opts = poptorch.Options()
    assert (opts.Distributed.ipu_processes, opts.Distributed.processes_per_pipeline) == (None, 1)
    opts.Distributed.set_ipu_processes({0: 0, 1: [1, 2]})
    assert opts.Distributed.ipu_processes == ((0,), (1, 2))
    assert opts.Distributed.processes_per_pipeline == 2
    opts.Distributed.ipu_processes = [[0, 1]]  # the attribute goes through the setter
    assert opts.Distributed.ipu_processes == ((0, 1),)
    assert poptorch.Options().from_json(
        '{"Distributed.ipu_processes": [[0], [1]]}').Distributed.ipu_processes == ((0,), (1,))


def test_options_pick_up_torchrun_environment(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    d = poptorch.Options().Distributed
    assert (d.processId, d.numProcesses) == (3, 4)
    assert not poptorch.is_main_process()


def test_several_processes_without_a_rendezvous_address_are_refused(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    torch.manual_seed(0)
    model = BlockMLP(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = poptorch.trainingModel(model, opts)
    with pytest.raises(poptorch.OptionsError, match="MASTER_ADDR and MASTER_PORT are not set; "
                                                    "launch with torchrun"):
        wrapped(torch.randn(2, 8), torch.zeros(2, dtype=torch.long))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.skipif(not (DATA / "MNIST" / "raw").is_dir(),
                    reason=f"MNIST not found under {DATA} (set MNIST_DATA)")
def test_mnist_distributed_example_runs_under_torchrun(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(P),
         "--log-dir", str(tmp_path),  # torchrun's folder, which it would leave in TMPDIR
         "--master_port", str(free_port()), str(ROOT / "examples" / "mnist_distributed.py"),
         "--data-dir", str(DATA), "--limit", "640", "--device-iterations", "2"],
        capture_output=True, text=True, timeout=limit(300), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()  # rank 0 alone prints
    assert lines[0] == ("effective batch: 8 x 4 accumulation x 1 replica x 2 processes = 64 "
                        "per step, 128 per call (2 steps)")
    assert re.fullmatch(r"trained on 640 images in [0-9.]+ s \([0-9]+ images/s\)", lines[-2])
    assert re.fullmatch(r"Accuracy on test set: [0-9]+\.[0-9]{2}%", lines[-1])
    assert len(lines) == 3


def test_distributed_docstring_examples_run():
    from poptorch_lite.distributed import processes as distributed
    result = doctest.testmod(distributed, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4
