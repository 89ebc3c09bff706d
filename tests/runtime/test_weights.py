"""Weight homes: where parameters, gradients and optimizer state live, and the host copy."""

import copy
import io

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.runtime import stage_work
from poptorch_lite.runtime.schedule import Action, Kind
from poptorch_lite.runtime.host_sync import HostView, watch
from poptorch_lite.runtime.weights import Weights

from models import BlockMLP, data, on_device, reference_training, twin

CPU = torch.device("cpu")


def placed(model, separate, offload=False, replicas=1, separate_buffers=False, users=None):
    w = Weights(model, replicas, separate_buffers, separate_memories=separate, offload=offload)
    names = [n for n, _ in model.named_parameters()]
    w.place({0: CPU, 1: CPU}, users or [(0, names)])
    return w


def test_a_shared_home_is_the_users_own_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    w = placed(model, separate=False, replicas=2, separate_buffers=True)
    assert w.param("0.weight", 0) is model[0].weight and w.home("0.weight") is model[0].weight
    assert w.buffer("1.running_mean", 0, 0) is model[1].running_mean
    replica1 = w.buffer("1.running_mean", 1, 0)
    assert replica1 is not model[1].running_mean and torch.equal(replica1, model[1].running_mean)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model[0].weight.grad = torch.ones(2, 2)
    before = model[0].weight.detach().clone()
    with w.stepping():  # nothing to bind: the step writes the user's parameter itself
        opt.step()
    assert torch.equal(model[0].weight.detach(), before - 0.5)
    assert not w.host_stale and w.edited() == []  # and that is not a host edit


def test_a_separate_home_is_stepped_in_place_of_the_host_parameter():
    model = torch.nn.Linear(2, 2)
    w = placed(model, separate=True)
    home = w.param("weight", 0)
    assert home is not model.weight and torch.equal(home, model.weight) and home.requires_grad
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    home.grad = torch.ones(2, 2)
    host_before = model.weight.detach().clone()
    with w.stepping():
        assert model.weight.data_ptr() == home.data_ptr() and model.weight.grad is home.grad
        opt.step()
    # the home moved, the host copy did not (no round trip), the optimizer state is the home's
    assert torch.equal(home.detach(), host_before - 0.5)
    assert torch.equal(dict.__getitem__(model._parameters, "weight").detach(), host_before)
    momentum = opt.state[model.weight]["momentum_buffer"]
    assert momentum.data_ptr() not in {model.weight.data_ptr(), home.data_ptr()}
    assert w.host_stale and w.edited() == []  # the step is not a host edit
    w.to_host()
    assert torch.equal(model.weight.detach(), home.detach()) and not w.host_stale
    assert model.weight.grad is None  # the host's own: [Note: host gradients]


def test_host_edits_are_pushed_and_never_overwritten_by_a_sync():
    model = torch.nn.Linear(2, 2)
    w = placed(model, separate=True)
    home_w, home_b = w.param("weight", 0), w.param("bias", 0)
    with torch.no_grad():
        home_w.add_(1.0)
        home_b.add_(1.0)
    w.host_stale = True
    with torch.no_grad():
        model.bias.fill_(7.0)  # an edit on the host while the devices are newer
    assert w.edited() == [model.bias]
    w.to_host()  # the weight comes back, the edited bias keeps its edit
    assert torch.equal(model.weight, home_w) and torch.equal(model.bias, torch.full((2,), 7.0))
    w.to_device(everything=False)
    assert torch.equal(home_b, torch.full((2,), 7.0))


def test_a_read_exposes_the_host_copy_and_the_next_push_carries_its_data_edits():
    """An edit through ``.data`` moves no version; a read of the model (or a sync) marks the
    host copy exposed, and the next push writes all of it to the copies ([Note: weight sync]
    in host_sync). Where homes are shared there is nothing to push."""
    model = torch.nn.Linear(2, 2)
    w = placed(model, separate=True)
    home = w.param("weight", 0)
    model.weight.data.mul_(2)  # no version moves, and the model is not watched: unseen
    assert not w.exposed and not w.edits()
    w.to_host()  # copyWeightsToHost: the host copy is in the user's hands
    assert w.exposed and w.edits() and w.edited() == []
    w.to_device(everything=False)
    assert torch.equal(home, model.weight) and not w.exposed and not w.edits()
    release = watch(model, w, owner=w)
    model.bias.data.clamp_(0.0, 0.0)  # the read of model.bias exposes the host copy
    assert w.exposed and w.edits()
    w.to_device(everything=False)
    assert torch.equal(w.param("bias", 0), torch.zeros(2))
    release()
    assert type(model._parameters) is dict
    shared = placed(torch.nn.Linear(2, 2), separate=False)
    shared.to_host()
    assert shared.exposed and not shared.edits()  # the stages compute with the host's own


