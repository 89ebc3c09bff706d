"""The GPU path by construction ([Note: values crossing streams], [Note: GPU timeline],
[Note: GPUs of a process] in ``devices``).

Each defect that has a shape on the CPU is pinned here with a CPU test: the device a
mapping names, the GPUs a process takes, what a CPU stream waits for, the streams every
way out of a run synchronizes, the error an asynchronous failure gives, the tensor each
IPU computes with, the host copies of outputs, the stash bytes. The CUDA-marked tests
run the same transparency checks on GPUs when they are present (two-GPU cases skip
with fewer); the reference is plain PyTorch on the same kind of device.
"""

import copy
import contextlib
import itertools
import threading

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.runtime import gpu as gpu_seam, placement as placement_module
from poptorch_lite.compiler import rng
from poptorch_lite.runtime.executor import Executor
from poptorch_lite.runtime.stage_work import StageWork
from poptorch_lite.profiling.timeline import Recorder, Span
from poptorch_lite.options.device import normalize_device
from poptorch_lite.runtime.devices import process_gpu, resolve_devices
from poptorch_lite.runtime.placement import Placement
from poptorch_lite.runtime.streams import CpuStream, StreamFailed, arrive
from poptorch_lite.runtime.weights import Weights

from gpu_twin import TWIN, TwinGpu
from models import (BlockMLP, data, microbatch_seeds, on_device, reference_training, twin,
                    workers)
from patience import WATCHDOG_S, limit

ATOL = 1e-5
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
SCHEDULES = ["sequential", "grouped", "interleaved", "gpipe", "zero_bubble"]


def pipelined(schedule, G, recompute=False, D=1):
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=schedule)).deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return opts


# -- devices and the GPUs of a process ------------------------------------------------


def test_an_index_less_cuda_device_is_the_current_one():
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert normalize_device("cuda") == torch.device("cuda", current)
    assert normalize_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert normalize_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_gpu_this_machine_lacks_is_refused_before_any_state_changes():
    torch.manual_seed(0)
    model = BlockMLP(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = pipelined("grouped", 4).set_ipu_devices({0: "cpu", 1: "cuda:1"})
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.OptionsError) as info:
        train(*data(8))
    assert str(info.value) == (
        "IPU 1 is mapped to cuda:1, but this machine has 0 CUDA devices (torch.cuda."
        "is_available() is False); map it to the CPU with opts.set_ipu_devices(...)")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    train.destroy()


def test_a_device_that_is_neither_cpu_nor_cuda_is_refused():
    with pytest.raises(poptorch.OptionsError, match=r"IPU 0 is mapped to meta, but "
                       r"poptorch_lite runs stages on 'cpu' or 'cuda' devices"):
        resolve_devices([0], {0: torch.device("meta")})


@pytest.fixture
def four_gpus(monkeypatch):
    """A host of 4 GPUs as torch would report it (nothing touches a real GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


def test_processes_on_one_host_take_blocks_of_gpus_of_their_own(four_gpus):
    """Two processes with three IPUs each: process 1 runs on cuda:2 and cuda:3 only, never on
    process 0's GPUs (the old round-robin from cuda:LOCAL_RANK overlapped them)."""
    four_gpus.setenv("LOCAL_WORLD_SIZE", "2")
    got = {}
    for rank in (0, 1):
        four_gpus.setenv("LOCAL_RANK", str(rank))
        got[rank] = [d.index for d in resolve_devices([0, 1, 2], None).values()]
        assert process_gpu() == 2 * rank
    assert got == {0: [0, 1, 0], 1: [2, 3, 2]}


def test_one_process_uses_every_gpu_from_the_current_one_on(four_gpus):
    assert [d.index for d in resolve_devices([0, 1, 2, 3], None).values()] == [1, 2, 3, 0]


