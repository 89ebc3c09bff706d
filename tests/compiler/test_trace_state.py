"""What the trace reads and leaves behind: inference tensors, scripted submodules, a user's
random generators, Python's and numpy's random, packed sequences (compiler/tracing.py,
compiler/trace_modes.py, compiler/trace_state.py)."""

from __future__ import annotations

import contextlib
import pathlib
import random
import re
import warnings
from random import uniform as _uniform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler import retarget, rng
from models import (GradCodeMLP, data, microbatch_seeds, on_device, reference_training,
                    trained_grads, twin)

ATOL = 1e-5


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("where", ["inputs", "call", "both"])
def test_inference_mode_and_its_tensors_infer_as_plain_pytorch(where, blocks, device):
    """Lightning validates under ``torch.inference_mode()``: its batches are inference tensors,
    which keep no version counter, and the call runs in that mode. The model writes a buffer
    in forward and, where plain PyTorch may (in inference mode), halves its input in place."""
    D, b = 3, 2
    torch.manual_seed(0)
    edit = where != "inputs"  # an inference tensor is written only in inference mode
    model = GradCodeMLP("ema_buffer", blocks, edit_input=edit)
    ref = twin(model, device)
    x, y = data(D * b)
    ref_x = x.clone().to("cuda" if device == "cuda" else "cpu")
    if where != "call":
        with torch.inference_mode():
            x, y = x.clone(), y.clone()
    opts = on_device(poptorch.Options().deviceIterations(D), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    infer = poptorch.inferenceModel(model, opts)
    mode = torch.inference_mode() if where != "inputs" else contextlib.nullcontext()
    with mode:
        out, loss = infer(x, y)
    with torch.no_grad():
        refs = [ref(ref_x[k * b:(k + 1) * b], y[k * b:(k + 1) * b].to(ref_x.device))
                for k in range(D)]
    assert_close(out, torch.cat([o for o, _ in refs]).cpu(), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack([l for _, l in refs]).cpu(), atol=ATOL, rtol=0)
    assert_close(x, ref_x.cpu(), atol=0, rtol=0)  # halved once, by the run, if at all
    assert_close(model.ema, ref.ema.cpu(), atol=ATOL, rtol=0)
    infer.destroy()


# -- a scripted submodule ([Note: an export-style trace]) --------------------------------------

def _twice(x):
    return x * 2


def _script(code):
    """``torch.jit.script(code)``, without the deprecation warning torch gives since 2.10."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.script(code)


_twice = _script(_twice)


class Scripted(torch.nn.Module):
    """Code for torch.jit.script: a helper method, a scripted function, a dropout, a scripted
    Sequential inside, and a buffer counted in forward."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.drop = torch.nn.Dropout(0.3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.drop(self.halved(self.seq(_twice(self.fc(x)))))

    def halved(self, x):
        return x * 0.5


class WithScripted(torch.nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.inner = _script(Scripted())
        self.head = torch.nn.Linear(8, 4)
        self.blocks = blocks

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = self.inner(x)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.head(h)
        return out, F.cross_entropy(out, y)


def train_against_plain_pytorch(make, blocks: int, G: int, device: str, steps: int = 2,
                                lr: float = 0.05, before_reference=None, schedule="grouped"):
    """Train ``make()`` wrapped (2 stages: pipelined) and another ``make()`` in plain PyTorch
    (a deep copy of a scripted module's parameters are not leaves), each micro-batch seeded as
    [Note: micro-batch RNG] seeds it, for ``steps`` calls; assert outputs, losses, the
    gradients, weights and buffers equal. ``before_reference(ref)`` runs before each reference
    step. Returns the two models."""
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    ref = make().to("cuda" if device == "cuda" else "cpu")
    opts = on_device(poptorch.Options(), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(schedule=schedule))
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    train = poptorch.trainingModel(model, opts, opt)
    for step in range(steps):
        x, y = data(2 * G, seed=step)
        torch.manual_seed(100 + step)
        out, loss = train(x, y)
        grads = trained_grads(train)
        torch.manual_seed(100 + step)
        seeds = microbatch_seeds(1, G)
        if before_reference is not None:
            before_reference(ref)
        outs, losses, ref_grads = reference_training(ref, ref_opt, x, y, 1, G, 1, seeds=seeds)
        assert_close(out, torch.cat(outs), atol=ATOL, rtol=0, msg=f"step {step}")
        assert_close(loss, torch.stack(losses), atol=ATOL, rtol=0, msg=f"step {step}")
        for name, g in ref_grads.items():
            assert_close(grads[name], g, atol=ATOL, rtol=0, msg=f"grad of {name}, step {step}")
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)
    train.destroy()
    return model, ref


@pytest.mark.parametrize("blocks, G", [(1, 2), (2, 3)])
def test_a_scripted_submodule_trains_and_infers_as_plain_pytorch(blocks, G, device):
    model, _ = train_against_plain_pytorch(lambda: WithScripted(blocks), blocks, G, device)
    assert int(model.inner.calls) == 2 * G
    model.eval()
    x, y = data(6, seed=9)
    opts = on_device(poptorch.Options().deviceIterations(3), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    infer = poptorch.inferenceModel(model, opts)
    out, _ = infer(x, y)
    with torch.no_grad():
        assert_close(out, torch.cat([model(x[k:k + 2], y[k:k + 2])[0] for k in (0, 2, 4)]),
                     atol=ATOL, rtol=0)
    assert isinstance(model.inner.forward, torch._C.ScriptMethod)  # the model as it was
    infer.destroy()


# -- Python's and numpy's random ([Note: Python's random while tracing]) -----------------------

class DrawsInPython(torch.nn.Module):
    """Scales its input by a number drawn in Python: by ``random.uniform``, numpy's global
    state, a from-imported ``uniform`` (not watched: the forward is named), or ``fixed``."""

    def __init__(self, blocks: int, how: str):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.blocks, self.how, self.fixed = blocks, how, None

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        if self.fixed is not None:
            scale = self.fixed
        elif self.how == "random":
            scale = random.uniform(0.5, 1.5)
        elif self.how == "numpy":
            scale = float(np.random.rand()) + 0.5
        else:
            scale = _uniform(0.5, 1.5)
        h = torch.relu(self.a(x * scale))
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        if self.how == "refused":
            out = out * out.sum().item()
        return out, F.cross_entropy(out, y)


def _line(code: str) -> str:
    lines = pathlib.Path(__file__).read_text().splitlines()
    return f"{__file__}:{lines.index(code) + 1}: {code.strip()}"


@pytest.mark.parametrize("how", ["random", "numpy", "imported"])
@pytest.mark.parametrize("blocks, G", [(1, 2), (2, 3)])
def test_a_number_drawn_in_python_is_drawn_once_and_warned_of_at_its_line(how, blocks, G,
                                                                           device):
    """PopTorch's semantics: the trace draws once, every micro-batch and call uses that
    number, and the state is left advanced by that one draw; the warning names the line."""
    random.seed(0)
    np.random.seed(0)
    drawn = {"random": lambda: random.uniform(0.5, 1.5), "imported": lambda: _uniform(0.5, 1.5),
             "numpy": lambda: float(np.random.rand()) + 0.5}[how]()
    after = random.getstate(), np.random.get_state()
    random.seed(0)
    np.random.seed(0)
    where = {"random": "random.uniform at " + _line("            scale = random.uniform(0.5, 1.5)"),
             "numpy": "numpy.random.rand at " + _line(
                 "            scale = float(np.random.rand()) + 0.5"),
             "imported": f"DrawsInPython.forward ({__file__}:"}[how]
    with pytest.warns(poptorch.PoptorchLiteWarning, match=re.escape(where)) as warned:
        model, ref = train_against_plain_pytorch(
            lambda: DrawsInPython(blocks, how), blocks, G, device,
            before_reference=lambda ref: setattr(ref, "fixed", drawn))
    assert "is drawn once and used for every micro-batch and every call" in str(
        warned[0].message)
    assert random.getstate() == after[0]
    assert np.array_equal(np.random.get_state()[1], after[1][1])


def test_a_refused_trace_puts_pythons_and_numpys_random_back():
    random.seed(0)
    np.random.seed(0)
    before = random.getstate(), np.random.get_state()
    model = DrawsInPython(1, "refused")
    with pytest.raises(poptorch.TraceError, match="reads a tensor's value into Python"):
        poptorch.trainingModel(model)(*data(2))
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1][1])


