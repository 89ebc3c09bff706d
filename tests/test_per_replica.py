"""Per-replica variables: ``poptorch_model.W.replicaGrouping(...)`` against plain PyTorch
([Note: per-replica variables] in poptorch_lite/runtime/replica_groups.py)."""

import copy
import pickle

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.runtime.replica_groups import groups

from models import on_device, trained_grads

Consecutive, Orthogonal = poptorch.CommGroupType.Consecutive, poptorch.CommGroupType.Orthogonal
NoGrouping, OnePerGroup = poptorch.CommGroupType.NoGrouping, poptorch.VariableRetrievalMode.OnePerGroup


class Sharded(torch.nn.Module):
    """A shared layer, then a weight with one value per group of replicas (Graphcore's
    knowledge-graph application shards its embedding so), in 1 or 2 blocks."""

    def __init__(self, values: int, blocks: int = 1):
        super().__init__()
        self.shared = torch.nn.Linear(4, 4)
        self.W = torch.nn.Parameter(torch.randn(values, 4, 3))
        self.blocks = blocks

    def forward(self, x, y):
        h = torch.tanh(self.shared(x))
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = h @ self.W
        return out, torch.nn.functional.mse_loss(out, y)


def plain_steps(model, x, y, D, G, R, g, input_kind, per_replica, lr):
    """Plain PyTorch: each step sums the backward of every replica's micro-batch, replica r
    computing with W[per_replica[r]] on its input group's slice, then divides by G·R."""
    shared, W = model.shared, model.W
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    inputs = groups(input_kind, g, R)
    b = x.shape[0] // (D * G * (R // g))
    losses = []
    for d in range(D):
        opt.zero_grad()
        for j in range(G):
            for r in range(R):
                k = (d * G + j) * (R // g) + inputs[r]
                out = torch.tanh(shared(x[k * b:(k + 1) * b])) @ W[per_replica[r]]
                loss = torch.nn.functional.mse_loss(out, y[k * b:(k + 1) * b])
                (loss / (G * R)).backward()
                losses.append(loss.detach())
        opt.step()
    return torch.stack(losses)


@pytest.mark.parametrize("R,g,input_kind,kind,size,blocks,schedule", [
    (4, 1, Consecutive, NoGrouping, 0, 1, "grouped"),
    (4, 2, Consecutive, Orthogonal, 2, 1, "grouped"),      # PopTorch's test: the input groups
    (4, 2, Orthogonal, Consecutive, 2, 2, "interleaved"),  # and the weight groups cross
    (4, 2, Consecutive, Orthogonal, 2, 2, "zero_bubble"),  # W's gradient from the split W pass
])
def test_each_replica_computes_with_its_groups_value_as_plain_pytorch_does(
        R, g, input_kind, kind, size, blocks, schedule, device):
    torch.manual_seed(0)
    per_replica = groups(kind, size, R)
    model = Sharded(max(per_replica) + 1, blocks)
    ref = copy.deepcopy(model)
    D, G = 2, 3
    x, y = torch.randn(2 * D * G * (R // g), 4), torch.randn(2 * D * G * (R // g), 3)
    opts = poptorch.Options().replicationFactor(R).deviceIterations(D)
    opts.inputReplicaGrouping(g, input_kind).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(schedule=schedule))
    train = poptorch.trainingModel(model, on_device(opts, device),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    train.W.replicaGrouping(kind, size, OnePerGroup)
    out, loss = train(x, y)
    ref_losses = plain_steps(ref, x, y, D, G, R, g, input_kind, per_replica, 0.1)
    assert out.shape == (2 * D * G * R, 3)  # every replica's output, as PopTorch returns them
    assert_close(loss, ref_losses, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        assert_close(p.detach(), dict(ref.named_parameters())[name].detach(), atol=1e-5,
                     rtol=0, msg=name)
    assert trained_grads(train)["W"].shape == model.W.shape
    train.destroy()


def test_replica_grouping_is_checked_and_refused_after_compiling():
    model = Sharded(4)
    train = poptorch.trainingModel(model, poptorch.Options().replicationFactor(4))
    with pytest.raises(poptorch.OptionsError, match=r"gives 4 replicas 2 values, one per group, "
                                                    r"along dim 0, but W has shape \(4, 4, 3\)"):
        train.W.replicaGrouping(Consecutive, 2, OnePerGroup)
    with pytest.raises(poptorch.OptionsError, match="the group size must be a positive int "
                                                    r"that divides replicationFactor \(4\)"):
        train.W.replicaGrouping(Orthogonal, 3, OnePerGroup)
    with pytest.raises(poptorch.OptionsError, match="only VariableRetrievalMode.OnePerGroup"):
        train.W.replicaGrouping(NoGrouping, 0, poptorch.VariableRetrievalMode.AllReplicas)
    assert train._replica_values == {}
    train.W.replicaGrouping(NoGrouping, 0, OnePerGroup)  # a value per replica: dim 0 is 4
    train(torch.randn(8, 4), torch.randn(8, 3))
    with pytest.raises(poptorch.WrapError, match="after the model compiled: call it before"):
        train.W.replicaGrouping(NoGrouping, 0, OnePerGroup)
    assert not hasattr(copy.deepcopy(train.W), "replicaGrouping")  # the method stays behind,
    assert pickle.loads(pickle.dumps(train.W)).replicaGrouping is None  # and needs no import
