"""One CUDA graph per step ([Note: step graphs] in poptorch_lite/runtime/step_graph.py).

On the GPU twin (tests/support/gpu_twin.py) a capture records every aten op and runs nothing; a
replay runs the record again on the same memory, with the numbers it was recorded with. So
a replay that reads last run's inputs, a learning rate baked in and not captured again, a
dropout mask from the wrong generator, or outputs read before the replay landed all give
other numbers than the eager path here, as on a GPU. The stages run their own kernels
(``backend="eager"``, or AOTAutograd's), so the replay must equal the eager path bit for
bit; on CUDA (``benchmarks/gpu_check.sh``) the same tests run on the GPU.
"""

import contextlib
import copy
import logging
import threading

import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.errors import ExecutionError, OptionsError
from poptorch_lite.optim.loss_scale import LossScale
from poptorch_lite.runtime.gpu import CaptureFailed
from poptorch_lite.runtime.stage_work import StageWork
from poptorch_lite.runtime.update import StepArithmetic, Update, graph_refusal

from conftest import DEVICE_MARKS
import gpu_twin
from gpu_twin import TWIN, TwinGpu, TwinGraph
from models import GRAD_CODE, BlockMLP, GradCodeMLP, data, on_device

GPUS = ["gpu_twin"] + ([pytest.param("cuda", marks=DEVICE_MARKS["cuda"])]
                       if torch.cuda.is_available() else [])


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def train(model, device, graph, *, D=4, G=4, calls=2, schedule="grouped", optimizer=sgd,
          backend="eager", recompute=False, between=None, batch=2, options=None):
    """``calls`` training calls of ``model`` (a fresh copy); with ``graph``, steps captured
    as a CUDA graph, else run eagerly. Returns (losses, state_dict, optimizer state, program)."""
    torch.manual_seed(0)
    model = copy.deepcopy(model)
    if hasattr(model, "install_hooks"):
        model.install_hooks()
    opt = optimizer(model.parameters())
    opts = poptorch.Options().deviceIterations(D).setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=schedule)).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    opts.compileStages(True, backend=backend, cuda_graph=graph)
    on_device(opts, device)
    if options is not None:
        options(opts)
    wrapper = poptorch.trainingModel(model, opts, opt)
    losses = []
    for call in range(calls):
        x, y = data(batch * G * D, seed=call)
        torch.manual_seed(10 + call)
        losses.append(wrapper(x, y)[1].flatten())
        if between is not None:
            between(call, wrapper, model, opt)
    program = next(iter(wrapper._state.programs.values()))
    wrapper.copyWeightsToHost()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = [{k: v.detach().cpu().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
               for s in opt.state.values()]
    wrapper.destroy()
    return torch.cat(losses).cpu(), state, moments, program


def assert_same(a, b):
    """Losses, every parameter and buffer, and the optimizer state, bit for bit."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
    assert len(a[2]) == len(b[2])
    for sa, sb in zip(a[2], b[2]):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def counts(program) -> tuple:
    r = program.graph.report
    return r.captures, r.recaptures, r.replays, r.eager_runs


# -- the replay is the eager path -----------------------------------------------------------

@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("schedule,dropout,recompute", [
    ("grouped", 0.3, False), ("interleaved", 0.0, True), ("zero_bubble", 0.3, False),
    ("gpipe", 0.0, False)])
def test_replayed_steps_equal_the_eager_path_bit_for_bit(device, schedule, dropout, recompute):
    """Two calls of 4 device iterations: 2 warm-up runs, a capture, and 6 replays whose
    inputs, dropout masks, losses, weights, BatchNorm statistics and momenta are the eager
    path's; each run says how it ran."""
    model = BlockMLP(2, dropout=dropout, batchnorm=True)
    eager = train(model, device, graph=False, schedule=schedule, recompute=recompute)
    graphed = train(model, device, graph=True, schedule=schedule, recompute=recompute)
    assert_same(eager, graphed)
    program = graphed[3]
    assert counts(program) == (1, 0, 6, 2)
    assert program.executor.update.steps_applied == 8  # replays count their steps
    assert program.graph.report.parts == (
        "every stage action of 4 micro-batches", "the reduction", "the optimizer's step")
    assert eager[3].graph is None  # cuda_graph=False: nothing captured


@pytest.mark.parametrize("case", ["replicas", "sum", "sharded", "accumulator", "clipped",
                                  "per_replica_buffers", "final_output"])
def test_every_configuration_replays_as_it_runs(twin_gpu_installed, case):
    """Replicas run in turn, the Sum reduction, a sharded model, an accumulator dtype,
    gradient clipping, replicas with buffers of their own, and the final micro-batch's
    outputs only: captured, replayed, the eager path's numbers."""
    def popsgd(params):  # float16 accumulators: float32 gradients are moved into them
        return poptorch.optim.SGD(params, lr=0.05, momentum=0.9, max_grad_norm=0.5) if (
            case == "clipped") else poptorch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                       accum_type=torch.float16)

    options = {
        "replicas": lambda o: o.replicationFactor(2),
        "per_replica_buffers": lambda o: o.replicationFactor(2).broadcastBuffers(False),
        "sum": lambda o: o.Training.accumulationAndReplicationReductionType(
            poptorch.ReductionType.Sum),
        "sharded": lambda o: o.setExecutionStrategy(poptorch.ShardedExecution()),
        "final_output": lambda o: o.outputMode(poptorch.OutputMode.Final),
    }.get(case)
    optimizer = popsgd if case in ("accumulator", "clipped") else sgd
    model = BlockMLP(2, batchnorm=case == "per_replica_buffers")
    kw = dict(options=options, optimizer=optimizer, batch=4)  # BatchNorm: 2 rows a replica
    eager = train(model, "gpu_twin", graph=False, **kw)
    graphed = train(model, "gpu_twin", graph=True, **kw)
    assert_same(eager, graphed)
    assert counts(graphed[3]) == (1, 0, 6, 2)


