"""Which refusals the fuzzer accepts and which warnings it requires: docs/ERRORS.md's, each
where the library says it applies.

A refusal is acceptable only as a documented one (its class, its message as the catalogue
gives it: ``<placeholder>`` matches anything) under the conditions its row and the code's
notes state, worked out here from the program and the configuration:

- E-PART-10: replicas, ``broadcastBuffers(True)``, and a buffer write of the model's own
  (a normalisation's running statistics are not one: each replica keeps its own, [Note:
  running statistics on replicas] in poptorch_lite/compiler/running_stats.py);
- E-PART-11 (``item``), E-PART-24 (``packed_lstm``), E-PART-14 (``buffer_assign``, PopTorch's own
  refusal of a buffer rebound in forward): always, at the trace;
- E-PART-28: a tensor attribute the forward writes in place (``tensor_counter``), on a GPU
  (or its twin), recomputed or compiled;
- E-PART-27: a gradient hook on a parameter whose layer another stage uses again;
- E-WRAP-21: a parameter or a layer replaced by another object between calls (``REFUSABLE_EDITS``);
- E-OPT-41: a generator of the model's own with replicas, recomputation or processes (each
  grammar generator is drawn from in one stage);
- E-PART-25 / E-PART-26: state written in forward that a stage reads before its writer, or
  that several stages write (:func:`shared_state`; [Note: state across stages] in
  poptorch_lite/compiler/state.py): E-PART-25 under a schedule that overlaps micro-batches,
  E-PART-26 under Sequential or ShardedExecution where those stages sit on several IPUs with
  memories of their own (the IPU Model, the GPU twin); on the CPU they share one and run;
- "pending" features and edits (a fix on its way): any clean refusal.

A program whose forward draws from Python's or numpy's random must warn W-LITE-13 at the
line of the draw, one that changes a Python attribute W-LITE-14 at the line of the write
(:func:`missing_warnings`). PopTorch computes such a forward once too, so the values may
then differ from plain PyTorch's where the warning says so (``DIFFERS``: W-LITE-14, whose
attribute keeps the trace's value); W-LITE-13's draws are replayed, so they may not.
"""

from __future__ import annotations

import builtins
import linecache
import pathlib
import re
from typing import Optional

from poptorch_lite import errors

from fuzz_config import Config
from fuzz_grammar import FEATURES, REFUSABLE_EDITS, Program, writes_buffers

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "ERRORS.md"


