"""Shared fixtures: the devices the transparency tests run on, warning and probe resets."""

import gc

import pytest
import torch

from poptorch_lite import errors

import probes
from models import exited, workers

# "ipu_model": every IPU on the CPU with a memory of its own (Options.useIpuModel(True)), the
# path that separate GPUs take, so that it runs on machines without one.
DEVICES = ["cpu", "ipu_model"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on the CPU, through the IPU Model, and on CUDA when one
    # is present (models.on_device puts the options there).
    if "device" in metafunc.fixturenames:
        marks = {"cuda": [pytest.mark.cuda]}
        metafunc.parametrize("device", [pytest.param(d, marks=marks.get(d, [])) for d in DEVICES])


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees its own one-time warnings."""
    saved = set(errors._warned)
    errors._warned.clear()
    yield
    errors._warned.clear()
    errors._warned.update(saved)


@pytest.fixture(autouse=True)
def no_probe():
    """No test leaves a probe callback behind (``probes.PROBE``)."""
    probes.PROBE["fn"] = None
    yield
    probes.PROBE["fn"] = None


@pytest.fixture(autouse=True)
def no_workers_left_over():
    """Each test starts without stream workers of earlier tests' wrappers: a wrapper nobody
    destroyed (a Keras model's) is collected, and its workers exit, before the next test, so
    tests that count workers see their own only. Costs nothing when no worker is alive."""
    if workers():
        gc.collect()
        exited()
    yield
