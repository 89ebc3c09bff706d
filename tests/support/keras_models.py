"""The Keras face's test models and its plain PyTorch reference, shared by the tests.

``plain`` trains as ``keras.Model.fit`` promises to (a step per G·R batches, the epoch orders
of ``orders``); ``build`` makes the sequential, model-class and functional forms of one staged
network (tests/frontends/test_keras.py, the fuzzer's Keras programs, the compiled stages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite import keras
from poptorch_lite.frontends import keras_losses

P = poptorch.PipelineSchedule
EPS = 1e-7


def layers(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
            torch.nn.Linear(8, 4)]


class StagedNet(torch.nn.Module):
    """The functional route: ``keras.PipelineStage`` inside forward."""

    def __init__(self, seed=0):
        super().__init__()
        self.a, _, self.b, _, self.c = layers(seed)

    def forward(self, x):
        with keras.PipelineStage(0):
            x = torch.relu(self.a(x))
        with keras.PipelineStage(1):
            return self.c(torch.relu(self.b(x)))


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def keras_loss(y_pred, y_true):
    """sparse_categorical_crossentropy(from_logits=True), per sample, as Keras writes it."""
    return -(F.one_hot(y_true, 4) * F.log_softmax(y_pred, -1)).sum(-1)


class Step(torch.nn.Module):
    """The hand-written PopTorch-face module: predictions and the marked mean loss."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        out = self.net(x)
        return out, poptorch.identity_loss(keras_losses.sparse_categorical_crossentropy(
            y, out, from_logits=True), "mean")


def orders(n, epochs, shuffle):
    """fit's epoch orders: one seed drawn from the default generator, then seed + epoch."""
    if not shuffle:
        return [torch.arange(n)] * epochs
    seed = int(torch.randint(0, 2**62, (1,)))
    return [torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))
            for e in range(epochs)]


def plain(net, x, y, B, G, R, order_list, lr_of_epoch=None):
    """Plain PyTorch: a step per G·R batches of B, gradients summed then / G·R.

    Returns the per-epoch mean loss and the per-epoch accuracy, as History holds them.
    """
    opt = sgd(net.parameters())
    history = {"loss": [], "accuracy": []}
    for e, order in enumerate(order_list):
        if lr_of_epoch is not None:
            for group in opt.param_groups:
                group["lr"] = lr_of_epoch(e)
        losses, correct = [], 0
        batches = len(order) // B
        for s in range(batches // (G * R)):
            opt.zero_grad(set_to_none=True)
            for k in range(s * G * R, (s + 1) * G * R):
                idx = order[k * B:(k + 1) * B]
                out = net(x[idx])
                loss = keras_losses.sparse_categorical_crossentropy(
                    y[idx], out, from_logits=True).mean()
                loss.backward()
                losses.append(float(loss.detach()))
                correct += int((out.argmax(-1) == y[idx]).sum())
            for p in net.parameters():
                if p.grad is not None:  # a frozen parameter has none
                    p.grad.div_(G * R)
            opt.step()
        history["loss"].append(sum(losses) / len(losses))
        history["accuracy"].append(correct / (batches * B))
    return history


def poptorch_loop(net, x, y, B, spe, G, R, schedule, order_list):
    """The hand-written PopTorch-face loop: one trainingModel call per execution."""
    opts = poptorch.Options().deviceIterations(spe // (G * R)).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(schedule=schedule))
    train = poptorch.trainingModel(Step(net), opts, sgd(net.parameters()))
    losses = []
    for order in order_list:
        for e in range(len(order) // (B * spe)):
            idx = order[e * B * spe:(e + 1) * B * spe]
            _, loss = train(x[idx], y[idx])
            losses += loss.reshape(-1).tolist()
    train.destroy()
    return losses


def build(kind, stages, ipus=None, seed=0):
    """A Keras model of ``kind`` ("sequential", "model", "functional") on ``stages`` stages."""
    scope = keras.IPUStrategy(_config(ipus)).scope() if ipus else _nothing()
    with scope:
        if kind == "functional":
            return keras.Model(StagedNet(seed))
        if kind == "model":
            model = keras.Model(torch.nn.Sequential(*layers(seed)))
        else:
            model = keras.Sequential(layers(seed))
    if stages == 2:
        model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    return model


def wrapper(model, kind):
    """The model's PopTorch wrapper of ``kind`` (one per steps per execution)."""
    (found,) = [w for (k, _), w in model._wrappers.items() if k == kind]
    return found


def _config(ipus):
    config = keras.IPUConfig()
    config.auto_select_ipus = ipus
    return config


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same_weights(a, b, exact=True):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p.detach(), q.detach()), name
        else:
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0, msg=name)
