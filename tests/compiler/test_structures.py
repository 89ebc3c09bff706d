"""Container subclasses in and out of a wrapped model ([Note: container subclasses]).

PopTorch walks every dict, list and tuple subclass and rebuilds it with its own type; an
output that pytree does not know must come back with each call's own tensors (not the
trace-time object), and one holding tensors that cannot be walked is refused.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch

from models import microbatch_seeds


class Out(collections.OrderedDict):
    """transformers' ModelOutput in miniature: an OrderedDict subclass pytree does not know."""


class Pair(list):
    pass


class Triple(tuple):
    pass


Named = collections.namedtuple("Named", ["logits", "loss"])


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    loss: torch.Tensor


class NeedsTwo(dict):
    def __init__(self, a, b):
        super().__init__(a=a, b=b)


def _pack(kind, logits, loss):
    """``logits`` and ``loss`` in the container ``kind`` names; ``loss`` is always reachable."""
    if kind == "ordered_dict_subclass":
        return Out(logits=logits, loss=loss)
    if kind == "list_subclass":
        return Pair([logits, loss])
    if kind == "tuple_subclass":
        return Triple((logits, loss, "tag"))
    if kind == "namedtuple":
        return Named(logits, loss)
    if kind == "nested":
        return (Out(inner=Pair([logits, Triple((loss,))]), step=3), {"plain": loss})
    if kind == "dataclass":
        return Result(logits, loss)
    raise AssertionError(kind)


def _loss_of(kind, out):
    return {"ordered_dict_subclass": lambda o: o["loss"], "list_subclass": lambda o: o[1],
            "tuple_subclass": lambda o: o[1], "namedtuple": lambda o: o.loss,
            "nested": lambda o: o[1]["plain"]}[kind](out)


def _logits_of(kind, out):
    return {"ordered_dict_subclass": lambda o: o["logits"], "list_subclass": lambda o: o[0],
            "tuple_subclass": lambda o: o[0], "namedtuple": lambda o: o.logits,
            "nested": lambda o: o[0]["inner"][0]}[kind](out)


class Packed(torch.nn.Module):
    """Two blocks on two IPUs whose forward returns its logits and loss in ``kind``."""

    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        self.kind = kind
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        poptorch.Block.start("b1", ipu_id=1)
        logits = self.b(self.drop(h))
        return _pack(self.kind, logits, F.cross_entropy(logits, y))


KINDS = ["ordered_dict_subclass", "list_subclass", "tuple_subclass", "namedtuple", "nested"]


@pytest.mark.parametrize("kind", KINDS)
def test_training_outputs_are_each_calls_own(kind):
    """Every call returns its own losses and logits in the forward's own types, as plain
    PyTorch computes them; the loss moves as the weights train (it is not the trace's)."""
    torch.manual_seed(0)
    model = Packed(kind, dropout=0.25)
    ref = copy.deepcopy(model)
    G, D, calls = 4, 1, 3
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(calls):
        x, y = torch.randn(G * 2, 6, generator=g), torch.randint(0, 3, (G * 2,), generator=g)
        torch.manual_seed(11)
        out = wrapped(x, y)
        torch.manual_seed(11)
        seeds = microbatch_seeds(D, G)
        ref_opt.zero_grad()
        ref_losses, ref_logits = [], []
        for k in range(G):
            torch.manual_seed(seeds[k])
            o = ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])
            _loss_of(kind, o).backward()
            ref_losses.append(_loss_of(kind, o).detach())
            ref_logits.append(_logits_of(kind, o).detach())
        for p in ref.parameters():
            p.grad.div_(G)
        ref_opt.step()
        assert type(out) is type(_pack(kind, None, None))
        if kind == "nested":
            assert type(out[0]) is Out and type(out[0]["inner"]) is Pair
            assert type(out[0]["inner"][1]) is Triple and out[0]["step"] == 3
        if kind == "tuple_subclass":
            assert out[2] == "tag"
        torch.testing.assert_close(_loss_of(kind, out), torch.stack(ref_losses), atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits_of(kind, out), torch.cat(ref_logits), atol=1e-5, rtol=0)
        losses.append(_loss_of(kind, out))
    assert not torch.equal(losses[0], losses[-1])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, atol=1e-5, rtol=0)


def test_inference_outputs_follow_each_calls_inputs():
    """An inference model returning an OrderedDict subclass gives each call's logits, at each
    call's batch size (a new size compiles again, as it does for plain outputs)."""
    torch.manual_seed(0)
    model = Packed("ordered_dict_subclass").eval()
    wrapped = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    for rows in (4, 4, 6):
        x, y = torch.randn(rows, 6), torch.randint(0, 3, (rows,))
        out = wrapped(x, y)
        assert type(out) is Out
        torch.testing.assert_close(out["logits"], model(x, y)["logits"], atol=1e-6, rtol=0)


