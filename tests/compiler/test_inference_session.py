"""An inferenceModel runs as PopTorch's inference session ([Note: inference session] in compiler/trace_modes.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch


class FunctionalDropouts(torch.nn.Module):
    """Every dropout a forward can call, all following ``self.training``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)
        t = self.training
        h = F.dropout(h, 0.5, t) + F.alpha_dropout(h, 0.5, t)
        h = h + F.feature_alpha_dropout(h, 0.5, t)
        img = h.view(-1, 2, 2, 2)
        img = F.dropout1d(img[:, :, :, 0], 0.5, t).unsqueeze(-1) + F.dropout2d(img, 0.5, t)
        return F.dropout3d(img.unsqueeze(2), 0.5, t).flatten(1)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True)

    def forward(self, x):
        q = x.view(-1, 2, 8)
        a, _ = self.mha(q, q, q)
        s = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0)
        return (self.layer(a) + s).flatten(1)


MODELS = {
    "Sequential(Linear, Dropout)": lambda: torch.nn.Sequential(torch.nn.Linear(4, 64),
                                                               torch.nn.Dropout(0.5)),
    "functional dropouts": FunctionalDropouts,
    "attention": Attention,
}


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_inference_model_of_a_training_mode_model_drops_nothing(make):
    torch.manual_seed(0)
    model = make()
    model.train()
    x = torch.randn(6, 16) if make is Attention else torch.randn(6, 4)
    reference = copy.deepcopy(model).eval()(x)
    infer = poptorch.inferenceModel(model)
    first, second = infer(x), infer(x)
    assert_close(first, second, rtol=0, atol=0)
    assert_close(first, reference)
    assert all(m.training for m in model.modules()), "the user's modules keep their flags"


def test_training_model_still_drops_out():
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5))

        def forward(self, x):
            out = self.net(x)
            return out, poptorch.identity_loss(out.sum() * 0, reduction="none")

    model = Net()
    opts = poptorch.Options()
    opts.outputMode(poptorch.OutputMode.All)
    out, _ = poptorch.trainingModel(model, opts)(torch.ones(6, 4))
    assert (out == 0).sum() > 0, "training-mode dropout zeroes some activations"


def test_batchnorm_follows_its_own_flag_as_in_poptorch():
    """PopTorch lowers a training-mode BatchNorm to batch statistics, in inference too."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3)
    norm.running_mean.copy_(torch.randn(3))
    reference = copy.deepcopy(norm)
    x = torch.randn(8, 3) * 2 + 1
    expected = reference(x)  # training mode: batch statistics, running ones updated
    assert_close(poptorch.inferenceModel(norm)(x), expected)
    assert_close(norm.running_mean, reference.running_mean)
    assert_close(norm.running_var, reference.running_var)
    assert norm.training
    norm.eval(), reference.eval()
    assert_close(poptorch.inferenceModel(norm)(x), reference(x))  # eval: running statistics


class Encoder(torch.nn.Module):
    """A TransformerEncoderLayer and a MultiheadAttention on a short sequence, in eval mode:
    plain PyTorch runs each one's fused kernel there ([Note: fused fast paths] in
    compiler/trace_modes.py)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, batch_first=True)
        self.mha = torch.nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        seq = x.unsqueeze(1).repeat(1, 3, 1) * torch.tensor([1.0, 0.5, -1.0]).view(1, 3, 1)
        attended, _ = self.mha(seq, seq, seq, need_weights=False)
        return self.enc(seq), attended


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_fast_paths_in_eval_mode_are_plain_pytorchs_bit_for_bit(compiled):
    """The inference model of a transformer in eval mode runs the fused kernels plain PyTorch
    runs, where the trace's own modes (and MultiheadAttention's check for make_fx) had it run
    the separate ops, 1e-8 off; under a CPU autocast the attention's is bit for bit too."""
    torch.manual_seed(0)
    model = Encoder().eval()
    opts = poptorch.Options()
    if compiled:
        opts.compileStages(True, backend="aot_eager")
    inference = poptorch.inferenceModel(model, opts)
    x = torch.randn(4, 6)
    with torch.no_grad():
        want = model(x)
    for got, plain in zip(inference(x), want):
        assert torch.equal(got, plain)
    inference.destroy()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(  # the encoder: W-LITE-20
            poptorch.PoptorchLiteWarning, match="TransformerEncoderLayer in eval mode"):
        inference = poptorch.inferenceModel(model)
        got = inference(x)[1]
        with torch.no_grad():
            plain = model(x)[1]
    assert got.dtype == plain.dtype == torch.bfloat16 and torch.equal(got, plain)
    inference.destroy()


def test_an_encoder_layer_under_a_cpu_autocast_runs_its_ops_and_says_so():
    """make_fx cannot trace the encoder layer's fused kernel under autocast: the layer runs
    its separate ops (its attention's kernel among them), and W-LITE-20 says so."""
    torch.manual_seed(0)
    model = Encoder().eval()
    x = torch.randn(4, 6)
    seq = x.unsqueeze(1).repeat(1, 3, 1) * torch.tensor([1.0, 0.5, -1.0]).view(1, 3, 1)
    enc = model.enc
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inference = poptorch.inferenceModel(model)
        with pytest.warns(poptorch.PoptorchLiteWarning, match="TransformerEncoderLayer in eval "
                          "mode without gradients, under torch.autocast on the CPU"):
            got = inference(x)[0]
        with torch.no_grad():  # the layer's own ops, as its forward runs them off the fast path
            h = enc.norm1(seq + enc._sa_block(seq, None, None))
            ops = enc.norm2(h + enc._ff_block(h))
            fused = enc(seq)
    assert got.dtype == ops.dtype == torch.float32 and torch.equal(got, ops)
    assert fused.dtype == torch.bfloat16  # what plain PyTorch's fused kernel returns
    inference.destroy()


def test_an_encoder_layer_wrapped_alone_runs_its_fused_kernel():
    """The layer as the model itself: the trace's own hooks are global, so the fast path's
    check for hooks on the layer finds none, as in plain PyTorch."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True).eval()
    x = torch.randn(2, 3, 4)
    inference = poptorch.inferenceModel(model)
    got = inference(x)
    with torch.no_grad():
        assert torch.equal(got, model(x))
    inference.destroy()


@pytest.mark.parametrize("device", ["ipu_model", "gpu_twin"])
def test_a_parameter_the_forward_writes_reaches_the_host_after_an_inference_call(device):
    """An embedding with ``max_norm`` renormalises the rows it reads, in place, in every
    forward: after an inference call on separate memories the host's weight is the one the
    forward wrote, as plain PyTorch's is."""
    from models import on_device, twin
    torch.manual_seed(0)
    model = torch.nn.Embedding(4, 6, max_norm=1.0)
    plain = twin(model)
    with torch.no_grad():
        model.weight.mul_(3.0)
        plain.weight.mul_(3.0)
    inference = poptorch.inferenceModel(model, on_device(poptorch.Options(), device))
    ids = torch.tensor([0, 2])
    got = inference(ids)
    with torch.no_grad():
        want = plain(ids)
    assert torch.equal(got, want)
    assert torch.equal(model.weight.detach(), plain.weight.detach())
    assert model.weight.norm(dim=1)[1] > 1.5  # a row the call did not read keeps its norm
    inference.destroy()
