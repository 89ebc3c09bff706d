"""Transparency for state that one stage writes in forward and another reads ([Note: state
across stages] in compiler/state.py): a buffer (an EMA, a counter, a queue written through a
slice) or a parameter (``nn.Embedding(max_norm=...)``, tied to a head on another stage).

Each micro-batch reads what plain PyTorch's loop would read at that point, on every device,
under every schedule, with and without recomputation; the shapes no pipeline can run so
(read before the writer, two writers) are refused before any state changes, and run exactly
where one action runs at a time on one memory.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import poptorch_lite as poptorch

from poptorch_lite.compiler.compiled_stages import CompiledGraph
from poptorch_lite.compiler.partition import partition

from conftest import DEVICE_MARKS, DEVICES
from models import on_device, pairwise, reference_training, trained_grads, twin

ATOL = 1e-5
FULL = os.environ.get("POPTORCH_LITE_FULL_MATRIX") == "1"
SCHEDULES = ["sequential", "grouped", "interleaved", "gpipe", "zero_bubble"]
G, D, B = 3, 2, 2  # 6 micro-batches a call, an optimizer step every 3


class WrittenState(torch.nn.Module):
    """Four blocks on ``ipus``. Blocks 0 and 1 compute; block 1 writes ``kind``'s state
    (block 0 when ``kind`` is tied_max_norm: the embedding's lookup renormalises its rows);
    blocks 2 and 3 read it.

    kinds: "ema" (a buffer following the features), "counter" (an int buffer counting
    micro-batches, which the read saves for its backward), "queue" (rows of a buffer written
    through a slice, the whole read), "queue_view" (the same, through a view of the rows
    taken in block 0 and read again after the write), and "tied_max_norm" (an ``nn.Embedding(max_norm=1)`` whose weight the head uses, tied).
    """

    def __init__(self, kind: str, ipus=(0, 0, 1, 1)):
        super().__init__()
        self.kind, self.ipus = kind, ipus
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 4)
        if kind == "tied_max_norm":
            self.emb = torch.nn.Embedding(10, 8, max_norm=1.0)
            with torch.no_grad():
                self.emb.weight.mul_(3)  # most rows are longer than max_norm: renormalised
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue", torch.zeros(4, 8))

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=self.ipus[0])
        h = self.emb(x) if self.kind == "tied_max_norm" else x
        h = torch.relu(self.layers[0](h))
        rows = self.queue[1:3]
        poptorch.Block.start("b1", ipu_id=self.ipus[1])
        h = torch.relu(self.layers[1](h))
        with torch.no_grad():
            if self.kind == "ema":
                self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
            elif self.kind == "queue":
                self.queue[1:3] = h[:2]
            elif self.kind == "queue_view":
                rows.copy_(h[:2])
        if self.kind == "counter":
            self.count += 1
        poptorch.Block.start("b2", ipu_id=self.ipus[2])
        if self.kind == "ema":
            h = h + self.ema
        elif self.kind == "counter":
            h = h * self.count / 4
        elif self.kind == "queue":
            h = h + self.queue.mean(0)
        elif self.kind == "queue_view":  # the rows' view, taken before the write, read after
            h = h + self.queue.mean(0) - rows.mean(0)
        h = torch.relu(self.layers[2](h))
        poptorch.Block.start("b3", ipu_id=self.ipus[3])
        out = self.head(h)
        if self.kind == "tied_max_norm":
            out = h @ self.emb.weight.t()
        return out, F.cross_entropy(out, y)


def batch(kind: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    classes = 10 if kind == "tied_max_norm" else 4
    x = (torch.randint(0, 10, (n,), generator=g) if kind == "tied_max_norm"
         else torch.randn(n, 8, generator=g))
    return x, torch.randint(0, classes, (n,), generator=g)


def options(schedule, recompute, device, strategy=None):
    opts = poptorch.Options().setExecutionStrategy(
        strategy or poptorch.PipelinedExecution(schedule=schedule)).deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    on_device(opts, device)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return opts


def train_against_plain_pytorch(model, opts, device, calls=2):
    """``calls`` calls of a wrapped ``model`` and of plain PyTorch's loop over the same
    micro-batches: outputs, losses, gradients, weights, buffers and optimizer state agree.
    Returns the wrapper's program."""
    ref = twin(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    try:
        for call in range(calls):
            x, y = batch(model.kind, B * G * D, seed=call)
            out, loss = train(x, y)
            ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, D, G, 1)
            assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
            assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0)
            for name, g in trained_grads(train).items():
                assert_close(g, ref_grads[name], atol=ATOL, rtol=0, msg=f"grad of {name}")
            for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
                assert_close(a, b.detach().cpu(), atol=ATOL, rtol=0, msg=f"call {call}: {name}")
            state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
            assert state.keys() == ref_state.keys()
            for k, held in state.items():
                assert_close(held["momentum_buffer"], ref_state[k]["momentum_buffer"].cpu(),
                             atol=ATOL, rtol=0)
        return next(iter(train._programs.values()))
    finally:
        train.destroy()