class DrawsThenRefused(DrawsInPython):
    """Draws in Python and then meets a refusal after its trace: a buffer of its own written
    under replicas (E-PART-10), or a hook on a parameter both stages use (E-PART-27)."""

    def __init__(self, why: str):
        super().__init__(2, "random")
        self.why = why
        self.register_buffer("count", torch.zeros(()))
        if why == "hook":
            self.a.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))

    def forward(self, x, y):
        out, loss = super().forward(x, y)
        if self.why == "buffer":
            with torch.no_grad():
                self.count.add_(1)
        else:
            out = out + self.a(x).sum(1, keepdim=True)  # self.a again, in block b1
        return out, loss


@pytest.mark.parametrize("why, error, R", [("buffer", poptorch.OptionsError, 2),
                                           ("hook", poptorch.BlockError, 1)])
def test_a_compile_refused_after_its_trace_puts_pythons_and_numpys_random_back(why, error, R):
    random.seed(0)
    np.random.seed(0)
    before = random.getstate(), np.random.get_state()
    opts = poptorch.Options().replicationFactor(R)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(3)
    x, y = torch.randn(3 * R * 2, 8), torch.randint(0, 4, (3 * R * 2,))
    with warnings.catch_warnings(), pytest.raises(error):
        warnings.simplefilter("ignore", poptorch.PoptorchLiteWarning)  # the draw's, once
        poptorch.trainingModel(DrawsThenRefused(why), opts)(x, y)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1][1])


