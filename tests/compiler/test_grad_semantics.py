"""What a forward says about its gradients, and what a call does to its arguments and to the
host model's gradients: plain PyTorch's numbers ([Note: gradients the forward shapes] in
compiler/grad_semantics.py, [Note: edited arguments] in runtime/stage_work.py, [Note: host
gradients] in runtime/weights.py). The matrix over schedules is in test_transparency.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler.partition import partition
from poptorch_lite.strategies import PipelinedExecution

from models import (CallsAModule, microbatch_seeds, on_device, reference_training, thirds_grad,
                    trained_grads, twin)


class Stopped(torch.nn.Module):
    """The issue's model: a Linear(4, 4) whose output is stopped before a second layer."""

    def __init__(self, how: str, blocks: int = 1):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.how, self.blocks = how, blocks

    def forward(self, x, y):
        if self.how == "detach":
            h = self.a(x).detach()
        else:
            with torch.no_grad():
                h = self.a(x)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("how", ["detach", "no_grad"])
@pytest.mark.parametrize("blocks", [1, 2])
def test_a_gradient_stopped_in_forward_leaves_the_layer_before_it_untouched(how, blocks, device):
    torch.manual_seed(0)
    model = Stopped(how, blocks)
    ref = twin(model, device)
    before = model.a.weight.detach().clone()
    opts = on_device(poptorch.Options(), device)
    opts.Training.gradientAccumulation(3 if blocks == 2 else 1)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    train(x, y)
    train.copyWeightsToHost()
    assert torch.equal(model.a.weight, before)  # plain PyTorch leaves it as it was
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    G = 3 if blocks == 2 else 1
    xs, ys = x.to(ref.a.weight.device), y.to(ref.a.weight.device)  # the reference's device
    for k in range(G):
        F.mse_loss(ref.b(ref.a(xs[k * 6 // G:(k + 1) * 6 // G]).detach()),
                   ys[k * 6 // G:(k + 1) * 6 // G]).div(G).backward()
    ref_opt.step()
    assert_close(model.b.weight, ref.b.weight.detach().cpu(), atol=1e-6, rtol=0)
    assert trained_grads(train)["a.weight"] is None


class NoGradInference(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        with torch.no_grad():
            mask = (x.abs() < 1).float() * 2  # from the inputs only: no gradient to stop
            scale = torch.sigmoid(self.a.weight.sum())  # from a weight: stopped
        out = h * mask * scale
        return out, F.mse_loss(out, y)


def test_only_no_grad_ops_whose_values_could_carry_a_gradient_run_without_it():
    """A stage runs an op traced under no_grad without grad where a trainable weight reaches
    it; the mask computed from the inputs alone costs no no_grad context per call."""
    model = NoGradInference()
    part = partition(model, {}, (torch.randn(2, 4), torch.randn(2, 4)), {},
                     PipelinedExecution(), training=True)
    wrapped = [n.target.__name__ for n in part.stages[0].module.graph.nodes
               if n.op == "call_function" and n.target.__name__.startswith("no_grad_")]
    assert wrapped == ["no_grad_aten_sum_default"]  # the sigmoid of its result has no gradient
    inference = partition(model, {}, (torch.randn(2, 4), torch.randn(2, 4)), {},
                          PipelinedExecution(), training=False)
    assert not any(n.op == "call_function" and n.target.__name__.startswith("no_grad_")
                   for n in inference.stages[0].module.graph.nodes)


class GivesAModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        out = CallsAModule.apply(x, self.a)
        return out, F.mse_loss(out, y)


def test_a_custom_function_given_a_module_is_refused_before_any_state_changes():
    """Its node could not hand the Function the stage's weights, only the host module's."""
    model = GivesAModule()
    apply = torch.autograd.Function.__dict__["apply"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = copy.deepcopy(model.state_dict())
    train = poptorch.trainingModel(model, optimizer=opt)
    with pytest.raises(poptorch.TraceError, match=r"the custom autograd Function "
                       r"CallsAModule is given a Linear that holds tensors.*Pass the tensors "
                       r"it needs as arguments of apply\(\)"):
        train(torch.randn(2, 4), torch.randn(2, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.state == {} and model.a.weight.grad is None
    assert torch.autograd.Function.__dict__["apply"] is apply  # torch's own again


class CustomOpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, y):
        h = thirds_grad(torch.relu(self.a(x)))
        poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        return out, F.mse_loss(out, y)


def test_a_custom_op_with_its_own_autograd_stays_one_op_and_trains_as_plain_pytorch():
    """torch.library's register_autograd makes an autograd Function of its own: the trace
    keeps the op (its backward comes with it), in the caller's grad mode."""
    torch.manual_seed(0)
    model = CustomOpNet()
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    train(x, y)
    stage0 = next(iter(train._programs.values())).partition.stages[0].module
    assert [n.target for n in stage0.graph.nodes if n.op == "call_function"][-1] is \
        torch.ops.poptorch_lite_test.thirds_grad.default
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for k in range(3):
        ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])[1].div(3).backward()
    ref_opt.step()
    grads = trained_grads(train)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, atol=1e-6, rtol=0, msg=name)


class HookedEval(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:  # as a training-minded model writes it
            h.register_hook(lambda g: g * 0)
        return torch.relu(h)


def test_a_hook_registered_in_forward_is_no_concern_of_an_inference_model():
    model = HookedEval()
    x = torch.randn(4, 4)
    assert torch.equal(poptorch.inferenceModel(model)(x), model(x).detach())


class EditsItsInput(torch.nn.Module):
    """PopTorch's inplace_test: ``x += 1`` in forward, then ``x * 2``."""

    def __init__(self, training: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.training_model = training

    def forward(self, x):
        x += 1
        out = x * 2 * self.w
        return (out, poptorch.identity_loss(out, "sum")) if self.training_model else out


@pytest.mark.parametrize("training", [False, True])
def test_an_argument_edited_in_place_is_edited_once_per_call(training, device):
    """The trace undoes its own write; the call writes once, from whichever memory the stage
    ran in, micro-batch by micro-batch (PopTorch's test_inplace_add on its first call)."""
    opts = on_device(poptorch.Options().deviceIterations(2), device)
    opts.outputMode(poptorch.OutputMode.All)
    if training:
        opts.deviceIterations(1).Training.gradientAccumulation(2)
    model = EditsItsInput(training)
    wrap = poptorch.trainingModel if training else poptorch.inferenceModel
    wrapped = wrap(model, opts, torch.optim.SGD(model.parameters(), lr=0.0)) if training \
        else wrap(model, opts)
    x = torch.ones(2, 3)
    out = wrapped(x)
    out = out[0] if training else out
    assert torch.equal(x, torch.full((2, 3), 2.0))
    assert torch.equal(out, torch.full((2, 3), 4.0))
    wrapped(x)
    assert torch.equal(x, torch.full((2, 3), 3.0))


class MatmulTraining(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(7, 7)

    def forward(self, x, target):
        out = self.linear(x)
        return out, F.l1_loss(out, target)


def test_a_training_call_leaves_the_host_gradients_as_the_user_left_them(device):
    """PopTorch's test_matmul_training: one optimizer both for the wrapper and for a host
    backward and step after it. The host's .grad holds only the host backward's gradient."""
    torch.manual_seed(0)
    model = MatmulTraining()
    ref = twin(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    train = poptorch.trainingModel(model, on_device(poptorch.Options(), device), opt)
    x, target = torch.randn(4, 7), torch.randn(4, 7)
    for _ in range(3):
        opt.zero_grad()
        train(x, target)
        assert model.linear.weight.grad is None
        model(x, target)[1].backward()
        opt.step()
        for _ in range(2):  # the wrapper's step, then the host's
            ref_opt.zero_grad()
            ref(x, target)[1].backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
    held = torch.full((7, 7), 5.0)
    model.linear.weight.grad = held  # a host gradient the call must neither use nor replace
    train(x, target)
    assert model.linear.weight.grad is held and torch.equal(held, torch.full((7, 7), 5.0))
    ref_opt.zero_grad()
    ref(x, target)[1].backward()
    assert_close(trained_grads(train)["linear.weight"], ref.linear.weight.grad, atol=1e-6,
                 rtol=0)


def test_the_last_steps_gradient_is_read_back_through_its_anchor(device):
    torch.manual_seed(0)
    model = MatmulTraining()
    ref = twin(model)
    opts = on_device(poptorch.Options(), device).anchorTensor("grad", "Gradient___linear.weight")
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, target = torch.randn(4, 7), torch.randn(4, 7)
    train(x, target)
    ref(x, target)[1].backward()
    grad = train.getAnchoredTensor("grad")
    assert grad.device == torch.device("cpu")
    assert_close(grad, ref.linear.weight.grad, atol=1e-6, rtol=0)
    assert model.linear.weight.grad is None


class SplitInside(torch.nn.Module):
    """A module whose forward starts the next block: its input and output in two stages."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        poptorch.Block.start("b1", ipu_id=1)
        return self.b(h)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = SplitInside()

    def forward(self, x, y):
        out = self.inner(x)
        return out, F.mse_loss(out, y)


def test_module_backward_hooks_that_cannot_be_kept_are_refused():
    """[Note: gradients the forward shapes]: the deprecated register_backward_hook sees an
    op's gradients, which the graph does not keep; a module with full backward hooks that
    spans two stages cannot tie its input's hook to its output's within one stage."""
    model = Outer()
    model.inner.register_backward_hook(lambda m, gi, go: None)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with pytest.raises(poptorch.TraceError, match=r"module inner has a hook registered with "
                                                  r"register_backward_hook, which PyTorch "
                                                  r"deprecates"):
        poptorch.trainingModel(model, opts)(x, y)
    model = Outer()
    model.inner.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(poptorch.TraceError, match=r"SplitInside has backward hooks .* its "
                                                  r"forward spans stages 0 and 1"):
        poptorch.trainingModel(model, opts)(x, y)


class Reused(torch.nn.Module):
    """The fuzzer's model: layer ``a`` in block 0 and again in block ``again`` (0: one stage),
    a clamping hook on its bias (registered with ``hook``)."""

    def __init__(self, again: int, hook: bool = True):
        super().__init__()
        self.a, self.b, self.head = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 6),
                                     torch.nn.Linear(6, 4))
        self.again = again
        if hook:
            self.hook()

    def hook(self):
        return self.a.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = torch.tanh(self.a(x))
        if self.again:
            poptorch.Block.start("b1", ipu_id=1)
        h = torch.tanh(self.a(torch.tanh(self.b(h))))
        out = self.head(h)
        return out, F.cross_entropy(out, y)


def _pipelined(device, G=3):
    opts = on_device(poptorch.Options().setExecutionStrategy(PipelinedExecution()), device)
    opts.Training.gradientAccumulation(G)
    return opts.outputMode(poptorch.OutputMode.All)


def _trains_as_plain_pytorch(train, model, ref, ref_opt, x, y, G=3):
    """One call of ``train`` against plain PyTorch's G micro-batches and step: outputs,
    losses, the gradients the step used and the weights."""
    out, loss = train(x, y)
    ref_outs, ref_losses = [], []
    ref_opt.zero_grad()
    b = len(x) // G
    for k in range(G):
        o, l = ref(x[b * k:b * (k + 1)].to(ref.a.weight.device),
                   y[b * k:b * (k + 1)].to(ref.a.weight.device))
        l.backward()  # the hook sees each micro-batch's gradient, then the mean is taken
        ref_outs.append(o.detach().cpu())
        ref_losses.append(l.detach().cpu())
    for p in ref.parameters():
        p.grad.div_(G)
    ref_opt.step()
    assert_close(out, torch.cat(ref_outs), atol=1e-6, rtol=0)
    assert_close(loss, torch.stack(ref_losses), atol=1e-6, rtol=0)
    for name, g in trained_grads(train).items():
        assert_close(g, ref.get_parameter(name).grad.cpu(), atol=1e-6, rtol=0, msg=name)
    for name, p in model.named_parameters():
        assert_close(p.detach(), ref.get_parameter(name).detach().cpu(), atol=1e-6, rtol=0,
                     msg=name)


def test_a_parameter_hook_in_one_stage_sees_the_sum_of_its_uses(device):
    """A parameter used twice in one stage: autograd sums its two parts before the hook, as
    in plain PyTorch (once per micro-batch), so a clamp of the sum is plain PyTorch's."""
    torch.manual_seed(0)
    model = Reused(again=0, hook=False)
    ref = twin(model, device)
    model.hook(), ref.hook()  # a deep copy keeps no parameter hook
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, _pipelined(device), opt)
    for call in range(2):
        _trains_as_plain_pytorch(train, model, ref, ref_opt, torch.randn(6, 6),
                                 torch.randint(0, 4, (6,)))
    train.destroy()


def test_a_parameter_hook_where_two_stages_use_the_parameter_is_refused_before_any_state_changes(
        device):
    """Each stage's backward computes its own part of a parameter's gradient, so a hook on it
    would run on each part, where plain PyTorch runs it once on their sum (a clamp of each
    part, not of the sum): refused before anything runs, naming the parameter, the stages and
    the fix, at a call after the hook was registered and at the first call of a model hooked
    when wrapped (E-PART-27); without the hook the same model trains as plain PyTorch."""
    torch.manual_seed(0)
    model = Reused(again=1, hook=False)
    ref = twin(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, _pipelined(device), opt)
    for call in range(3):
        x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
        if call == 1:  # registered between calls: refused at the next one
            handle = model.hook()
            before = copy.deepcopy((model.state_dict(), opt.state_dict()))
            with pytest.raises(poptorch.BlockError) as refused:
                train(x, y)
            assert str(refused.value) == (
                "parameter 'a.bias' has a gradient hook (register_hook) and stages 0 (block "
                "'b0') and 1 (block 'b1') use it: each stage's backward computes its own part "
                "of the parameter's gradient, so the hook would run on each part (2 times a "
                "micro-batch), where plain PyTorch runs it once on their sum. Put every use of "
                "'a.bias' in one stage (one block), or remove the hook")
            for k, v in before[0].items():
                assert torch.equal(model.state_dict()[k], v), k
            for k, s in before[1]["state"].items():
                assert torch.equal(opt.state_dict()["state"][k]["momentum_buffer"],
                                   s["momentum_buffer"])
            handle.remove()
        _trains_as_plain_pytorch(train, model, ref, ref_opt, x, y)
    train.destroy()
    fresh = Reused(again=1)  # hooked when wrapped: its first call is refused
    wrapped = poptorch.trainingModel(fresh, _pipelined(device),
                                     torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(poptorch.BlockError, match="parameter 'a.bias' has a gradient hook"):
        wrapped(torch.randn(6, 6), torch.randint(0, 4, (6,)))
    wrapped.destroy()


class InPlaceFeedForward(torch.nn.Module):
    """Conformer's feed-forward ([Note: writes to activations]): a dropout in place on a
    ReLU's output, which plain PyTorch's backward refuses (the ReLU saved it); ``inplace``
    False is the same arithmetic, which it runs."""

    def __init__(self, inplace=True):
        super().__init__()
        self.w1, self.w2, self.head = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 8),
                                       torch.nn.Linear(8, 4))
        self.drop = torch.nn.Dropout(0.25, inplace=inplace)
        poptorch.BeginBlock(self.head, ipu_id=1)

    def forward(self, x, y):
        h = self.w1(x)
        h.mul_(0.5)  # a write to an activation whose backward needs nothing of it
        out = self.head(self.w2(self.drop(torch.relu(h))))
        return out, F.cross_entropy(out, y)


def test_a_write_in_place_to_a_saved_activation_trains_as_the_same_arithmetic_out_of_place():
    torch.manual_seed(0)
    net, plain = InPlaceFeedForward(), InPlaceFeedForward(inplace=False)
    plain.load_state_dict(net.state_dict())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        net(torch.randn(2, 8), torch.tensor([0, 1]))[1].backward()  # plain PyTorch refuses
    G = 4
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * G, 8, generator=g), torch.randint(0, 4, (2 * G,), generator=g)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    train = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.5))
    torch.manual_seed(7)
    out, loss = train(x, y)
    torch.manual_seed(7)
    outs, losses, _ = reference_training(plain, torch.optim.SGD(plain.parameters(), lr=0.5),
                                         x, y, 1, G, 1, seeds=microbatch_seeds(1, G))
    assert_close(loss, losses[-1], rtol=0, atol=0)
    assert_close(out, outs[-1], rtol=0, atol=0)
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        assert_close(p, q, rtol=0, atol=0, msg=name)
    train.destroy()
