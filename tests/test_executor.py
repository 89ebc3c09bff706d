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
