"""The loss that trains is the value the model returns ([Note: the trained loss] in
poptorch_lite/compiler/losses.py): arithmetic after a loss function is part of its gradient,
as in plain PyTorch's ``loss.backward()``; a value that cannot carry a gradient is no loss."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch

from models import BlockMLP, data, on_device, reference_training, trained_grads, twin

ATOL = 1e-5


def _masked_mean(out, y, model):
    mask = (y != 3).float()
    return (F.cross_entropy(out, y, reduction="none") * mask).sum() / mask.sum().clamp(min=1)


# What the model returns as its loss, per kind, from the head's output ``out``.
LOSSES = {
    "scaled": lambda out, y, m: 2 * F.cross_entropy(out, y),
    "divided": lambda out, y, m: F.cross_entropy(out, y) / 4,
    "mean_of_none": lambda out, y, m: F.cross_entropy(out, y, reduction="none").mean(),
    "masked_mean": _masked_mean,
    "regularised": lambda out, y, m: F.cross_entropy(out, y) + 0.5 * (m.head.weight ** 2).sum(),
    "cast_and_viewed": lambda out, y, m: F.cross_entropy(out, y).double().view(1),
    "identity_of_arithmetic": lambda out, y, m: poptorch.identity_loss(
        3 * F.mse_loss(out, F.one_hot(y, 4).float()), reduction="mean"),
}


class LossArithmetic(BlockMLP):
    """:class:`BlockMLP` returning ``(out, LOSSES[kind], metric)``: the metric is a loss
    function's value under ``torch.no_grad()``, which trains nothing."""

    def __init__(self, kind: str, blocks: int):
        super().__init__(blocks)
        self.kind = kind

    def forward(self, x, y):
        per = 4 // self.blocks
        for k, layer in enumerate(list(self.layers) + [self.head]):
            if k % per == 0:
                poptorch.Block.start(f"b{k // per}", ipu_id=k // per)
            x = layer(x) if layer is self.head else torch.relu(layer(x))
        out = x
        with torch.no_grad():
            metric = F.l1_loss(out, torch.zeros_like(out))
        return out, LOSSES[self.kind](out, y, self), metric


def _options(device, blocks, G, schedule, recompute=False):
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=schedule))
    opts.Training.gradientAccumulation(G)
    opts.deviceIterations(2).outputMode(poptorch.OutputMode.All)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return on_device(opts, device)


ROWS = [(1, 2, "grouped", False), (2, 3, "grouped", False), (2, 3, "interleaved", True),
        (4, 4, "zero_bubble", False)]


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("blocks,G,schedule,recompute", ROWS)
def test_arithmetic_after_a_loss_function_trains_as_in_plain_pytorch(
        kind, blocks, G, schedule, recompute, device):
    """Outputs, losses, metrics, the gradients of every step, the weights and the optimizer
    state after two calls of two steps each are plain PyTorch's."""
    torch.manual_seed(0)
    model = LossArithmetic(kind, blocks)
    ref = twin(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, _options(device, blocks, G, schedule, recompute), opt)
    for call in range(2):
        x, y = data(2 * G * 2, seed=call)
        out, loss, metric = train(x, y)
        refs = reference_training(_FirstTwo(ref), ref_opt, x, y, 2, G, 1)
        assert_close(out, torch.cat(refs[0]), atol=ATOL, rtol=0)
        assert_close(loss.reshape(-1).to(torch.float32),
                     torch.stack(refs[1]).reshape(-1).to(torch.float32), atol=ATOL, rtol=0)
        assert_close(metric, torch.stack([F.l1_loss(o, torch.zeros_like(o)) for o in refs[0]]),
                     atol=ATOL, rtol=0)
        for name, g in trained_grads(train).items():
            assert_close(g, refs[2][f"model.{name}"], atol=ATOL, rtol=0, msg=f"grad of {name}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach().cpu(), atol=ATOL, rtol=0, msg=name)
    for a, b in zip(opt.state.values(), ref_opt.state.values()):
        assert_close(a["momentum_buffer"], b["momentum_buffer"].cpu(), atol=ATOL, rtol=0)
    train.destroy()


class _FirstTwo(torch.nn.Module):
    """The reference's view of a :class:`LossArithmetic`: ``(out, loss)`` for
    ``reference_training``, which calls ``backward()`` on the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out, loss, _ = self.model(x, y)
        return out, loss


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        out = self.fc(x)
        ce = F.cross_entropy(out, y)
        return out, 2 * ce  # scaled


def test_the_log_says_once_where_poptorch_on_an_ipu_would_train_differently(caplog):
    torch.manual_seed(0)
    model = Scaled()
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        train(*data(2))
        train(*data(2, seed=2))
    told = [r.getMessage() for r in caplog.records if "loss function's output" in r.getMessage()]
    assert len(told) == 1
    assert "test_losses.py" in told[0] and "return out, 2 * ce  # scaled" in told[0]
    assert "ce = F.cross_entropy(out, y)" in told[0]
    assert "identity_loss" in told[0]
    train.destroy()


@pytest.mark.parametrize("kind", ["cast_and_viewed", "identity_of_arithmetic"])
def test_the_log_is_quiet_where_poptorch_trains_alike(kind, caplog):
    """A view or cast of the loss trains as the loss does; ``identity_loss`` is the loss."""
    torch.manual_seed(0)
    model = LossArithmetic(kind, 1)
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        train(*data(2))
    assert not [r for r in caplog.records if "loss function's output" in r.getMessage()]
    train.destroy()


class TotalAndParts(torch.nn.Module):
    """Returns a total and the loss function's output it was made from: which one trains?"""

    def __init__(self, detach_part: bool):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.detach_part = detach_part

    def forward(self, x, y):
        out = self.fc(x)
        recon = F.cross_entropy(out, y)
        total = recon + 0.1 * out.pow(2).mean()
        return total, recon.detach() if self.detach_part else recon


def test_two_returned_values_carrying_the_loss_are_refused_before_any_state_changes():
    torch.manual_seed(0)
    model = TotalAndParts(detach_part=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, optimizer=opt)
    rng = torch.get_rng_state()
    with pytest.raises(poptorch.LossError, match=r"2 returned values carry the gradient of the "
                       r"loss .*test_losses\.py:\d+: total = .*test_losses\.py:\d+: recon = .*"
                       r"identity_loss\(value, reduction='mean'\)"):
        train(*data(2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state == {} and torch.equal(rng, torch.get_rng_state())
    train.destroy()


def test_a_detached_part_beside_the_total_leaves_the_total_to_train():
    torch.manual_seed(0)
    model = TotalAndParts(detach_part=True)
    ref = twin(model)
    x, y = data(2)
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    total, part = train(x, y)
    ref_total, ref_part = ref(x, y)
    ref_total.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert_close(total, ref_total.detach(), atol=ATOL, rtol=0)
    assert_close(part, ref_part, atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0)
    train.destroy()
