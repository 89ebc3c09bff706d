"""The gradient all-reduce overlapped with the backward ([Note: overlapped all-reduce]):
tests/support/overlap_script.py trains each configuration in 2 processes (gloo on loopback)
with the overlap and without it, from the same weights on the same data.
"""

import pytest
import torch

import overlap_script as script
from poptorch_lite.distributed.overlap import Overlap, buckets_in_backward_order
from poptorch_lite.distributed.processes import _buckets
from poptorch_lite.runtime.update import overlappable
from processes import ranks_results

NOT_OVERLAPPED = {"accumulated-in-float16-not-overlapped"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ranks_results("overlap_script.py", tmp_path_factory.mktemp("overlap"), 2)


def test_the_overlapped_all_reduce_gives_the_same_numbers(runs):
    """Every configuration: the losses, the weights and the gradients the last step used are
    those of the all-reduce after the backward, bit for bit (2 processes: each element is
    one sum of the same two values)."""
    for rank, result in enumerate(runs):
        for name in script.CONFIGS:
            overlapped, plain = result[name]
            assert all(torch.equal(a, b) for a, b in zip(overlapped["losses"], plain["losses"]))
            for k, v in plain["weights"].items():
                assert torch.equal(overlapped["weights"][k], v), (rank, name, k)
            for k, g in plain["grads"].items():
                got = overlapped["grads"][k]
                assert (got is None) == (g is None) and (g is None or torch.equal(got, g)), \
                    (rank, name, k)


def test_buckets_go_while_the_backward_runs(runs):
    """Every bucket goes before the update, in every step where the overlap applies: the
    three 1.4 MB weights each alone, the small tensors together; the first (the last layer's
    weight) while the backward has made the final gradients of the head and that layer only;
    a frozen layer's weight is in no bucket (a frozen first weight: three buckets, the
    small tensors' last); a weight that gets no gradient holds its bucket
    back to the update, and keeps no gradient; the sharded state's reduce-scatter goes the
    same way; an accumulator of another dtype keeps the all-reduce in the update."""
    for result in runs:
        for name in script.CONFIGS:
            early = result[name][0]["early"]
            if name in NOT_OVERLAPPED:
                assert early == [None] * script.STEPS, name
            elif name == "frozen-layer":
                assert early == [(3, 3, 4, 6)] * script.STEPS, name
            elif name == "frozen-first-weight":  # the small tensors' bucket goes last
                assert early == [(3, 3, 4, 7)] * script.STEPS, name
            elif name == "a-weight-without-gradient":  # its bucket (the small one) goes last
                assert early == [(3, 4, 4, 9)] * script.STEPS, name
            elif name == "compiled-stages":  # AOTAutograd's backward hands out every
                # gradient of a stage at once: its first bucket goes at its first
                assert early == [(4, 4, 1, 8)] * script.STEPS, name
            else:
                assert early == [(4, 4, 4, 8)] * script.STEPS, name
        assert result["frozen-layer"][0]["grads"]["layers.1.weight"] is None
        # destroy() takes the hooks off the user's parameters
        assert all(result[name][0]["hooks_left"] == 0 for name in script.CONFIGS)
        assert result["a-weight-without-gradient"][0]["grads"]["offset"] is None


def test_the_flags_ride_in_the_last_bucket_where_it_is_a_flat_copy(runs):
    """Which weights had a gradient is summed after the last bucket's gradients in its own
    all-reduce (one collective a step, as DDP's) where that bucket is the small tensors'
    flat copy: a frozen first weight puts the biases' bucket last; a weight without a
    gradient holds it back to the update, and is found absent from the carried flags (the
    numbers are checked above). Where a 1.4 MB weight goes last, reduced in place, or the
    reduce-scatter of the sharded state, the flags go in an all-reduce of their own."""
    carrying = {"frozen-first-weight", "a-weight-without-gradient"}
    for result in runs:
        for name in script.CONFIGS:
            carried = result[name][0]["carried"]
            if name in NOT_OVERLAPPED:
                assert carried == [None] * script.STEPS, name
            else:
                assert carried == [name in carrying] * script.STEPS, name


def test_which_parameters_are_overlapped_and_in_what_order():
    """Every stepped parameter must be its own home and a leaf of exactly one graph; the
    buckets go last parameter first (the backward's order)."""
    net = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 2))
    params = dict(net.named_parameters())
    buckets = buckets_in_backward_order(params, _buckets)
    assert [[tuple(p.shape) for p in b] for b in buckets] == [[(2,), (2, 600), (600,)],
                                                               [(600, 600)]]

    class Weights:
        offload = False

        def shared(self):
            return False

        def home(self, name):
            return params[name]

    class Stage:
        recompute, param_names = False, tuple(params)

    assert overlappable(params, Weights(), [Stage()]) == params
    assert overlappable(params, Weights(), [Stage(), Stage()]) is None  # shared by two
    Weights.offload = True
    assert overlappable(params, Weights(), [Stage()]) is None


