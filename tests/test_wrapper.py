"""The wrapper: output modes, weight sync, setOptimizer, lifecycle and refused inputs."""

import copy
import inspect
import itertools
import logging
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch

from models import (BlockMLP, data, microbatch_seeds, on_device, reference_training,
                    replicas_training, twin)

ATOL = 1e-5
All, Final, Sum, EveryN, Default = (poptorch.OutputMode.All, poptorch.OutputMode.Final,
                                    poptorch.OutputMode.Sum, poptorch.OutputMode.EveryN,
                                    poptorch.OutputMode.Default)


def options(device, D=1, R=1, G=1, mode=None, period=None, strategy=None):
    """Options for a test: D, R, G, an output mode, a strategy, every IPU on ``device``."""
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    if mode is not None:
        opts.outputMode(mode, period)
    opts.setExecutionStrategy(strategy if strategy is not None else poptorch.ShardedExecution())
    on_device(opts, device)
    return opts


def sgd(model, lr=0.05, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def assert_same_weights(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach().cpu(), atol=ATOL, rtol=0, msg=name)


# -- 1. output modes (POPTORCH_REFERENCE §3) -------------------------------------------

B, C = 2, 4  # micro-batch size and classes of BlockMLP


def returned_count(mode, D, G, R, n):
    """b of the shape rule: how many micro-batch results one output holds."""
    return {All: R * D * G, Final: R, Sum: R, EveryN: R * D * G // n if n else 0}[mode]


def expected_output(per_microbatch, mode, D, G, R, n):
    """What ``mode`` returns, from every micro-batch's value in [D, G, R] order."""
    t = torch.stack(per_microbatch).reshape(D, G, R, *per_microbatch[0].shape)
    picked = {All: lambda: t, Final: lambda: t[D - 1, G - 1], Sum: lambda: t.sum(dim=(0, 1)),
              EveryN: lambda: t[n - 1::n]}[mode]()
    if per_microbatch[0].dim() == 0:
        flat = picked.reshape(-1)
        return flat.reshape(()) if flat.numel() == 1 else flat
    return picked.reshape(-1, *per_microbatch[0].shape[1:])


def mode_cases(G_values):
    cases = []
    for R, D, G in itertools.product([1, 2], [1, 3], G_values):
        for mode, n in [(All, None), (Final, None), (Sum, None), (EveryN, 1), (EveryN, 3)]:
            if n is None or D % n == 0:
                name = mode.name + (f"{n}" if n else "")
                cases.append(pytest.param(R, D, G, mode, n, id=f"R{R}-D{D}-G{G}-{name}"))
    return cases


@pytest.mark.parametrize("R,D,G,mode,n", mode_cases([1, 4]))
def test_training_output_modes(R, D, G, mode, n, device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    x, y = data(B * D * G * R)
    train = poptorch.trainingModel(model, options(device, D, R, G, mode, n), sgd(model))
    out, loss = train(x, y)
    ref_outs, ref_losses, _ = reference_training(ref, sgd(ref), x, y, D, G, R)

    b = returned_count(mode, D, G, R, n)
    assert out.shape == (b * B, C)
    assert loss.shape == ((b,) if b > 1 else ())
    assert_close(out, expected_output(ref_outs, mode, D, G, R, n), atol=ATOL, rtol=0)
    assert_close(loss, expected_output(ref_losses, mode, D, G, R, n), atol=ATOL, rtol=0)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("R,D,G,mode,n", mode_cases([1]))
def test_inference_output_modes(R, D, G, mode, n, device):
    torch.manual_seed(0)
    model = BlockMLP(2).eval()
    x, y = data(B * D * R)
    out, loss = poptorch.inferenceModel(model, options(device, D, R, 1, mode, n))(x, y)
    refs = [model(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(D * R)]

    b = returned_count(mode, D, 1, R, n)
    assert out.shape == (b * B, C)
    assert loss.shape == ((b,) if b > 1 else ())
    assert_close(out, expected_output([o.detach() for o, _ in refs], mode, D, 1, R, n),
                 atol=ATOL, rtol=0)
    assert_close(loss, expected_output([l.detach() for _, l in refs], mode, D, 1, R, n),
                 atol=ATOL, rtol=0)


def test_all_mode_is_the_concatenation_in_d_g_r_b_order(device):
    # An identity model makes the order visible: the output is the input, row for row.
    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return x + 0 * self.w, poptorch.identity_loss(x * self.w, reduction="sum")

    D, G, R = 3, 2, 2
    x = torch.arange(D * G * R * B, dtype=torch.float32).reshape(-1, 1)
    out, _ = poptorch.trainingModel(Echo(), options(device, D, R, G, All))(x)
    assert_close(out, x, atol=0, rtol=0)
    final, _ = poptorch.trainingModel(Echo(), options(device, D, R, G, Final))(x)
    k = [(D - 1) * G * R + (G - 1) * R + r for r in range(R)]  # last micro-batch per replica
    assert_close(final, torch.cat([x[i * B:(i + 1) * B] for i in k]), atol=0, rtol=0)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_default_output_mode_is_final_for_training_and_all_for_inference(training, device):
    torch.manual_seed(0)
    D, G, R = 3, (2 if training else 1), 2
    model = BlockMLP(2)
    ref = twin(model)
    x, y = data(B * D * G * R)
    opts = options(device, D, R, G, Default)
    if training:
        out, loss = poptorch.trainingModel(model, opts, sgd(model))(x, y)
        ref_outs, ref_losses, _ = reference_training(ref, sgd(ref), x, y, D, G, R)
        mode = Final
    else:
        out, loss = poptorch.inferenceModel(model, opts)(x, y)
        pairs = [ref(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(D * R)]
        ref_outs, ref_losses = [o.detach() for o, _ in pairs], [l.detach() for _, l in pairs]
        mode = All
    b = returned_count(mode, D, G, R, None)
    assert out.shape == (b * B, C) and loss.shape == (b,)
    assert_close(out, expected_output(ref_outs, mode, D, G, R, None), atol=ATOL, rtol=0)
    assert_close(loss, expected_output(ref_losses, mode, D, G, R, None), atol=ATOL, rtol=0)


# -- 2. weight sync --------------------------------------------------------------------


def test_training_call_leaves_the_trained_weights_in_the_user_model(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    x, y = data(B * 2 * 2)
    poptorch.trainingModel(model, options(device, D=2, G=2), sgd(model))(x, y)
    reference_training(ref, sgd(ref), x, y, 2, 2, 1)
    assert_same_weights(model, ref)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("created", ["before", "after"])
def test_inference_model_computes_with_the_trained_weights(created, device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    x, y = data(4, seed=2)
    if created == "before":
        infer = poptorch.inferenceModel(model, options(device))
        assert_close(infer(x, y)[0], ref(x, y)[0].detach(), atol=ATOL, rtol=0)  # compiled
    xt, yt = data(B * 2)
    poptorch.trainingModel(model, options(device, G=2), sgd(model))(xt, yt)
    reference_training(ref, sgd(ref), xt, yt, 1, 2, 1)
    if created == "after":
        infer = poptorch.inferenceModel(model, options(device))
    out, loss = infer(x, y)
    ref_out, ref_loss = ref(x, y)
    assert_close(out, ref_out.detach(), atol=ATOL, rtol=0)
    assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_host_edit_then_copy_weights_to_device_takes_effect(training, device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    x, y = data(B)
    if training:
        wrapped = poptorch.trainingModel(model, options(device), sgd(model, momentum=0))
    else:
        wrapped = poptorch.inferenceModel(model, options(device))
    wrapped(x, y)
    with torch.no_grad():
        model.head.bias.add_(3.0)
        model.layers[0].weight.mul_(-1.0)
    wrapped.copyWeightsToDevice()
    ref = twin(model)
    out, loss = wrapped(x, y)
    if training:
        ref_outs, ref_losses, _ = reference_training(ref, sgd(ref, momentum=0), x, y, 1, 1, 1)
        ref_out, ref_loss = ref_outs[0], ref_losses[0]
    else:
        ref_out, ref_loss = (v.detach() for v in ref(x, y))
    assert_close(out, ref_out, atol=ATOL, rtol=0)
    assert_close(loss, ref_loss, atol=ATOL, rtol=0)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_copying_weights_before_compilation_is_refused(training):
    model = BlockMLP(1)
    wrapped = poptorch.trainingModel(model) if training else poptorch.inferenceModel(model)
    for copy_weights in (wrapped.copyWeightsToHost, wrapped.copyWeightsToDevice):
        with pytest.raises(poptorch.DeviceError, match="not been compiled"):
            copy_weights()


# -- 3. setOptimizer -------------------------------------------------------------------


def test_set_optimizer_changes_hyper_parameters_and_keeps_the_state(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    G = 2
    opt, ref_opt = sgd(model, lr=0.05), sgd(ref, lr=0.05)
    train = poptorch.trainingModel(model, options(device, G=G), opt)
    batches = [data(B * G, seed=s) for s in range(3)]

    train(*batches[0])
    reference_training(ref, ref_opt, *batches[0], 1, G, 1)
    momentum = {p: opt.state[p]["momentum_buffer"] for p in model.parameters()}
    kept = {p: m.clone() for p, m in momentum.items()}
    before = [p.detach().clone() for p in model.parameters()]

    # lr=0 (and no momentum): the call moves no weight and leaves the momentum alone.
    train.setOptimizer(torch.optim.SGD(model.parameters(), lr=0))
    train(*batches[1])
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    for p in model.parameters():
        assert opt.state[p]["momentum_buffer"] is momentum[p]
        assert torch.equal(opt.state[p]["momentum_buffer"], kept[p])
    ref_opt.param_groups[0].update(lr=0, momentum=0)
    reference_training(ref, ref_opt, *batches[1], 1, G, 1)

    # A new lr (and momentum again) from the next call on, on top of the kept momentum.
    train.setOptimizer(sgd(model, lr=0.02))
    train(*batches[2])
    ref_opt.param_groups[0].update(lr=0.02, momentum=0.9)
    reference_training(ref, ref_opt, *batches[2], 1, G, 1)
    assert_same_weights(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(opt.state[p]["momentum_buffer"].cpu(), ref_opt.state[q]["momentum_buffer"],
                     atol=ATOL, rtol=0)


def test_default_optimizer_is_sgd_lr_0_01_without_momentum(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    D = 3  # three steps: momentum would show from the second one
    x, y = data(B * D)
    poptorch.trainingModel(model, options(device, D=D))(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.01), x, y, D, 1, 1)
    assert_same_weights(model, ref)


# -- 4. lifecycle and misuse ----------------------------------------------------------


def test_wrapping_twice_is_refused_until_destroy(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    x, y = data(B)
    train = poptorch.trainingModel(model, options(device))
    train(x, y)
    for again in (model, train):
        with pytest.raises(poptorch.WrapError, match=r"already been wrapped.*destroy\(\)"):
            poptorch.trainingModel(again, options(device))
    with pytest.raises(RuntimeError):  # PopTorch raises RuntimeError here
        poptorch.trainingModel(model, options(device))
    train.destroy()
    ref = twin(model)
    _, loss = poptorch.trainingModel(model, options(device), sgd(model))(x, y)
    _, ref_losses, _ = reference_training(ref, sgd(ref), x, y, 1, 1, 1)
    assert_close(loss, ref_losses[0], atol=ATOL, rtol=0)
    assert_same_weights(model, ref)


def test_a_destroyed_wrapper_called_again_compiles_again_and_takes_the_model_back(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    x, y = data(B)
    train = poptorch.trainingModel(model, options(device), sgd(model))
    train(x, y)
    train.destroy()
    with pytest.warns(poptorch.PoptorchLiteWarning, match="was destroyed and is called again"):
        _, loss = train(x, y)  # PopTorch: a destroyed wrapper recompiles
    ref_opt = sgd(ref)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, 1, 1)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, 1, 1)
    assert_close(loss, ref_losses[0], atol=ATOL, rtol=0)
    assert_same_weights(model, ref)
    with pytest.raises(poptorch.WrapError, match=r"Call model\.destroy\(\) on the model"):
        poptorch.trainingModel(model, options(device))  # the revived wrapper holds it again
    copied = copy.deepcopy(model)  # a copy's (or a pickle's) destroy() holds no wrapper
    assert pickle.loads(pickle.dumps(model)).destroy() is None and copied.destroy() is None
    assert train._weights is not None
    # PopTorch's model.destroy() unwraps it ([Note: one trainer per model] in trainers)
    model.destroy()
    assert train._weights is None and "destroy" not in vars(model)
    poptorch.trainingModel(model, options(device))


def test_a_destroyed_wrapper_is_refused_while_another_holds_the_model(device):
    model = BlockMLP(2)
    x, y = data(B)
    first = poptorch.trainingModel(model, options(device))
    first(x, y)
    first.destroy()
    second = poptorch.trainingModel(model, options(device))
    second(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(poptorch.WrapError, match="already been wrapped"):
        first(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    second(x, y)  # the live wrapper is unaffected


def test_a_block_on_an_ipu_the_explicit_mapping_leaves_out_is_refused():
    model = BlockMLP(2)
    opts = options("cpu", G=3, strategy=poptorch.PipelinedExecution("b0", "b1"))
    opts.set_ipu_devices({0: "cpu"})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(poptorch.OptionsError,
                       match=r"maps IPUs \[0\] only, but the model places blocks on IPU 1 "
                             r"\(block 'b1'\).*set_ipu_devices\(\{0: 'cpu', 1: 'cpu'\}\)"):
        poptorch.trainingModel(model, opts)(*data(B * 3))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    poptorch.trainingModel(model, options("cpu", G=3).set_ipu_devices(["cpu", "cpu"]))(
        *data(B * 3))  # a list maps IPUs 0 and 1


def test_the_first_call_logs_stages_devices_schedule_and_batch(caplog):
    opts = options("cpu", D=2, G=3, strategy=poptorch.PipelinedExecution(
        "b0", "b1", schedule=poptorch.PipelineSchedule.Interleaved))
    train = poptorch.trainingModel(BlockMLP(2), opts)
    with caplog.at_level("INFO", logger="poptorch_lite"):
        train(*data(B * 2 * 3))
        train(*data(B * 2 * 3))  # compiled once: one record
    assert [r.getMessage() for r in caplog.records if r.name == "poptorch_lite"] == [
        "trainingModel compiled: 2 stages (0: IPU 0 on cpu; 1: IPU 1 on cpu), schedule "
        "interleaved; micro-batch 2 x gradientAccumulation 3 x replicas 1 = 6 per optimizer "
        "step, x deviceIterations 2 = 12 per call"]


SCALE = torch.tensor(0.1)  # a tensor made outside the forward, returned as it is


class ReturnsAConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.with_scale = True  # the plain reference returns (out, loss)

    def forward(self, x, y):
        out = self.fc(x)
        return (SCALE, out, F.cross_entropy(out, y)) if self.with_scale else \
            (out, F.cross_entropy(out, y))


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_a_constant_tensor_returned_as_it_is_comes_back_from_every_call(training, device):
    torch.manual_seed(0)
    model = ReturnsAConstant()
    ref = twin(model)
    ref.with_scale = False
    x, y = data(B * 2)
    opts = options(device, D=2)
    wrapped = poptorch.trainingModel(model, opts, sgd(model)) if training else \
        poptorch.inferenceModel(model, opts)
    ref_opt = sgd(ref)
    for _ in range(2):
        scale, out, loss = wrapped(x, y)
        assert torch.equal(scale, SCALE)
        if training:
            _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 2, 1, 1)
            assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)
    if training:
        assert_same_weights(model, ref)


class KeepsItsLoss(torch.nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.fc, self.returns = torch.nn.Linear(8, 4), returns

    def forward(self, x, y):
        out = self.fc(x)
        loss = F.cross_entropy(out, y)
        return {"none": out, "loss": (out, loss), "detached": (out, loss.detach())}[self.returns]


@pytest.mark.parametrize("returns, warned", [("none", True), ("loss", False),
                                             ("detached", False)])
def test_a_loss_the_forward_does_not_return_is_warned_about(returns, warned):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        poptorch.trainingModel(KeepsItsLoss(returns))(*data(B))
    hits = [w for w in caught if "does not return it" in str(w.message)]
    assert len(hits) == warned
    if warned:  # it points at the loss's line in forward, and quotes it without a frame
        source = inspect.getsource(KeepsItsLoss.forward).splitlines()
        line = KeepsItsLoss.forward.__code__.co_firstlineno + next(
            k for k, text in enumerate(source) if "loss = F.cross_entropy" in text)
        assert (hits[0].filename, hits[0].lineno) == (__file__, line)
        assert str(hits[0].message).startswith(
            "the training model computes its loss (loss = F.cross_entropy(out, y)) but does "
            "not return it: ")


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_options_are_frozen_after_wrapping(training):
    opts = poptorch.Options().deviceIterations(1)
    model = BlockMLP(1)
    wrapped = poptorch.trainingModel(model, opts) if training else \
        poptorch.inferenceModel(model, opts)
    with pytest.raises(poptorch.FrozenOptionsError, match="Can't modify frozen Options"):
        opts.deviceIterations(2)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.Training.gradientAccumulation(2)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.replication_factor = 2
    assert opts.device_iterations == 1 and wrapped.options.device_iterations == 1
    assert wrapped.options.replication_factor == 1


@pytest.mark.parametrize("move", ["to", "cpu", "cuda", "half"])
def test_moving_a_wrapper_is_refused(move):
    wrapped = poptorch.inferenceModel(BlockMLP(1))
    args = ("cpu",) if move == "to" else ()
    with pytest.raises(poptorch.WrapError, match=r"cannot be moved with \.to\(\)"):
        getattr(wrapped, move)(*args)


def test_device_attach_and_detach(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    train = poptorch.trainingModel(model, options(device), sgd(model))
    with pytest.raises(poptorch.DeviceError, match="not attached"):
        train.detachFromDevice()
    assert not train.isAttachedToDevice()
    batches = [data(B, seed=s) for s in range(2)]
    train(*batches[0])
    assert train.isAttachedToDevice()
    with pytest.raises(poptorch.DeviceError, match="already attached"):
        train.attachToDevice()
    train.detachFromDevice()
    assert not train.isAttachedToDevice()
    with pytest.raises(poptorch.DeviceError, match="not attached"):
        train.detachFromDevice()
    train(*batches[1])  # re-attaches
    assert train.isAttachedToDevice()
    ref_opt = sgd(ref)
    for x, y in batches:
        reference_training(ref, ref_opt, x, y, 1, 1, 1)
    assert_same_weights(model, ref)
    train.detachFromDevice()
    train.attachToDevice()
    assert train.isAttachedToDevice()


def test_compile_runs_no_step(device):
    torch.manual_seed(0)
    model = BlockMLP(2, dropout=0.5, batchnorm=True)
    opt = primed_sgd(model)
    ref = twin(model, device)
    ref_opt = sgd(ref, lr=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the same primed momentum
    x, y = data(B * 2)
    train = poptorch.trainingModel(model, options(device, G=2), opt)
    assert not train.isCompiled()
    before = snapshot(model, opt)
    train.compile(x, y)
    assert train.isCompiled()
    assert_unchanged(before, model, opt)
    torch.manual_seed(5)
    train(x, y)
    torch.manual_seed(5)
    reference_training(ref, ref_opt, x, y, 1, 2, 1, seeds=microbatch_seeds(1, 2))  # one step
    assert_same_weights(model, ref)


def test_attributes_are_forwarded_to_the_user_model():
    model = BlockMLP(2)
    train = poptorch.trainingModel(model)
    infer = poptorch.inferenceModel(model)
    assert train.layers[0].weight is model.layers[0].weight
    assert infer.head.bias is model.head.bias
    assert train.model is model and infer.model is model
    assert train.blocks == 2
    with pytest.raises(AttributeError):
        train.no_such_attribute


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_returned_tensors_do_not_require_grad(training, device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    x, y = data(B * 2)
    opts = options(device, G=2 if training else 1, D=1 if training else 2, mode=All)
    wrapped = poptorch.trainingModel(model, opts) if training else \
        poptorch.inferenceModel(model, opts)
    for t in wrapped(x, y):
        assert not t.requires_grad and t.grad_fn is None


@pytest.mark.parametrize("wrap", [poptorch.trainingModel, poptorch.inferenceModel])
def test_options_of_another_type_are_refused(wrap):
    with pytest.raises(poptorch.OptionsError,
                       match=r"Invalid type: 'options' is of type <class 'dict'>.*"
                             r"Expected poptorch.Options"):
        wrap(BlockMLP(1), {"deviceIterations": 2})


def test_inference_model_refuses_gradient_accumulation():
    """PopTorch's text (batching_test), its hint for pipelines only."""
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.OptionsError,
                       match=r"gradientAccumulation to 1 .*Use poptorch\.Options\(\)\."
                             r"deviceIterations to process .*\(It is 2\.\)$"):
        poptorch.inferenceModel(BlockMLP(1), opts)
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(3)
    with pytest.raises(poptorch.OptionsError,
                       match=r"poptorch\.inferenceModel\(\)\. \(It is 3\.\)$"):
        poptorch.inferenceModel(BlockMLP(1), opts)


def test_connection_type_never_compiles_but_refuses_to_run(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    opts = options(device)
    with pytest.warns(poptorch.IpuOnlyWarning):
        opts.connectionType(poptorch.ConnectionType.Never)
    opt = primed_sgd(model)
    train = poptorch.trainingModel(model, opts, opt)
    x, y = data(B)
    before = snapshot(model, opt)
    train.compile(x, y)
    assert train.isCompiled()
    with pytest.raises(poptorch.DeviceError,  # PopTorch's AssertionError too
                       match=r"^Trying to run a model on an offline device .*ConnectionType\."
                             r"Never.*ConnectionType\.Always") as info:
        train(x, y)
    assert isinstance(info.value, AssertionError)
    assert_unchanged(before, model, opt)


# -- 5. refused inputs leave every state as it was -------------------------------------


class Probe(torch.nn.Module):
    """Linear -> BatchNorm -> Dropout -> Linear -> Linear with a cross-entropy loss.

    A training step moves its parameters, optimizer state, buffers and the RNG,
    so a refused call that changed any of them shows. Subclasses change
    ``forward`` into one misuse each.
    """

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.drop = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(4, 4)
        self.fc3 = torch.nn.Linear(4, 3)

    def first(self, x):
        return self.drop(self.bn(torch.relu(self.fc1(x))))

    def forward(self, x, y):
        out = self.fc3(torch.relu(self.fc2(self.first(x))))
        return out, F.cross_entropy(out, y)


class ThreeBlocks(Probe):
    """Blocks 'a', 'b', 'c' on the given IPUs (None: no ipu_id)."""

    def __init__(self, ipus=(0, 1, 2)):
        super().__init__()
        self.ipus = ipus

    def forward(self, x, y):
        poptorch.Block.start("a", ipu_id=self.ipus[0])
        h = self.first(x)
        poptorch.Block.start("b", ipu_id=self.ipus[1])
        h = torch.relu(self.fc2(h))
        poptorch.Block.start("c", ipu_id=self.ipus[2])
        out = self.fc3(h)
        return out, F.cross_entropy(out, y)


class OpAfterBlock(Probe):
    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.first(x)
        out = self.fc3(torch.relu(self.fc2(h)))  # no active block
        return out, F.cross_entropy(out, y)


class NoLoss(Probe):
    def forward(self, x, y):
        return self.fc3(torch.relu(self.fc2(self.first(x))))


class TwoLosses(Probe):
    def __init__(self, combined):
        super().__init__()
        self.combined = combined

    def forward(self, x, y):
        out = self.fc3(torch.relu(self.fc2(self.first(x))))
        l1, l2 = F.cross_entropy(out, y), F.mse_loss(out, torch.zeros_like(out))  # two losses
        if self.combined:
            return out, poptorch.identity_loss(l1 + l2, reduction="none")
        return out, l1, l2


class FloatIdentityLoss(Probe):
    def forward(self, x, y):
        out = self.fc3(torch.relu(self.fc2(self.first(x))))
        return out, poptorch.identity_loss(3.0, "mean")


class FloatCheckpoint(Probe):
    def forward(self, x, y):
        h = poptorch.recomputationCheckpoint(1.0)
        out = self.fc3(torch.relu(self.fc2(self.first(x)))) * h
        return out, F.cross_entropy(out, y)


class FunctionalBatchNorm(Probe):
    """Running statistics in its own buffers, updated by F.batch_norm (no counter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x, y):
        h = F.batch_norm(self.fc1(x), self.mean, self.var, training=True)
        out = self.fc3(h)
        return out, F.cross_entropy(out, y)


def test_functional_batchnorm_keeps_statistics_per_replica_as_batchnorm_layers_do(device):
    """PopTorch tells a batch norm's statistics by the op, not the layer: F.batch_norm on the
    model's own buffers trains on 2 replicas as 2 independent copies would."""
    torch.manual_seed(0)
    model = FunctionalBatchNorm()
    copies = [twin(model, device) for _ in range(2)]
    opt, ref_opt = sgd(model, lr=0.02), sgd(copies[0], lr=0.02)
    train = poptorch.trainingModel(model, options(device, R=2, G=2, mode=All), opt)
    for call in range(2):
        x, y = probe_data(4 * 2 * 2, seed=call)
        out, _ = train(x, y)
        ref_outs, _, _ = replicas_training(copies, ref_opt, x, y, 1, 2)
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=f"call {call}")
        for (name, a), ref in zip(model.state_dict().items(), copies[0].state_dict().values()):
            assert_close(a, ref.cpu(), atol=ATOL, rtol=0, msg=f"{name}, call {call}")
        for name in ("mean", "var"):
            assert_close(train._weights.buffer(name, 1, 0).cpu(), getattr(copies[1], name).cpu(),
                         atol=ATOL, rtol=0, msg=f"replica 1's {name}, call {call}")
    train.destroy()


class FunctionalBatchNormOnLargerBatches(torch.nn.Module):
    """F.batch_norm on statistics of its own, only on micro-batches of more than 2 rows; no
    normalisation layer."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc3 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x, y):
        h = self.fc1(x)
        if x.shape[0] > 2:
            h = F.batch_norm(h, self.mean, self.var, training=True)
        out = self.fc3(h)
        return out, F.cross_entropy(out, y)


def test_statistics_first_updated_by_a_later_signature_on_shared_buffers_are_refused(device):
    """Replicas share the buffers of a model without normalisation layers whose first program
    updates no statistics; a later signature's F.batch_norm on them is refused as a buffer
    write (E-PART-10), nothing changed."""
    torch.manual_seed(0)
    model = FunctionalBatchNormOnLargerBatches()
    opt = sgd(model)
    train = poptorch.trainingModel(model, options(device, R=2), opt)
    train(*probe_data(2 * 2))
    before = snapshot(model, opt)
    with pytest.raises(poptorch.OptionsError, match=r"buffers \['mean', 'var'\] and "
                       r"replicationFactor is 2\.\)"):
        train(*probe_data(2 * 4))
    assert_unchanged(before, model, opt)
    train.destroy()


class WritesAStatistic(Probe):
    """Its own write to BatchNorm's running mean, outside the layer (PopTorch's half_test)."""

    def forward(self, x, y):
        out = self.fc3(torch.relu(self.fc2(self.first(x))))
        with torch.no_grad():
            self.bn.running_mean += 1.0
        return out, F.cross_entropy(out, y)


class ShapeMismatch(Probe):
    def forward(self, x, y):
        h = self.first(x)
        out = self.fc3(torch.cat([h, h], dim=1))  # the forward raises here
        return out, F.cross_entropy(out, y)


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(marker))


def probe_data(n, seed=1):
    return data(n, width=4, classes=3, seed=seed)


def primed_sgd(model):
    """SGD with momentum whose state is already filled by one plain step."""
    opt = sgd(model, lr=0.1)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def snapshot(model, optimizer):
    """Parameters, optimizer state, buffers and the CPU RNG state, copied."""
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            copy.deepcopy(optimizer.state_dict()),
            {n: b.detach().clone() for n, b in model.named_buffers()},
            torch.get_rng_state())


def assert_unchanged(before, model, optimizer):
    params, opt_state, buffers, rng = before
    now_params, now_opt, now_buffers, now_rng = snapshot(model, optimizer)
    assert now_params.keys() == params.keys() and now_buffers.keys() == buffers.keys()
    for name, p in now_params.items():
        assert torch.equal(p, params[name]), f"parameter {name} changed"
    for name, b in now_buffers.items():
        assert torch.equal(b, buffers[name]), f"buffer {name} changed"
    assert now_opt["param_groups"] == opt_state["param_groups"]
    assert now_opt["state"].keys() == opt_state["state"].keys()
    for k, state in now_opt["state"].items():
        assert state.keys() == opt_state["state"][k].keys()
        for name, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_state["state"][k][name])), \
                f"optimizer state {k}/{name} changed"
    assert torch.equal(now_rng, rng), "the CPU RNG state changed"


def train_call(model_cls, opts, x=None, y=None, **model_kwargs):
    """Setup returning (model, optimizer, trigger) where trigger is one training call."""
    def setup(device):
        model = model_cls(**model_kwargs)
        opt = primed_sgd(model)
        o = opts(device)
        train = poptorch.trainingModel(model, o, opt)
        xx, yy = probe_data(poptorch.combined_batch_size(o, B)) if x is None else (x, y)
        return model, opt, lambda: train(xx, yy)
    return setup


def inference_call(model_cls, opts, **model_kwargs):
    def setup(device):
        model = model_cls(**model_kwargs).eval()
        opt = primed_sgd(model)
        infer = poptorch.inferenceModel(model, opts(device))
        return model, opt, lambda: infer(*probe_data(B * 2))
    return setup


def frozen_options(device):
    model = Probe()
    opts = options(device)
    poptorch.trainingModel(model, opts)
    return model, primed_sgd(model), lambda: opts.Training.gradientAccumulation(2)


def wrapped_twice(device):
    model = Probe()
    first = poptorch.trainingModel(model, options(device))  # alive while the second is tried
    return model, primed_sgd(model), lambda: (first, poptorch.trainingModel(model, options(device)))


X4, Y4 = probe_data(B)

BAD_INPUTS = [
    ("batch-not-a-multiple", train_call(Probe, lambda d: options(d, D=2, R=2, G=3), *probe_data(10)),
     poptorch.BatchSizeError,
     [r"In the input \(10, 4\)", r"batch dimension \(10\)", r"deviceIterations\(2\)",
      r"replicationFactor\(2\)", r"gradientAccumulation\(3\) = 12", r"micro_batch_size \* 12"]),
    ("accumulation-below-2N-1", train_call(ThreeBlocks, lambda d: options(
        d, G=2, strategy=poptorch.PipelinedExecution())), poptorch.PipelineError,
     [r"pipeline stages \(5\)", r"gradientAccumulation\(2\) is too small", r"3-stage",
      r"gradientAccumulation\(5\) or more", "ShardedExecution"]),
    ("device-iterations-below-N", inference_call(ThreeBlocks, lambda d: options(
        d, D=2, strategy=poptorch.PipelinedExecution())), poptorch.PipelineError,
     [r"pipeline stages \(3\)", r"deviceIterations\(2\) is too small",
      r"opts\.deviceIterations\(3\)"]),
    ("op-outside-block", train_call(OpAfterBlock, lambda d: options(
        d, strategy=poptorch.PipelinedExecution())), poptorch.BlockError,
     ["No active Block", rf"test_wrapper\.py:{line_of('# no active block')}: ",
      "Block scope"]),
    ("stage-names-unknown-block", train_call(ThreeBlocks, lambda d: options(
        d, strategy=poptorch.ShardedExecution("a", "b", "c", "ghost"))), poptorch.BlockError,
     [r"names block 'ghost'", r"\['a', 'b', 'c'\]", "fix the Stage"]),
    ("block-in-no-stage", train_call(ThreeBlocks, lambda d: options(
        d, strategy=poptorch.ShardedExecution("a", "b"))), poptorch.BlockError,
     [r"Unknown Block 'c'", r"\['a', 'b'\]", r"add 'c' to a Stage"]),
    ("stage-ids-descend", train_call(ThreeBlocks, lambda d: options(
        d, G=5, strategy=poptorch.PipelinedExecution()), ipus=(0, 1, 0)), poptorch.BlockError,
     ["ascend", r"block 'c' \(stage 0\)", r"block 'b' \(stage 1\)", "AutoIncrement"]),
    ("same-as-ipu-without-ipu", train_call(ThreeBlocks, lambda d: options(
        d, strategy=poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu)),
        ipus=(None, None, None)), poptorch.BlockError,
     [r"SameAsIpu was selected but no IPU was specified for block a", "AutoIncrement"]),
    ("no-loss", train_call(NoLoss, options), poptorch.LossError,
     ["Couldn't find a loss", "identity_loss"]),
    ("two-losses", train_call(TwoLosses, options, combined=False), poptorch.LossError,
     [r"Multiple independent losses found in graph\. Graph must have one final loss",
      r"The 2 losses: ",
      rf"test_wrapper\.py:{line_of('# two losses')}: ", r"identity_loss\(l1 \+ l2"]),
    ("frozen-options", frozen_options, poptorch.FrozenOptionsError,
     [r"Training\.gradientAccumulation\(\)", r"opts\.clone\(\)"]),
    ("wrapped-twice", wrapped_twice, poptorch.WrapError,
     ["already been wrapped", r"Call model\.destroy\(\) on the model"]),
    ("numpy-input", train_call(Probe, options, X4.numpy(), Y4), poptorch.InputError,
     [r"numpy\.ndarray", r"torch\.from_numpy"]),
    ("list-of-floats-input", train_call(Probe, options, X4, [0.0, 1.0]), poptorch.InputError,
     ["list of numbers", r"torch\.tensor\(\[0\.0, 1\.0\]\)"]),
    ("identity-loss-of-float", train_call(FloatIdentityLoss, options), poptorch.InputError,
     [r"identity_loss needs a tensor, got float", r"torch\.(as_)?tensor"]),
    ("checkpoint-of-float", train_call(FloatCheckpoint, options), poptorch.InputError,
     ["All inputs must be tensors", "got float"]),
    ("trace-fails", train_call(ShapeMismatch, options), RuntimeError,  # the forward's own
     ["^mat1 and mat2 shapes cannot be multiplied"]),
    ("replicated-buffer-write", train_call(WritesAStatistic, lambda d: options(d, R=2)),
     poptorch.OptionsError,  # BatchNorm's own updates are not named: only the model's write
     [r"PopTorch does not support broadcasting buffers", r"buffers \['bn\.running_mean'\] and",
      r"replicationFactor is 2", r"broadcastBuffers\(False\)"]),
]


@pytest.mark.parametrize("setup,error,fragments", [pytest.param(*case[1:], id=case[0])
                                                   for case in BAD_INPUTS])
def test_bad_input_is_refused_and_changes_no_state(setup, error, fragments, device):
    torch.manual_seed(0)
    model, opt, trigger = setup(device)
    before = snapshot(model, opt)
    with pytest.raises(error) as info:
        trigger()
    assert isinstance(info.value, poptorch.Error) or error is RuntimeError
    for fragment in fragments:
        assert re.search(fragment, str(info.value)), (fragment, str(info.value))
    assert_unchanged(before, model, opt)


def test_non_tensor_loss_and_checkpoint_refused_outside_a_wrapper_too():
    with pytest.raises(poptorch.InputError, match="identity_loss needs a tensor, got float"):
        poptorch.identity_loss(3.0, "mean")
    with pytest.raises(poptorch.InputError, match="All inputs must be tensors.*got float"):
        poptorch.recomputationCheckpoint(1.0)


def trains_like_plain_pytorch(model, opts, device, D=1, G=1, R=1):
    """One call of ``model`` wrapped with ``opts`` against plain PyTorch on ``device``'s kind
    (outputs, loss, weights)."""
    ref = twin(model, device)
    x, y = probe_data(B * D * G * R)
    torch.manual_seed(7)
    out, loss = poptorch.trainingModel(model, opts, sgd(model))(x, y)
    torch.manual_seed(7)
    seeds = microbatch_seeds(D, G * R)  # [Note: micro-batch RNG], for models with random ops
    ref_outs, ref_losses, _ = reference_training(ref, sgd(ref), x, y, D, G, R, seeds=seeds)
    assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack(ref_losses).reshape(loss.shape), atol=ATOL, rtol=0)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("strategy,G", [
    (poptorch.ShardedExecution(), 2),
    (poptorch.PipelinedExecution(), 5),
], ids=["sharded-G2", "pipelined-G5"])
def test_three_stage_model_runs_where_accumulation_suffices(strategy, G, device):
    torch.manual_seed(0)
    trains_like_plain_pytorch(ThreeBlocks(), options(device, G=G, mode=All, strategy=strategy),
                              device, G=G)


@pytest.mark.parametrize("strategy", [
    poptorch.ShardedExecution(), poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)],
    ids=["sharded", "auto-increment"])
def test_blocks_on_ipus_0_1_0_run_where_stage_order_allows(strategy, device):
    torch.manual_seed(0)
    trains_like_plain_pytorch(ThreeBlocks(ipus=(0, 1, 0)),
                              options(device, G=5, mode=All, strategy=strategy), device,
                              G=5)


def test_two_losses_combined_with_identity_loss_train(device):
    torch.manual_seed(0)
    trains_like_plain_pytorch(TwoLosses(combined=True), options(device, G=2, mode=All), device,
                              G=2)


def test_replicated_batchnorm_runs_with_broadcast_buffers_off(device):
    torch.manual_seed(0)
    model = Probe()
    replica0 = twin(model, device)
    x, _ = probe_data(B * 2)
    opts = options(device, R=2, mode=All).broadcastBuffers(False)
    trains_like_plain_pytorch(model, opts, device, R=2)
    # The host keeps replica 0's buffers: one update, from rows 0..B.
    replica0.first(x[:B].to(next(replica0.parameters()).device))
    for (name, a), b in zip(model.named_buffers(), replica0.buffers()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)


class BatchNormOnLargerBatches(Probe):
    """BatchNorm only on micro-batches of more than 2 rows: the program of a later signature
    updates running statistics that the first one's did not."""

    def forward(self, x, y):
        h = torch.relu(self.fc1(x))
        if x.shape[0] > 2:
            h = self.bn(h)
        out = self.fc3(torch.relu(self.fc2(h)))
        return out, F.cross_entropy(out, y)


def test_replicas_keep_their_own_statistics_from_the_first_signature_that_updates_them(device):
    """[Note: running statistics on replicas] in compiler/running_stats: a model with a
    BatchNorm layer gives each replica buffers of its own from its first program, which does
    not update them; from the first that does, each replica's statistics are its own, as 2
    independent copies of the model would have them."""
    torch.manual_seed(0)
    model = BatchNormOnLargerBatches()
    copies = [twin(model, device) for _ in range(2)]
    opt, ref_opt = sgd(model, lr=0.02), sgd(copies[0], lr=0.02)
    train = poptorch.trainingModel(model, options(device, R=2, mode=All), opt)
    for call, b in enumerate((2, 4, 2, 4)):
        x, y = probe_data(2 * b, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, _ = replicas_training(copies, ref_opt, x, y, 1, 1)
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=f"call {call}")
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=f"call {call}")
        for (name, a), ref in zip(model.state_dict().items(), copies[0].state_dict().values()):
            assert_close(a, ref.cpu(), atol=ATOL, rtol=0, msg=f"{name}, call {call}")
        for name, ref in copies[1].named_buffers():
            assert_close(train._weights.buffer(name, 1, 0).cpu(), ref.cpu(), atol=ATOL, rtol=0,
                         msg=f"replica 1's {name}, call {call}")
    assert int(model.bn.num_batches_tracked) == 2
    train.destroy()


class ReadsANanBuffer(Probe):
    """A buffer that holds a NaN and is only read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pad", torch.tensor([float("nan"), 1.0, 2.0, float("nan")]))

    def forward(self, x, y):
        h = torch.relu(self.fc1(x)) + torch.nan_to_num(self.pad)
        out = self.fc3(torch.relu(self.fc2(h)))
        return out, F.cross_entropy(out, y)


def test_a_buffer_holding_a_nan_is_not_taken_for_a_write(device):
    """A NaN differs from itself, but the buffer is only read: replicas run it (it was
    refused as a buffer write)."""
    torch.manual_seed(0)
    trains_like_plain_pytorch(ReadsANanBuffer(), options(device, R=2, G=2, mode=All), device,
                              G=2, R=2)


# -- 6. effective batch arithmetic ------------------------------------------------------


def test_any_multiple_of_the_batch_factor_is_accepted_and_retraced(device):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    D, G, R = 2, 2, 2
    opt, ref_opt = sgd(model), sgd(ref)
    train = poptorch.trainingModel(model, options(device, D, R, G, All), opt)
    for step, micro_batch in enumerate([1, 3, 2, 3]):
        x, y = data(micro_batch * D * G * R, seed=step)
        out, loss = train(x, y)
        ref_outs, ref_losses, _ = reference_training(ref, ref_opt, x, y, D, G, R)
        assert out.shape == (micro_batch * D * G * R, C) and loss.shape == (D * G * R,)
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0)
        assert_same_weights(model, ref)


# -- models without inputs or without tensor outputs ------------------------------------


class CountsCalls(torch.nn.Module):
    """No inputs; returns ``kind``: nothing, constants beside a tensor, or a tensor."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self):
        self.calls += 1
        if self.kind == "nothing":
            return None
        if self.kind == "constants":
            return self.w * 2, None, "tag", 3
        return poptorch.identity_loss((self.w ** 2).sum(), reduction="sum")


@pytest.mark.parametrize("D", [1, 2])
def test_a_model_without_inputs_or_tensor_outputs_runs_as_in_poptorch(D):
    """PopTorch returns what forward returns: None for nothing, constants as they are."""
    opts = poptorch.Options().deviceIterations(D)
    model = CountsCalls("nothing")
    assert poptorch.inferenceModel(model, opts)() is None
    assert int(model.calls) == D
    out, none, tag, three = poptorch.inferenceModel(CountsCalls("constants"), opts)()
    assert_close(out, torch.full((3 * D,), 2.0))
    assert (none, tag, three) == (None, "tag", 3)


def test_a_model_without_inputs_trains_as_plain_pytorch():
    D = 3
    model = CountsCalls("loss")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(D):
        opt.zero_grad()
        loss = ref()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    loss = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))()
    assert_close(loss, torch.stack(losses))
    assert_close(model.w, ref.w)
    assert int(model.calls) == D


# -- synthetic data ([Note: synthetic data] in runtime/batch.py) -----------------------------

class _Echo(torch.nn.Module):
    def forward(self, x, labels):
        return x * 1, labels + 0


@pytest.mark.parametrize("mode", [1, 2])
def test_synthetic_data_replaces_the_inputs_as_popart_does(mode):
    """Zeros (1) or one normal(0, 1) draw per input tensor (2), the same for every micro-batch
    and call; integer inputs are zeros; the host's values are never read."""
    opts = poptorch.Options().deviceIterations(2)
    with pytest.warns(poptorch.PoptorchLiteWarning, match="host's inputs are not used"):
        opts._Popart.set("syntheticDataMode", mode)
    wrapped = poptorch.inferenceModel(_Echo(), opts)
    x, labels = torch.full((4, 3), 7.0).half(), torch.arange(4)
    one = (torch.randn((2, 3), generator=torch.Generator().manual_seed(0)).half() if mode == 2
           else torch.zeros(2, 3, dtype=torch.half))
    for _ in range(2):
        out_x, out_labels = wrapped(x, labels)
        assert out_x.dtype == torch.half and out_labels.dtype == torch.int64
        torch.testing.assert_close(out_x, torch.cat([one, one]), atol=0, rtol=0)
        torch.testing.assert_close(out_labels, torch.zeros(4, dtype=torch.int64))
        x, labels = x + 1, labels + 1


class TwoBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buffer_1", torch.ones(3))
        self.register_buffer("buffer_2", torch.ones(3))

    def forward(self, x):
        return (x * self.buffer_1 * self.buffer_2).sum()


def test_copy_named_buffers_to_device_needs_names_the_model_has(device):
    """PopTorch's buffers_test: updatableNamedBuffers are checked when the model compiles,
    and copyNamedBuffersToDevice needs them. A host edit of any buffer reaches the devices
    before the next call ([Note: weight sync]), so the push adds no staleness of its own."""
    model, x = TwoBuffers(), torch.ones(3)
    infer = poptorch.inferenceModel(model, options(device).updatableNamedBuffers(["buffer_1"]))
    assert float(infer(x)) == 3.0
    model.buffer_1.add_(1)
    infer.copyNamedBuffersToDevice()
    assert float(infer(x)) == 6.0
    plain = poptorch.inferenceModel(TwoBuffers(), options(device))
    plain(x)
    with pytest.raises(poptorch.OptionsError, match="No named buffers marked as updatable via "
                                                    "updatableNamedBuffers option"):
        plain.copyNamedBuffersToDevice()
    wrong = poptorch.inferenceModel(
        TwoBuffers(), options(device).updatableNamedBuffers(["buffer_3"]))
    with pytest.raises(poptorch.OptionsError, match=r"updatableNamedBuffers names \['buffer_3'\],"
                                                    r" which the model has no buffer of; its "
                                                    r"buffers are \['buffer_1', 'buffer_2'\]"):
        wrong(x)


def test_a_wrappers_options_say_what_is_in_force():
    """PopTorch's options_test: a wrapper's options read OutputMode.Default back as the mode
    it runs in; a float16 accum_type sets the Running mean strategy (refused once compiled);
    Distributed has PopTorch's stored names."""
    model = BlockMLP(1)
    opts = poptorch.Options()
    training, inference = poptorch.trainingModel(model, opts), poptorch.inferenceModel(model, opts)
    assert opts.defaultOutputMode() and opts.output_mode == poptorch.OutputMode.Default
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All
    training.destroy()
    half = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=torch.float16)
    train = poptorch.trainingModel(model, poptorch.Options(), half)
    strategy = train.options.Training.meanAccumulationAndReplicationReductionStrategy
    assert strategy == poptorch.MeanReductionStrategy.Running
    train.destroy()
    train = poptorch.trainingModel(model, poptorch.Options(), sgd(model))
    train(*data(B))
    with pytest.raises(poptorch.OptimizerError, match="Invalid optimizer: the new optimizer "
                       r"would require changing options\.Training\.meanAccumulation"):
        train.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1,
                                              accum_type=torch.float16))
    combined = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                  accum_type=torch.float16, use_combined_accum=True)
    train.setOptimizer(combined)  # the combined variant keeps Post, as in PopTorch
    distributed = poptorch.Options().Distributed.configureProcessId(1, 4)
    assert (distributed.distributed_process_id, distributed.num_distributed_processes) == (1, 4)


def test_a_new_input_signature_compiles_again_and_says_so_once(caplog):
    """[Note: a new signature compiles] in runtime/batch.py: PopTorch refuses a call whose
    shapes or dtypes differ from the compiled one until destroy(); poptorch_lite compiles
    again, keeps both programs and logs one warning per new signature."""
    model = torch.nn.Linear(4, 2)
    infer = poptorch.inferenceModel(model)
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        for x in (torch.ones(2, 4), torch.ones(3, 4), torch.ones(2, 4), torch.ones(3, 4)):
            assert torch.equal(infer(x), model(x).detach())
        infer(torch.ones(2, 4, dtype=torch.float64))
    notes = [r.getMessage() for r in caplog.records if r.name == "poptorch_lite"]
    assert notes == [
        "inferenceModel: a call whose input signature differs from the compiled one (argument "
        "leaf 0: shape (2, 4) -> (3, 4)) compiles again and keeps both programs; PopTorch "
        "would refuse it until destroy()",
        "inferenceModel: a call whose input signature differs from the compiled one (argument "
        "leaf 0: shape (3, 4) -> (2, 4), dtype torch.float32 -> torch.float64) compiles again "
        "and keeps both programs; PopTorch would refuse it until destroy()"]
    assert len(infer._programs) == 3