def test_more_processes_than_gpus_on_a_host_are_refused(four_gpus):
    four_gpus.setenv("LOCAL_WORLD_SIZE", "5")
    four_gpus.setenv("LOCAL_RANK", "4")
    with pytest.raises(poptorch.OptionsError) as info:
        resolve_devices([0], None)
    assert str(info.value) == (
        "5 processes on this host (LOCAL_WORLD_SIZE) share 4 GPUs, so processes would run "
        "IPUs on the same GPU and contend for it; start at most 4 processes per host "
        "(torchrun --nproc_per_node 4), or map the IPUs yourself with "
        "opts.set_ipu_devices(...)")


def test_a_mapping_beyond_the_gpus_present_is_refused(four_gpus):
    with pytest.raises(poptorch.OptionsError, match=r"IPU 2 is mapped to cuda:4, but this "
                       r"machine has 4 CUDA devices; map it to cuda:0..cuda:3"):
        resolve_devices([0, 2], {0: "cuda:0", 2: "cuda:4"})


# -- streams: waiting, synchronizing, failing --------------------------------------------


class FakeEvent:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(self)


def test_a_cpu_stream_waits_on_the_host_for_the_gpu_work_it_depends_on():
    log = []
    events = [FakeEvent(log), FakeEvent(log)]
    CpuStream("t").wait(events)
    assert log == events


def test_the_twins_waits_are_transitive_as_cudas_are():
    """Stream c waits for b's event recorded after b waited for a's: c sees a's work up to
    a's event, not a's work launched after it; d waits for an event b recorded before its
    wait, and sees nothing of a (CUDA orders a stream's work after every wait before it)."""
    twin = TwinGpu()
    a, b, c, d = (twin.Stream(TWIN) for _ in range(4))
    a.launch(lambda: None)
    early = twin.Event()
    early.record(a)
    a.launch(lambda: None)  # after the event b waits for
    b.launch(lambda: None)
    before = twin.Event()
    before.record(b)
    b.wait_event(early)
    after = twin.Event()
    after.record(b)
    d.wait_event(before)
    assert d.sees(b, before.mark) and not d.sees(a, early.mark)
    c.wait_event(after)
    assert c.sees(b, after.mark) and c.sees(a, early.mark) and not c.sees(a, a.launched)


def test_a_tensor_already_where_it_is_read_arrives_as_itself():
    t = torch.ones(3)
    assert arrive(t, torch.device("cpu")) is t


@pytest.fixture
def counted(monkeypatch):
    """Count each CPU stream's ``synchronize`` (a GPU stream's end-of-run wait)."""
    calls = []
    monkeypatch.setattr(CpuStream, "synchronize", lambda self: calls.append(self.name))
    return calls


def test_a_finished_run_and_a_failed_one_synchronize_every_stream(counted):
    placement = Placement([0, 1], {0: "cpu", 1: "cpu"})
    placement.run_lists({0: ["a"], 1: ["b"]}, lambda a: [], lambda a: None)
    assert sorted(counted) == ["poptorch_lite-ipu0", "poptorch_lite-ipu1"]
    counted.clear()

    def call(a):
        if a == "b":
            raise ValueError("boom")
    with pytest.raises(placement_module.ActionFailed):
        placement.run_lists({0: ["a"], 1: ["b"]}, lambda a: [], call)
    assert sorted(counted) == ["poptorch_lite-ipu0", "poptorch_lite-ipu1"]
    placement.close()


def test_the_watchdog_synchronizes_the_streams_that_are_not_stuck(counted):
    placement = Placement([0, 1], {0: "cpu", 1: "cpu"})
    release = threading.Event()

    def call(a):
        if a == "b":
            release.wait(limit(120))
    with pytest.raises(placement_module.ActionStuck):
        placement.run_lists({0: ["a"], 1: ["b"]}, lambda a: [], call, watchdog=WATCHDOG_S)
    assert counted == ["poptorch_lite-ipu0"]
    release.set()
    placement.close()