def test_a_sparse_gradient_goes_alone_and_carries_no_flags():
    """A sparse embedding's weight (found in the traced graph) is a bucket of its own, summed
    as a sparse tensor: flattened with the small ones, its all-reduce failed. The end-to-end
    checks are the fuzzer's found examples ``sparse_gradients_over_two_processes*``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from poptorch_lite.distributed.processes import _AllReduce
    from poptorch_lite.runtime.update import sparse_gradients
    emb, head = torch.nn.Embedding(5, 3, sparse=True), torch.nn.Linear(3, 2)

    def forward(w, weight, bias, i):
        return torch.nn.functional.linear(torch.nn.functional.embedding(i, w, sparse=True),
                                          weight, bias)
    graph = make_fx(forward)(emb.weight, head.weight, head.bias, torch.tensor([1]))

    class Stage:
        module, inputs = graph, ("param:emb.weight", "param:head.weight", "param:head.bias",
                                 "input:0")
    assert sparse_gradients([Stage()]) == {"emb.weight"}
    assert sparse_gradients([type("Dense", (Stage,), {"module": make_fx(
        lambda w, *rest: torch.nn.functional.embedding(rest[-1], w))(
            emb.weight, head.weight, head.bias, torch.tensor([1]))})]) == frozenset()
    params = {"emb.weight": emb.weight, "head.weight": head.weight, "head.bias": head.bias}
    assert [[n for n, p in params.items() if any(p is q for q in b)] for b in
            buckets_in_backward_order(params, lambda ps: _buckets(ps, alone={id(emb.weight)}))
            ] == [["head.weight", "head.bias"], ["emb.weight"]]
    head(emb(torch.tensor([1, 1]))).sum().backward()
    assert emb.weight.grad.is_sparse and _AllReduce(None).carries([head.weight])
    assert not _AllReduce(None).carries([emb.weight])


def test_a_users_hook_registered_after_the_overlaps_is_seen():
    """The overlap's hooks must run after a user's post-accumulate hooks (which edit each
    process's gradient before the sum, as in plain PyTorch): one registered after them
    (between calls) is seen, and the update then makes the overlap again. The end-to-end
    check is the fuzzer's found example ``post_accumulate_hook_registered_after_the_
    overlapped_all_reduce``."""
    net = torch.nn.Linear(3, 2)
    earlier = net.bias.register_post_accumulate_grad_hook(lambda p: None)
    params = dict(net.named_parameters())
    overlap = Overlap(params, [list(params.values())], None, None, None)
    assert overlap.hooked_last()  # the user's first, then the overlap's
    later = net.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert not overlap.hooked_last()
    later.remove()
    assert overlap.hooked_last()
    overlap.remove()
    assert list(net.bias._post_accumulate_grad_hooks) == [earlier.id]


def test_docstring_examples_run():
    import doctest

    from poptorch_lite.distributed import overlap
    from poptorch_lite.runtime import update
    for module in (overlap, update):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
