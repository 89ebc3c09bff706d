"""One process of tests/distributed/test_distributed.py, started with torchrun's variables set.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/support/_distributed_worker.py train OUT_DIR

Scenarios: ``train`` runs every configuration of ``CONFIGS``, then a
mismatched-options wrap, a BatchNorm model on replicas, a model writing its own
buffer, and a run that saves checkpoints mid-epoch and at an epoch's end
(``OUT_DIR/mid.pt``, ``OUT_DIR/end.pt``) for one process to resume, saving what
each call returned and the final state to ``OUT_DIR/rank<r>.pt``; ``fail`` makes
rank 1 pass a wrong batch on its second call and records the error each rank
ends with in ``OUT_DIR/rank<r>.txt``;
``nccl`` runs two of the configurations with each process's model on its own GPU.
Options pick rank and count up from the environment, as under torchrun.
"""

import sys

import torch

import poptorch_lite as poptorch
from poptorch_lite.runtime.devices import process_gpu

from models import BlockMLP, data

B, CALLS = 2, 3
# name: (blocks, G, R, D, schedule, reduction, optimizer)
CONFIGS = {
    "replicated": (1, 2, 2, 2, "grouped", "mean", "sgd"),
    "grouped": (2, 4, 1, 1, "grouped", "mean", "adam"),
    "interleaved-sum": (2, 3, 1, 2, "interleaved", "sum", "sgd"),
}


def options(G, R, D, schedule, reduction):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.parse(schedule)))
    opts.Training.gradientAccumulation(G)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    opts.outputMode(poptorch.OutputMode.All)
    return opts


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def call_data(config, call, rank, P):
    """Process ``rank``'s combined batch for ``call``: rows of one global tensor."""
    blocks, G, R, D = CONFIGS[config][:4]
    C = B * G * R * D
    x, y = data(C * P * CALLS, seed=7)
    k = (call * P + rank) * C
    return x[k:k + C], y[k:k + C]


