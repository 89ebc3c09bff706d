"""One process of tests/distributed/test_process_pipeline.py: a pipeline whose stages run in several
processes, started with torchrun's variables set.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/support/_pipeline_worker.py train OUT_DIR

The same functions run the single-process reference inside the test (``WORLD_SIZE``
unset: the same configuration without ``set_ipu_processes``). Scenarios (``W`` processes):
``train`` runs every configuration of ``CONFIGS`` for this W; ``fail`` makes one
process's action raise in the second call; ``refuse`` wraps with options that differ
between processes and with a placement that misses an IPU; ``checkpoint`` saves in the
middle of training and resumes in fresh models; ``exit-ours-CONFIG`` and
``exit-users-CONFIG`` count gloo's threads left at exit. Each writes
``OUT_DIR/<scenario>-rank<r>.pt``.
"""

import atexit
import importlib
import os
import pathlib
import shutil
import sys

import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.distributed.layout import Layout

from models import BlockMLP, data
from probes import PROBE, Probed, probed_batch

B, CALLS = 2, 3


class SkipTied(torch.nn.Module):
    """Four stages: stage 3 reads stage 0's output (a skip connection) and uses stage 1's
    layer again (a tied weight); stages 0 and 2 drop out."""

    def __init__(self, width=8, classes=4):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = (torch.nn.Linear(width, width) for _ in range(3))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            h0 = F.dropout(torch.relu(self.fc0(x)), 0.25, self.training)
        with poptorch.Block("b1", ipu_id=1):
            h1 = torch.relu(self.fc1(h0))
        with poptorch.Block("b2", ipu_id=2):
            h2 = F.dropout(torch.relu(self.fc2(h1)), 0.25, self.training)
        with poptorch.Block("b3", ipu_id=3):
            out = self.head(torch.relu(self.fc1(h2)) + h0)
            return out, F.cross_entropy(out, y)


class StateAcross(torch.nn.Module):
    """Two stages: stage 0 moves an EMA buffer and renormalises the rows of an embedding
    (max_norm) that it looks up; stage 1 reads the EMA and uses the embedding's weight again
    (tied) beside its head: each reads the writer's snapshot ([Note: state across stages])."""

    def __init__(self, width=8, classes=4):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(width, width), torch.nn.Linear(width, classes)
        self.emb = torch.nn.Embedding(classes, width, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            h = torch.relu(self.fc(x)) + self.emb(y)
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
        with poptorch.Block("b1", ipu_id=1):
            h = h + self.ema
            out = self.head(h) + h @ self.emb.weight.t()
            return out, F.cross_entropy(out, y)


# name: (world size, model, processes' IPUs, schedule, G, D, recompute, optimizer)
CONFIGS = {
    **{f"2-{s}{'-recompute' if r else ''}": (2, "mlp", [[0], [1]], s, 4, 2, r, "sgd")
       for s in ("sequential", "grouped", "interleaved", "gpipe", "zero_bubble")
       for r in (False, True)},
    "2-state-interleaved-recompute": (2, "state", [[0], [1]], "interleaved", 4, 2, True, "sgd"),
    "2-state-zero_bubble": (2, "state", [[0], [1]], "zero_bubble", 4, 2, False, "adam"),
    "3-grouped": (3, "skip", [[0], [1], [2, 3]], "grouped", 8, 2, False, "sgd"),
    "3-interleaved-recompute-clip": (3, "skip", [[0], [1], [2, 3]], "interleaved", 8, 2, True,
                                     "clip"),
    "3-sequential-back-and-forth": (3, "skip", [[0, 2], [1], [3]], "sequential", 7, 1, False,
                                    "adam"),
    "3-gpipe-back-and-forth-als": (3, "skip", [[0, 2], [1], [3]], "gpipe", 7, 2, False, "als"),
    "3-zero_bubble-back-and-forth": (3, "skip", [[0, 2], [1], [3]], "zero_bubble", 7, 2, True,
                                     "adam"),
    "4-grouped-two-replicas": (4, "replicable", [[0], [1]], "grouped", 4, 2, False, "adam"),
    "4-interleaved-two-replicas": (4, "replicable", [[0], [1]], "interleaved", 3, 1, True,
                                   "sgd"),
    "4-grouped-two-replicas-data-parallel-inner": (4, "replicable", [[0], [1]], "grouped", 4,
                                                   2, False, "adam"),
    "4-interleaved-two-replicas-sharded-clip": (4, "replicable", [[0], [1]], "interleaved", 4,
                                                2, False, "clip"),
}
# Options.Distributed.set_process_order of a configuration ("pipeline_inner" where unnamed)
ORDERS = {"4-grouped-two-replicas-data-parallel-inner": "data_parallel_inner"}
# configurations whose optimizer state is sharded over the processes that run the same stages
# (useReplicatedTensorSharding; [Note: sharded optimizer state])
SHARDED = {"4-interleaved-two-replicas-sharded-clip"}


def layout(name, rank):
    """Where process ``rank`` of a configuration sits ([Note: process layout])."""
    W, _, ipus, *_ = CONFIGS[name]
    return Layout(rank, W, tuple(map(tuple, ipus)), ORDERS.get(name, "pipeline_inner"))


def build(kind):
    """The model of a configuration. "replicable" has no BatchNorm (each replica keeps its own
    statistics, which one reference model cannot) and no dropout (a replica in another process draws its masks from the streams
    of its own micro-batches, not from those of the one process's interleaved replicas)."""
    torch.manual_seed(100)
    if kind == "skip":
        return SkipTied()
    if kind == "state":
        return StateAcross()
    if kind == "replicable":
        return BlockMLP(2)
    return BlockMLP(2, dropout=0.3, batchnorm=True)


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "clip":
        return poptorch.optim.SGD(params, lr=0.5, momentum=0.9, max_grad_norm=0.05)
    if kind == "als":
        return poptorch.optim.SGD(params, lr=0.05, momentum=0.9, loss_scaling=1024.0)
    return torch.optim.Adam(params, lr=0.01)


def options(name, spread):
    W, _, ipus, schedule, G, D, recompute, opt = CONFIGS[name]
    replicas = W // len(ipus)
    opts = poptorch.Options().deviceIterations(D)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.parse(schedule)))
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    if opt == "als":
        opts.Training.setAutomaticLossScaling(True, growth_interval=1)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    if spread:
        opts.Distributed.set_ipu_processes(ipus)
        opts.Distributed.set_process_order(ORDERS.get(name, "pipeline_inner"))
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(name in SHARDED))
    elif replicas > 1:  # the reference: the same replicas in one process
        opts.replicationFactor(replicas)
    return opts


