"""Tracing values that ops read from the data ([Note: values read while tracing] in compiler/trace_modes.py)."""

from __future__ import annotations

import copy
import pathlib
import traceback
from traceback import FrameSummary

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler import rng, trace_modes
from poptorch_lite.compiler.partition import partition as poptorch_partition
from models import reference_training, twin
from patience import limit


class ReadsValues(torch.nn.Module):
    """Ops that read the data to do their work: one_hot's class check, sizes set by the data."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(10, 10)

    def forward(self, x, y):
        out = self.fc(F.one_hot(y, num_classes=10).float())
        counts = torch.bincount(y, minlength=10).float()  # width max(y)+1 if larger
        positive = (x[x > 0].sum() + x.nonzero().shape[0]) * torch.unique(y).float().mean()
        repeated = torch.repeat_interleave(x[:, :1], y.clamp(max=2) + 1, dim=0).sum()
        out = out + counts[:10] + positive + repeated
        return out, F.cross_entropy(out, y)


def batch(rows: int):
    torch.manual_seed(7)
    return torch.randn(rows, 10), torch.randint(0, 10, (rows,))


def test_ops_that_read_values_train_as_plain_pytorch():
    D, G, b = 2, 3, 4
    x, y = batch(D * G * b)
    torch.manual_seed(0)
    model = ReadsValues()
    ref = twin(model)
    opts = poptorch.Options().deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    out, loss = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                       lr=0.1))(x, y)
    outs, losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                                         D, G, 1)
    assert_close(out, torch.cat(outs), atol=1e-5, rtol=0)
    assert_close(loss, torch.stack(losses), atol=1e-5, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, rtol=0, msg=name)


def test_ops_that_read_values_infer_as_plain_pytorch():
    D, b = 3, 4
    x, y = batch(D * b)
    model = ReadsValues()
    out, loss = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(D))(x, y)
    with torch.no_grad():
        refs = [model(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(D)]
    assert_close(out, torch.cat([o for o, _ in refs]), atol=1e-5, rtol=0)
    assert_close(loss, torch.stack([l for _, l in refs]), atol=1e-5, rtol=0)


class ReadsIntoPython(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "constant":
            return x * torch.tensor(3.0).item()  # not traced: a constant, fine
        if self.how == "item":
            return x * x.sum().item()
        if self.how == "if":
            return x if x.sum() > 0 else -x
        if self.how == "index":
            return x * [1.0, 2.0][x.argmax() % 2]
        if self.how == "random":
            return x if torch.rand(()) > 0.5 else -x  # from constants, but drawn anew each time
        return F.one_hot(x.long().abs())


@pytest.mark.parametrize("how, fragment", [
    ("item", "with t.item() at "), ("if", "with bool(t) (an if or while on a tensor) at "),
    ("index", "with t used as an index or size at "),
    ("random", "with bool(t) (an if or while on a tensor) at "),
    ("one_hot", "OneHot num classes must be specified and must be constant: F.one_hot at ")])
def test_a_value_read_into_python_is_refused_with_its_line(how, fragment):
    with pytest.raises(poptorch.TraceError) as info:
        poptorch.inferenceModel(ReadsIntoPython(how))(torch.randn(4, 3))
    statement = {"item": "return x * x.sum().item()", "if": "return x if x.sum() > 0 else -x",
                 "index": "return x * [1.0, 2.0][x.argmax() % 2]",
                 "random": "return x if torch.rand(()) > 0.5 else -x  # from constants, but "
                           "drawn anew each time",
                 "one_hot": "return F.one_hot(x.long().abs())"}[how]
    source = pathlib.Path(__file__).read_text().splitlines()
    line = next(k for k, text in enumerate(source, 1) if text.strip() == statement)
    assert f"{fragment}{__file__}:{line}: {statement}" in str(info.value)


class MaskGiven(torch.nn.Module):
    """A TransformerEncoder given its causal mask as an input: torch compares the mask with a
    causal one to choose a kernel (a value of the data, read into Python), unless the forward
    says whether it is causal."""

    def __init__(self, is_causal=None):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.is_causal = is_causal

    def forward(self, x, mask):
        return self.enc(x, mask=mask, is_causal=self.is_causal)


def test_a_read_inside_a_library_names_the_library_line_too():
    """The user's line only calls torch's encoder, which reads the mask: the refusal names
    that line of torch's too (PopTorch's own suite's nn.Transformer case), so that the fix
    (say whether the mask is causal) can be found; said, it traces."""
    x, mask = torch.randn(2, 3, 8), torch.nn.Transformer.generate_square_subsequent_mask(3)
    with pytest.raises(poptorch.TraceError) as info:
        poptorch.inferenceModel(MaskGiven())(x, mask)
    text = str(info.value)
    assert "return self.enc(x, mask=mask, is_causal=self.is_causal) (in " in text
    assert "torch/nn/modules/transformer.py:" in text and ", _detect_is_causal_mask): " in text
    model = MaskGiven(is_causal=True).eval()
    assert_close(poptorch.inferenceModel(model)(x, mask), model(x, mask))


def test_the_user_line_is_found_by_folder_not_by_name():
    import contextlib
    import _pytest.python
    frames = [FrameSummary(_pytest.python.__file__, 1, "f", line="call"),
              # a clone of this project is a folder called poptorch_lite: its tests are user code
              FrameSummary("/home/u/poptorch_lite/tests/test_model.py", 7, "forward",
                            line="y = x.item()"),
              FrameSummary(contextlib.__file__, 2, "__exit__", line="next(self.gen)"),
              FrameSummary("<string>", 1, "__init__", line=""),
              FrameSummary(torch.overrides.__file__, 3, "g", line="h()"),
              FrameSummary(trace_modes.__file__, 4, "__torch_function__", line="func()"),
              FrameSummary("<eval_with_key>.3", 5, "forward", line="")]
    assert trace_modes._user_line(frames) == \
        "/home/u/poptorch_lite/tests/test_model.py:7: y = x.item()"
    assert trace_modes._user_line(frames[2:]) == "(no line of user code in the traceback)"


def test_a_constant_read_into_python_is_fine():
    x = torch.randn(4, 3)
    assert_close(poptorch.inferenceModel(ReadsIntoPython("constant"))(x), x * 3)


class CausalEncoder(torch.nn.Module):
    """A TransformerEncoder whose causal mask is built in forward (torch reads the mask's
    values to detect that it is causal), and a Normal of constant parameters (torch checks
    them): values computed from constants alone, read into Python."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        prior = torch.distributions.Normal(torch.tensor([0.5, 2.0]), torch.tensor([1.0, 3.0]))
        out = self.head(self.enc(x, mask=mask)).mean(1) + prior.mean.sum()
        return out, F.cross_entropy(out, y)


