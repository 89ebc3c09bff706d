"""The model's Python side between calls: attributes the forward reads or changes, and the
objects the programs compile with ([Note: Python attributes of the model] in
compiler/python_attributes.py, [Note: attributes the forward reads] in runtime/compiled.py,
[Note: objects the programs compile with] in runtime/host_sync.py)."""

from __future__ import annotations

import copy
import logging
import pathlib
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler.python_attributes import Hooks

from models import data, microbatch_seeds, on_device, reference_training, trained_grads, twin

ATOL = 1e-5
ROWS = [(1, 2), (2, 3)]  # blocks, G: one stage, and a pipeline of two


class Annealed(torch.nn.Module):
    """Two Linear layers in 1 or 2 blocks: the input scaled by a buffer, the first layer's
    output divided by ``temperature`` (a Python attribute a user anneals between calls) and,
    with ``counts``, scaled by ``1 + 0.1 * steps``, a counter the forward itself increments."""

    def __init__(self, blocks: int, counts: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(8))
        self.blocks, self.counts = blocks, counts
        self.temperature, self.steps = 1.0, 0

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = torch.relu(self.a(x * self.scale)) / self.temperature
        if self.counts:
            self.steps += 1
        h = h * (1 + 0.1 * self.steps)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        return out, F.cross_entropy(out, y)


def options(blocks: int, G: int, device: str) -> poptorch.Options:
    opts = on_device(poptorch.Options(), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(G)
    return opts.outputMode(poptorch.OutputMode.All)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def calls_like_plain_pytorch(model, ref, blocks: int, G: int, device: str, calls: int = 3,
                             edit=lambda m, call: None):
    """``calls`` calls of ``model`` wrapped beside plain PyTorch's loop on ``ref``, with
    ``edit(m, call)`` applied to both after each: outputs, losses, the gradients the steps
    used, weights, buffers and optimizer state agree. Returns the wrapper (not destroyed)."""
    opt, ref_opt = sgd(model), sgd(ref)
    train = poptorch.trainingModel(model, options(blocks, G, device), opt)
    for call in range(calls):
        x, y = data(2 * G, seed=call)
        out, loss = train(x, y)
        outs, losses, grads = reference_training(ref, ref_opt, x, y, 1, G, 1)
        where = f"call {call}"
        assert_close(out, torch.cat(outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(losses), atol=ATOL, rtol=0, msg=where)
        for name, g in trained_grads(train).items():
            assert_close(g, grads[name], atol=ATOL, rtol=0, msg=f"grad of {name}, {where}")
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")
        for a, b in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
            assert_close(a["momentum_buffer"], b["momentum_buffer"].cpu(), atol=ATOL, rtol=0)
        edit(model, call)
        edit(ref, call)
    return train


def _line(code: str) -> str:
    lines = pathlib.Path(__file__).read_text().splitlines()
    return f"{__file__}:{lines.index(code) + 1}: {code.strip()}"


# -- an attribute the forward changes: warned of, put back --------------------------------

@pytest.mark.parametrize("blocks, G", ROWS)
def test_an_attribute_the_forward_changes_is_warned_of_at_its_line_and_put_back(blocks, G,
                                                                                device):
    """PopTorch's semantics: the counter's Python runs once, at the trace, so every
    micro-batch and call computes with its value then (1), as plain PyTorch with the counter
    fixed at 1 does; the warning names the attribute and its line, the attribute is as the
    user left it (0), and it keys no program (three calls, one program)."""
    torch.manual_seed(0)
    model = Annealed(blocks, counts=True)
    ref = twin(model, device)
    ref.counts, ref.steps = False, 1
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "the forward changes the Python attribute model.steps (0 -> 1) at "
            + _line("            self.steps += 1"))) as warned:
        train = calls_like_plain_pytorch(model, ref, blocks, G, device)
    assert "every micro-batch and every call computes with the value of the trace" in str(
        warned[0].message)
    assert model.steps == 0
    assert len(train._programs) == 1
    program = next(iter(train._programs.values()))
    assert [a for a, _, _ in program.partition.reads.attributes()] == [
        "model.blocks", "model.counts", "model.temperature"]
    train.destroy()


