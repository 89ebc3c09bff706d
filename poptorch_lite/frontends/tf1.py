"""The TF1 face: a pipeline of stage functions (``poptorch_lite.pipeline``).

Graphcore's TF1 tutorial pipelines a model written as a list of stage
functions: the outputs of stage k are the inputs of stage k+1, one call runs
``repeat_count x gradient_accumulation_count`` micro-batches, and the losses
come back through an outfeed. :func:`pipeline` gives that workflow on torch
modules and functions. It builds nothing of its own to run them: the stages
become one ``nn.Module`` whose stage k runs inside ``Block("stage<k>",
ipu_id=device_mapping[k])``, wrapped by ``trainingModel`` / ``inferenceModel``
with ``PipelinedExecution(Stage("stage0").ipu(..), ...)``,
``deviceIterations(repeat_count)`` and ``gradientAccumulation(G)``. The
numbers are therefore the PopTorch face's, and plain PyTorch's.

[Note: TF1 loss and labels]
Three ways, decided by ``loss`` and ``optimizer_function``:

* ``loss=None`` (TF1's way): the labels travel through the stages like any
  other value (``def stage1(x, labels): return h, labels``) and the last stage
  computes the loss: it returns the loss alone, or last in a tuple or list
  (``return logits, loss``), as TF1's ``optimizer_function`` receives it.
* ``loss=fn``: ``fn(outputs, labels)`` computes the loss from the last stage's
  outputs, on the last stage's IPU. A training call is then ``pipe(*inputs,
  labels)``: the last argument is the labels, the others go to the first stage.
* ``optimizer_function=fn`` (the TF1 tutorial's way): ``fn(*last stage's
  outputs)`` returns ``OptimizerFunctionOutput(optimizer, loss)``; its loss is
  the loss, and its optimizer (read once, from the dry run of [Note: TF1 stage
  modules]) trains the stages' parameters.

TF1's ``inputs=[learning_rate]`` go to the first stage ahead of each call's
arguments, as ``stage1(learning_rate, images, labels)`` receives them; they are
fixed when the pipeline is made (a Python number is a constant of the traced
graph; to change the learning rate, set the optimizer's ``param_groups``). With
``outfeed_loss=False`` (TF1's default) a training call returns the last stage's
outputs, with True the losses.

Either way the loss must be a scalar tensor; it is marked with
``identity_loss(loss, "none")`` (no change to its value or gradient).
Inference (``pipe.inference(*inputs)``) gives every argument to the first stage
and returns the last stage's outputs.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..enums import OutputMode, PipelineSchedule, ReductionType
from ..errors import (InputError, OptimizerError, OptionsError, PipelineError, PoptorchLiteWarning,
                      WrapError, warn_once)
from ..options.options import Options
from ..strategies import PipelinedExecution, Stage
from ..wrap import inferenceModel, trainingModel
from .tf1_feeds import IPUInfeedQueue, IPUOutfeedQueue
from .tf1_stages import (StageModel, all_exact, called_modules, check_optimizer_params,
                         optimizer_output, owned_modules)


def _positive(value, name: str, example: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionsError(f"{name} must be a positive int, got {value!r}; pass e.g. "
                           f"{name}={example}")
    return value


def _mapping(device_mapping, S: int) -> list:
    """``device_mapping`` checked: one IPU id per stage (default: stage k on IPU k)."""
    if device_mapping is None:
        return list(range(S))
    if not isinstance(device_mapping, (list, tuple)) or len(device_mapping) != S:
        n = len(device_mapping) if isinstance(device_mapping, (list, tuple)) else device_mapping
        raise OptionsError(f"device_mapping has {n!r} entries for {S} computational stages; give "
                           f"one IPU id per stage, e.g. device_mapping={list(range(S))}")
    for k, ipu in enumerate(device_mapping):
        if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
            raise OptionsError(f"device_mapping[{k}] is {ipu!r}; IPU ids are non-negative ints, "
                               f"e.g. device_mapping={list(range(S))}")
    return list(device_mapping)


def _recompute_flags(mode, S: int) -> list:
    """One bool per stage from ``recomputation_mode`` (see :func:`pipeline`)."""
    if mode is None or mode is False:
        return [False] * S
    if mode is True:
        return [True] * S
    if isinstance(mode, (list, tuple)) and len(mode) == S and all(
            isinstance(r, bool) for r in mode):
        return list(mode)
    name = getattr(mode, "name", mode)  # an enum member of TF1's RecomputationMode, or its name
    if isinstance(name, str) and name.lower() in _RECOMPUTATION_MODES:
        return [True] * S
    raise OptionsError(f"recomputation_mode {mode!r} is not one of None, True, False, "
                       f"{sorted(_RECOMPUTATION_MODES)} or a list of {S} bools (one per stage); "
                       f"pass e.g. recomputation_mode='Auto' to recompute every stage")


# TF1's RecomputationMode names: all of them recompute every stage's forward in its backward.
_RECOMPUTATION_MODES = {"auto", "recomputethenbackpropagate",
                        "recomputeandbackpropagateinterleaved"}


def _runs(mapping: Sequence[int]) -> int:
    """Pipeline stages the engine sees: consecutive stages on one IPU run as one."""
    return sum(1 for k, ipu in enumerate(mapping) if k == 0 or ipu != mapping[k - 1])


class Pipeline:
    """What :func:`pipeline` returns: call it to train, ``inference(...)`` to predict.

    The PopTorch models are made once the stages' modules are known ([Note: TF1
    stage modules]): at once when every stage is a module or a bound method of one
    (or an ``infeed_queue`` gives a first micro-batch), otherwise at the first call
    (or ``compile``), after the stages ran once on its first micro-batch.

    Attributes:
        model: the ``nn.Module`` that holds every stage's modules (its
            ``state_dict()``, ``parameters()``).
        options: the training options (``poptorch_lite.DataLoader(pipe.options,
            dataset, batch_size=b)`` yields one call's combined batch).
        training_model: the ``trainingModel`` (None without an optimizer, or
            before the models are made).
        inference_model: the ``inferenceModel`` (None before the models are made).
        name: TF1's ``name`` (only kept).
    """

    def __init__(self, stages, mapping, loss, optimizer, optimizer_function, strategy,
                 base: Options, repeat_count: int, G: int, outfeed_loss: bool, reduction,
                 prefix, infeed, outfeed, name):
        self._stages, self._mapping, self._loss = stages, mapping, loss
        self._repeat_count, self._G, self._S = repeat_count, G, _runs(mapping)
        self._outfeed_loss, self._schedule = outfeed_loss, strategy.schedule
        self._optimizer, self._optimizer_function = optimizer, optimizer_function
        self._infeed, self._outfeed, self.name = infeed, outfeed, name
        self.model = StageModel(stages, mapping, loss, True, prefix, optimizer_function)
        self._predictor = StageModel(stages, mapping, loss, False, prefix)
        self.options = base.clone().deviceIterations(repeat_count).setExecutionStrategy(strategy)
        self.options.Training.gradientAccumulation(G)
        self.options.Training.accumulationAndReplicationReductionType(reduction)
        self.options.outputMode(OutputMode.All)
        self._infer = base.clone().deviceIterations(repeat_count * G).setExecutionStrategy(
            strategy)
        self._infer.Training.gradientAccumulation(1)  # an inference model accumulates nothing
        self._infer.outputMode(OutputMode.All)
        self.training_model = self.inference_model = None
        self._built = False
        if all_exact(stages) and optimizer_function is None:
            self._build(None, None)
        elif infeed is not None:
            self._discover(self._feed_inputs(peek=True))  # one micro-batch already

    # -- making the PopTorch models -------------------------------------------------------

    def _micro_batch(self, inputs: tuple) -> tuple:
        """The first micro-batch of one call's arguments (first rows of each tensor)."""
        n = self.options.replication_factor * self._repeat_count * self._G
        return tuple(v[:max(1, len(v) // n)] if isinstance(v, torch.Tensor) and v.dim() else v
                     for v in inputs)

    def _feed_inputs(self, peek: bool = False) -> tuple:
        if peek:
            item = self._infeed.peek()
            return (item,) if isinstance(item, torch.Tensor) else tuple(item)
        n = self.options.replication_factor * self._repeat_count * self._G
        return self._infeed.take(n)

    def _discover(self, inputs: tuple) -> None:
        """Run the stages once on a micro-batch ([Note: dry run]) and make the models."""
        values, labels = self.model.split(inputs)
        tail = None
        if self._optimizer_function is not None:
            tail = lambda out: optimizer_output(self._optimizer_function, out)  # noqa: E731
        elif self._loss is not None:
            tail = lambda out: self._loss(out, labels)  # noqa: E731
        called, result = called_modules(self._stages, values, tail)
        optimizer = result.optimizer if self._optimizer_function is not None else None
        self._build(called, optimizer)

    def _build(self, called, optimizer) -> None:
        owned = owned_modules(self._stages, self._mapping, called)
        optimizer = self._optimizer if optimizer is None else optimizer
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise OptimizerError(f"the optimizer of the OptimizerFunctionOutput is "
                                     f"{type(optimizer).__name__}, not a torch optimizer or a "
                                     f"function from parameters to one")
        self.model.own(owned)  # our own containers: nothing of the user's changes here
        self._predictor.own(owned)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not any(True for _ in self.model.parameters()):
                raise OptimizerError("the stages use no parameters, so the optimizer has nothing "
                                     "to train: no stage is, or calls, a module with parameters; "
                                     "call the layers as modules in the stages (layer(x))")
            optimizer = optimizer(self.model.parameters())
        if optimizer is not None:
            check_optimizer_params(optimizer, owned)
        self.training_model = None if optimizer is None else trainingModel(
            self.model, self.options, optimizer)
        self.inference_model = inferenceModel(self._predictor, self._infer)
        self._built = True

    def compile(self, *inputs) -> None:
        """Make the models (running the stages once if needed) and compile the training
        model for ``inputs`` (TF1's ``ipu_compiler.compile``), without training.

        Example:
            >>> pipe.compile(images, labels)  # doctest: +SKIP
        """
        if not self._built:
            self._discover(self._micro_batch(inputs))
        (self.training_model or self.inference_model).compile(*inputs)

    # -- running ---------------------------------------------------------------------------

    def __call__(self, *inputs):
        """Train on ``repeat_count x G`` micro-batches: ``repeat_count`` optimizer steps.

        Args:
            *inputs: the first stage's inputs (then the labels when ``loss`` is a
                function), each with ``micro-batch x G x repeat_count`` rows; none
                with an ``infeed_queue``, which gives them ([Note: TF1 feeds]).

        Returns:
            The outfeed (also enqueued on the ``outfeed_queue``, if any): with
            ``outfeed_loss`` the loss of every micro-batch, shape
            ``(repeat_count * G,)`` in order (``× replicas`` with a base
            ``options.replicationFactor``); otherwise the last stage's outputs,
            every micro-batch's concatenated along dim 0 (scalars stacked), as
            PopTorch's ``OutputMode.All``.

        Raises:
            WrapError: the pipeline has no optimizer.
        """
        if self._optimizer is None and self._optimizer_function is None:
            raise WrapError("this pipeline has no optimizer, so it cannot train: pass "
                            "optimizer=... (or optimizer_function=...) to "
                            "poptorch_lite.pipeline(), or call pipe.inference(*inputs) to run "
                            "it forward only")
        if not inputs and self._infeed is not None:
            inputs = self._feed_inputs()
        if not self._built:
            self._discover(self._micro_batch(inputs))
        outputs, losses = self.training_model(*inputs)
        result = losses if self._outfeed_loss else outputs
        if self._outfeed is not None:
            self._outfeed.enqueue(result)
        return result

    def inference(self, *inputs):
        """Run the stages forward on ``repeat_count x G`` micro-batches, without an optimizer.

        Every argument goes to the first stage (after TF1's ``inputs``). Returns the
        last stage's outputs, every micro-batch's concatenated along dim 0 (scalars
        stacked).

        Raises:
            PipelineError: fewer micro-batches per call than pipeline stages.
        """
        D, S = self._repeat_count * self._G, self._S
        if self._schedule is not PipelineSchedule.Sequential and S > 1 and D < S:
            raise PipelineError(
                f"an inference pipeline of {S} stages needs at least {S} micro-batches per call "
                f"to fill, but repeat_count x gradient_accumulation_count = {self._repeat_count} x "
                f"{self._G} = {D}; raise repeat_count to {-(-S // self._G)} or more")
        if not inputs and self._infeed is not None:
            inputs = self._feed_inputs()
        if not self._built:
            first = self._micro_batch(inputs)
            if self._optimizer_function is not None:
                self._discover(first)
            else:
                values, _ = self._predictor.split(first)
                self._build(called_modules(self._stages, values)[0], None)
        return self.inference_model(*inputs)

    def destroy(self) -> None:
        """Release both wrapped models (the stages' modules keep their trained weights)."""
        if self.training_model is not None:
            self.training_model.destroy()
        if self.inference_model is not None:
            self.inference_model.destroy()


def pipeline(computational_stages: Sequence, gradient_accumulation_count: int,
             repeat_count: int = 1, optimizer=None, loss: Optional[Callable] = None,
             pipeline_schedule=PipelineSchedule.Grouped, device_mapping=None,
             recomputation_mode=None, outfeed_loss: bool = False,
             reduction_method=ReductionType.Mean, options: Optional[Options] = None, *,
             optimizer_function: Optional[Callable] = None, inputs: Sequence = (),
             infeed_queue=None, outfeed_queue=None, name: Optional[str] = None,
             gradient_accumulation_dtype=None) -> Pipeline:
    """TF1's ``pipelining_ops.pipeline`` on torch: a list of stages, pipelined over IPUs.

    Args:
        computational_stages: ``nn.Module``s or functions; stage k+1 takes stage
            k's outputs (a tuple unpacks into its arguments, a dict into keywords).
            A function stage's modules are the modules it calls, however it reaches
            them ([Note: TF1 stage modules]).
        gradient_accumulation_count: G, micro-batches per optimizer step (each
            stage runs G times per step). Pipelined schedules need G >= 2S-1 for S
            pipeline stages (consecutive stages on one IPU count as one).
        repeat_count: optimizer steps per call (PopTorch's ``deviceIterations``).
        optimizer: a ``torch.optim`` / ``poptorch_lite.optim`` optimizer, or a
            function from parameters to one (TF1's ``optimizer_function``); None
            builds an inference-only pipeline.
        loss: None (the last stage returns the loss) or ``fn(outputs, labels)``;
            see [Note: TF1 loss and labels].
        pipeline_schedule: a ``PipelineSchedule`` or its name (default Grouped, as TF1).
        device_mapping: the IPU of each stage (default stage k on IPU k); stages
            may share an IPU, and must where they share parameters.
        recomputation_mode: None or False (keep activations); True or a TF1
            ``RecomputationMode`` name (``"Auto"``, ...) recomputes every stage's
            forward in its backward; or a list of one bool per stage.
        outfeed_loss: a training call returns the losses (True) or the last
            stage's outputs (False, TF1's default).
        reduction_method: ``ReductionType.Mean`` (PopTorch's default) or ``Sum``
            (TF1's default) over the G micro-batches of a step.
        options: base ``Options`` (devices, seeds, replication), cloned; the
            pipeline sets device iterations, accumulation, strategy and output mode.
        optimizer_function: TF1's: a function of the last stage's outputs returning
            ``OptimizerFunctionOutput(optimizer, loss)`` (instead of ``optimizer``
            and ``loss``); see [Note: TF1 loss and labels].
        inputs: values given to the first stage ahead of each call's arguments
            (TF1's ``inputs=[learning_rate]``): Python numbers (or 0-dim tensors, read
            as numbers) and other non-tensor values.
        infeed_queue, outfeed_queue: TF1's feeds ([Note: TF1 feeds]): a call with
            no arguments takes its micro-batches from the infeed, and each call's
            result is enqueued on the outfeed.
        name: TF1's name of the pipeline (kept as ``pipe.name``).
        gradient_accumulation_dtype: None or torch.float32; another dtype is
            accepted with one warning and ignored (give a ``poptorch_lite.optim``
            optimizer ``accum_type=...`` for another accumulator).

    Returns:
        A :class:`Pipeline`.

    Raises:
        OptionsError, InputError, PipelineError, OptimizerError: refused before
            anything is wrapped or changed (docs/ERRORS.md, E-TF-*).

    Example:
        >>> import torch
        >>> dense = torch.nn.Linear(4, 4)
        >>> def stage2(h, labels):
        ...     return torch.nn.functional.cross_entropy(h, labels)
        >>> pipe = pipeline([lambda x, y: (dense(x), y), stage2], gradient_accumulation_count=4,
        ...                 repeat_count=2, optimizer=torch.optim.SGD(dense.parameters(), lr=0.1))
        >>> pipe(torch.randn(16, 4), torch.randint(0, 4, (16,))).shape
        torch.Size([8])
    """
    stages = computational_stages
    if not isinstance(stages, (list, tuple)) or not stages:
        raise OptionsError(f"computational_stages must be a non-empty list of nn.Modules or "
                           f"functions, got {stages!r}; pass e.g. computational_stages=[stage1, "
                           f"stage2]")
    for k, stage in enumerate(stages):
        if not callable(stage):
            raise InputError(f"computational_stages[{k}] is {type(stage).__name__} {stage!r}, not "
                             f"an nn.Module or a function; pass a callable of the previous "
                             f"stage's outputs")
    S = len(stages)
    G = _positive(gradient_accumulation_count, "gradient_accumulation_count", 8)
    _positive(repeat_count, "repeat_count", 10)
    schedule = PipelineSchedule.parse(pipeline_schedule)
    mapping = _mapping(device_mapping, S)
    recompute = _recompute_flags(recomputation_mode, S)
    if not isinstance(outfeed_loss, bool):
        raise OptionsError(f"outfeed_loss needs a bool, got {outfeed_loss!r}; pass True for the "
                           f"losses or False for the last stage's outputs")
    if loss is not None and not callable(loss):
        raise InputError(f"loss must be None or a function of (outputs, labels), got "
                         f"{type(loss).__name__} {loss!r}")
    if optimizer is not None and not callable(optimizer) and not isinstance(
            optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"optimizer must be a torch.optim.Optimizer or a function from "
                             f"parameters to one, got {type(optimizer).__name__}; pass e.g. "
                             f"optimizer=lambda params: torch.optim.SGD(params, lr=0.01)")
    n = _runs(mapping)
    if optimizer_function is not None and (optimizer is not None or loss is not None):
        raise OptionsError("optimizer_function gives both the optimizer and the loss: pass it "
                           "alone, without optimizer= or loss=")
    if optimizer_function is not None and not callable(optimizer_function):
        raise OptionsError(f"optimizer_function must be a function of the last stage's outputs "
                           f"returning OptimizerFunctionOutput(optimizer, loss), got "
                           f"{type(optimizer_function).__name__}")
    if not isinstance(inputs, (list, tuple)):
        raise OptionsError(f"inputs must be a list of values given to the first stage ahead of "
                           f"each call's arguments (TF1's inputs=[learning_rate]), got "
                           f"{type(inputs).__name__}")
    inputs = [v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v for v in inputs]
    for k, v in enumerate(inputs):
        if isinstance(v, torch.Tensor):
            raise OptionsError(f"inputs[{k}] is a tensor of shape {tuple(v.shape)}; TF1's inputs "
                               f"are constants of each call: pass a Python number (a 0-dim "
                               f"tensor is read as one), or let the stage reach the tensor "
                               f"through its closure")
    if infeed_queue is not None and not isinstance(infeed_queue, IPUInfeedQueue):
        infeed_queue = IPUInfeedQueue(infeed_queue)
    if outfeed_queue is not None and not isinstance(outfeed_queue, IPUOutfeedQueue):
        raise OptionsError(f"outfeed_queue must be a poptorch_lite.IPUOutfeedQueue, got "
                           f"{type(outfeed_queue).__name__}")
    if gradient_accumulation_dtype not in (None, torch.float32):
        warn_once("pipeline.gradient_accumulation_dtype",
                  "pipeline(gradient_accumulation_dtype=...) is ignored: gradients accumulate in "
                  "the parameters' dtype (for another accumulator, give a poptorch_lite.optim "
                  "optimizer accum_type=...)", PoptorchLiteWarning)
    training = optimizer is not None or optimizer_function is not None
    if training and schedule in (PipelineSchedule.Grouped, PipelineSchedule.Interleaved) \
            and n > 1 and G < 2 * n - 1:  # IPU TF's own pipelines; as check_pipeline_minimums
        raise PipelineError(
            f"gradient_accumulation_count({G}) is too small for the {schedule.name} schedule of "
            f"{n} pipeline stages: it needs at least {2 * n - 1} (2 x stages - 1); pass "
            f"gradient_accumulation_count={2 * n - 1} or more, or "
            f"pipeline_schedule=PipelineSchedule.Sequential")
    strategy = PipelinedExecution(*[Stage(f"stage{k}").ipu(mapping[k]).recompute(recompute[k])
                                    for k in range(S)], schedule=schedule)
    return Pipeline(list(stages), mapping, loss, optimizer, optimizer_function, strategy,
                    Options() if options is None else options, repeat_count, G, outfeed_loss,
                    reduction_method, list(inputs), infeed_queue, outfeed_queue, name)
