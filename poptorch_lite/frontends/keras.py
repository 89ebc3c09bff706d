"""The Keras face: ``Model``, ``Sequential``, ``compile``, ``fit``, ``evaluate``, ``predict``.

[Note: Keras face]
The workflow of Graphcore's IPU Keras tutorials on torch modules, built on the
PopTorch face and nothing else. ``fit`` wraps the module and its loss with
``trainingModel``; ``evaluate`` and ``predict`` with ``inferenceModel``. Their
``Options`` say what the Keras names say:

    deviceIterations     = steps_per_execution / (G × replicas)   (training)
                         = steps_per_execution / replicas         (inference)
    gradientAccumulation = G   (gradient_accumulation_steps_per_replica)
    replicationFactor    = auto_select_ipus / stages              (IPUStrategy scope)
    broadcastBuffers     = False with replicas: each replica keeps its own buffers,
                           as each IPU keeps its own copy of TF's non-trainable
                           variables (the host reads replica 0's)
    outputMode           = All (every batch's loss and predictions, for the logs)
    strategy             = PipelinedExecution(schedule=pipeline_schedule)

so one call of the wrapper is one execution of ``steps_per_execution`` batches,
batch k of the execution being micro-batch k, and every number equals the
PopTorch face's.

[Note: Keras steps]
A step is one batch of ``batch_size`` samples on one replica, and every count
of the face is in steps of all replicas together: ``steps_per_execution``
(an execution takes ``steps_per_execution × batch_size`` samples,
``steps_per_execution / replicas`` of its steps on each replica, hence "a
multiple of G × replicas"), ``steps_per_epoch`` / ``steps``, ``params["steps"]``
of the callbacks, the progress bar and the batch indices of the hooks. The
Keras tutorial's per-replica figures are the same counts divided by the
replicas: each replica runs its own program of ``steps_per_execution /
replicas`` steps, and an epoch holds ``samples // (batch_size × replicas)``
steps per replica. A ``steps_per_execution`` larger than an epoch's steps is
truncated to them for that call, with one warning, as Keras does.

The effective batch of an optimizer step is ``batch_size × G × replicas``. Changing ``steps_per_execution`` (``compile``
again) or an IPU option destroys the wrappers; the next call wraps again, and the
module keeps its weights and the optimizer its state.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from ..annotations import removeBlocks
from ..errors import (BlockError, InputError, OptimizerError, OptionsError, PoptorchLiteWarning,
                      WrapError, warn_once)
from ..options.base import check_positive_int
from ..options.options import Options
from ..strategies import ShardedExecution
from ..wrap import inferenceModel, trainingModel
from .dry_run import module_calls
from .keras_callbacks import CallbackList, History, RunningLogs, format_logs
from .keras_data import Data
from .keras_ipu import IPU_ONLY_KEYWORDS, IpuSettings, PipelineSchedule, current_ipus
from .keras_losses import resolve_loss, resolve_metrics, resolve_optimizer
from .splits import _last_program, assign_stages, num_stages
from .keras_stages import PipelineStageAssignment, layer_stages, table

_LOG = logging.getLogger("poptorch_lite")
_HINTED: set = set()


class Model:
    """A torch module with Keras' ``compile``/``fit``/``evaluate``/``predict`` ([Note: Keras face]).

    Args:
        module: an ``nn.Module`` whose forward maps inputs to predictions.
        name: shown by ``summary()`` (default: the module's class name).

    Raises:
        InputError: ``module`` is not an ``nn.Module``.

    Example:
        >>> model = Model(torch.nn.Linear(4, 2))
        >>> model.compile("sgd", "mse", steps_per_execution=2)
        >>> history = model.fit(torch.ones(8, 4), torch.zeros(8, 2), batch_size=2, verbose=0)
        >>> len(history.history["loss"])
        1
    """

    def __init__(self, module: torch.nn.Module, name: Optional[str] = None):
        if not isinstance(module, torch.nn.Module):
            raise InputError(f"keras.Model wraps an nn.Module, got {type(module).__name__}; "
                             f"for a list of layers use keras.Sequential([...])")
        self.module, self.name = module, name or type(module).__name__
        self._ipu = IpuSettings(ipus=current_ipus())
        self._step = _TrainStep(module)
        self.optimizer = self._optimizer_spec = self._metrics = None
        self._spe, self._compiled = 1, False
        self._async = False
        self._assignment: Optional[list] = None
        self._applied = False
        self._stages: Optional[int] = None  # found by tracing once ([Note: Keras face])
        self._layer_stages: Optional[dict] = None  # child -> stage, from that trace
        self._example = None  # the first batch seen ([Note: Keras layer order])
        self._call_order: Optional[list] = None
        self._wrappers: dict = {}
        self.history: Optional[History] = None
        self.stop_training = False

    # -- Keras' API --------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if self._example is None and args and isinstance(args[0], torch.Tensor):
            self._example = args[0]
        return self.module(*args, **kwargs)

    @property
    def layers(self) -> list:
        """The module's children, in order (the layers of ``set_pipeline_stage_assignment``)."""
        return list(self.module.children())

    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, run_eagerly=None, steps_per_execution: int = 1,
                jit_compile=None, **ipu_only):
        """Choose the optimizer, loss, metrics and batches per execution (Keras' signature).

        Args:
            optimizer: ``"sgd"``, ``"adam"``, ``"rmsprop"`` (Keras' defaults), a
                ``keras.optimizers`` description, a torch optimizer, or a callable from
                parameters to one. The same name or object as the last compile keeps
                the optimizer (and its state).
            loss: a Keras name, a ``keras.losses`` object, a torch loss module or a
                callable ``fn(y_true, y_pred)`` ([Note: Keras formulas]).
            metrics: ``["accuracy"]`` or callables ``fn(y_true, y_pred)``.
            loss_weights: None, or a number (or a list of one) multiplying the loss.
            weighted_metrics: None only (metrics weighted by ``sample_weight`` are not
                kept).
            run_eagerly, jit_compile: accepted; they change no number here.
            steps_per_execution: steps per execution, all replicas' together
                ([Note: Keras steps]).
            **ipu_only: IPU Keras' compile-time IPU options, accepted with one warning.

        Raises:
            OptionsError, OptimizerError: an invalid argument; nothing changes.

        Example:
            >>> model = Model(torch.nn.Linear(4, 2))
            >>> model.compile("adam", "sparse_categorical_crossentropy", ["accuracy"],
            ...               steps_per_execution=10)
        """
        spe = check_positive_int(steps_per_execution, "steps_per_execution",
                                 "model.compile(..., steps_per_execution=1)")
        weight = _loss_weight(loss_weights)
        if weighted_metrics is not None:
            raise OptionsError(f"weighted_metrics={weighted_metrics!r}: metrics weighted by "
                               f"sample_weight are not kept; pass them as metrics=[...] "
                               f"(unweighted)")
        _ipu_only("compile", ipu_only)
        if weight is not None and isinstance(loss, torch.nn.Module):
            raise OptionsError(f"loss_weights={loss_weights!r} needs a Keras loss (a name or a "
                               f"keras.losses object); the torch loss module "
                               f"{type(loss).__name__} is marked as the loss as it is")
        build = resolve_optimizer(optimizer)
        loss_fn = None if loss is None else resolve_loss(loss)
        metric_fns = resolve_metrics(metrics)
        same = self.optimizer is not None and _same_spec(optimizer, self._optimizer_spec)
        opt = self.optimizer if same else build(self.module.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise OptimizerError(f"the optimizer callable returned {type(opt).__name__}, not "
                                 f"a torch optimizer; return e.g. torch.optim.SGD(params, lr=0.01)")
        self._release()
        self.optimizer, self._optimizer_spec, self._metrics = opt, optimizer, metric_fns
        self._step.loss_fn, self._spe, self._compiled = loss_fn, spe, True
        self._step.loss_weight = weight
        if spe == 1 and "spe" not in _HINTED:
            _HINTED.add("spe")
            _LOG.warning("steps_per_execution is 1: every batch is an execution of its own, "
                         "with a round trip to the host; compile(..., steps_per_execution=N) "
                         "runs N batches per execution and is faster")

    def set_gradient_accumulation_options(self, gradient_accumulation_steps_per_replica=None,
                                          offload_weight_update_variables=None, **ipu_only):
        """Accumulate the gradients of G batches per replica before each optimizer step.

        IPU Keras' other keywords (``replicated_optimizer_state_sharding``, ...) are
        accepted with one IPU-only warning each.

        Raises:
            OptionsError: G is not a positive int, or an unknown keyword.

        Example:
            >>> Model(torch.nn.Linear(4, 2)).set_gradient_accumulation_options(
            ...     gradient_accumulation_steps_per_replica=4)
        """
        self.set_pipelining_options(gradient_accumulation_steps_per_replica,
                                    offload_weight_update_variables=offload_weight_update_variables,
                                    **ipu_only)

    def set_pipelining_options(self, gradient_accumulation_steps_per_replica=None,
                               pipeline_schedule=None, recomputation_mode=None,
                               offload_weight_update_variables=None, **ipu_only):
        """IPU Keras' pipelining options; None leaves an option as it is.

        Args:
            gradient_accumulation_steps_per_replica: G.
            pipeline_schedule: ``PipelineSchedule.Grouped`` (default), ``Interleaved``,
                ``Sequential`` or ``ZeroBubble`` (backward split into input and weight
                gradients; poptorch_lite's own), or its name.
            recomputation_mode: a :class:`RecomputationMode` or its name: recompute
                every stage.
            offload_weight_update_variables: keep optimizer state off the device
                (``TensorLocations.setOptimizerLocation(useOnChipStorage(False))``).
            **ipu_only: the porting table's IPU-only keywords
                (``batch_serialization_iterations``, ``offload_activations``,
                ``*_poplar_options``, ...; see ``keras_ipu.IPU_ONLY_KEYWORDS``),
                accepted with one warning each.

        Raises:
            OptionsError: an invalid value or an unknown keyword; nothing changes.

        Example:
            >>> Model(torch.nn.Linear(4, 2)).set_pipelining_options(
            ...     gradient_accumulation_steps_per_replica=8,
            ...     pipeline_schedule=PipelineSchedule.Interleaved)
        """
        ipu = self._ipu.with_pipelining(gradient_accumulation_steps_per_replica,
                                        pipeline_schedule, recomputation_mode,
                                        offload_weight_update_variables)
        _ipu_only("set_pipelining_options", ipu_only)
        self._release()
        self._ipu = ipu

    def set_asynchronous_callbacks(self, asynchronous: bool = False) -> None:
        """True: batch hooks fire for every batch, not once per execution.

        See [Note: Keras batch hooks].

        Example:
            >>> Model(torch.nn.Linear(4, 2)).set_asynchronous_callbacks(True)
        """
        self._async = bool(asynchronous)

    def fit(self, x=None, y=None, batch_size=None, epochs: int = 1, verbose: int = 1,
            callbacks=None, validation_data=None, shuffle: bool = True, initial_epoch: int = 0,
            steps_per_epoch: Optional[int] = None, drop_remainder: bool = False,
            sample_weight=None) -> History:
        """Train for ``epochs - initial_epoch`` epochs; return the ``History``.

        Each execution runs ``steps_per_execution`` batches through the training
        model ([Note: Keras face]). With ``shuffle``, each epoch's order is
        ``torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))``
        with ``seed`` drawn once per ``fit`` from torch's default generator.

        Args:
            x, y: tensors or NumPy arrays, a ``Dataset`` of ``(x, y)``, or a stream of
                ``(x, y)`` batches: a ``DataLoader``, an ``IterableDataset`` or an
                ``AsynchronousDataAccessor`` (``y`` None then; [Note: Keras data streams]).
            batch_size: samples per batch (default 32).
            epochs, initial_epoch: train epochs ``initial_epoch .. epochs - 1``.
            verbose: 1 a tqdm bar per epoch, 2 one line per epoch, 0 silent.
            callbacks: ``keras.callbacks.Callback`` objects ([Note: Keras batch hooks]).
            validation_data: ``(x_val, y_val)`` evaluated at each epoch's end (``val_`` logs).
            shuffle: shuffle tensors and Datasets each epoch (a DataLoader keeps its order).
            steps_per_epoch: steps per epoch (default: all; [Note: Keras steps]).
            drop_remainder: drop the samples beyond a multiple of ``batch_size × replicas``.
            sample_weight: one weight per sample (tensors): the loss is
                ``sum(w * loss) / batch_size`` per batch, as Keras'.

        Raises:
            WrapError: not compiled with a loss.
            InputError, BatchSizeError, OptionsError, PipelineError: the tutorials'
                rules; refused before anything changes.

        Example:
            >>> model = Sequential([torch.nn.Linear(4, 3)])
            >>> model.compile("sgd", "sparse_categorical_crossentropy", ["accuracy"])
            >>> h = model.fit(torch.randn(64, 4), torch.randint(0, 3, (64,)), verbose=0)
            >>> sorted(h.history)
            ['accuracy', 'loss']
        """
        data, R, count, spe = self._prepare("fit", x, y, batch_size, steps_per_epoch,
                                            drop_remainder, "steps_per_epoch", sample_weight)
        val = None if validation_data is None else Data(*_pair(validation_data),
                                                        data.batch_size, True, "validation_data")
        val_count, val_spe = (None, None) if val is None else self._plan(
            val, "evaluate", R, None, drop_remainder, "validation_steps")
        history = History()
        hooks = CallbackList([*(callbacks or []), history], self,
                             {"epochs": epochs, "steps": count, "verbose": verbose})
        train = self._wrapper("train", R, spe)
        seed = int(torch.randint(0, 2**62, (1,))) if shuffle and data.loader is None else None
        self.stop_training, logs = False, {}
        hooks.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            hooks.on_epoch_begin(epoch)
            order = None if seed is None else torch.randperm(
                data.samples, generator=torch.Generator().manual_seed(seed + epoch))
            logs = self._run("train", train, data, order, count, spe,
                             hooks.on_train_batch_begin, hooks.on_train_batch_end, verbose,
                             f"Epoch {epoch + 1}/{epochs}")
            if val is not None:
                val_logs = self._run("evaluate", self._wrapper("evaluate", R, val_spe), val,
                                     None, val_count, val_spe, None, None, 0, "")
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            hooks.on_epoch_end(epoch, logs)
            if verbose == 2:
                print(f"Epoch {epoch + 1}/{epochs} - " + format_logs(logs))
            if self.stop_training:
                break
        hooks.on_train_end(logs)
        self.history = history
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose: int = 1, steps=None,
                 callbacks=None, return_dict: bool = False, drop_remainder: bool = False,
                 sample_weight=None):
        """The loss (and metrics) over the data: ``loss``, or ``[loss, *metrics]``, as Keras.

        Runs the module in eval mode through ``inferenceModel``, ``steps_per_execution``
        batches per execution. ``return_dict=True`` returns the logs instead.

        Raises:
            as :meth:`fit`.

        Example:
            >>> model = Sequential([torch.nn.Linear(4, 1)])
            >>> model.compile("sgd", "mse")
            >>> float(model.evaluate(torch.ones(32, 4), torch.zeros(32, 1), verbose=0)) >= 0
            True
        """
        data, R, count, spe = self._prepare("evaluate", x, y, batch_size, steps, drop_remainder,
                                            "steps", sample_weight)
        hooks = CallbackList(callbacks, self, {"steps": count, "verbose": verbose})
        hooks.on_test_begin()
        logs = self._run("evaluate", self._wrapper("evaluate", R, spe), data, None, count, spe,
                         hooks.on_test_batch_begin, hooks.on_test_batch_end, verbose, "evaluate")
        hooks.on_test_end(logs)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def predict(self, x, batch_size=None, verbose: int = 0, steps=None, callbacks=None,
                drop_remainder: bool = False) -> torch.Tensor:
        """The module's outputs for every sample (eval mode, through ``inferenceModel``).

        Returns a tensor (Keras returns a NumPy array; ``.numpy()`` gives one).

        Raises:
            as :meth:`fit` (no loss is needed).

        Example:
            >>> model = Sequential([torch.nn.Linear(4, 2)])
            >>> model.compile("sgd", "mse")
            >>> model.predict(torch.ones(32, 4)).shape
            torch.Size([32, 2])
        """
        data, R, count, spe = self._prepare("predict", x, None, batch_size, steps, drop_remainder)
        hooks = CallbackList(callbacks, self, {"steps": count, "verbose": verbose})
        hooks.on_predict_begin()
        outputs = []
        self._run("predict", self._wrapper("predict", R, spe), data, None, count, spe,
                  hooks.on_predict_batch_begin, hooks.on_predict_batch_end, verbose, "predict",
                  outputs)
        hooks.on_predict_end()
        return torch.cat(outputs)

    # -- internals ---------------------------------------------------------------------


    # -- stage assignment ([Note: Keras layer order] in ``keras_stages``) ------------------

    def _order(self) -> Optional[list]:
        """``(name, child)`` in call order, or None while no batch has been seen."""
        children = list(self.module.named_children())
        if isinstance(self.module, torch.nn.Sequential):
            return children
        if self._example is None:
            return None
        if self._call_order is None:
            _, calls = module_calls(self.module, self._example)
            position = {id(m): k for k, (m, _) in enumerate(calls)}
            self._call_order = sorted(children, key=lambda nc: position.get(id(nc[1]),
                                                                            len(calls)))
        return self._call_order

    def _apply_assignment(self) -> None:
        """Put the blocks of a kept assignment on the layers once their order is known."""
        order = self._order()
        if self._assignment is not None and order is not None and not self._applied:
            assign_stages(self.module, [m for _, m in order], self._assignment)
            self._applied = True

    def set_pipeline_stage_assignment(self, assignment: Sequence) -> None:
        """Put the k-th layer in call order on stage (IPU) ``assignment[k]``.

        ``assignment`` holds ints, or the objects of ``get_pipeline_stage_assignment()``
        with their ``pipeline_stage`` set. For a functional model whose call order is
        not known yet, the assignment is applied to the first batch ([Note: Keras layer
        order]).

        Raises:
            BlockError: the list's length differs from the number of layers, a stage
                is not an int >= 0, or the stages decrease.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> model = Sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
            >>> model.set_pipeline_stage_assignment([0, 1])
        """
        stages = [a.pipeline_stage if isinstance(a, PipelineStageAssignment) else a
                  for a in assignment]
        n = len(list(self.module.children()))
        if len(stages) != n:
            raise BlockError(f"the assignment has {len(stages)} entries for {n} layers; give "
                             f"one stage per layer")
        order = self._order()
        if order is not None:
            assign_stages(self.module, [m for _, m in order], stages)
        else:  # checked and applied at the first batch, in call order
            for k, s in enumerate(stages):
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise BlockError(f"assignment[{k}] is {s!r}; stages are non-negative ints")
        self._release()
        self._assignment, self._applied, self._stages = list(stages), order is not None, None
        self._layer_stages = None

    def reset_pipeline_stage_assignment(self) -> None:
        """Drop the stage assignment: the model is no longer pipelined by it.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).reset_pipeline_stage_assignment()
        """
        from ..annotations import removeBlocks
        removeBlocks(self.module)
        self._release()
        self._assignment, self._applied, self._stages, self._layer_stages = None, False, None, None

    def get_pipeline_stage_assignment(self) -> list:
        """The layers in post order (the order they run) with their pipeline stages.

        Each item has ``.layer`` and ``.pipeline_stage`` (None where no stage is set:
        no assignment and no ``PipelineStage`` scope seen in a trace).

        Raises:
            InputError: a functional model that has not run yet (its order is unknown).

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> model = Sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])
            >>> model.set_pipeline_stage_assignment([0, 1])
            >>> [a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
            [0, 1]
        """
        order = self._order()
        if order is None:
            raise InputError(f"{self.name} is not an nn.Sequential, so the order in which it "
                             f"calls its layers is read off one run: call the model once on a "
                             f"batch (model(x)), or fit/evaluate/predict, first")
        stages = self._stage_list(order)
        return [PipelineStageAssignment(m, s, name) for (name, m), s in zip(order, stages)]

    def _stage_list(self, order: list) -> list:
        if self._assignment is not None:
            return list(self._assignment)
        known = self._layer_stages or {}
        return [known.get(name) for name, _ in order]

    def print_pipeline_stage_assignment_summary(self, line_length=None, print_fn=None) -> None:
        """Print each layer (in the order they run), its type, stage and parameter count.

        The stages are the assignment's, or for a model with ``PipelineStage`` scopes
        the ones its trace found ("-" until the model has run).

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).print_pipeline_stage_assignment_summary()
            layer | type   | stage | parameters
            ------+--------+-------+-----------
            0     | Linear | 0     | 10
        """
        order = self._order() or list(self.module.named_children())
        if self._assignment is None and self._layer_stages is None and self._example is not None:
            self._trace_stages()
        stages = self._stage_list(order)
        if self._assignment is None and self._layer_stages is None:
            stages = [0 if isinstance(self.module, torch.nn.Sequential) else None] * len(order)
        rows = [(name, type(m).__name__, "-" if s is None else str(s),
                 f"{sum(p.numel() for p in m.parameters()):,}")
                for (name, m), s in zip(order, stages)]
        for line in table(("layer", "type", "stage", "parameters"), rows).splitlines():
            (print_fn or print)(line)

    def summary(self, line_length=None, print_fn=None) -> None:
        """Print the layers and their parameter counts, then the totals.

        Example:
            >>> from poptorch_lite.frontends.keras import Sequential
            >>> Sequential([torch.nn.Linear(4, 2)]).summary()
            Model: "Sequential"
            layer | type   | parameters
            ------+--------+-----------
            0     | Linear | 10
            Total params: 10
            Trainable params: 10
            Non-trainable params: 0
        """
        rows = [(name, type(m).__name__, f"{sum(p.numel() for p in m.parameters()):,}")
                for name, m in self.module.named_children()]
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.module.parameters() if not p.requires_grad) + sum(
            b.numel() for b in self.module.buffers() if b.is_floating_point())
        out = print_fn or print
        out(f'Model: "{self.name}"')
        for line in table(("layer", "type", "parameters"), rows).splitlines():
            out(line)
        out(f"Total params: {trainable + frozen:,}\nTrainable params: {trainable:,}\n"
            f"Non-trainable params: {frozen:,}")

    # -- a pass over data as executions of PopTorch wrappers: the checks made before anything
    # runs ([Note: Keras steps]), the one trace that finds the stages, a PopTorch wrapper per
    # kind and steps per execution, and the loop that runs a pass steps_per_execution steps
    # per call and keeps the running logs ([Note: Keras batch hooks]) -----------------------

    def _prepare(self, method: str, x, y, batch_size, steps, drop_remainder: bool,
                 steps_name: str = "steps", sample_weight=None) -> tuple:
        """The checks every method makes first: ``(data, replicas, steps per pass,
        steps per execution)``."""
        self._require_compiled(method != "predict")
        data = Data(x, y, _batch_size(batch_size), method != "predict", method, sample_weight)
        data.require_steps(steps, steps_name)
        if self._example is None:
            self._example = data.first(data.batch_size)[0]
        self._apply_assignment()
        R = self._ipu.replicas(self._num_stages(data))
        count, spe = self._plan(data, method, R, steps, drop_remainder, steps_name)
        return data, R, count, spe

    def _plan(self, data: Data, method: str, R: int, steps, drop_remainder: bool,
              steps_name: str) -> tuple:
        """Steps of one pass and the steps per execution for it ([Note: Keras steps])."""
        count = data.batches(R, steps, drop_remainder, steps_name)
        spe = self._spe
        if spe > count:  # to the steps of the pass, kept a multiple of G x replicas if it can
            unit = R * (self._ipu.G if method == "fit" else 1)
            cut = count - count % unit if count >= unit else count
            warn_once(f"keras.truncate.{data.what}.{spe}.{cut}",
                      f"{data.what}: steps_per_execution ({spe}) is larger than the {count} "
                      f"steps of this pass over the data; truncating it to {cut} for this "
                      f"call, as Keras does", PoptorchLiteWarning)
            spe = cut
        self._ipu.check(self._stages, spe, R, method == "fit")
        data.check_executions(count, spe, steps_name)
        return count, spe

    def _require_compiled(self, needs_loss: bool) -> None:
        if not self._compiled or (needs_loss and self._step.loss_fn is None):
            raise WrapError("You must compile your model with a loss before training/testing: "
                            "call model.compile(optimizer, loss=...)")

    def _num_stages(self, data: Data) -> int:
        """The stages of the model, from one trace of its first batch (once per assignment)."""
        if self._stages is None:
            x, y, w = data.first(data.batch_size)
            probe = inferenceModel(self._step if y is not None else self.module,
                                   Options().setExecutionStrategy(ShardedExecution()))
            probe.compile(*((x,) if y is None else (x, y) if w is None else (x, y, w)))
            self._stages = num_stages(probe)
            self._layer_stages = layer_stages(_last_program(probe).partition,
                                              "" if y is None else "net.", self.module)
            probe.destroy()
        return self._stages

    def _trace_stages(self) -> None:
        """The stages of the layers of a model with ``PipelineStage`` scopes, from one trace
        of the first batch it saw."""
        probe = inferenceModel(self.module, Options().setExecutionStrategy(ShardedExecution()))
        probe.compile(self._example)
        self._layer_stages = layer_stages(_last_program(probe).partition, "", self.module)
        probe.destroy()

    def _wrapper(self, kind: str, R: int, spe: int):
        """The PopTorch model for ``kind`` (train, evaluate, predict), wrapped once per
        steps per execution (see :meth:`_plan`)."""
        if (kind, spe) not in self._wrappers:
            module = self.module if kind == "predict" else self._step
            opts = self._ipu.options(kind, spe, R)
            with self._mode(kind):
                self._wrappers[(kind, spe)] = (
                    trainingModel(module, opts, self.optimizer) if kind == "train"
                    else inferenceModel(module, opts))
        return self._wrappers[(kind, spe)]

    @contextlib.contextmanager
    def _mode(self, kind: str):
        """The layers in Keras' training flag for ``kind`` (train mode for fit's steps, eval
        mode else) while a wrapper of that kind is made or runs, which reads the flags at
        each call ([Note: train and eval modes] in runtime/compiled); the user's after."""
        modes = {m: m.training for m in self.module.modules()}
        self.module.train(kind == "train")
        try:
            yield
        finally:
            for m, flag in modes.items():
                m.training = flag

    def _release(self) -> None:
        """Destroy the PopTorch models; the next call wraps again ([Note: Keras face])."""
        for wrapper in self._wrappers.values():
            wrapper.destroy()
        self._wrappers.clear()

    def _run(self, kind: str, wrapper, data: Data, order, count: int, spe: int, begin, end,
             verbose: int, desc: str, outputs: Optional[list] = None) -> dict:
        """Run ``count`` steps, ``spe`` per call, of ``wrapper`` (made for ``kind``); return
        the running logs."""
        with self._mode(kind):
            return self._steps(wrapper, data, order, count, spe, begin, end, verbose, desc,
                               outputs)

    def _steps(self, wrapper, data: Data, order, count: int, spe: int, begin, end,
               verbose: int, desc: str, outputs: Optional[list]) -> dict:
        b = data.batch_size
        running = RunningLogs(self._metrics or [] if outputs is None else [], outputs is None)
        bar = tqdm(total=count, desc=desc, unit="batch", disable=verbose != 1)
        for e, (xb, yb, wb) in enumerate(data.executions(order, spe, b, count)):
            first = e * spe
            if begin is not None and not self._async:
                begin(first)
            if outputs is not None:
                result = wrapper(xb)
                outputs.append(result)
            else:
                result = wrapper(xb, yb) if wb is None else wrapper(xb, yb, wb)
                y_pred, losses = result[0], result[1].reshape(-1)
            for j in range(spe):
                if outputs is None:
                    rows = slice(j * b, (j + 1) * b)
                    running.add(losses[j], y_pred[rows], yb[rows])
                if begin is not None and self._async:
                    begin(first + j)
                    end(first + j, running.logs())
            if begin is not None and not self._async:
                end(first + spe - 1, running.logs())
            bar.update(spe)
            bar.set_postfix_str(format_logs(running.logs()), refresh=False)
            if self.stop_training:
                break
        bar.close()
        return running.logs()


