"""Transparency: a wrapped training model does plain PyTorch's arithmetic, over a matrix."""

import itertools
import logging
import os

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.compiler import rng

from conftest import DEVICE_MARKS, DEVICES
from models import (GRAD_CODE, BlockMLP, GradCodeMLP, data, microbatch_seeds, on_device,
                    pairwise, reference_training, replicas_training, shared_traces, trained_grads,
                    twin)

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_trace_per_structure(monkeypatch):
    """The matrix's wrappers share one trace per model structure and signature (models.py)."""
    shared_traces(monkeypatch)


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def assert_same_state(opt_a, opt_b):
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            assert_close(sa[k][name], sb[k][name], atol=ATOL, rtol=0)


def sharded(G, device):
    """Options for G accumulated micro-batches through ShardedExecution on ``device``."""
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(G)
    on_device(opts, device)
    return opts


MATRIX = list(itertools.product([1, 2, 4], [1, 4, 8], [1, 2], [1, 3], ["mean", "sum"],
                                ["sgd", "adam"]))
# The whole matrix on the CPU; on the other devices (conftest.DEVICES) the rows that cover
# every pair of factor values (models.pairwise), or the whole matrix there too in the long
# run (POPTORCH_LITE_FULL_MATRIX=1; CONTRIBUTING.md).
FULL = os.environ.get("POPTORCH_LITE_FULL_MATRIX") == "1"
DEVICE_MATRIX = [("cpu", *row) for row in MATRIX] + [
    pytest.param(d, *row, marks=DEVICE_MARKS.get(d, []))
    for d in DEVICES if d != "cpu" for row in (MATRIX if FULL else pairwise(MATRIX))]
SCHEDULES = ["sequential", "grouped", "interleaved", "gpipe", "zero_bubble"]
VARIANTS = list(itertools.product(SCHEDULES, [False, True]))  # (schedule, recompute)


def pipelined(schedule, recompute, G, device, *auto):
    """Options for G micro-batches through PipelinedExecution with ``schedule`` (``auto``:
    an AutoStage)."""
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(*auto, schedule=schedule))
    opts.Training.gradientAccumulation(G)
    on_device(opts, device)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    return opts


def runnable(schedule, blocks, G):
    """PopTorch's minimum for its pipelined schedules, G >= 2N-1; those PopTorch never had
    (Sequential, GPipe, ZeroBubble) have none."""
    return schedule not in ("grouped", "interleaved") or blocks == 1 or G >= 2 * blocks - 1


@pytest.mark.parametrize("device,blocks,G,R,D,reduction,opt_kind", DEVICE_MATRIX)
def test_training_matches_plain_pytorch(device, blocks, G, R, D, reduction, opt_kind):
    """Every schedule, with and without recomputation, against one plain-PyTorch run."""
    torch.manual_seed(0)
    initial = BlockMLP(blocks)
    ref = twin(initial, device)
    B = 2
    x, y = data(B * D * G * R)
    ref_opt = make_optimizer(opt_kind, ref.parameters())
    ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, D, G, R,
                                                         mean=reduction == "mean")
    n = D * G * R
    ran = 0
    for schedule, recompute in VARIANTS:
        if not runnable(schedule, blocks, G):
            continue
        model = twin(initial)
        opts = pipelined(schedule, recompute, G, device).deviceIterations(D).replicationFactor(R)
        opts.Training.accumulationAndReplicationReductionType(
            poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
        opts.outputMode(poptorch.OutputMode.All)
        opt = make_optimizer(opt_kind, model.parameters())
        train = poptorch.trainingModel(model, opts, opt)
        out, loss = train(x, y)
        grads = trained_grads(train)
        where = f"{schedule}, recompute={recompute}"
        assert out.shape == (n * B, 4)
        assert loss.shape == ((n,) if n > 1 else ())
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(ref_losses).reshape(loss.shape), atol=ATOL, rtol=0,
                     msg=where)
        for name, p in model.named_parameters():
            assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=0,
                         msg=f"grad of {name}, {where}")
            assert p.grad is None, f"the call left a gradient on the host's {name}"
            assert_close(p.detach(), dict(ref.named_parameters())[name].detach().cpu(),
                         atol=ATOL, rtol=0, msg=f"weight {name}, {where}")
        assert_same_state(opt, ref_opt)
        ran += 1
    assert ran == sum(runnable(s, blocks, G) for s, _ in VARIANTS)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("blocks,G", [(2, 3), (4, 7)])
