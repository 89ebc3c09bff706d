"""Optimizer state in PopTorch's dtypes ([Note: optimizer state dtypes]), against plain
PyTorch doing the same arithmetic in those dtypes, written out here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.optim.optimizers import LAMB, SGD, Adam, AdamW, RMSprop

H, F32 = torch.float16, torch.float32
STEPS = 3


def fp16_model() -> torch.nn.Module:
    """A float16 model whose first input feature is always 0, so one weight column gets a
    gradient of exactly 0: with float16 moments, 0 / (sqrt(0) + fp16(1e-8) = 0) is NaN."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 2)).to(H)


def batches(n: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(4, 4, generator=gen)
        x[:, 0] = 0
        yield x.to(H), torch.randint(0, 2, (4,), generator=gen)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).float(), y)


def adam_reference(p, g, st, t, *, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0, decoupled=True,
                   bias_correction=True, m_dtype=F32, v_dtype=F32, lamb=False, max_norm=65500.0):
    """PopART's Adam/AdamW/LAMB: each moment in its dtype, the update in v's dtype, the step
    in the parameter's."""
    b1, b2 = betas
    if not st:
        st["m"], st["v"] = torch.zeros_like(p, dtype=m_dtype), torch.zeros_like(p, dtype=v_dtype)
    if wd and not decoupled:
        g = g.add(p, alpha=wd)
    g1, g2 = g.to(m_dtype), g.to(v_dtype)  # each update rounds once, as torch's in-place ops
    st["m"] = st["m"].mul(b1).add(g1, alpha=1 - b1)
    st["v"] = st["v"].mul(b2).addcmul(g2, g2, value=1 - b2)
    bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
    u = ((st["m"] / bc1).to(v_dtype) / (torch.sqrt(st["v"] / bc2) + eps)).to(p.dtype)
    if decoupled and wd:
        u = u.add(p, alpha=wd)
    if lamb:
        r1, r2 = min(p.float().norm(), torch.tensor(max_norm)), u.float().norm()
        trust = 1.0 if r1 == 0 or r2 == 0 else r1 / r2
        return p - (u.float() * (lr * trust)).to(p.dtype)
    return p.add(u, alpha=-lr)


def rmsprop_reference(p, g, st, t, *, lr, alpha=0.99, eps=1e-8, momentum=0.0, centered=False,
                      tf=False, s_dtype=F32, a_dtype=F32):
    """PopART's Adaptive RMSprop: squares in s_dtype, centered mean in a_dtype, momentum in
    float32, the ratio in the widest of them."""
    if not st:
        st["s"] = torch.full_like(p, 1.0 if tf else 0.0, dtype=s_dtype)
        st["a"], st["b"] = torch.zeros_like(p, dtype=a_dtype), torch.zeros_like(p, dtype=F32)
    gs = g.to(s_dtype)
    st["s"] = st["s"].mul(alpha).addcmul(gs, gs, value=1 - alpha)
    wide = torch.promote_types(s_dtype, F32 if momentum > 0 else s_dtype)
    var = st["s"].to(wide)
    if centered:
        st["a"] = st["a"].mul(alpha).add(g.to(a_dtype), alpha=1 - alpha)
        wide = torch.promote_types(wide, a_dtype)
        var = st["s"].to(wide).addcmul(st["a"].to(wide), st["a"].to(wide), value=-1)
    denom = torch.sqrt(var + eps) if tf else torch.sqrt(var) + eps
    ratio = g.to(wide) / denom
    if momentum > 0:
        st["b"] = st["b"].mul(momentum).add(ratio.float(), alpha=lr if tf else 1.0)
        return p.sub(st["b"].to(p.dtype)) if tf else p.add(st["b"].to(p.dtype), alpha=-lr)
    return p.add(ratio.to(p.dtype), alpha=-lr)


def sgd_reference(p, g, st, t, *, lr, momentum, v_dtype):
    """SGD with the velocity in v_dtype (torch: the first velocity is the gradient)."""
    st["b"] = g.to(v_dtype).clone() if not st else st["b"].mul(momentum).add(g.to(v_dtype))
    return p.add(st["b"].to(p.dtype), alpha=-lr)


