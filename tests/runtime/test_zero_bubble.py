"""The backward split into I and W ([Note: split backward]), the ZeroBubble kind at run time,
and stages balanced by measured time ([Note: balance by time])."""

import types

import pytest
import torch
from torch.testing import assert_close

import poptorch_lite as poptorch
from poptorch_lite.frontends import balance
from poptorch_lite.frontends.balance import BalancePlan, partition_even
from poptorch_lite.runtime.split_backward import backward_input, backward_weight, run_backward

from models import BlockMLP, data


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls: the chain back to the inputs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Counted.calls += 1
        return g


def _graph(x, w1, w2, b):
    """Two outputs; w2 used twice; b reaches the second output without a leaf's path."""
    h = torch.tanh(Counted.apply(x) @ w1)
    return [h @ w2 + b, (h * 2) @ w2, b.sum() * 3]


@pytest.mark.parametrize("leaf_grad", [True, False])
def test_the_split_gives_the_joint_backwards_gradients_and_w_skips_the_chain(leaf_grad):
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=leaf_grad)
    w1, w2, b = (torch.randn(4, 5, requires_grad=True), torch.randn(5, 2, requires_grad=True),
                 torch.randn(2, requires_grad=True))
    grads = [torch.randn(3, 2), torch.randn(3, 2), torch.tensor(1.5)]
    torch.autograd.backward(_graph(x, w1, w2, b), grads)
    joint = [t.grad.clone() for t in (w1, w2, b)] + ([x.grad.clone()] if leaf_grad else [])
    for t in (x, w1, w2, b):
        t.grad = None
    Counted.calls = 0
    outs = _graph(x, w1, w2, b)
    later = backward_input(outs, grads, [x], [w1, w2, b])
    assert all(t.grad is None for t in (w1, w2, b))
    assert Counted.calls == (1 if leaf_grad else 0)
    if leaf_grad:
        assert_close(x.grad, joint[3], atol=1e-6, rtol=0)
    else:  # nothing waits for an I: no walk over the graph, W one backward to every weight
        assert [(len(ps), frontier, seeding) for ps, frontier, seeding in later.groups] == [
            (3, [], (0, 1, 2))]
    backward_weight(later)
    assert Counted.calls == (1 if leaf_grad else 0)  # W did not run the chain again
    for t, g in zip((w1, w2, b), joint):
        assert_close(t.grad, g, atol=1e-6, rtol=0)


def test_the_split_is_walked_on_the_first_micro_batch_and_found_again_by_position(
        monkeypatch):
    """Later micro-batches find the first one's frontier nodes by their paths from the
    outputs (SplitPlan): no walk, the same gradients; a weight frozen since is a graph of
    another shape, walked again."""
    from poptorch_lite.runtime import split_backward as sb
    torch.manual_seed(0)
    w1, w2, b = (torch.randn(4, 5, requires_grad=True), torch.randn(5, 2, requires_grad=True),
                 torch.randn(2, requires_grad=True))
    walks = []
    real = sb._walk
    monkeypatch.setattr(sb, "_walk", lambda *a: walks.append(1) or real(*a))
    plans: list = []
    for i in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        grads = [torch.randn(3, 2), torch.randn(3, 2), torch.tensor(1.5)]
        torch.autograd.backward(_graph(x, w1, w2, b), grads)
        joint = [t.grad.clone() for t in (x, w1, w2, b)]
        for t in (x, w1, w2, b):
            t.grad = None
        outs = _graph(x, w1, w2, b)
        later = backward_input(outs, grads, [x], [w1, w2, b], plans)
        assert len(walks) == 1  # the first micro-batch's only
        located = plans[0].frontiers([sb._node(o) for o in outs], plans[0].shape)
        frontier = {n for _, met, _ in later.groups for n in met}
        assert frontier and frontier == {n for nodes in located for n in nodes}
        backward_weight(later)
        for t, g in zip((x, w1, w2, b), joint):
            assert_close(t.grad, g, atol=1e-6, rtol=0)
        for t in (w1, w2, b):
            t.grad = None
    w2.requires_grad_(False)
    x = torch.randn(3, 4, requires_grad=True)
    later = backward_input(_graph(x, w1, w2, b), grads, [x], [w1, w2, b], plans)
    assert len(walks) == 2 and all(p is not w2 for ps, _, _ in later.groups for p in ps)
    backward_weight(later)
    assert w2.grad is None and w1.grad is not None


