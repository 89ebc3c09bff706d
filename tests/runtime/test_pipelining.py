"""Pipelined execution: stages on their own streams, the stash's promise, recomputation,
accumulator dtype, timelines, failures and the watchdog."""

import copy
import gc
import json
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.enums import PipelineSchedule
from poptorch_lite.runtime.schedule_kinds import build

from models import BlockMLP, data, exited, on_device, trained_grads, twin, workers
from patience import WATCHDOG_S, limit
from probes import CONCURRENT, PROBE, SCHEDULES, Probed, options, probed_batch


# -- streams -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", CONCURRENT)
def test_stages_work_at_the_same_time_on_their_own_threads(schedule):
    """1F0 and 0F1 only pass a 2-party barrier if they really run at once."""
    barrier = threading.Barrier(2, timeout=limit(30))
    threads = {}

    def fn(kind, stage, i):
        threads.setdefault(stage, set()).add(threading.current_thread().name)
        if kind == "F" and (stage, i) in ((0, 1), (1, 0)):
            barrier.wait()

    PROBE["fn"] = fn
    model = poptorch.trainingModel(Probed(2), options(schedule, 4))
    model(*probed_batch(4))
    assert [sorted(threads[s]) for s in (0, 1)] == [["poptorch_lite-ipu0_0"],
                                                    ["poptorch_lite-ipu1_0"]]
    spans = model.runStatistics().timeline.spans
    f01 = next(s for s in spans if s.label == "0F1")
    f10 = next(s for s in spans if s.label == "1F0")
    assert f01.start < f10.end and f10.start < f01.end  # overlapping in time
    model.destroy()


def test_sequential_runs_one_action_at_a_time():
    model = poptorch.trainingModel(BlockMLP(4), options("sequential", 2))
    model(*data(4))
    spans = model.runStatistics().timeline.spans
    assert [s.label for s in spans] == [str(a) for a in build(
        PipelineSchedule.Sequential, 4, 2, True).actions()]
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("schedule", ["sequential", "gpipe", "zero_bubble"])
def test_only_poptorchs_own_pipelines_have_an_accumulation_minimum(schedule):
    """PopTorch's G >= 2N-1 is its pipelines' (Grouped, Interleaved); the schedules it never
    had run any number of micro-batches, each action of the grid once."""
    torch.manual_seed(0)
    x, y = data(2)
    model = poptorch.trainingModel(BlockMLP(4), options(schedule, 1))
    model(x, y)
    spans = model.runStatistics().timeline.spans
    assert sorted(s.label for s in spans) == sorted(str(a) for a in build(
        PipelineSchedule.parse(schedule), 4, 1, True).actions())
    for kind in ("grouped", "interleaved"):
        with pytest.raises(poptorch.PipelineError, match=r"gradientAccumulation\(7\)"):
            poptorch.trainingModel(BlockMLP(4), options(kind, 1))(x, y)


def test_workers_are_reused_and_released_by_destroy_and_by_garbage_collection():
    gc.collect()  # earlier tests' models
    assert exited()
    model = poptorch.trainingModel(BlockMLP(2), options("grouped", 4))
    model(*data(8))
    first = {t.ident for t in workers()}
    model(*data(8))
    assert len(first) == 2 and {t.ident for t in workers()} == first
    model.destroy()
    assert workers() == []
    model = poptorch.trainingModel(BlockMLP(2), options("interleaved", 4))
    model(*data(8))
    assert len(workers()) == 2
    del model
    gc.collect()
    assert exited()


# -- the activation stash ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES + ["zero_bubble"])
@pytest.mark.parametrize("blocks,G", [(2, 3), (2, 8), (4, 7), (4, 12)])
def test_stash_depth_is_what_the_schedule_promises(schedule, blocks, G):
    model = poptorch.trainingModel(BlockMLP(blocks), options(schedule, G))
    model(*data(2 * G))
    promised = build(PipelineSchedule.parse(schedule), blocks, G, True).peak_in_flight()
    assert list(model.runStatistics().peak_stash_depth) == promised
    expected = {"sequential": [1] * blocks, "gpipe": [G] * blocks,
                "interleaved": [min(G, blocks - s) for s in range(blocks)],
                "zero_bubble": [min(G, blocks - s) for s in range(blocks)],  # counted until W
                "grouped": [min(G, 2 * (blocks - s) - 1) for s in range(blocks)]}[schedule]
    assert promised == expected


