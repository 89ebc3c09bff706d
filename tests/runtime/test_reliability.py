"""Reliability: a failing call changes nothing (every schedule, action kind, stage and
micro-batch; KeyboardInterrupt; the watchdog), loss scaling, and the lifecycle of models."""

import contextlib
import copy
import itertools
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch
from poptorch_lite.compiler import rng

from models import BlockMLP, data, twin, workers
from patience import WATCHDOG_S, interrupt_caller, limit
from probes import PROBE, SCHEDULES, Probed, options, probed_batch

G, D = 5, 2  # two runs of five micro-batches: a failure in the second follows a step


def state(model, optimizer):
    """Everything a call may change, as plain values to compare."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            copy.deepcopy(optimizer.state_dict()), torch.get_rng_state())


def assert_same_state(a, b):
    (wa, oa, ra), (wb, ob, rb) = a, b
    assert wa.keys() == wb.keys() and [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        sa, sb = oa["state"][k], ob["state"][k]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(torch.as_tensor(sa[n]), torch.as_tensor(sb[n])) for n in sa)
    assert torch.equal(ra, rb)


_MADE: list = []


@pytest.fixture(autouse=True)
def destroy_models():
    """A failing assertion must not leave workers behind for the next test to count."""
    yield
    while _MADE:
        _MADE.pop().destroy()


def stateful_model(schedule, recompute=False, ipu_model=False, **kwargs):
    torch.manual_seed(0)
    net = Probed(2, stateful=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opts = options(schedule, G, D, recompute).useIpuModel(ipu_model)
    for name, value in kwargs.items():
        getattr(opts, name)(value)
    model = poptorch.trainingModel(net, opts, opt)
    _MADE.append(model)
    return net, opt, model


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


def after_each_step(net, opt):
    """Record the state right after every optimizer step (a post-step hook) of the next call
    of a model whose stages have random ops: weights and optimizer state as the hook sees
    them, and the random state that a call which stopped there leaves: the call's start,
    advanced by the bases of its runs so far (a call draws its runs' bases together, the
    same numbers as one draw per run: [Note: micro-batch RNG])."""
    start, states = torch.get_rng_state(), []

    def record(*_):
        now = torch.get_rng_state()
        torch.set_rng_state(start)
        rng.draw_bases(len(states) + 1)
        states.append(state(net, opt))
        torch.set_rng_state(now)
    handle = opt.register_step_post_hook(record)
    return states, handle


def resumed_from(saved, schedule, ipu_model, x, y):
    """A fresh model put in ``saved``'s state, then called on (x, y): what the next call of a
    model left in that state must return and leave."""
    net, opt, model = stateful_model(schedule, ipu_model=ipu_model)
    warm_up(model, net)  # compiled and attached
    weights, optim_state, rng = saved
    model.load_state_dict(weights)
    opt.load_state_dict(optim_state)
    torch.set_rng_state(rng)
    out = model(x, y)
    result = (out, state(net, opt))
    model.destroy()
    torch.set_rng_state(rng)  # the caller's model goes on from the same random state
    return result


# -- failed calls -------------------------------------------------------------------------


# Every schedule, action kind and failing micro-batch (the first, the middle one that starts
# the second run, the last); the stage and the memories (shared, or the IPU Model's) turn in
# step with them, so that each of their values meets every value of the others.
FAILURES = [pytest.param(schedule, kind, index, k % 2, (k // 2) % 2 == 1,
                         id=f"{index}-{k % 2}-{kind}-{schedule}-"
                            f"{'ipu_model' if (k // 2) % 2 else 'shared'}")
            for k, (schedule, kind, index) in enumerate(
                itertools.product(SCHEDULES, ["F", "B", "R"], [0, 5, 9]))]


@pytest.mark.parametrize("schedule,kind,index,stage,ipu_model", FAILURES)
def test_a_failing_call_leaves_its_last_step_and_the_next_call_is_exact(
        schedule, kind, stage, index, ipu_model):
    """[Note: commit point]: a failure in run d leaves the state right after step d-1
    (before the call for d = 0): weights, optimizer state, buffers and random state."""
    net, opt, model = stateful_model(schedule, recompute=kind == "R", ipu_model=ipu_model)
    x, y = warm_up(model, net)
    before = state(net, opt)
    steps, handle = after_each_step(net, opt)
    PROBE["fn"] = fail_at(kind, stage, index)
    with pytest.raises(poptorch.ExecutionError) as info:  # at once: not the 600 s watchdog's
        model(x, y)
    handle.remove()
    run, local = divmod(index, G)
    assert str(info.value).startswith(f"action {stage}{kind}{local} (")
    assert f"stage {stage} ['b{stage}'], micro-batch {local} of device iteration {run}" \
        in str(info.value)
    assert len(steps) == run
    if run == 0:
        assert any("the call was undone: parameters, buffers, optimizer state, loss scale and "
                   "random state are as they were before it" in n for n in info.value.__notes__)
        assert_same_state(state(net, opt), before)
    else:
        assert any(f"the call was undone to its last completed optimizer step: {run} of its "
                   f"{D} steps were applied" in n for n in info.value.__notes__)
        assert_same_state(state(net, opt), steps[-1])
    assert model._steps == D + run
    PROBE["fn"] = None
    (expected_out, expected_loss), expected_state = resumed_from(
        state(net, opt), schedule, ipu_model, x, y)
    out, loss = model(x, y)  # exactly what a model in that state computes
    assert torch.equal(out, expected_out) and torch.equal(loss, expected_loss)
    assert_same_state(state(net, opt), expected_state)
    model.destroy()
    assert workers() == []


@pytest.mark.parametrize("ipu_model", [False, True], ids=["shared", "ipu_model"])
def test_a_failing_optimizer_step_is_unrecoverable(ipu_model):
    """The optimizer's own step failing part-way cannot be put back without a snapshot."""
    net, opt, model = stateful_model("grouped", ipu_model=ipu_model)
    x, y = warm_up(model, net)

    def hook(optimizer, args, kwargs):
        raise RuntimeError("injected optimizer fault")
    handle = opt.register_step_pre_hook(hook)
    with pytest.raises(poptorch.UnrecoverableError, match=(
            r"^action U \(step\) failed .*device iteration 0: the optimizer's step raised "
            r"part-way \(RuntimeError: injected optimizer fault\), so parameters and optimizer "
            r"state may be half updated and cannot be put back; reload the last checkpoint")):
        model(x, y)
    handle.remove()
    model.destroy()


