"""PopTorch's private PoplarExecutor attributes that integrations read ([Note: private
attributes] in wrapper_private), and Lightning's IPUStrategy making its calls on them in its
order, without Lightning (tests/programs/test_lightning.py runs the real one where it is
installed)."""

import copy

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.wrapper_private import REFUSED

from models import BlockMLP, data, reference_training

ATOL = 1e-5


class LightningWrapper(torch.nn.Module):
    """As lightning-graphcore's ``_LightningModuleWrapperBase``: the module both wrappers wrap."""

    def __init__(self, module):
        super().__init__()
        self._forward_module = module

    def forward(self, x, y):
        return self._forward_module(x, y)


class IPUStrategyCalls:
    """lightning-graphcore 0.1.0's IPUStrategy (``strategy.py``): its PopTorch calls, verbatim,
    in the order Lightning 2.0.9's fit loop makes them."""

    def __init__(self, module, optimizer, training_opts, inference_opts):
        self.model, self.optimizer = LightningWrapper(module), optimizer
        self.training_opts, self.inference_opts = training_opts, inference_opts
        self.poptorch_models = {}

    def setup(self, fn):
        if fn == "fit":
            model = poptorch.trainingModel(model=self.model, options=self.training_opts,
                                           optimizer=self.optimizer)
            self.poptorch_models["train"] = model
            model = poptorch.inferenceModel(model=self.model, options=self.inference_opts)
            self.poptorch_models["validate"] = model
            self.poptorch_models["sanity_check"] = model
        else:
            self.poptorch_models[fn] = poptorch.inferenceModel(model=self.model,
                                                               options=self.inference_opts)

    def replication_factor(self, stage):
        return self.poptorch_models[stage]._options.toDict()["replication_factor"]

    def _compiled(self, model):
        return model._executable is not None

    def _detach_models(self):
        for model in self.poptorch_models.values():
            if self._compiled(model) and model.isAttachedToDevice():
                model.detachFromDevice()

    def _load_model(self, stage):
        self._detach_models()
        model = self.poptorch_models[stage]
        if self._compiled(model) and not model.isAttachedToDevice():
            model.attachToDevice()

    def on_train_batch_start(self):
        self.poptorch_models["train"].setOptimizer(self.optimizer)

    def teardown(self):
        for model in self.poptorch_models.values():
            model.destroy()

    def evaluate(self, stage, batches):
        """A validation loop: ``on_validation_start``, the steps, ``on_validation_end``."""
        self._load_model("validate" if stage == "sanity_check" else stage)
        outputs = [self.poptorch_models[stage](x, y) for x, y in batches]
        self._detach_models()
        return outputs

    def fit(self, train, val, epochs, scheduler):
        """Lightning's fit: the sanity check, then each epoch's training and validation, the
        scheduler stepped after each epoch's validation; the models torn down at the end."""
        self.setup("fit")
        assert self.replication_factor("train") == 1
        self.evaluate("sanity_check", val[:2])
        self._load_model("train")  # on_train_start
        for _ in range(epochs):
            for x, y in train:
                self.on_train_batch_start()
                self.poptorch_models["train"](x, y)
            self.evaluate("validate", val)
            scheduler.step()
        self._detach_models()  # on_train_end
        self.teardown()


def batches(x, y, rows):
    return [(x[i:i + rows], y[i:i + rows]) for i in range(0, len(x), rows)]


