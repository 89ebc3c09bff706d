"""The PopTorch face: ``trainingModel``, ``inferenceModel`` and the model they return.

A call validates its inputs, compiles a program once per input signature (``runtime/
program.py``: traced, split into stages, placed, weights given homes), runs it
(``Program.run``) and merges the micro-batch outputs per the output mode. Every refusal
happens before any parameter, optimizer state, buffer or RNG state changes. What reads of
the user's model see while it is wrapped: [Note: weight sync] in ``runtime/host_sync.py``.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from typing import Optional

import torch
from torch.utils import _pytree as pytree

from . import anchors, optim as poptorch_optim, per_replica
from .annotations import module_repr
from .compiler.partition import Partition
from .compiler.rng import model_generator
from .distributed.processes import Processes
from .enums import ConnectionType
from .executables import Executables
from .errors import (DeviceError, OfflineDeviceError, OptionsError, PoptorchLiteWarning,
                     UnrecoverableError, WrapError,
                     hide_when_refused as __tracebackhide__, warn_once)
from .optim.loss_scale import LossScale
from .optim.optimizers import _PopTorchOptimizer
from .options.options import Options, batch_arithmetic, batch_factor
from .profiling import perf_counters
from .profiling.run_statistics import RunStatistics, run_statistics
from .runtime.batch import (MicroBatches, merge, recompile_note, resolve_output_mode,
                            selected_microbatches)
from .runtime.placement import Placement
from .runtime.program import Program, compile_program
from .runtime.undo import capture, undo_note
from .runtime.host_sync import watch
from .runtime.weights import Weights
from .trainers import (refuse_second_trainer, register_trainer,
                       training_wrapper as _training_wrapper, unregister_trainer)
from .wrapper_private import CompiledInputs, PrivateAttributes, check_private

_LOG = logging.getLogger("poptorch_lite")


class PoplarExecutor(perf_counters.Latencies, PrivateAttributes, Executables):
    """A model wrapped by ``trainingModel`` or ``inferenceModel``.

    Call it like the model with a combined batch. Attributes that the wrapper
    does not define are read from the user's model (``poptorch_model.fc.weight``);
    PopTorch's private names: [Note: private attributes] in ``wrapper_private``.
    """

    def __init__(self, model: torch.nn.Module, options: Options, training: bool,
                 optimizer: Optional[torch.optim.Optimizer] = None):
        self._user_model = model
        self._options = options
        self._training = training
        self._modes = {m: m.training for m in model.modules()}  # traced with wrap-time modes
        self._optimizer = optimizer
        self._programs: dict = {}
        self._placement: Optional[Placement] = None
        self._weights: Optional[Weights] = None
        self._attached = False
        self._compiled = False
        self._destroyed = False  # destroy() ran; a call compiles again (PopTorch)
        self._release: Optional[weakref.finalize] = None  # syncs and unwatches the model
        self._statistics: Optional[RunStatistics] = None  # built from _last_run when asked for
        self._last_run = None
        self._groups = None      # _output_groups()
        self._last_call: Optional[tuple] = None  # (partition, tensor inputs), for perf counters
        self._steps = 0  # optimizer steps taken (skipped ones included)
        self._loss_scale = LossScale(
            poptorch_optim.loss_scaling(optimizer), options.Training.automatic_loss_scaling,
            options.Training.loss_scaling_growth_interval) if training else None
        self._processes = Processes.for_options(options, training)
        self._random = model_generator(options.random_seed)  # [Note: micro-batch RNG]
        self._replica_values: dict = {}  # [Note: per-replica variables] in replica_groups

    # -- PopTorch's API -------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The user's model."""
        return self._user_model

    @property
    def options(self) -> Options:
        """The wrapper's own (frozen) copy of the options."""
        return self._options

    def __call__(self, *args, **kwargs):
        """Run one call: D device iterations over a combined batch.

        Raises:
            BatchSizeError, InputError, BlockError, LossError, PipelineError,
            OptionsError: refused before any state changes.
            ExecutionError: an action failed while running (or, with
                ``stopOnNonFiniteLoss``, a loss was not finite); the model is as after the
                call's last completed step, or as before the call with ``allOrNothingCalls``
                ([Note: all-or-nothing calls] in ``undo``), as it is for ``KeyboardInterrupt``.
            UnrecoverableError: the optimizer's step raised part-way ([Note: commit point]).
        """
        opts = self._options
        if opts.connection_type == ConnectionType.Never:
            raise OfflineDeviceError(
                "Trying to run a model on an offline device (Options.connectionType("
                "ConnectionType.Never), useOfflineIpuTarget): it can be compiled but not run; use "
                "ConnectionType.Always to run it")
        mbs, program = self._prepare(args, kwargs)
        trainer = _training_wrapper(self._user_model)
        if trainer is not None and trainer is not self and trainer._weights is not None:
            trainer._weights.to_host()  # [Note: weight sync]: follow the training model
        weights = self._weights
        if weights.edited():  # host edits reach the devices
            weights.to_device(everything=False)
        ex = program.executor
        # [Note: commit point]: a failure leaves the state of the last completed step;
        # allOrNothingCalls also undoes the steps of a failed call.
        full = self._training and opts.all_or_nothing_calls
        restore = capture(weights, self._optimizer, self._loss_scale, True,
                          generator=self._random) if full else None
        ex.undoable = full
        applied = ex.steps_applied
        if self._training:
            weights.optimizer_state_to_homes(self._optimizer)
        try:
            result = self._run(program, mbs, per_run=not full)
        except BaseException as exc:
            applied = ex.steps_applied - applied
            if restore is not None:
                restore()
                applied = 0
            self._steps += applied
            exc.add_note(undo_note(applied, opts.device_iterations if self._training else 0,
                                    isinstance(exc, UnrecoverableError)))
            raise
        if self._training:
            self._steps += opts.device_iterations
            if self._loss_scale.automatic and isinstance(
                    self._optimizer, _PopTorchOptimizer):
                self._optimizer.loss_scaling = self._loss_scale.scale  # [Note: loss scaling]
        return result

    def _run(self, program: Program, mbs: MicroBatches, per_run: bool = True):
        """The runs of one call (``Program.run``), then the merged outputs."""
        kept = {i for group in self._output_groups() for i in group}  # copied to the host
        outputs, record = program.run(
            mbs, self._options, self._training, self._replicas(), self._optimizer,
            self._loss_scale, self._weights, kept, per_run, self._random)
        # runStatistics() builds the statistics when asked for: per call only the records.
        self._last_run, self._statistics = (*record, dict(self._placement.devices)), None
        self._last_call = (program.partition, len(mbs.tensor_positions))
        return self._merge(program.partition, outputs)

    def runStatistics(self) -> RunStatistics:
        """The last call's timeline and activation-stash peaks (poptorch_lite's own).

        Raises:
            DeviceError: the model has not been called yet.

        Example:
            >>> import torch
            >>> from poptorch_lite import inferenceModel
            >>> model = inferenceModel(torch.nn.Linear(2, 1))
            >>> _ = model(torch.ones(3, 2))
            >>> model.runStatistics().timeline.spans[0].label
            '0F0'
        """
        if self._last_run is None:
            raise DeviceError("runStatistics() reports on the last call: call the model first")
        if self._statistics is None:
            self._statistics = run_statistics(
                *self._last_run, self._processes.layout if self._processes is not None else None)
        return self._statistics

    def getPerfCounters(self) -> dict:
        """PopTorch's performance counters of the last call ([Note: performance counters]).

        The latencies (``getLatency()``, ...) come from them (``perf_counters.Latencies``).

        Returns:
            ``{'input', 'input_complete', 'output', 'output_complete'}`` -> per tensor
            input (output), per micro-batch (output step): seconds from the start of the
            call; ``[[]]`` each before the model has run.

        Example:
            >>> import torch
            >>> from poptorch_lite import inferenceModel
            >>> model = inferenceModel(torch.nn.Linear(2, 1))
            >>> model.getPerfCounters()["input"]
            [[]]
            >>> _ = model(torch.ones(3, 2))
            >>> len(model.getPerfCounters()["input"][0])
            1
        """
        if not self._compiled or self._last_call is None:
            return perf_counters.empty()
        part, num_inputs = self._last_call
        o = self._options
        per_run = (o.Training.gradient_accumulation if self._training else o.device_iterations)
        return perf_counters.counters(
            self.runStatistics().timeline, num_inputs, sum(isinstance(v, str) for v in part.outputs),
            self._output_groups(), per_run * self._replicas())

    def compile(self, *args, **kwargs) -> None:
        """Trace and check the model for these inputs without running a step."""
        if self._compiled:
            warn_once("compile.twice", "compile() was called on a model that is already "
                      "compiled; nothing to do", PoptorchLiteWarning)
        self._prepare(args, kwargs)

    def isCompiled(self) -> bool:
        return self._compiled

    def getTensorNames(self) -> list:
        """The names of the tensors ``Options.anchorTensor`` can anchor ([Note: anchored
        tensors] in ``anchors``): parameters and buffers, ``Gradient___<param>`` and
        ``UpdatedVar___<param>`` when training. Needs a compiled model, as in PopTorch."""
        self._require_compiled()
        return anchors.tensor_names(self._user_model, self._training)

    def getAnchoredTensor(self, short_name: str) -> Optional[torch.Tensor]:
        """The value of the tensor anchored as ``short_name``, after the last call (a
        gradient is None before any step computed one)."""
        self._require_compiled()
        self._weights.to_host()
        return anchors.value(self._options.anchored_tensors, short_name, self._user_model,
                             self._weights.last_grads)

    def copyWeightsToHost(self) -> None:
        """Copy device-side weights and buffers back to the user's model.

        When the pipeline's stages run in several processes ([Note: stages in other processes] in ``distributed``), every process of the pipeline must call it
        together: each weight comes from the process that trains it, so every process's
        model then holds the whole trained model (otherwise a process's model is current
        for its own stages only).
        """
        self._require_compiled()
        self._weights.to_host()
        owner = self._owner() if self._processes is not None else None
        if owner is not None:  # what arrived from the owners is not a host edit
            self._weights.remember_versions(self._processes.from_owners(self._user_model, owner))

    def copyWeightsToDevice(self) -> None:
        """Make the device side use the user's model's current weights and buffers."""
        self._require_compiled()
        self._weights.to_host()  # values trained since the last sync are kept
        self._weights.to_device()

    def copyNamedBuffersToDevice(self) -> None:
        """Push the buffers named by ``Options.updatableNamedBuffers`` to the devices now (a
        host edit of any buffer reaches them before the next call anyway: [Note: weight sync]).

        Raises:
            OptionsError: no buffers were named.
        """
        self._require_compiled()
        if not self._options.updatable_named_buffers:
            raise OptionsError("No named buffers marked as updatable via updatableNamedBuffers "
                               "option; call opts.updatableNamedBuffers([...]) before wrapping")
        self._weights.to_device(everything=False)

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer``'s hyper-parameters from the next call on.

        The optimizer state is kept unless ``optimizer`` carries state of its own
        (a loaded state dict), as in PopTorch.
        """
        if not self._training:
            raise WrapError("setOptimizer() needs a model wrapped with trainingModel; this one was "
                            "wrapped with inferenceModel, which has no optimizer")
        self._optimizer = poptorch_optim.adopt(self._optimizer, optimizer,
                                               self._options.Training, self._compiled)
        self._loss_scale.scale = poptorch_optim.loss_scaling(self._optimizer)

    def detachFromDevice(self) -> None:
        """Copy weights to the host and release the device's workers."""
        if not self._compiled or not self._attached:
            raise DeviceError("Device is not attached: compile or call the model before "
                              "detachFromDevice()")
        self._weights.to_host()
        self._placement.close()
        self._attached = False
        self._unwatch_model()

    def attachToDevice(self) -> None:
        """Attach again after ``detachFromDevice()`` (a call attaches automatically)."""
        self._require_compiled()
        if self._attached:
            raise DeviceError("Device is already attached: call detachFromDevice() before "
                              "attachToDevice()")
        self._attach()

    def isAttachedToDevice(self) -> bool:
        return self._attached

    def destroy(self) -> None:
        """Copy weights back, release workers and unwrap (the model can be wrapped again)."""
        if self._weights is not None:
            self._weights.to_host()
        self._unwatch_model()
        if self._placement is not None:
            self._placement.close()
        self._programs.clear()
        self._placement = self._weights = self._last_call = None
        self._attached = self._compiled = False
        self._destroyed = True
        unregister_trainer(self._user_model, self)

    def _revive(self) -> None:
        """A destroyed wrapper called again compiles again, as PopTorch's does, unless
        another training wrapper has taken the model meanwhile.

        Raises:
            WrapError: another ``trainingModel`` of the same model is alive.
        """
        if self._training:
            refuse_second_trainer(self._user_model, self)
        warnings.warn(
            f"this {'trainingModel' if self._training else 'inferenceModel'} was destroyed "
            f"and is called again: it compiles again from the model's current weights. Wrap "
            f"the model anew (poptorch.{'trainingModel' if self._training else 'inferenceModel'}"
            f"(model, ...)) to make that explicit", PoptorchLiteWarning, stacklevel=4)
        if self._training:
            register_trainer(self._user_model, self)
        self._destroyed = False

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the user's model, then into the device side."""
        if self._weights is not None:
            self._weights.to_host()  # what the state dict leaves out keeps its trained value
        result = self._user_model.load_state_dict(state_dict, strict)
        if self._compiled:
            self.copyWeightsToDevice()
        return result

    def to(self, *args, **kwargs):
        raise WrapError("a wrapped model cannot be moved with .to(): IPUs map to devices through "
                        "Options.set_ipu_devices(...); move the model before wrapping it")

    cuda = cpu = half = float = double = to

    def __getattr__(self, name: str):
        if name.startswith("_"):
            check_private(self.__dict__, name)  # [Note: private attributes]
        weights = self.__dict__.get("_weights")
        if weights is not None:
            weights.to_host()  # [Note: weight sync]
        return per_replica.offer(self, name, getattr(self._user_model, name))

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({module_repr(self._user_model)})"

    # -- internals ------------------------------------------------------------------------

    def _replicas(self) -> int:  # every replica runs with per-replica variables
        o = self._options
        return o.replication_factor // (1 if self._replica_values else o.input_group_size)

    def _split(self, args, kwargs) -> MicroBatches:
        o = self._options  # the factor's arithmetic is spelled out only for a refusal
        return MicroBatches(args, kwargs, batch_factor(o), functools.partial(batch_arithmetic, o),
                            o.synthetic_data_mode)

    def _prepare(self, args, kwargs) -> tuple:
        """The call's micro-batches and its program, compiled and attached (revived first)."""
        mbs = self._split(args, kwargs)
        if self._destroyed:
            self._revive()
        program = self._program(mbs, args, kwargs)
        if not self._attached:
            self._attach()
        return mbs, program

    def _program(self, mbs: MicroBatches, args: tuple, kwargs: dict) -> Program:
        key = mbs.signature()
        program = self._programs.get(key)
        if program is None and self._programs:  # [Note: a new signature compiles]
            _LOG.warning("%s", recompile_note(self._training, next(reversed(self._programs)), key))
        if program is None:
            if self._processes is not None:  # first compile: join the group, compare options
                self._processes.join(self._user_model, self._optimizer)
            anchors.check(self._options.anchored_tensors, self._user_model, self._training)
            anchors.check_updatable_buffers(self._options.updatable_named_buffers,
                                            self._user_model)
            if self._weights is not None:
                self._weights.to_host()  # trace with the trained values, outside the trace
            program, self._weights, self._placement = compile_program(
                self._user_model, self._modes, self._options, self._training, mbs,
                self._replicas(), self._weights, self._placement, self._processes,
                self._replica_values)
            self._programs[key], self._compiled = program, True
            self._executable_inputs = CompiledInputs(self._user_model.forward, args, kwargs)
            o = self._options
            _LOG.info("%s", program.describe(
                self._training, o.device_iterations, self._replicas(),
                o.Training.gradient_accumulation,
                next((t.shape[0] for t in mbs.tensors(0) if t.dim() > 0), 1)))
        return program

    def _attach(self) -> None:
        if self._processes is not None and self._training:  # every replica starts the same
            self._processes.broadcast_from_main(self._user_model, self._owner())
        self._attached = True
        self._weights.to_device()
        self._watch_model()

    def _owner(self):
        """Parameter or buffer name -> the position in the pipeline of the process that runs
        it (None: no stage does); None when every process runs every stage."""
        channels = next(iter(self._programs.values())).executor.channels
        return None if channels is None else channels.weight_owner.get

    def _require_compiled(self) -> None:
        if not self._compiled:
            raise DeviceError("Model has not been compiled or has been destroyed: call the "
                              "model (or model.compile(...)) first")

    def _watch_model(self) -> None:
        """Reading the user's model brings it up to date ([Note: weight sync]); so does this
        wrapper being garbage collected without ``destroy()``."""
        if self._release is None:
            self._release = watch(self._user_model, self._weights, self)

    def _unwatch_model(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def _output_groups(self) -> list:
        """The micro-batches each returned output step holds, per the output mode."""
        if self._groups is None:  # the options are frozen: once per wrapper
            o = self._options
            mode = resolve_output_mode(o.output_mode, self._training)
            self._groups = selected_microbatches(
                mode, o.output_return_period or 1, o.device_iterations,
                o.Training.gradient_accumulation, self._replicas())
        return self._groups

    def _merge(self, part: Partition, per_microbatch: list):
        merged = iter(merge(per_microbatch, self._output_groups()))
        leaves = [next(merged) if isinstance(v, str) else v[1] for v in part.outputs]
        return pytree.tree_unflatten(leaves, part.out_spec)