def test_an_asynchronous_error_at_the_end_of_a_run_names_its_stream_and_actions(monkeypatch):
    torch.manual_seed(0)
    model = BlockMLP(2)
    opts = pipelined("grouped", 4).set_ipu_devices("cpu")
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    train.compile(*data(8))

    def late(self):
        if self.name == "poptorch_lite-ipu1":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(CpuStream, "synchronize", late)
    with pytest.raises(poptorch.ExecutionError) as info:
        train(*data(8))
    message = str(info.value)
    assert message.startswith(
        "the run of schedule 'grouped' failed on stream 1 (IPU 1, cpu) with an error the GPU "
        "reported only when the run waited for it: RuntimeError: CUDA error: an illegal memory "
        "access was encountered. CUDA reports a kernel's failure late, so it came from one of "
        "that stream's actions (1F0, 1B0, 1F1, 1B1, 1F2, 1B2, 1F3, 1B3, 1G)")
    assert message.endswith("run with the environment variable CUDA_LAUNCH_BLOCKING=1 to have "
                            "the action that launched it raise it")
    train.destroy()


class FakeTimingEvent:
    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_gpu_spans_are_read_from_their_events_against_the_runs_reference():
    """A GPU action's span is where the GPU ran it: its events' times after the reference
    event, added to the host time at which the reference was recorded."""
    recorder = Recorder(origin=10.0)
    recorder.add_gpu(1, 1, 0, "F", FakeTimingEvent(1000.0), 10.5, FakeTimingEvent(1250.0),
                     FakeTimingEvent(1500.0))
    recorder.add(0, 0, 0, "F", 10.0, 10.25)
    assert sorted(recorder.timeline(["ipu0", "ipu1"], "grouped").spans, key=lambda s: s.stream) == [
        Span(0, 0, 0, "F", 0.0, 0.25, 0), Span(1, 1, 0, "F", 0.75, 1.0, 0)]


def test_stream_failed_carries_the_stream_and_the_error():
    exc = RuntimeError("x")
    failed = StreamFailed(3, exc)
    assert (failed.ipu, failed.exc) == (3, exc)


# -- random streams across devices ------------------------------------------------------


def test_a_micro_batchs_random_stream_continues_from_one_gpu_to_the_next(monkeypatch):
    """Stage 0 on cuda:0 and stage 1 on cuda:1 draw one stream, as plain PyTorch on one GPU
    draws one generator: stage 1 continues where stage 0 stopped instead of restarting
    from the micro-batch's seed (which repeated stage 0's masks). Two CPU generators stand
    for the GPUs' default generators."""
    gens = {0: torch.Generator(), 1: torch.Generator()}
    monkeypatch.setattr(rng, "device_generator", lambda device: gens[device.index])

    def draw(device):
        return torch.rand(4, generator=gens[device.index])
    with rng.use(rng.Stream(1234)):
        first = rng.seeded(draw)(device=torch.device("cuda", 0))
        second = rng.seeded(draw)(device=torch.device("cuda", 1))
    one_gpu = torch.Generator().manual_seed(1234)
    assert torch.equal(first, torch.rand(4, generator=one_gpu))
    assert torch.equal(second, torch.rand(4, generator=one_gpu))


# -- weights, outputs, stash ----------------------------------------------------------


def test_off_the_cpu_each_ipu_on_a_device_computes_with_a_tensor_of_its_own():
    """Two streams on one GPU adding into one ``.grad`` would race: the second IPU on the
    host parameter's device gets a copy; on the CPU both use the parameter itself."""
    for device in ("cpu", "meta"):
        net = torch.nn.Linear(2, 2, device=device)
        w = Weights(net, 1, False)
        dev = torch.device(device)
        w.place({0: dev, 1: dev}, [(0, ["weight"]), (1, ["weight"])])
        first, second = w.param("weight", 0), w.param("weight", 1)
        assert first is net.weight
        assert (second is net.weight) == (device == "cpu")


@pytest.mark.parametrize("mode,kept", [(poptorch.OutputMode.Final, [7]),
                                       (poptorch.OutputMode.All, list(range(8))),
                                       (poptorch.OutputMode.EveryN, [4, 5, 6, 7])])
@pytest.mark.parametrize("device,join_bytes", [("cpu", None), ("gpu_twin", None),
                                               ("gpu_twin", 0)])
