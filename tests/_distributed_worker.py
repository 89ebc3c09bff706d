"""One process of tests/test_distributed.py, started with torchrun's variables set.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/_distributed_worker.py train OUT_DIR

Scenarios: ``train`` runs every configuration of ``CONFIGS`` and then a
mismatched-options wrap, saving what each call returned and the final state
to ``OUT_DIR/rank<r>.pt``; ``fail`` makes rank 1 pass a wrong batch on its
second call and records the error each rank ends with in ``OUT_DIR/rank<r>.txt``;
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


def train(rank, P):
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
    return results


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


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    opts = poptorch.Options()
    rank, P = opts.Distributed.processId, opts.Distributed.numProcesses
    if scenario == "train":
        torch.save(train(rank, P), f"{out}/rank{rank}.pt")
    elif scenario == "nccl":
        torch.save(nccl(rank, P), f"{out}/rank{rank}.pt")
    else:
        fail(rank, out)


if __name__ == "__main__":
    main()
