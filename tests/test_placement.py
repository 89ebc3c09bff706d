"""Placement: devices per IPU, CPU streams running a row together, where weights live."""

import threading

import pytest
import torch

from poptorch_lite.placement import Placement, Weights, resolve_devices


def test_devices_follow_the_mapping_and_default_to_cpu_without_cuda():
    devices = resolve_devices([0, 1, 2], {1: torch.device("cpu")})
    assert devices[1] == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices == {0: torch.device("cpu"), 1: torch.device("cpu"), 2: torch.device("cpu")}


def test_a_row_of_several_actions_runs_them_together_on_their_own_threads():
    placement = Placement([0, 1], {0: "cpu", 1: "cpu"})
    barrier = threading.Barrier(2, timeout=10)  # only passes if both run at once
    names = {}

    def action(ipu):
        def run():
            names[ipu] = threading.current_thread().name
            barrier.wait()
            return ipu * 10
        return run

    results = placement.run_row([(0, action(0)), (1, action(1))])
    assert results == [(0, None), (10, None)]
    assert names[0].startswith("poptorch_lite-ipu0") and names[1].startswith("poptorch_lite-ipu1")
    placement.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("poptorch_lite")]


def test_a_failing_action_is_returned_with_its_exception_and_the_others_finish():
    placement = Placement([0, 1], None)
    done = []

    def fail():
        raise ValueError("boom")

    results = placement.run_row([(0, fail), (1, lambda: done.append(1) or "ok")])
    assert results[1] == ("ok", None) and done == [1]
    assert isinstance(results[0][1], ValueError) and results[0][0] is None
    placement.close()


def test_a_single_action_runs_on_the_callers_thread_and_starts_no_worker():
    placement = Placement([0], None)
    [(name, exc)] = placement.run_row([(0, lambda: threading.current_thread().name)])
    assert exc is None and name == threading.current_thread().name
    assert not [t for t in threading.enumerate() if t.name.startswith("poptorch_lite")]


def test_garbage_collection_releases_the_workers():
    import gc
    placement = Placement([0, 1], None)
    placement.run_row([(0, lambda: 0), (1, lambda: 1)])
    del placement
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name.startswith("poptorch_lite")]


def test_stages_on_the_models_device_use_the_users_parameter_objects():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    weights = Weights(model, replicas=2, separate_buffers=True)
    assert weights.param("0.weight", torch.device("cpu")) is model[0].weight
    assert weights.buffer("1.running_mean", 0, torch.device("cpu")) is model[1].running_mean
    replica1 = weights.buffer("1.running_mean", 1, torch.device("cpu"))
    assert replica1 is not model[1].running_mean and torch.equal(replica1, model[1].running_mean)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stage_on_another_device_uses_a_copy_that_follows_the_host():
    model = torch.nn.Linear(2, 2)
    weights = Weights(model, replicas=1, separate_buffers=False)
    copy = weights.param("weight", torch.device("cuda"))
    assert copy.device.type == "cuda" and copy.requires_grad
    with torch.no_grad():
        model.weight.add_(1.0)
    weights.after_step()
    assert torch.equal(copy.cpu(), model.weight.detach())
    copy.grad = torch.ones_like(copy)
    assert torch.equal(weights.gather_grad("weight"), torch.ones(2, 2))


def test_closing_again_after_reuse_releases_the_new_workers():
    placement = Placement([0, 1], None)
    placement.run_row([(0, lambda: 0), (1, lambda: 1)])
    placement.close()  # as detachFromDevice does
    placement.run_row([(0, lambda: 0), (1, lambda: 1)])  # re-attached: workers start again
    assert [t for t in threading.enumerate() if t.name.startswith("poptorch_lite")]
    placement.close()  # as destroy does
    assert not [t for t in threading.enumerate() if t.name.startswith("poptorch_lite")]