class Wide(torch.nn.Module):
    """Two stages of three Linear+GELU layers (with dropout), optionally checkpointed."""

    def __init__(self, width=64, checkpoint=False, dropout=0.0):
        super().__init__()
        self.a = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.b = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.drop = torch.nn.Dropout(dropout)
        self.checkpoint = checkpoint

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            for fc in self.a:
                x = F.gelu(fc(x))
        with poptorch.Block("b1", ipu_id=1):
            for k, fc in enumerate(self.b):
                x = self.drop(F.gelu(fc(x)))
                if self.checkpoint and k == 1:
                    x = poptorch.recomputationCheckpoint(x)
            loss = F.mse_loss(x, y)
        return x, loss


def run_wide(schedule, recompute, checkpoint=False, dropout=0.0, seed=5, stage=None):
    torch.manual_seed(0)
    model = Wide(checkpoint=checkpoint, dropout=dropout)
    opts = options(schedule, 4, recompute=recompute and stage is None)
    if stage is not None:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(
            poptorch.Stage("b0").recompute(stage == 0), poptorch.Stage("b1").recompute(stage == 1),
            schedule=schedule))
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    torch.manual_seed(seed)
    _, loss = wrapped(x, y)
    return model, loss, wrapped.runStatistics(), trained_grads(wrapped)


