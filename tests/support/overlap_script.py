"""One of 2 processes training with the gradient all-reduce (or the sharded state's
reduce-scatter) overlapped with the backward, and without (tests/distributed/test_overlap.py;
[Note: overlapped all-reduce]).

    python overlap_script.py OUT_DIR     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

For every configuration of ``CONFIGS`` the same model trains STEPS steps from the same
weights on this process's data twice: as poptorch_lite runs it, then with the overlap
switched off (the update all-reduces every gradient after the backward). Writes
``OUT_DIR/rank<r>.pt``: per configuration both runs' losses and final weights and gradients,
and per step of the first run how many buckets were launched before the update, how many
there are, how many of the parameters were final when the first one was launched, and
whether the flags of the weights that had a gradient rode in the last bucket's all-reduce.
"""

import os
import sys

import torch

import poptorch_lite as poptorch
from poptorch_lite.distributed import overlap
from poptorch_lite.distributed.overlap import Overlap
from poptorch_lite.runtime.update import Update

from models import BlockMLP, data

STEPS, B, WIDTH = 3, 2, 600  # 600 x 600 weights: 1.4 MB, each a bucket of its own

# name -> (blocks, G, replicas in the process, options, optimizer)
CONFIGS = {
    "sgd": (1, 2, 1, {}, "sgd"),
    "two-stages-pipelined": (2, 4, 1, {"pipelined": True}, "sgd"),
    "replicas-recomputed-adam": (2, 4, 2, {"pipelined": True, "recompute": True}, "adam"),
    "loss-scaling-sum": (1, 3, 1, {"als": True, "sum": True}, "sgd"),
    "frozen-layer": (1, 2, 1, {"frozen": True}, "adam"),
    "frozen-first-weight": (1, 2, 1, {"frozen_first": True}, "sgd"),
    "a-weight-without-gradient": (1, 2, 1, {"detached": True}, "adam"),
    "compiled-stages": (2, 4, 1, {"pipelined": True, "compiled": True}, "adam"),
    "sharded": (1, 2, 1, {"sharded": True}, "adam"),
    "sharded-two-stages-clipped": (2, 4, 1, {"sharded": True, "pipelined": True}, "adam-clip"),
    "sharded-lamb": (1, 2, 1, {"sharded": True}, "lamb"),
    "accumulated-in-float16-not-overlapped": (1, 2, 1, {"accum": True}, "poptorch-sgd"),
}


class Detached(BlockMLP):
    """A weight the forward reads without a gradient: its gradient stays None everywhere."""

    def __init__(self):
        super().__init__(1, width=WIDTH)
        self.offset = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, y):
        out, loss = super().forward(x, y)
        return out + self.offset.detach(), loss


def wrap(name):
    blocks, G, R, extra, kind = CONFIGS[name]
    torch.manual_seed(3)
    model = Detached() if extra.get("detached") else BlockMLP(blocks, width=WIDTH)
    if extra.get("frozen"):
        model.layers[1].requires_grad_(False)
    if extra.get("frozen_first"):  # the small tensors' bucket goes last, flags in it
        model.layers[0].weight.requires_grad_(False)
    opts = poptorch.Options().deviceIterations(1).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    if extra.get("pipelined"):
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    if extra.get("compiled"):  # AOTAutograd's graphs, run as they are ([Note: compiled stages])
        opts.compileStages(True, backend="aot_eager")
    if extra.get("recompute"):
        opts._Popart.set("autoRecomputation", 3)
    if extra.get("als"):
        opts.Training.setAutomaticLossScaling(True)
    if extra.get("sum"):
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    if extra.get("sharded"):
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(True))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=0.01),
           "adam-clip": lambda: poptorch.optim.Adam(params, lr=0.01, max_grad_norm=0.05),
           "lamb": lambda: poptorch.optim.LAMB(params, lr=0.01),
           "poptorch-sgd": lambda: poptorch.optim.SGD(params, lr=0.05, loss_scaling=4.0,
                                                      accum_type=torch.float16)}[kind]()
    if extra.get("als"):
        opt = poptorch.optim.SGD(params, lr=0.05, loss_scaling=64.0)
    return model, poptorch.trainingModel(model, opts, opt)


def train(name, rank):
    _, G, R, *_ = CONFIGS[name]
    model, wrapped = wrap(name)
    losses, early, carried = [], [], []
    for step in range(STEPS):
        x, y = data(B * G * R, width=WIDTH, seed=100 * step + rank)
        losses.append(wrapped(x, y)[1].clone())
        early.append(EARLY.pop() if EARLY else None)
        carried.append(CARRIED.pop() if CARRIED else None)
    wrapped.copyWeightsToHost()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.destroy()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return {"losses": losses, "weights": weights, "grads": grads, "early": early,
            "carried": carried, "hooks_left": hooks}


EARLY = []  # (buckets launched before the update, buckets, parameters final at the first
FIRST = []  # launch, parameters) of the last step
CARRIED = []  # whether the flags of the weights with a gradient rode in the last bucket
FLAGS_SENT = []  # the flags' own all-reduces in a step
_finish, _launch, _flags = Overlap.finish, Overlap._launch, overlap._all_reduce


def _recording_finish(self, divisor):
    EARLY.append((len(self._launched), len(self.buckets), *FIRST.pop()))
    _finish(self, divisor)
    CARRIED.append(not FLAGS_SENT)
    FLAGS_SENT.clear()


def _recording_flags(*args):
    FLAGS_SENT.append(True)
    return _flags(*args)


def _recording_launch(self):
    if not self._launched:
        FIRST.append((len(self.final), len(self.params)))
    return _launch(self)


def main(out):
    rank = int(os.environ["RANK"])
    Overlap.finish, Overlap._launch = _recording_finish, _recording_launch
    overlap._all_reduce = _recording_flags
    results = {}
    for name in CONFIGS:
        overlapped = train(name, rank)
        begin_run = Update.begin_run
        Update.begin_run = lambda *args: None  # the all-reduce after the backward, as before
        try:
            plain = train(name, rank)
        finally:
            Update.begin_run = begin_run
        results[name] = (overlapped, plain)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
