"""What PopTorch's clients (optimum-graphcore, Graphcore's applications) use beside the core API.

Each name against PopTorch's documented behaviour, or a model using it against plain PyTorch.
"""

from __future__ import annotations

import copy
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite import _impl, errors, side_modules
from poptorch_lite import optim

from models import data, reference_training, twin
from patience import limit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_script(tmp_path, source: str) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", str(script)],
                          capture_output=True, text=True, timeout=limit(120), cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- popart and popdist beside poptorch (poptorch-lite run) ----------------------------------

def test_the_alias_provides_popart_enums_and_a_single_instance_popdist(tmp_path):
    out = run_script(tmp_path, """
        import popart, popdist, popdist.poptorch, poptorch
        opts = poptorch.Options()
        opts._Popart.set("subgraphCopyingStrategy", int(popart.SubgraphCopyingStrategy.JustInTime))
        opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                         int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized))
        print(opts._Popart.options["subgraphCopyingStrategy"],
              opts._Popart.options["accumulateOuterFragmentSettings.schedule"],
              int(popart.RecomputationType.Pipeline), int(getattr(popart.RecomputationType, "None")))
        print(popdist.isPopdistEnvSet(), popdist.getNumInstances(), popdist.getInstanceIndex(),
              popdist.getNumTotalReplicas(), type(popdist.poptorch.Options()).__name__)
    """)
    assert out.split("\n")[:2] == ["1 3 3 0", "False 1 0 1 Options"]


def test_popart_enums_have_poparts_values():
    popart = side_modules.popart_module()
    assert [int(v) for v in popart.AccumulateOuterFragmentSchedule] == [0, 1, 2, 3]
    assert popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized == 3
    assert popart.SubgraphCopyingStrategy.JustInTime == 1
    assert popart.RecomputationType.RecomputeAll == 4
    assert popart.VirtualGraphMode.Manual == 1 and popart.MergeVarUpdateType.AutoTight == 3
    assert [int(v) for v in popart.SyntheticDataMode] == [0, 1, 2]  # Off, Zeros, RandomNormal


# -- poptorch.optim.Optimizer, _impl, ipuHardwareVersion -------------------------------------

def test_poptorchs_optimizers_derive_from_poptorch_optim_optimizer():
    params = list(torch.nn.Linear(2, 1).parameters())
    for opt in (optim.SGD(params, lr=0.1), optim.Adam(params), optim.AdamW(params),
                optim.RMSprop(params), optim.LAMB(params)):
        assert isinstance(opt, optim.Optimizer) and isinstance(opt, torch.optim.Optimizer)
    for opt in (torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params)):
        assert not isinstance(opt, optim.Optimizer)  # optimum-graphcore converts these
    assert issubclass(optim.AdamW, torch.optim.AdamW)


