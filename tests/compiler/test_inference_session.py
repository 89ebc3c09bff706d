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
