"""The differential fuzzer's short profile: what it found, then a fixed budget of new models.

The fuzzer draws small models from a grammar of what changes autograd's or the data's
semantics (tests/support/fuzz_grammar.py), runs each under a drawn configuration (fuzz_draw.py) and
compares poptorch_lite with plain PyTorch call by call ([Note: the fuzzer's oracle] in
fuzz_check.py). Here it is deterministic (``derandomize``, no example database): every
found example of tests/support/fuzz_found.py (a strict xfail while its fix is pending, so that the
fix landing fails it: then delete its entry of ``fuzz_draw.PENDING``), then a fixed number of
new examples with the pending names left out. A failure prints the minimal model as Python
and its Options. The long profile, for 30 minutes and more: ``python benchmarks/fuzz.py``.
"""

import tempfile

import pytest
from hypothesis import HealthCheck, configuration, event, given, reject, settings

import fuzz_keras
from fuzz_check import Finding, check
from fuzz_config import Config
from fuzz_draw import PENDING, atoms, examples
from fuzz_found import FOUND
from fuzz_grammar import Edit, Op, Program
from fuzz_plain import Invalid

# Hypothesis caches what it reads of local modules under ./.hypothesis: here, under a folder
# of this process's own that goes when it ends (tests write nowhere else).
_STORAGE = tempfile.TemporaryDirectory(prefix="hypothesis-")
configuration.set_hypothesis_home_dir(_STORAGE.name)

SHORT = settings(max_examples=14, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                 print_blob=False)


def _found_params():
    for found in FOUND:
        marks = ()
        if found.pending in PENDING:
            marks = pytest.mark.xfail(strict=True, raises=Finding,
                                      reason=f"pending: {PENDING[found.pending]}")
        yield pytest.param(found, marks=marks, id=found.name)


@pytest.mark.parametrize("found", list(_found_params()))
def test_found_example(found):
    """A finding's minimal example: exact (or a clean, acceptable refusal) once it is fixed."""
    keras = isinstance(found.config, fuzz_keras.KerasConfig)
    (fuzz_keras.check if keras else check)(found.program, found.config)


def test_every_pending_finding_has_its_minimal_example():
    """A PENDING key without a found example would leave its finding untested until the
    next long run; a found example whose key is in PENDING runs as a strict xfail above."""
    assert set(PENDING) - {found.pending for found in FOUND} == set()
    assert len({found.name for found in FOUND}) == len(FOUND)


def _one(example):
    program, config = example
    try:
        outcome = check(program, config)
    except Invalid:
        reject()
    for atom in sorted(atoms(program, config)):
        event(atom)
    event(f"outcome: {outcome}")


# Two streams of examples (derandomize seeds each by its test's name), so that the suite's
# two workers share the budget.
@SHORT
@given(example=examples())
def test_drawn_models_match_plain_pytorch(example):
    _one(example)


@SHORT
@given(example=examples())
def test_more_drawn_models_match_plain_pytorch(example):
    _one(example)


@settings(SHORT, max_examples=6)
@given(example=fuzz_keras.examples())
def test_drawn_keras_models_match_plain_pytorch(example):
    """The Keras face's subset of the grammar: fit against plain PyTorch's loop."""
    fuzz_keras.check(*example)


# Two processes ([Note: the fuzzer's processes]): replicas (as DDP runs them) or a pipeline
# spread over them; the long profile draws them
# (starting processes takes seconds); here, what each process keeps of its own.
@pytest.mark.parametrize("program, config", [
    # each replica's statistics, its dropout masks, a Python draw at each process's trace
    (Program(stages=2, ops=(Op("batchnorm"), Op("dropout", 1), Op("python_random"))),
     Config(processes=2, R=2, G=3, broadcast_buffers=False, calls=3)),
    # writes to weights in forward, each process's own (a clamp; rows renormalised by its data)
    (Program(stages=2, ops=(Op("weight_clip"), Op("embedding_max_norm", 1)), optimizer="adam"),
     Config(processes=2, G=3, schedule="interleaved", D=2, calls=3)),
    # a pipeline's stages in two processes: masks, a residual and a tied weight across them
    (Program(stages=3, ops=(Op("dropout"), Op("skip", 0, 2), Op("tied", 2, 0))),
     Config(processes=2, spread="stages", G=5, schedule="interleaved", R=2, calls=2)),
    # the optimizer's state sharded over them: each its chunks, clipped by the whole norm;
    # the gradients the steps used read back whole through their anchors
    (Program(stages=2, ops=(Op("dropout", 1), Op("batchnorm")), optimizer="clipped",
             edits=(Edit("opt_state_edit", 0, 0), Edit("optimizer_reload", 1, 0))),
     Config(processes=2, R=2, G=3, calls=3, sharded=True)),
    # ... and a weight each process renormalises its own way in forward: the owners' values
    (Program(stages=2, ops=(Op("embedding_max_norm", 0),)),
     Config(processes=2, G=3, calls=2, sharded=True)),
    # a pipeline whose first stage gets no gradient (detached): no process must hold one
    (Program(stages=2, ops=(Op("stop", 0, 0),)),
     Config(processes=2, spread="stages", G=3, calls=2)),
], ids=["buffers-and-draws", "weights-written-in-forward", "a-pipeline", "sharded-state",
        "sharded-weights-written-in-forward", "a-stage-without-gradients"])
def test_two_processes_match_plain_pytorch(program, config):
    assert check(program, config) in ("exact", "warned: W-LITE-13")