def train(rank, P, out):
    results = {}
    for name, (blocks, G, R, D, schedule, reduction, opt_kind) in CONFIGS.items():
        torch.manual_seed(100 + rank)  # different weights per rank: the broadcast aligns them
        model = BlockMLP(blocks)
        opt = optimizer(opt_kind, model.parameters())
        wrapped = poptorch.trainingModel(model, options(G, R, D, schedule, reduction), opt)
        losses = [wrapped(*call_data(name, c, rank, P))[1] for c in range(CALLS)]
        results[name] = {"losses": losses, "params": {k: v.clone() for k, v in
                                                      model.state_dict().items()},
                         "opt": opt.state_dict()}
        wrapped.destroy()
    # Mismatched options: rank 1 accumulates 4 micro-batches, rank 0 2; both must refuse.
    torch.manual_seed(100 + rank)
    model = BlockMLP(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = poptorch.trainingModel(model, options(2 * (rank + 1), 1, 1, "grouped", "mean"))
    try:
        wrapped(*data(B * 2 * (rank + 1)))
        results["mismatch"] = None
    except poptorch.OptionsError as e:
        results["mismatch"] = str(e)
    results["mismatch_unchanged"] = all(torch.equal(before[k], v)
                                        for k, v in model.state_dict().items())
    results["batchnorm"] = batchnorm(rank, P)
    results["buffer_write"] = buffer_write(rank)
    results["resume"] = resume(rank, P, out)
    return results


# BatchNorm on R replicas in each process ([Note: running statistics on replicas]): blocks,
# G, R, D, micro-batch, calls. A few rows per BatchNorm amplify summation order; B = 4.
BN = (2, 3, 2, 2, 4, 2)


def bn_call_data(call, rank, P):
    """Process ``rank``'s combined batch for ``call`` of the BatchNorm run."""
    _, G, R, D, b, calls = BN
    C = b * G * R * D
    x, y = data(C * P * calls, seed=9)
    k = (call * P + rank) * C
    return x[k:k + C], y[k:k + C]


def batchnorm(rank, P):
    """A BatchNorm model on 2 replicas per process, broadcastBuffers left on: losses, the
    host's state (replica 0's buffers) and replica 1's buffers after every call."""
    blocks, G, R, D, _, calls = BN
    torch.manual_seed(100 + rank)  # the broadcast gives every process process 0's
    model = BlockMLP(blocks, batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    wrapped = poptorch.trainingModel(model, options(G, R, D, "grouped", "mean"), opt)
    result = {"losses": [], "state": [], "replica1": []}
    for c in range(calls):
        result["losses"].append(wrapped(*bn_call_data(c, rank, P))[1])
        result["state"].append({k: v.clone() for k, v in model.state_dict().items()})
        result["replica1"].append({n: wrapped._weights.buffer(n, 1, blocks - 1).clone()
                                   for n, _ in model.named_buffers()})
    wrapped.destroy()
    return result


class CountsSteps(BlockMLP):
    """Its own buffer written in forward: replicas in other processes refuse it too."""

    def __init__(self):
        super().__init__(1)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, y):
        self.steps += 1
        return super().forward(x, y)


def buffer_write(rank):
    """The refusal each process gives a model that writes its own buffer, and whether its
    state stayed as it was."""
    torch.manual_seed(0)
    model = CountsSteps()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = poptorch.trainingModel(model, options(2, 1, 1, "grouped", "mean"))
    try:
        wrapped(*data(B * 2))
        refused = None
    except poptorch.OptionsError as e:
        refused = str(e)
    wrapped.destroy()
    return {"refused": refused, "unchanged": all(torch.equal(before[k], v)
                                                 for k, v in model.state_dict().items())}


NCCL_CONFIGS = ["replicated", "grouped"]


def nccl(rank, P):
    """``train``'s first configurations with the model on this process's GPU: NCCL reduces."""
    gpu = process_gpu()  # the first GPU of this process's block ([Note: GPUs of a process])
    torch.cuda.set_device(gpu)
    results = {"gpu": f"cuda:{gpu}"}
    for name in NCCL_CONFIGS:
        blocks, G, R, D, schedule, reduction, opt_kind = CONFIGS[name]
        torch.manual_seed(100 + rank)
        model = BlockMLP(blocks).cuda()
        opt = optimizer(opt_kind, model.parameters())
        wrapped = poptorch.trainingModel(model, options(G, R, D, schedule, reduction), opt)
        losses = [wrapped(*call_data(name, c, rank, P))[1] for c in range(CALLS)]
        state = opt.state_dict()
        results[name] = {
            "losses": losses,
            "params": {k: v.cpu() for k, v in model.state_dict().items()},
            "opt": {"state": {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                              for i, s in state["state"].items()}},
            "devices": sorted({str(d) for d in wrapped._placement.devices.values()})}
        wrapped.destroy()
    results["backend"] = torch.distributed.get_backend()
    return results


def fail(rank, out):
    torch.manual_seed(0)
    model = BlockMLP(1)
    wrapped = poptorch.trainingModel(model, options(2, 1, 1, "grouped", "mean"))
    try:
        for call in range(3):
            rows = B * 2 + (1 if rank == 1 and call == 1 else 0)  # rank 1: a bad batch
            wrapped(*data(rows))
    except poptorch.Error as e:
        with open(f"{out}/rank{rank}.txt", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def resumable():
    """A BatchNorm model, its wrapper and a shuffling loader of 64 numbered samples, each
    process reading its shard in combined batches of 8 (B=2, G=2, D=2)."""
    model = BlockMLP(1, batchnorm=True)
    opts = options(2, 1, 2, "grouped", "mean").randomSeed(3)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = data(64, seed=11)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(x, y, torch.arange(64)),
                                 batch_size=B, shuffle=True)
    return model, wrapped, loader


def resume(rank, P, out):
    """Save mid-epoch (after 2 of each process's 4 batches) and at the epoch's end, every
    process calling save_checkpoint, process 0 first, then process 1: the samples each read,
    and its state when it saved."""
    torch.manual_seed(100 + rank)
    model, wrapped, loader = resumable()
    result = {"read": [], "saved": {}}
    for step, (x, y, index) in enumerate(loader, 1):
        wrapped(x, y)
        result["read"] += index.tolist()
        if step in (2, len(loader)):
            name = "mid" if step == 2 else "end"
            for turn in range(P):
                if turn == rank:
                    poptorch.save_checkpoint(f"{out}/{name}.pt", wrapped, loader)
                torch.distributed.barrier()
            result["saved"][name] = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.destroy()
    return result


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    opts = poptorch.Options()
    rank, P = opts.Distributed.processId, opts.Distributed.numProcesses
    if scenario == "train":
        torch.save(train(rank, P, out), f"{out}/rank{rank}.pt")
    elif scenario == "nccl":
        torch.save(nccl(rank, P), f"{out}/rank{rank}.pt")
    else:
        fail(rank, out)


if __name__ == "__main__":
    main()