CASES = [  # (optimizer, its arguments, the reference, its arguments)
    (AdamW, dict(lr=1e-2, second_order_momentum_accum_type=F32), adam_reference,
     dict(lr=1e-2, wd=1e-2)),
    (AdamW, dict(lr=1e-2, first_order_momentum_accum_type=H, bias_correction=False,
                 weight_decay=0.1), adam_reference,
     dict(lr=1e-2, wd=0.1, m_dtype=H, bias_correction=False)),
    (Adam, dict(lr=1e-2, weight_decay=0.1), adam_reference,
     dict(lr=1e-2, wd=0.1, decoupled=False)),
    (LAMB, dict(lr=1e-2, first_order_momentum_accum_type=H), adam_reference,
     dict(lr=1e-2, wd=1e-2, m_dtype=H, lamb=True)),
    (RMSprop, dict(lr=1e-2), rmsprop_reference, dict(lr=1e-2)),
    (RMSprop, dict(lr=1e-2, centered=True, momentum=0.9, second_order_momentum_accum_type=H),
     rmsprop_reference, dict(lr=1e-2, centered=True, momentum=0.9, a_dtype=H)),
    (RMSprop, dict(lr=1e-2, momentum=0.9, use_tf_variant=True), rmsprop_reference,
     dict(lr=1e-2, momentum=0.9, tf=True)),
    (SGD, dict(lr=0.1, momentum=0.9), sgd_reference, dict(lr=0.1, momentum=0.9, v_dtype=F32)),
    (SGD, dict(lr=0.1, momentum=0.9, velocity_accum_type=H), sgd_reference,
     dict(lr=0.1, momentum=0.9, v_dtype=H)),
]


@pytest.mark.parametrize("cls, kwargs, reference, ref_kwargs", CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_float16_parameters_step_with_state_in_poptorchs_dtypes(cls, kwargs, reference,
                                                                ref_kwargs):
    model, ref = fp16_model(), fp16_model()
    opt = cls(model.parameters(), **kwargs)
    states = {name: {} for name, _ in ref.named_parameters()}
    for t, (x, y) in enumerate(batches(), start=1):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        ref.zero_grad()
        loss_of(ref, x, y).backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(reference(p, p.grad, states[name], t, **ref_kwargs))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == H and torch.isfinite(p).all(), name
        assert_close(p, q, msg=lambda m: f"{name}: {m}")
    wanted = {k: v for k, v in kwargs.items() if k.endswith("accum_type")}
    for state in opt.state.values():
        for key, tensor in state.items():
            if key != "step":  # every state tensor in its dtype: float32 unless asked
                want = F32
                if key in ("exp_avg", "square_avg"):
                    want = wanted.get("first_order_momentum_accum_type", F32)
                elif key in ("exp_avg_sq", "grad_avg"):
                    want = wanted.get("second_order_momentum_accum_type", F32)
                elif key == "momentum_buffer" and cls is SGD:
                    want = wanted.get("velocity_accum_type", F32)
                assert tensor.dtype == want, (key, tensor.dtype)


def test_torchs_adamw_on_float16_state_gives_nan_where_poptorchs_trains():
    """The issue's case: torch keeps float16 moments (eps rounds to 0, 0/0 is NaN) while
    PopTorch's AdamW keeps them in float32; through a wrapper with accumulation."""
    plain = fp16_model()
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    x, y = next(batches(1))
    loss_of(plain, x, y).backward()
    torch_opt.step()
    assert torch.isnan(plain[0].weight).any()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = fp16_model()

        def forward(self, x, y):
            return loss_of(self.net, x, y)

    model, G = WithLoss(), 2
    ref = copy.deepcopy(model.net)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opt = AdamW(model.parameters(), lr=1e-3, second_order_momentum_accum_type=F32)
    train = poptorch.trainingModel(model, opts, opt)
    states = {name: {} for name, _ in ref.named_parameters()}
    for t, (x, y) in enumerate(batches(), start=1):
        train(x.repeat(G, 1), y.repeat(G))
        ref.zero_grad()
        grads = {}
        for _ in range(G):  # accumulated in float32 (accum_type), the mean cast once
            ref.zero_grad()
            loss_of(ref, x, y).backward()
            for name, p in ref.named_parameters():
                grads[name] = grads.get(name, 0) + p.grad.float()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(adam_reference(p, (grads[name] / G).to(H), states[name], t, lr=1e-3,
                                       wd=1e-2))
    for (name, p), q in zip(model.net.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), name
        assert_close(p.detach(), q, msg=name)
    assert all(s["exp_avg_sq"].dtype == F32 for s in opt.state.values())


@pytest.mark.parametrize("cls, kwargs", [(AdamW, {}), (LAMB, {}), (SGD, dict(lr=0.1, momentum=0.9)),
                                         (RMSprop, dict(momentum=0.9))])
def test_a_loaded_state_keeps_its_dtypes_and_values(cls, kwargs):
    """torch's load_state_dict casts state to the parameter's dtype (float16 here); PopTorch's
    state stays in its own: a resumed run continues exactly."""
    model, twin_model = fp16_model(), fp16_model()
    opt = cls(model.parameters(), **kwargs)
    for x, y in batches(2):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    twin_opt = cls(twin_model.parameters(), **kwargs)
    twin_model.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), twin_model.parameters()):
        for key, value in opt.state[p].items():
            assert twin_opt.state[q][key].dtype == value.dtype, key
            assert torch.equal(twin_opt.state[q][key], value), key
    for m, o in ((model, opt), (twin_model, twin_opt)):
        x, y = next(batches(1))
        o.zero_grad()
        loss_of(m, x, y).backward()
        o.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