@pytest.mark.parametrize("ipu_model", [False, True], ids=["shared", "ipu_model"])
def test_all_or_nothing_calls_undo_every_step_even_a_failing_optimizer_step(ipu_model):
    net, opt, model = stateful_model("grouped", ipu_model=ipu_model, allOrNothingCalls=True)
    x, y = warm_up(model, net)
    calls = []

    def hook(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second step of the call: the first one already ran
            raise RuntimeError("injected optimizer fault")
    handle = opt.register_step_pre_hook(hook)
    before = state(net, opt)
    with pytest.raises(poptorch.ExecutionError, match=r"^action U \(step\) failed .*device "
                       r"iteration 1: RuntimeError: injected optimizer fault") as info:
        model(x, y)
    assert any("as they were before it" in n for n in info.value.__notes__)
    assert_same_state(state(net, opt), before)
    assert model._steps == D
    handle.remove()
    (expected_out, expected_loss), expected_state = resumed_from(
        before, "grouped", ipu_model, x, y)
    out, loss = model(x, y)
    assert torch.equal(out, expected_out) and torch.equal(loss, expected_loss)
    assert_same_state(state(net, opt), expected_state)
    model.destroy()


@pytest.mark.parametrize("schedule", ["sequential", "grouped"])
def test_keyboard_interrupt_undoes_the_call_to_its_last_step_and_stops_every_stream(schedule):
    net, opt, model = stateful_model(schedule)
    x, y = warm_up(model, net)
    steps, handle = after_each_step(net, opt)  # the failure is in the second run

    def fn(k, s, i):
        if (k, s, i) == ("B", 1, 7):
            interrupt_caller()
    PROBE["fn"] = fn
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    notes = "\n".join(info.value.__notes__)
    assert re.search(r"interrupted while running (\S+ on stream 0, )?1B2 on stream 1;", notes)
    assert "the call was undone" in notes
    handle.remove()
    assert len(steps) == 1
    assert_same_state(state(net, opt), steps[0])
    PROBE["fn"] = None
    model(x, y)
    model.destroy()
    assert workers() == []


def test_a_ctrl_c_that_a_finalizer_swallows_during_a_call_is_raised_when_the_call_ends(
        monkeypatch):
    # CPython reports a KeyboardInterrupt raised inside a finalizer ("Exception ignored in")
    # and goes on; the call ran to its end, so the interrupt comes out there, the model as
    # after the call's last step.
    net, opt, model = stateful_model("sequential")
    x, y = warm_up(model, net)
    steps, handle = after_each_step(net, opt)
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))

    class Interrupts:
        def __del__(self):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def fn(k, s, i):
        if (k, s, i) == ("B", 1, 7):
            Interrupts()  # freed at once: Ctrl-C lands in its finalizer
    PROBE["fn"] = fn
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    PROBE["fn"] = None
    assert swallowed == [KeyboardInterrupt]
    assert info.value.__notes__[0].startswith(
        "poptorch_lite: a Ctrl-C during the call was swallowed where it landed")
    handle.remove()
    assert len(steps) == D
    assert_same_state(state(net, opt), steps[-1])
    model(x, y)
    model.destroy()