@pytest.mark.parametrize("kind", sorted(GRAD_CODE))
def test_models_that_stop_gradients_or_edit_their_input_replay_as_they_run(kind):
    """PopTorch's suite found the contract broken where a model stops a gradient or edits
    its input in place: every such kind, its input halved in place, replays as it runs
    eagerly (or stays eager, where its hooks would run only at the capture)."""
    with poptorch_twin():
        model = GradCodeMLP(kind, edit_input=True)
        eager = train(model, "gpu_twin", graph=False, calls=1)
        graphed = train(model, "gpu_twin", graph=True, calls=1)
    assert_same(eager, graphed)
    report = graphed[3].graph.report
    if kind == "parameter_hook":
        assert report.refused.startswith("a parameter has gradient hooks")
        assert counts(graphed[3]) == (0, 0, 0, 4)
    else:
        assert report.refused is None and counts(graphed[3]) == (1, 0, 2, 2)


def poptorch_twin():
    from poptorch_lite.runtime import gpu
    return gpu.installed(TwinGpu())


@pytest.mark.parametrize("device", GPUS)
def test_an_aot_compiled_step_replays_what_its_compiled_stages_run(device,
                                                                   every_stage_compiles):
    """AOTAutograd's graphs inside the CUDA graph: the replay equals the compiled stages
    launched op by op."""
    model = BlockMLP(2, dropout=0.3)
    launched = train(model, device, graph=False, backend="aot_eager", schedule="zero_bubble")
    graphed = train(model, device, graph=True, backend="aot_eager", schedule="zero_bubble")
    assert_same(launched, graphed)
    assert counts(graphed[3]) == (1, 0, 6, 2)
    assert set(graphed[3].compiled.summary().values()) <= {"compiled", "reused"}


