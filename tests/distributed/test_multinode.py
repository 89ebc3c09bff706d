"""A real multi-node launch: two torchrun "nodes" on loopback, c10d rendezvous.

Each test starts two ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT`` launches, as two hosts would, of
tests/support/multinode_script.py: one 2 stages × 2 replicas run (data-parallel-inner, so
a node holds one stage's two replicas), with Adam, dropout and clipping. The reference is
plain PyTorch doing the same arithmetic in this process: two copies of the model, each
micro-batch's forward seeded as the launch seeds it, the two replicas' gradients summed
and divided by G·2, clipped, one Adam step.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.testing import assert_close

import multinode_script as script
from patience import limit
from processes import collective_s, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "multinode_script.py"
ATOL = 1e-6
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


def launch(scenario, out, per_node=2, **env):
    """Start the two nodes' torchrun launches (each its own process group, to kill)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    base.update(OMP_NUM_THREADS="1", POPTORCH_LITE_DIST_TIMEOUT=str(collective_s(60)),
                PYTHONFAULTHANDLER="1",  # an abort prints every thread's Python stack
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]),
                **env)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--max-restarts", "0",
               "--log-dir", str(pathlib.Path(out) / "torchrun"),  # not a folder left in TMPDIR
               str(SCRIPT), scenario, str(out)]
    return [subprocess.Popen(command, env=base, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for _ in range(2)]


def finish(nodes, timeout=240):
    """Wait for both launches; each must succeed."""
    for node in nodes:
        try:
            log, _ = node.communicate(timeout=limit(timeout))
        except subprocess.TimeoutExpired:
            for n in nodes:
                os.killpg(n.pid, signal.SIGKILL)
            raise AssertionError("a multi-node launch hung") from None
        assert node.returncode == 0, log[-4000:]


def results(out, scenario, W=4):
    return [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(W)]


def wait_for(out, names, nodes, deadline):
    while not all((out / name).exists() for name in names):
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), \
            [n.communicate()[0][-3000:] for n in nodes if n.poll() is not None]
        time.sleep(0.2)
    time.sleep(0.5)  # the last file is closed


def plain(calls, R=2):
    """What each of R replicas returns in each of ``calls``, then the weights and Adam's
    state: plain PyTorch doing the launch's arithmetic."""
    copies = [script.build() for _ in range(R)]
    optimizer = torch.optim.Adam(copies[0].parameters(), lr=0.01)
    returned = {p: [] for p in range(R)}
    G, D, B = script.G, script.D, script.B
    for c in calls:
        seeds = script.seeds(c)
        batches = [script.call_data(c, p, R) for p in range(R)]
        outs = {p: [] for p in range(R)}
        for d in range(D):
            for m in copies:
                m.zero_grad(set_to_none=True)
            for p, (x, y) in enumerate(batches):
                for g in range(G):
                    k = d * G + g
                    torch.manual_seed(seeds[k])
                    out, loss = copies[p](x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
                    loss.backward()
                    outs[p].append((out.detach(), loss.detach()))
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in copies)):
                    ps[0].grad = sum(q.grad for q in ps) / (G * R)
            torch.nn.utils.clip_grad_norm_(copies[0].parameters(), script.MAX_NORM)
            optimizer.step()
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in copies)):
                    for q in ps[1:]:
                        q.copy_(ps[0])
        for p in range(R):
            returned[p].append((torch.cat([o for o, _ in outs[p]]),
                                torch.stack([l for _, l in outs[p]])))
    names = {id(p): n for n, p in copies[0].named_parameters()}
    return returned, {"params": copies[0].state_dict(), "opt": {
        names[id(p)]: {k: v for k, v in s.items() if torch.is_tensor(v)}
        for p, s in optimizer.state.items()}}