def test_pipelines_at_their_minimum_accumulation_match_plain_pytorch(blocks, G, schedule,
                                                                     device):
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    ref = twin(model, device)
    x, y = data(2 * G)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _, loss = poptorch.trainingModel(model, pipelined(schedule, False, G, device), opt)(x, y)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
    assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)  # OutputMode.Final by default
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach().cpu(), atol=ATOL, rtol=0, msg=name)


def test_several_calls_keep_matching(device):
    torch.manual_seed(0)
    model, G = BlockMLP(2), 4
    ref = twin(model, device)
    opts = sharded(G, device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train = poptorch.trainingModel(model, opts, opt)
    for step in range(3):
        x, y = data(2 * G, seed=step)
        _, loss = train(x, y)
        _, ref_losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
        assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach().cpu(), atol=ATOL, rtol=0)
    assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("blocks, G", [(1, 1), (2, 3)])
@pytest.mark.parametrize("first", [True, False])
def test_autocast_around_a_call_casts_as_around_plain_pytorchs_forward(blocks, G, first,
                                                                       caplog):
    """Calls made in and out of ``torch.autocast`` (bfloat16) in turn: each computes as plain
    PyTorch's forward does in the same context ([Note: autocast around a call] in
    compiler/casting.py); the second context traces once more, logged, and later calls reuse
    the two programs."""
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    ref = twin(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    opts = sharded(G, "cpu") if blocks == 2 else on_device(poptorch.Options(), "cpu")
    train = poptorch.trainingModel(model, opts.outputMode(poptorch.OutputMode.All), opt)
    caplog.set_level(logging.INFO, logger="poptorch_lite")
    for call in range(4):
        on = (call % 2 == 0) == first
        x, y = data(2 * G, seed=call)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            out, loss = train(x, y)
            outs, losses, _ = reference_training(ref, ref_opt, x, y, 1, G, 1)
        assert out.dtype == (torch.bfloat16 if on else torch.float32)
        assert_close(out, torch.cat(outs), atol=ATOL, rtol=0, msg=f"call {call}")
        assert_close(loss.reshape(-1), torch.stack(losses), atol=ATOL, rtol=0,
                     msg=f"call {call}")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=ATOL, rtol=0)
    change = "cpu bfloat16 -> off" if first else "off -> cpu bfloat16"
    assert caplog.text.count(f"a call whose autocast differs from the compiled one "
                             f"(autocast: {change}) compiles again") == 1
    assert caplog.text.count("trainingModel compiled") == 2