@pytest.mark.parametrize("device", GPUS)
def test_the_tutorials_mnist_pipeline_replays_as_it_runs(device):
    """examples/mnist_pipelined.py's network, options and optimizer (PopTorch's SGD with
    momentum, an exponential learning-rate schedule stepped after each call): three calls of
    three steps, captured, captured again for the new learning rate, then with the optimizer's
    step out of the graph; the eager path's numbers throughout."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    from mnist_pipelined import Network, parser, strategy

    args = parser.parse_args(["--gradient-accumulation", "4", "--batch-size", "4"])
    torch.manual_seed(0)
    net, results = Network(), {}
    for graph in (False, True):
        model = copy.deepcopy(net)
        opts = on_device(poptorch.Options().deviceIterations(3).randomSeed(1), device)
        opts.Training.gradientAccumulation(4)
        opts.setExecutionStrategy(strategy(args)).compileStages(True, "eager", graph)
        opt = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.3)
        wrapper = poptorch.trainingModel(model, opts, opt)
        losses = []
        for call in range(3):
            g = torch.Generator().manual_seed(call)
            x, y = torch.randn(48, 1, 28, 28, generator=g), torch.randint(0, 10, (48,), generator=g)
            losses.append(wrapper(x, y)[1].flatten())
            scheduler.step()
            wrapper.setOptimizer(opt)
        program = next(iter(wrapper._state.programs.values()))
        wrapper.copyWeightsToHost()
        results[graph] = (torch.cat(losses).cpu(),
                          {k: v.clone() for k, v in model.state_dict().items()},
                          [{k: v.clone() for k, v in st.items()} for st in opt.state.values()],
                          program)
        wrapper.destroy()
    assert_same(results[False], results[True])
    assert counts(results[True][3]) == (3, 2, 7, 2)
    assert results[True][3].graph.report.parts[-1] == "the reduction"


def test_a_replay_is_one_span_of_the_timeline(twin_gpu_installed):
    """runStatistics after a call: the eager runs' actions, then one "C" span per replayed run
    on the update's stream; each run says how it ran."""
    model = BlockMLP(2)
    opts = on_device(poptorch.Options().deviceIterations(4).compileStages(True, "eager"),
                     "gpu_twin")
    opts.Training.gradientAccumulation(4)
    wrapper = poptorch.trainingModel(model, opts, sgd(model.parameters()))
    wrapper(*data(32, seed=0))
    first = wrapper.runStatistics().timeline
    assert [(p.run, p.stream) for p in first.spans if p.kind == "C"] == [(2, 0), (3, 0)]
    assert {p.run for p in first.spans if p.kind != "C"} == {0, 1}
    assert [r.graph for r in wrapper._state.last_run[1]] == [None, None, "captured", "replayed"]
    wrapper(*data(32, seed=1))
    second = wrapper.runStatistics().timeline
    assert [(p.label, p.run) for p in second.spans] == [("C", k) for k in range(4)]
    assert "C step graph" in second.render()
    wrapper.destroy()


def test_inference_replays_equal_the_eager_outputs(twin_gpu_installed):
    """An inference model is captured on its third call (one run per call) and its outputs
    come back from the graph's memory, copied after each replay."""
    model = BlockMLP(2).eval()
    outs = {}
    for graph in (False, True):
        opts = on_device(poptorch.Options().deviceIterations(3).compileStages(
            True, backend="eager", cuda_graph=graph), "gpu_twin")
        infer = poptorch.inferenceModel(copy.deepcopy(model), opts)
        outs[graph] = [infer(*data(6, seed=k))[0] for k in range(5)]
        program = next(iter(infer._state.programs.values()))
        infer.destroy()
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    assert counts(program) == (1, 0, 3, 2)
    assert program.graph.report.parts == ("the forwards of 3 micro-batches",)


@pytest.fixture
def twin_gpu_installed():
    with poptorch_twin() as twin:
        yield twin


# -- what a capture bakes in ----------------------------------------------------------------