def test_offloaded_weights_step_on_the_host_and_refresh_the_stage_copies():
    model = torch.nn.Linear(2, 2)
    w = placed(model, separate=True, offload=True)
    copy_w = w.param("weight", 0)
    assert w.home("weight") is model.weight and copy_w is not model.weight
    copy_w.grad = torch.ones(2, 2)
    assert torch.equal(w.gather_grad("weight"), torch.ones(2, 2)) and copy_w.grad is None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with w.stepping():
        opt.step()
    w.after_step()
    assert torch.equal(copy_w, model.weight) and not w.host_stale


def test_a_tied_weight_has_a_visitor_copy_whose_gradient_joins_the_homes():
    model = torch.nn.Linear(2, 2)
    w = placed(model, separate=True, users=[(0, ["weight", "bias"]), (1, ["weight"])])
    home, visitor = w.param("weight", 0), w.param("weight", 1)
    assert home is not visitor and w.home_of["weight"] == 0
    home.grad, visitor.grad = torch.ones(2, 2), torch.full((2, 2), 2.0)
    assert torch.equal(w.gather_grad("weight"), torch.full((2, 2), 3.0))
    with torch.no_grad():
        home.sub_(1.0)
    w.after_step()
    assert torch.equal(visitor, home)


def trained_on_the_ipu_model(batchnorm=False):
    """A 2-stage model after one call under useIpuModel, its wrapper, its plain twin, the data."""
    torch.manual_seed(0)
    model = BlockMLP(2, batchnorm=batchnorm)
    ref = twin(model)
    opts = poptorch.Options().useIpuModel(True)
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(8)
    train(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 4, 1)
    return model, train, ref, x, y


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "ipu_model"])
def test_values_crossing_ipus_are_copied_only_into_a_memory_of_their_own(separate):
    torch.manual_seed(0)
    opts = poptorch.Options().useIpuModel(separate).deviceIterations(2)
    infer = poptorch.inferenceModel(BlockMLP(2), opts)
    x, y = data(4)
    infer(x, y)
    ex = next(iter(infer._programs.values())).executor
    work = ex.work
    run = stage_work.Run([list(x[:2].split(2)) + [y[:2]]], lambda i: 0, None,
                         stage_work.WorkState(ex.partition.num_stages))
    with torch.no_grad():
        work.forward(Action(Kind.FORWARD, 0, 0), run, None)
        args, _ = work.args(1, run, 0, CPU)
    crossing = [n for n in work.stages[1].inputs if n in run.values[0]]
    assert crossing
    for name in crossing:
        arg = args[work.stages[1].inputs.index(name)]
        shared = arg.data_ptr() == run.values[0][name].data_ptr()
        assert shared is not separate and torch.equal(arg, run.values[0][name])
    infer.destroy()


def test_host_view_syncs_on_read_and_pickles_as_a_plain_dict():
    model, train, ref, _, _ = trained_on_the_ipu_model()
    assert isinstance(model.layers[0]._parameters, HostView)
    assert train._weights.host_stale
    assert_close(model.layers[0].weight, ref.layers[0].weight, atol=1e-6, rtol=0)  # a read syncs
    assert not train._weights.host_stale
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert type(copy.deepcopy(model).layers[0]._parameters) is dict
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False).layers[0]._parameters) is dict
    train.destroy()
    assert type(model.layers[0]._parameters) is dict


@pytest.mark.parametrize("read", ["attribute", "parameters", "state_dict", "call", "wrapper",
                                  "inference", "collected"])