def test_a_refused_trace_puts_an_attribute_back_without_a_warning():
    class Refused(Annealed):
        def forward(self, x, y):
            out, loss = super().forward(x, y)
            return out * out.sum().item(), loss

    model = Refused(1, counts=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", poptorch.PoptorchLiteWarning)
        with pytest.raises(poptorch.TraceError, match="reads a tensor's value into Python"):
            poptorch.trainingModel(model)(*data(2))
    assert model.steps == 0


def test_an_attribute_made_by_the_forward_is_removed_again():
    class Makes(Annealed):
        def forward(self, x, y):
            self.seen = x.shape[0]
            return super().forward(x, y)

    model = Makes(1)
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "model.seen ((none) -> 2)")):
        train = poptorch.trainingModel(model)
        train(*data(2))
    assert "seen" not in vars(model)
    train.destroy()


# -- an attribute the forward reads, changed between calls: traced again ------------------

def _anneal(model, call):
    model.temperature = [2.0, 1.0][call] if call < 2 else model.temperature


@pytest.mark.parametrize("blocks, G", ROWS)
def test_an_attribute_the_forward_reads_changed_between_calls_trains_as_plain_pytorch(
        blocks, G, device, caplog):
    """``model.temperature = 2.0`` between calls: the next call computes with 2.0, as plain
    PyTorch does (traced again, logged); back to 1.0, the first program is used again."""
    torch.manual_seed(0)
    model = Annealed(blocks)
    ref = twin(model, device)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    train = calls_like_plain_pytorch(model, ref, blocks, G, device, edit=_anneal)
    assert "attributes the forward reads changed since it was traced (model.temperature: " \
           "1.0 -> 2.0): compiles again for them and keeps the other program" in caplog.text
    assert len(train._programs) == 2
    assert caplog.text.count("trainingModel compiled") == 2
    train.destroy()


class Masked(Annealed):
    """:class:`Annealed` whose first layer's output is multiplied by ``mask``, a tensor kept
    as a plain attribute (not a buffer), as user code often keeps one."""

    def __init__(self, blocks: int):
        super().__init__(blocks)
        self.mask = torch.ones(8)

    def forward(self, x, y):
        return super().forward(x * self.mask, y)


def _new_mask(model, call):
    if call == 0:
        model.mask = torch.tensor([1.0, 0.0] * 4)  # another tensor
    elif call == 1:
        model.mask.mul_(0.5)  # the same tensor, edited in place


@pytest.mark.parametrize("blocks, G", ROWS)
def test_a_tensor_attribute_replaced_or_edited_between_calls_trains_as_plain_pytorch(
        blocks, G, device, caplog):
    """A tensor kept as a plain attribute, replaced by another between calls, then edited in
    place: each next call computes with it as it is, as plain PyTorch does (traced again,
    logged: a stage on a GPU holds a copy made when it compiled)."""
    torch.manual_seed(0)
    model = Masked(blocks)
    ref = twin(model, device)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    train = calls_like_plain_pytorch(model, ref, blocks, G, device, edit=_new_mask)
    for change in ("another tensor of shape (8,)", "the same tensor, edited in place"):
        assert f"attributes the forward reads changed since it was traced (model.mask: a " \
               f"tensor of shape (8,) -> {change})" in caplog.text
    assert caplog.text.count("trainingModel compiled") == 3
    train.destroy()


def test_a_tensor_attribute_made_in_inference_mode_is_read_as_any_other():
    """A tensor made under ``torch.inference_mode()`` keeps no version counter: the key holds
    it by identity alone (the trace read its version, and failed), and the calls train as
    plain PyTorch's."""
    torch.manual_seed(0)
    model = Masked(1)
    with torch.inference_mode():
        model.mask = torch.linspace(0.5, 1.5, 8)
    ref = twin(model, "cpu")
    calls_like_plain_pytorch(model, ref, 1, 2, "cpu").destroy()


class Counting(Annealed):
    """:class:`Annealed` scaled by ``1 + 0.1 * count``, a tensor kept as a plain attribute
    that the forward adds one to in place."""

    def __init__(self, blocks: int):
        super().__init__(blocks)
        self.count = torch.zeros(())

    def forward(self, x, y):
        self.count.add_(1)
        return super().forward(x * (1 + 0.1 * self.count), y)


