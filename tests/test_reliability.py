"""Reliability: a failing call changes nothing (every schedule, action kind, stage and
micro-batch; KeyboardInterrupt; the watchdog), loss scaling, and the lifecycle of models."""

import copy
import signal
import threading
import time

import pytest
import torch

import poptorch_lite as poptorch

from models import workers
from probes import PROBE, SCHEDULES, Probed, options, probed_batch

G, D = 5, 2  # two runs of five micro-batches: a failure in the second follows a step


def state(model, optimizer):
    """Everything a call may change, as plain values to compare."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            copy.deepcopy(optimizer.state_dict()), torch.get_rng_state())


def assert_same_state(a, b):
    (wa, oa, ra), (wb, ob, rb) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        sa, sb = oa["state"][k], ob["state"][k]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(torch.as_tensor(sa[n]), torch.as_tensor(sb[n])) for n in sa)
    assert torch.equal(ra, rb)


def stateful_model(schedule, recompute=False, **kwargs):
    torch.manual_seed(0)
    net = Probed(2, stateful=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opts = options(schedule, G, D, recompute)
    for name, value in kwargs.items():
        getattr(opts, name)(value)
    return net, opt, poptorch.trainingModel(net, opts, opt)


def fail_at(kind, stage, index, exc=RuntimeError("injected fault")):
    """A probe callback raising at the given action; kind "R" is the second forward."""
    seen = {}

    def fn(k, s, i):
        seen[k, s, i] = seen.get((k, s, i), 0) + 1
        if k == "F" and seen[k, s, i] == 2:
            k = "R"
        if (k, s, i) == (kind, stage, index):
            raise exc
    return fn


def warm_up(model, net):
    """One good call first, so the optimizer has momentum to lose."""
    x, y = probed_batch(G * D)
    model(x, y)
    return probed_batch(G * D)


# -- all-or-nothing calls -----------------------------------------------------------------


_UNDISTURBED: dict = {}


def undisturbed(schedule):
    """The second call's outputs and the state after it, in a run without failures."""
    if schedule not in _UNDISTURBED:
        net, opt, model = stateful_model(schedule)
        x, y = warm_up(model, net)
        _UNDISTURBED[schedule] = (model(x, y), state(net, opt))
        model.destroy()
    return _UNDISTURBED[schedule]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["F", "B", "R"])
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("index", [0, 5, 9])  # first, middle (second run), last micro-batch
def test_a_failing_call_changes_nothing_and_the_next_call_is_exact(schedule, kind, stage, index):
    (expected_out, expected_loss), expected_state = undisturbed(schedule)
    net, opt, model = stateful_model(schedule, recompute=kind == "R")
    x, y = warm_up(model, net)
    before = state(net, opt)
    PROBE["fn"] = fail_at(kind, stage, index)
    start = time.perf_counter()
    with pytest.raises(poptorch.ExecutionError) as info:
        model(x, y)
    assert time.perf_counter() - start < 1.0
    run, local = divmod(index, G)
    assert str(info.value).startswith(f"action {stage}{kind}{local} (")
    assert f"stage {stage} ['b{stage}'], micro-batch {local} of device iteration {run}" \
        in str(info.value)
    assert any("the call was undone" in note for note in info.value.__notes__)
    assert_same_state(state(net, opt), before)
    PROBE["fn"] = None
    out, loss = model(x, y)  # as if the failed call never happened (recomputation is exact)
    assert torch.equal(out, expected_out) and torch.equal(loss, expected_loss)
    assert_same_state(state(net, opt), expected_state)
    model.destroy()
    assert workers() == []


def test_a_failing_optimizer_step_changes_nothing():
    net, opt, model = stateful_model("grouped")
    x, y = warm_up(model, net)
    calls = []

    def hook(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second step of the call: the first one already ran
            raise RuntimeError("injected optimizer fault")
    handle = opt.register_step_pre_hook(hook)
    before = state(net, opt)
    with pytest.raises(poptorch.ExecutionError, match=r"^action U \(step\) failed .*device "
                       r"iteration 1: RuntimeError: injected optimizer fault"):
        model(x, y)
    assert_same_state(state(net, opt), before)
    handle.remove()
    model(x, y)
    model.destroy()


def interrupt_main():
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(0.5)  # still inside the action when the caller's thread sees the signal


@pytest.mark.parametrize("schedule", ["sequential", "grouped"])
def test_keyboard_interrupt_undoes_the_call_and_stops_every_stream(schedule):
    net, opt, model = stateful_model(schedule)
    x, y = warm_up(model, net)
    before = state(net, opt)

    def fn(k, s, i):
        if (k, s, i) == ("B", 1, 7):
            interrupt_main()
    PROBE["fn"] = fn
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    notes = "\n".join(info.value.__notes__)
    assert "interrupted while running 1B2 on stream 1" in notes
    assert "the call was undone" in notes
    assert_same_state(state(net, opt), before)
    assert all(t.is_alive() for t in workers())  # idle, waiting for work, not blocked in a run
    PROBE["fn"] = None
    model(x, y)
    model.destroy()
    assert workers() == []


def test_keyboard_interrupt_raised_inside_an_action_stays_a_keyboard_interrupt():
    net, opt, model = stateful_model("interleaved")
    x, y = warm_up(model, net)
    before = state(net, opt)
    PROBE["fn"] = fail_at("F", 0, 6, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    assert "poptorch_lite: raised by action 0F1" in info.value.__notes__
    assert_same_state(state(net, opt), before)
    PROBE["fn"] = None
    model(x, y)
    model.destroy()


def test_the_watchdog_firing_undoes_the_call():
    release = threading.Event()
    net, opt, model = stateful_model("grouped", watchdogTimeout=0.3)
    x, y = warm_up(model, net)
    before = state(net, opt)

    def fn(k, s, i):
        if (k, s, i) == ("B", 0, 8):
            release.wait(30)
    PROBE["fn"] = fn
    start = time.perf_counter()
    with pytest.raises(poptorch.ExecutionError, match=r"^action 0B3 \(backward\) failed .*"
                       r"device iteration 1: TimeoutError: no action finished for 0.3 s"):
        model(x, y)
    assert time.perf_counter() - start < 2.0
    assert_same_state(state(net, opt), before)
    stuck = [t for t in workers() if t.name.startswith("poptorch_lite-ipu0")]
    release.set()
    for t in stuck:
        t.join(5)
    PROBE["fn"] = None
    model(x, y)
    model.destroy()
    assert workers() == []


def test_an_inference_call_that_fails_leaves_buffers_and_random_state():
    torch.manual_seed(0)
    net = Probed(2, stateful=True)
    model = poptorch.inferenceModel(net, options("grouped", 1, 4))
    x, _ = probed_batch(4)
    before = ({k: v.clone() for k, v in net.state_dict().items()}, torch.get_rng_state())
    PROBE["fn"] = fail_at("F", 1, 3)
    with pytest.raises(poptorch.ExecutionError, match=r"^action 1F3 \(forward\) failed .*"
                       r"micro-batch 3: RuntimeError"):
        model(x, x)
    after = ({k: v.clone() for k, v in net.state_dict().items()}, torch.get_rng_state())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert torch.equal(before[1], after[1])
    model.destroy()