ROWS = [(kind, ipus) for kind in ("ema", "counter", "queue", "queue_view", "tied_max_norm")
        for ipus in ((0, 0, 1, 1), (0, 1, 1, 1))]


MATRIX = [(kind, ipus, schedule, recompute) for kind, ipus in ROWS for schedule in SCHEDULES
          for recompute in (False, True)]
# The whole matrix on the CPU; on the other devices the rows that cover every pair of its
# factors' values (models.pairwise), as the transparency matrix does, or the whole matrix
# there too in the long run (POPTORCH_LITE_FULL_MATRIX=1).
DEVICE_MATRIX = [pytest.param(d, *row, marks=DEVICE_MARKS.get(d, []),
                              id=f"{d}-{row[0]}-ipus{''.join(map(str, row[1]))}-{row[2]}"
                                 f"{'-recompute' if row[3] else ''}")
                 for d in DEVICES
                 for row in (MATRIX if d == "cpu" or FULL else pairwise(MATRIX))]


@pytest.mark.parametrize("device,kind,ipus,schedule,recompute", DEVICE_MATRIX)
def test_state_written_in_one_stage_and_read_in_a_later_one_matches_plain_pytorch(
        device, kind, ipus, schedule, recompute):
    """Each micro-batch's later stages read the state as the writing stage left it for that
    micro-batch (its snapshot), not as other micro-batches' writes or another IPU's copy
    have it by then; the writer's parameter gets the head's gradient."""
    torch.manual_seed(0)
    model = WrittenState(kind, ipus)
    train_against_plain_pytorch(model, options(schedule, recompute, device), device)
    assert model.count.item() == (2 * G * D if kind == "counter" else 0)
    assert (model.ema.abs().sum() > 0) == (kind == "ema")
    assert (model.queue.abs().sum() > 0) == kind.startswith("queue")


@pytest.mark.parametrize("schedule", ["grouped", "interleaved"])
@pytest.mark.parametrize("kind", ["ema", "counter", "queue_view", "tied_max_norm"])
def test_an_inference_pipeline_reads_the_snapshot(kind, schedule, device):
    """Inference overlaps micro-batches too: each one's outputs are plain PyTorch's."""
    torch.manual_seed(0)
    model = WrittenState(kind)
    ref = twin(model, device)
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=schedule)).deviceIterations(G * D).outputMode(poptorch.OutputMode.All)
    infer = poptorch.inferenceModel(model, on_device(opts, device))
    for call in range(2):
        x, y = batch(kind, B * G * D, seed=call)
        with torch.no_grad():
            expected = [ref(x[k * B:(k + 1) * B].to(ref.ema.device),
                            y[k * B:(k + 1) * B].to(ref.ema.device))[0].cpu()
                        for k in range(G * D)]
        assert_close(infer(x, y)[0], torch.cat(expected), atol=ATOL, rtol=0)
    infer.copyWeightsToHost()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)
    infer.destroy()


@pytest.mark.parametrize("kind,ipus", ROWS, ids=[f"{k}-ipus{''.join(map(str, i))}"
                                                 for k, i in ROWS])
