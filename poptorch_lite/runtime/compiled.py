"""A wrapped model's compiled state, and the one direction a call takes through it.

[Note: a call's direction]
``PoplarExecutor`` (``wrapper``) is PopTorch's face: argument checks, the pairing of a
training and an inference wrapper, attach and detach, the loss scale. Everything that a
call computes with and that lasts between calls belongs to its :class:`CompiledModel`:
the programs per input signature, the weights, the placement, which outputs come back, the
last run. A call goes through it once, downwards, each step in its own home:

1. **split** the combined batch into micro-batches (``batch.MicroBatches``);
2. **compile** on a new input signature (``compiling.compile_program``: trace, partition,
   retarget the stages' graphs, place the weights), once per signature;
3. **run** the program (``program.Program.run``: its schedule's plan, on the executor);
4. **merge** the kept micro-batches' outputs into what the call returns (``merge``).

Nothing here calls back into the wrapper, and no step hands its product back up for
another step to take: each takes the one before it's.

[Note: trainable parameters]
Which parameters require grad shapes a training program: its trace (what runs without
grad: ``grad_semantics.mark_stops``; which values carry a gradient to other processes:
``value_info``; the model's own Python may read ``requires_grad``), the stages' copies of
the weights (made with the host parameter's flag) and its captured step graph. Plain
PyTorch reads the flags at every forward: a layer frozen between calls
(``model.a.requires_grad_(False)``) gets no gradient from the next call on, and the
optimizer skips it; one unfrozen trains from then on. So a training program is keyed by
the input signature *and* the tuple of the parameters' flags, compared at every call
(one attribute read per parameter): a new set traces and compiles again (logged once, at
INFO) and keeps the other program for a return to the old set; the copies follow the
flags whenever the program changes (``Weights.follow_requires_grad``). Where homes are
shared, the stages compute with the user's parameters, whose flags autograd reads
itself; the program's trace still changes. A step graph belongs to its program, so a
freeze never replays a capture made before it ([Note: step graphs] in ``step_graph``).

[Note: attributes the forward reads]
A plain Python attribute the forward reads (``h / self.temperature``, a dropout's ``p``)
is baked into the program with the value its trace read ([Note: Python attributes of the
model] in ``python_attributes``), where plain PyTorch reads the value the user set last
(``model.temperature = 2.0`` between calls). So a program is kept also under the values of
the attributes its trace read (``Reads.key``), and each call compares them with the
model's (``Reads.same``: only the attributes the programs' traces read, by value and
type, one C-level getter per module that has them, some 0.2 us each; nothing for a
model whose forward reads none). A changed value finds the kept program traced with the new values, or
traces and compiles again (logged at INFO, naming the attributes) and keeps the other
program for a return to the old values, as a freeze does. An attribute the forward
writes itself is never part of the key. An attribute changed at every step would trace
at every call: only the last ``_KEPT`` programs of a signature that differ in attributes
alone are kept (the least recently used dropped, with its memory), and once one
attribute has keyed more than that, a warning says so and suggests a buffer
(``register_buffer``), which a program reads at every call. A step graph belongs to its
program ([Note: step graphs] in ``step_graph``), so no replay bakes an old value either.
The modules' forward and backward hooks key a program the same way (``Hooks``): one
registered or removed between calls finds or traces the program that runs it, as plain
PyTorch's next forward runs it.

[Note: train and eval modes]
PopTorch wraps a shallow copy of the model: the wrapper's own ``training`` flag is the
model's at wrap time (``model.eval()`` afterwards does not reach it), while the submodules,
and their flags, are the user's, read when the first call traces. So the model's own flag
is traced as it was when wrapped, and every submodule's as it is when the call traces; a
submodule's flag is an attribute the forward reads (a dropout's, a normalisation's), so a
call after ``model.eval()`` or ``bn.eval()`` runs the program of the modes it finds, as
plain PyTorch does, traced again if none has them. Graphcore's CNN application wraps its
validation model while the model trains and calls ``model.eval()`` before each validation
pass: the normalisations must use their running statistics there, and leave them as they
are. PopTorch keeps the modes of its first trace after that; where a training model finds a
submodule gone to eval mode it compiles again and warns once (W-LITE-18), since a program
that counted on PopTorch's freeze would now train that module in eval mode, as plain
PyTorch would. A forward that reads the model's own flag (``if self.training: return out,
loss``, ``F.dropout(h, p, self.training)``) reads the wrapper's, as in PopTorch; where the
user has since set the model's to the other mode, each such call warns once (W-LITE-19),
since plain PyTorch would read the user's.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Optional

import torch

from . import anchors
from ..compiler import backward_hooks, trace_modes
from ..compiler.python_attributes import is_hooks, shown
from ..errors import (PoptorchLiteWarning, UnrecoverableError,
                      hide_when_refused as __tracebackhide__, warn_once)
from ..options.options import Options, batch_arithmetic, batch_factor
from ..profiling.run_statistics import RunStatistics, run_statistics
from .batch import MicroBatches, recompile_note
from .compiling import compile_program
from .host_sync import check_unchanged, tables, watch
from .merge import Outputs
from .placement import Placement
from .program import Program
from .undo import capture, undo_note
from .weights import Weights

_LOG = logging.getLogger("poptorch_lite")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_KEPT = 4  # programs kept per signature and trainable flags, differing in attributes alone


class CompiledModel:
    """What a wrapped model has compiled, and its calls ([Note: a call's direction]).

    Args:
        model: the user's model; options: the wrapper's frozen options; training: a
            training wrapper; processes: the replicas and stages in other processes
            (``distributed``), or None; generator: the model's own random state
            (``Options.randomSeed``), or None.
    """

    def __init__(self, model: torch.nn.Module, options: Options, training: bool, processes,
                 generator: Optional[torch.Generator]):
        self.model, self.options, self.training = model, options, training
        # What every call reads of the (frozen) options, read once: each read of an option
        # is a Python call, and a call's setup runs cold ([Note: one setup per call] in plan).
        self._D, self._all_or_nothing = options.device_iterations, options.all_or_nothing_calls
        self._R, self._group = options.replication_factor, options.input_group_size
        self.modes = {model: model.training}  # [Note: train and eval modes]
        self.processes = processes
        self.generator = generator  # [Note: micro-batch RNG]
        self.replica_values: dict = {}  # [Note: per-replica variables] in replica_groups
        # (input signature, trainable flags, attributes read: Reads.key) -> Program, the
        # most recently used last; and (signature, flags) -> the program its last call ran
        self.programs: dict = {}
        self._ran: dict = {}
        self.tables: Optional[dict] = None  # what the programs compile with (host_sync.tables)
        self._retraced: dict = {}  # attribute -> the programs its values have keyed
        self._drawn = None  # Python's and numpy's random states when a compile began
        # The parameters whose flags key a training program, and the flags the weights'
        # copies follow now ([Note: trainable parameters]).
        self.params = tuple(dict(model.named_parameters()).values()) if training else ()
        self.trainable: Optional[tuple] = None
        self.weights: Optional[Weights] = None
        self.placement: Optional[Placement] = None
        self.attached = False
        self.compiled_args: Optional[tuple] = None  # (args, kwargs) of the last compile
        self.last_run = None  # (schedule, the runs' RunStats, Recorder, devices)
        self.last_call: Optional[tuple] = None  # (partition, tensor inputs), perf counters
        self.statistics: Optional[RunStatistics] = None  # made from last_run when asked for
        self.steps = 0  # optimizer steps taken (skipped ones included)
        self._outputs: Optional[Outputs] = None
        self._split: Optional[tuple] = None  # MicroBatches' factor, explanation, synthetic mode
        self._release = None  # host_sync.watch's finalizer while the model is watched

    # -- a call ---------------------------------------------------------------------------

    def call(self, args: tuple, kwargs: dict, optimizer, loss_scale):
        """One call: split, compile (on a new signature), run, merge.

        Raises:
            As ``PoplarExecutor.__call__``: refusals before any state changes, then what a
            run raises, with a note of what it undid.
        """
        mbs, program = self.prepare(args, kwargs, optimizer)
        per_microbatch = self.run(program, mbs, optimizer, loss_scale)
        return self.outputs().merge(program.partition, per_microbatch)

    def prepare(self, args: tuple, kwargs: dict, optimizer) -> tuple:
        """Split the call's inputs and compile them if their signature (or the set of
        trainable parameters) is new, attached: ``(micro-batches, program)``; what
        ``compile()`` does. A refusal puts back Python's and numpy's random states, which
        a trace advances by the forward's draws ([Note: Python's random while tracing]):
        read when a compile starts (a call that compiles nothing draws nothing)."""
        self._drawn = None
        try:
            return self._prepare(args, kwargs, optimizer)
        except BaseException:
            if self._drawn is not None:
                trace_modes.set_host_random(self._drawn)
            raise

    def _prepare(self, args: tuple, kwargs: dict, optimizer) -> tuple:
        o = self.options  # the factor's arithmetic is spelled out only for a refusal
        weights = self.weights
        if weights is None:  # the parameters the first program compiles with
            self.params = tuple(dict(self.model.named_parameters()).values()) \
                if self.training else ()
        elif weights.rebound or not self.attached:  # [Note: objects the programs compile with]
            check_unchanged(self.model, self.tables)
            weights.rebound = False
        split = self._split
        if split is None:  # the options are frozen: read once (batch_factor may refuse them)
            split = self._split = (batch_factor(o), functools.partial(batch_arithmetic, o),
                                   o.synthetic_data_mode)
        mbs = MicroBatches(args, kwargs, *split)
        key = (mbs.signature(), tuple(map(_REQUIRES_GRAD, self.params)))
        program = self._ran.get(key)  # [Note: attributes the forward reads]
        if program is None or not program.partition.reads.same():
            program = self.find(key)
            if program is None:
                program = self.compile(key, mbs, optimizer)
                self.compiled_args = (args, kwargs)
            self._ran[key] = program
        if program.partition.reads.own_mode and self.model.training is not self.modes[self.model]:
            _own_mode_differs(self.model.training, self.training)
        if self.training and program.shared:  # a hook registered since the last call too
            backward_hooks.refuse_hooks_on_shared_parameters(program.shared, self.weights.params)
        if key[1] != self.trainable:  # [Note: trainable parameters]
            self.weights.follow_requires_grad()
            self.trainable = key[1]
        if not self.attached:
            self.attach()
        return mbs, program

    def find(self, key: tuple) -> Optional[Program]:
        """A kept program of ``key`` (signature, trainable flags) whose attributes have the
        values it was traced with, made the most recently used; None if there is none."""
        for k, program in self.programs.items():
            if k[:2] == key and program.partition.reads.same():
                self.programs[k] = self.programs.pop(k)
                return program
        return None

    def compile(self, key: tuple, mbs: MicroBatches, optimizer) -> Program:
        """The program of ``mbs``'s signature and the trainable flags, ``key`` ([Note: the
        compile step] in ``compiling``), kept under ``key`` and the attributes its trace
        read."""
        if key in self._ran:  # [Note: attributes the forward reads]
            self._attributes_changed(self._ran[key].partition.reads.changed())
        elif any(k[0] == key[0] for k in self.programs):  # [Note: trainable parameters]
            _LOG.info("%s", _trainable_note(self.programs, key, self.weights.params))
        elif self.programs:  # [Note: a new signature compiles] in batch
            _LOG.warning("%s", recompile_note(self.training, next(reversed(self.programs))[0],
                                              key[0]))
        self._drawn = trace_modes.host_random()  # put back if the call is refused
        if self.processes is not None:  # first compile: join the group, compare options
            self.processes.join(self.model, optimizer)
        if not self.programs:  # the names, as first compiled (a gradient frozen since: None)
            anchors.check(self.options.anchored_tensors, self.model, self.training,
                          anchors.scope_of(self.options))
            anchors.check_updatable_buffers(self.options.updatable_named_buffers, self.model)
        if self.weights is not None:
            self.weights.to_host()  # trace with the trained values, outside the trace
        program = compile_program(self.model, self.modes, self.options, self.training, mbs,
                                  self.replicas(), self.weights, self.placement, self.processes,
                                  self.replica_values)
        if self.weights is None:  # [Note: objects the programs compile with]
            self.tables = tables(self.model)
        self.weights, self.placement = program.executor.weights, program.executor.placement
        self.programs[(*key, program.partition.reads.key)] = program
        variants = [k for k in self.programs if k[:2] == key]
        for old in variants[:max(0, len(variants) - _KEPT)]:  # the least recently used
            del self.programs[old]
        o = self.options
        _LOG.info("%s", program.describe(
            self.training, o.device_iterations, self.replicas(), o.Training.gradient_accumulation,
            next((t.shape[0] for t in mbs.tensors(0) if t.dim() > 0), 1)))
        return program

    def _attributes_changed(self, changed: list) -> None:
        """Log a program compiled again for new values of attributes its forward reads
        (``changed``: ``Reads.changed``); warn once of an attribute whose values have keyed
        more programs than are kept ([Note: attributes the forward reads])."""
        _LOG.info("%s: attributes the forward reads changed since it was traced (%s): "
                  "compiles again for them and keeps the other program",
                  "trainingModel" if self.training else "inferenceModel",
                  ", ".join(f"{n}: {shown(a)} -> {shown(b)}" for n, a, b in changed))
        gone = [n for n, old, new in changed if n.endswith(".training") and old is True
                and new is False]
        if self.training and gone:  # [Note: train and eval modes]
            warn_once(f"modes.eval_in_training:{','.join(gone)}",
                      f"{', '.join(n[:-len('.training')] for n in gone)} went to eval mode "
                      f"since the training model was traced: it compiles again and trains "
                      f"with {'them' if len(gone) > 1 else 'it'} in eval mode (no dropout, "
                      f"normalisations on their running statistics), as plain PyTorch does, "
                      f"where PopTorch kept the modes of its first compile. Call model.train() "
                      f"before the training model's next call to train in train mode",
                      PoptorchLiteWarning)
        hook_tables = {n for n, _, _ in changed if is_hooks(n)}
        for name, _, _ in changed:
            n = self._retraced[name] = self._retraced.get(name, 1) + 1
            if n > _KEPT and name in hook_tables:
                warn_once(f"attributes.rehook:{name}",
                          f"the hooks of {name} have changed {n - 1} times since the model "
                          f"was first traced, and each change traces and compiles it again "
                          f"(the programs of the last {_KEPT} are kept): register a hook once "
                          f"and let it read a flag of your own to switch it on and off",
                          PoptorchLiteWarning)
            elif n > _KEPT:
                path, _, attr = name.rpartition(".")
                warn_once(
                    f"attributes.retrace:{name}",
                    f"{name}, which the forward reads, has had {n} values, and each new one "
                    f"traces and compiles the model again (the programs of the last {_KEPT} "
                    f"are kept): keep a value that changes every step in a buffer "
                    f"(self.register_buffer('{attr}', torch.tensor(value)), changed in place: "
                    f"{path}.{attr}.fill_(new)), which every call reads without tracing again",
                    PoptorchLiteWarning)

    def run(self, program: Program, mbs: MicroBatches, optimizer, loss_scale) -> list:
        """The call's runs (``Program.run``): the outputs per micro-batch.

        [Note: commit point] in ``update``: a failure leaves the state of the last
        completed step; ``allOrNothingCalls`` also undoes the steps of a failed call.
        """
        opts, weights, training = self.options, self.weights, self.training
        if training and self.processes is not None:  # [Note: sharded optimizer state]
            self.processes.check_sharded_state(optimizer, frozenset(  # sparse gradients
                n for n in program.executor.update.sparse if weights.params[n].requires_grad))
        if weights.edits():  # host edits reach the devices ([Note: weight sync] in host_sync)
            weights.to_device(everything=False)
        ex = program.executor
        full = training and self._all_or_nothing
        restore = capture(weights, optimizer, loss_scale, True, generator=self.generator,
                          generators=program.generators) if full else None
        ex.undoable = full
        applied = ex.update.steps_applied
        if training:
            weights.optimizer_state_to_homes(optimizer)
        try:
            outputs, record = program.run(  # with autocast off: its ``Call``
                mbs, opts, training, self.replicas(), optimizer, loss_scale, weights,
                self.outputs().kept, not full, self.generator)
        except BaseException as exc:
            applied = ex.update.steps_applied - applied
            if restore is not None:
                restore()
                applied = 0
            self.steps += applied
            exc.add_note(undo_note(applied, self._D if training else 0,
                                    isinstance(exc, UnrecoverableError)))
            raise
        finally:
            if program.compiled is not None:  # what the first calls compiled, once
                program.compiled.flush()
        if training:
            self.steps += self._D
        # The statistics are built when asked for: per call only the records.
        self.last_run, self.statistics = (*record, dict(self.placement.devices)), None
        self.last_call = (program.partition, len(mbs.tensor_positions))
        return outputs

    # -- what lasts between calls ---------------------------------------------------------

    def replicas(self) -> int:
        """The replicas this process runs in turn: every replica with per-replica variables,
        else one per input group."""
        return self._R // (1 if self.replica_values else self._group)

    def outputs(self) -> Outputs:
        """Which micro-batches come back and how they merge (the options are frozen: made
        once)."""
        if self._outputs is None:
            o = self.options
            self._outputs = Outputs(o.output_mode, o.output_return_period or 1, self.training,
                                    o.device_iterations, o.Training.gradient_accumulation,
                                    self.replicas())
        return self._outputs

    def run_statistics(self) -> Optional[RunStatistics]:
        """The last call's statistics (None before a call), made once per call."""
        if self.last_run is not None and self.statistics is None:
            self.statistics = run_statistics(
                *self.last_run, self.processes.layout if self.processes is not None else None)
        return self.statistics

    def attach(self) -> None:
        """Push the model's weights to the devices, and watch the model: reading it brings it
        up to date ([Note: weight sync] in ``host_sync``), as does this state being collected
        without ``detach``."""
        check_unchanged(self.model, self.tables)  # [Note: objects the programs compile with]
        if self.processes is not None and self.training:  # every replica starts the same
            self.processes.broadcast_from_main(self.model, self.owner())
        self.attached = True
        self.weights.to_device()
        if self._release is None:
            self._release = watch(self.model, self.weights, self)

    def detach(self) -> None:
        """Copy the weights to the host, release the devices' workers, stop watching."""
        self.weights.to_host()
        self.placement.close()
        self.attached = False
        self.unwatch()

    def unwatch(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def destroy(self) -> None:
        """Copy the weights back and drop every program (a later call compiles again)."""
        if self.weights is not None:
            self.weights.to_host()
        self.unwatch()
        if self.placement is not None:
            self.placement.close()
        for program in self.programs.values():  # [Note: overlapped all-reduce]'s hooks
            program.executor.update.release()
        self.programs.clear()
        self._ran.clear()
        self.placement = self.weights = self.last_call = self.trainable = self.tables = None
        self.attached = False

    def owner(self):
        """Parameter or buffer name -> the position in the pipeline of the process that runs
        it (None: no stage does); None when every process runs every stage."""
        channels = next(iter(self.programs.values())).executor.channels
        return None if channels is None else channels.weight_owner.get


def _trainable_note(programs: dict, key: tuple, params: dict) -> str:
    """The log line of a training program compiled again because the parameters that
    require grad changed since the last one of its signature ([Note: trainable parameters])."""
    old = next(k for k in reversed(programs) if k[0] == key[0])[1]
    names = list(params)
    frozen = [n for n, a, b in zip(names, old, key[1]) if a and not b]
    unfrozen = [n for n, a, b in zip(names, old, key[1]) if b and not a]
    return (f"trainingModel: the parameters that require grad changed (frozen: "
            f"{frozen or 'none'}; unfrozen: {unfrozen or 'none'}): compiles again for them "
            f"and keeps the other program")


def _own_mode_differs(user: bool, training: bool) -> None:
    """Warn once that the forward reads the wrapper's own ``training`` flag, the other one
    than the user's model's now, ``user`` ([Note: train and eval modes])."""
    kind = "trainingModel" if training else "inferenceModel"
    now, wrapped = ("train", "eval") if user else ("eval", "train")
    warn_once(f"modes.own:{kind}:{user}",
              f"the model is in {now} mode, but its forward reads self.training, which is the "
              f"{kind}'s own flag, set when it wrapped the model: it runs the forward in "
              f"{wrapped} mode, as PopTorch does (it wraps a shallow copy, which "
              f"model.{now}() no longer reaches), where plain PyTorch would run it in {now} "
              f"mode. Wrap the model in {now} mode to run it so", PoptorchLiteWarning)