def test_unwrap_and_rewrap_leave_a_wrapped_model_training_as_before():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            out = self.net(x)
            return out, F.cross_entropy(out, y)

    wrapped_model = WithLoss()
    ref = copy.deepcopy(wrapped_model)
    train = poptorch.trainingModel(wrapped_model, poptorch.Options(),
                                   torch.optim.SGD(wrapped_model.parameters(), lr=0.1))
    x, y = data(4, width=4, classes=2)
    train(x, y)
    tensors = [(type(t), t) for t in [*wrapped_model.parameters(), *wrapped_model.buffers()]]
    assert _impl.unwrapModelIfNecessary(wrapped_model) is None
    assert _impl.rewrapModelIfNecessary(wrapped_model) is None
    assert [(type(t), t) for t in [*wrapped_model.parameters(), *wrapped_model.buffers()]] == tensors
    assert not _impl.isWrapped(wrapped_model) and _impl.unwrapIfWrapped(model) is model
    _, loss = train(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _, ref_losses, _ = reference_training(ref, ref_opt, torch.cat([x, x]), torch.cat([y, y]),
                                          2, 1, 1)
    assert_close(loss, ref_losses[-1], atol=1e-5, rtol=0)


def test_ipu_hardware_version_is_mk2s_int():
    assert poptorch.ipuHardwareVersion() == 2 and type(poptorch.ipuHardwareVersion()) is int


# -- hints that change no numbers -------------------------------------------------------------

class Convs(torch.nn.Module):
    """Two convolutions in a MultiConv scope, and an outlining Attribute, as Graphcore's apps
    and optimum-graphcore write them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(1, 2, 3), torch.nn.Conv2d(1, 2, 3)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.MultiConv().partialsTypes(torch.float).planType(
                poptorch.MultiConvPlanType.Parallel):
            u, v = self.a(x), self.b(x)
        with poptorch.Attribute(__outline={"layer": 1}):
            out = self.head((u + v).flatten(1))
        return out, F.cross_entropy(out, y)


def test_multiconv_and_attribute_train_like_plain_pytorch():
    torch.manual_seed(0)
    model = Convs()
    ref = twin(model)
    x, y = torch.randn(8, 1, 4, 4), torch.randint(0, 3, (8,))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opts.outputMode(poptorch.OutputMode.All)
    with pytest.warns(errors.IpuOnlyWarning):
        _, loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                        lr=0.1))(x, y)
    _, ref_losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                          x, y, 1, 2, 1)
    assert_close(loss, torch.stack(ref_losses), atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, rtol=0)


def test_multiconv_setters_validate_and_chain_as_poptorchs():
    conv = poptorch.MultiConv()
    assert conv.availableMemoryProportions([0.2, 0.3]).perConvReservedTiles(8) \
        .cycleBackOff(0.5).enableConvDithering(True) is conv
    assert conv._available_memory_proportions == (0.2, 0.3)
    with pytest.raises(errors.OptionsError):
        conv.partialsTypes(torch.int32)
    with pytest.raises(errors.OptionsError):
        conv.planType(1)
    with pytest.warns(errors.IpuOnlyWarning):
        with poptorch.MultiConv() as inside:
            assert inside is None  # PopTorch's __enter__ returns nothing


# -- torch.ops.poptorch ------------------------------------------------------------------------

class NamedOps(torch.nn.Module):
    """A model calling PopTorch's ops by their torch.ops names."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, y):
        torch.ops.poptorch.push_name_scope("encoder")
        h = torch.ops.poptorch.internal_cast(torch.relu(self.a(x)), "FLOAT16")
        torch.ops.poptorch.pop_name_scope()
        out = self.b(torch.ops.poptorch.internal_cast(h, "FLOAT"))
        out = torch.ops.poptorch.nop(out)
        return out, torch.ops.poptorch.identity_loss(F.cross_entropy(out, y, reduction="none"), 1)


def test_torch_ops_poptorch_train_like_their_plain_meaning():
    torch.manual_seed(0)
    model = NamedOps()
    ref = twin(model)
    x, y = data(8, width=4, classes=2)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    out, loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                      lr=0.1))(x, y)
    ref_outs, ref_losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                                 x, y, 1, 4, 1)
    assert_close(out, torch.cat(ref_outs), atol=1e-5, rtol=0)
    assert_close(loss, torch.stack(ref_losses), atol=1e-5, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, rtol=0)
    h = torch.ops.poptorch.internal_cast(torch.ones(2), "FLOAT16")
    assert h.dtype == torch.float16
    assert torch.ops.poptorch.identity_loss(torch.tensor([1.0, 3.0]), 0) == 4.0  # 0: sum


# -- ICustomArgParser ----------------------------------------------------------------------------

class Batch:
    """A user's batch type holding the inputs and labels, plus a constant."""

    def __init__(self, x, y, note="train"):
        self.x, self.y, self.note = x, y, note


class BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.x
        yield struct.y

    def reconstruct(self, original, tensors):
        return Batch(next(tensors), next(tensors), original.note)


class TakesBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, batch):
        assert batch.note == "train"
        out = self.fc(batch.x)
        return out, F.cross_entropy(out, batch.y)


def test_custom_arg_parser_cuts_a_user_type_into_micro_batches():
    poptorch.registerCustomArgParser(Batch, BatchParser())
    torch.manual_seed(0)
    model = TakesBatch()
    ref = twin(model)
    x, y = data(8, width=4, classes=2)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = train(Batch(x, y))
    _, loss2 = train(Batch(x, y))  # a new object of the same type: the same graph
    assert len(train._programs) == 1
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _, ref_losses, _ = reference_training(_Unpacked(ref), ref_opt, torch.cat([x, x]),
                                          torch.cat([y, y]), 2, 4, 1)
    assert_close(torch.cat([loss, loss2]), torch.stack(ref_losses), atol=1e-5, rtol=0)


def test_a_second_parser_for_a_type_replaces_the_first():
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    class First(poptorch.ICustomArgParser):
        def yieldTensors(self, struct):
            yield struct.a

        def reconstruct(self, original, tensors):
            return Pair(next(tensors), original.b)

    class Both(First):
        def yieldTensors(self, struct):
            yield struct.a
            yield struct.b

        def reconstruct(self, original, tensors):
            return Pair(next(tensors), next(tensors))

    from torch.utils import _pytree as pytree
    poptorch.registerCustomArgParser(Pair, First())
    assert len(pytree.tree_flatten(Pair(torch.zeros(1), torch.ones(1)))[0]) == 1
    poptorch.registerCustomArgParser(Pair, Both())
    leaves, spec = pytree.tree_flatten(Pair(torch.zeros(1), torch.ones(1)))
    assert [t.item() for t in leaves] == [0.0, 1.0]
    assert pytree.tree_unflatten([torch.full((1,), 5.0), torch.full((1,), 6.0)], spec).b == 6.0


class _Unpacked(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(Batch(x, y))


def test_doctests_of_the_client_modules():
    import doctest
    import warnings

    from poptorch_lite import custom_args, ops
    from poptorch_lite.runtime import anchors
    from poptorch_lite.optim import precision as optim_precision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.IpuOnlyWarning)
        for module in (_impl, anchors, custom_args, ops, optim_precision, side_modules):
            result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
            assert result.failed == 0 and result.attempted > 0, module.__name__
