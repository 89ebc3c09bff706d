"""PopTorch's optimizers: torch's numerics, PopTorch's extras, the wrapper's helpers."""

from __future__ import annotations

import copy
import doctest
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from poptorch_lite import errors
from poptorch_lite import optim
from poptorch_lite.optim import accepted, optimizers, rules
from poptorch_lite.errors import OptimizerError, PoptorchLiteWarning
from poptorch_lite.optim.optimizers import LAMB, SGD, Adam, AdamW, RMSprop

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test sees warn_once's record empty, so expected warnings do fire."""
    monkeypatch.setattr(errors, "_warned", set())


def make_model(zero_bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    if zero_bias:  # ||p|| = 0: LAMB's trust ratio is 1
        torch.nn.init.zeros_(model[2].bias)
    return model


def train(model: torch.nn.Module, step) -> list[torch.Tensor]:
    """STEPS steps of MSE on fixed data; ``step()`` updates; returns the parameters."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def run(make_opt, zero_bias: bool = False) -> list[torch.Tensor]:
    model = make_model(zero_bias)
    opt = make_opt(model.parameters())
    return train(model, opt.step)


def run_reference(update, zero_bias: bool = False) -> list[torch.Tensor]:
    """Train with ``update(p, g, state, t)`` applied to each parameter by hand."""
    model = make_model(zero_bias)
    states = {p: {} for p in model.parameters()}
    count = [0]

    def step():
        count[0] += 1
        with torch.no_grad():
            for p in model.parameters():
                update(p, p.grad.clone(), states[p], count[0])

    return train(model, step)


def assert_params_equal(actual, expected, atol=0.0):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=atol, rtol=0 if atol == 0 else 1e-5)


# --- torch's numerics with default extras -------------------------------------------------

BITWISE = [
    (SGD, torch.optim.SGD, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    (Adam, torch.optim.Adam, dict()),
    (Adam, torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(lr=0.01)),
    (AdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, maximize=True)),
    (RMSprop, torch.optim.RMSprop, dict()),
    (RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
]


@pytest.mark.parametrize("ours, theirs, kwargs", BITWISE,
                         ids=[f"{o.__name__}-{i}" for i, (o, _, _) in enumerate(BITWISE)])
def test_default_extras_match_torch_bitwise(ours, theirs, kwargs):
    expected = run(lambda params: theirs(params, **kwargs))
    assert_params_equal(run(lambda params: ours(params, **kwargs)), expected)


@pytest.mark.parametrize("ours, theirs, kwargs, extras", [
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9),
     dict(use_combined_accum=True, velocity_scaling=4.0, loss_scaling=128.0,
          accum_type=torch.float16, velocity_accum_type=torch.float16, max_grad_norm=5.0)),
    (Adam, torch.optim.Adam, dict(lr=0.01), dict(loss_scaling=8.0, accum_type=torch.float16)),
    (RMSprop, torch.optim.RMSprop, dict(lr=0.01),  # grad_avg's dtype: only when centered
     dict(second_order_momentum_accum_type=torch.float16)),
])
def test_precision_knobs_leave_fp32_results_unchanged(ours, theirs, kwargs, extras):
    """Knobs a step does not use here (velocity dtype with the combined variant, the
    gradient accumulators' dtype outside a wrapper) change nothing; the state dtypes that
    are used are pinned in test_optim_precision.py."""
    expected = run(lambda params: theirs(params, **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PoptorchLiteWarning)
        actual = run(lambda params: ours(params, **kwargs, **extras))
    assert_params_equal(actual, expected)


def test_overridden_steps_run_step_hooks_once():
    model = make_model()
    torch.optim.AdamW(model.parameters())  # torch hooks its classes' step on first use
    torch.optim.RMSprop(model.parameters())
    for opt in (AdamW(model.parameters()), RMSprop(model.parameters()),
                AdamW(model.parameters(), bias_correction=False),
                RMSprop(model.parameters(), use_tf_variant=True)):
        calls = []
        opt.register_step_pre_hook(lambda *_: calls.append("pre"))
        opt.register_step_post_hook(lambda *_: calls.append("post"))
        train(model, opt.step)
        assert calls == ["pre", "post"] * STEPS


# --- variants that change the math, against written-out references -------------------------


def adamw_without_bias_correction(lr, betas, eps, wd):
    def update(p, g, state, t):
        m = state.setdefault("m", torch.zeros_like(p))
        v = state.setdefault("v", torch.zeros_like(p))
        m.copy_(betas[0] * m + (1 - betas[0]) * g)
        v.copy_(betas[1] * v + (1 - betas[1]) * g * g)
        p.copy_(p * (1 - lr * wd) - lr * m / (v.sqrt() + eps))
    return update


def test_adamw_without_bias_correction_matches_reference():
    kwargs = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    actual = run(lambda params: AdamW(params, **kwargs, bias_correction=False))
    expected = run_reference(adamw_without_bias_correction(0.01, (0.8, 0.9), 1e-6, 0.1))
    assert_params_equal(actual, expected, atol=1e-6)
    assert not torch.allclose(actual[0], run(lambda params: AdamW(params, **kwargs))[0])


def rmsprop_tf(lr, alpha, eps, wd, momentum, centered):
    def update(p, g, state, t):
        g = g + wd * p
        s = state.setdefault("s", torch.ones_like(p))  # TF: the squares start at 1
        a = state.setdefault("a", torch.zeros_like(p))
        b = state.setdefault("b", torch.zeros_like(p))
        s.copy_(alpha * s + (1 - alpha) * g * g)
        a.copy_(alpha * a + (1 - alpha) * g)
        d = torch.sqrt(s - a * a + eps) if centered else torch.sqrt(s + eps)
        if momentum > 0:
            b.copy_(momentum * b + lr * g / d)
            p.sub_(b)
        else:
            p.sub_(lr * g / d)
    return update


@pytest.mark.parametrize("momentum, centered, wd", [(0.0, False, 0.0), (0.9, False, 0.1),
                                                     (0.0, True, 0.0), (0.9, True, 0.1)])
def test_rmsprop_tf_variant_matches_reference(momentum, centered, wd):
    kwargs = dict(lr=0.01, alpha=0.9, eps=1e-3, weight_decay=wd, momentum=momentum,
                  centered=centered)
    actual = run(lambda params: RMSprop(params, **kwargs, use_tf_variant=True))
    expected = run_reference(rmsprop_tf(0.01, 0.9, 1e-3, wd, momentum, centered))
    assert_params_equal(actual, expected, atol=1e-6)
    assert not torch.allclose(actual[0], run(lambda params: RMSprop(params, **kwargs))[0])


def lamb_reference(lr, betas, eps, wd, max_weight_norm, bias_correction):
    def update(p, g, state, t):
        m = state.setdefault("m", torch.zeros_like(p))
        v = state.setdefault("v", torch.zeros_like(p))
        m.copy_(betas[0] * m + (1 - betas[0]) * g)
        v.copy_(betas[1] * v + (1 - betas[1]) * g * g)
        m_hat, v_hat = (m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)) if bias_correction \
            else (m, v)
        u = m_hat / (v_hat.sqrt() + eps) + wd * p
        w_norm, u_norm = min(p.norm().item(), max_weight_norm), u.norm().item()
        trust = 1.0 if w_norm == 0 or u_norm == 0 else w_norm / u_norm
        p.sub_(lr * trust * u)
    return update


@pytest.mark.parametrize("bias_correction, max_weight_norm, zero_bias", [
    (True, 65500.0, True), (False, 65500.0, False), (True, 0.5, False)])
def test_lamb_matches_reference(bias_correction, max_weight_norm, zero_bias):
    actual = run(lambda params: LAMB(params, lr=0.05, betas=(0.8, 0.9), eps=1e-6,
                                     weight_decay=0.1, bias_correction=bias_correction,
                                     max_weight_norm=max_weight_norm), zero_bias)
    expected = run_reference(lamb_reference(0.05, (0.8, 0.9), 1e-6, 0.1, max_weight_norm,
                                            bias_correction), zero_bias)
    assert_params_equal(actual, expected, atol=1e-6)


def test_lamb_trust_ratio_is_one_for_a_zero_weight():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([2.0, -1.0, 0.5])
    LAMB([p], lr=0.1, eps=1e-6).step()  # m_hat = g, v_hat = g^2, u = g / (|g| + eps)
    torch.testing.assert_close(p.detach(), -0.1 * p.grad / (p.grad.abs() + 1e-6))


def test_lamb_defaults_follow_poptorch():
    opt = LAMB(make_model().parameters())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert group["max_weight_norm"] == 65500.0
    assert (opt.bias_correction, opt.loss_scaling, opt.max_grad_norm) == (True, 1.0, math.inf)
    with pytest.raises(OptimizerError, match="betas=\\(1.0, 0.9\\)"):
        LAMB(make_model().parameters(), betas=(1.0, 0.9))
    with pytest.raises(OptimizerError, match="max_weight_norm=0"):
        LAMB(make_model().parameters(), max_weight_norm=0)


# --- the wrapper's helpers -----------------------------------------------------------------


def test_loss_scaling_and_max_grad_norm_readers():
    params = list(make_model().parameters())
    for torch_opt in (torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params),
                      torch.optim.RMSprop(params)):
        assert optim.loss_scaling(torch_opt) == 1.0
        assert optim.max_grad_norm(torch_opt) == math.inf
    assert optim.loss_scaling(SGD(params, lr=0.1, loss_scaling=64)) == 64.0
    assert optim.max_grad_norm(Adam(params, max_grad_norm=2)) == 2.0
    assert optim.max_grad_norm(LAMB(params, max_grad_norm=3.0)) == 3.0
    assert optim.max_grad_norm(AdamW(params)) == math.inf
    assert optim.max_grad_norm(RMSprop(params, loss_scaling=2.0)) == math.inf  # PopTorch: none
    assert optim.loss_scaling(RMSprop(params, loss_scaling=2.0)) == 2.0
    with pytest.raises(AttributeError, match="RMSprop has no max_grad_norm"):
        RMSprop(params).max_grad_norm


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.Adam(ps),
    lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.RMSprop(ps),
    lambda ps: SGD(ps, lr=0.1), lambda ps: Adam(ps), lambda ps: AdamW(ps),
    lambda ps: RMSprop(ps), lambda ps: LAMB(ps)])
def test_check_optimizer_accepts_supported_types_silently(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.check_optimizer(make(make_model().parameters()))


def test_check_optimizer_refuses_other_types():
    with pytest.raises(OptimizerError, match=r"torch\.optim\.adagrad\.Adagrad.*use one of.*"
                                             r"torch\.optim\.sgd\.SGD.*poptorch_lite\.optim\.LAMB"):
        optim.check_optimizer(torch.optim.Adagrad(make_model().parameters()))


def test_amsgrad_is_refused():
    params = list(make_model().parameters())
    for torch_cls in (torch.optim.Adam, torch.optim.AdamW):
        with pytest.raises(OptimizerError, match="amsgrad=True is not supported"):
            optim.check_optimizer(torch_cls(params, amsgrad=True))
    for cls in (Adam, AdamW):
        with pytest.raises(OptimizerError, match="pass amsgrad=False"):
            cls(params, amsgrad=True)
        with pytest.raises(OptimizerError, match=r"\[False, True\]"):
            cls([{"params": params[:2]}, {"params": params[2:], "amsgrad": True}])


def test_rmsprop_groups_must_agree_on_centered():
    params = list(make_model().parameters())
    opt = torch.optim.RMSprop([{"params": params[:2]}, {"params": params[2:], "centered": True}])
    with pytest.raises(OptimizerError, match=r"centered, got \[False, True\]"):
        optim.check_optimizer(opt)


def test_subclasses_warn_once():
    class MySGD(torch.optim.SGD):
        pass

    class MyAdam(Adam):
        pass

    for opt in (MySGD(make_model().parameters(), lr=0.1), MyAdam(make_model().parameters())):
        with pytest.warns(PoptorchLiteWarning, match="unlikely to behave as intended"):
            optim.check_optimizer(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optim.check_optimizer(opt)


# --- global extras -------------------------------------------------------------------------


def two_groups(**second):
    params = list(make_model().parameters())
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def test_global_extras_are_attributes_and_in_every_group():
    opt = SGD(two_groups(lr=0.5), lr=0.1, loss_scaling=16, max_grad_norm=2.0)
    assert (opt.loss_scaling, opt.max_grad_norm, opt.accum_type) == (16.0, 2.0, torch.float32)
    for group in opt.param_groups:
        assert (group["loss_scaling"], group["max_grad_norm"]) == (16.0, 2.0)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    assert opt.param_groups[2]["loss_scaling"] == 16.0
    opt.loss_scaling = 512
    assert [g["loss_scaling"] for g in opt.param_groups] == [512.0] * 3


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "2", True, None])
def test_loss_scaling_is_validated(bad):
    opt = Adam(make_model().parameters(), loss_scaling=4.0)
    with pytest.raises(OptimizerError, match="positive finite float"):
        opt.loss_scaling = bad
    assert opt.loss_scaling == 4.0
    if bad is not None:
        with pytest.raises(OptimizerError, match=f"loss_scaling={bad!r} is invalid"):
            Adam(make_model().parameters(), loss_scaling=bad)


def test_other_extras_are_validated():
    params = list(make_model().parameters())
    with pytest.raises(OptimizerError, match="torch.float32 or torch.float16"):
        SGD(params, lr=0.1, accum_type=torch.bfloat16)
    with pytest.raises(OptimizerError, match="first_order_momentum_accum_type"):
        LAMB(params, first_order_momentum_accum_type=torch.float64)
    with pytest.raises(OptimizerError, match="max_grad_norm=0 is invalid"):
        AdamW(params, max_grad_norm=0)
    with pytest.raises(OptimizerError, match="pass use_tf_variant=True or use_tf_variant=False"):
        RMSprop(params, use_tf_variant=1)
    with pytest.raises(OptimizerError, match="Invalid learning rate"):  # torch's own check
        SGD(params, lr=-1.0)
    with pytest.raises(TypeError):  # PopTorch's SGD requires lr
        SGD(params)
    with pytest.raises(TypeError, match="loss_scalling"):  # a typo is not ignored
        Adam(params, loss_scalling=2.0)


def test_float16_moment_types_are_stored_without_a_warning():
    params = list(make_model().parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # honoured: test_optim_precision.py
        opt = Adam(params, first_order_momentum_accum_type=torch.float16)
    assert opt.first_order_momentum_accum_type == torch.float16


def test_accum_type_is_the_gradient_accumulator_dtype():
    params = list(make_model().parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it has an effect here: no IPU-only warning
        opt = Adam(params, accum_type=torch.float16)
    assert opt.accum_type == torch.float16 and opt.param_groups[0]["accum_type"] == torch.float16
    assert accepted.accum_dtype(opt) == torch.float16
    assert accepted.accum_dtype(SGD(params, lr=0.1)) == torch.float32
    assert accepted.accum_dtype(torch.optim.SGD(params, lr=0.1)) is None


def test_groups_disagreeing_on_a_global_extra_are_refused():
    with pytest.raises(OptimizerError, match=r"loss_scaling is global.*\[1.0, 2.0\]"):
        SGD(two_groups(loss_scaling=2.0), lr=0.1)
    opt = AdamW(two_groups())
    opt.param_groups[1]["bias_correction"] = False
    with pytest.raises(OptimizerError, match=r"bias_correction is global.*\[True, False\]"):
        opt.bias_correction
    with pytest.raises(OptimizerError, match="set opt.bias_correction = value"):
        optim.check_optimizer(opt)


def test_velocity_scaling_is_per_group_and_needs_the_combined_variant():
    with pytest.warns(PoptorchLiteWarning, match="velocity_scaling=2.0 is ignored"):
        opt = SGD(make_model().parameters(), lr=0.1, momentum=0.9, velocity_scaling=2.0)
    assert "velocity_scaling" not in opt.param_groups[0]
    opt = SGD(two_groups(velocity_scaling=8.0), lr=0.1, use_combined_accum=True,
              velocity_scaling=2.0)
    assert [g["velocity_scaling"] for g in opt.param_groups] == [2.0, 8.0]
    assert opt.use_combined_accum is True
    with pytest.raises(OptimizerError, match="velocity_scaling=-1"):
        SGD(make_model().parameters(), lr=0.1, use_combined_accum=True, velocity_scaling=-1)


def test_extras_survive_state_dict_deepcopy_and_torch_load():
    opt = RMSprop(make_model().parameters(), loss_scaling=4.0, use_tf_variant=True,
                  accum_type=torch.float32)
    clone = copy.deepcopy(opt)
    assert (clone.loss_scaling, clone.use_tf_variant) == (4.0, True)
    assert not clone.variable_attrs.isConstant("loss_scaling")
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = RMSprop(make_model().parameters())
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert (fresh.loss_scaling, fresh.use_tf_variant) == (4.0, True)


# --- variable_attrs ------------------------------------------------------------------------


def test_variable_attrs():
    attrs = Adam(make_model().parameters(), betas=(0.8, 0.9), loss_scaling=2.0).variable_attrs
    assert not attrs.isConstant("betas") and not attrs.isConstant("loss_scaling")
    assert not attrs.isConstant("lr")  # always variable
    assert attrs.isConstant("eps") and attrs.isConstant("weight_decay")
    attrs.markAsVariable("eps")
    attrs.markAsConstant("betas")
    assert not attrs.isConstant("eps") and attrs.isConstant("betas")
    for method in (attrs.isConstant, attrs.markAsConstant, attrs.markAsVariable):
        with pytest.raises(OptimizerError, match="unknown optimizer attribute 'momentum'"):
            method("momentum")
    assert not SGD(make_model().parameters(), lr=0.1, momentum=0.9, use_combined_accum=True,
                   velocity_scaling=2.0).variable_attrs.isConstant("velocity_scaling")


# --- copy_hyperparameters ------------------------------------------------------------------


def test_copy_hyperparameters_keeps_state_and_copies_hyperparameters():
    model = make_model()
    target = SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0)
    train(model, target.step)
    buffers = {p: target.state[p]["momentum_buffer"] for p in model.parameters()}
    saved = {p: b.clone() for p, b in buffers.items()}
    source = SGD(model.parameters(), lr=0.5, momentum=0.5, loss_scaling=8.0, max_grad_norm=1.0)
    optim.copy_hyperparameters(source, target)
    group = target.param_groups[0]
    assert (group["lr"], group["momentum"], target.loss_scaling, target.max_grad_norm) == \
        (0.5, 0.5, 8.0, 1.0)
    assert group["params"] == list(model.parameters())
    for p, buffer in buffers.items():
        assert target.state[p]["momentum_buffer"] is buffer
        assert torch.equal(buffer, saved[p])


def test_copy_hyperparameters_from_a_torch_optimizer_resets_the_extras():
    model = make_model()
    target = Adam(model.parameters(), loss_scaling=8.0, max_grad_norm=1.0)
    optim.copy_hyperparameters(torch.optim.Adam(model.parameters(), lr=0.02), target)
    assert (target.param_groups[0]["lr"], target.loss_scaling, target.max_grad_norm) == \
        (0.02, 1.0, math.inf)


def test_copy_hyperparameters_refuses_mismatches():
    model = make_model()
    with pytest.raises(OptimizerError, match="source has 2 param groups and the target 1"):
        optim.copy_hyperparameters(SGD(two_groups(), lr=0.1), SGD(model.parameters(), lr=0.1))
    with pytest.raises(OptimizerError, match="from Adam to SGD"):
        optim.copy_hyperparameters(Adam(model.parameters()), SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("module", [optimizers, accepted, rules], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
