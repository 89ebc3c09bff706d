"""One process of a multi-node launch (tests/distributed/test_multinode.py).

    torchrun --nnodes 2 --nproc_per_node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        multinode_script.py SCENARIO OUT_DIR

Every process trains the same model: ``BlockMLP`` in 2 stages with dropout, one stage per
process (``set_ipu_processes([[0], [1]])``), the W / 2 pipelines data-parallel in
data-parallel-inner order (a node holds one stage's replicas), Adam with clipping
(``poptorch.optim.Adam(max_grad_norm=...)``), G micro-batches per step, D steps per call.

- ``train``: CALLS calls, a checkpoint after the first; writes
  ``OUT_DIR/train-rank<r>.pt`` (what each call returned, the final weights and optimizer
  state, this node's rank). Then, with ``KILL`` set, the processes of node 1 wait to be
  killed and those of node 0 make one more call and write what it raised and how long
  it took to ``OUT_DIR/killed-rank<r>.pt``.
- ``restart``: fresh models load that checkpoint and make the remaining calls; writes
  ``OUT_DIR/restart-rank<r>.pt``.
"""

import os
import sys
import time

import torch

import poptorch_lite as poptorch
from poptorch_lite.distributed.layout import Layout

from models import BlockMLP, data, microbatch_seeds

B, G, D, CALLS, WIDTH, MAX_NORM = 2, 4, 2, 3, 8, 0.05
SEED = 1000


def build():
    torch.manual_seed(100)
    return BlockMLP(2, width=WIDTH, dropout=0.3)


def make_optimizer(model):
    return poptorch.optim.Adam(model.parameters(), lr=0.01, max_grad_norm=MAX_NORM)


def options(world):
    opts = poptorch.Options().deviceIterations(D)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Distributed.set_ipu_processes([[0], [1]])
    opts.Distributed.set_process_order("data_parallel_inner")
    return opts


def call_data(call, replica, replicas):
    """Replica ``replica``'s combined batch of call ``call`` ([D, G, B] of its own rows)."""
    x, y = data(B * G * D * replicas, width=WIDTH, seed=7 + call)
    x, y = x.view(D, G, replicas, B, WIDTH), y.view(D, G, replicas, B)
    return x[:, :, replica].reshape(-1, WIDTH), y[:, :, replica].reshape(-1)


def seeds(call):
    """The seed of each micro-batch's random ops in call ``call``: every process draws the
    same ([Note: micro-batch RNG]), from ``torch.manual_seed(SEED + call)``."""
    torch.manual_seed(SEED + call)
    return microbatch_seeds(D, G)


def wrap(world):
    model = build()
    return model, poptorch.trainingModel(model, options(world), make_optimizer(model))


def run(wrapped, calls, replica, replicas):
    outputs = []
    for c in calls:
        torch.manual_seed(SEED + c)
        out, loss = wrapped(*call_data(c, replica, replicas))
        outputs.append((out.clone(), loss.clone()))
    return outputs


def final(model, wrapped):
    wrapped.copyWeightsToHost()
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {names[id(p)]: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                    for p, s in wrapped._optimizer.state.items()}}


def main(scenario, out):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    layout = Layout(rank, world, ((0,), (1,)), "data_parallel_inner")
    replica, replicas = layout.pipeline, layout.pipelines
    ckpt = os.path.join(out, "ckpt.pt")
    model, wrapped = wrap(world)
    if scenario == "train":
        outputs = run(wrapped, [0], replica, replicas)
        poptorch.save_checkpoint(ckpt, wrapped)
        outputs += run(wrapped, range(1, CALLS), replica, replicas)
        torch.save({"outputs": outputs, "node": node, "pid": os.getpid(),
                    **final(model, wrapped)},
                   os.path.join(out, f"train-rank{rank}.pt"))
        if os.environ.get("KILL"):
            if node == 1:
                time.sleep(600)  # the test kills this node
            start = time.monotonic()
            try:
                run(wrapped, [CALLS], replica, replicas)
                raised = None
            except Exception as e:  # what a user sees
                raised = (type(e).__name__, str(e))
            torch.save({"raised": raised, "seconds": time.monotonic() - start},
                       os.path.join(out, f"killed-rank{rank}.pt"))
            os._exit(0)  # without waiting for the dead node at the exit
    else:
        info = poptorch.load_checkpoint(ckpt, wrapped)
        outputs = run(wrapped, range(info.steps // D, CALLS), replica, replicas)
        torch.save({"outputs": outputs, "steps": info.steps, **final(model, wrapped)},
                   os.path.join(out, f"restart-rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