@pytest.mark.parametrize("device", ["cpu", "ipu_model"])
@pytest.mark.parametrize("blocks, G", ROWS)
def test_a_tensor_attribute_the_forward_writes_counts_each_forward_once(blocks, G, device,
                                                                        caplog):
    """The trace puts back what the forward wrote into a tensor kept as a plain attribute,
    as it does a buffer's: each micro-batch's forward adds its one, as in plain PyTorch
    (the trace's own add stayed before), and the write keys nothing (one trace)."""
    torch.manual_seed(0)
    model = Counting(blocks)
    ref = twin(model, device)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    train = calls_like_plain_pytorch(model, ref, blocks, G, device)
    assert float(model.count) == float(ref.count) == 3 * G
    assert caplog.text.count("trainingModel compiled") == 1
    train.destroy()


class CountedAcross(Counting):
    """:class:`Counting` whose second block reads the count too."""

    def forward(self, x, y):
        out, loss = super().forward(x, y)
        return out, loss * self.count


@pytest.mark.parametrize("how, why", [
    ("recompute", "the stage is recomputed, which would write it again"),
    ("compiled", "the stage is compiled (compileStages), which keeps no such write"),
    ("across", "a later stage reads it as it is, which a pipeline runs out of step")])
def test_a_tensor_attribute_the_forward_writes_is_refused_where_the_write_would_differ(
        how, why, every_stage_compiles):
    """E-PART-28 at the first call, before anything changes: a tensor kept as a plain
    attribute that the forward writes, in a recomputed or compiled stage, or read as it is by
    a later stage of a pipeline (the value it sent was the tensor itself, which the next
    micro-batch's write changed before that stage read it: the loss was off)."""
    torch.manual_seed(0)
    model = CountedAcross(2) if how == "across" else Counting(2)
    opts = options(2, 3, "cpu")
    if how == "recompute":
        opts._Popart.set("autoRecomputation", 3)
    elif how == "compiled":
        opts.compileStages(True, "aot_eager")
    train = poptorch.trainingModel(model, opts, sgd(model))
    before = copy.deepcopy(model.state_dict())
    x, y = data(6)
    with pytest.raises(poptorch.TraceError, match=re.escape(why)):
        train(x, y)
    assert float(model.count) == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    train.destroy()


class Hooked(Annealed):
    """:class:`Annealed` whose first layer's output goes through ``act``, a function kept as
    a plain attribute (``self.act = torch.tanh``), as user code often keeps one."""

    def __init__(self, blocks: int):
        super().__init__(blocks)
        self.act = torch.tanh

    def forward(self, x, y):
        return super().forward(self.act(x), y)


def _rehook(model, call):
    """Between calls: a forward hook registered, then removed with a forward patched onto
    the last layer and the activation replaced, then the layer's own forward again."""
    if call == 0:
        model.handle = model.a.register_forward_hook(lambda m, i, o: o * 2)
    elif call == 1:
        model.handle.remove()
        model.b.forward = lambda t, m=model.b: F.linear(t, m.weight) * 0.5
        model.act = torch.sigmoid
    elif call == 2:
        del model.b.forward


@pytest.mark.parametrize("blocks, G", ROWS)
def test_hooks_and_functions_changed_between_calls_train_as_plain_pytorch(blocks, G, device,
                                                                          caplog):
    """A forward hook registered, then removed; a forward patched onto a layer, then taken
    off; a function kept as an attribute replaced: each next call computes as plain
    PyTorch's forward does (traced again, logged), and a return finds the kept program."""
    torch.manual_seed(0)
    model = Hooked(blocks)
    ref = twin(model, device)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    train = calls_like_plain_pytorch(model, ref, blocks, G, device, calls=4, edit=_rehook)
    for change in ("model.a.forward_hooks: 0 hooks -> 1 hook",
                   "model.a.forward_hooks: 1 hook -> 0 hooks",
                   "model.b.forward: its class's -> its own",
                   "model.act: <built-in method tanh",
                   "model.b.forward: its own -> its class's"):
        assert change in caplog.text
    assert caplog.text.count("trainingModel compiled") == 4
    train.destroy()


