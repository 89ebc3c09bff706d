"""Shared fixtures: the devices the transparency tests run on, warning and probe resets.

The tests are laid out as the package is (``tests/runtime/`` tests ``poptorch_lite/runtime/``;
``tests/programs/`` runs programs nobody here wrote); what they share (the GPU twin, the
hygiene plugin, the models, the processes, the fuzzer) is in ``tests/support/``, which this
file puts on ``sys.path``.
"""

import gc
import os
import pathlib
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))

# Inductor compiles in the test's own thread: no pool of compile threads or processes, which
# would outlive the test that compiled first (tests/support/hygiene.py) and crowd a 2-core machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from poptorch_lite import errors
from poptorch_lite.runtime import gpu

from gpu_twin import TwinGpu

import probes
from models import exited, workers

pytest_plugins = ["hygiene"]  # every test leaves the process as it found it (support/hygiene.py)

# pytest-xdist's workers share the machine's cores: each takes its share of intra-op threads,
# as a stage's worker takes its share of a run's (runtime/placement). torch's default (a
# thread per core in every worker) oversubscribes the cores, and OpenMP's waiting threads
# then spin against each other: a pipelined test ran 9x slower beside another worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Ctrl-C reaches the suite whichever way it was started. A shell starts a background job
# ("cmd &" in a script, nohup-like launchers, some CI runners) with SIGINT ignored, and Python
# then keeps it ignored instead of installing its KeyboardInterrupt handler: every test that
# sends a Ctrl-C (and each child process, which inherits the ignored signal) then saw nothing,
# the 7 "busy machine" failures of issue 46 that were not about speed. The suite's processes
# get Python's own handler, as a script started in a terminal has; a child gets the default
# action back when it starts, and Python's handler with it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# "ipu_model": every IPU on the CPU with a memory of its own (Options.useIpuModel(True)), the
# path that separate GPUs take, so that it runs on machines without one. "gpu_twin": every
# IPU on the GPU twin (gpu_twin.py): the GPU's branches, streams, events and asynchronous
# input copies, with CPU tensors ([Note: the GPU seam] in poptorch_lite/runtime/gpu.py).
DEVICES = ["cpu", "ipu_model", "gpu_twin"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_finish(session):
    """Freeze what is alive once the tests are collected (torch's, transformers' and the test
    modules' objects, which live as long as the session) out of the garbage collector's
    reach: a full collection then walks only what the tests made since. The hygiene plugin
    collects after most tests, to end the workers of a wrapper nobody destroyed; each of
    those walks cost a quarter of a second with the session's objects in them."""
    gc.collect()
    gc.freeze()


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on the CPU, through the IPU Model, on the GPU twin and on
    # CUDA when one is present (models.on_device puts the options there), unless it lists its
    # devices itself (the transparency matrix: in full on the CPU, pairwise elsewhere).
    if "device" in metafunc.fixturenames and not _parametrizes(metafunc, "device"):
        metafunc.parametrize("device", [pytest.param(d, marks=DEVICE_MARKS.get(d, []))
                                        for d in DEVICES])


DEVICE_MARKS = {"cuda": [pytest.mark.cuda]}


def _parametrizes(metafunc, name: str) -> bool:
    """Whether a ``parametrize`` mark of the test names ``name``."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return True
    return False


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


@pytest.fixture
def every_stage_compiles(monkeypatch):
    """The test models are far below what pays for compiling: compile them anyway."""
    from poptorch_lite.compiler import compiled_stages
    monkeypatch.setattr(compiled_stages, "PAYS_FROM", 0)


@pytest.fixture(autouse=True)
def twin_gpu(request):
    """The GPU twin, in force for the placements of a test run on the ``gpu_twin`` device
    (None for the other devices)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device") != "gpu_twin":
        yield None
        return
    with gpu.installed(TwinGpu()) as twin:
        yield twin