def test_values_computed_from_constants_alone_are_read_into_python():
    """[Note: values read while tracing]: the same in every micro-batch, so they are read."""
    torch.manual_seed(0)
    model = CausalEncoder()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 5, 8), torch.randint(0, 3, (6,))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = train(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        ref_loss = ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])[1]
        (ref_loss / 3).backward()
    ref_opt.step()
    assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0)


class DrawsIntegers(torch.nn.Module):
    def forward(self, x):
        return (x + 0).random_(5, 100)  # aten.random_.from: an overload named as a keyword


def test_an_op_whose_overload_is_named_as_a_python_keyword_traces():
    out = poptorch.inferenceModel(DrawsIntegers(), poptorch.Options().deviceIterations(2))(
        torch.zeros(2, 1000))
    assert out.shape == (2, 1000) and out.min() >= 5 and out.max() < 100
    assert not torch.equal(out[0], out[1])  # each micro-batch draws from its own stream


class DropsBuffer(torch.nn.Module):
    """PopTorch's test_error_on_remove_buffer, and its sibling that rebinds the buffer."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("y", torch.tensor([2.0]))
        self.register_buffer("z", torch.tensor([1.0]), persistent=False)

    def forward(self, x):
        x = x + self.y
        if self.how == "delete" and "y" in self._buffers:
            del self._buffers["y"]
        if self.how == "del":
            del self.y
        if self.how == "rebind":
            self.y = x.sum(0)
        return x


@pytest.mark.parametrize("how, message", [
    ("delete", r"^Buffer y is removed from the model when calling the forward method\."),
    ("del", r"^Buffer y is removed from the model when calling the forward method\."),
    ("rebind", r"^Buffer y is reassigned within the model when calling the forward method\. "
               r"This is not supported\. Consider using self\.y\.copy_\(src\)")])
def test_a_forward_that_removes_a_buffer_is_refused_and_the_buffer_kept(how, message):
    model = DropsBuffer(how)
    y, z = model.y, model.z
    with pytest.raises(poptorch.TraceError, match=message):
        poptorch.inferenceModel(model)(torch.tensor([5.0]))
    assert model._buffers == {"y": y, "z": z} and model.y is y and "y" not in model.__dict__
    assert model._non_persistent_buffers_set == {"z"}
    assert list(model.state_dict()) == ["y"] and torch.equal(y, torch.tensor([2.0]))
    assert_close(DropsBuffer("keep")(torch.tensor([5.0])), torch.tensor([7.0]))


def test_dropout_is_traced_as_the_kernel_plain_pytorch_fuses_on_a_gpu():
    """``F.dropout`` records ``native_dropout``: on the CPU it masks exactly as the traced
    decomposition did (so CPU runs are unchanged), and a stage graph run on a GPU then uses
    the fused kernel that plain PyTorch uses there, with the same draws. Dropout in place,
    or with p 0 or 1, stays as PyTorch writes it."""

    class Drops(torch.nn.Module):
        def __init__(self, p, inplace=False):
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)
            self.drop = torch.nn.Dropout(p, inplace=inplace)

        def forward(self, x):
            out = self.drop(self.fc(x))
            return out, poptorch.identity_loss(out.sum(), reduction="none")

    def ops(model):
        part = poptorch_partition(model, {m: m.training for m in model.modules()},
                                  (torch.randn(4, 6),), {}, poptorch.ShardedExecution(), True)
        return {str(n.target) for st in part.stages for n in st.module.graph.nodes
                if n.op == "call_function"}

    assert any("native_dropout" in t for t in ops(Drops(0.3)))
    assert not any("bernoulli" in t for t in ops(Drops(0.3)))
    for model in (Drops(0.3, inplace=True), Drops(1.0)):
        assert not any("native_dropout" in t for t in ops(model))
    torch.manual_seed(3)
    x = torch.randn(4, 6)
    model = Drops(0.3)
    ref = twin(model)
    torch.manual_seed(11)
    out, _ = poptorch.trainingModel(model, poptorch.Options(),
                                    torch.optim.SGD(model.parameters(), lr=0.0))(x)
    torch.manual_seed(11)
    seed = rng.microbatch_seed(rng.draw_base(), 0)
    torch.manual_seed(seed)
    assert torch.equal(out, ref(x)[0].detach())


class MaskShortcut(torch.nn.Module):
    """Masks its input as export-friendly libraries do ([Note: an export-style trace]):
    eagerly it skips the mask when every position is kept (a value read into Python);
    exported, it always applies the mask as tensor ops."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.seen = []

    def forward(self, x, mask, y):
        self.seen.append((torch.compiler.is_compiling(), torch.compiler.is_exporting()))
        h = self.fc(x)
        if torch.compiler.is_exporting() or not bool(mask.all()):
            h = h.masked_fill(~mask, 0.0)
        poptorch.Block.start("b1", ipu_id=1)
        out = self.head(h)
        return out, F.cross_entropy(out, y)