def test_a_zero_bubble_run_splits_every_backward_and_keeps_1f1bs_stash():
    torch.manual_seed(0)
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule=poptorch.PipelineSchedule.ZeroBubble))
    opts.Training.gradientAccumulation(7)
    net = BlockMLP(4)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    model(*data(14))
    stats = model.runStatistics()
    kinds = sorted({s.kind for s in stats.timeline.spans})
    assert kinds == ["F", "G", "I", "U", "W"]
    assert list(stats.peak_stash_depth) == [4, 3, 2, 1]  # min(G, S - s), held until W
    assert "I input gradients, W weight gradients" in stats.timeline.render(width=40)
    model.destroy()


# -- balance by time ---------------------------------------------------------------------


def test_partition_even_minimises_the_slowest_stage():
    assert partition_even([1, 1, 1, 3], 2) == [0, 3]
    assert partition_even([4, 1, 1, 1, 1], 2) == [0, 1]
    assert partition_even([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5]
    assert partition_even([1, 1], 2) == [0, 1]
    plan = BalancePlan(["a", "b", "c", "d"], [1.0, 1.0, 1.0, 3.0], [0, 3])
    assert plan.stage_times == [3.0, 3.0] and plan.begin_blocks == ["d"]


class Slow(torch.nn.Module):
    """Takes ``seconds`` of a clock the test controls (CLOCK): the timings are the same on
    any machine, busy or idle."""

    def __init__(self, seconds):
        super().__init__()
        self.fc, self.seconds = torch.nn.Linear(8, 8), seconds

    def forward(self, x):
        CLOCK[0] += self.seconds
        return self.fc(x)


CLOCK = [0.0]


def test_balance_by_time_puts_the_slow_layer_alone_and_leaves_the_model_as_it_was(
        capsys, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(balance, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK[0]))
    seq = torch.nn.Sequential(torch.nn.BatchNorm1d(8), Slow(0.01), Slow(0.01), Slow(0.2))
    seq.train()
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    plan = poptorch.balance_by_time(seq, x, stages=2, repeats=5)
    assert plan.starts == [0, 3] and plan.begin_blocks == ["3"]
    assert plan.stage_times == pytest.approx([0.02, 0.2], rel=1e-9, abs=0)
    assert "expected time" in capsys.readouterr().out
    assert all(p.grad is None for p in seq.parameters())
    for k, v in seq.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, torch.nn.functional.cross_entropy(x, y)


def test_an_applied_plan_splits_the_model_where_it_says():
    torch.manual_seed(0)
    model = Chain()
    plan = poptorch.balance_by_time(model, *data(4), stages=2, verbose=False, apply=True)
    assert plan.layers == ["layers.0", "layers.1", "layers.2", "layers.3"]
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule="zero_bubble"))
    opts.Training.gradientAccumulation(3)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped(*data(12))
    rows = [r.split("|") for r in poptorch.stage_summary(wrapped).splitlines()[2:]]
    stage_of = {r[0].strip(): int(r[2]) for r in rows}
    first = plan.starts[1]
    assert [stage_of[f"layers.{k}"] for k in range(4)] == [int(k >= first) for k in range(4)]
    wrapped.destroy()


def test_docstring_examples_run():
    import doctest

    from poptorch_lite.frontends import balance
    from poptorch_lite.runtime import split_backward
    for module in (split_backward, balance):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