class Keyed(torch.nn.Module):
    """Takes its batch as one OrderedDict subclass and checks the type it is given."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, batch):
        assert type(batch) is Out, type(batch)
        h = self.a(batch["x"])
        poptorch.Block.start("b1", ipu_id=1)
        logits = self.b(h)
        return logits, F.cross_entropy(logits, batch["y"])


def test_container_subclass_inputs_are_rebuilt_per_microbatch():
    """A dict-subclass input reaches the forward as its own type, cut into micro-batches."""
    torch.manual_seed(0)
    model = Keyed()
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    _, loss = wrapped(Out(x=x, y=y))
    expected = torch.stack([ref(Out(x=x[2 * k:2 * k + 2], y=y[2 * k:2 * k + 2]))[1]
                            for k in range(4)])
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=0)


class Returns(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.a = kind, torch.nn.Linear(6, 3)

    def forward(self, x, y):
        logits = self.a(x)
        loss = F.cross_entropy(logits, y)
        if self.kind == "dataclass":
            return Result(logits, loss)
        return NeedsTwo(logits, loss)


def test_output_holding_tensors_that_cannot_be_flattened_is_refused():
    model = Returns("dataclass")
    before = copy.deepcopy(model.state_dict())
    wrapped = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    with pytest.raises(poptorch.TraceError, match=r"returns a test_structures\.Result that "
                                                  r"holds tensors.*register_dataclass"):
        wrapped(torch.randn(2, 6), torch.randint(0, 3, (2,)))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_registered_dataclass_output_is_walked():
    """The fix the refusal names works: a dataclass registered with pytree is walked."""
    @dataclasses.dataclass
    class Registered:
        logits: torch.Tensor
        loss: torch.Tensor

    torch.utils._pytree.register_dataclass(Registered)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 3)

        def forward(self, x, y):
            logits = self.a(x)
            return Registered(logits, F.cross_entropy(logits, y))

    torch.manual_seed(0)
    model = M()
    ref = copy.deepcopy(model)
    wrapped = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        x, y = torch.randn(2, 6), torch.randint(0, 3, (2,))
        out = wrapped(x, y)
        ref_opt.zero_grad()
        expected = ref(x, y)
        expected.loss.backward()
        ref_opt.step()
        assert type(out) is Registered
        torch.testing.assert_close(out.loss, expected.loss.detach(), atol=1e-6, rtol=0)


def test_container_subclass_that_cannot_be_rebuilt_is_refused():
    model = Returns("needs_two")
    wrapped = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    with pytest.raises(poptorch.TraceError, match=r"returns a test_structures\.NeedsTwo, which "
                                                  r"cannot be built again from its items"):
        wrapped(torch.randn(2, 6), torch.randint(0, 3, (2,)))
    with pytest.raises(poptorch.InputError, match=r"an input is a test_structures\.NeedsTwo"):
        poptorch.inferenceModel(torch.nn.Identity())(NeedsTwo(torch.ones(2), torch.ones(2)))


def test_doctests_of_structures():
    import doctest

    from poptorch_lite.compiler import structures

    result = doctest.testmod(structures, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("factor", [1, 2])
def test_plain_tensor_arguments_are_cut_as_any_others(factor):
    """A call of plain tensors takes a short way (its tree spec worked out once): the same
    spec, micro-batches and trace signature as the general walk gives."""
    from torch.utils import _pytree as pytree

    from poptorch_lite.runtime.batch import MicroBatches
    x, y = torch.arange(8.0).reshape(4, 2), torch.tensor(3)
    mb = MicroBatches((x, y), {}, factor, lambda: str(factor))
    assert mb.spec == pytree.tree_flatten(((x, y), {}))[1]
    assert mb.leaves == [x, y]
    assert mb.signature() == (str(mb.spec), ((4 // factor, 2), torch.float32, x.device),
                              ((), torch.int64, y.device))
    rows = 4 // factor
    for k, tensors in enumerate(mb.all_tensors()):
        assert torch.equal(tensors[0], x[k * rows:(k + 1) * rows]) and tensors[1] is y
        args, kwargs = mb.args_kwargs(k)
        assert torch.equal(args[0], tensors[0]) and args[1] is y and kwargs == {}
    with pytest.raises(poptorch.BatchSizeError, match=r"must be a multiple of 3 \+ 0 = 3"):
        MicroBatches((x, y), {}, 3, lambda: "3 + 0")  # the arithmetic, made only when refused