def test_ctrl_c_inside_the_optimizers_step_is_held_until_the_step_is_counted():
    # Sequential updates on the caller's thread, where Ctrl-C lands. Raised inside
    # optimizer.step() it left the step applied (here: all of it, from a post-step hook) but
    # not counted, and the call "undone" to before it; held, the step counts and the call
    # stops right after it.
    net, opt, model = stateful_model("sequential")
    x, y = warm_up(model, net)
    steps, handle = after_each_step(net, opt)
    interrupt = opt.register_step_post_hook(
        lambda *_: len(steps) == 1 and signal.pthread_kill(threading.main_thread().ident,
                                                           signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    assert info.value.__notes__[-1].startswith(
        "poptorch_lite: the call was undone to its last completed optimizer step: 1 of its 2 "
        "steps were applied")
    handle.remove(), interrupt.remove()
    assert len(steps) == 1
    assert_same_state(state(net, opt), steps[0])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    model(x, y)


def test_a_call_off_the_main_thread_or_under_a_users_handler_installs_none_and_trains_alike():
    # The Ctrl-C guard goes only where Python's own handler is, on the main thread: signal
    # refuses a handler from any other thread, and a user's handler stays in force. Either
    # way the call's step is the one a guarded call takes.
    nets = []
    for where in ("main", "thread", "user's handler"):
        net, opt, model = stateful_model("sequential")
        x, y = warm_up(model, net)
        seen = []
        hook = opt.register_step_post_hook(lambda *_: seen.append(signal.getsignal(signal.SIGINT)))
        if where == "thread":
            failed = []
            worker = threading.Thread(target=lambda: _call_catching(model, x, y, failed))
            worker.start(), worker.join()
            assert failed == []
        elif where == "user's handler":
            def handler(signum, frame):
                raise AssertionError("not reached")
            previous = signal.signal(signal.SIGINT, handler)
            try:
                model(x, y)
                assert signal.getsignal(signal.SIGINT) is handler
            finally:
                signal.signal(signal.SIGINT, previous)
        else:
            model(x, y)
        hook.remove()
        guarded = [h is not signal.default_int_handler and type(h).__name__ == "CtrlC"
                   for h in seen]
        assert guarded == [where == "main"] * D, (where, seen)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        nets.append(state(net, opt))
    assert_same_state(nets[1], nets[0])
    assert_same_state(nets[2], nets[0])


def _call_catching(model, x, y, failed):
    try:
        model(x, y)
    except BaseException as exc:  # seen by the test's thread
        failed.append(exc)


def test_the_ctrl_c_tests_pass_when_the_suite_starts_with_sigint_ignored():
    # A background job of a shell ("cmd &" in a script) starts with SIGINT ignored, which
    # Python keeps: the conftest gives the suite Python's own handler back (issue 46).
    launcher = ("import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "sys.exit(subprocess.call(sys.argv[1:]))")
    here = pathlib.Path(__file__).resolve()
    result = subprocess.run(
        [sys.executable, "-c", launcher, sys.executable, "-m", "pytest", "-q", "-p",
         "no:cacheprovider", "-p", "no:randomly",
         f"{here}::test_ctrl_c_inside_the_optimizers_step_is_held_until_the_step_is_counted",
         f"{here.parents[1]}/data/test_dataloader.py::test_ctrl_c_beside_an_async_loader_stops_the_"
         "script_cleanly"],
        capture_output=True, text=True, timeout=limit(300), cwd=here.parents[1],
        env={k: v for k, v in os.environ.items()  # its tmp_path where the suite's are
             if not k.startswith("PYTEST_") or k == "PYTEST_DEBUG_TEMPROOT"})
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.splitlines()[-1].startswith("3 passed")


def test_no_automatic_garbage_collection_runs_inside_a_call():
    # A collection runs the finalizers of whatever garbage it finds, on the thread that
    # allocated, and CPython drops a Ctrl-C that lands in a finalizer: a call would run on
    # past it. Collection is paused while a call runs, and a caller's own choice is kept.
    import gc
    net, opt, model = stateful_model("grouped")
    x, y = warm_up(model, net)
    seen = []
    PROBE["fn"] = lambda k, s, i: seen.append(gc.isenabled())
    model(x, y)
    assert seen and set(seen) == {False} and gc.isenabled()
    gc.disable()
    try:
        model(x, y)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_keyboard_interrupt_raised_inside_an_action_stays_a_keyboard_interrupt():
    net, opt, model = stateful_model("interleaved")
    x, y = warm_up(model, net)
    steps, handle = after_each_step(net, opt)  # the failure is in the second run
    PROBE["fn"] = fail_at("F", 0, 6, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as info:
        model(x, y)
    assert "poptorch_lite: raised by action 0F1" in info.value.__notes__
    handle.remove()
    assert len(steps) == 1
    assert_same_state(state(net, opt), steps[0])
    PROBE["fn"] = None
    model(x, y)
    model.destroy()


def test_the_watchdog_firing_undoes_the_call_to_its_last_step():
    release = threading.Event()
    net, opt, model = stateful_model("grouped", watchdogTimeout=WATCHDOG_S)
    x, y = warm_up(model, net)
    steps, handle = after_each_step(net, opt)  # the failure is in the second run

    def fn(k, s, i):
        if (k, s, i) == ("B", 0, 8):
            release.wait(limit(120))
    PROBE["fn"] = fn
    with pytest.raises(poptorch.ExecutionError, match=r"^action 0B3 \(backward\) failed .*"
                       r"device iteration 1: TimeoutError: no action finished for "
                       + re.escape(f"{WATCHDOG_S} s")):
        model(x, y)
    handle.remove()
    assert len(steps) == 1
    assert_same_state(state(net, opt), steps[0])
    stuck = [t for t in workers() if t.name.startswith("poptorch_lite-ipu0")]
    release.set()
    for t in stuck:
        t.join(limit(60))
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


# -- loss scaling -------------------------------------------------------------------------


def als_model(schedule="grouped", interval=2, scale=4.0, automatic=True):
    torch.manual_seed(3)
    net = BlockMLP(2)
    opt = poptorch.optim.SGD(net.parameters(), lr=0.1, loss_scaling=scale)
    opts = options(schedule, 4)
    opts.Training.setAutomaticLossScaling(automatic, growth_interval=interval)
    return net, opt, poptorch.trainingModel(net, opts, opt)


@pytest.mark.parametrize("schedule", ["sequential", "interleaved"])
def test_automatic_loss_scaling_skips_non_finite_steps_as_grad_scaler_does(schedule):
    net, opt, model = als_model(schedule)
    ref_net = twin(net)
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=2)
    scales = []
    for step in range(7):
        x, y = data(16, seed=step)
        if step in (2, 5):
            x[9, 3] = float("inf")  # micro-batch 2's loss and every gradient are not finite
        weights = [p.detach().clone() for p in net.parameters()]
        _, loss = model(x, y)
        ref_opt.zero_grad()
        for xs, ys in zip(x.split(4), y.split(4)):
            scaler.scale(F.cross_entropy(ref_net(xs, ys)[0], ys) / 4).backward()
        scaler.step(ref_opt)
        scaler.update()
        scales.append(opt.loss_scaling)
        assert opt.loss_scaling == scaler.get_scale()
        if step in (2, 5):  # skipped: the weights did not move
            assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters()))
        for p, q in zip(net.parameters(), ref_net.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert scales == [4.0, 8.0, 4.0, 4.0, 8.0, 4.0, 4.0]
    assert model._loss_scale.skipped_steps == 2
    model.destroy()


def test_a_non_finite_loss_passes_through_as_in_plain_pytorch():
    """PopTorch returns the NaN and trains on; so does plain PyTorch. No check by default."""
    net, opt, model = als_model(automatic=False, scale=1.0)
    ref_net = twin(net)
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    x, y = data(16)
    x[13, 0] = float("nan")  # micro-batch 3
    out, loss = model(x, y)
    ref_opt.zero_grad()
    ref_losses = []
    for xs, ys in zip(x.split(4), y.split(4)):
        ref_loss = F.cross_entropy(ref_net(xs, ys)[0], ys)
        ref_losses.append(ref_loss.detach())
        (ref_loss / 4).backward()
    ref_opt.step()
    assert torch.isnan(loss).any() and torch.isnan(ref_losses[3])
    for p, q in zip(net.parameters(), ref_net.parameters()):  # NaN where plain PyTorch has it
        assert torch.equal(torch.isnan(p), torch.isnan(q))
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, equal_nan=True)
    assert torch.isnan(net.layers[0].weight).all()
    model.destroy()


def test_stop_on_non_finite_loss_names_its_micro_batch():
    net, opt, model = als_model(automatic=False)
    model.destroy()
    opts = options("grouped", 4)
    opts.Training.stopOnNonFiniteLoss(True)
    model = poptorch.trainingModel(net, opts, opt)
    x, y = data(16)
    model(x, y)
    before = state(net, opt)
    x[13, 0] = float("nan")
    with pytest.raises(poptorch.ExecutionError, match=(
            r"^action 1F3 \(forward\) failed on .* micro-batch 3 of device iteration 0: "
            r"FloatingPointError: the loss of micro-batch 3 is nan, not finite.*"
            r"setAutomaticLossScaling\(True\)")):
        model(x, y)
    assert_same_state(state(net, opt), before)
    assert opt.loss_scaling == 4.0
    model.destroy()


def test_the_automatic_scale_never_grows_past_float32s_largest_number():
    """As GradScaler's update: a doubling that would overflow float32 is skipped (a scale of
    2**128 made every backward fail to build its float32 seed)."""
    from poptorch_lite.optim.loss_scale import LossScale
    scale = LossScale(2.0 ** 126, automatic=True, growth_interval=1)
    assert [scale.update(finite=True) for _ in range(3)] == [True] * 3
    assert (scale.scale, scale.good_steps) == (2.0 ** 127, 0)
    # GradScaler.update's kernel, on the same three finite steps
    torch_scale, tracker = torch.tensor([2.0 ** 126]), torch.zeros(1, dtype=torch.int32)
    for _ in range(3):
        torch._amp_update_scale_(torch_scale, tracker, torch.zeros(1), 2.0, 0.5, 1)
    assert float(torch_scale) == scale.scale


def test_set_optimizer_restarts_the_scale_from_the_new_loss_scaling():
    net, opt, model = als_model()
    x, y = data(16)
    model(x, y)
    model(x, y)
    assert opt.loss_scaling == 8.0  # grew after two good steps
    model.setOptimizer(poptorch.optim.SGD(net.parameters(), lr=0.1, loss_scaling=2.0))
    model(x, y)
    assert opt.loss_scaling == 2.0 and model._loss_scale.good_steps == 1
    model.destroy()


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_growth_interval_is_checked(bad):
    with pytest.raises(poptorch.OptionsError, match="growth_interval must be a positive int"):
        poptorch.Options().Training.setAutomaticLossScaling(True, growth_interval=bad)
    with pytest.raises(poptorch.OptionsError, match="needs a bool, got 1"):
        poptorch.Options().Training.setAutomaticLossScaling(1)


# -- checkpoints --------------------------------------------------------------------------


def resumable(seed, workers=0):
    torch.manual_seed(seed)
    net = BlockMLP(2, dropout=0.2)
    opt = poptorch.optim.Adam(net.parameters(), lr=0.01, loss_scaling=8.0)
    opts = options("grouped", 4, D=2).randomSeed(seed)
    opts.Training.setAutomaticLossScaling(True, growth_interval=3)
    x, y = data(100, seed=7)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(x, y), batch_size=2,
                                 shuffle=True, num_workers=workers)
    return net, opt, poptorch.trainingModel(net, opts, opt), loader


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_continues_bit_identically(tmp_path, workers):
    """Dropout, accumulation 4, two steps per call, Adam, automatic loss scaling, shuffle;
    saved in the middle of the second epoch (6 combined batches of 16 per epoch, 100 % 16
    leftover samples dropped)."""
    path = tmp_path / "ckpt.pt"
    net, opt, model, loader = resumable(0, workers)
    losses, calls = [], 0
    for epoch in range(3):
        for x, y in loader:
            _, loss = model(x, y)
            calls += 1
            if calls > 8:
                losses.append(loss)
            if calls == 8:
                poptorch.save_checkpoint(path, model, loader, extra={"note": "mid-epoch"})
                python_draw = random.random()  # Python's random state is saved too
    final = state(net, opt)
    model.destroy()

    net, opt, model, loader = resumable(1, workers)  # other weights, other random state
    random.seed(99)
    info = poptorch.load_checkpoint(path, model, loader)
    assert random.random() == python_draw
    assert (info.steps, info.epoch, info.extra) == (16, 1, {"note": "mid-epoch"})
    resumed = []
    for epoch in range(info.epoch, 3):
        for x, y in loader:
            resumed.append(model(x, y)[1])
    assert len(resumed) == len(losses) == 10
    assert all(torch.equal(a, b) for a, b in zip(resumed, losses))
    assert_same_state(state(net, opt), final)
    model.destroy()