def call_data(name, call, replica=None):
    """A call's combined batch: one per data-parallel replica, or (``replica`` None) all
    replicas' micro-batches interleaved as one process with replicationFactor lays them out."""
    W, _, ipus, _, G, D, _, _ = CONFIGS[name]
    R = W // len(ipus)
    width = 8
    x, y = data(B * G * D * R, width=width, seed=7 + call)
    if CONFIGS[name][-1] == "als" and call == 1:
        x[0, 0] = float("inf")  # the first step of the second call is skipped, the scale halves
    x, y = x.view(D, G, R, B, width), y.view(D, G, R, B)
    if replica is None:
        return x.reshape(-1, width), y.reshape(-1)
    return x[:, :, replica].reshape(-1, width), y[:, :, replica].reshape(-1)


def state_by_name(model, optimizer):
    """Optimizer state keyed by parameter name (only the parameters it holds state for)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()}


def train(name, spread, calls=CALLS):
    """Run one configuration; what every call returned and the final state."""
    W, kind, ipus, *_, opt_kind = CONFIGS[name]
    model = build(kind)
    # clipping's norm is of the optimizer's weights: fc0's bias has a gradient and no step
    params = [p for n, p in model.named_parameters() if opt_kind != "clip" or n != "fc0.bias"]
    optimizer = make_optimizer(opt_kind, params)
    wrapped = poptorch.trainingModel(model, options(name, spread), optimizer)
    replica = layout(name, int(os.environ["RANK"])).pipeline if spread else None
    outputs = []
    for c in range(calls):
        torch.manual_seed(1000 + c)
        out, loss = wrapped(*call_data(name, c, replica))
        outputs.append((out, loss))
    wrapped.copyWeightsToHost()
    result = {"outputs": outputs, "params": {k: v.clone() for k, v in model.state_dict().items()},
              "opt": state_by_name(model, optimizer), "rng": torch.get_rng_state(),
              "scale": (wrapped._loss_scale.scale, wrapped._loss_scale.skipped_steps),
              "timeline": wrapped.runStatistics().timeline.stream_names}
    wrapped.destroy()
    if W == len(ipus):  # one pipeline: an inference model of the trained model, spread too
        opts = poptorch.Options().deviceIterations(4).outputMode(poptorch.OutputMode.All)
        opts.setExecutionStrategy(options(name, spread).execution_strategy)
        if spread:
            opts.Distributed.set_ipu_processes(ipus)
        infer = poptorch.inferenceModel(model, opts)
        x, _ = data(B * 4, width=8, seed=99)
        result["inference"] = infer(x, torch.zeros(B * 4, dtype=torch.long))[0]
        infer.destroy()
    return result


def scenario_train(W):
    return {name: train(name, True) for name, config in CONFIGS.items() if config[0] == W}


def failing(rank):
    """Rank 1's stage 1 raises in the forward of micro-batch 2 in the second call; the
    third call runs."""
    torch.manual_seed(0)
    model = Probed(2, stateful=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.Interleaved))
    opts.Training.gradientAccumulation(4)
    opts.Distributed.set_ipu_processes([[0], [1]])
    wrapped = poptorch.trainingModel(model, opts, opt)
    result = {"losses": [], "errors": []}
    for c in range(3):
        torch.manual_seed(c)
        x, y = probed_batch(4)

        def fault(kind, stage, i, c=c):
            if (c, kind, stage, i) == (1, "F", 1, 2):
                raise RuntimeError("injected fault")
        PROBE["fn"] = fault if rank == 1 else None
        try:
            result["losses"].append(wrapped(x, y)[1])
        except poptorch.ExecutionError as e:
            result["errors"].append(str(e))
            wrapped.copyWeightsToHost()
            result["after_failure"] = {k: v.clone() for k, v in model.state_dict().items()}
    PROBE["fn"] = None
    wrapped.copyWeightsToHost()
    result["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def errors(rank):
    """What each process raises: a call in which process 1's action fails, a call in which
    process 1 has exited (process 0 alone goes on), and a call after that one."""
    torch.manual_seed(0)
    model = Probed(2)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Distributed.set_ipu_processes([[0], [1]])
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    raised = {}
    for c, what in enumerate(("fine", "remote", "lost", "broken")):
        if rank == 1 and what == "lost":
            os._exit(3)  # as a process that crashes
        PROBE["fn"] = _fault if (rank, what) == (1, "remote") else None
        try:
            wrapped(*probed_batch(4))
        except poptorch.Error as e:
            raised[what] = (type(e).__name__, str(e), getattr(e, "__notes__", []),
                            type(e.__cause__).__name__)
    PROBE["fn"] = None
    return raised


def ended(rank):
    """An inference call in which process 1 exits in its last forward, after it received
    everything process 0 sent: process 0 misses it only at the end of the run."""
    torch.manual_seed(0)
    opts = poptorch.Options().deviceIterations(4)
    opts.Distributed.set_ipu_processes([[0], [1]])
    infer = poptorch.inferenceModel(Probed(2), opts)
    raised = {}
    if rank == 1:
        PROBE["fn"] = lambda kind, stage, i: os._exit(3) if (kind, i) == ("F", 3) else None
    for what in ("end", "broken"):
        try:
            infer(*probed_batch(4))
        except poptorch.Error as e:
            raised[what] = (type(e).__name__, str(e), getattr(e, "__notes__", []),
                            type(e.__cause__).__name__)
    return raised


def host_edits(spread, rank=0):
    """A call; a host edit of each process's own weight (in one process: of both); the
    collective copyWeightsToHost; another call. Every IPU has a memory of its own
    (useIpuModel), so the edits must be pushed to the stages' copies."""
    torch.manual_seed(0)
    model = BlockMLP(2)
    opts = poptorch.Options().useIpuModel(True)
    opts.Training.gradientAccumulation(4)
    if spread:
        opts.Distributed.set_ipu_processes([[0], [1]])
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(8)
    wrapped(x, y)
    with torch.no_grad():
        for owner, weight in ((0, model.layers[0].weight), (1, model.head.weight)):
            if not spread or owner == rank:
                weight.add_(1.0)
    wrapped.copyWeightsToHost()
    wrapped(x, y)
    wrapped.copyWeightsToHost()
    result = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.destroy()
    return result


