"""Placement: devices per IPU, streams running their lists concurrently, where weights live."""

import threading
import time

import pytest
import torch

from poptorch_lite.runtime import gpu
from poptorch_lite.runtime.devices import resolve_devices
from poptorch_lite.runtime.placement import Placement
from poptorch_lite.runtime.streams import ActionFailed, ActionStuck

from gpu_twin import TWIN, TwinGpu
from models import exited, workers
from patience import WATCHDOG_S, limit


def test_devices_follow_the_mapping_and_default_to_cpu_without_cuda():
    devices = resolve_devices([0, 1, 2], {1: torch.device("cpu")})
    assert devices[1] == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices == {0: torch.device("cpu"), 1: torch.device("cpu"), 2: torch.device("cpu")}


def run(placement, lists, waits=None, call=None, watchdog=None):
    placement.run_lists(lists, lambda a: (waits or {}).get(a, []), call or (lambda a: None),
                        watchdog)


def test_each_stream_runs_its_list_on_its_own_thread_at_the_same_time():
    placement = Placement([0, 1], {0: "cpu", 1: "cpu"})
    barrier = threading.Barrier(2, timeout=limit(30))  # only passes if both run at once
    names = {}

    def call(a):
        names[a] = threading.current_thread().name
        if a in ("a1", "b1"):
            barrier.wait()

    run(placement, {0: ["a0", "a1"], 1: ["b0", "b1"]}, call=call)
    assert {a: n.split("_")[1] for a, n in names.items()} == {
        "a0": "lite-ipu0", "a1": "lite-ipu0", "b0": "lite-ipu1", "b1": "lite-ipu1"}
    placement.close()
    assert workers() == []


def test_an_action_waits_for_what_it_needs_on_other_streams():
    placement = Placement([0, 1], None)
    order = []

    def call(a):
        if a == "a0":
            time.sleep(0.05)  # b0 would overtake it if it did not wait
        order.append(a)

    run(placement, {0: ["a0", "a1"], 1: ["b0", "b1"]}, waits={"b0": ["a0"], "a1": ["b0"]},
        call=call)
    assert order.index("a0") < order.index("b0") < order.index("a1")
    placement.close()


def test_a_failing_action_stops_the_other_streams_before_their_next_action():
    placement = Placement([0, 1], None)
    ran = []

    def call(a):
        ran.append(a)
        if a == "a1":
            raise ValueError("boom")

    with pytest.raises(ActionFailed) as info:
        run(placement, {0: ["a0", "a1", "a2"], 1: ["b0", "b1", "b2"]},
            waits={"b1": ["a1"], "b2": ["a2"]}, call=call)
    assert info.value.action == "a1" and isinstance(info.value.exc, ValueError)
    assert "a2" not in ran and "b1" not in ran and "b2" not in ran
    run(placement, {0: ["a0"], 1: ["b0"]})  # usable again
    placement.close()
    assert workers() == []