def test_a_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    net, opt, model = als_model()
    model(*data(16))
    path = tmp_path / "ckpt.pt"
    poptorch.save_checkpoint(path, model)
    good = path.read_bytes()

    def broken(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        poptorch.save_checkpoint(path, model)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    model.destroy()


def test_unreadable_foreign_and_unfitting_files_are_refused_before_loading(tmp_path):
    net, opt, model = als_model()
    model(*data(16))
    path = tmp_path / "ckpt.pt"
    poptorch.save_checkpoint(path, model)
    model(*data(16))
    before = state(net, opt)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:200])
    foreign = tmp_path / "weights.pt"
    torch.save(net.state_dict(), foreign)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    cases = [
        (tmp_path / "missing.pt", r"no checkpoint at '.*missing.pt'; check the path"),
        (truncated, r"'.*truncated.pt' cannot be read as a checkpoint: it is truncated, corrupt "
                    r"or not a torch file \(.*\); use a file written by "
                    r"poptorch_lite.save_checkpoint"),
        (text, r"'.*notes.txt' cannot be read as a checkpoint"),
        (foreign, r"'.*weights.pt' is not a poptorch_lite checkpoint \(found \['head.bias', "
                  r".*for a plain state_dict use model.load_state_dict"),
    ]
    for bad, message in cases:
        with pytest.raises(poptorch.CheckpointError, match=message):
            poptorch.load_checkpoint(bad, model)
    assert_same_state(state(net, opt), before)

    other = BlockMLP(2, width=6)
    wrong = poptorch.trainingModel(other, options("grouped", 4),
                                   poptorch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(poptorch.CheckpointError, match=r"has layers.0.weight of shape \(8, 8\), "
                       r"the model \(6, 6\); wrap the same architecture"):
        poptorch.load_checkpoint(path, wrong)
    copied = twin(net)
    adam = poptorch.trainingModel(copied, options("grouped", 4),
                                  poptorch.optim.Adam(copied.parameters()))
    with pytest.raises(poptorch.CheckpointError, match="holds the state of a SGD optimizer, the "
                       "model's is a Adam"):
        poptorch.load_checkpoint(path, adam)
    with pytest.raises(poptorch.CheckpointError, match="holds no DataLoader position"):
        poptorch.load_checkpoint(path, model, poptorch.DataLoader(
            poptorch.Options(), torch.utils.data.TensorDataset(torch.ones(4)), batch_size=2))
    with pytest.raises(poptorch.CheckpointError, match="pass the model returned by "
                       "poptorch.trainingModel"):
        poptorch.save_checkpoint(path, poptorch.inferenceModel(twin(net)))
    assert_same_state(state(net, opt)[:2] + before[2:], before)  # building models drew numbers
    for m in (model, wrong, adam):
        m.destroy()


@contextlib.contextmanager
def saved_as_if_on(location):
    """``torch.save`` tags every storage with ``location`` (``"cuda:3"``), as it tags the
    storages of tensors that live on that GPU."""
    entry = (0, lambda storage: location, lambda storage, loc: None)
    torch.serialization._package_registry.insert(0, entry)
    try:
        yield
    finally:
        torch.serialization._package_registry.remove(entry)


def test_a_checkpoint_saved_on_gpus_loads_on_a_machine_with_fewer(tmp_path):
    """Its tensors are read into host memory and go to the model's devices; the random
    states of GPUs this machine lacks are left (nothing here can draw from them)."""
    net, opt, model = als_model()
    model(*data(16))
    saved = state(net, opt)
    path = tmp_path / "gpu.pt"
    with saved_as_if_on("cuda:3"), mock.patch.object(
            torch.cuda, "get_rng_state_all", lambda: [torch.get_rng_state()[:16]] * 4), \
            mock.patch.object(torch.cuda, "is_initialized", lambda: True):
        poptorch.save_checkpoint(path, model)
    with pytest.raises(RuntimeError, match="CUDA"):  # what torch.load alone does here
        torch.load(path, weights_only=True)
    assert len(torch.load(path, weights_only=True, map_location="cpu")["rng"]["cuda"]) == 4
    model(*data(16))
    info = poptorch.load_checkpoint(path, model)
    assert info.steps == 1
    assert_same_state(state(net, opt), saved)
    model.destroy()


def edited_checkpoint(tmp_path, edit):
    """A checkpoint after one call, changed by ``edit``; the model then takes another step."""
    net, opt, model = als_model()
    model(*data(16))
    path = tmp_path / "ckpt.pt"
    poptorch.save_checkpoint(path, model)
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, path)
    model(*data(16))
    return net, opt, model, path


