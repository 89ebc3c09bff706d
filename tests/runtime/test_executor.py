"""Executor: the order actions run in, failures reported with their place in the schedule."""

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch

RECORDED = []
_lib = torch.library.Library("poptorch_lite_test", "DEF")
_lib.define("record(Tensor x, int stage) -> ()")
_lib.impl("record", lambda x, stage: RECORDED.append((stage, int(x.flatten()[0]))),
          "CompositeExplicitAutograd")


class Recording(torch.nn.Module):
    """Each stage logs (stage, micro-batch) when its forward runs; rows carry their index."""

    def __init__(self, stages):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(stages))

    def forward(self, x, y):
        h = x
        for s, fc in enumerate(self.fcs):
            poptorch.Block.start(f"s{s}", ipu_id=s)
            torch.ops.poptorch_lite_test.record(x, s)
            h = fc(h)
        return F.mse_loss(h, y)


@pytest.mark.parametrize("training", [True, False])
def test_sharded_execution_runs_each_micro_batch_through_every_stage_in_turn(training):
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.deviceIterations(1 if training else 3)
    if training:
        opts.Training.gradientAccumulation(3)
    model = Recording(3)
    wrapped = (poptorch.trainingModel(model, opts) if training
               else poptorch.inferenceModel(model, opts))
    x = torch.arange(3.0).repeat_interleave(2).reshape(3, 2)  # micro-batch i holds the value i
    wrapped.compile(x, torch.zeros(3, 2))
    RECORDED.clear()
    wrapped(x, torch.zeros(3, 2))
    assert RECORDED == [(s, i) for i in range(3) for s in range(3)]


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 2)
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, idx, y):
        with poptorch.Block("table", ipu_id=0):
            h = self.emb(idx)
        with poptorch.Block("head", ipu_id=1):
            return F.mse_loss(self.fc(h), y)


def test_a_failing_action_names_its_place_and_the_model_works_on_the_next_call():
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(2)
    model = Lookup()
    wrapped = poptorch.trainingModel(model, opts)
    y = torch.zeros(2, 2)
    with pytest.raises(poptorch.ExecutionError) as info:
        wrapped(torch.tensor([1, 9]), y)  # micro-batch 1 indexes past the table
    message = str(info.value)
    assert "action 0F1 (forward) failed on stream 0" in message
    assert "stage 0 ['table'], micro-batch 1" in message
    assert ">>   4 | 0F1" in message          # the grid with the failing row marked
    assert isinstance(info.value.__cause__, IndexError)
    loss = wrapped(torch.tensor([1, 2]), y)
    assert loss.dim() == 0 and torch.isfinite(loss)


# -- one setup per call ([Note: one setup per call] in runtime/plan.py) -------------------


@pytest.mark.parametrize("fails", [False, True])
def test_a_call_runs_in_training_mode_and_its_threads_and_leaves_the_callers_as_they_were(
        fails):
    """The caller's thread runs a one-stage model's actions itself, with the grad mode and
    intra-op threads set once for the call's runs; afterwards (also after a failure in its
    second run) the caller's own settings are back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        opts = poptorch.Options().deviceIterations(3)
        opts.Training.stopOnNonFiniteLoss(True)
        wrapped = poptorch.trainingModel(Loss(net), opts, torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = torch.randn(6, 2), torch.randn(6, 2)
        if fails:
            x[2] = float("nan")  # micro-batch 1: the second run's loss is not finite
        start = net[0].weight.detach().clone()
        torch.set_num_threads(1)
        with torch.no_grad():
            if fails:
                with pytest.raises(poptorch.ExecutionError, match="micro-batch 0 of device "
                                                                  "iteration 1"):
                    wrapped(x, y)
            else:
                wrapped(x, y)
            assert not torch.is_grad_enabled()
        assert torch.get_num_threads() == 1
        assert not torch.equal(net[0].weight, start)  # the first run's step, in either case
        if not fails:
            spans = wrapped.runStatistics().timeline.spans
            assert [(sp.run, sp.label) for sp in spans] == [
                (d, label) for d in range(3) for label in ("0F0", "0B0", "0G", "U")]
    finally:
        torch.set_num_threads(before)


class Loss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def test_runtime_docstring_examples_run():
    import doctest

    from poptorch_lite.runtime import batch, gpu, inputs, placement
    for module in (batch, gpu, inputs, placement):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