def _rows() -> dict:
    """``{id: (class, message regex)}`` of docs/ERRORS.md (test_errors_catalogue's reading)."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if re.match(r"\|\s*[EW]-[A-Z]+-\d+\s*\|", line):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            message = re.fullmatch(r"`(.*?)`.*", cells[3]).group(1)
            cls = getattr(errors, cells[1], None) or getattr(builtins, cells[1])
            rows[cells[0]] = (cls, ".*?".join(
                re.escape(part) for part in re.split(r"<[^<>]*>", message)))
    return rows


ROWS = _rows()
#: The schedules that run one action at a time (PipelineSchedule.Sequential).
ONE_AT_A_TIME = ("sequential", "sharded")


def shared_state(program: Program) -> list:
    """``(state, stages that write or read it)`` for each state the forward writes that a
    stage reads before its writer, or that several stages write."""
    found = []
    for i, op in enumerate(program.ops):
        s = op.stage
        if op.kind == "buffer_across" and op.to < s:  # read before its writer
            found.append((f"stat{i}", {s, op.to}))
        elif op.kind == "spectral_norm":  # every computation of the weight updates u and v
            users = {s} | {o.to for o in program.ops
                           if o.kind in ("tied", "shared_module") and o.stage == s}
            if len(users) > 1:
                found.append((f"l{s}'s spectral_norm buffers", users))
        elif op.kind == "weight_clip":  # l<s>.bias, which l<s> reads wherever it runs
            before = {o.to for o in program.ops
                      if o.kind == "shared_module" and o.stage == s and o.to < s}
            if before:
                found.append((f"l{s}.bias", {s} | before))
    return found


def acceptable(program: Program, config: Config) -> dict:
    """The refusals ``program`` may meet under ``config``: ``{id or "pending": why}``."""
    kinds = {o.kind for o in program.ops}
    ok = {}
    if config.R > 1 and config.broadcast_buffers and writes_buffers(program, "own"):
        ok["E-PART-10"] = "replicas of a model that writes a buffer of its own"
    for kind in sorted(kinds & {"item", "packed_lstm", "buffer_assign"}):
        ok[FEATURES[kind].refused] = kind
    if "generator" in kinds and (config.R > 1 or config.recompute or config.processes > 1):
        ok["E-OPT-41"] = ("a generator of the model's own with replicas, recomputation or "
                          "processes")
    ipu = (lambda s: s % 2) if program.ipus == "loop" else (lambda s: s)
    for state, stages in shared_state(program):
        if config.schedule not in ONE_AT_A_TIME:
            ok["E-PART-25"] = f"{state}: state across stages, overlapping micro-batches"
        elif config.device != "cpu" and len({ipu(s) for s in stages}) > 1:
            ok["E-PART-26"] = f"{state}: state across stages on separate memories"
    if "tensor_counter" in kinds and (config.device in ("gpu_twin", "cuda") or config.recompute
                                      or config.compiled):
        ok["E-PART-28"] = "a tensor attribute the forward writes, on a GPU, recomputed or compiled"
    hooked = {o.stage for o in program.ops
              if o.kind in ("param_hook", "post_accumulate_hook")}
    if any(o.kind == "shared_module" and o.to != o.stage and o.stage in hooked
           for o in program.ops):
        ok["E-PART-27"] = "a gradient hook on a parameter that two stages use"
    if config.sharded and "step_pre_hook" in {e.kind for e in program.edits}:
        ok["E-OPTIM-15"] = "a step pre-hook on an optimizer whose state is sharded"
    if config.sharded and "embedding_sparse" in kinds:
        ok["E-OPTIM-16"] = "a sparse gradient, with the optimizer's state sharded"
    for edit in sorted({e.kind for e in program.edits} & set(REFUSABLE_EDITS)):
        ok[REFUSABLE_EDITS[edit]] = edit
    pending = sorted(k for k in kinds if FEATURES[k].refused == "pending")
    if pending:
        ok["pending"] = ", ".join(pending)
    return ok


def accepted(error: Exception, ok: dict) -> Optional[str]:
    """The id of ``ok`` that ``error`` is (its class and documented message), or None."""
    if "pending" in ok and isinstance(error, errors.Error):
        return "pending"
    for key in ok:
        cls, message = ROWS.get(key, (None, None))
        if cls is not None and isinstance(error, cls) and re.search(message, str(error),
                                                                    re.DOTALL):
            return key
    return None


#: Warning id -> what the line it names must hold (the draw, the write).
_AT = {"W-LITE-13": "random.", "W-LITE-14": "self.steps"}
#: The warnings that own up to values that differ from plain PyTorch's.
DIFFERS = {"W-LITE-14"}


def warns(program: Program) -> set:
    """The warnings ``program``'s first trace must give (ids)."""
    return {FEATURES[o.kind].warned for o in program.ops if FEATURES[o.kind].warned}


def missing_warnings(program: Program, records: list) -> list:
    """What is missing of :func:`warns` among the warnings ``records`` (``catch_warnings``'s)
    of a call that traced: each must name a line of the program that draws."""
    missing = []
    for key in sorted(warns(program)):
        cls, message = ROWS[key]
        if not any(issubclass(w.category, cls) and re.search(message, str(w.message), re.DOTALL)
                   and _AT[key] in linecache.getline(w.filename, w.lineno) for w in records):
            missing.append(f"no {key} warning at the line of the {_AT[key]} (its {cls.__name__}: "
                           f"{message[:80]}...)")
    return missing
