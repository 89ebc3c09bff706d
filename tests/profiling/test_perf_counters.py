"""getPerfCounters and the latencies ([Note: performance counters] in perf_counters).

Shapes as PopTorch's tests/perf_counters_test.py pins them; times only by their order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import poptorch_lite as poptorch

EVENTS = ("input", "input_complete", "output", "output_complete")
LATENCIES = ("getLatency", "getHostIpuLatency", "getComputeLatency", "getIpuHostLatency")


class MatMul(torch.nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class Trained(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 10)

    def forward(self, data, target):
        out = self.linear(data)
        return out, F.mse_loss(out, target)


def assert_sizes(perf, inputs, outputs, steps, outsteps):
    assert set(perf) == set(EVENTS)
    for event, tensors, n in (("input", inputs, steps), ("input_complete", inputs, steps),
                              ("output", outputs, outsteps), ("output_complete", outputs, outsteps)):
        assert [len(per_tensor) for per_tensor in perf[event]] == [n] * tensors, event


def assert_ordered(model):
    perf = model.getPerfCounters()
    starts = perf["input"][0]
    assert perf["input_complete"] == perf["input"]  # the copy is inside the forward action
    assert starts == sorted(starts)
    for out, done in zip(perf["output"][0], perf["output_complete"][0]):
        assert min(starts) <= out <= done
    for name in LATENCIES:
        lo, hi, avg = getattr(model, name)()
        assert 0.0 <= lo <= avg <= hi, name
    assert model.getHostIpuLatency() == (0.0, 0.0, 0.0)
    total, compute = model.getLatency(), model.getComputeLatency()
    assert all(t >= c for t, c in zip(total, compute))


def outsteps_of(mode, period, D, G, R):
    if mode in (poptorch.OutputMode.Final, poptorch.OutputMode.Sum):
        return R
    if mode == poptorch.OutputMode.EveryN:
        return D // period * G * R
    return D * G * R


def test_empty_before_the_model_has_run():
    model = poptorch.inferenceModel(MatMul())
    empty = {event: [[]] for event in EVENTS}
    assert model.getPerfCounters() == empty
    assert all(getattr(model, name)() == (0.0, 0.0, 0.0) for name in LATENCIES)
    x = torch.randn(4, 4)
    model.compile(x, x)
    assert model.getPerfCounters() == empty
    model(x, x)
    assert_sizes(model.getPerfCounters(), 2, 1, 1, 1)
    model.destroy()
    assert model.getPerfCounters() == empty
    model.compile(x, x)  # a new executable has not run yet
    assert model.getPerfCounters() == empty


@pytest.mark.parametrize("mode, period", [(poptorch.OutputMode.Final, 1),
                                          (poptorch.OutputMode.All, 1),
                                          (poptorch.OutputMode.Sum, 1),
                                          (poptorch.OutputMode.EveryN, 2)])
@pytest.mark.parametrize("D, R", [(2, 1), (4, 2)])
def test_inference_counters_per_input_and_replica(mode, period, D, R):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R).outputMode(
        mode, period if mode == poptorch.OutputMode.EveryN else None)
    model = poptorch.inferenceModel(MatMul(), opts)
    x = torch.randn(2 * D * R, 5, 5)
    model(x, x)
    assert_sizes(model.getPerfCounters(), 2, 1, D * R, outsteps_of(mode, period, D, 1, R))
    assert_ordered(model)


@pytest.mark.parametrize("mode, period", [(poptorch.OutputMode.Final, 1),
                                          (poptorch.OutputMode.All, 1),
                                          (poptorch.OutputMode.Sum, 1),
                                          (poptorch.OutputMode.EveryN, 2)])
@pytest.mark.parametrize("D, G, R", [(2, 1, 1), (2, 2, 2)])
def test_training_counters_per_input_output_and_replica(mode, period, D, G, R):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R).outputMode(
        mode, period if mode == poptorch.OutputMode.EveryN else None)
    opts.Training.gradientAccumulation(G)
    model = poptorch.trainingModel(Trained(), opts)
    n = 2 * D * G * R
    model(torch.randn(n, 10), torch.randn(n, 10))
    assert_sizes(model.getPerfCounters(), 2, 2, D * G * R, outsteps_of(mode, period, D, G, R))
    assert_ordered(model)


def test_a_pipelined_model_counts_each_micro_batch_once():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            with poptorch.Block("a", ipu_id=0):
                h = self.a(x)
            with poptorch.Block("b", ipu_id=1):
                return self.b(h)

    opts = poptorch.Options().deviceIterations(4).setExecutionStrategy(
        poptorch.PipelinedExecution())
    model = poptorch.inferenceModel(Two(), opts)
    model(torch.randn(8, 4))
    assert_sizes(model.getPerfCounters(), 1, 1, 4, 4)
    assert_ordered(model)


def test_no_tensor_inputs_or_outputs_read_as_empty():
    class Constant(torch.nn.Module):
        def forward(self):
            return None

    model = poptorch.inferenceModel(Constant())
    assert model() is None
    assert model.getPerfCounters() == {event: [[]] for event in EVENTS}
    assert model.getLatency() == (0.0, 0.0, 0.0)


def test_the_examples_in_the_docstrings_run():
    import doctest

    from poptorch_lite.profiling import perf_counters
    from poptorch_lite import wrap, wrapper
    for module in (perf_counters, wrapper, wrap):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