def test_what_the_hook_tables_are_compared_by():
    """By the handles they hold (a registration anywhere, a tensor's too, only makes the
    check look), and whether each module has a forward of its own."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    names = {m: n for n, m in model.named_modules()}
    hooks = Hooks(names)
    torch.ones(1, requires_grad=True).register_hook(lambda g: g)
    assert hooks.same()
    handle = model[0].register_forward_hook(lambda *_: None)
    assert not hooks.same()
    assert hooks.changed() == [("model.0.forward_hooks", "0 hooks", "1 hook")]
    handle.remove()
    assert hooks.same()
    first = model[0].register_forward_pre_hook(lambda *_: None)
    hooks = Hooks(names)
    first.remove()
    second = model[0].register_forward_pre_hook(lambda *_: None)  # as many, another
    assert not hooks.same()
    assert hooks.changed() == [("model.0.forward_pre_hooks", "1 hook", "1 other")]
    second.remove()
    hooks = Hooks(names)
    model[0].forward = lambda t: t
    assert not hooks.same()
    assert hooks.changed() == [("model.0.forward", "its class's", "its own")]
    del model[0].forward
    assert hooks.same()


def test_hooks_registered_and_removed_elsewhere_do_not_trace_again(caplog):
    """A hook on a tensor, or on a module of another model, numbers a registration too:
    the tables the model's forward reads are compared, found unchanged, and nothing traces."""
    torch.manual_seed(0)
    model, other = Hooked(1), torch.nn.Linear(2, 2)
    train = poptorch.trainingModel(model)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    for _ in range(3):
        train(*data(2))
        other.register_forward_hook(lambda *_: None).remove()
        torch.ones(1, requires_grad=True).register_hook(lambda g: g)
    assert caplog.text.count("trainingModel compiled") == 1
    assert len(train._programs) == 1
    train.destroy()


def test_hooks_changed_at_every_call_keep_four_programs_and_are_warned_of():
    """A new forward hook at every call traces again each time; the programs of the last four
    are kept, and a warning says so, suggesting one hook that reads a flag (not a buffer)."""
    torch.manual_seed(0)
    model = Hooked(1)
    ref = twin(model)

    def rehook(m, call):
        if call < 5:
            old = getattr(m, "handle", None)
            if old is not None:
                old.remove()
            m.handle = m.a.register_forward_hook(lambda mod, i, o, k=call: o * (1 + 0.1 * k))
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "the hooks of model.a.forward_hooks have changed 4 times since the model was first "
            "traced")):
        train = calls_like_plain_pytorch(model, ref, 1, 2, "cpu", calls=6, edit=rehook)
    assert len(train._programs) == 4
    train.destroy()


def test_an_attribute_changed_at_every_call_keeps_four_programs_and_is_warned_of():
    """Each new value traces again; the programs of the last four values are kept (a
    return to an older one traces again, exactly), and a warning suggests a buffer."""
    torch.manual_seed(0)
    model = Annealed(1)
    ref = twin(model)
    values = [2.0, 3.0, 4.0, 5.0, 6.0, 1.0]
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "model.temperature, which the forward reads, has had 5 values")):
        train = calls_like_plain_pytorch(model, ref, 1, 2, "cpu", calls=7, edit=lambda m, c: (
            setattr(m, "temperature", values[c]) if c < len(values) else None))
    assert len(train._programs) == 4
    train.destroy()


def test_what_an_attribute_is_compared_by():
    """By type and value: 1 is not 1.0 (a program each), NaN is itself (one program)."""
    torch.manual_seed(0)
    model = Annealed(1)
    train = poptorch.trainingModel(model)
    for t in (1.0, 1, 1.0, float("nan")):
        model.temperature = t
        train(*data(2))
        train(*data(2))
    assert len(train._programs) == 3
    train.destroy()


# -- the objects the programs compile with: a replaced one is refused ---------------------

def _replace(model, what):
    if what == "parameter":
        model.a.weight = torch.nn.Parameter(model.a.weight.detach() * 0.5)
    elif what == "buffer":
        model.scale = torch.full((8,), 0.5)
    elif what == "submodule":
        model.a = torch.nn.Linear(8, 8)
    else:  # a parameter loaded by assignment
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()}, assign=True)


@pytest.mark.parametrize("what, named", [("parameter", "parameter 'a.weight'"),
                                         ("buffer", "buffer 'scale'"),
                                         ("submodule", "submodule 'a'"),
                                         ("assigned", "parameter 'a.bias'")])