# -- a generator of the model's own ([Note: a user's generator] in compiler/rng.py) -------------

class OwnGenerator(torch.nn.Module):
    """Draws from a generator of its own in block 0 (randn, rand_like, randperm, multinomial,
    normal_, bernoulli) and, with ``both``, in block 1 too; ``how`` makes it misbehave:
    "seeds" seeds it in forward, "makes" draws from one made in forward."""

    def __init__(self, blocks: int, both: bool = False, how: str = ""):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.g = torch.Generator().manual_seed(5)
        self.blocks, self.both, self.how = blocks, both, how

    def forward(self, x, y):
        g = self.g
        if self.how == "seeds":
            g.manual_seed(11)
        if self.how == "makes":
            g = torch.Generator().manual_seed(11)
        poptorch.Block.start("b0", ipu_id=0)
        x = x + 0.1 * torch.randn(x.shape, generator=g).to(x.device)
        x = x * torch.rand_like(x.cpu(), generator=g).to(x.device)
        x = x[torch.randperm(x.shape[0], generator=g).to(x.device)]
        h = torch.relu(self.a(x))
        pick = torch.multinomial(h.detach().abs().cpu() + 0.1, 2, generator=g).to(x.device)
        noise = torch.empty(h.shape).normal_(generator=g).to(x.device)
        keep = torch.bernoulli(torch.full(h.shape, 0.8), generator=g).to(x.device)
        h = (h + 0.01 * noise + 0.1 * h.gather(1, pick).sum(1, keepdim=True)) * keep
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        if self.both:
            h = h + 0.1 * torch.randn(h.shape, generator=g).to(x.device)
        out = self.b(h)
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("blocks, G, both, schedule", [
    (1, 2, False, "grouped"), (2, 3, False, "grouped"), (2, 3, False, "interleaved"),
    (2, 3, True, "sequential")])
def test_a_generator_of_the_models_own_draws_as_in_plain_pytorch(blocks, G, both, schedule,
                                                                  device):
    """One stage draws from it (its forwards run in micro-batch order), or the stages run one
    at a time: every draw is the one plain PyTorch's forwards make, in three calls, and the
    generator ends where plain PyTorch's does."""
    model, ref = train_against_plain_pytorch(
        lambda: OwnGenerator(blocks, both), blocks, G, device, steps=3, schedule=schedule)
    assert torch.equal(model.g.get_state(), ref.g.get_state())
    drawn = model.g.get_state()
    x, y = data(2 * 3)  # inference: micro-batch after micro-batch, as plain PyTorch
    opts = on_device(poptorch.Options().deviceIterations(3), device)
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(schedule=schedule))
    infer = poptorch.inferenceModel(model, opts)
    out, _ = infer(x, y)
    with torch.no_grad():
        expected = [ref(x[k:k + 2].to(ref.a.weight.device), y[k:k + 2].to(ref.a.weight.device))[0]
                    for k in (0, 2, 4)]
    assert_close(out, torch.cat(expected).cpu(), atol=ATOL, rtol=0)
    assert not torch.equal(model.g.get_state(), drawn)
    assert torch.equal(model.g.get_state(), ref.g.get_state())
    infer.destroy()


@pytest.mark.parametrize("case, error, message", [
    ("two_stages", poptorch.OptionsError,
     r"\(.*test_trace_state.py.*torch.randn\(x.shape, generator=g\).* in stages 0, 1 of a "
     r"pipelined schedule: plain PyTorch draws from it micro-batch after micro-batch.*"
     r"Draw from it in one stage, run the stages one at a time"),
    ("recomputed", poptorch.OptionsError,
     r"in stage 0, which is recomputed: .*a recomputed stage runs its forward again"),
    ("replicas", poptorch.OptionsError, r"with 2 replicas: .*Use replicationFactor\(1\)"),
    ("seeds", poptorch.TraceError,
     r"sets the state of a torch.Generator \(manual_seed, seed or set_state\) and then draws "
     r"from it at .*test_trace_state.py:\d+: x = x \+ 0.1 \* torch.randn"),
    ("makes", poptorch.TraceError,
     r"draws from a torch.Generator it makes itself, at .*test_trace_state.py:\d+: x = x \+ "
     r"0.1 \* torch.randn.*Make it once outside forward")])