def test_random_states_that_cannot_be_restored_are_refused_before_anything_loads(tmp_path):
    net, opt, model, path = edited_checkpoint(tmp_path, lambda c: c["rng"].update(
        cuda=[torch.zeros(16, dtype=torch.uint8), "not a state"]))
    before = state(net, opt)
    with pytest.raises(poptorch.CheckpointError) as info:
        poptorch.load_checkpoint(path, model)
    assert str(info.value) == (
        f"the checkpoint {str(path)!r} has random states that cannot be restored (the CUDA "
        f"generators' states are not a list of byte tensors); use a file written by "
        f"poptorch_lite.save_checkpoint")
    assert_same_state(state(net, opt), before)
    model.destroy()


def test_a_load_that_fails_part_way_puts_back_what_it_changed(tmp_path):
    """The loss scale's entry is unreadable; model and optimizer were loaded before it."""
    net, opt, model, path = edited_checkpoint(tmp_path, lambda c: c.update(loss_scale={}))
    before, steps, scale = state(net, opt), model._steps, model._loss_scale.state_dict()
    with pytest.raises(poptorch.CheckpointError, match=r"could not be loaded into this model "
                       r"\(KeyError: 'scale'\); nothing was changed"):
        poptorch.load_checkpoint(path, model)
    assert_same_state(state(net, opt), before)
    assert (model._steps, model._loss_scale.state_dict()) == (steps, scale)
    model(*data(16))  # and training goes on
    model.destroy()