def test_the_trace_is_export_style_and_each_microbatch_masks_as_plain_pytorch():
    """Micro-batch 0 has no padding, micro-batch 1 has: each gets plain PyTorch's numbers
    (the trace takes the exported branch, so it does not fix micro-batch 0's)."""
    torch.manual_seed(0)
    model = MaskShortcut()
    ref = twin(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    mask = torch.ones(8, 6, dtype=torch.bool)
    mask[2:, 4:] = False  # micro-batches 1..3 are padded, micro-batch 0 is not
    out, loss = wrapped(x, mask, y)
    assert model.seen == [(True, True)]  # traced once, as an export
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    for k in range(4):
        rows = slice(2 * k, 2 * k + 2)
        o, l = ref(x[rows], mask[rows], y[rows])
        assert_close(out[rows], o.detach(), atol=1e-6, rtol=0)
        assert_close(loss[k], l.detach(), atol=1e-6, rtol=0)
    assert ref.seen == [(False, False)] * 4


USER_TEST = '''\
import torch
import poptorch_lite as poptorch


class Net(torch.nn.Module):
    def __init__(self, refused):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.refused = refused

    def forward(self, x, y):
        out = self.fc(x)
        if self.refused:
            out = out * 2 if out.sum() > 0 else out
        else:
            out = out @ torch.ones(3, 3)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_refused():
    poptorch.trainingModel(Net(True))(torch.randn(2, 4), torch.tensor([0, 1]))


def test_failed():
    poptorch.trainingModel(Net(False))(torch.randn(2, 4), torch.tensor([0, 1]))
'''


def test_a_trace_error_under_pytest_shows_the_users_lines_and_no_log(tmp_path):
    """[Note: frames a user sees] in errors.py: pytest hides this package's frames and the
    trace keeps torch's out of the traceback, so the failure shows the test's call and the
    forward's line; torch's structured trace log says nothing. One pytest run, two failures:
    a value read into Python (refused while tracing: TraceError) and an op that fails
    (its own RuntimeError, as PopTorch re-raises it)."""
    import os
    import subprocess
    import sys
    test = tmp_path / "test_user.py"
    test.write_text(USER_TEST)
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True, text=True, timeout=limit(300), cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)})
    sections = {}  # test name -> the places its failure shows, in order
    for ln in result.stdout.splitlines():
        if ln.startswith("_") and " test_" in ln:
            sections[ln.strip("_ ")] = current = []
        elif ln.startswith("test_user.py:") and sections:
            current.append(ln)
    def at(code):  # "test_user.py:<line of code>: "
        return f"test_user.py:{USER_TEST.splitlines().index(code) + 1}: "
    call = "    poptorch.trainingModel(Net({}))(torch.randn(2, 4), torch.tensor([0, 1]))"
    assert sections == {
        "test_refused": [at(call.format(True)),
                         at("            out = out * 2 if out.sum() > 0 else out") + "TraceError"],
        "test_failed": [at(call.format(False)),
                        at("            out = out @ torch.ones(3, 3)") + "RuntimeError"]}, result.stdout
    # no frame of this package's or torch's, no log record
    assert "poptorch_lite/" not in result.stdout and "torch/" not in result.stdout
    assert "DEBUG" not in result.stdout and "Captured log" not in result.stdout