@pytest.mark.parametrize("schedule,recompute", VARIANTS)
def test_dropout_and_batchnorm_match_with_the_same_seed(schedule, recompute, device):
    """Random ops draw from one stream per micro-batch ([Note: micro-batch RNG]), so every
    schedule gives plain PyTorch's numbers when it seeds each micro-batch the same way;
    recomputation replays the masks and moves BatchNorm statistics once."""
    torch.manual_seed(0)
    model, G, D = BlockMLP(2, dropout=0.3, batchnorm=True), 4, 2
    ref = twin(model, device)
    opts = pipelined(schedule, recompute, G, device).deviceIterations(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = data(4 * G * D)
    torch.manual_seed(123)
    _, loss = poptorch.trainingModel(model, opts, opt)(x, y)
    after = torch.rand(3)  # the call drew one base per run from the default generator
    torch.manual_seed(123)
    seeds = microbatch_seeds(D, G)
    assert torch.equal(torch.rand(3), after)
    _, ref_losses, _ = reference_training(ref, ref_opt, x, y, D, G, 1, seeds=seeds)
    assert_close(loss, ref_losses[-1], atol=ATOL, rtol=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=name)
    assert int(model.bn.num_batches_tracked) == G * D


def test_a_seeded_model_draws_from_a_random_state_of_its_own(device):
    """Options.randomSeed(n) seeds the model's own generator, as PopTorch seeds each model's
    device RNG ([Note: micro-batch RNG]): two models with the same seed draw the same dropout
    masks, torch's generator is not drawn from, and plain PyTorch seeded per micro-batch from
    a generator seeded with n does the same arithmetic."""
    torch.manual_seed(0)
    model, G = BlockMLP(2, dropout=0.3), 4
    ref, other = twin(model, device), twin(model)
    opts = pipelined("interleaved", False, G, device).randomSeed(77).deviceIterations(2)
    x, y = data(2 * G * 2)
    state = torch.get_rng_state()
    losses = []
    for m in (model, other):
        train = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.05))
        losses.append(train(x, y)[1])
        train.destroy()
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(losses[0], losses[1])
    own = torch.Generator().manual_seed(77)
    seeds = [rng.microbatch_seed(base, i) for base in rng.draw_bases(2, own) for i in range(G)]
    _, ref_losses, _ = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.05),
                                          x, y, 2, G, 1, seeds=seeds)
    assert_close(losses[0], ref_losses[-1], atol=ATOL, rtol=0)
    for p, q, r in zip(model.parameters(), other.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert_close(p.detach(), r.detach().cpu(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ipus,schedules", [
    ((0, 1, 0, 1), SCHEDULES),        # a loop: 4 stages on 2 IPUs, in every schedule
    ((0, 1, 1, 0), ["zero_bubble"]),  # a V: the middle two stages share IPU 1 (ZeroBubble only)
])
@pytest.mark.parametrize("recompute", [False, True])
def test_virtual_stages_on_repeating_ipus_match_plain_pytorch(ipus, schedules, recompute, device):
    """Blocks whose ipu_ids repeat, with AutoStage.AutoIncrement: 4 stages on 2 streams,
    with dropout, 2 replicas and accumulation below PopTorch's minimum where the schedule
    has none, against plain PyTorch seeded per micro-batch."""
    D, R = 2, 2
    x, y = data(2 * 8 * R * D)
    for schedule in schedules:
        G = 4 if runnable(schedule, 4, 4) else 7
        torch.manual_seed(0)
        model = BlockMLP(4, dropout=0.3, ipus=ipus)
        ref = twin(model, device)
        opts = pipelined(schedule, recompute, G, device, poptorch.AutoStage.AutoIncrement)
        opts.deviceIterations(D).replicationFactor(R)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        n = 2 * G * R * D
        torch.manual_seed(123)
        wrapped = poptorch.trainingModel(model, opts, opt)
        _, loss = wrapped(x[:n], y[:n])
        torch.manual_seed(123)
        seeds = microbatch_seeds(D, G * R)
        _, ref_losses, _ = reference_training(ref, ref_opt, x[:n], y[:n], D, G, R, seeds=seeds)
        stages = wrapped.runStatistics().timeline.spans
        assert {s.stage for s in stages if s.stage is not None} == {0, 1, 2, 3}, schedule
        # OutputMode.Final: each replica's last micro-batch
        assert_close(loss, torch.stack(ref_losses[-R:]), atol=ATOL, rtol=0, msg=schedule)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert_close(a.detach(), b.detach().cpu(), atol=ATOL, rtol=0, msg=f"{name}, {schedule}")
        assert_same_state(opt, ref_opt)
        wrapped.destroy()


@pytest.mark.parametrize("R", [1, 2])
def test_inference_matches_plain_pytorch(R, device):
    torch.manual_seed(0)
    model = BlockMLP(4).eval()
    D = 4
    x, y = data(3 * D * R)
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    on_device(opts, device)
    out, loss = poptorch.inferenceModel(model, opts)(x, y)
    b = 3
    refs = [model(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(D * R)]
    assert_close(out, torch.cat([o for o, _ in refs]).detach(), atol=ATOL, rtol=0)
    assert_close(loss, torch.stack([l for _, l in refs]).detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_replicas_sharing_inputs_count_once_each(reduction, device):
    """inputReplicaGrouping(2) with R=2: both replicas see every slice (POPTORCH_REFERENCE §4).

    Sum adds both replicas' (equal) gradients: twice the slices' sum; Mean divides that
    by G·R, which is the slices' sum over G.
    """
    torch.manual_seed(0)
    model, G, lr = BlockMLP(2), 4, 0.1
    ref = twin(model, device)
    x, y = data(2 * G)
    opts = sharded(G, device).replicationFactor(2).inputReplicaGrouping(
        2, poptorch.CommGroupType.Consecutive)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=lr))
    train(x, y)
    grads = trained_grads(train)
    _, _, slice_sums = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.0),
                                          x, y, 1, G, 1, mean=False)
    for name, p in model.named_parameters():
        expected = 2 * slice_sums[name] if reduction == "sum" else slice_sums[name] / G
        assert_close(grads[name], expected, atol=ATOL, rtol=0, msg=name)
        initial = dict(ref.named_parameters())[name].detach().cpu()
        assert_close(p.detach(), initial - lr * expected, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("blocks,G,schedule,recompute", [
    (1, 2, "grouped", False), (2, 3, "interleaved", True), (2, 2, "sequential", False)])
def test_replicas_keep_their_own_batchnorm_statistics_as_independent_copies(
        blocks, G, schedule, recompute, device):
    """[Note: running statistics on replicas]: with broadcastBuffers left on, BatchNorm trains on
    2 replicas as PopTorch trains it, as 2 independent copies of the model, each normalising
    its own slices with its own statistics, their gradients averaged: outputs, losses,
    gradients, weights and optimizer state are plain PyTorch's over 2 calls, and replica r's
    running statistics are copy r's (the host's are replica 0's)."""
    torch.manual_seed(0)
    R, D, B = 2, 2, 4  # BatchNorm of a few rows amplifies the replicas' summation order
    model = BlockMLP(blocks, dropout=0.3, batchnorm=True)
    copies = [twin(model, device) for _ in range(R)]
    opts = pipelined(schedule, recompute, G, device).deviceIterations(D).replicationFactor(R)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ref_opt = torch.optim.SGD(copies[0].parameters(), lr=0.02, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(B * D * G * R, seed=call)
        torch.manual_seed(123 + call)
        out, loss = train(x, y)
        torch.manual_seed(123 + call)
        seeds = microbatch_seeds(D, G * R)
        ref_outs, ref_losses, ref_grads = replicas_training(copies, ref_opt, x, y, D, G, seeds)
        where = f"call {call}, {schedule}, recompute={recompute}"
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=where)
        for name, g in trained_grads(train).items():
            assert_close(g, ref_grads[name], atol=ATOL, rtol=0, msg=f"grad of {name}, {where}")
        for (name, a), b in zip(model.state_dict().items(), copies[0].state_dict().values()):
            assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")
        assert_same_state(opt, ref_opt)
        for name, b in copies[1].named_buffers():  # replica 1's, on its IPU
            mine = train._weights.buffer(name, 1, blocks - 1)
            assert_close(mine.cpu(), b.cpu(), atol=ATOL, rtol=0, msg=f"replica 1's {name}")
    assert not torch.equal(copies[0].bn.running_mean, copies[1].bn.running_mean)
    assert int(model.bn.num_batches_tracked) == 2 * D * G  # replica 0's micro-batches
    train.destroy()



@pytest.mark.parametrize("blocks,G,R,schedule,recompute", [
    (1, 2, 1, "grouped", False), (2, 3, 1, "interleaved", True), (2, 2, 2, "sequential", False)])
def test_a_cumulative_batchnorm_counts_every_micro_batch_as_plain_pytorch(
        blocks, G, R, schedule, recompute, device):
    """BatchNorm(momentum=None) averages its statistics over every batch it has seen, with
    ``1 / num_batches_tracked`` as the factor, a count torch reads into Python: traced with
    the count kept a tensor ([Note: cumulative averages] in compiler/running_stats), each
    micro-batch of each replica uses its own. Outputs, losses, gradients, weights, every
    replica's statistics and the optimizer state are plain PyTorch's over 2 calls."""
    torch.manual_seed(0)
    D, B = 2, 4
    model = BlockMLP(blocks, batchnorm=True)
    model.bn.momentum = None
    copies = [twin(model, device) for _ in range(R)]
    opts = pipelined(schedule, recompute, G, device).deviceIterations(D).replicationFactor(R)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ref_opt = torch.optim.SGD(copies[0].parameters(), lr=0.02, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(B * D * G * R, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, ref_grads = (
            replicas_training(copies, ref_opt, x, y, D, G) if R > 1 else
            reference_training(copies[0], ref_opt, x, y, D, G, 1))
        where = f"call {call}, {schedule}, recompute={recompute}"
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=where)
        for name, g in trained_grads(train).items():
            assert_close(g, ref_grads[name], atol=ATOL, rtol=0, msg=f"grad of {name}, {where}")
        for (name, a), b in zip(model.state_dict().items(), copies[0].state_dict().values()):
            assert_close(a, b.cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")
        assert_same_state(opt, ref_opt)
        for r in range(1, R):  # replica r's, on its IPU
            for name, b in copies[r].named_buffers():
                mine = train._weights.buffer(name, r, blocks - 1)
                assert_close(mine.cpu(), b.cpu(), atol=ATOL, rtol=0, msg=f"replica {r}'s {name}")
    assert int(model.bn.num_batches_tracked) == 2 * D * G  # replica 0's micro-batches
    train.destroy()

class FeatureQueue(torch.nn.Module):
    """CLIP's feature queue: a buffer written in forward with a tensor that carries gradients,
    read (as a value) by the next micro-batch. ``write_in`` picks the stage that writes."""

    def __init__(self, blocks: int, write_in: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.register_buffer("queue", torch.zeros(2, 8))
        self.blocks, self.write_in = blocks, write_in

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        if self.write_in == 0:
            h = self._queue(h)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        if self.write_in == 1:
            h = self._queue(h)
        out = self.b(h)
        return out, torch.nn.functional.cross_entropy(out, y)

    def _queue(self, h):
        h = h + self.queue.detach().mean(0)  # the previous micro-batch's features
        self.queue.copy_(h[:2])  # h carries gradients
        return h * 2


@pytest.mark.parametrize("schedule,recompute", VARIANTS)
@pytest.mark.parametrize("blocks,write_in", [(1, 0), (2, 0), (2, 1)])
def test_a_buffer_written_with_gradients_in_forward_matches_plain_pytorch(
        blocks, write_in, schedule, recompute, device):
    """[Note: buffers written in forward]: losses, gradients, weights and the buffer after the
    call are plain PyTorch's, micro-batch after micro-batch; the buffer keeps no history."""
    torch.manual_seed(0)
    model, G, D = FeatureQueue(blocks, write_in), 4, 2
    ref = twin(model, device)
    opts = pipelined(schedule, recompute, G, device).deviceIterations(D)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(2 * G * D, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, D, G, 1)
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0)
        for name, g in trained_grads(train).items():
            assert_close(g, ref_grads[name], atol=ATOL, rtol=0, msg=name)
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert_close(a, b.detach().cpu(), atol=ATOL, rtol=0, msg=name)
        assert model.queue.grad_fn is None and not model.queue.requires_grad
        assert not torch.equal(model.queue, torch.zeros(2, 8))
    train.destroy()  # its stream workers exit now, not at the next garbage collection


# [Note: gradients the forward shapes]: models that stop gradients, bring their own gradient
# code or edit their inputs. The matrix above trains models whose forward says nothing about
# its gradients, so a stop or a custom backward that the trace dropped went unseen.
GRAD_ROWS = [  # (blocks, G, R, schedule, recompute)
    (1, 2, 1, "grouped", False),
    (2, 3, 2, "grouped", False),
    (2, 3, 1, "interleaved", True),
    (2, 2, 1, "sequential", False),
    (4, 4, 1, "gpipe", True),
    (4, 7, 1, "zero_bubble", False),
    (2, 4, 2, "zero_bubble", True),
]
GRAD_MATRIX = [  # replicas refuse ema_buffer, a buffer write of the model's own (E-PART-10)
    pytest.param(d, kind, *row, marks=DEVICE_MARKS.get(d, []))
    for d in DEVICES for kind in sorted(GRAD_CODE)
    for row in (GRAD_ROWS if d == "cpu" or FULL else GRAD_ROWS[1::4])
    if not (kind == "ema_buffer" and row[2] > 1)]


@pytest.mark.parametrize("device,kind,blocks,G,R,schedule,recompute", GRAD_MATRIX)
def test_models_that_shape_their_own_gradients_match_plain_pytorch(
        device, kind, blocks, G, R, schedule, recompute):
    """Stops (detach, .data, no_grad, a write without history, gumbel_softmax's own detach),
    custom Functions and ops (a straight-through round, gradient reversal, a hand-written
    backward, one that draws random numbers, a custom op's registered backward), hooks and
    checkpoints, half of them on a model that halves its input in place: outputs, losses,
    gradients, weights, buffers, optimizer state and the edited input are plain PyTorch's."""
    torch.manual_seed(0)
    edit = GRAD_ROWS.index((blocks, G, R, schedule, recompute)) % 2 == 1
    model = GradCodeMLP(kind, blocks, edit_input=edit)
    ref = twin(model, device).install_hooks()
    model.install_hooks()
    x, y = data(2 * G * R * 2)
    ref_x = x.clone().to("cuda" if device == "cuda" else "cpu")
    opts = pipelined(schedule, recompute, G, device).replicationFactor(R).deviceIterations(2)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    train = poptorch.trainingModel(model, opts, opt)
    torch.manual_seed(123)
    out, loss = train(x, y)
    torch.manual_seed(123)
    seeds = microbatch_seeds(2, G * R)
    ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, ref_x, y, 2, G, R,
                                                         seeds=seeds)
    where = f"{kind}, {schedule}, recompute={recompute}"
    assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
    assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=where)
    grads = trained_grads(train)
    for name, p in model.named_parameters():
        if ref_grads[name] is None:  # stopped: plain PyTorch computed none
            assert grads.get(name) is None, f"{name} got a gradient, {where}"
        else:
            assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=0, msg=f"{name}, {where}")
        assert p.grad is None, f"{name}: the call left a gradient on the host model"
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close(a, b.detach().cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")
    assert_same_state(opt, ref_opt)
    assert_close(x, ref_x.cpu(), atol=0, rtol=0, msg=f"the input after the call, {where}")
    train.destroy()


# -- edits between calls ([Note: weight sync] in host_sync, [Note: trainable parameters] in
# compiled): what a training loop does to the model between two calls, done to the plain
# PyTorch twin too. Where stages hold their own copies of the weights (the IPU Model, a GPU)
# an edit that moves no version, or a flag the copies were made with, went unseen.

class Edited(torch.nn.Module):
    """Two Linear layers in 1 or 2 blocks; the input scaled by a buffer; the first layer's
    output divided by a norm taken without grad: a stop the trace keeps only where the layer
    requires grad when it is traced ([Note: trainable parameters] in runtime/compiled.py)."""

    def __init__(self, blocks: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(8))
        self.blocks = blocks

    def forward(self, x, y):
        poptorch.Block.start("b0", ipu_id=0)
        h = torch.relu(self.a(x * self.scale))
        with torch.no_grad():
            norm = h.norm(dim=1, keepdim=True)
        h = h / (1 + norm)
        if self.blocks == 2:
            poptorch.Block.start("b1", ipu_id=1)
        out = self.b(h)
        return out, torch.nn.functional.cross_entropy(out, y)


EDIT_ROWS = [(1, 2, "grouped"), (2, 3, "grouped"), (2, 3, "interleaved")]  # blocks, G, schedule


def trains_with_edits_like_plain_pytorch(device, blocks, G, schedule, edit, opt_kind,
                                         before=None):
    """Three calls of :class:`Edited` beside plain PyTorch's loop, ``edit(model, call)``
    applied to both after each call (``before(model)``: before wrapping): outputs, losses,
    gradients (None where plain PyTorch has none), weights, buffers and optimizer state
    compared after every call; the host's ``.grad`` stays the user's (None)."""
    torch.manual_seed(0)
    model = Edited(blocks)
    if before is not None:
        before(model)
    ref = twin(model, device)
    opts = pipelined(schedule, False, G, device).outputMode(poptorch.OutputMode.All)
    opt = make_optimizer(opt_kind, model.parameters())
    ref_opt = make_optimizer(opt_kind, ref.parameters())
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(3):
        x, y = data(2 * G, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, ref_grads = reference_training(ref, ref_opt, x, y, 1, G, 1)
        where = f"call {call}, {schedule}"
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=where)
        grads = trained_grads(train)
        for name, p in model.named_parameters():
            if ref_grads[name] is None:  # frozen: plain PyTorch computed none
                assert grads.get(name) is None, f"{name} got a gradient, {where}"
            else:
                assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=0,
                             msg=f"{name}, {where}")
            assert p.grad is None, f"{name}: the call left a gradient on the host model"
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert_close(a, b.detach().cpu(), atol=ATOL, rtol=0, msg=f"{name}, {where}")
        assert_same_state(opt, ref_opt)
        edit(model, call)
        edit(ref, call)
    train.destroy()


