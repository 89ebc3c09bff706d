"""Ops and annotations on their own: return values, refusals, surviving copies."""

import copy
import io

import pytest
import torch

import poptorch_lite as poptorch


def test_identity_loss_reduces_and_refuses_other_reductions():
    x = torch.tensor([1.0, 2.0, 6.0])
    assert poptorch.identity_loss(x, "sum").item() == 9.0
    assert poptorch.identity_loss(x, "mean").item() == 3.0
    assert poptorch.identity_loss(x, "none") is x
    with pytest.raises(poptorch.OptionsError, match="Unsupported reduction type 'max'"):
        poptorch.identity_loss(x, "max")
    with pytest.raises(poptorch.InputError, match="needs a tensor, got float"):
        poptorch.identity_loss(3.0, "mean")


def test_recomputation_checkpoint_returns_its_inputs_in_their_container():
    a, b = torch.ones(1), torch.zeros(1)
    assert poptorch.recomputationCheckpoint(a) is a
    assert poptorch.recomputationCheckpoint(a, b) == (a, b)
    assert poptorch.recomputationCheckpoint([a, b]) == [a, b]
    with pytest.raises(poptorch.InputError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(a, 1.0)


def test_ipu_print_tensor_prints_every_time_the_wrapped_model_runs(capsys):
    class Printing(torch.nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x * 2, "value=")

    model = poptorch.inferenceModel(Printing(), poptorch.Options().deviceIterations(2))
    out = model(torch.tensor([1.0, 2.0]))
    assert torch.equal(out, torch.tensor([2.0, 4.0]))
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["value=tensor([2.])", "value=tensor([4.])"]  # once per micro-batch


def test_begin_block_twice_is_refused_and_remove_blocks_allows_it_again():
    layer = torch.nn.Linear(2, 2)
    assert poptorch.BeginBlock(layer, "a", ipu_id=0) is layer
    with pytest.raises(poptorch.BlockError, match="already been assigned to a block"):
        poptorch.BeginBlock(layer, "b", ipu_id=1)
    poptorch.removeBlocks(layer)
    poptorch.BeginBlock(layer, "b", ipu_id=1)
    with pytest.raises(poptorch.BlockError, match="needs an nn.Module or a callable"):
        poptorch.BeginBlock(3)
    with pytest.raises(poptorch.BlockError, match="ipu_id must be a non-negative int"):
        poptorch.Block("x", ipu_id=-1)


def test_annotated_models_survive_deepcopy_and_torch_save():
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    poptorch.set_pipeline_stage_assignment(seq, [0, 0, 1])
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(seq), torch.load(buffer, weights_only=False)):
        wrapped = poptorch.inferenceModel(
            clone, poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution()))
        wrapped(torch.ones(3, 2))
        part = next(iter(wrapped._programs.values())).partition
        assert [(st.ipu, st.blocks) for st in part.stages] == [(0, ("stage0",)), (1, ("stage1",))]


def test_block_ids_are_auto_numbered_and_blocks_with_one_id_merge():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            poptorch.Block.useAutoId()
            with poptorch.Block(ipu_id=0):
                x = self.a(x)
            with poptorch.Block(ipu_id=1):
                x = self.b(x)
            with poptorch.Block("1"):  # re-enters block "1"
                return x * 2

    wrapped = poptorch.inferenceModel(Twice(), poptorch.Options().deviceIterations(2))
    wrapped(torch.ones(4, 2))
    part = next(iter(wrapped._programs.values())).partition
    assert [(st.ipu, st.blocks) for st in part.stages] == [(0, ("0",)), (1, ("1",))]


def test_log_level_names_and_ipu_availability():
    poptorch.setLogLevel("WARN")
    with pytest.raises(poptorch.OptionsError, match="Unknown log level 'LOUD'"):
        poptorch.setLogLevel("LOUD")
    assert poptorch.ipuHardwareIsAvailable(4) is True
