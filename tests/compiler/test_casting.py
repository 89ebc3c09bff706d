"""PopTorch's implicit casting of mixed float16/float32 ops ([Note: implicit casting] in
compiler/casting.py), against PopTorch's documented examples and plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch

import poptorch_lite as poptorch

from models import microbatch_seeds, trained_grads


class Adder(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class SimpleAdder(torch.nn.Module):
    def forward(self, x, y, z, w):
        return x + y + 5, z + w + 5


def test_poptorchs_half_tests_hold():
    """pt:tests/half_test.py: half + float is float either way round; half + half stays half,
    float + float float (test_simple_model); a half Linear on a half input is half."""
    half, single = torch.tensor([1.0]).half(), torch.tensor([2.0])
    assert poptorch.inferenceModel(Adder())(half, single).dtype == torch.float
    assert poptorch.inferenceModel(Adder())(single, half).dtype == torch.float
    out_half, out_float = poptorch.inferenceModel(SimpleAdder())(
        half, torch.tensor([2.0]).half(), torch.tensor([3.0]), torch.tensor([4.0]))
    assert (out_half.dtype, out_half.float().item()) == (torch.half, 8.0)
    assert (out_float.dtype, out_float.item()) == (torch.float, 12.0)
    linear = torch.nn.Linear(1, 10).half()
    out = poptorch.inferenceModel(linear)(half)
    assert out.dtype == torch.half
    torch.testing.assert_close(out, linear(half), atol=0, rtol=0)


def backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3, stride=2),
                               torch.nn.GroupNorm(1, 2), torch.nn.Flatten(),
                               torch.nn.Linear(2 * 3 * 3, 5), torch.nn.LayerNorm(5))


def test_a_half_model_called_with_float32_inputs_computes_in_float32():
    """YOLOv4's backbone test: ``inferenceModel(model.half())(float32 input)``. Conv and norm
    weights take the input's type (castWeightAndBias), the Linear promotes: float32 out, equal
    to the model's float32 copy (float16 -> float32 is exact), where plain PyTorch raises."""
    model = backbone().half().eval()
    poptorch.BeginBlock(model[3], "second", ipu_id=1)
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(RuntimeError, match="should be the same"):
        model(x)
    out = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        expected = copy.deepcopy(model).float()(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_training_a_half_model_on_float32_inputs_reaches_its_half_parameters():
    """Gradients go through the casts to the float16 parameters, and a training BatchNorm's
    running statistics are written back into its float16 buffers, as for its float32 copy."""
    model = backbone().half().train()
    ref = copy.deepcopy(model).float()
    x, target = torch.randn(2, 3, 8, 8), torch.randn(2, 5)

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, target):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, target)

    wrapped = poptorch.trainingModel(WithLoss(model),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    out, loss = wrapped(x, target)
    ref_out = ref(x)
    ref_loss = torch.nn.functional.mse_loss(ref_out, target)
    ref_loss.backward()
    assert (out.dtype, loss.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    grads = trained_grads(wrapped)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.half
        torch.testing.assert_close(grads["net." + name], q.grad.half(), atol=1e-3, rtol=1e-3,
                                   msg=name)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean.half(), atol=1e-3,
                               rtol=0)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var.half(), atol=1e-3,
                               rtol=0)


class MixedPrecision(torch.nn.Module):
    """A bfloat16 network whose normalisations stay in float32 (mixed precision's usual
    layout, which plain PyTorch runs as it is), with dropout in bfloat16."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.bn, self.ln = torch.nn.BatchNorm1d(8), torch.nn.LayerNorm(8)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, y):
        h = self.drop(self.ln(torch.relu(self.bn(self.a(x)))))
        out = self.b(h)
        return out, torch.nn.functional.cross_entropy(out.float(), y)


@pytest.mark.parametrize("how", ["bfloat16_with_float32_norms", "autocast"])
def test_mixed_precision_norms_and_dropout_train_bit_for_bit(how):
    """A normalisation of a bfloat16 input with float32 weights and statistics runs as plain
    PyTorch runs it, not with its weights cast down, and a bfloat16 dropout's gradient is
    the decomposition's (``native_dropout``'s backward rounds otherwise), for a model made
    so and for one under ``torch.autocast``: outputs, gradients, weights and statistics
    equal plain PyTorch's to the bit over two steps."""
    torch.manual_seed(0)
    model = MixedPrecision()
    if how != "autocast":
        model = model.bfloat16()
        model.bn.float()
        model.ln.float()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    wrapped = poptorch.trainingModel(model, poptorch.Options(), opt)
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast")
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        x = x if how == "autocast" else x.bfloat16()
        torch.manual_seed(10 + step)
        with context:
            out, loss = wrapped(x, y)
        torch.manual_seed(10 + step)
        seed = microbatch_seeds(1, 1)[0]
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with context:
            ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref_out.detach(), atol=0, rtol=0)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=0, rtol=0)
        for name, grad in trained_grads(wrapped).items():
            torch.testing.assert_close(grad, dict(ref.named_parameters())[name].grad, atol=0,
                                       rtol=0, msg=f"{name}, step {step}")
        ref_opt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    wrapped.destroy()