def _clip(model, call):  # WGAN's weight clipping
    for p in model.parameters():
        p.data.clamp_(-0.1, 0.1)


def _scale_buffer(model, call):
    model.scale.data.mul_(1.5)


@pytest.mark.parametrize("blocks,G,schedule", EDIT_ROWS)
@pytest.mark.parametrize("edit", [_clip, _scale_buffer], ids=["clip_weights", "scale_buffer"])
def test_edits_through_data_between_calls_reach_the_next_call(device, blocks, G, schedule,
                                                               edit):
    """``p.data.clamp_(-c, c)`` and a buffer's ``.data.mul_`` move no version: read through
    the model, they are pushed to the stages' copies before the next call, and no sync
    writes the old values back over them ([Note: weight sync] in runtime/host_sync.py)."""
    trains_with_edits_like_plain_pytorch(device, blocks, G, schedule, edit, "sgd")


def _freeze_then_unfreeze(model, call):
    model.a.requires_grad_(call != 0)


def _unfreeze_then_freeze(model, call):
    model.a.requires_grad_(call == 0)


@pytest.mark.parametrize("blocks,G,schedule", EDIT_ROWS)
@pytest.mark.parametrize("order", ["freeze_after_call_1", "frozen_when_wrapped"])
def test_freezing_and_unfreezing_between_calls_match_plain_pytorch(device, blocks, G, schedule,
                                                                   order):
    """A layer frozen after the first call gets no gradient and no step (Adam's state stays
    as it was), and trains again once unfrozen after the second; one frozen when wrapped
    trains once unfrozen, through the stop its trace dropped while it was frozen, and not
    once frozen again ([Note: trainable parameters] in runtime/compiled.py)."""
    if order == "freeze_after_call_1":
        trains_with_edits_like_plain_pytorch(device, blocks, G, schedule,
                                             _freeze_then_unfreeze, "adam")
    else:
        trains_with_edits_like_plain_pytorch(device, blocks, G, schedule, _unfreeze_then_freeze,
                                             "adam", before=lambda m: m.a.requires_grad_(False))