class Sequential(Model):
    """``keras.Sequential([layer, ...])`` of torch layers (an ``nn.Sequential`` inside).

    Example:
        >>> model = Sequential([torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)])
        >>> model.set_pipeline_stage_assignment([0, 0, 1])
    """

    def __init__(self, layers: Sequence[torch.nn.Module] = (), name: Optional[str] = None):
        for k, layer in enumerate(layers):
            if not isinstance(layer, torch.nn.Module):
                raise InputError(f"keras.Sequential: layer {k} is a {type(layer).__name__}, not "
                                 f"an nn.Module")
        super().__init__(torch.nn.Sequential(*layers), name or "Sequential")

    def add(self, layer: torch.nn.Module) -> None:
        """Append a layer. The stage assignment, if any, is dropped, and the model must be
        compiled again (its optimizer did not know the new layer's parameters).

        Example:
            >>> model = Sequential()
            >>> model.add(torch.nn.Linear(4, 2))
        """
        if not isinstance(layer, torch.nn.Module):
            raise InputError(f"keras.Sequential.add needs an nn.Module, got {type(layer).__name__}")
        self._release()
        removeBlocks(self.module)
        self.module.append(layer)
        self._assignment, self._applied, self._stages, self._layer_stages = None, False, None, None
        self._call_order = None
        self.optimizer = self._optimizer_spec = None
        self._compiled = False