def check(results_, W, atol):
    """Every process's returned values, weights and optimizer state against plain PyTorch
    (with one intra-op thread, as each process has: a product split over threads can round
    otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        returned, state = plain(range(script.CALLS), R=W // 2)
    finally:
        torch.set_num_threads(threads)
    close = (lambda a, b, msg="": assert_close(a, b, atol=atol, rtol=0, msg=msg)) if atol else \
        (lambda a, b, msg="": torch.testing.assert_close(a, b, atol=0, rtol=0, msg=msg))
    for rank, got in enumerate(results_):
        replica = script.Layout(rank, W, ((0,), (1,)), "data_parallel_inner").pipeline
        assert len(got["outputs"]) == script.CALLS
        for (out, loss), (ref_out, ref_loss) in zip(got["outputs"], returned[replica]):
            close(out, ref_out)
            close(loss, ref_loss)
        for k, v in state["params"].items():
            close(got["params"][k], v, k)
        assert got["opt"] and got["opt"].keys() < state["opt"].keys()
        for name, s in got["opt"].items():  # each process: its own stage's parameters
            for k, v in s.items():
                close(v, state["opt"][name][k], f"{name} {k}")


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """The 2 stages × 2 replicas launch: three calls, a checkpoint after the first; then
    node 1 (its agent and its workers) is killed while node 0 makes a fourth call."""
    out = tmp_path_factory.mktemp("two_nodes")
    nodes = launch("train", out, KILL="1")
    deadline = time.monotonic() + limit(240)
    wait_for(out, [f"train-rank{r}.pt" for r in range(4)], nodes, deadline)
    trained = results(out, "train")
    doomed = {r for r, t in enumerate(trained) if t["node"] == 1}
    # the whole node: its workers (torchrun starts each in a session of its own), its agent
    victim = next(n for n in nodes if all(_is_child(trained[r]["pid"], n.pid) for r in doomed))
    for r in doomed:
        os.kill(trained[r]["pid"], signal.SIGKILL)
    os.killpg(victim.pid, signal.SIGKILL)
    survivors = sorted(set(range(4)) - doomed)
    # a hang guard of its own: on a loaded machine the launch and the three calls above can
    # take most of the first (the survivors then wait out their collective timeout)
    deadline = time.monotonic() + limit(240)
    try:
        wait_for(out, [f"killed-rank{r}.pt" for r in survivors], [], deadline)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
            n.communicate()
    killed = {r: torch.load(out / f"killed-rank{r}.pt", weights_only=False) for r in survivors}
    return out, trained, doomed, killed


def test_two_nodes_of_two_processes_train_as_plain_pytorch(two_by_two):
    """Outputs, losses, weights and Adam state of every process within 1e-6 of plain
    PyTorch (the replicas' gradients are summed across processes)."""
    _, trained, doomed, _ = two_by_two
    assert len(doomed) == 2
    check(trained, 4, ATOL)


def test_a_lost_node_ends_the_others_call_within_the_timeout_naming_it(two_by_two):
    _, _, doomed, killed = two_by_two
    assert len(killed) == 2
    for rank, got in killed.items():
        kind, message = got["raised"]
        assert kind == "ExecutionError", got
        assert any(f"from process {r} failed" in message for r in doomed), message
        assert got["seconds"] < collective_s(60), got


def test_a_restart_from_the_checkpoint_continues_exactly(two_by_two):
    """A new launch loads the checkpoint written after the first call and makes the other
    two: bit for bit what the launch that never stopped returned and ended with."""
    out, trained, _, _ = two_by_two
    finish(launch("restart", out))
    for got, ref in zip(results(out, "restart"), trained):
        assert got["steps"] == script.D
        assert len(got["outputs"]) == script.CALLS - 1
        for (out_, loss), (ref_out, ref_loss) in zip(got["outputs"], ref["outputs"][1:]):
            assert torch.equal(out_, ref_out) and torch.equal(loss, ref_loss)
        assert all(torch.equal(got["params"][k], v) for k, v in ref["params"].items())
        assert got["opt"].keys() == ref["opt"].keys() and all(
            torch.equal(got["opt"][n][k], v) for n, s in ref["opt"].items() for k, v in s.items())


def test_one_replica_over_two_nodes_is_plain_pytorch_bit_for_bit(tmp_path):
    """One process per node: one pipeline of 2 stages, nothing summed across processes."""
    finish(launch("train", tmp_path, per_node=1))
    check(results(tmp_path, "train", W=2), 2, atol=0)


def _is_child(pid, parent):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