def test_the_newest_file_set_at_a_path_loads_and_a_save_removes_the_others(tmp_path):
    """[Note: resharding checkpoints]: where a checkpoint of one process and the parts of
    two are both at the path (a save stopped before removing the other), the one written
    last loads; a save there leaves its own file set alone."""
    torch.manual_seed(0)
    net = BlockMLP(1)
    model = poptorch.trainingModel(net, options("grouped", 4),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(*data(16))
    path = tmp_path / "ckpt.pt"
    poptorch.save_checkpoint(path, model)  # step 1
    state = torch.load(path, weights_only=True)
    part = {"rank": 0, "processes": 2, "ipu_processes": None,
            "process_order": "pipeline_inner", "shards": None}
    for rank in range(2):  # the same state as 2 data-parallel parts, of step 7
        torch.save({**state, "steps": 7, "part": {**part, "rank": rank}},
                   f"{path}.process{rank}-of-2")
    os.utime(path, ns=(1, 1))  # the single file is older
    assert poptorch.load_checkpoint(path, model).steps == 7
    os.utime(f"{path}.process0-of-2", ns=(1, 1))  # now the parts are
    assert poptorch.load_checkpoint(path, model).steps == 1
    poptorch.save_checkpoint(path, model)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    model.destroy()


def test_a_loader_position_is_checked():
    loader = poptorch.DataLoader(poptorch.Options(),
                                 torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with pytest.raises(poptorch.DataLoaderError, match="not a DataLoader position"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(poptorch.DataLoaderError, match=r"the position 5 of epoch 0 does not fit "
                       r"this loader of 4 batches per epoch"):
        loader.load_state_dict({"epoch": 0, "batches": 5, "rng": torch.get_rng_state()})
    loader.load_state_dict({"epoch": 3, "batches": 4, "rng": None})  # a finished epoch
    assert [b[0].tolist() for b in loader][0] == [0.0, 1.0]
    assert loader.state_dict()["epoch"] == 4


def sharded_loader(P, batch_size=2, p=0, replicas=1, shuffle=True, **kwargs):
    """Process p of P's loader of 32 numbered samples, shuffled."""
    opts = poptorch.Options().randomSeed(3).replicationFactor(replicas)
    opts.Distributed.configureProcessId(p, P)
    return poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(32)),
                               batch_size=batch_size, shuffle=shuffle, **kwargs)


def read_steps(loaders, steps=None):
    """What each step reads (``steps`` of them, or to the epoch's end): the processes'
    batches, in process order, one list a step."""
    batches = zip(*(iter(loader) for loader in loaders))
    return [[int(i) for (batch,) in step for i in batch]
            for step in itertools.islice(batches, steps)]


def resumed(position, P, **kwargs):
    """P processes' loaders continuing ``position``."""
    loaders = [sharded_loader(P, p=p, **kwargs) for p in range(P)]
    for loader in loaders:
        loader.load_state_dict(position)
    return loaders


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_position_inside_an_epoch_continues_in_any_split(shuffle):
    """[Note: global loader position]: 2 processes read 3 of their 8 steps; 1 process with 2
    replicas, then 4 processes with batches of 1, then 2 processes again read the rest of
    that epoch: every step reads the samples of the uninterrupted run's step, each sample of
    the epoch once; the next epoch is the loader's own."""
    straight = read_steps([sharded_loader(2, p=p, shuffle=shuffle) for p in range(2)])
    assert sorted(i for step in straight for i in step) == list(range(32))
    two = [sharded_loader(2, p=p, shuffle=shuffle) for p in range(2)]
    steps = read_steps(two, 3)
    one = resumed(two[0].state_dict(), 1, replicas=2, shuffle=shuffle)
    assert len(one[0]) == 5 and one[0].state_dict()["batches_per_epoch"] == 5
    steps += read_steps(one, 2)
    four = resumed(one[0].state_dict(), 4, batch_size=1, shuffle=shuffle)
    assert [len(loader) for loader in four] == [3] * 4
    steps += read_steps(four, 1)
    again = resumed(four[0].state_dict(), 2, shuffle=shuffle)
    steps += read_steps(again)
    assert steps == straight
    assert again[0].state_dict()["batches"] == again[0].state_dict()["batches_per_epoch"] == 2
    assert len(again[0]) == 8  # the next epoch: the loader's own split
    fresh = [sharded_loader(2, p=p, shuffle=shuffle) for p in range(2)]
    read_steps(fresh)
    assert read_steps(again, 1) == read_steps(fresh, 1)


def test_a_resumed_position_counts_the_batches_it_skipped():
    """Resumed at batch 3 and read one more, a loader is at batch 4: a second checkpoint
    continues from there, not from batch 1 again (which read batches 1-3 twice)."""
    straight = read_steps([sharded_loader(1)])
    first = [sharded_loader(1)]
    steps = read_steps(first, 3)
    second = resumed(first[0].state_dict(), 1)
    steps += read_steps(second, 1)
    assert second[0].state_dict()["batches"] == 4
    steps += read_steps(resumed(second[0].state_dict(), 1))
    assert steps == straight


def test_one_process_rest_of_an_epoch_goes_to_two():
    """A single process's shuffle (torch's RandomSampler, from the generator state its epoch
    began with) is rebuilt and its rest shared out; a position saved at the rest's start
    (nothing of it read yet) continues it too."""
    torch.manual_seed(11)
    straight = read_steps([sharded_loader(1, batch_size=4)])
    torch.manual_seed(11)
    one = [sharded_loader(1, batch_size=4)]
    steps = read_steps(one, 5)
    two = resumed(one[0].state_dict(), 2)
    again = resumed(two[0].state_dict(), 2)  # saved before any of the rest was read
    steps += read_steps(again)
    assert steps == straight


def test_a_position_inside_an_epoch_is_refused_where_its_rest_cannot_be_shared_out():
    """A loader of another dataset, or one reading through a sampler of the user's, cannot
    continue another split's epoch: refused, the loader unchanged; from an epoch's end any
    split reads the next epoch whole."""
    two = sharded_loader(2)
    batches = iter(two)
    next(batches)
    mid = two.state_dict()
    for _ in batches:
        pass
    end = two.state_dict()
    assert (mid["batches"], mid["processes"], end["batches"], end["batches_per_epoch"]) == (
        1, 2, 8, 8)
    opts = poptorch.Options()
    for other, why in ((poptorch.DataLoader(opts, torch.utils.data.TensorDataset(
            torch.arange(32)), batch_size=2, sampler=range(32)), "a sampler of the user's"),
                       (poptorch.DataLoader(opts, torch.utils.data.TensorDataset(
                           torch.arange(40)), batch_size=2), "another dataset")):
        fresh = other.state_dict()
        with pytest.raises(poptorch.DataLoaderError, match=re.escape(
                "the position (batch 1 of 8 of epoch 0) was saved in the middle of an epoch by "
                "2 processes, each reading combined batches of 2, but this loader reads ")):
            other.load_state_dict(mid)
        assert other.state_dict() == fresh, why
    one = sharded_loader(1)
    one.load_state_dict(end)
    assert one.state_dict()["batches"] == len(one) == 16  # epoch 0 is over here too
    assert sorted(int(i) for (batch,) in one for i in batch) == list(range(32))
    assert one.state_dict()["epoch"] == 1


def test_docstring_examples_run():
    import doctest

    from poptorch_lite import checkpoint
    from poptorch_lite.data import dataloader
    from poptorch_lite.optim import loss_scale as loss_scaling
    from poptorch_lite.runtime import undo
    for module in (checkpoint, dataloader, loss_scaling, undo):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


# -- lifecycle ----------------------------------------------------------------------------


def test_a_hundred_models_leave_no_threads_and_no_memory_behind():
    """Half released by destroy(), half by garbage collection, in a fresh process."""
    script = pathlib.Path(__file__).resolve().parents[1] / "support" / "lifecycle_script.py"
    result = subprocess.run([sys.executable, str(script), "100"], capture_output=True,
                            text=True, timeout=limit(600))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["threads"] == []
    assert report["rss_ratio"] <= 1.05, report
    assert report["cuda_bytes"] == 0


# -- saved executables ([Note: saved executables] in poptorch_lite/executables.py) ----------


def test_a_saved_executable_loads_and_trains_on_as_the_original(tmp_path):
    """PopTorch's save()/poptorch.load(): the model, optimizer and the model's own random
    state come back, compiled for the same arguments; both then train identically."""
    torch.manual_seed(0)
    net = BlockMLP(2, dropout=0.2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(net, options("grouped", 4).randomSeed(3), opt)
    x, y = data(8)
    model(x, y)
    path = tmp_path / "nested" / "model.poptorch"
    model.save(path)
    loaded = poptorch.load(path)
    assert loaded.isCompiled() and loaded.model is not net
    for a, b in zip(loaded.model.state_dict().values(), net.state_dict().values()):
        assert torch.equal(a, b)
    x2, y2 = data(8, seed=5)
    for _ in range(2):
        assert torch.equal(loaded(x2, y2)[1], model(x2, y2)[1])
    for a, b in zip(loaded.model.parameters(), net.parameters()):
        assert torch.equal(a, b)
    model.destroy()
    loaded.destroy()


def test_an_executable_saved_without_its_model_loads_into_a_wrapper_of_ones_own(tmp_path):
    net = BlockMLP(1)
    infer = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(2))
    x, y = data(4)
    infer.compileAndExport(tmp_path, x, y, export_model=False)  # a folder: model.poptorch
    path = tmp_path / "model.poptorch"
    with pytest.raises(poptorch.CheckpointError, match="was created with 'export_model=False'"):
        poptorch.load(path)
    again = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(2))
    again.loadExecutable(path)
    assert again.isCompiled() and torch.equal(again(x, y)[0], infer(x, y)[0])
    with pytest.raises(poptorch.CheckpointError, match="not a poptorch_lite executable"):
        torch.save({"weights": 1}, tmp_path / "other.pt")
        poptorch.load(tmp_path / "other.pt")