def test_a_changed_learning_rate_is_captured_again_then_leaves_the_graph(twin_gpu_installed,
                                                                           caplog):
    """A capture bakes the learning rate in: a new one captures the step again; a second
    change (a schedule) leaves the optimizer's step out of the graph, run eagerly after each
    replay; the numbers are the eager path's throughout."""
    def new_lr(call, wrapper, model, opt):
        opt.param_groups[0]["lr"] *= 0.5
        wrapper.setOptimizer(opt)

    model = BlockMLP(2)
    eager = train(model, "gpu_twin", graph=False, calls=4, between=new_lr)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        graphed = train(model, "gpu_twin", graph=True, calls=4, between=new_lr)
    assert_same(eager, graphed)
    report = graphed[3].graph.report
    assert counts(graphed[3]) == (3, 2, 14, 2)
    assert "hyperparameters changed between runs" in report.eager["optimizer step"]
    assert report.parts == ("every stage action of 4 micro-batches", "the reduction")
    assert "capturing the step on cpu:0 again: the optimizer's hyperparameters" in caplog.text


def test_the_host_reads_what_replays_trained_and_its_edits_reach_them(twin_gpu_installed):
    """After a call of replays only, the model read on the host has the steps' weights; a
    weight edited on the host is pushed into the memory the graph reads."""
    def read_and_edit(seen):
        def between(call, wrapper, model, opt):
            seen.append(model.head.weight.detach().clone())
            with torch.no_grad():
                model.layers[0].weight.mul_(0.5)
        return between

    model, seen_eager, seen_graphed = BlockMLP(2), [], []
    assert_same(train(model, "gpu_twin", graph=False, calls=3, between=read_and_edit(seen_eager)),
                train(model, "gpu_twin", graph=True, calls=3,
                      between=read_and_edit(seen_graphed)))
    for a, b in zip(seen_eager, seen_graphed, strict=True):
        assert torch.equal(a, b)


def test_data_edits_and_freezing_between_calls_reach_the_replays(twin_gpu_installed):
    """WGAN's clipping through ``.data`` (no version moves), and the first layer frozen after
    the first call, unfrozen after the second, frozen again after the third: the replays give
    the numbers of the CPU's shared homes, which compute with the user's own parameters. Each
    set of trainable parameters has a program of its own, so no capture outlives a freeze:
    the first program captures again when it comes back (the other program's placement moved
    the weights' tables), the frozen one replays its own capture ([Note: trainable
    parameters] in runtime/compiled.py)."""
    programs = []

    def clip_and_freeze(call, wrapper, model, opt):
        for p in model.parameters():
            p.data.clamp_(-0.2, 0.2)
        model.layers[0].requires_grad_(call % 2 == 1)
        programs[:] = wrapper._state.programs.values()

    model = BlockMLP(2)
    shared = train(model, "cpu", graph=False, calls=4, between=clip_and_freeze)
    graphed = train(model, "gpu_twin", graph=True, calls=4, between=clip_and_freeze)
    assert_same(shared, graphed)
    assert [counts(p) for p in programs] == [(2, 1, 6, 2), (1, 0, 6, 2)]


def test_an_optimizer_that_is_not_graph_safe_steps_after_the_replay(twin_gpu_installed):
    """Adam with capturable=False: the graph ends with the reduction, the step runs eagerly."""
    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    model = BlockMLP(2, dropout=0.3)
    eager = train(model, "gpu_twin", graph=False, optimizer=adam)
    graphed = train(model, "gpu_twin", graph=True, optimizer=adam)
    assert_same(eager, graphed)
    report = graphed[3].graph.report
    assert report.parts == ("every stage action of 4 micro-batches", "the reduction")
    assert report.eager["optimizer step"].startswith("Adam was built with capturable=False")


def test_a_parameter_no_stage_reads_steps_after_a_replay_as_after_an_eager_run(
        twin_gpu_installed):
    """The user gave a layer the forward never calls a gradient and stepped it on the host
    after the first call: plain PyTorch's next steps clear it, and Adam skips the layer. A
    replay set the gradients the graph made and left the user's on that layer, so the step
    after the replay moved it by Adam's learning rate (the fuzzer, seed 176). The user's
    gradient is still handed back after each call."""
    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    handed_back = {}

    def host_step(call, wrapper, model, opt):
        if call == 0:
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5)
            opt.step()
        handed_back.setdefault(call, []).append(model.unused.weight.grad)

    model = BlockMLP(2)
    model.unused = torch.nn.Linear(4, 4)
    eager = train(model, "gpu_twin", graph=False, optimizer=adam, calls=4, between=host_step)
    graphed = train(model, "gpu_twin", graph=True, optimizer=adam, calls=4, between=host_step)
    assert counts(graphed[3]) == (1, 0, 14, 2)  # 16 runs: 2 eager, then replays
    assert_same(eager, graphed)
    for call, (a, b) in handed_back.items():
        assert torch.equal(a, b) and torch.equal(a, torch.full((4, 4), 0.5)), call


