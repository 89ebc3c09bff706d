"""The optimizer state sharded over 2 data-parallel processes ([Note: sharded optimizer state]):
tests/support/sharding_script.py trains each configuration with the state whole and
sharded, from the same weights on the same data, in the same 2 processes (gloo on loopback).
"""

import math

import pytest
import torch

import sharding_script as script
from poptorch_lite.distributed.sharding import Shards, shardable
from processes import ranks_results



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ranks_results("sharding_script.py", tmp_path_factory.mktemp("sharding"), 2)


def test_five_sharded_steps_end_where_the_whole_state_does(runs):
    """Losses, weights and the optimizer state gathered whole: bit for bit, but where clipping
    or LAMB's trust ratio sums squares by chunks (within 1e-6; 1e-4 with float16 moments)."""
    for rank, result in enumerate(runs):
        for name, (kind, _, _, clip) in script.CONFIGS.items():
            # clipping's norm and LAMB's trust ratio sum squares by chunks: within 1e-6; with
            # LAMB's first moment in float16, that rounding can move a moment by one float16
            # ulp, which the next steps carry into the weights (measured: 1.6e-5)
            atol = 1e-4 if kind == "lamb16" else 1e-6 if clip or kind == "lamb" else 0
            got = result[name]
            for whole, sharded in zip(*got["losses"]):
                torch.testing.assert_close(sharded, whole, atol=atol, rtol=0)
            whole, sharded = got["params"]
            assert whole.keys() == sharded.keys()
            for k, v in whole.items():
                torch.testing.assert_close(sharded[k], v, atol=atol, rtol=0, msg=f"{name} {k}")
            whole, sharded = got["state"]
            assert whole.keys() == sharded.keys() and whole, name
            for p, state in whole.items():
                assert state.keys() == sharded[p].keys(), (name, p)
                for k, v in state.items():
                    torch.testing.assert_close(sharded[p][k], v, atol=atol, rtol=0,
                                               msg=f"{name} {p} {k}")


def test_an_anchored_gradient_is_the_one_the_sharded_step_used(runs):
    """``Gradient___<name>`` anchors read the reduced (and clipped) gradient whole, as with
    the state whole, where each process holds only its chunks: gathered at each step, for
    small weights bucketed and for 1 MB ones on their own."""
    for rank, result in enumerate(runs):
        for name in script.ANCHORED:
            whole, sharded = result[name]["grads"]
            assert whole.keys() == sharded.keys() and whole, name
            for k, v in whole.items():
                atol = 1e-6 if script.CONFIGS[name][3] else 0  # clipping's norm by chunks
                torch.testing.assert_close(sharded[k], v, atol=atol, rtol=0,
                                           msg=f"rank {rank} {name} {k}")
                assert not torch.equal(v, torch.zeros_like(v)), (name, k)


def test_a_host_step_of_the_sharded_state_is_refused(runs):
    """The user's optimizer stepped on the host while it holds chunks: E-OPTIM-13 names the
    parameter and the sizes, and the state is as it was; with the state whole it steps."""
    for rank, result in enumerate(runs):
        (whole, whole_kept), (refused, kept) = result["host step"]
        assert whole is None and not whole_kept  # stepped: the momenta moved
        assert refused.startswith(
            "SGD.step() on the host: its state is sharded over 2 processes "
            "(useReplicatedTensorSharding(True)), and this process holds only a chunk of it "
            f"(param group 0, parameter 0: 'momentum_buffer' has {25 if rank == 0 else 24} "
            f"of the weight's 49 elements)"), refused
        assert kept


def test_one_processs_state_dict_loaded_in_every_process_is_refused_in_both(runs):
    """Graphcore's BERT saves ``optimizer.state_dict()`` on instance 0 alone and every
    instance loads it: process 1 would step process 0's chunks (silently, where they have
    its chunks' size). Both processes refuse the call (E-OPTIM-14), naming process 1 and
    save_checkpoint, and nothing changes."""
    for rank, result in enumerate(runs):
        refused, unchanged = result["rank 0's state everywhere"]
        assert unchanged
        assert refused.startswith(
            "the optimizer's state is sharded over 2 processes (useReplicatedTensorSharding"
            "(True)), and process [1] holds chunks of it that are not its own ("), refused
        assert ("here, in process 1, param group 0, parameter 0 holds the chunk of process 0 "
                "of 2 (elements 0..25), where this process steps elements 25..49" if rank
                else "this process, 0, holds its own") in refused, refused
        assert "poptorch.save_checkpoint(path, model)" in refused


def test_each_process_holds_its_half_of_the_state_plus_padding(runs):
    """Each weight of n elements leaves a process ceil(n/2) or floor(n/2) elements of each
    state tensor; the step counts (scalars) stay whole."""
    for rank, result in enumerate(runs):
        for name, (kind, *_) in script.CONFIGS.items():
            sizes = [p.numel() for p in script.BlockMLP(
                1, width=script.WIDTHS.get(name, script.WIDTH),
                classes=script.CLASSES).parameters()]
            whole, sharded = result[name]["bytes"]
            # bytes of state per element: SGD's momentum; two moments (LAMB16's first in
            # float16; RMSprop's square_avg and momentum_buffer); and a step count per weight
            per = {"sgd": 4, "poptorch-sgd": 4, "lamb16": 2 + 4}.get(kind, 8)
            scalars = 0 if per == 4 else 4 * len(sizes)
            assert whole == per * sum(sizes) + scalars, name
            mine = sum(math.ceil(n / 2) if rank == 0 else n // 2 for n in sizes)
            assert sharded == per * mine + scalars, name
            assert sharded <= whole / 2 + per * len(sizes) + scalars / 2, name


def test_a_sharded_checkpoint_resumes_exactly(runs):
    """Saved after 3 sharded steps (process 1's chunks beside the file), loaded into fresh
    sharded models: the last 2 steps are those of the run that never stopped."""
    for rank, result in enumerate(runs):
        resumed, straight = result["resumed"], result["adam-clip"]
        assert {"ckpt.pt", "ckpt.pt.shard1-of-2"} <= set(resumed["files"])
        assert all(torch.equal(a, b) for a, b in zip(resumed["losses"],
                                                     straight["losses"][1][3:]))
        assert all(torch.equal(resumed["params"][k], v)
                   for k, v in straight["params"][1].items())


def test_the_chunks_of_a_weight_cover_it_once_and_which_optimizers_shard():
    net = torch.nn.Linear(3, 1)  # a weight of 3 elements over 2 processes: chunks of 2
    spans = [Shards(lambda: None, k, 2, None)._spans(net.weight, 2) for k in range(2)]
    assert spans == [(0, 2), (2, 3)]
    assert Shards(lambda: None, 1, 4, None)._spans(torch.zeros(3), 1) == (1, 2)
    assert Shards(lambda: None, 3, 4, None)._spans(torch.zeros(3), 1) == (3, 3)  # owns nothing
    assert [shardable(o) for o in (
        torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.RMSprop(net.parameters()),
        script.poptorch.optim.AdamW(net.parameters()),
        script.poptorch.optim.LAMB(net.parameters()),
        type("Mine", (torch.optim.Adam,), {})(net.parameters()))] == [True, True, True, True,
                                                                       False]
