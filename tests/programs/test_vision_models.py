"""torchvision's models, as Graphcore's CNN application pipelines them, against plain PyTorch.

The models are torchvision's own, with their defaults: batch norm with running statistics,
``ReLU(inplace=True)`` and residual ``+=`` across the stage boundaries, and (EfficientNet)
SiLU, squeeze-excitation and stochastic depth, whose random draws follow each micro-batch
([Note: micro-batch RNG]). Each is cut into 4 stages at its own layers with ``BeginBlock``
and trained for two device iterations; the losses, outputs, parameters, running statistics
and momentum buffers must be plain PyTorch's, micro-batch by micro-batch. With one thread
on both sides the CPU and the GPU twin do the same arithmetic, and with cuDNN's
deterministic kernels so does a GPU, so they must be bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch

from models import microbatch_seeds, on_device, reference_training

torchvision = pytest.importorskip("torchvision")

D, G, B = 2, 7, 4  # 4 stages need gradientAccumulation >= 7


class Classifier(torch.nn.Module):
    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        out = self.net(x)
        return out, F.cross_entropy(out, y)


def resnet18() -> torch.nn.Module:
    net = torchvision.models.resnet18(num_classes=10)
    for k, name in enumerate(["layer2", "layer3", "layer4"], start=1):
        setattr(net, name, poptorch.BeginBlock(getattr(net, name), f"stage{k}", ipu_id=k))
    return net


def efficientnet_b0() -> torch.nn.Module:
    net = torchvision.models.efficientnet_b0(num_classes=10)
    for k, at in enumerate([3, 5, 7], start=1):  # of its 9 feature blocks
        net.features[at] = poptorch.BeginBlock(net.features[at], f"stage{k}", ipu_id=k)
    return net


@pytest.fixture
def one_thread():
    """One intra-op thread for both sides: a thread count changes a reduction's order.
    On a GPU, cuDNN's deterministic kernels for both sides: its default ones (a convolution's
    weight gradient) sum in an order that changes from run to run, and these models, with
    batch norm over 4 rows of 1x1 maps, amplify that (on an H200, two plain PyTorch runs of
    the same EfficientNet steps differed by 0.1 in the second step's losses)."""
    before = torch.get_num_threads(), torch.backends.cudnn.deterministic, \
        torch.backends.cudnn.benchmark
    torch.set_num_threads(1)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.set_num_threads(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


@pytest.mark.parametrize("device", ["cpu", "gpu_twin", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])])
@pytest.mark.parametrize("make, schedule", [(resnet18, "grouped"),
                                            (efficientnet_b0, "interleaved")])
def test_torchvision_models_pipelined_in_4_stages_train_as_plain_pytorch(
        make, schedule, device, one_thread):
    torch.manual_seed(0)
    model = Classifier(make())
    plain = copy.deepcopy(model).to("cuda" if device == "cuda" else "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(D * G * B, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (D * G * B,), generator=g)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    plain_opt = sgd(plain)
    torch.manual_seed(5)
    seeds = microbatch_seeds(D, G)
    outs, losses, _ = reference_training(plain, plain_opt, x, y, D, G, 1, seeds=seeds)

    opts = on_device(poptorch.Options().deviceIterations(D), device)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.parse(schedule)))
    optimizer = sgd(model)
    train = poptorch.trainingModel(model, opts, optimizer)
    torch.manual_seed(5)
    out, loss = train(x, y)
    train.copyWeightsToHost()

    exact = dict(atol=0, rtol=0)  # the same kernels on both sides, on every device
    assert_close(loss, torch.stack(losses), **exact)
    assert_close(out, torch.cat(outs), **exact)
    mine, theirs = model.state_dict(), plain.state_dict()
    assert list(mine) == list(theirs)
    for name in theirs:  # parameters, running means and variances, batches tracked
        assert_close(mine[name], theirs[name].cpu(), **exact, msg=name)
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert_close(optimizer.state[p]["momentum_buffer"].cpu(),  # kept where the weight lives
                     plain_opt.state[plain_params[name]]["momentum_buffer"].cpu(), **exact,
                     msg=name)
    train.destroy()