@pytest.mark.parametrize("blocks, G", ROWS)
def test_a_parameter_buffer_or_module_replaced_between_calls_is_refused_then_rewrapped(
        what, named, blocks, G, device):
    """Refused at the next call before anything changes, naming it and the fix; after
    ``model.destroy()``, a new wrapper with an optimizer over the new parameters trains the
    new objects as plain PyTorch does."""
    torch.manual_seed(0)
    model = Annealed(blocks)
    opt = sgd(model)
    train = poptorch.trainingModel(model, options(blocks, G, device), opt)
    train(*data(2 * G))
    _replace(model, what)
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(poptorch.WrapError, match=re.escape(named + " is another object")) as e:
        train(*data(2 * G, seed=1))
    assert "call model.destroy() (or destroy() on the wrapper) and wrap the model again" in str(
        e.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    for k, s in opt_state["state"].items():
        assert torch.equal(after["state"][k]["momentum_buffer"], s["momentum_buffer"])
    with pytest.raises(poptorch.WrapError, match="is another object"):  # and again
        train(*data(2 * G, seed=1))
    model.destroy()
    calls_like_plain_pytorch(model, twin(model, device), blocks, G, device, calls=2).destroy()


def test_the_librarys_own_writes_and_the_same_object_put_back_are_not_refused():
    """A new signature's trace (functional_call swaps tensors in the watched tables), a
    second wrapper's trace, weight copies both ways, ``load_state_dict`` through the wrapper
    and a parameter assigned to itself: calls go on."""
    torch.manual_seed(0)
    model = Annealed(1)
    opts = on_device(poptorch.Options(), "ipu_model")
    train = poptorch.trainingModel(model, opts, sgd(model))
    train(*data(2))
    train(*data(4))  # a new signature, traced while the model is watched
    assert not train._weights.rebound
    infer = poptorch.inferenceModel(model, on_device(poptorch.Options(), "ipu_model"))
    infer(data(2)[0], data(2)[1])
    train.copyWeightsToHost()
    train.copyWeightsToDevice()
    train.load_state_dict(model.state_dict())
    model.a.weight = model.a.weight
    assert train._weights.rebound  # a write: compared at the next call, and the same object
    train(*data(2))
    assert not train._weights.rebound
    infer.destroy()
    train.destroy()


def test_a_replacement_while_detached_is_refused_at_attach():
    torch.manual_seed(0)
    model = Annealed(1)
    train = poptorch.trainingModel(model, on_device(poptorch.Options(), "ipu_model"))
    train(*data(2))
    train.detachFromDevice()
    model.b.bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(poptorch.WrapError, match="parameter 'b.bias' is another object"):
        train.attachToDevice()
    with pytest.raises(poptorch.WrapError, match="parameter 'b.bias' is another object"):
        train(*data(4))  # a new signature: refused before it traces
    train.destroy()


# -- train and eval modes ([Note: train and eval modes] in runtime/compiled.py) -----------

class Normalised(torch.nn.Module):
    """A Linear layer, a BatchNorm, dropout and a head, in 1 or 2 blocks; the loss comes
    back only while the model itself trains (``if self.training``), as in Graphcore's
    models, whose validation calls the same module without labels."""

    def __init__(self, blocks: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.bn, self.drop = torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3)
        self.blocks = blocks

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = self.drop(torch.relu(self.bn(self.a(x))))
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        return (out, F.cross_entropy(out, y)) if self.training else out


def _step_both(train, ref, ref_opt, G: int, call: int):
    """One call of ``train`` and plain PyTorch's step on ``ref`` with the same dropout
    masks: outputs and losses agree; returns nothing."""
    x, y = data(2 * G, seed=call)
    torch.manual_seed(100 + call)
    out, loss = train(x, y)
    torch.manual_seed(100 + call)
    outs, losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1,
                                         seeds=microbatch_seeds(1, G))
    assert_close(out, torch.cat(outs), atol=ATOL, rtol=0, msg=f"call {call}")
    assert_close(loss, torch.stack(losses), atol=ATOL, rtol=0, msg=f"call {call}")


def _same_state(model, ref, where: str):
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")