def test_only_the_micro_batches_an_output_mode_returns_are_copied_to_the_host(
        monkeypatch, mode, kept, device, join_bytes):
    """Only the kept micro-batches' outputs are read; on a GPU, where a run keeps more than
    one, each output of at most ``JOIN_BYTES`` comes back in one copy for all of them
    (``Executor._outputs``), a larger one micro-batch by micro-batch."""
    if join_bytes is not None:
        monkeypatch.setattr(gpu_seam, "JOIN_BYTES", join_bytes)
    read = []
    original = Executor._result

    def spy(self, run, i, name):
        read.append(i)
        return original(self, run, i, name)
    monkeypatch.setattr(Executor, "_result", spy)
    torch.manual_seed(0)
    model = BlockMLP(2)
    opts = on_device(pipelined("grouped", 4, D=2), device)
    opts.outputMode(mode, 2) if mode == poptorch.OutputMode.EveryN else opts.outputMode(mode)
    ref = copy.deepcopy(model)
    x, y = data(16)
    out, loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                    lr=0.1))(x, y)
    # two outputs (logits and loss) per kept micro-batch; run-local indices, 4 per run
    one_by_one = device == "cpu" or len(kept) == 1 or join_bytes == 0
    assert sorted(read) == (sorted(i % 4 for i in kept for _ in range(2)) if one_by_one else [])
    outs, losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                                         2, 4, 1)
    assert torch.equal(loss, torch.stack([losses[i] for i in kept]) if len(kept) > 1
                       else losses[kept[0]])
    assert torch.equal(out, torch.cat([outs[i] for i in kept]))