class ClippedSteps:
    """Plain PyTorch's clipping before each of ``optimizer``'s steps, of the gradients of
    the parameters it holds (for :func:`reference_training`)."""

    def __init__(self, optimizer, max_norm: float):
        self.optimizer, self.max_norm = optimizer, max_norm
        self.held = [p for g in optimizer.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        torch.nn.utils.clip_grad_norm_([p for p in self.held if p.grad is not None],
                                       self.max_norm)
        self.optimizer.step()


@pytest.mark.parametrize("blocks,G,schedule", [(1, 2, "grouped"), (2, 3, "interleaved")])
def test_clipping_is_to_the_norm_of_the_weights_the_optimizer_steps(device, blocks, G,
                                                                    schedule):
    """``max_grad_norm`` clips the global norm of the gradients of the parameters the
    optimizer holds, as PopART clips the weights it updates (and as plain PyTorch's
    ``clip_grad_norm_`` over them does): the head's bias, left out of the optimizer, has a
    gradient that must not count."""
    torch.manual_seed(0)
    model = BlockMLP(blocks)
    ref = twin(model, device)

    def optimizer(net):
        held = [p for n, p in net.named_parameters() if n != "head.bias"]
        return poptorch.optim.SGD(held, lr=0.5, momentum=0.9, max_grad_norm=0.05)
    opt, ref_opt = optimizer(model), optimizer(ref)
    opts = pipelined(schedule, False, G, device).outputMode(poptorch.OutputMode.All)
    train = poptorch.trainingModel(model, opts, opt)
    for call in range(2):
        x, y = data(2 * G, seed=call)
        out, loss = train(x, y)
        ref_outs, ref_losses, ref_grads = reference_training(
            ref, ClippedSteps(ref_opt, 0.05), x, y, 1, G, 1)
        where = f"call {call}"
        assert_close(out, torch.cat(ref_outs), atol=ATOL, rtol=0, msg=where)
        assert_close(loss, torch.stack(ref_losses), atol=ATOL, rtol=0, msg=where)
        grads = trained_grads(train)
        for name, p in model.named_parameters():
            if name != "head.bias":  # plain PyTorch's zero_grad leaves it to accumulate
                assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=0,
                             msg=f"{name}, {where}")
            assert_close(p.detach(), dict(ref.named_parameters())[name].detach().cpu(),
                         atol=ATOL, rtol=0, msg=f"{name}, {where}")
        assert_same_state(opt, ref_opt)
    train.destroy()