def test_an_inference_replay_leaves_the_users_gradients(twin_gpu_installed):
    """Gradients the user set on the host survive inference calls, replays as eager runs."""
    def infer(graph):
        torch.manual_seed(0)
        model = BlockMLP(2).eval()
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opts = poptorch.Options().deviceIterations(4).compileStages(True, backend="eager",
                                                                    cuda_graph=graph)
        on_device(opts, "gpu_twin")
        wrapper = poptorch.inferenceModel(model, opts)
        outs = [wrapper(*data(8, seed=c))[0] for c in range(4)]
        program = next(iter(wrapper._state.programs.values()))
        wrapper.destroy()
        return outs, [p.grad for p in model.parameters()], program

    eager, graphed = infer(False), infer(True)
    assert counts(graphed[2]) == (1, 0, 2, 2)  # two eager calls, then replays
    for a, b in zip(eager[0], graphed[0], strict=True):
        assert torch.equal(a, b)
    for grad in graphed[1]:
        assert torch.equal(grad, torch.full_like(grad, 0.5))


@pytest.mark.parametrize("device", GPUS[1:])
def test_a_tensor_learning_rate_changes_without_a_new_capture(device):
    """Adam built with capturable=True and a learning rate in device memory: the graph reads
    it there, so a schedule that changes it in place needs no new capture."""
    def adam(params):
        return torch.optim.Adam(params, lr=torch.tensor(0.01, device=device), capturable=True)

    def decay(call, wrapper, model, opt):
        opt.param_groups[0]["lr"].mul_(0.5)

    model = BlockMLP(2, dropout=0.3)
    eager = train(model, device, graph=False, calls=3, optimizer=adam, between=decay)
    graphed = train(model, device, graph=True, calls=3, optimizer=adam, between=decay)
    assert_same(eager, graphed)
    assert counts(graphed[3]) == (1, 0, 10, 2)
    assert graphed[3].graph.report.parts[-1] == "the optimizer's step"


def test_which_steps_are_graph_safe():
    params = list(torch.nn.Linear(2, 1).parameters())

    def why(opt, **step):
        return graph_refusal(StepArithmetic(opt, **step))

    assert why(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)) is None
    assert why(poptorch.optim.SGD(params, lr=0.1)) is None
    assert why(torch.optim.AdamW(params, capturable=True)) is None
    assert why(torch.optim.AdamW(params)).startswith("AdamW was built with capturable=False")
    assert why(poptorch.optim.LAMB(params)).startswith("LAMB's step is not known to be graph")
    assert why(poptorch.optim.SGD(params, lr=0.1, momentum=0.9,
                                  velocity_accum_type=torch.float16)).startswith(
        "SGD keeps its state in dtypes of its own")
    scale = LossScale(automatic=True)
    assert why(torch.optim.SGD(params, lr=0.1), loss_scale=scale).startswith(
        "automatic loss scaling")
    hooked = torch.optim.SGD(params, lr=0.1)
    hooked.register_step_post_hook(lambda *a: None)
    assert why(hooked) == "the optimizer has step hooks, whose Python runs at every step"


# -- what is not captured ---------------------------------------------------------------------