def test_a_ctrl_c_between_two_hand_offs_stops_the_streams_already_given_theirs(monkeypatch):
    # [Note: Ctrl-C during a run]: stream 0 has its list, stream 1 never gets one; a0 ran,
    # a1 waits for b0, which no stream will run: the caller stops stream 0 and re-raises.
    placement = Placement([0, 1], None)
    ran = []

    def interrupted(fn):
        raise KeyboardInterrupt
    monkeypatch.setattr(placement.streams[1], "submit", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        run(placement, {0: ["a0", "a1"], 1: ["b0"]}, waits={"a1": ["b0"]}, call=ran.append)
    assert info.value.__notes__[-1].endswith("; every stream stopped before its next action")
    assert "a1" not in ran and "b0" not in ran
    monkeypatch.undo()
    run(placement, {0: ["a0"], 1: ["b0"]})  # usable again
    placement.close()
    assert workers() == []


def test_the_watchdog_abandons_a_stuck_stream_and_the_placement_stays_usable():
    placement = Placement([0, 1], None)
    release = threading.Event()

    def call(a):
        if a == "b0":
            release.wait(limit(120))

    with pytest.raises(ActionStuck) as info:
        run(placement, {0: ["a0", "a1"], 1: ["b0"]}, waits={"a1": ["b0"]}, call=call,
            watchdog=WATCHDOG_S)
    assert info.value.running == {1: "b0"}
    stuck = [t for t in workers() if "ipu1" in t.name]
    release.set()
    for t in stuck:
        t.join(limit(60))
    run(placement, {0: ["a0"], 1: ["b0"]}, call=call)  # ipu1 has a fresh worker
    placement.close()
    assert workers() == []


def test_a_single_cpu_stream_or_a_total_order_runs_on_the_callers_thread():
    placement = Placement([0, 1], None)
    seen = []
    record = lambda a: seen.append((a, threading.current_thread() is threading.main_thread()))
    run(placement, {0: ["a0", "a1"], 1: []}, call=record)
    placement.run_lists({0: ["a0"], 1: ["b0"]}, lambda a: [], record, None,
                        in_order=[(1, "b0"), (0, "a0")])
    assert seen == [("a0", True), ("a1", True), ("b0", True), ("a0", True)]
    assert workers() == []  # no worker was started
    seen.clear()
    run(placement, {0: ["a0"], 1: ["b0"]}, call=record)  # concurrent streams: workers
    assert sorted(seen) == [("a0", False), ("b0", False)]
    placement.close()


def test_gpu_streams_alone_or_in_a_total_order_run_on_the_callers_thread_with_the_gpus_waits():
    """On the GPU twin, whose copies land only when waited for: the caller launches each
    action on its stream's own GPU stream, after the caller's earlier work and after the
    event of the action it depends on on another stream; it synchronizes the streams before
    it returns or raises, and starts no worker."""
    twin = TwinGpu()
    with gpu.installed(twin):
        placement = Placement([0, 1], {0: TWIN, 1: TWIN})
    default = twin.current_stream(TWIN)
    early = twin.copy_in(torch.ones(2), TWIN)  # the caller's work before the run
    ipu = {"a0": 0, "a1": 0, "b0": 1}
    made, seen = {}, []

    def call(a):
        stream = twin.current_stream(TWIN)
        seen.append((a, threading.current_thread() is threading.main_thread(),
                     stream is placement.streams[ipu[a]].stream))
        if a == "a0":
            seen.append(early.tolist())
            made[a] = twin.copy_in(torch.full((2,), 3.0), TWIN)  # launched on stream 0
        elif a == "b0":
            seen.append(made["a0"].tolist())
        else:
            made[a] = twin.copy_in(torch.full((2,), 4.0), TWIN)
            raise ValueError("boom")

    placement.run_lists({0: ["a0"], 1: ["b0"]}, {"b0": ["a0"]}.get, call,
                        in_order=[(0, "a0"), (1, "b0")])
    assert seen == [("a0", True, True), [1.0, 1.0], ("b0", True, True), [3.0, 3.0]]
    assert twin.current_stream(TWIN) is default  # the caller's streams are its own again
    with pytest.raises(ActionFailed):  # one stream alone, failing: what it launched landed
        placement.run_lists({0: ["a1"], 1: []}, lambda a: [], call)
    assert made["a1"].tolist() == [4.0, 4.0]
    assert workers() == []
    placement.close()


def test_the_twin_shows_a_value_read_on_another_stream_before_its_event_as_nan():
    """The twin's rule for values handed between stages ([Note: the GPU seam]): a reader on
    the maker's own stream sees them; one on another stream sees NaN until it waited for an
    event recorded after the making action, or the host synchronized the maker's stream."""
    twin = TwinGpu()
    maker, reader = twin.Stream(TWIN), twin.Stream(TWIN)
    early = twin.Event()
    early.record(maker)  # before the action: waiting for it is not enough
    value = torch.ones(3)
    with twin.stream(maker):
        twin.made([value], TWIN)
        assert torch.equal(twin.arrive(value.detach(), TWIN), value)
    after = twin.Event()
    after.record(maker)
    with twin.stream(reader):
        reader.wait_event(early)
        assert twin.arrive(value.detach(), TWIN).isnan().all()
        reader.wait_event(after)
        assert torch.equal(twin.arrive(value.detach(), TWIN), value)
    assert len(twin.unwaited) == 1
    late = twin.Stream(TWIN)
    maker.synchronize()  # the host waited for the maker: every stream sees its values
    with twin.stream(late):
        assert torch.equal(twin.arrive(value, TWIN), value)


def test_a_gpu_action_launched_back_to_back_starts_at_the_event_that_ended_the_last_one():
    """[Note: GPU timeline]: on the caller's thread, an action that waits for nothing starts
    at its stream's previous end event (nothing was enqueued between them); the first action
    of a stream, and one that waits for another stream, record a start of their own after
    their waits, and every action records its end."""
    twin = TwinGpu()
    with gpu.installed(twin):
        placement = Placement([0, 1], {0: TWIN, 1: TWIN})
    order = [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (0, "a2"), (1, "b2")]
    spans = placement.run_in_order(order, {"b0": ["a1"], "b2": ["a2"]}.get, lambda a: None)
    ref, host, start, end = zip(*(spans[a] for _, a in order))
    assert len(set(map(id, end))) == 6
    fresh = [s for s in start if all(s is not e for e in end)]
    assert [a for (_, a), s in zip(order, start) if any(s is f for f in fresh)] == \
        ["a0", "b0", "b2"]
    assert start[1] is end[0] and start[3] is end[2] and start[4] is end[1]
    assert all(r is ref[0] for r in ref) and all(h == host[0] for h in host)
    placement.close()


def test_an_interrupt_on_the_callers_thread_names_its_action():
    placement = Placement([0], None)

    def call(a):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        run(placement, {0: ["a0"]}, call=call)
    assert info.value.__notes__ == ["poptorch_lite: interrupted while running a0 on stream 0; "
                                    "every stream stopped before its next action"]
    placement.close()


def test_garbage_collection_releases_the_workers():
    import gc
    placement = Placement([0, 1], None)
    run(placement, {0: ["a"], 1: ["b"]})
    del placement
    gc.collect()
    assert exited()


def test_closing_again_after_reuse_releases_the_new_workers():
    placement = Placement([0, 1], None)
    run(placement, {0: ["a"], 1: ["b"]})
    placement.close()  # as detachFromDevice does
    run(placement, {0: ["a"], 1: ["b"]})  # re-attached: workers start again
    assert len(workers()) == 2
    placement.close()  # as destroy does
    assert workers() == []


def test_cpu_streams_share_the_intra_op_threads_and_leave_the_callers_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        placement = Placement([0, 1], None)
        seen = {}
        run(placement, {0: ["a"], 1: ["b"]}, call=lambda a: seen.update({a: torch.get_num_threads()}))
        assert seen == {"a": 2, "b": 2}
        assert torch.get_num_threads() == 4
        fresh = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [4]  # torch's default for new threads is restored
        placement.close()
        single = Placement([0], None)
        run(single, {0: ["a"]}, call=lambda a: seen.update({a: torch.get_num_threads()}))
        assert seen["a"] == 4
        single.close()
    finally:
        torch.set_num_threads(before)
