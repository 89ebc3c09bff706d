"""What the differential fuzzer draws: programs of the grammar and valid configurations.

Hypothesis shrinks each choice towards its first value, so every list starts with the
simplest (one stage, no ops, ``F.cross_entropy``, SGD, the CPU, G = D = R = 1): a
finding shrinks to the fewest features and configuration factors that still show it.

:data:`PENDING` names what the short profile leaves out until its fix lands: a grammar
name (``fuzz_grammar``: an op, a loss, an edit) or a combination ``"a&b"`` of names and
configuration factors (``"data_edit&device=ipu_model"``). Each is a finding of the
fuzzer on the code of its day (tests/support/fuzz_found.py holds its minimal example, which runs
as a strict xfail); when its fix lands, delete the entry: the short profile then draws it,
and the found example turns into a regression test.
"""

from __future__ import annotations

import dataclasses

from hypothesis import assume, strategies as st

from fuzz_config import DEVICES, SCHEDULES, Config
from fuzz_grammar import (EDITS, FEATURES, LATER, LOSSES, OPTIMIZERS, RETURNS, TWO_STAGE, Edit,
                          Op, Program)

#: How often a compiled example's stages compile with Inductor rather than ``aot_eager``
#: (0: never, the short profile: a compile takes seconds; the long profile sets it): what
#: users get by default, whose partition of forward and backward is not ``aot_eager``'s.
INDUCTOR_ONE_IN = 0

#: How often a training example on the CPU runs its replicas in two processes, as torchrun
#: starts them (0: never, the short profile: starting them takes seconds; the long profile
#: sets it): [Note: the fuzzer's processes] in fuzz_check.
PROCESSES_ONE_IN = 0

PENDING = {
    # found by the fuzzer (tests/support/fuzz_found.py); fixes on their way
    "stop&processes=2&spread=stages": "a gradient another process never made arrives as zeros",
}


def _names(catalogue, pending) -> list:
    return [n for n in catalogue if n not in pending]


@st.composite
def _op(draw, stages: int, kinds: list) -> Op:
    kind = draw(st.sampled_from(kinds))
    stage = draw(st.integers(0, stages - 1))
    to = 0
    if kind == "buffer_across":
        to = draw(st.sampled_from([t for t in range(stages) if t != stage]))
    elif kind in LATER:
        to = draw(st.integers(stage, stages - 1))
    elif kind in TWO_STAGE:
        to = draw(st.integers(0, stages - 1))
    return Op(kind, stage, to)


@st.composite
def programs(draw, pending=frozenset(PENDING), require=frozenset()) -> Program:
    """A program of the grammar, without the ``pending`` names and with the ``require``d
    ones (ops, a loss, edits)."""
    forced = dict(a.split("=", 1) for a in require if "=" in a)
    stages = draw(st.integers(2 if "buffer_across" in require else 1, 4))
    kinds = [k for k in _names(FEATURES, pending) if stages > 1 or k != "buffer_across"]
    ops = tuple(draw(st.lists(_op(stages, kinds), max_size=3)))
    ops += tuple(draw(_op(stages, [k])) for k in sorted(require & FEATURES.keys()))
    forced_loss = sorted(require & LOSSES.keys())
    loss = draw(st.sampled_from(forced_loss or _names(LOSSES, pending)))
    optimizer = forced.get("optimizer") or draw(st.sampled_from(list(OPTIMIZERS)))

    def edit(kinds):
        return st.builds(Edit, st.sampled_from(kinds), st.integers(0, 1),
                         st.integers(0, stages - 1))
    edits = tuple(draw(st.lists(edit(_names(EDITS, pending)), max_size=2)))
    edits += tuple(draw(edit([k])) for k in sorted(require & EDITS.keys()))
    if any(e.kind == "add_param_group" for e in edits):
        groups = "partial"  # the head's bias joins the optimizer later
    else:
        groups = forced.get("groups") or draw(st.sampled_from(["one", "two", "partial"]))
    ipus = draw(st.sampled_from(["distinct", "loop"])) if stages > 2 else "distinct"
    returns = forced.get("returns") or draw(st.sampled_from(RETURNS))
    return Program(stages, ops, loss, optimizer, groups, edits, ipus, returns)


#: What an inference model cannot run (a gradient the forward takes; a tensor hook on a
#: value that needs none) or has not (``setOptimizer``; a checkpoint, which holds a training
#: state: save_checkpoint refuses an inference model).
TRAINING_ONLY = {"penalty", "saliency", "input_penalty", "tensor_hook", "set_optimizer",
                 "checkpoint_rewind"}