@pytest.mark.parametrize("case,why", [
    ("recomputed_dropout", "a recomputed stage has random ops"),
    ("stop_on_non_finite", "Training.stopOnNonFiniteLoss reads every micro-batch's loss on"),
    ("two_devices", "the stages run on 2 devices (cpu:0, cpu); one graph holds one GPU's"),
    ("ipu_model", "useIpuModel gives every IPU a memory of its own"),
    ("offloaded", "the optimizer's state is offloaded to host memory"),
    ("cumulative_batchnorm", "a BatchNorm with momentum=None reads its count on the host"),
    ("printed", "a stage runs Python in every micro-batch (ipu_print_tensor, or ExpMovAvg"),
])
def test_what_cannot_be_captured_runs_eagerly_and_says_why(twin_gpu_installed, case, why,
                                                          caplog):
    model = BlockMLP(2, dropout=0.3 if case == "recomputed_dropout" else 0.0,
                     batchnorm=case == "cumulative_batchnorm")
    if case == "cumulative_batchnorm":  # 1 / float(num_batches_tracked) in every forward
        model.bn.momentum = None
    if case == "printed":  # a replay would print nothing
        model.register_forward_hook(lambda m, i, out: poptorch.ipu_print_tensor(out[0][:1]))
    kw = dict(recompute=case == "recomputed_dropout", options={
        "stop_on_non_finite": lambda o: o.Training.stopOnNonFiniteLoss(True),
        "two_devices": lambda o: o.set_ipu_devices({0: "cpu:0", 1: "cpu"}),
        "ipu_model": lambda o: o.useIpuModel(True),
        "offloaded": lambda o: o.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False)),
    }.get(case))
    eager = train(model, "gpu_twin", graph=False, **kw)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        graphed = train(model, "gpu_twin", graph=True, **kw)
    assert_same(eager, graphed)
    assert graphed[3].graph.report.refused.startswith(why)
    assert why in caplog.text
    assert counts(graphed[3]) == (0, 0, 0, 8)


def test_a_stage_that_makes_the_host_wait_is_not_captured(twin_gpu_installed, monkeypatch,
                                                         caplog):
    """A host sync in a stage's action (here a nonzero, whose output's size CUDA reads back)
    would invalidate the capture, which then could not be ended: the last warm-up run looks
    for them ([Note: host syncs] in gpu_twin.py, CUDA's sync debug mode on a GPU), and the
    program stays eager, saying which action."""
    forward = StageWork.forward

    def reading(self, a, run, step):
        if a.stage == 1:
            torch.ones(2).nonzero()
        return forward(self, a, run, step)

    monkeypatch.setattr(StageWork, "forward", reading)
    model = BlockMLP(2)
    eager = train(model, "gpu_twin", graph=False)
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        graphed = train(model, "gpu_twin", graph=True)
    assert_same(eager, graphed)
    assert graphed[3].graph.report.refused == (
        "action 1F0 makes the host wait for the GPU (aten::nonzero reads a GPU value on the "
        "host), which a capture forbids")
    assert counts(graphed[3]) == (0, 0, 0, 8)
    assert caplog.text.count("run eagerly from now on") == 1


def test_an_optimizer_step_that_makes_the_host_wait_runs_after_the_replay(twin_gpu_installed,
                                                                          monkeypatch):
    """A host sync in the optimizer's step only takes the step out of the graph."""
    commit = Update._commit

    def reading(self, step):
        torch.ones(2).nonzero()
        return commit(self, step)

    monkeypatch.setattr(Update, "_commit", reading)
    model = BlockMLP(2)
    eager = train(model, "gpu_twin", graph=False)
    graphed = train(model, "gpu_twin", graph=True)
    assert_same(eager, graphed)
    report = graphed[3].graph.report
    assert report.refused is None and report.parts[-1] == "the reduction"
    assert report.eager["optimizer step"] == (
        "it makes the host wait for the GPU (aten::nonzero reads a GPU value on the host), "
        "which a capture forbids")
    assert counts(graphed[3]) == (1, 0, 6, 2)


