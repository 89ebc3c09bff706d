"""Shared fixtures: the devices the transparency tests run on, warning and probe resets."""

import pytest
import torch

from poptorch_lite import errors

import probes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on the CPU, and on CUDA when one is present.
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
