"""Checkpoints that cross process layouts ([Note: resharding checkpoints] in checkpoint.py):
tests/support/reshard_script.py trains one epoch in 4 processes as 2 stages × 2 replicas,
and again changing layout at each checkpoint: 4 processes → 2 data-parallel processes → 1
process with 2 replicas → 4 processes, with the optimizer state whole and sharded.
"""

import pytest
import torch

import reshard_script as script
from processes import ranks_results

PROCESSES = {"four": 4, "two": 2, "one": 1, "back": 4}
VARIANTS = ("whole", "sharded")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resharding")
    # one launch each, in order: each loads the last's checkpoint
    return {phase: ranks_results("reshard_script.py", out, W, [phase], f"{phase}-rank{{r}}.pt")
            for phase, W in PROCESSES.items()}


def by_pipeline(ranks, variant, what):
    """``what`` of each pipeline (from its first stage's process), by step."""
    first = [r[variant][what] for r in ranks if r["layout"].position == 0]
    return [list(steps) for steps in zip(*first)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_layout_continues_the_run_that_never_stopped(runs, variant):
    """The steps after each change of layout return the losses of the uninterrupted run's
    steps, and every run ends with its weights (within 1e-6; measured: bit for bit)."""
    straight = by_pipeline(runs["four"], variant, "losses")  # [step][pipeline]
    for phase in ("two", "one", "back"):
        first = script.PHASES[phase][0]
        got = by_pipeline(runs[phase], variant, "losses")
        assert len(got) == script.STEPS - first
        for step, losses in enumerate(got, start=first):
            torch.testing.assert_close(torch.cat(losses), torch.cat(straight[step]),
                                       atol=1e-6, rtol=0, msg=f"{phase} step {step}")
    final = {k: v for r in runs["four"] for k, v in r[variant]["weights"].items()}
    assert len(final) == 8
    for phase in ("two", "one", "back"):
        weights = {k: v for r in runs[phase] for k, v in r[variant]["weights"].items()}
        assert weights.keys() == final.keys()
        for k, v in final.items():
            torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=f"{phase} {k}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_sample_of_the_epoch_is_read_once_across_the_changes(runs, variant):
    """The loader's position is global ([Note: global loader position]): each step after a
    change reads the samples of the uninterrupted run's step, and the epoch's 48 samples
    are read once each."""
    straight = [sorted(i for pipeline in step for i in pipeline)
                for step in by_pipeline(runs["four"], variant, "read")]
    read = straight[:script.PHASES["two"][0]]
    for phase in ("two", "one", "back"):
        first, *_, after = script.PHASES[phase]
        steps = [sorted(i for pipeline in step for i in pipeline)
                 for step in by_pipeline(runs[phase], variant, "read")]
        assert steps == straight[first:], phase
        read += steps[:(after if after is not None else first) - first + 1]
    assert sorted(i for step in read for i in step) == list(range(script.N))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_resumes_at_its_own_layout_from_each_processs_part(runs, variant):
    """A resumed by the 4 processes that saved it (each its own part; sharded, its own
    chunks of the state): the last 3 steps are the run's, bit for bit."""
    first = script.PHASES["two"][0]
    for result in runs["four"]:
        straight = result[variant]["losses"][first:]
        resumed = result[variant]["resumed"]
        assert len(resumed) == len(straight) == 3
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


def test_one_file_set_per_checkpoint(runs):
    """4 processes write 4 parts; 2 data-parallel processes writing the same path replace
    them with one file (and the second process's chunks, sharded)."""
    for variant in VARIANTS:
        files = runs["two"][0][variant]["files"]
        same = [f for f in files if f.startswith(f"{variant}-same.pt")]
        assert same == [f"{variant}-same.pt"] + (
            [f"{variant}-same.pt.shard1-of-2"] if variant == "sharded" else [])
        assert [f for f in runs["four"][0][variant]["files"] if "-same.pt" in f] == [
            f"{variant}-same.pt.process{r}-of-4" for r in range(4)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_spread_process_keeps_the_optimizer_state_of_its_own_stage(runs, variant):
    """Loading C (1 process: every weight's state) into processes that know their stage
    (compiled first), each keeps the state of its stage's 4 weights; one process, all 8."""
    assert [r[variant]["state_held"] for r in runs["back"]] == [4, 4, 4, 4]
    assert runs["one"][0][variant]["state_held"] == 8


@pytest.mark.parametrize("variant", VARIANTS)
def test_another_model_or_optimizer_is_refused_in_every_process(runs, variant):
    """C (1 process) loaded by 4 processes with another optimizer class, or another width:
    every process refuses, its weights unchanged."""
    for rank, result in enumerate(runs["back"]):
        refused = result[variant]["refused"]
        message, unchanged = refused["optimizer"]
        assert unchanged and message.endswith(
            "holds the state of a Adam optimizer, the model's is a SGD; use the same "
            "optimizer class"), (rank, message)
        message, unchanged = refused["model"]
        assert unchanged and message.endswith(
            "has layers.0.weight of shape (8, 8), the model (9, 9); wrap the same "
            "architecture"), (rank, message)


def test_chunks_put_together_whole_lose_the_key_of_whose_they_were():
    """A state sharded over 2 processes, put together whole for another layout: each
    tensor is the chunks joined in order, and the key that said whose chunks they were
    (``sharding.CHUNK``) is gone, since the state is nobody's chunk now."""
    from types import SimpleNamespace

    from poptorch_lite.checkpoint import _whole_optimizer_state
    from poptorch_lite.distributed.sharding import CHUNK
    layer = torch.nn.Linear(3, 1)  # a weight of 3 elements: chunks of 2 and 1
    model = SimpleNamespace(_optimizer=torch.optim.SGD(layer.parameters(), lr=0.1))
    pieces = [(k, {"state": {0: {"momentum_buffer": torch.arange(3.)[2 * k:2 * k + 2],
                                 CHUNK: (k, 2, 2 * k, min(2 * k + 2, 3))}}}) for k in range(2)]
    whole = _whole_optimizer_state("ckpt.pt", pieces, model)
    assert list(whole[0]) == ["momentum_buffer"]
    assert torch.equal(whole[0]["momentum_buffer"], torch.arange(3.).view(1, 3))
