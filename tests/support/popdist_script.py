"""Trains a small model as an instance of a ``poprun`` launch, on its share of every global
batch, and saves its weights (tests/distributed/test_popdist.py).

    poprun ... python popdist_script.py OUT_DIR          # an instance of the launch

The test trains the same in its own process, with 4 replicas: ``train(poptorch_lite, ...)``.
"""

import os
import sys

import torch

STEPS, BATCH = 3, 4  # a replica's micro-batch


def model() -> torch.nn.Module:
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 3))

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, y)
    return Net()


def batches(replicas: int) -> list:
    """Every step's global batch: ``replicas`` micro-batches of BATCH rows."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(replicas * BATCH, 6, generator=g),
             torch.randn(replicas * BATCH, 3, generator=g)) for _ in range(STEPS)]


def train(poptorch, opts, index: int, instances: int) -> dict:
    """Train on this instance's share of every global batch; the weights after."""
    net = model()
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    trained = poptorch.trainingModel(net, opts, optimizer=optimizer)
    share = opts.replication_factor * BATCH
    for x, y in batches(opts.replication_factor * instances):
        trained(x[index * share:(index + 1) * share], y[index * share:(index + 1) * share])
    trained.copyWeightsToHost()
    return {k: v.clone() for k, v in net.state_dict().items()}


if __name__ == "__main__":
    import popdist
    import popdist.poptorch
    import poptorch

    popdist.init()
    index = popdist.getInstanceIndex()
    print(f"instance {index} of {popdist.getNumInstances()}, replicas "
          f"{popdist.getNumLocalReplicas()} of {popdist.getNumTotalReplicas()} from "
          f"{popdist.getReplicaIndexOffset()}", flush=True)
    weights = train(poptorch, popdist.poptorch.Options(), index, popdist.getNumInstances())
    torch.save(weights, os.path.join(sys.argv[1], f"instance-{index}.pt"))
    popdist.execute_on_instances({0}, print, "only instance 0 prints this", flush=True)
