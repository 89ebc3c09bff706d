"""Pipeline stages in other processes ([Note: stages in other processes]): 2, 3 and 4
processes on loopback with gloo, started by the test, against one process running the same
model.

Every configuration (tests/support/_pipeline_worker.py ``CONFIGS``) runs three calls with
dropout; the reference is the same wrapper in this process without
``set_ipu_processes`` (with ``replicationFactor`` standing for data-parallel pipelines).
A pipeline over processes does the same arithmetic in the same order, so it agrees bit for
bit; where gradients are summed over processes (data-parallel replicas, a weight tied
across processes, the clipping norm) only the fp32 summation order differs (atol 1e-6).
"""

import pathlib

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch

import _pipeline_worker as worker
from processes import collective_s, start

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "_pipeline_worker.py"
ATOL = 1e-6


def spawn(scenario, W, out, codes=None):
    """Run the worker's ``scenario`` in W processes; their results, by rank. Every process
    must exit with 0 (or ``codes[rank]``)."""
    for r, (code, _, stderr) in enumerate(start(WORKER, [scenario, out], W)):
        assert code == (codes or {}).get(r, 0), f"rank {r}:\n{stderr[-4000:]}"
    return [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(W)
            if (out / f"{scenario}-rank{r}.pt").exists()]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2_processes", "3_processes",
                                                       "4_processes"])
def trained(request, tmp_path_factory):
    W = request.param
    return W, spawn("train", W, tmp_path_factory.mktemp(f"pipeline{W}"))


