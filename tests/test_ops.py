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


def add_one(x):
    return x + 1.0


def test_begin_block_takes_int_ids_a_function_and_module_repr_shows_the_blocks():
    """PopTorch's pipelining_test: int user_ids; BeginBlock(function) gives a module that
    saves; module_repr (and the wrapper's repr) show each block before its module, copies
    included."""
    l1, l2 = torch.nn.ReLU(), torch.nn.ReLU()
    model = torch.nn.Sequential(l1, l2)
    assert "BeginBlock(" not in poptorch.module_repr(model)
    poptorch.BeginBlock(l2, user_id=1, ipu_id=2)
    expected = "Sequential(\n  (0): ReLU()\n  (1): BeginBlock(user_id=1, ipu_id=2) ReLU()\n)"
    assert poptorch.module_repr(model) == expected
    assert poptorch.module_repr(copy.deepcopy(model)) == expected
    assert repr(poptorch.inferenceModel(model)) == f"inferenceModel({expected})"
    block = poptorch.BeginBlock(add_one, 1, 2)
    assert isinstance(block, torch.nn.Module) and (block._user_id, block._ipu_id) == (1, 2)
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(torch.zeros(1)), torch.ones(1))
    with pytest.raises(poptorch.BlockError, match="user_id must be a str .or an int"):
        poptorch.BeginBlock(torch.nn.ReLU(), user_id=1.5)


class IntBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = poptorch.BeginBlock(torch.nn.Linear(2, 2), user_id=7, ipu_id=1)

    def forward(self, x):
        return self.b(poptorch.BeginBlock(torch.relu, user_id=3, ipu_id=0)(self.a(x)))


def test_int_block_ids_are_their_str_for_stages():
    model = IntBlocks()
    opts = poptorch.Options().deviceIterations(2).setExecutionStrategy(
        poptorch.PipelinedExecution(poptorch.Stage("3"), poptorch.Stage("7")))
    infer = poptorch.inferenceModel(model, opts)
    x = torch.randn(4, 2)
    torch.testing.assert_close(infer(x), model(x).detach())
    stages = next(iter(infer._programs.values())).partition.stages
    assert [(st.blocks, st.ipu) for st in stages] == [(("3",), 0), (("7",), 1)]


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


class Looped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x, y):
        def body(h, total):
            h = torch.tanh(self.fc(h))
            return h, total + h.sum(1)
        h, total = poptorch.for_loop(3, body, [x, torch.zeros(x.shape[0])])
        return h, torch.nn.functional.mse_loss(total, y)


def test_for_loop_runs_its_body_count_times_and_trains_as_the_plain_loop():
    torch.manual_seed(0)
    model = Looped()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3), torch.randn(4)
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = train(x, y)
    h, total = x, torch.zeros(4)
    for _ in range(3):
        h = torch.tanh(ref.fc(h))
        total = total + h.sum(1)
    ref_loss = torch.nn.functional.mse_loss(total, y)
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    with pytest.raises(poptorch.InputError, match=r"to be a list of tensors\. \(Object is not"):
        poptorch.for_loop(2, torch.tanh, (x,))
    with pytest.raises(poptorch.InputError, match="at index 1 is not torch.tensor"):
        poptorch.for_loop(2, torch.tanh, [x, 1.0])


class MakesIntegers(torch.nn.Module):
    def forward(self, x):
        return (torch.randint(0, 10, (3,)), torch.randperm(5), torch.arange(4),
                x.argmax(1), (x * 10).int())


def test_integer_results_keep_plain_pytorchs_dtypes():
    """README, "Where poptorch_lite departs from PopTorch on purpose": PopTorch returns int32
    (an IPU has no 64-bit integers); the results here are plain PyTorch's."""
    x = torch.randn(2, 3)
    got = poptorch.inferenceModel(MakesIntegers())(x)
    plain = MakesIntegers()(x)
    assert [t.dtype for t in got] == [t.dtype for t in plain] == [torch.int64] * 4 + [torch.int32]
    assert torch.equal(got[2], plain[2]) and torch.equal(got[3], plain[3])
