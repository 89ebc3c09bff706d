"""What Graphcore's applications use of PopTorch: anchored tensors, BeginBlock's keyword,
copies of frozen options; each against plain PyTorch or PopTorch's documented behaviour."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite import errors

from models import data, on_device, reference_training, twin


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, y):
        self.seen += 1
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, F.cross_entropy(out, y)


# -- anchorTensor / getAnchoredTensor / getTensorNames ----------------------------------------

def test_tensor_names_are_poptorchs_names_of_the_weights(device):
    model = TwoLayers()
    train = poptorch.trainingModel(model, on_device(poptorch.Options(), device),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(errors.DeviceError, match="has not been compiled"):
        train.getTensorNames()  # PopTorch: the model must be compiled first
    train.compile(*data(2, width=4, classes=2))
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert train.getTensorNames() == (params + ["seen"] + [f"Gradient___{n}" for n in params]
                                      + [f"UpdatedVar___{n}" for n in params])
    infer = poptorch.inferenceModel(TwoLayers(), on_device(poptorch.Options(), device))
    infer.compile(*data(2, width=4, classes=2))
    assert infer.getTensorNames() == params + ["seen"]


def test_anchored_gradients_and_weights_are_plain_pytorchs_after_each_call(device):
    torch.manual_seed(0)
    model, G, D = TwoLayers(), 2, 2
    ref = twin(model)
    opts = on_device(poptorch.Options().deviceIterations(D), device)
    opts.Training.gradientAccumulation(G)
    opts.anchorTensor("grad_bias", "Gradient___fc2.bias")
    opts.anchorTensor("grad_w", "Gradient___fc1.weight", poptorch.OutputMode.Final)
    opts.anchorTensor("updated", "UpdatedVar___fc2.weight")
    opts.anchorTensor("weight", "fc1.bias")
    opts.anchorTensor("buffer", "seen")
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1,
                                                                momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for call in range(2):
        x, y = data(2 * G * D, width=4, classes=2, seed=call)
        train(x, y)
        _, _, grads = reference_training(ref, ref_opt, x, y, D, G, 1)
        assert_close(train.getAnchoredTensor("grad_bias"), grads["fc2.bias"], atol=1e-5, rtol=0)
        assert_close(train.getAnchoredTensor("grad_w"), grads["fc1.weight"], atol=1e-5, rtol=0)
        assert_close(train.getAnchoredTensor("updated"), ref.fc2.weight.detach(), atol=1e-5,
                     rtol=0)
        assert_close(train.getAnchoredTensor("weight"), ref.fc1.bias.detach(), atol=1e-5, rtol=0)
        assert train.getAnchoredTensor("buffer") == ref.seen
    with pytest.raises(errors.DeviceError, match="no tensor was anchored as 'nope'"):
        train.getAnchoredTensor("nope")


def test_trace_model_gives_the_names_before_poptorch_3_as_sdk2_programs_anchor_them():
    """``Jit.traceModel(True)`` ([Note: anchored tensors]): MAE's alignment script keeps the
    names of ``getTensorNames()`` that are ``Gradient___model.<param>``, and anchors them; with
    PopTorch 3's names that would be none, and its comparison would check nothing."""
    torch.manual_seed(0)
    model = TwoLayers()
    ref = twin(model)
    opts = poptorch.Options().anchorTensor("grad", "Gradient___model.fc2.bias")
    opts.anchorTensor("updated", "UpdatedVar___model.fc1.weight")
    with pytest.warns(errors.PoptorchLiteWarning, match="traceModel.True. is deprecated"):
        opts.Jit.traceModel(True)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(2, width=4, classes=2)
    train(x, y)
    names = train.getTensorNames()
    assert names[:5] == ["model.fc1.weight", "model.fc1.bias", "model.fc2.weight",
                         "model.fc2.bias", "model.seen"]
    assert "Gradient___model.fc1.weight" in names and "Gradient___fc1.weight" not in names
    _, _, grads = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                                     1, 1, 1)
    assert_close(train.getAnchoredTensor("grad"), grads["fc2.bias"], atol=0, rtol=0)
    assert_close(train.getAnchoredTensor("updated"), ref.fc1.weight.detach(), atol=0, rtol=0)
    train.destroy()
    plain = poptorch.Options().anchorTensor("grad", "Gradient___model.fc2.bias")
    with pytest.raises(errors.OptionsError, match="no tensor named 'Gradient___model.fc2.bias'"):
        poptorch.trainingModel(TwoLayers(), plain, torch.optim.SGD(model.parameters()))(x, y)