def test_the_writing_stage_hands_later_stages_a_snapshot(kind, ipus):
    """The partition: the stage that writes the state returns its value after the last write,
    and no later stage reads the buffer or parameter itself, nor a view of it that another
    stage took ([Note: state across stages])."""
    model = WrittenState(kind, ipus)
    part = partition(model, {m: True for m in model.modules()}, batch(kind, B, 0), {},
                     poptorch.PipelinedExecution(), training=True)
    name = {"ema": "ema", "counter": "count", "tied_max_norm": "emb.weight"}.get(kind, "queue")
    state = f"{'param' if kind == 'tied_max_norm' else 'buffer'}:{name}"
    writer = 0 if kind == "tied_max_norm" or ipus[1] == 0 else 1
    snapshot = f"node:{name.replace('.', '_')}_snapshot"
    assert part.shared_state == {}
    last = len(part.stages) - 1
    for st in part.stages:
        made = any(f"node:{n.name}" == snapshot for n in st.module.graph.nodes)
        assert made == (st.index == writer), st.index
        assert (state in st.inputs) == (st.index == writer), st.index
        assert (snapshot in st.outputs) == (st.index == writer < last), st.index
        assert (snapshot in st.inputs) == (st.index > writer), st.index


@pytest.mark.parametrize("kind", ["ema", "counter", "queue_view", "tied_max_norm"])
def test_one_stage_reads_its_own_snapshot_after_its_last_write(kind, device):
    """All blocks on one IPU: micro-batch i's reads after the stage's last write read a copy,
    which micro-batch i+1's write cannot change before i's backward (the counter's product
    saves it, as the head saves the embedding's weight; GPipe runs every forward first);
    nothing leaves the stage."""
    torch.manual_seed(0)
    model = WrittenState(kind, (0, 0, 0, 0))
    train_against_plain_pytorch(model, options("gpipe", False, device), device)
    wrapped = poptorch.inferenceModel(model, poptorch.Options())
    wrapped(*batch(kind, B, 0))
    (stage,) = next(iter(wrapped._programs.values())).partition.stages
    assert stage.outputs == ("node:addmm_3", "node:getitem") if kind != "tied_max_norm" \
        else stage.outputs == ("node:mm", "node:getitem")
    wrapped.destroy()


