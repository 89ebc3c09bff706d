"""The PopTorch face: ``trainingModel``, ``inferenceModel`` and the model they return.

The face checks what PopTorch checks, pairs training and inference wrappers, attaches and
detaches, and keeps the loss scale; a call's work (split, compile once per input signature,
run, merge) and every piece of state it lasts on belong to the wrapper's
``runtime.compiled.CompiledModel`` ([Note: a call's direction] there). Every refusal
happens before any parameter, optimizer state, buffer or RNG state changes. What reads of
the user's model see while it is wrapped: [Note: weight sync] in ``runtime/host_sync.py``.
"""

from __future__ import annotations

import types
import warnings
from typing import Optional

import torch

from . import optim as poptorch_optim, per_replica
from .annotations import module_repr
from .compiler.rng import model_generator
from .distributed.processes import Processes
from .enums import ConnectionType
from . import executables
from .executables import target_path
from .errors import (DeviceError, OfflineDeviceError, OptionsError, PoptorchLiteWarning,
                     WrapError, hide_when_refused as __tracebackhide__, warn_once)
from .optim.loss_scale import LossScale
from .optim.optimizers import _PopTorchOptimizer
from .options.options import Options
from .profiling import perf_counters
from .profiling.run_statistics import RunStatistics
from .runtime import anchors
from .runtime.compiled import CompiledModel
from .trainers import (refuse_second_trainer, register_trainer,
                       training_wrapper as _training_wrapper, unregister_trainer)
from .wrapper_private import CompiledInputs, check_private