def _same_spec(a, b) -> bool:
    """Whether two ``optimizer`` arguments of compile describe the same optimizer."""
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a is b or (type(a) is type(b) and a == b)  # keras.optimizers descriptions


def _loss_weight(loss_weights):
    """compile's ``loss_weights`` as one number (None: 1)."""
    w = loss_weights
    if isinstance(w, (list, tuple)) and len(w) == 1:
        w = w[0]
    if w is None or (isinstance(w, (int, float)) and not isinstance(w, bool)):
        return None if w is None or w == 1 else float(w)
    raise OptionsError(f"loss_weights={loss_weights!r}: a single-output model takes one number "
                       f"(or a list of one), e.g. loss_weights=0.5")


def _ipu_only(method: str, keywords: dict) -> None:
    """Accept IPU Keras' IPU-only keywords with one warning each; refuse any other."""
    for name, value in keywords.items():
        if name not in IPU_ONLY_KEYWORDS:
            raise OptionsError(f"{method}() got an unknown keyword {name!r}; its IPU-only "
                               f"keywords are {sorted(IPU_ONLY_KEYWORDS)}")
        if value is not None:
            warn_once(f"keras.{name}", f"{method}({name}=...) only tunes IPU memory or Poplar "
                      f"and has no effect in poptorch_lite; ignored")


class _TrainStep(torch.nn.Module):
    """The user's module followed by the compiled loss: ``forward(x, y) -> (y_pred, loss)``."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net
        self.loss_fn, self.loss_weight = None, None

    def forward(self, x, y, weight=None):
        y_pred = self.net(x)
        return y_pred, self.loss_fn(y_pred, y, weight, self.loss_weight)


def _batch_size(batch_size) -> int:
    return 32 if batch_size is None else check_positive_int(batch_size, "batch_size",
                                                             "fit(..., batch_size=32)")


def _pair(validation_data) -> tuple:
    if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
        return tuple(validation_data)
    return validation_data, None