def test_inputs_are_copied_once_into_each_ipu_memory_that_lacks_them(monkeypatch, device):
    """A stage reads its inputs from the copies made when the run began (one per micro-batch
    and IPU memory, holding that micro-batch's rows; on a GPU one transfer per input, each
    micro-batch reading its own rows of it), and the user's own tensors where the memory is
    the same. The spy keeps every tensor a stage read alive, so no two copies can share an
    address (a caching allocator reuses a freed copy's)."""
    seen = []
    original = StageWork.args

    def spy(self, s, run, i, dev):
        args, boundary = original(self, s, run, i, dev)
        seen.extend((s, i, a) for a, (_, kind, _) in zip(args, self.stages[s].sources)
                    if kind == "input")
        return args, boundary
    monkeypatch.setattr(StageWork, "args", spy)
    torch.manual_seed(0)
    model = BlockMLP(2)
    x, y = data(8)
    poptorch.trainingModel(model, on_device(pipelined("grouped", 4), device),
                           torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    users = {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    # x read by stage 0, y by stage 1, for each of 4 micro-batches, each its own rows
    assert sorted((s, i) for s, i, _ in seen) == [(s, i) for s in (0, 1) for i in range(4)]
    for s, i, a in seen:
        assert torch.equal(a.cpu(), (x if s == 0 else y)[2 * i:2 * i + 2]), (s, i)
    copies = {a.untyped_storage().data_ptr() for _, _, a in seen} - users
    assert len(copies) == {"cpu": 0, "ipu_model": 8}.get(device, 2)
    assert len({a.data_ptr() for _, _, a in seen}) == 8  # each stage and micro-batch its own rows


@pytest.mark.parametrize("device", ["gpu_twin"])
@pytest.mark.parametrize("blocks,schedule,on_workers", [
    (1, "grouped", False), (2, "sequential", False), (2, "grouped", True)])
def test_one_action_at_a_time_on_a_gpu_is_launched_by_the_callers_thread(
        blocks, schedule, on_workers, device):
    """[Note: streams]: a run on one GPU stream, or in a total order, is launched by the
    caller's thread (a worker's hand-offs made a one-stage step 1.2-1.5x plain PyTorch's on
    an H100); a pipeline's streams run on workers."""
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    opts = on_device(pipelined(schedule, 4) if blocks > 1 else poptorch.Options(), device)
    if blocks == 1:
        opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    train(*data(8))
    assert bool(workers()) == on_workers
    # every action timed on its GPU stream: per stage F and B per micro-batch and its
    # gradients' reduction, then the step
    assert len(train.runStatistics().timeline.spans) == blocks * (2 * 4 + 1) + 1
    train.destroy()


def test_inputs_copied_into_an_ipus_memory_are_not_counted_as_stash():
    """The IPU Model copies each input into the memory of the IPU that reads it; the stash
    statistics exclude those copies as they exclude the call's own inputs."""
    peaks = {}
    for device in ("cpu", "ipu_model"):
        torch.manual_seed(0)
        model = BlockMLP(2, width=64)
        opts = on_device(pipelined("grouped", 4), device)
        train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        train(*data(4 * 16, width=64))
        peaks[device] = train.runStatistics().peak_stash_bytes
        train.destroy()
    assert peaks["ipu_model"] == peaks["cpu"]


# -- on GPUs ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["grouped", "sequential"])
def test_the_mnist_examples_conv_net_in_two_stages_matches_plain_pytorch(schedule, device):
    """examples/mnist_pipelined.py's network and options (2 stages, accumulation 8, SGD with
    momentum) over two calls of two steps each, against plain PyTorch on the same kind of
    device: the run that trained to 10% on a GPU when every micro-batch read micro-batch 0's
    input copy. On ``gpu_twin`` it takes the GPU's branches on the CPU."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    from mnist_pipelined import Network, parser, strategy

    args = parser.parse_args(["--schedule", schedule])
    torch.manual_seed(0)
    model = Network()
    ref = twin(model, device)
    G, D, B = args.gradient_accumulation, 2, args.batch_size
    opts = on_device(poptorch.Options().deviceIterations(D), device)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy(args)).outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(B * G * D, 1, 28, 28, generator=g), torch.randint(0, 10, (B * G * D,), generator=g)
        out, loss = train(x, y)
        ref_outs, ref_losses, _ = reference_training(ref, ref_opt, x, y, D, G, 1)
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)
    train.destroy()



def train_and_compare(model, opts, ref, G, D=1, seeds=None, lr=0.05):
    """Train ``model`` through poptorch_lite and ``ref`` plainly; compare everything."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    x, y = data(2 * G * D)
    opts.outputMode(poptorch.OutputMode.All)
    torch.manual_seed(123)
    train = poptorch.trainingModel(model, opts, opt)
    out, loss = train(x, y)
    torch.manual_seed(123)
    seeds = microbatch_seeds(D, G) if seeds else None
    ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, D, G, 1, seeds=seeds)
    assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(opt.state[p]["momentum_buffer"].cpu(),
                     ref_opt.state[q]["momentum_buffer"].cpu(), atol=ATOL, rtol=0)
    train.destroy()


# The GPU tests run on CUDA where there is a GPU, and on the GPU twin everywhere (gpu_twin.py:
# the GPU's branches with CPU tensors; its GPUs are cpu:0 and cpu:1).
GPU_KINDS = [pytest.param("cuda", marks=[cuda, needs_gpu]), "twin"]


@contextlib.contextmanager
def two_stage_gpus(kind, gpus):
    """The devices of stages 0 and 1, on one GPU or two, and the reference's device."""
    if kind == "cuda":
        if gpus == 2 and GPUS < 2:
            pytest.skip("needs two CUDA GPUs")
        yield "cuda:0", f"cuda:{gpus - 1}", "cuda"
        return
    with gpu_seam.installed(TwinGpu()):
        yield "cpu:0", f"cpu:{gpus - 1}", "cpu"


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("gpus", [1, 2], ids=["one_gpu", "two_gpus"])
@pytest.mark.parametrize("schedule,recompute", list(itertools.product(SCHEDULES, [False, True])))
def test_stages_on_gpu_streams_match_plain_pytorch_on_one_gpu(schedule, recompute, gpus, kind):
    """Two stages on one GPU (a stream each) or on two: values and gradients cross streams
    or GPUs; the dropout masks continue from stage to stage as on one GPU
    ([Note: micro-batch RNG])."""
    with two_stage_gpus(kind, gpus) as (first, second, reference):
        torch.manual_seed(0)
        model = BlockMLP(2, dropout=0.3, batchnorm=True)
        ref = twin(model, reference)
        opts = pipelined(schedule, 4, recompute, D=2).set_ipu_devices({0: first, 1: second})
        train_and_compare(model, opts, ref, 4, D=2, seeds=True)


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("gpu_first", [False, True], ids=["cpu_then_gpu", "gpu_then_cpu"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_on_the_cpu_and_a_gpu_match_plain_pytorch(gpu_first, schedule, kind):
    """A host stage and a GPU stage in one run. Sequential runs it in order on the caller's
    thread, which switches between the host's stream and the GPU's at every action (on an
    H100 that switch once raised: the host's stream had no context to leave)."""
    with two_stage_gpus(kind, 1) as (gpu, _, _):
        torch.manual_seed(0)
        model = BlockMLP(2)
        ref = twin(model, "cpu")
        mapping = {0: gpu, 1: "cpu"} if gpu_first else {0: "cpu", 1: gpu}
        opts = pipelined(schedule, 4, D=2).set_ipu_devices(mapping)
        train_and_compare(model, opts, ref, 4, D=2)


class DropoutInBoth(torch.nn.Module):
    """Two stages whose dropouts have the same shape: one stream per micro-batch gives them
    different masks, as on one GPU."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.drop(torch.relu(self.fc(x)))
        with poptorch.Block("b", ipu_id=1):
            out = self.head(self.drop(h))
            return out, torch.nn.functional.cross_entropy(out, y)


class TiedOnTwoIpus(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.relu(self.fc(x))
        with poptorch.Block("b", ipu_id=1):
            out = self.head(torch.relu(self.fc(h)))  # fc again: a tied weight on IPU 1
            return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("gpus", [1, 2], ids=["one_gpu", "two_gpus"])
@pytest.mark.parametrize("make,schedule,seeds", [
    (DropoutInBoth, "interleaved", True), (TiedOnTwoIpus, "grouped", None)],
    ids=["dropouts_draw_as_on_one_gpu", "a_tied_weight_across_two_streams"])
def test_two_stages_on_one_or_two_gpus_match_plain_pytorch_on_one(make, schedule, seeds, gpus,
                                                                  kind):
    with two_stage_gpus(kind, gpus) as (first, second, reference):
        torch.manual_seed(0)
        model = make()
        ref = twin(model, reference)
        opts = pipelined(schedule, 4, D=2).set_ipu_devices({0: first, 1: second})
        train_and_compare(model, opts, ref, 4, D=2, seeds=seeds)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_the_gpu_timeline_is_measured_on_the_gpu_and_ordered_per_stream(kind):
    with two_stage_gpus(kind, 1) as (first, second, _):
        torch.manual_seed(0)
        model = BlockMLP(2, width=512)
        opts = pipelined("grouped", 8).set_ipu_devices({0: first, 1: second})
        train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = data(8 * 64, width=512)
        train(x, y)
    timeline = train.runStatistics().timeline
    assert len(timeline.spans) == len([a for row in train._last_run[0].rows for a in row if a])
    for stream in (0, 1):
        spans = sorted((s for s in timeline.spans if s.stream == stream), key=lambda s: s.start)
        assert all(s.start <= s.end for s in spans)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(spans, spans[1:]))
    train.destroy()


@cuda
@needs_gpu
def test_a_model_on_the_gpu_with_inputs_on_the_gpu_matches_plain_pytorch():
    """The user's model and batch on the GPU: the stages use them without copies."""
    torch.manual_seed(0)
    model = BlockMLP(2).cuda()
    ref = twin(model, "cuda")
    opts = pipelined("grouped", 4).set_ipu_devices("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(8)
    _, loss = poptorch.trainingModel(model, opts, opt)(x.cuda(), y.cuda())
    _, ref_losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.05),
                                          x, y, 1, 4, 1)
    assert_close(loss.cpu(), ref_losses[-1], atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0)