@pytest.mark.parametrize("schedule", SCHEDULES + ["zero_bubble"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_recomputation_gives_identical_numbers_and_keeps_less(schedule, checkpoint):
    plain, plain_loss, plain_stats, plain_grads = run_wide(schedule, False, checkpoint,
                                                           dropout=0.2)
    recomputed, loss, stats, grads = run_wide(schedule, True, checkpoint, dropout=0.2)
    assert torch.equal(loss, plain_loss)
    for (name, p), q in zip(recomputed.named_parameters(), plain.parameters()):
        assert torch.equal(grads[name], plain_grads[name]), name
        assert torch.equal(p.detach(), q.detach()), name
    assert stats.peak_stash_depth == plain_stats.peak_stash_depth
    rows = 8
    if schedule == "zero_bubble":
        # A split backward holds from I to W what the recompute rebuilt (the stage's forward
        # graph) with the output gradients W starts from (one 8 x 64 float gradient per
        # Linear of the stage: three at stage 1, stage 1's at stage 0): so one micro-batch's
        # graph at a time where the plain run holds one per micro-batch in flight, and at
        # stage 1 (one in flight) what the plain run holds
        held = rows * 64 * 4
        graph0 = (plain_stats.peak_stash_bytes[0] - held) // plain_stats.peak_stash_depth[0]
        assert stats.peak_stash_bytes[0] == graph0 + held < plain_stats.peak_stash_bytes[0]
        assert stats.peak_stash_bytes[1] == plain_stats.peak_stash_bytes[1]
    else:
        # Stage 1 keeps its boundary input (8 rows x 64 floats per micro-batch), plus the
        # checkpointed value when there is one, instead of every activation.
        depth = stats.peak_stash_depth[1]
        kept = (2 if checkpoint else 1) * rows * 64 * 4
        assert stats.peak_stash_bytes[1] == depth * kept
        assert plain_stats.peak_stash_bytes[1] > 3 * stats.peak_stash_bytes[1]
        assert stats.peak_stash_bytes[0] == 0  # stage 0 starts from the call's own inputs
    kinds = {(s.stage, s.kind) for s in stats.timeline.spans}
    assert (0, "R") in kinds and (1, "R") in kinds


def test_recompute_can_be_chosen_per_stage():
    _, _, plain, _ = run_wide("grouped", False)
    _, _, only1, _ = run_wide("grouped", True, stage=1)
    assert {s.stage for s in only1.timeline.spans if s.kind == "R"} == {1}
    assert only1.peak_stash_bytes[0] == plain.peak_stash_bytes[0]
    assert only1.peak_stash_bytes[1] < plain.peak_stash_bytes[1]


def test_stage_recompute_takes_a_bool():
    assert repr(poptorch.Stage("b0").ipu(1).recompute(False)) == "Stage('b0').ipu(1).recompute(False)"
    assert poptorch.Stage("b0").recompute_enabled is None  # follows autoRecomputation
    with pytest.raises(poptorch.OptionsError, match=r"Stage\('b0',\)\.recompute\(\) needs a bool, got 'yes'"):
        poptorch.Stage("b0").recompute("yes")


def test_recomputed_batchnorm_statistics_move_once():
    torch.manual_seed(0)
    model = BlockMLP(2, batchnorm=True)
    ref = twin(model)
    x, y = data(16)
    poptorch.trainingModel(model, options("interleaved", 4, recompute=True))(x, y)
    poptorch.trainingModel(ref, options("interleaved", 4))(x, y)
    assert int(model.bn.num_batches_tracked) == 4
    assert torch.equal(model.bn.running_mean, ref.bn.running_mean)
    assert torch.equal(model.bn.running_var, ref.bn.running_var)


# -- gradient accumulation ---------------------------------------------------------------


@pytest.mark.parametrize("accum_type", [None, torch.float32])
def test_gradients_accumulate_in_the_optimizers_accum_type(accum_type):
    """bfloat16 parameters: with accum_type=float32 (PopTorch's "data type used for
    gradients") the G micro-batch gradients are summed and divided in float32, then cast
    once; torch's own optimizer accumulates in the parameter's dtype."""
    torch.manual_seed(0)
    G = 8
    model = BlockMLP(2).to(torch.bfloat16)
    ref = twin(model)
    x, y = data(2 * G)
    x = x.to(torch.bfloat16)
    if accum_type is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=accum_type)
    train = poptorch.trainingModel(model, options("grouped", G), opt)
    train(x, y)
    grads = trained_grads(train)
    sums = {n: None for n, _ in ref.named_parameters()}
    for i in range(G):
        ref.zero_grad(set_to_none=True)
        _, loss = ref(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
        loss.backward()
        for n, p in ref.named_parameters():
            g = p.grad if accum_type is None else p.grad.float()
            sums[n] = g if sums[n] is None else sums[n] + g
    for n, p in ref.named_parameters():
        grad = (sums[n] / G).to(torch.bfloat16)
        assert torch.equal(grads[n], grad), n
        assert torch.equal(dict(model.named_parameters())[n].detach(), p.detach().add(grad, alpha=-0.1)), n


# -- timeline ----------------------------------------------------------------------------


def test_run_statistics_need_a_call():
    model = poptorch.trainingModel(BlockMLP(2), options("grouped", 4))
    with pytest.raises(poptorch.DeviceError, match="call the model first"):
        model.runStatistics()
    model(*data(8))
    assert model.runStatistics().schedule == "grouped"


def test_the_timeline_records_every_action_of_every_run(tmp_path):
    D, G = 2, 4
    model = poptorch.trainingModel(BlockMLP(2), options("interleaved", G, D=D))
    model(*data(2 * G * D))
    stats = model.runStatistics()
    assert stats.peak_stash_depth == (2, 1)  # the peak over both runs
    timeline = stats.timeline
    actions = [str(a) for a in build(PipelineSchedule.Interleaved, 2, G, True).actions()]
    for run in range(D):
        labels = sorted(s.label for s in timeline.spans if s.run == run)
        assert labels == sorted(actions)
    for s in timeline.spans:
        assert s.stream == (0 if s.stage is None else s.stage) and s.end >= s.start
    for stream in (0, 1):
        mine = [s for s in timeline.spans if s.stream == stream]
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))  # one at a time per stream
    assert timeline.stream_names == ["ipu0 (cpu)", "ipu1 (cpu)"]
    path = tmp_path / "trace.json"
    timeline.write_chrome_trace(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == D * len(actions)
    assert 0 < timeline.bubble_fraction() < 1


# -- failures and the watchdog -----------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["F", "B"])
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("microbatch", [0, 2, 4])
def test_a_failing_action_is_reported_promptly_and_the_next_call_works(schedule, kind, stage,
                                                                       microbatch):
    def fn(k, s, i):
        if (k, s, i) == (kind, stage, microbatch):
            raise RuntimeError("injected fault")

    before = set(workers())  # earlier tests' collected wrappers may still be winding down
    model = poptorch.trainingModel(Probed(2), options(schedule, 5))
    x, y = probed_batch(5)
    PROBE["fn"] = fn
    with pytest.raises(poptorch.ExecutionError) as info:  # at once: not the 600 s watchdog's
        model(x, y)
    text = str(info.value)
    assert text.startswith(f"action {stage}{kind}{microbatch} (")
    assert f"stage {stage} ['b{stage}'], micro-batch {microbatch}" in text
    assert "RuntimeError: injected fault" in text
    marked = [line for line in text.splitlines() if line.startswith(">>")]
    assert len(marked) == 1 and f"{stage}{kind}{microbatch}" in marked[0]
    PROBE["fn"] = None
    _, loss = model(x, y)
    assert torch.isfinite(loss)
    model.destroy()
    assert set(workers()) <= before  # destroy() ended this model's workers


def test_the_watchdog_turns_a_stuck_action_into_an_error():
    release = threading.Event()

    def fn(k, s, i):
        if (k, s, i) == ("F", 1, 2):
            release.wait(limit(120))

    opts = options("grouped", 4).watchdogTimeout(WATCHDOG_S)
    model = poptorch.trainingModel(Probed(2), opts)
    x, y = probed_batch(4)
    PROBE["fn"] = fn
    with pytest.raises(poptorch.ExecutionError,
                       match=re.escape(f"no action finished for {WATCHDOG_S} s")) as info:
        model(x, y)
    assert str(info.value).startswith("action 1F2 (forward) failed")
    stuck = [t for t in workers() if t.name.startswith("poptorch_lite-ipu1")]
    release.set()  # the abandoned worker finishes its action and exits
    for t in stuck:
        t.join(limit(60))
    PROBE["fn"] = None
    _, loss = model(x, y)  # ipu1 has a fresh worker
    assert torch.isfinite(loss)
    model.destroy()
    assert workers() == []


def test_watchdog_timeout_is_checked():
    with pytest.raises(poptorch.OptionsError, match="watchdogTimeout needs a number"):
        poptorch.Options().watchdogTimeout(-1)
    assert poptorch.Options().watchdogTimeout(None).watchdog_timeout is None
    assert poptorch.Options().watchdog_timeout == 600.0


class _SliceAcross(torch.nn.Module):
    """Stage 0 hands stage 1 rows 3.. of its output: a view 72 bytes into its memory."""

    def __init__(self):
        super().__init__()
        self.l0, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 4)

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            h = torch.tanh(self.l0(x))[3:]
        with poptorch.Block("b1", ipu_id=1):
            out = self.head(h)
            return out, F.cross_entropy(out, y[3:])


@pytest.mark.parametrize("seed", range(4))
def test_a_value_crossing_into_another_ipus_memory_rounds_as_the_view_plain_pytorch_reads(seed):
    """Under useIpuModel a value crossing into another IPU's memory is copied at the offset in
    its 64-byte line that the view it copies has, so ``head`` rounds as it does on plain
    PyTorch's view ([Note: copies keep their alignment] in runtime/inputs; an aligned copy
    differed in the last bit for every seed here)."""
    torch.manual_seed(seed)
    net = _SliceAcross()
    plain = copy.deepcopy(net)
    opts = on_device(poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution()),
                     "ipu_model")
    wrapped = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    got = wrapped(x, y)[0]
    want, loss = plain(x, y)
    loss.backward()
    optimizer.step()
    wrapped.copyWeightsToHost()
    assert torch.equal(got, want)
    for name, p in plain.named_parameters():
        assert torch.equal(dict(net.named_parameters())[name], p), name
