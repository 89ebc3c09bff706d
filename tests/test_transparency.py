"""Transparency: a wrapped training model does plain PyTorch's arithmetic, over a matrix."""

import itertools

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch

from models import BlockMLP, data, reference_training, twin

ATOL = 1e-5


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def assert_same_state(opt_a, opt_b):
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            assert_close(sa[k][name], sb[k][name], atol=ATOL, rtol=0)


def sharded(G, device):
    """Options for G accumulated micro-batches through ShardedExecution on ``device``."""
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(G)
    opts.set_ipu_devices(device)
    return opts


MATRIX = list(itertools.product([1, 2, 4], [1, 4, 8], [1, 2], [1, 3], ["mean", "sum"],
                                ["sgd", "adam"]))


@pytest.mark.parametrize("blocks,G,R,D,reduction,opt_kind", MATRIX)
def test_training_matches_plain_pytorch(blocks, G, R, D, reduction, opt_kind, device):
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    ref = twin(model)
    B = 2
    x, y = data(B * D * G * R)
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.set_ipu_devices(device)
    opt = make_optimizer(opt_kind, model.parameters())
    ref_opt = make_optimizer(opt_kind, ref.parameters())

    out, loss = poptorch.trainingModel(model, opts, opt)(x, y)
    ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, D, G, R,
                                                         mean=reduction == "mean")

    n = D * G * R
    assert out.shape == (n * B, 4)
    assert loss.shape == ((n,) if n > 1 else ())
    assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack(ref_losses).reshape(loss.shape), atol=ATOL, rtol=0)
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_grads[name], atol=ATOL, rtol=0, msg=f"grad of {name}")
        assert_close(p.detach(), dict(ref.named_parameters())[name].detach(), atol=ATOL, rtol=0,
                     msg=f"weight {name}")
    assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("blocks,G", [(2, 3), (4, 7), (4, 8)])
def test_pipelined_execution_matches_plain_pytorch(blocks, G, device):
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    ref = twin(model)
    x, y = data(2 * G)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.set_ipu_devices(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with pytest.warns(poptorch.PoptorchLiteWarning, match="Sequential"):
        _, loss = poptorch.trainingModel(model, opts, opt)(x, y)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
    assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)  # OutputMode.Final by default
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0, msg=name)


def test_several_calls_keep_matching(device):
    torch.manual_seed(0)
    model, G = BlockMLP(2), 4
    ref = twin(model)
    opts = sharded(G, device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train = poptorch.trainingModel(model, opts, opt)
    for step in range(3):
        x, y = data(2 * G, seed=step)
        _, loss = train(x, y)
        _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
        assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0)
    assert_same_state(opt, ref_opt)


def test_dropout_and_batchnorm_match_with_the_same_seed(device):
    torch.manual_seed(0)
    model, G = BlockMLP(2, dropout=0.3, batchnorm=True), 4
    ref = twin(model)
    opts = sharded(G, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = data(4 * G)
    torch.manual_seed(123)
    _, loss = poptorch.trainingModel(model, opts, opt)(x, y)
    torch.manual_seed(123)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
    assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b, atol=ATOL, rtol=0, msg=name)
    assert int(model.bn.num_batches_tracked) == G


@pytest.mark.parametrize("R", [1, 2])
def test_inference_matches_plain_pytorch(R, device):
    torch.manual_seed(0)
    model = BlockMLP(4).eval()
    D = 4
    x, y = data(3 * D * R)
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.set_ipu_devices(device)
    out, loss = poptorch.inferenceModel(model, opts)(x, y)
    b = 3
    refs = [model(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(D * R)]
    assert_close(out, torch.cat([o for o, _ in refs]).detach(), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack([l for _, l in refs]).detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_replicas_sharing_inputs_count_once_each(reduction, device):
    """inputReplicaGrouping(2) with R=2: both replicas see every slice (POPTORCH_REFERENCE §4).

    Sum adds both replicas' (equal) gradients: twice the slices' sum; Mean divides that
    by G·R, which is the slices' sum over G.
    """
    torch.manual_seed(0)
    model, G, lr = BlockMLP(2), 4, 0.1
    ref = twin(model)
    x, y = data(2 * G)
    opts = sharded(G, device).replicationFactor(2).inputReplicaGrouping(
        2, poptorch.CommGroupType.Consecutive)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=lr))(x, y)
    _, _, slice_sums = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.0),
                                          x, y, 1, G, 1, mean=False)
    for name, p in model.named_parameters():
        expected = 2 * slice_sums[name] if reduction == "sum" else slice_sums[name] / G
        assert_close(p.grad, expected, atol=ATOL, rtol=0, msg=name)
        initial = dict(ref.named_parameters())[name].detach()
        assert_close(p.detach(), initial - lr * expected, atol=ATOL, rtol=0, msg=name)