@pytest.mark.parametrize("blocks", [1, 2])
def test_ipu_strategy_calls_train_and_evaluate_like_plain_pytorch(blocks):
    """IPUStrategy's fit, then validate, on a 1-device and a 2-stage model, against plain
    PyTorch on the same combined batches: the weights after each epoch's steps (an LR
    schedule set on ``_optimizer``, as Graphcore's yolo_v4 does) and every validation output."""
    G, D = (3, 2) if blocks == 2 else (1, 1)
    B, epochs = 2, 2
    training_opts = poptorch.Options()
    training_opts.Training.gradientAccumulation(G)
    inference_opts = poptorch.Options().deviceIterations(D)
    torch.manual_seed(0)
    module = BlockMLP(blocks)
    plain = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy = IPUStrategyCalls(module, optimizer, training_opts, inference_opts)
    x, y = data(B * G * 4)
    vx, vy = data(B * D * 3, seed=2)
    train, val = batches(x, y, B * G), batches(vx, vy, B * D)

    strategy.setup("fit")  # the scheduler is made on the wrapper's optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(strategy.poptorch_models["train"]._optimizer, 1, 0.5)
    strategy.teardown()
    strategy.poptorch_models = {}
    strategy.fit(train, val, epochs, scheduler)

    ref_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, 1, 0.5)
    for _ in range(epochs):
        for bx, by in train:
            reference_training(plain, ref_optimizer, bx, by, 1, G, 1)
        ref_scheduler.step()
    for p, q in zip(module.parameters(), plain.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0)

    strategy.setup("validate")  # Trainer.validate: a model of its own, torn down after
    outputs = strategy.evaluate("validate", val)
    strategy.teardown()
    with torch.no_grad():
        for (out, loss), (bx, by) in zip(outputs, val):
            ref = [plain(bx[k * B:(k + 1) * B], by[k * B:(k + 1) * B]) for k in range(D)]
            assert_close(out, torch.cat([o for o, _ in ref]), atol=ATOL, rtol=0)
            assert_close(loss.reshape(-1), torch.stack([l for _, l in ref]), atol=ATOL, rtol=0)


def test_executable_is_none_until_compiled_and_after_destroy():
    """PopTorch's ``isCompiled()`` is ``bool(self._executable)``; ``destroy()`` drops it."""
    model = poptorch.inferenceModel(torch.nn.Linear(2, 1))
    assert model._executable is None and not model.isCompiled()
    model.compile(torch.ones(3, 2))
    assert model._executable is not None and bool(model._executable) and model.isCompiled()
    model.detachFromDevice()
    assert model._executable is not None  # compiled, detached: attach again
    model.attachToDevice()
    model.destroy()
    assert model._executable is None and not model.isCompiled()
    with pytest.raises(TypeError):
        model._executable["x"] = 1  # read-only


def test_executable_inputs_are_the_compiling_call_in_forward_order():
    """As PopTorch's ``ArgsParser.Args``: keyword arguments take their place in ``forward``'s
    order, defaults are filled in; optimum-graphcore's pipelines read the compiled batch size
    off the first tensor of ``.args``."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)

        def forward(self, x, mask=None, scale=2.0):
            return self.fc(x) * scale

    model = poptorch.inferenceModel(Net(), poptorch.Options().deviceIterations(2))
    assert model._executable_inputs is None
    x = torch.ones(4, 2)
    model(scale=3.0, x=x)
    inputs = model._executable_inputs
    assert inputs.arg_names == ["x", "mask", "scale"] and inputs.kwargs == {}
    assert inputs.args[0] is x and inputs.args[1:] == [None, 3.0]
    assert inputs.args[0].shape[0] == 4  # the combined batch, as PopTorch keeps it
    model(torch.ones(6, 2))  # a new signature compiles again
    assert model._executable_inputs.args[0].shape[0] == 6


def test_the_model_options_training_optimizer_and_attachment():
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    opts = poptorch.Options().replicationFactor(1)
    training = poptorch.trainingModel(net, opts, optimizer)
    assert training._user_model is net and training._model is net and training.model is net
    assert training._options is training.options and training._options is not opts
    assert training._options.toDict()["replication_factor"] == 1
    assert training._training is True and training._optimizer is optimizer
    assert training._is_attached is False
    inference = poptorch.inferenceModel(training)  # PopTorch reads the wrapper's _user_model
    assert inference._user_model is net and inference._training is False
    inference(torch.ones(1, 2))
    assert inference._is_attached is True and inference.isAttachedToDevice()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_popTorch_machinery_is_refused_with_the_public_way(name):
    model = poptorch.inferenceModel(torch.nn.Linear(2, 1))
    with pytest.raises(poptorch.Error, match=rf"PoplarExecutor\.{name} is PopTorch's internal "
                                             rf"state.*; use .+ instead") as info:
        getattr(model, name)
    assert isinstance(info.value, AttributeError)
    assert not hasattr(model, name)


def test_other_private_names_are_read_from_the_user_model_as_popTorch_does():
    net = LightningWrapper(torch.nn.Linear(2, 1))
    model = poptorch.inferenceModel(net)
    assert model._forward_module is net._forward_module
    assert model._parameters is net._parameters
    with pytest.raises(AttributeError):
        model._nothing_of_that_name
    with pytest.raises(AttributeError):
        model.__wrapped__  # dunder names are not delegated
    copy.copy(model)  # copying an object that is being built reads no attribute of the model