class SharedState(torch.nn.Module):
    """A buffer read in stage 0 before stage 1 writes it ("read_before"), or written in both
    stages ("two_writers")."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        if self.kind == "two_writers":
            self.ema.add_(1)
        h = torch.relu(self.a(x + self.ema))
        poptorch.Block.start("b1", ipu_id=1)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
        out = self.b(h + self.ema)
        return out, F.cross_entropy(out, y)


ONE_AT_A_TIME = {"sharded": poptorch.ShardedExecution, "sequential": None}


@pytest.mark.parametrize("kind", ["read_before", "two_writers"])
@pytest.mark.parametrize("schedule", ["sharded", *SCHEDULES])
def test_state_read_before_its_writer_or_written_twice_is_exact_or_refused(
        kind, schedule, device):
    """Micro-batch i's read needs micro-batch i-1's write in a later stage: exact where one
    action runs at a time on one memory (the CPU's), refused everywhere else before any
    state changes, naming the buffer, its stages and the fixes."""
    torch.manual_seed(0)
    model = SharedState(kind)
    strategy = poptorch.ShardedExecution() if schedule == "sharded" else None
    opts = options(schedule, False, device, strategy)
    if schedule in ONE_AT_A_TIME and device == "cpu":
        train_against_plain_pytorch(model, opts, device)
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(kind, B * G * D, 0)
    model(x[:B], y[:B])[1].backward()  # optimizer state to keep, and an EMA already moved
    opt.step()
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    rng = torch.get_rng_state()
    train = poptorch.trainingModel(model, opts, opt)
    where = (r"written in forward by stage 1 \(blocks \['b1'\], IPU 1\) and read before "
             r"that by stage 0 \(blocks \['b0'\], IPU 0\)" if kind == "read_before" else
             r"written in forward by stages 0 \(blocks \['b0'\], IPU 0\), 1 \(blocks "
             r"\['b1'\], IPU 1\)")
    why = ("runs stages of different micro-batches at once" if schedule not in ONE_AT_A_TIME
           else "each compute with their own copy of it")
    with pytest.raises(poptorch.Error, match=rf"buffer 'ema' is {where}: .*{why}.*"
                                             r"Move the buffer's reads and writes into one "
                                             r"stage .* or use ShardedExecution"):
        train(x, y)
    state, opt_state = before
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    now = opt.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    for k, held in opt_state["state"].items():
        assert torch.equal(now["state"][k]["momentum_buffer"], held["momentum_buffer"]), k
    assert torch.equal(torch.get_rng_state(), rng)
    train.destroy()


COMPILED = [pytest.param("cpu", "aot_eager", False, id="cpu-aot_eager"),
            pytest.param("gpu_twin", "eager", True, id="gpu_twin-step_graph"),
            pytest.param("gpu_twin", "aot_eager", True, id="gpu_twin-aot_eager-step_graph")] + (
    [pytest.param("cuda", "eager", True, marks=DEVICE_MARKS["cuda"], id="cuda-step_graph")]
    if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,backend,graph", COMPILED)
@pytest.mark.parametrize("schedule,recompute", [("interleaved", True), ("zero_bubble", False)])
@pytest.mark.parametrize("kind", ["ema", "counter", "queue_view", "tied_max_norm"])
def test_compiled_stages_and_step_graphs_read_the_snapshot(kind, schedule, recompute, device,
                                                           backend, graph, every_stage_compiles):
    """Compiled stages (their split halves under ZeroBubble) and a step captured as one CUDA
    graph take the snapshot as any other value between stages."""
    torch.manual_seed(0)
    model = WrittenState(kind, (0, 0, 1, 1))
    opts = options(schedule, recompute, device)
    opts.compileStages(True, backend=backend, cuda_graph=graph)
    program = train_against_plain_pytorch(model, opts, device, calls=3)
    if backend != "eager":
        assert all(isinstance(st.module, CompiledGraph) and st.module.fns
                   for st in program.executor.work.stages if not st.recompute)
    if graph:  # 6 runs: 2 to warm up, then one captured and replayed, 3 replays
        report = program.graph.report
        assert (report.captures, report.replays, report.eager_runs) == (1, 4, 2)


def test_shared_state_across_processes_is_refused():
    """Stages in other processes each hold their own copy of the buffer: refused even
    where one action runs at a time (each process checks its layout alike)."""
    from poptorch_lite.runtime.compiling import check_shared_state
    model = SharedState("read_before")
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    part = partition(model, {m: True for m in model.modules()}, batch("read_before", B, 0), {},
                     opts.execution_strategy, training=True)
    assert part.shared_state == {"buffer:ema": ((1,), (0,), True)}
    check_shared_state(part, model, opts, lambda ipu: True)  # one process, one memory
    with pytest.raises(poptorch.Error, match=r"buffer 'ema' is written in forward by stage 1 .*"
                                             r"those stages run in different processes"):
        check_shared_state(part, model, opts, lambda ipu: ipu == 0)


class _ZeroThenNorm(torch.nn.Module):
    """A BatchNorm after a zero-initialised layer: at the trace its batch mean is exactly 0,
    so its running_mean keeps its value, though the layer learns and later means are not."""

    def __init__(self):
        super().__init__()
        self.zero = torch.nn.Linear(4, 4)
        torch.nn.init.zeros_(self.zero.weight)
        torch.nn.init.zeros_(self.zero.bias)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            out = self.head(self.bn(self.zero(x)) + x)
            return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_statistics_the_trace_left_unchanged_move_once_a_forward_as_in_plain_pytorch(recompute):
    """The trace finds a buffer written by the values it changed, and a batch norm's first
    update may change none (a batch mean of exactly 0): the running statistics a
    normalisation in training updates are written all the same, so a recomputed stage's
    recompute writes a copy of them ([Note: recomputation]), and they move once a forward,
    as in plain PyTorch (before, the recompute moved them a second time)."""
    torch.manual_seed(0)
    net = _ZeroThenNorm()
    plain = copy.deepcopy(net)
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule="grouped"))
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    wrapped = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.5))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    x = torch.randn(8, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    for call in range(3):
        wrapped(x, y)
        optimizer.zero_grad()
        plain(x, y)[1].backward()
        optimizer.step()
    wrapped.copyWeightsToHost()
    assert plain.bn.num_batches_tracked.item() == 3
    for name, value in plain.state_dict().items():
        assert torch.equal(net.state_dict()[name], value), name