def one_process(name):
    """The reference, with one intra-op thread as each process has (OMP_NUM_THREADS=1): a
    matrix product split over threads can round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return worker.train(name, spread=False)
    finally:
        torch.set_num_threads(threads)


def summed_across_processes(name):
    W, kind, ipus, *_, opt = worker.CONFIGS[name]
    return W > len(ipus) or kind == "skip" or opt == "clip"


def test_every_configuration_matches_one_process(trained):
    """Losses and outputs of every micro-batch of every call, then every parameter and buffer
    of the whole model and the optimizer state, in every process."""
    W, results = trained
    names = [n for n, c in worker.CONFIGS.items() if c[0] == W]
    assert names
    for name in names:
        ref = one_process(name)
        ipus = worker.CONFIGS[name][2]
        exact = not summed_across_processes(name)
        for rank, result in enumerate(results):
            got = result[name]
            where = worker.layout(name, rank)
            replica = where.pipeline
            for c, ((out, loss), (ref_out, ref_loss)) in enumerate(zip(got["outputs"],
                                                                        ref["outputs"])):
                # the reference interleaves the replicas' micro-batches ([D, G, R, B] layout)
                R = W // len(ipus)
                pick = lambda t: t.view(-1, R, *t.shape[1:])[:, replica].reshape(-1, *t.shape[1:])
                ref_out = pick(ref_out.view(-1, worker.B, ref_out.shape[-1]))
                ref_loss = pick(ref_loss.view(-1, 1)).view(-1)
                if exact:
                    assert torch.equal(loss, ref_loss), (name, rank, c)
                    assert torch.equal(out.view(ref_out.shape), ref_out), (name, rank, c)
                else:
                    assert_close(loss, ref_loss, atol=ATOL, rtol=0, equal_nan=True,
                                 msg=f"{name} {rank} {c}")
                    assert_close(out.view(ref_out.shape), ref_out, atol=ATOL, rtol=0,
                                 equal_nan=True)
            for k, v in ref["params"].items():
                if exact:
                    assert torch.equal(got["params"][k], v), (name, rank, k)
                else:
                    assert_close(got["params"][k], v, atol=ATOL, rtol=0, msg=f"{name} {k}")
            assert got["opt"], name
            for pname, state in got["opt"].items():  # only the parameters it steps
                for key, value in state.items():
                    if torch.is_tensor(value):
                        expected = ref["opt"][pname][key]
                        if name in worker.SHARDED and expected.dim():  # this pipeline's chunk
                            c = -(-expected.numel() // where.pipelines)
                            expected = expected.reshape(-1)[replica * c:(replica + 1) * c]
                        assert_close(value, expected, atol=0 if exact else ATOL,
                                     rtol=0, msg=f"{name} {pname} {key}")
            assert torch.equal(got["rng"], ref["rng"]), name  # the same draws as one process
            assert got["scale"] == ref["scale"], name
            if "inference" in ref:  # an inference model of the trained model, spread too
                assert_close(got["inference"], ref["inference"], atol=0 if exact else ATOL,
                             rtol=0, msg=name)
            assert got["timeline"] == [
                f"ipu{k} (cpu)" if k in ipus[where.position] else
                f"ipu{k} (process {where.rank_of(where.pipeline, j)})"
                for k in range(len(ref["timeline"])) for j, ids in enumerate(ipus) if k in ids]


@pytest.mark.parametrize("trained", [4], ids=["4_processes"], indirect=True)
def test_the_process_order_changes_which_rank_runs_what_and_no_number(trained):
    """Data-parallel-inner puts the replicas of a stage on neighbouring ranks (0, 1 run stage
    0 of pipelines 0, 1): every number of each (pipeline, position) is bit for bit that of
    the same configuration in pipeline-inner order (ranks 0, 2 run stage 0)."""
    W, results = trained
    dp, pi = "4-grouped-two-replicas-data-parallel-inner", "4-grouped-two-replicas"
    assert [(worker.layout(dp, r).pipeline, worker.layout(dp, r).position)
            for r in range(W)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for rank in range(W):
        where = worker.layout(dp, rank)
        twin = results[worker.layout(pi, 0).rank_of(where.pipeline, where.position)][pi]
        got = results[rank][dp]
        for (out, loss), (twin_out, twin_loss) in zip(got["outputs"], twin["outputs"]):
            assert torch.equal(out, twin_out) and torch.equal(loss, twin_loss), rank
        assert all(torch.equal(got["params"][k], v) for k, v in twin["params"].items()), rank
        assert got["opt"].keys() == twin["opt"].keys() and all(
            torch.equal(got["opt"][p][k], v) for p, s in twin["opt"].items()
            for k, v in s.items() if torch.is_tensor(v)), rank


def _layer(name):
    return name.rsplit(".", 1)[0]


# The layers whose optimizer state each position of the pipeline holds; fc1 is used by
# stages in two processes (a tied weight), so both hold it.
OWN_LAYERS = {
    ("mlp", ((0,), (1,))): [{"layers.0", "layers.1"}, {"layers.2", "bn", "head"}],
    ("replicable", ((0,), (1,))): [{"layers.0", "layers.1"}, {"layers.2", "head"}],
    ("state", ((0,), (1,))): [{"fc", "emb"}, {"head"}],  # stage 1 reads emb's snapshot
    ("skip", ((0,), (1,), (2, 3))): [{"fc0"}, {"fc1"}, {"fc2", "fc1", "head"}],
    ("skip", ((0, 2), (1,), (3,))): [{"fc0", "fc2"}, {"fc1"}, {"fc1", "head"}],
}


def test_each_process_holds_optimizer_state_for_its_own_stages_only(trained):
    W, results = trained
    for name, (w, kind, ipus, *_) in worker.CONFIGS.items():
        if w != W:
            continue
        own = OWN_LAYERS[kind, tuple(tuple(i) for i in ipus)]
        for rank, result in enumerate(results):
            held = {_layer(n) for n in result[name]["opt"]}
            assert held == own[worker.layout(name, rank).position], (name, rank)


def test_a_failing_action_ends_the_call_in_every_process_which_keep_their_last_step(tmp_path):
    results = spawn("fail", 2, tmp_path)
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 1 and len(result["losses"]) == 2, rank
        error = result["errors"][0]
        where = ("action 1F2 (forward) failed on process 1, stream 1 (IPU 1, cpu), stage 1 "
                 "['b1'], micro-batch 2 of device iteration 0: RuntimeError: injected fault")
        if rank == 1:
            assert error.startswith(where), error
        else:
            assert error.startswith(
                f"process 1 failed this run of schedule 'interleaved', so process 0 stopped "
                f"with it: {where}"), error
            assert error.endswith("No process applied this run's step")
    # both processes are as after the first call: the reference runs that call alone
    ref = reference_of_failing(calls=[0])
    for result in results:
        for k, v in ref.items():
            assert torch.equal(result["after_failure"][k], v), k
    # and the third call continues from there, as one process would
    ref = reference_of_failing(calls=[0, 2])
    for result in results:
        for k, v in ref.items():
            assert torch.equal(result["params"][k], v), k
        assert torch.equal(results[0]["losses"][1], results[1]["losses"][1])


def reference_of_failing(calls):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the processes: see one_process
    try:
        return _failing_reference(calls)
    finally:
        torch.set_num_threads(threads)


def _failing_reference(calls):
    torch.manual_seed(0)
    model = worker.Probed(2, stateful=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(
        schedule=poptorch.PipelineSchedule.Interleaved))
    opts.Training.gradientAccumulation(4)
    wrapped = poptorch.trainingModel(model, opts, opt)
    for c in range(3):
        torch.manual_seed(c)
        x, y = worker.probed_batch(4)
        if c in calls:
            wrapped(x, y)
    wrapped.destroy()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_process_that_exits_ends_the_others_call_naming_it_and_later_calls_refuse(tmp_path):
    """Process 1 exits at its third call (as a crash): process 0's call fails at the first
    message it misses, within the collective timeout, and its next call refuses to run."""
    (rank0,) = spawn("errors", 2, tmp_path, codes={1: 3})
    kind, text, notes, cause = rank0["remote"]
    assert (kind, cause) == ("ExecutionError", "NoneType")
    assert text == (
        "process 1 failed this run of schedule 'grouped', so process 0 stopped with it: action "
        "1B1 (backward) failed on process 1, stream 1 (IPU 1, cpu), stage 1 ['b1'], micro-batch "
        "1 of device iteration 0: RuntimeError: injected fault. No process applied this run's "
        "step")
    kind, text, notes, cause = rank0["lost"]
    assert (kind, cause) == ("ExecutionError", "ChannelError")
    assert text.startswith(
        "action 0B0 (backward) failed on process 0, stream 0 (IPU 0, cpu), stage 0 ['b0'], "
        "micro-batch 0 of device iteration 0: ChannelError: receiving the gradient of "
        "node:probe of micro-batch 0 (stage 1) from process 1 failed: ")
    assert ("Process 1 failed or exited (see its own error), or did not answer within the "
            f"collective timeout of {collective_s()} s (POPTORCH_LITE_DIST_TIMEOUT)") in text
    assert notes == ["poptorch_lite: the call was undone: parameters, buffers, optimizer state, "
                     "loss scale and random state are as they were before it"]
    kind, text, notes, cause = rank0["broken"]
    assert kind == "ExecutionError"
    assert text == (
        "this model's processes went out of step in an earlier call (0B0: ChannelError): "
        "messages between them may be half delivered, so no further call can run; restart "
        "every process (from the last checkpoint: poptorch_lite.load_checkpoint)")


def test_a_process_missing_at_the_end_of_a_run_ends_the_others_call_naming_it(tmp_path):
    """Process 1 exits in its last forward of an inference call, after it received every
    activation: process 0 misses it at the end-of-run exchange, and later calls refuse."""
    (rank0,) = spawn("end", 2, tmp_path, codes={1: 3})
    kind, text, notes, cause = rank0["end"]
    assert (kind, cause) == ("ExecutionError", "ChannelError")
    assert text.startswith(
        "the run of schedule 'grouped' failed: ChannelError: exchanging the run's outcome and "
        "outputs with process 1 failed: ")
    assert ("Process 1 failed or exited (see its own error), or did not answer within the "
            f"collective timeout of {collective_s()} s (POPTORCH_LITE_DIST_TIMEOUT)") in text
    assert rank0["broken"][1] == (
        "this model's processes went out of step in an earlier call (the end of the run: "
        "ChannelError): messages between them may be half delivered, so no further call can "
        "run; restart every process (from the last checkpoint: poptorch_lite.load_checkpoint)")


def test_options_that_differ_or_a_placement_that_misses_an_ipu_are_refused_everywhere(tmp_path):
    results = spawn("refuse", 2, tmp_path)
    for rank, result in enumerate(results):
        other = 1 - rank
        assert result["mismatch"] == (
            f"Options.Training.gradientAccumulation differs between processes: "
            f"{8 if rank == 0 else 9} in this process (rank {rank}) but {9 if rank == 0 else 8} "
            f"in rank {other}; every process must use the same options, optimizer and model")
        assert result["uncovered"] == (
            "the model's stages run on IPUs [0, 1, 2, 3], but Options.Distributed."
            "set_ipu_processes([[0, 1], [2]]) gives no process IPU 3; give every IPU the model "
            "uses to a process")
        assert result["stageless"] == (
            "process 1 of each pipeline runs IPUs 2, 3 (Options.Distributed.set_ipu_processes), "
            "but no stage of the model runs there (its stages run on IPUs [0, 1]); give it a "
            "stage or leave it out, with one process fewer per pipeline")
        assert result["unchanged"]


def test_each_process_checkpoints_its_part_and_a_resumed_run_continues_exactly(tmp_path):
    results = spawn("checkpoint", 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["files"] == ["a.pt.process0-of-2", "a.pt.process1-of-2",
                                   "b.pt.process0-of-2", "b.pt.process1-of-2"]
        assert result["refused"] == (
            f"the parts of the checkpoint {str(tmp_path / 'a.pt')!r} are of different steps "
            f"(process 0: step 6, process 1: step 4): a process stopped while saving; resume "
            f"from an earlier checkpoint")
        assert result["steps"] == 4
        assert all(torch.equal(x, y) for x, y in zip(result["resumed"], result["losses"][2:]))
        assert all(torch.equal(result["resumed_final"][k], v) for k, v in result["final"].items())
        # B resumed with each process running the other's stage: the state put together
        # from both parts ([Note: resharding checkpoints]), the same arithmetic
        assert all(torch.equal(x, y) for x, y in zip(result["swapped"], result["losses"][2:]))
    missing = f"no checkpoint at {str(tmp_path / 'c.pt.process1-of-2')!r}; check the path"
    assert results[1]["missing"] == missing
    assert results[0]["missing"] == (f"process 1 cannot load its part of the checkpoint "
                                     f"{str(tmp_path / 'c.pt')!r}: {missing}")
    part = torch.load(tmp_path / "b.pt.process1-of-2", weights_only=True)
    assert sorted(part["model"]) == ["bn.bias", "bn.num_batches_tracked", "bn.running_mean",
                                     "bn.running_var", "bn.weight", "head.bias", "head.weight",
                                     "layers.2.bias", "layers.2.weight"]


def test_host_edits_of_a_processs_own_weights_survive_copy_weights_to_host(tmp_path):
    """copyWeightsToHost brings the other processes' weights; an edit of this process's own
    weight made before it still reaches the stage at the next call, as in one process."""
    ref = worker.host_edits(spread=False)
    for result in spawn("edits", 2, tmp_path):
        assert all(torch.equal(result[k], v) for k, v in ref.items())


@pytest.mark.parametrize("groups, name", [
    ("ours", "4-interleaved-two-replicas-sharded-clip"),  # the mesh's groups, messages, shards
    ("users", "3-interleaved-recompute-clip"),  # a tied weight's group; the user's default
])
def test_no_gloo_thread_outlives_the_exit_handlers_while_the_model_lives(groups, name, tmp_path):
    """gloo's worker threads end before the interpreter finalizes, though the trained
    wrapper is still alive: one of them letting go of a collective's tensors while it
    finalizes aborts the process ([Note: process groups at exit]; a CI run of the
    multi-node test died so). With the default group the user's, the user destroys it."""
    W = worker.CONFIGS[name][0]
    before = [r["before"] for r in spawn(f"exit-{groups}-{name}", W, tmp_path)]
    if not all(before):
        pytest.skip(f"this torch ({torch.__version__}) does not name gloo's threads")
    left = [torch.load(tmp_path / f"left-rank{r}.pt")["after"] for r in range(W)]
    assert left == [0] * W, (before, left)


def test_a_process_count_the_pipeline_does_not_divide_is_refused_when_wrapping(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    opts = poptorch.Options()
    opts.Distributed.set_ipu_processes([[0], [1]])
    with pytest.raises(poptorch.OptionsError) as info:
        poptorch.trainingModel(worker.BlockMLP(2), opts)
    assert str(info.value) == (
        "Options.Distributed.set_ipu_processes spreads each pipeline over 2 processes, but this "
        "run has 3 processes (Options.Distributed.numProcesses), which is not a multiple of 2; "
        "launch a multiple of 2 processes (torchrun --nproc_per_node 2 script.py for one "
        "pipeline, 4 for two data-parallel replicas of it)")


def test_docstring_examples_run():
    import doctest

    from poptorch_lite import checkpoint
    from poptorch_lite.compiler import rng, value_info
    from poptorch_lite.distributed import layout, sharding
    from poptorch_lite.runtime import channels
    for module in (layout, channels, value_info, rng, sharding, checkpoint):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