@pytest.mark.parametrize("blocks, G", ROWS)
def test_normalisation_and_dropout_frozen_between_calls_train_as_plain_pytorch(blocks, G,
                                                                              device):
    """``bn.eval(); drop.eval()`` after a call (freezing them, as a fine-tune does): the next
    calls run them in eval mode, as plain PyTorch does (the running statistics used and left
    alone), with a warning that PopTorch kept its first modes; back in train mode, the first
    program runs again."""
    torch.manual_seed(0)
    model = Normalised(blocks)
    ref = twin(model, device)
    opt, ref_opt = sgd(model), sgd(ref)
    train = poptorch.trainingModel(model, options(blocks, G, device), opt)
    _step_both(train, ref, ref_opt, G, 0)
    for m in (model, ref):
        m.bn.eval()
        m.drop.eval()
    statistics = model.bn.running_mean.clone()
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "model.bn, model.drop went to eval mode since the training model was traced: it "
            "compiles again and trains with them in eval mode")):
        _step_both(train, ref, ref_opt, G, 1)
    assert torch.equal(model.bn.running_mean, statistics)
    _same_state(model, ref, "frozen")
    for m in (model, ref):
        m.train()
    _step_both(train, ref, ref_opt, G, 2)
    _same_state(model, ref, "unfrozen")
    assert len(train._programs) == 2
    train.destroy()


def test_a_validation_model_wrapped_while_the_model_trains_validates_in_eval_mode(device):
    """Graphcore's CNN application wraps its validation model while the model trains, then
    calls ``model.eval()`` before each validation pass and ``model.train()`` after it: the
    validation uses the running statistics and leaves them alone, and training goes on as
    plain PyTorch's (the training model never runs in eval mode: no W-LITE-18). The
    wrapper's own flag is the model's when wrapped (PopTorch's shallow copy), so the forward
    returns its loss too, and says so (W-LITE-19)."""
    torch.manual_seed(0)
    model = Normalised(1)
    ref = twin(model, device)
    opt, ref_opt = sgd(model), sgd(ref)
    train = poptorch.trainingModel(model, options(1, 2, device), opt)
    validation = poptorch.inferenceModel(model, on_device(poptorch.Options(), device)
                                         .deviceIterations(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):
            _step_both(train, ref, ref_opt, 2, call)
            x, y = data(4, seed=10 + call)
            model.eval()
            statistics = model.bn.running_mean.clone()
            got = validation(x, y)[0]  # wrapped in train mode: its own flag says so
            model.train()
            with torch.no_grad():
                ref.eval()
                ref.training = True
                want = torch.cat([ref(x[k:k + 2].to(ref.a.weight.device),
                                      y[k:k + 2].to(ref.a.weight.device))[0]
                                  for k in (0, 2)]).cpu()
                ref.train()
            assert_close(got, want, atol=ATOL, rtol=0, msg=f"validation {call}")
            assert torch.equal(model.bn.running_mean, statistics)
    _same_state(model, ref, "after")
    ours = [str(w.message) for w in caught if w.category is poptorch.PoptorchLiteWarning]
    assert not [m for m in ours if "went to eval mode" in m]
    assert [m for m in ours if m.startswith(
        "the model is in eval mode, but its forward reads self.training, which is the "
        "inferenceModel's own flag")]
    train.destroy()
    validation.destroy()


def test_the_models_own_mode_is_the_wrappers_as_wrapped():
    """PopTorch wraps a shallow copy: ``model.eval()`` after ``trainingModel`` puts the
    submodules in eval mode, but the wrapper's own flag stays as it was (the forward's
    ``if self.training`` still returns the loss), with a warning that plain PyTorch would
    read the user's."""
    torch.manual_seed(0)
    model = Normalised(1)
    ref = twin(model)
    opt, ref_opt = sgd(model), sgd(ref)
    train = poptorch.trainingModel(model, options(1, 2, "cpu"), opt)
    model.eval()
    ref.eval()
    ref.training = True  # the wrapper's copy of the flag
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(
            "the model is in eval mode, but its forward reads self.training, which is the "
            "trainingModel's own flag, set when it wrapped the model: it runs the forward in "
            "train mode")):
        _step_both(train, ref, ref_opt, 2, 0)
    _same_state(model, ref, "after")
    assert not model.training  # the user's flag, as the user set it
    train.destroy()