@st.composite
def configs(draw, program: Program, require=frozenset()) -> Config:
    """A configuration valid for ``program`` (PopTorch's minimums met: G >= 2S-1 for
    Grouped and Interleaved pipelines), with the ``require``d factors ("device=ipu_model")."""
    forced = dict(a.split("=", 1) for a in require if "=" in a)

    def pick(name, strategy):
        if name not in forced or name not in Config.__dataclass_fields__:
            return draw(strategy)
        kind = type(getattr(Config(), name))
        value = forced[name]
        return value == "True" if kind is bool else kind(value) if kind is int else value

    kinds = {o.kind for o in program.ops} | {e.kind for e in program.edits}
    inference = not kinds & TRAINING_ONLY and pick("inference", st.booleans())
    schedules = [s for s in SCHEDULES if program.ipus == "distinct" or s != "sharded"]
    if inference:  # PopTorch's inference pipelines: Grouped, Sequential or sharded
        schedules = [s for s in schedules if s in ("grouped", "sequential", "sharded")]
    schedule = pick("schedule", st.sampled_from(schedules))
    low = 2 * program.stages - 1 if schedule in ("grouped", "interleaved") else 1
    device = pick("device", st.sampled_from(DEVICES))
    # A captured step needs a GPU (or its twin), and enough runs to warm up, capture and replay.
    graph = device in ("gpu_twin", "cuda") and pick("graph", st.booleans())
    config = Config(
        schedule=schedule,
        G=1 if inference else pick("G", st.integers(low, low + 1)),
        # an inference pipeline's micro-batches are its device iterations (PopTorch's minimum)
        D=pick("D", st.integers(program.stages, program.stages + 1)
               if inference and schedule != "sharded" else st.integers(1, 2)),
        R=pick("R", st.integers(1, 2)),
        reduction=pick("reduction", st.sampled_from(["mean", "sum"])),
        recompute=pick("recompute", st.booleans()),
        compiled=pick("compiled", st.booleans()),
        device=device,
        broadcast_buffers=pick("broadcast_buffers", st.booleans().map(lambda b: not b)),
        random_seed=pick("random_seed", st.sampled_from([None, 77])),
        B=pick("B", st.sampled_from([2, 3])),
        calls=pick("calls", st.integers(4, 5) if graph else st.integers(2, 3)),
        output_mode=pick("output_mode", st.sampled_from(["All", "Final", "Sum"])),
        keyword=pick("keyword", st.booleans()),
        offload=pick("offload", st.booleans()),
        vary_batch=pick("vary_batch", st.booleans()),
        graph=graph,
        autocast=pick("autocast", st.sampled_from(["off", "on", "second"])),
        inference=inference)
    if PROCESSES_ONE_IN and not inference and device == "cpu":
        config = dataclasses.replace(config, processes=pick("processes", st.integers(
            1, PROCESSES_ONE_IN).map(lambda k: 2 if k == PROCESSES_ONE_IN else 1)))
        if config.processes > 1 and program.stages > 1:  # replicas, or the stages, spread
            config = dataclasses.replace(config, spread=pick("spread", st.sampled_from(
                ["replicas", "stages"])))
        # ZeRO-1 over them (whose chunked state a host step is refused: E-OPTIM-13)
        if config.processes > 1 and config.spread == "replicas" and "host_step" not in kinds:
            config = dataclasses.replace(config, sharded=pick("sharded", st.booleans()))
    if config.compiled and not graph and INDUCTOR_ONE_IN:
        config = dataclasses.replace(config, backend=pick("backend", st.integers(
            1, INDUCTOR_ONE_IN).map(lambda k: "inductor" if k == INDUCTOR_ONE_IN else "aot_eager")))
    # A model in half precision where the arithmetic is plain PyTorch's to the bit (the
    # float rule's tolerance is for float32, confirmed in float64)
    if config.tolerance(program) == 0:
        config = dataclasses.replace(config, dtype=pick("dtype", st.sampled_from(
            ["float32", "bfloat16", "float16"])))
    return config


def atoms(program: Program, config: Config) -> frozenset:
    """The grammar's names and the configuration's factors an example uses."""
    return program.atoms() | config.atoms()


@st.composite
def examples(draw, pending=frozenset(PENDING), require=frozenset()) -> tuple:
    """A (program, config) pair with nothing ``pending`` in it and the ``require``d names
    and factors (``"lstm"``, ``"compiled=True"``) in it."""
    program = draw(programs(frozenset(p for p in pending if "&" not in p), require))
    config = draw(configs(program, require))
    used = atoms(program, config)
    assume(not any(c <= used for c in (frozenset(p.split("&")) for p in pending if "&" in p)))
    return program, config