def test_a_capture_that_fails_leaves_the_program_eager(twin_gpu_installed, monkeypatch, caplog,
                                                     every_stage_compiles):
    """A backend the GPU cannot record (the twin: Inductor's CPU kernels; here AOTAutograd's,
    refused for the test) fails the capture: nothing ran, the run goes eagerly, and so do
    the rest, with the reason logged once."""
    monkeypatch.setattr(TwinGpu, "records", lambda self, backend: False)
    model = BlockMLP(2)
    launched = train(model, "gpu_twin", graph=False, backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        graphed = train(model, "gpu_twin", graph=True, backend="aot_eager")
    assert_same(launched, graphed)
    assert graphed[3].graph.report.refused == (
        "its capture failed: ExecutionError: this GPU cannot record stages compiled by "
        "aot_eager")
    assert counts(graphed[3]) == (0, 0, 0, 8)
    assert caplog.text.count("run eagerly from now on") == 1


def test_an_action_that_raises_while_capturing_leaves_the_program_eager(twin_gpu_installed,
                                                                       monkeypatch):
    """The optimizer's step raises inside the capture: the streams forked into it are joined
    back, the capture ends, nothing of it ran, and the run and the rest go eagerly."""
    commit = Update._commit

    def refusing(self, step):
        if "streams" in gpu_twin._CAPTURE:
            raise RuntimeError("not while capturing")
        return commit(self, step)

    monkeypatch.setattr(Update, "_commit", refusing)
    model = BlockMLP(2)
    eager = train(model, "gpu_twin", graph=False)
    graphed = train(model, "gpu_twin", graph=True)
    assert_same(eager, graphed)
    assert graphed[3].graph.report.refused == (
        "its capture failed: RuntimeError: not while capturing")
    assert counts(graphed[3]) == (0, 0, 0, 8)


def test_a_new_signature_places_weights_and_the_step_is_captured_again(twin_gpu_installed,
                                                                      caplog):
    """A call of another batch size compiles a second program, which may give the weights
    new users: the first program's graph is captured again before it replays."""
    def other_size(call, wrapper, model, opt):
        if call == 0:
            wrapper(*data(4 * 4 * 4, seed=7))  # micro-batch 4: a program of its own

    model = BlockMLP(2)
    eager = train(model, "gpu_twin", graph=False, between=other_size)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        graphed = train(model, "gpu_twin", graph=True, between=other_size)
    assert_same(eager, graphed)
    assert counts(graphed[3]) == (2, 1, 6, 2)
    assert "again: the weights' memory changed" in caplog.text


def test_a_capture_that_cannot_be_ended_stops_the_call(twin_gpu_installed, monkeypatch):
    """Ending the capture fails (on a GPU: a stream not joined back, a call a capture
    forbids): torch's CUDA state is unknown, so the call stops with an ExecutionError, after
    the runs before it, and the steps are never captured again."""
    capture = TwinGpu.capture

    @contextlib.contextmanager
    def unending(self, graph, stream):
        with capture(self, graph, stream):
            yield
        raise CaptureFailed("RuntimeError: the capture was invalidated")

    monkeypatch.setattr(TwinGpu, "capture", unending)
    opts = on_device(poptorch.Options().deviceIterations(4).compileStages(True, "eager"),
                     "gpu_twin")
    opts.Training.gradientAccumulation(4)
    model = BlockMLP(2)
    wrapper = poptorch.trainingModel(model, opts, sgd(model.parameters()))
    with pytest.raises(ExecutionError, match=r"the CUDA graph capture of the step on cpu:0 "
                       r"could not be ended \(RuntimeError: the capture was invalidated\)"):
        wrapper(*data(32))
    program = next(iter(wrapper._state.programs.values()))
    assert program.graph.report.refused == (
        "its capture could not be ended: RuntimeError: the capture was invalidated")
    assert program.executor.update.steps_applied == 2  # the two eager runs before it
    wrapper.destroy()


def test_graphs_are_for_gpus_and_the_option_turns_them_off(monkeypatch):
    opts = poptorch.Options()
    assert opts.compile_cuda_graph is True
    assert opts.compileStages(True, cuda_graph=False).compile_cuda_graph is False
    with pytest.raises(OptionsError, match=r"cuda_graph needs a bool, got 'yes' \(str\)"):
        opts.compileStages(True, cuda_graph="yes")
    assert opts.compile_cuda_graph is False  # refused before anything changed
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"compile_cuda_graph": false}')
    assert poptorch.Options().compile_cuda_graph is False
    cpu = train(BlockMLP(2), "cpu", graph=True, calls=1)
    assert cpu[3].graph is None  # no stage on a GPU: nothing to capture