def test_an_anchored_gradient_of_a_layer_frozen_between_calls_is_none_while_frozen(device):
    """Freezing compiles again ([Note: trainable parameters] in runtime/compiled.py) with the
    anchors checked when the model first compiled: the frozen weight's gradient reads None,
    as its ``.grad`` in plain PyTorch, and again the step's once unfrozen."""
    torch.manual_seed(0)
    model = TwoLayers()
    ref = twin(model)
    opts = on_device(poptorch.Options(), device).anchorTensor("grad_w", "Gradient___fc1.weight")
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for call, trainable in enumerate([True, False, True]):
        model.fc1.requires_grad_(trainable)
        ref.fc1.requires_grad_(trainable)
        x, y = data(2, width=4, classes=2, seed=call)
        train(x, y)
        _, _, grads = reference_training(ref, ref_opt, x, y, 1, 1, 1)
        if trainable:
            assert_close(train.getAnchoredTensor("grad_w"), grads["fc1.weight"], atol=1e-5,
                         rtol=0)
        else:
            assert train.getAnchoredTensor("grad_w") is None and grads["fc1.weight"] is None
    assert len(train._programs) == 2
    train.destroy()


@pytest.mark.parametrize("name, mode, match", [
    ("MatMul:0", None, "no tensor named 'MatMul:0'"),
    ("Gradient___fc9.bias", None, "no tensor named"),
    ("fc1.bias", poptorch.OutputMode.All, "only the value after the call"),
])
def test_anchors_that_name_no_tensor_or_ask_per_step_values_are_refused_before_running(
        name, mode, match):
    model = TwoLayers()
    before = copy.deepcopy(model.state_dict())
    opts = poptorch.Options()
    opts.anchorTensor("a", name, mode)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(errors.OptionsError, match=match):
        train(*data(2, width=4, classes=2))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- BeginBlock(layer_to_call=...) ----------------------------------------------------------------

def test_begin_block_takes_poptorchs_keyword_and_trains_like_plain_pytorch():
    torch.manual_seed(0)
    model = TwoLayers()
    ref = twin(model)
    model.fc2 = poptorch.BeginBlock(layer_to_call=model.fc2, user_id="second", ipu_id=1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    x, y = data(6, width=4, classes=2)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = train(x, y)
    assert train._programs and next(iter(train._programs.values())).partition.num_stages == 2
    _, ref_losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                          x, y, 1, 3, 1)
    assert_close(loss, ref_losses[-1], atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, rtol=0)
    train.destroy()  # its stream workers exit now, not at the next garbage collection


# -- copy.deepcopy of frozen Options ---------------------------------------------------------------

def test_a_deep_copy_of_frozen_options_is_an_unfrozen_copy():
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    poptorch.trainingModel(TwoLayers(), opts)
    assert opts.is_frozen
    twin_opts = copy.deepcopy(opts)
    assert not twin_opts.is_frozen and not twin_opts.Training.is_frozen
    assert (twin_opts.device_iterations, twin_opts.Training.gradient_accumulation) == (3, 2)
    twin_opts.deviceIterations(5).Training.gradientAccumulation(4)
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 2)
    with pytest.raises(errors.FrozenOptionsError):
        opts.deviceIterations(4)