def test_a_generator_that_cannot_draw_as_in_plain_pytorch_is_refused_before_anything_changes(
        case, error, message):
    torch.manual_seed(0)
    model = OwnGenerator(2 if case in ("two_stages", "recomputed") else 1,
                         both=case == "two_stages", how=case if case in ("seeds", "makes") else "")
    opts = poptorch.Options()
    if model.blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(3)
    if case == "recomputed":
        opts._Popart.set("autoRecomputation", 3)
    if case == "replicas":
        opts.replicationFactor(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state, own = torch.get_rng_state(), model.g.get_state()
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(error, match=message):
        train(*data(2 * 3 * (2 if case == "replicas" else 1)))
    assert torch.equal(model.g.get_state(), own) and torch.equal(torch.get_rng_state(), state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    train.destroy()


def test_a_draw_from_a_generator_on_another_kind_of_device_runs_there():
    """[Note: graphs on their devices]: a stage on a GPU gets a graph traced on the host, where
    plain PyTorch's copies to and from a CPU generator's device were no ops. The rewritten
    graph draws on the generator's device (here: a stage on "meta" keeps every draw on the
    CPU and copies in between); moved back to the CPU, it draws exactly what it drew."""
    g = torch.Generator().manual_seed(3)

    def f(x):
        return (x + torch.randn(x.shape, generator=g) + torch.rand_like(x, generator=g)
                + torch.empty(x.shape).normal_(generator=g)
                + torch.multinomial(x.abs() + 0.1, 1, generator=g)
                + torch.bernoulli(torch.full(x.shape, 0.5), generator=g))
    x = torch.rand(2, 3)
    gm = make_fx(f)(x)
    rng.seed_random_ops(gm)
    g.manual_seed(3)
    want = gm(x)
    retarget.to_device(gm, torch.device("meta"))
    draws = [n for n in gm.graph.nodes if "generator" in n.kwargs]
    assert len(draws) == 5
    for n in draws:
        assert all(a.target is torch.ops.aten._to_copy.default and a.kwargs["device"].type ==
                   "cpu" for a in n.all_input_nodes if a.op != "get_attr")
        assert n.kwargs.get("device", torch.device("cpu")).type == "cpu"
        (user,) = n.users
        assert user.target in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
    retarget.to_device(gm, torch.device("cpu"))
    g.manual_seed(3)
    assert torch.equal(gm(x), want)


class FailsOnHuge(torch.autograd.Function):
    """The identity, which fails at run time on a micro-batch holding a huge value."""

    @staticmethod
    def forward(ctx, x):
        if x.abs().max() > 1e3:
            raise RuntimeError("a huge value")
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class OwnGeneratorThenFails(OwnGenerator):
    def forward(self, x, y):
        return super().forward(FailsOnHuge.apply(x), y)


@pytest.mark.parametrize("whole", [False, True])
def test_a_failed_run_puts_the_models_generator_back_as_after_the_last_step(whole, device):
    """[Note: commit point]: the second run of a call fails; the generator is left as after
    the first, as a call of that run alone leaves it, or as before the call with
    allOrNothingCalls."""
    x, y = data(8)
    x[6] = 1e4  # the second run's second micro-batch
    torch.manual_seed(0)
    model, alone = OwnGeneratorThenFails(1), OwnGeneratorThenFails(1)
    alone.load_state_dict(model.state_dict())
    for m, D in ((model, 2), (alone, 1)):
        opts = on_device(poptorch.Options().deviceIterations(D), device)
        opts.Training.gradientAccumulation(2)
        opts.allOrNothingCalls(whole)
        train = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.1))
        if D == 2:
            with pytest.raises(poptorch.ExecutionError, match="a huge value"):
                train(x, y)
        elif not whole:
            train(x[:4], y[:4])
        train.destroy()
    assert torch.equal(model.g.get_state(), alone.g.get_state())
    for (name, p), q in zip(model.named_parameters(), alone.parameters()):
        assert torch.equal(p, q), name


# -- packed sequences ([Note: values read while tracing] in compiler/trace_modes.py) ------------