def _fault(kind, stage, i):
    if (kind, stage, i) == ("B", 1, 1):
        raise RuntimeError("injected fault")


def refusals(rank):
    """Options that differ between the processes, then a placement that misses an IPU."""
    result = {}
    torch.manual_seed(0)
    model = BlockMLP(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(8 if rank == 0 else 9)
    opts.Distributed.set_ipu_processes([[0, 1], [2, 3]])
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        wrapped(*data(B * opts.Training.gradient_accumulation))
    except poptorch.OptionsError as e:
        result["mismatch"] = str(e)
    wrapped.destroy()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(8)
    opts.Distributed.set_ipu_processes([[0, 1], [2]])
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        wrapped(*data(B * 8))
    except poptorch.OptionsError as e:
        result["uncovered"] = str(e)
    wrapped.destroy()
    small = BlockMLP(2)  # on IPUs 0 and 1: process 1 would run no stage
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Distributed.set_ipu_processes([[0, 1], [2, 3]])
    wrapped = poptorch.trainingModel(small, opts, torch.optim.SGD(small.parameters(), lr=0.1))
    try:
        wrapped(*data(B * 4))
    except poptorch.OptionsError as e:
        result["stageless"] = str(e)
    result["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    wrapped.destroy()
    teacher = _Teacher()  # an after-step average over a pipeline's processes
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Distributed.set_ipu_processes([[0], [1]])
    wrapped = poptorch.trainingModel(teacher, opts,
                                     torch.optim.SGD(teacher.parameters(), lr=0.1))
    try:
        wrapped(torch.ones(4, 4), torch.ones(4))
    except poptorch.BlockError as e:
        result["averaged"] = str(e)
    wrapped.destroy()
    return result


class _Teacher(torch.nn.Module):
    """DINO's teacher, averaged from the student by ExpMovAvg, over IPUs 0 and 1."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.teacher.requires_grad_(False)
        self.head = poptorch.BeginBlock(torch.nn.Linear(4, 4), ipu_id=1)

    def forward(self, x, factor):
        with torch.no_grad():
            for q, k in zip(self.student.parameters(), self.teacher.parameters()):
                poptorch.custom_op([q, k, factor], "ExpMovAvg", "com.acme", 1, [q])
        return poptorch.identity_loss(self.head(self.student(x) - self.teacher(x)).sum(),
                                      reduction="mean")


def checkpointed(rank, out):
    """Four calls with checkpoints after the second (A and B) and, in process 0 alone, after
    the third (A again); then fresh models (other weights and random state) load A, which
    is refused, and resume from B, and again with the processes' stages swapped."""
    name = "2-interleaved"
    a, b = os.path.join(out, "a.pt"), os.path.join(out, "b.pt")
    model = build("mlp")
    wrapped = poptorch.trainingModel(model, options(name, True), make_optimizer("sgd", model.parameters()))
    torch.manual_seed(1000)
    losses = []
    for c in range(4):
        losses.append(wrapped(*call_data(name, c, 0))[1])
        if c == 1:
            poptorch.save_checkpoint(a, wrapped)
            poptorch.save_checkpoint(b, wrapped)
        if c == 2 and rank == 0:
            poptorch.save_checkpoint(a, wrapped)
    wrapped.copyWeightsToHost()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.destroy()
    torch.manual_seed(5)  # other weights and random state: the checkpoint restores them
    model = BlockMLP(2, dropout=0.3, batchnorm=True)
    wrapped = poptorch.trainingModel(model, options(name, True), make_optimizer("sgd", model.parameters()))
    try:
        poptorch.load_checkpoint(a, wrapped)
        refused = None
    except poptorch.CheckpointError as e:
        refused = str(e)
    info = poptorch.load_checkpoint(b, wrapped)
    resumed = [wrapped(*call_data(name, c, 0))[1] for c in range(2, 4)]
    wrapped.copyWeightsToHost()
    # the parts A and B wrote (process 0 may already have made c.pt's part, below)
    files = sorted(f for f in os.listdir(out) if "-of-" in f and not f.startswith("c.pt"))
    wrapped.destroy()
    result = {"losses": losses, "resumed": resumed, "steps": info.steps, "final": final,
              "resumed_final": {k: v.clone() for k, v in model.state_dict().items()},
              "refused": refused, "files": files}
    # B loaded with the processes' IPUs swapped (each process's stage is the other's:
    # [Note: resharding checkpoints]), resumed; then a checkpoint process 1 has no part of
    swapped = options(name, False)
    swapped.Distributed.set_ipu_processes([[1], [0]])
    wrapped = poptorch.trainingModel(model, swapped, make_optimizer("sgd", model.parameters()))
    poptorch.load_checkpoint(b, wrapped)
    result["swapped"] = [wrapped(*call_data(name, c, 0))[1] for c in range(2, 4)]
    wrapped.destroy()
    c = os.path.join(out, "c.pt")
    if rank == 0:
        shutil.copy(a + ".process0-of-2", c + ".process0-of-2")
    torch.distributed.barrier()  # process 1 sees process 0's part: its own is missing
    wrapped = poptorch.trainingModel(model, options(name, True),
                                     make_optimizer("sgd", model.parameters()))
    try:
        poptorch.load_checkpoint(c, wrapped)
    except poptorch.CheckpointError as e:
        result["missing"] = str(e)
    wrapped.destroy()
    return result


def sharded_refusals(rank, out):
    """Data-parallel processes with the optimizer state sharded: a checkpoint whose process-1
    chunks are missing, then one whose chunks are of another step; what loading raised."""
    def wrap():
        torch.manual_seed(0)
        model = BlockMLP(1)
        opts = poptorch.Options()
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(True))
        return poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters()))
    wrapped = wrap()
    x, y = data(4)
    wrapped(x, y)
    path = os.path.join(out, "s.pt")
    poptorch.save_checkpoint(path, wrapped)
    wrapped(x, y)
    poptorch.save_checkpoint(os.path.join(out, "later.pt"), wrapped)
    torch.distributed.barrier()
    result = {}
    chunks = path + ".shard1-of-2"
    for what, edit in (("chunk_stale", lambda: shutil.copy(
            os.path.join(out, "later.pt.shard1-of-2"), chunks)),
                       ("chunk_missing", lambda: os.remove(chunks))):
        if rank == 1:
            edit()
        try:
            poptorch.load_checkpoint(path, wrap())
        except poptorch.CheckpointError as e:
            result[what] = ("CheckpointError", str(e), [])
    return result