# -- the twin itself --------------------------------------------------------------------------

def test_the_twin_captures_without_running_and_replays_on_the_same_memory():
    twin = TwinGpu()
    x, w = torch.arange(3.0), torch.zeros(3)
    graph, stream = twin.graph(), twin.Stream(TWIN)
    with twin.capture(graph, stream):
        y = x * 2
        w.add_(y)
    assert torch.equal(w, torch.zeros(3)) and bool(y.isnan().all())  # nothing ran
    x.copy_(torch.ones(3))  # the next run's input, in the captured memory
    twin.replay(graph, stream)
    assert torch.equal(w, torch.zeros(3))  # launched: it runs when the stream is waited for
    stream.synchronize()
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(w, torch.full((3,), 2.0))
    # A host read or wait fails where it is, and invalidates the capture: ending it fails too.
    with pytest.raises(CaptureFailed, match="a host read of a tensor inside a capture"):
        with twin.capture(TwinGraph(), stream):
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                float(x.sum())
    with pytest.raises(CaptureFailed, match="the host waited for a stream or an event"):
        with twin.capture(TwinGraph(), stream):
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                stream.synchronize()
    with pytest.raises(CaptureFailed, match="aten::nonzero"):  # its output's size: a host read
        with twin.capture(TwinGraph(), stream):
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                x.nonzero()
    side = twin.Stream(TWIN)
    with pytest.raises(CaptureFailed, match="1 stream.s. forked into the capture were not "):
        with twin.capture(TwinGraph(), stream):
            side.wait_stream(stream)  # forked, and never joined back
            with twin.stream(side):
                twin.made([x * 3], TWIN)


def test_the_twin_refuses_a_threads_first_cublas_call_on_a_stream_inside_a_capture():
    """cuBLAS and cuDNN state is made per thread and stream on first use, which a capture
    forbids ([Note: library state on first use] in gpu_twin.py): only the same thread's eager
    use of the same stream before the capture lets it record a matrix product."""
    twin = TwinGpu()
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    stream = twin.Stream(TWIN)
    worker = threading.Thread(target=_multiply_on, args=(twin, stream, a, b))
    worker.start()
    worker.join()  # another thread warmed the stream up: this one has no handle of its own
    _multiply_on(twin, twin.Stream(TWIN), a, b)  # this thread, another stream
    for _ in range(2):  # the error is raised where the call is, and the end fails too
        with pytest.raises(CaptureFailed, match="previous error during capture .the twin: "
                           "aten::mm was the first cuBLAS/cuDNN call of thread MainThread"):
            with twin.capture(TwinGraph(), stream):
                with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_INITIALIZED"):
                    a @ b
    _multiply_on(twin, stream, a, b)  # warmed up where it is captured
    graph = TwinGraph()
    with twin.capture(graph, stream):
        c = a @ b
    twin.replay(graph, stream)
    stream.synchronize()
    assert torch.equal(c, torch.full((2, 2), 2.0))


def test_the_twin_refuses_a_random_op_launched_outside_the_capture_under_way():
    """A registered generator's offset moves inside the capture only: a random op launched on a
    stream that did not join the capture fails as CUDA's "Offset increment outside graph
    capture" does."""
    twin = TwinGpu()
    stream, outside = twin.Stream(TWIN), twin.Stream(TWIN)
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        with twin.capture(TwinGraph(), stream):
            with twin.stream(outside):
                torch.rand(3)
    with twin.capture(TwinGraph(), stream):  # on the capture's stream it is recorded
        torch.rand(3)


def _multiply_on(twin, stream, a, b):
    with twin.stream(stream):
        return a @ b