class Packs(torch.nn.Module):
    """An RNN over sequences packed by ``lengths``: "data" (from the labels), "constant", or
    "handmade" (a PackedSequence whose batch_sizes come from the data)."""

    def __init__(self, blocks: int, rnn: str = "lstm", lengths: str = "data",
                 total_length=None, enforce_sorted: bool = False):
        super().__init__()
        self.rnn = (torch.nn.LSTM if rnn == "lstm" else torch.nn.GRU)(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 4)
        self.blocks, self.lengths, self.total_length = blocks, lengths, total_length
        self.enforce_sorted = enforce_sorted

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        seq = x.unsqueeze(1) * torch.arange(1.0, 4.0, device=x.device)[None, :, None]
        if self.lengths == "handmade":
            sizes = (y * 0 + 2)[:3].cpu()
            packed = PackedSequence(seq.transpose(0, 1).reshape(-1, 8), sizes)
        else:
            lengths = (y % 3) + 1 if self.lengths == "data" else torch.tensor([3, 1])
            packed = pack_padded_sequence(seq, lengths.cpu(), batch_first=True,
                                          enforce_sorted=self.enforce_sorted)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=self.total_length)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.head(padded.sum(1))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("rnn, lengths, total_length, enforce_sorted, where", [
    ("lstm", "data", None, False, "pack_padded_sequence at "),
    ("lstm", "data", 3, False, "pack_padded_sequence at "),
    ("gru", "data", None, True, "pack_padded_sequence at "),
    ("lstm", "handmade", 3, False, "a packed lstm at ")])
@pytest.mark.parametrize("blocks", [1, 2])
def test_a_sequence_packed_by_lengths_from_the_data_is_refused_at_its_line(
        rnn, lengths, total_length, enforce_sorted, where, blocks):
    """Its batch_sizes would be baked into the trace: micro-batch 0's for every micro-batch."""
    torch.manual_seed(0)
    model = Packs(blocks, rnn, lengths, total_length, enforce_sorted)
    opts = poptorch.Options()
    if blocks == 2:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    code = ("        out, _ = self.rnn(packed)" if lengths == "handmade" else
            "            packed = pack_padded_sequence(seq, lengths.cpu(), batch_first=True,")
    with pytest.raises(poptorch.TraceError) as info:
        train(*data(2 * 3))
    text = str(info.value)
    assert text.startswith("the forward packs sequences by lengths that come from the data (")
    assert f"{where}{_line(code)}" in text
    assert "would be the first micro-batch's for every micro-batch" in text
    assert "Run the RNN over the padded batch instead and use the lengths as a mask" in text
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    train.destroy()


@pytest.mark.parametrize("total_length", [None, 3])
@pytest.mark.parametrize("blocks, G", [(1, 2), (2, 3)])
def test_a_sequence_packed_by_constant_lengths_trains_as_plain_pytorch(total_length, blocks, G,
                                                                       device):
    """The same layout in every micro-batch: nothing to refuse."""
    if device == "cuda":
        pytest.skip("a packed sequence's lengths must stay on the CPU; a stage on a GPU "
                    "moves the constant there (see the report of issue 45)")
    train_against_plain_pytorch(lambda: Packs(blocks, lengths="constant",
                                              total_length=total_length), blocks, G, device)


class ClampsAfterUse(torch.nn.Module):
    """WGAN's weight clipping done in forward, after the layer read the weight: each
    micro-batch computes with the weight as the previous one left it, then clamps it."""

    def __init__(self, blocks: int):
        super().__init__()
        self.l0, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.blocks = blocks

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = torch.tanh(self.l0(x))
        with torch.no_grad():
            self.l0.bias.clamp_(-0.05, 0.05)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.head(h)
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("blocks,G,schedule", [(1, 2, "grouped"), (2, 3, "grouped"),
                                               (2, 3, "interleaved")])
def test_a_weight_the_forward_writes_is_put_back_after_the_trace(blocks, G, schedule, device):
    """The trace runs the forward once: its clamp must not reach the weights the first call
    starts from (plain PyTorch's first forward reads them unclamped)."""
    torch.manual_seed(0)
    model = ClampsAfterUse(blocks)
    with torch.no_grad():
        model.l0.bias.mul_(10)  # far outside the clamp
    ref = twin(model, device)
    opts = on_device(poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=schedule)), device)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(2 * G, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, 1, G, 1)
        assert_close(out, torch.cat(ref_outs).cpu(), atol=ATOL, rtol=0)
        assert_close(loss, torch.stack(ref_losses).cpu(), atol=ATOL, rtol=0)
        for name, g in trained_grads(train).items():
            assert_close(g, ref_grads[name].cpu(), atol=ATOL, rtol=0, msg=name)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach().cpu(), atol=ATOL, rtol=0, msg=name)
    train.destroy()