_KEPT = []  # the "exit" scenarios' wrappers: alive until the interpreter finalizes


def gloo_threads() -> int:
    """gloo's worker threads in this process (torch names them pt_gloo_runloop)."""
    tasks = pathlib.Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in tasks.iterdir())


def at_exit(name, groups, rank, out):
    """Train configuration ``name`` and keep its wrapper alive to the end, as a script's
    global would be. With ``groups`` "users" this script makes the default group and
    destroys it at its end, as torch asks of a program. The exit handler registered here,
    first, runs last (``atexit`` runs them in reverse): it writes how many of gloo's worker
    threads are left once poptorch_lite's handler ran ([Note: process groups at exit])."""
    atexit.register(lambda: torch.save({"after": gloo_threads()},
                                       os.path.join(out, f"left-rank{rank}.pt")))
    if groups == "users":
        # torch.distributed.nn.functional takes the default group as its functions' default
        # argument when it is first imported (torch._dynamo imports it, at the first
        # optimizer), which would keep the user's group alive whatever poptorch_lite does
        importlib.import_module("torch.distributed.nn")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=CONFIGS[name][0])
    model = build(CONFIGS[name][1])
    wrapped = poptorch.trainingModel(model, options(name, True),
                                     make_optimizer(CONFIGS[name][-1], model.parameters()))
    for c in range(2):
        torch.manual_seed(1000 + c)
        wrapped(*call_data(name, c, layout(name, rank).pipeline))
    wrapped.copyWeightsToHost()
    _KEPT.append(wrapped)
    result = {"before": gloo_threads()}
    if groups == "users":
        torch.distributed.destroy_process_group()
    return result


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario.startswith("exit"):  # exit-ours-CONFIG or exit-users-CONFIG
        _, groups, name = scenario.split("-", 2)
        result = at_exit(name, groups, rank, out)
    elif scenario == "train":
        result = scenario_train(W)
    elif scenario == "fail":
        result = failing(rank)
    elif scenario == "refuse":
        result = refusals(rank)
    elif scenario == "errors":
        result = errors(rank)
    elif scenario == "end":
        result = ended(rank)
    elif scenario == "edits":
        result = host_edits(True, rank)
    elif scenario == "sharded":
        result = sharded_refusals(rank, out)
    else:
        result = checkpointed(rank, out)
    torch.save(result, os.path.join(out, f"{scenario}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
