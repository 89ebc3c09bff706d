"""One process of a run that changes its process layout at checkpoints
(tests/distributed/test_resharding.py; [Note: resharding checkpoints] in checkpoint.py).

    python reshard_script.py PHASE OUT_DIR     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

The same model (``BlockMLP`` in 2 stages, Adam with clipping) trains STEPS steps of one
epoch of a shuffled DataLoader, with its optimizer state whole and sharded
(``useReplicatedTensorSharding``), in four phases, each a launch of its own:

- ``four``: 4 processes, 2 stages × 2 replicas (``set_ipu_processes([[0], [1]])``), the
  run that never stops; it saves A after 3 steps (and ``same.pt``, as 4 parts); then a
  fresh model resumes A at the same layout and trains to the end;
- ``two``: 2 data-parallel processes running both stages load A, save B to ``same.pt``
  after their first step (one file set replaces the other), and train on to the end;
- ``one``: 1 process with 2 replicas loads B, saves C after its first step, trains on;
- ``back``: 4 processes as in ``four``, compiled first, load C (each keeping the optimizer
  state of its own stage) and train the last step; then a model with another optimizer,
  and one of another width, try to load C.

Writes ``OUT_DIR/<phase>-rank<r>.pt``: per variant, per step the loss each replica returned
and the samples this process read; the final weights of the stages this process runs; the
files of the checkpoints; the losses of A resumed at its own layout; what the refused loads
raised.
"""

import os
import sys

import torch

import poptorch_lite as poptorch
from poptorch_lite.checkpoint import _own_keys
from poptorch_lite.distributed.layout import Layout

from models import BlockMLP, data

N, B, G, WIDTH, STEPS = 48, 1, 4, 8, 6
# phase -> (first step, the checkpoint it loads, the one it saves, after which step)
PHASES = {"four": (0, None, "a.pt", 2), "two": (3, "a.pt", "same.pt", 3),
          "one": (4, "same.pt", "c.pt", 4), "back": (5, "c.pt", None, None)}
SPREAD = ("four", "back")


class Indexed(torch.utils.data.Dataset):
    """N samples that remember which of them were read."""

    def __init__(self):
        self.x, self.y = data(N, width=WIDTH, seed=3)
        self.read = []

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.x[i], self.y[i]


def options(phase, sharded):
    opts = poptorch.Options().randomSeed(5).deviceIterations(1)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    if phase in SPREAD:
        opts.Distributed.set_ipu_processes([[0], [1]])
    if phase == "one":
        opts.replicationFactor(2)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useReplicatedTensorSharding(sharded))
    return opts


def wrap(phase, sharded, width=WIDTH, optimizer="adam"):
    torch.manual_seed(1 if phase == "four" else 2)  # resumed runs start from other weights
    model = BlockMLP(2, width=width)
    opt = (poptorch.optim.Adam(model.parameters(), lr=0.01, max_grad_norm=0.5)
           if optimizer == "adam" else torch.optim.SGD(model.parameters(), lr=0.01))
    return model, poptorch.trainingModel(model, options(phase, sharded), opt)


def run(phase, variant, out):
    first, loads, saves, after = PHASES[phase]
    sharded = variant == "sharded"
    model, wrapped = wrap(phase, sharded)
    dataset = Indexed()
    loader = poptorch.DataLoader(options(phase, sharded), dataset, batch_size=B, shuffle=True)
    where = lambda name: os.path.join(out, f"{variant}-{name}")  # noqa: E731
    result = {"losses": [], "read": [], "files": {}}
    if phase == "back":  # compiled first: each process knows its stage when C loads
        wrapped.compile(dataset.x[:B * G], dataset.y[:B * G])
    if loads:
        poptorch.load_checkpoint(where(loads), wrapped, loader)
        result["state_held"] = len(wrapped._optimizer.state)  # weights with optimizer state
    batches = iter(loader)
    for step in range(first, STEPS):
        dataset.read.clear()
        x, y = next(batches)
        _, loss = wrapped(x, y)
        result["losses"].append(loss.clone())
        result["read"].append(list(dataset.read))
        if step == after:
            poptorch.save_checkpoint(where(saves), wrapped, loader)
            if phase == "four":
                poptorch.save_checkpoint(where("same.pt"), wrapped, loader)
    wrapped.copyWeightsToHost()
    own = _own_keys(wrapped) if phase in SPREAD else model.state_dict().keys()
    result["weights"] = {k: v.clone() for k, v in model.state_dict().items() if k in own}
    wrapped.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every process's files are written
    result["files"] = sorted(f for f in os.listdir(out) if f.startswith(variant))
    if phase == "four":  # A resumed at its own layout: each process its own part (chunks)
        model, wrapped = wrap(phase, sharded)
        loader = poptorch.DataLoader(options(phase, sharded), dataset, batch_size=B, shuffle=True)
        poptorch.load_checkpoint(where("a.pt"), wrapped, loader)
        result["resumed"] = [wrapped(x, y)[1].clone() for x, y in loader]
        wrapped.destroy()
    if phase == "back":  # another optimizer, another model: refused everywhere, nothing moved
        result["refused"] = {}
        for what, kwargs in (("optimizer", {"optimizer": "sgd"}), ("model", {"width": 9})):
            model, wrapped = wrap(phase, sharded, **kwargs)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                poptorch.load_checkpoint(where("c.pt"), wrapped)
                result["refused"][what] = None
            except poptorch.CheckpointError as e:
                unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
                result["refused"][what] = (str(e), unchanged)
            wrapped.destroy()
    return result


def main():
    phase, out = sys.argv[1], sys.argv[2]
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {"layout": Layout(rank, W, ((0,), (1,)) if phase in SPREAD else None)}
    for variant in ("whole", "sharded"):
        results[variant] = run(phase, variant, out)
    torch.save(results, os.path.join(out, f"{phase}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