class PoplarExecutor(perf_counters.Latencies):
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
        self._optimizer = optimizer
        self._destroyed = False  # destroy() ran; a call compiles again (PopTorch)
        self._offline = options.connection_type == ConnectionType.Never  # compiles, never runs
        self._loss_scale = LossScale(
            poptorch_optim.loss_scaling(optimizer), options.Training.automatic_loss_scaling,
            options.Training.loss_scaling_growth_interval) if training else None
        self._processes = Processes.for_options(options, training)
        self._random = model_generator(options.random_seed)  # [Note: micro-batch RNG]
        # What the calls compute with and keep: [Note: a call's direction] in runtime/compiled
        self._state: CompiledModel = CompiledModel(model, options, training, self._processes,
                                                   self._random)

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
        if self._offline:
            raise OfflineDeviceError(
                "Trying to run a model on an offline device (Options.connectionType("
                "ConnectionType.Never), useOfflineIpuTarget): it can be compiled but not run; use "
                "ConnectionType.Always to run it")
        self._ready()
        result = self._state.call(args, kwargs, self._optimizer, self._loss_scale)
        if self._training and self._loss_scale.automatic and isinstance(
                self._optimizer, _PopTorchOptimizer):
            self._optimizer.loss_scaling = self._loss_scale.scale  # [Note: loss scaling]
        return result

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
        statistics = self._state.run_statistics()
        if statistics is None:
            raise DeviceError("runStatistics() reports on the last call: call the model first")
        return statistics

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
        state = self._state
        if not self._compiled or state.last_call is None:
            return perf_counters.empty()
        part, num_inputs = state.last_call
        o = self._options
        per_run = (o.Training.gradient_accumulation if self._training else o.device_iterations)
        return perf_counters.counters(
            self.runStatistics().timeline, num_inputs, sum(isinstance(v, str) for v in part.outputs),
            state.outputs().groups, per_run * state.replicas())

    def compile(self, *args, **kwargs) -> None:
        """Trace and check the model for these inputs without running a step."""
        if self._compiled:
            warn_once("compile.twice", "compile() was called on a model that is already "
                      "compiled; nothing to do", PoptorchLiteWarning)
        self._ready()
        self._state.prepare(args, kwargs, self._optimizer)

    def isCompiled(self) -> bool:
        return self._compiled

    def getTensorNames(self) -> list:
        """The names of the tensors ``Options.anchorTensor`` can anchor ([Note: anchored
        tensors] in ``anchors``): parameters and buffers, ``Gradient___<param>`` and
        ``UpdatedVar___<param>`` when training. Needs a compiled model, as in PopTorch."""
        self._require_compiled()
        return anchors.tensor_names(self._user_model, self._training,
                                    anchors.scope_of(self._options))

    def getAnchoredTensor(self, short_name: str) -> Optional[torch.Tensor]:
        """The value of the tensor anchored as ``short_name``, after the last call (a
        gradient is None before any step computed one)."""
        self._require_compiled()
        self._weights.to_host()
        return anchors.value(self._options.anchored_tensors, short_name, self._user_model,
                             self._weights.last_grads, anchors.scope_of(self._options))

    def copyWeightsToHost(self) -> None:
        """Copy device-side weights and buffers back to the user's model.

        When the pipeline's stages run in several processes ([Note: stages in other processes] in ``distributed``), every process of the pipeline must call it
        together: each weight comes from the process that trains it, so every process's
        model then holds the whole trained model (otherwise a process's model is current
        for its own stages only).
        """
        self._require_compiled()
        self._weights.to_host()
        owner = self._state.owner() if self._processes is not None else None
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
        self._state.detach()

    def attachToDevice(self) -> None:
        """Attach again after ``detachFromDevice()`` (a call attaches automatically)."""
        self._require_compiled()
        if self._attached:
            raise DeviceError("Device is already attached: call detachFromDevice() before "
                              "attachToDevice()")
        self._state.attach()

    def isAttachedToDevice(self) -> bool:
        return self._attached

    def destroy(self) -> None:
        """Copy weights back, release workers and unwrap (the model can be wrapped again)."""
        self._state.destroy()
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
        state = self.__dict__.get("_state")
        weights = state.weights if state is not None else None
        if weights is not None:
            weights.to_host()  # [Note: weight sync]
        return per_replica.offer(self, name, getattr(self._user_model, name))

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({module_repr(self._user_model)})"

    # -- internals ------------------------------------------------------------------------

    def _ready(self) -> None:
        """Before a call compiles or runs: a destroyed wrapper compiles again, and an
        inference wrapper follows its training wrapper's weights ([Note: weight sync])."""
        if self._destroyed:
            self._revive()
        if self._training:  # a live training wrapper is its model's trainer
            return  # ([Note: one trainer per model] in ``trainers``)
        trainer = _training_wrapper(self._user_model)
        if trainer is not None and trainer._weights is not None:
            trainer._weights.to_host()

    def _require_compiled(self) -> None:
        if not self._compiled:
            raise DeviceError("Model has not been compiled or has been destroyed: call the "
                              "model (or model.compile(...)) first")

    # The compiled state's fields, by the private names PopTorch's clients and this
    # package's modules read ([Note: private attributes] in ``wrapper_private``).
    _programs = property(lambda self: self._state.programs)
    _weights = property(lambda self: self._state.weights)
    _placement = property(lambda self: self._state.placement)
    _last_run = property(lambda self: self._state.last_run)
    _replica_values = property(lambda self: self._state.replica_values)

    # -- saved executables ([Note: saved executables] in ``executables``) ------------------

    def save(self, filename, export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save what the compiled model needs to run again ([Note: saved executables] in
        ``executables``): its options and compiling
        arguments, and with ``export_model`` the model and optimizer.

        Raises:
            DeviceError: the model has not been compiled.
        """
        if not self._compiled or self._executable_inputs is None:
            raise DeviceError("Model has not been compiled or has been destroyed: call "
                              "compile(*args) or the model before save()")
        inputs = self._executable_inputs
        data = {"format": executables.FORMAT, "version": executables.VERSION,
                "training": self._training,
                "options": self._options.clone(), "args": list(inputs.args),
                "kwargs": dict(inputs.kwargs), "model": None, "optimizer": None, "rng": None}
        if export_model:
            self._weights.to_host()  # [Note: weight sync]
            data["model"], data["optimizer"] = self._user_model, self._optimizer
        if save_rng_state and self._random is not None:
            data["rng"] = self._random.get_state()
        torch.save(data, target_path(filename))

    def compileAndExport(self, filename, *args, export_model: bool = True, **kwargs) -> None:
        """Compile for ``args`` and ``kwargs`` (the model's own arguments), then ``save``."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def loadExecutable(self, filename) -> None:
        """Compile this wrapper for the arguments a saved file was compiled for.

        Raises:
            CheckpointError: the file is not one ``save`` wrote.
        """
        data = executables.read(filename)
        self.compile(*data["args"], **data["kwargs"])
        if data["rng"] is not None and self._random is not None:
            self._random.set_state(data["rng"])

    # -- PopTorch's private attributes that its clients read ([Note: private attributes] in
    # ``wrapper_private``) ---------------------------------------------------------------

    @property
    def _executable(self) -> Optional[types.MappingProxyType]:
        return types.MappingProxyType(self._programs) if self._compiled else None

    @property
    def _model(self):
        return self._user_model

    @property
    def _is_attached(self) -> bool:
        return self._attached

    @property
    def _executable_inputs(self) -> Optional[CompiledInputs]:
        """The last compile's arguments, as PopTorch keeps them (None before one)."""
        compiled = self._state.compiled_args
        return None if compiled is None else CompiledInputs(self._user_model.forward, *compiled)
    _compiled = property(lambda self: bool(self._state.programs))
    _attached = property(lambda self: self._state.attached)

    @property
    def _steps(self) -> int:
        """Optimizer steps taken (skipped ones included); a checkpoint sets it."""
        return self._state.steps

    @_steps.setter
    def _steps(self, steps: int) -> None:
        self._state.steps = steps