def test_a_refusals_traceback_keeps_the_users_frames_or_all_when_it_has_none():
    """tracing._user_traceback ([Note: frames a user sees]): the user's frames only, and a
    traceback with none of them whole, so that a refusal never shows nothing."""
    import json
    from poptorch_lite.compiler.tracing import _user_traceback
    try:
        json.loads("{")
    except ValueError as exc:
        tb = exc.__traceback__
    frames = [f.name for f in traceback.extract_tb(tb)]
    assert frames[0] == "test_a_refusals_traceback_keeps_the_users_frames_or_all_when_it_has_none"
    assert len(frames) > 1  # json's own frames below this test's
    assert [f.name for f in traceback.extract_tb(_user_traceback(tb))] == frames[:1]
    assert _user_traceback(tb.tb_next) is tb.tb_next  # only the standard library's frames


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_trace_leaves_no_weak_reference_to_the_parameters(compiled, every_stage_compiles):
    """make_fx's tracer lives on in reference cycles until Python's collector runs, and its
    tables held a weak reference to every parameter, which ``torch.utils.swap_tensors``
    (``Module.to()`` under torch.__future__'s swap of parameters on conversion) refuses: the
    swap between calls failed or not by when the collector last ran. Collection stays off
    here, so only the trace's own emptying of its tables can pass this. A compiled stage's
    graphs keep AOTAutograd's fake-tensor mode, whose tables held them for the stage's life."""
    import gc
    import weakref

    from models import BlockMLP

    torch.manual_seed(0)
    model = BlockMLP(blocks=1)
    plain = copy.deepcopy(model)
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    collecting = gc.isenabled()
    gc.disable()
    try:
        opts = poptorch.Options()
        if compiled:
            opts.compileStages(True, backend="aot_eager")
        train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        train(x, y)
        assert {weakref.getweakrefcount(p) for p in model.parameters()} == {0}
        train.copyWeightsToHost()
        bias = model.head.bias
        torch.utils.swap_tensors(bias, torch.nn.Parameter(bias.detach() * 0.5))
    finally:
        if collecting:
            gc.enable()
    _, loss = train(x, y)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x, y)[1].backward()
    opt.step()
    with torch.no_grad():
        plain.head.bias.mul_(0.5)
    assert torch.equal(loss, plain(x, y)[1].detach()) if not compiled else \
        torch.allclose(loss, plain(x, y)[1].detach(), rtol=1e-6, atol=0)
    train.destroy()