def test_every_read_of_the_model_sees_the_trained_values(read):
    model, train, ref, x, y = trained_on_the_ipu_model(batchnorm=True)
    if read == "attribute":
        got = {"head.weight": model.head.weight, "bn.running_mean": model.bn.running_mean}
    elif read == "parameters":
        got = dict(model.named_parameters())
    elif read == "state_dict":
        got = model.state_dict()
    elif read == "call":
        model.eval()
        assert_close(model(x, y)[0], ref.eval()(x, y)[0], atol=1e-6, rtol=0)
        got = {"head.weight": dict.__getitem__(model.head._parameters, "weight")}
    elif read == "wrapper":
        got = {"head.weight": train.head.weight}
    elif read == "inference":
        opts = poptorch.Options().useIpuModel(True).setExecutionStrategy(
            poptorch.ShardedExecution())
        out, _ = poptorch.inferenceModel(model.eval(), opts)(x, y)
        assert_close(out, ref.eval()(x, y)[0], atol=1e-6, rtol=0)
        got = {"head.weight": dict.__getitem__(model.head._parameters, "weight")}
    else:  # a wrapper dropped without destroy() leaves its values in the model
        del train
        import gc
        gc.collect()
        got = {"head.weight": dict.__getitem__(model.head._parameters, "weight")}
    expected = ref.state_dict()
    for name, value in got.items():
        assert_close(value.detach(), expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", ["sequential", "grouped", "interleaved"])
@pytest.mark.parametrize("offload", [False, True], ids=["on_chip", "offloaded"])
def test_ipu_model_and_offloading_match_plain_pytorch_over_calls(schedule, offload):
    torch.manual_seed(0)
    model, G, D = BlockMLP(2, batchnorm=True), 3, 2
    ref = twin(model)
    opts = poptorch.Options().useIpuModel(True).deviceIterations(D).setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=schedule))
    opts.Training.gradientAccumulation(G)
    if offload:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(3):
        x, y = data(2 * G * D, seed=call)
        _, loss = train(x, y)
        _, ref_losses, _ = reference_training(ref, ref_opt, x, y, D, G, 1)
        assert_close(loss, ref_losses[-1], atol=1e-5, rtol=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    sa, sb = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for k in sb:
        for key in sb[k]:
            assert_close(sa[k][key], sb[k][key], atol=1e-5, rtol=0)
    assert train._weights.offload is offload
    homes = {train._weights.home(n).data_ptr() for n, _ in model.named_parameters()}
    hosts = {dict.__getitem__(m._parameters, n).data_ptr() for m in model.modules()
             for n in m._parameters}
    assert (homes == hosts) is offload  # on chip: every parameter has its own memory
    train.destroy()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["on_chip", "offloaded"])
def test_on_a_gpu_the_optimizer_state_lives_where_its_stage_runs(offload):
    torch.manual_seed(0)
    model = BlockMLP(2)
    ref = twin(model)
    opts = poptorch.Options().set_ipu_devices("cuda:0")
    opts.Training.gradientAccumulation(4)
    if offload:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    x, y = data(8)
    train(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), x, y, 1, 4, 1)
    kind = {s["momentum_buffer"].device.type for s in opt.state.values()}
    assert kind == ({"cpu"} if offload else {"cuda"})
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert a.device.type == "cpu"
        assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    train.destroy()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tied_weight_homed_on_a_gpu_and_used_on_the_host_matches_plain_pytorch():
    """The host stage computes with the user's parameter itself: a visitor that is the host
    copy gets its gradient gathered into the GPU home and its value refreshed after the step."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            with poptorch.Block("a", ipu_id=0):
                h = torch.relu(self.fc(x))
            with poptorch.Block("b", ipu_id=1):
                out = self.fc(h)
                return out, torch.nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    model = Tied()
    ref = twin(model)
    opts = poptorch.Options().set_ipu_devices({0: "cuda:0", 1: "cpu"}).setExecutionStrategy(
        poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(2)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for call in range(2):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        train(x, y)
        ref_opt.zero_grad()
        for xs, ys in zip(x.split(2), y.split(2)):
            (ref(xs, ys)[1] / 2).backward()
        ref_opt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    train.destroy()


def test_host_edits_reach_replica_0s_buffers_and_the_other_replicas_keep_theirs(device):
    """With ``broadcastBuffers(False)`` the host copy is replica 0's: a host edit of a buffer
    (in place, its version moves) and a read that exposes the host copy ([Note: weight sync]
    in host_sync: every tensor is pushed) reach replica 0's copies, and replica 1 keeps the
    statistics its own runs left, as where the memory is shared (the CPU)."""
    def trained(dev):
        torch.manual_seed(0)
        model = BlockMLP(2, batchnorm=True)
        opts = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
        opts.Training.gradientAccumulation(3)
        train = poptorch.trainingModel(model, on_device(opts, dev),
                                       torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for call in range(3):
            losses.append(train(*data(2 * 3 * 2, seed=call))[1])
            with torch.no_grad():
                model.bn.running_mean.mul_(0.5)
            model.layers[0].weight.data.clamp_(-0.1, 0.1)
        replica1 = {n: train._weights.buffer(n, 1, 1).detach().cpu().clone()
                    for n in ("bn.running_mean", "bn.running_var")}
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train.destroy()
        return losses, replica1, state

    expected, got = trained("cpu"), trained(device)
    # Separate memories sum the replicas' gradients in another order than the CPU's shared
    # one: the contract's 1e-5 (README, 'What "the numbers are plain PyTorch's" covers'); an
    # AMD EPYC machine's float32 sums put layers.2.bias 1.2e-6 apart after three calls.
    for a, b in zip(got[0], expected[0]):
        assert_close(a, b, atol=1e-5, rtol=0)
    for part in (1, 2):
        for name in expected[part]:
            assert_close(got[part][name], expected[part][name], atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(expected[1]["bn.running_mean"], expected[2]["bn.running_mean"])