class Tied(torch.nn.Module):
    """Stage 1 uses stage 0's layer again: its W adds to a weight stage 0 reduces."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.relu(self.fc(x))
        with poptorch.Block("b", ipu_id=1):
            out = self.head(torch.relu(self.fc(h)))
            return out, torch.nn.functional.cross_entropy(out, y)


def test_a_weight_two_stages_share_is_reduced_after_both_ws():
    """The reduction of stage 0 waits for stage 1's W's too (they ran on another stream
    after it once, and the step lost their gradient)."""
    torch.manual_seed(0)
    model, G = Tied(), 6
    ref = Tied()
    ref.load_state_dict(model.state_dict())
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(schedule="zero_bubble"))
    opts.Training.gradientAccumulation(G)
    train = poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for call in range(4):
        x, y = data(2 * G, seed=call)
        train(x, y)
        ref_opt.zero_grad()
        for k in range(G):
            (ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])[1] / G).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0, msg=name)
    train.destroy()


def test_run_backward_adds_what_autograd_backward_adds_and_refuses_what_it_refuses(monkeypatch):
    """The stages' backward goes straight to autograd's engine (split_backward.run_backward):
    the same gradients as torch.autograd.backward, a wrong-shaped gradient refused, another
    dtype cast, and tensor subclasses through the documented path."""
    class Sub(torch.Tensor):
        pass

    def grads(backward, wrap=lambda t: t):
        w = torch.arange(3.0, requires_grad=True)
        backward([wrap(w) * 2, (wrap(w) ** 2).sum()],
                 [torch.ones(3, dtype=torch.float64), torch.tensor(0.5)])
        return w.grad
    expected = grads(torch.autograd.backward)
    assert torch.equal(grads(run_backward), expected)
    assert expected.dtype == torch.float32 and expected.tolist() == [2.0, 3.0, 4.0]
    calls, documented = [], torch.autograd.backward

    def counting(*a, **k):
        calls.append(a)
        return documented(*a, **k)
    monkeypatch.setattr(torch.autograd, "backward", counting)
    assert torch.equal(grads(run_backward, lambda t: t.as_subclass(Sub)), expected)
    assert calls and isinstance(calls[0][0][0], Sub)  # the subclass took the documented path
    taken = len(calls)
    assert torch.equal(grads(run_backward), expected) and len(calls) == taken  # plain ones not
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"got \[4\] but expected shape compatible with \[3\]"):
        run_backward([w * 2], [torch.ones(4)])


def _graph_tensors() -> int:
    """Tensors alive that still carry an autograd graph."""
    import gc
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_a_destroyed_zero_bubble_wrapper_leaves_no_saved_activation_behind():
    # The first call measures each stage's saved tensors with a pack hook; one that returned
    # the tensor itself made a node saving its own output hold itself through its grad_fn (a
    # cycle in autograd's C++ graph that gc cannot see): 3 tensors lived on per wrapper.
    def one():
        torch.manual_seed(0)
        model = BlockMLP(2)
        opts = poptorch.Options().setExecutionStrategy(
            poptorch.PipelinedExecution(schedule="zero_bubble"))
        opts.Training.gradientAccumulation(6)
        train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        train(*data(12))
        train.destroy()

    one()  # anything made once per process
    before = _graph_tensors()
    for _ in range(3):
        one()
    assert _graph_tensors() == before


def test_a_collected_program_takes_its_generated_sources_with_it():
    # torch.fx keeps every generated graph module's source for tracebacks, for the process's
    # life; a wrapper's program drops the ones its compile added when it is collected.
    import gc
    import linecache
    cache = torch.fx.graph_module._loader.eval_cache
    model = BlockMLP(2)
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(4)
    train = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    before = set(cache)
    train(*data(8))
    added = set(cache) - before
    assert added and added <= set(linecache.cache)
    train.destroy()
    del train
    gc.collect()
    assert not added & set(cache) and not added & set(linecache.cache)
