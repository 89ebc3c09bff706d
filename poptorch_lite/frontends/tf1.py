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
Two ways, decided by ``loss``:

* ``loss=None`` (TF1's way): the labels travel through the stages like any
  other value (``def stage1(x, labels): return h, labels``) and the last stage
  computes the loss: it returns the loss alone, or last in a tuple or list
  (``return logits, loss``), as TF1's ``optimizer_function`` receives it.
* ``loss=fn``: ``fn(outputs, labels)`` computes the loss from the last stage's
  outputs, on the last stage's IPU. A training call is then ``pipe(*inputs,
  labels)``: the last argument is the labels, the others go to the first stage.

Either way the loss must be a scalar tensor; it is marked with
``identity_loss(loss, "none")`` (no change to its value or gradient).
Inference (``pipe.inference(*inputs)``) gives every argument to the first stage
and returns the last stage's outputs.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from ..annotations import Block
from ..enums import OutputMode, PipelineSchedule, ReductionType
from ..errors import (InputError, LossError, OptimizerError, OptionsError, PipelineError,
                      WrapError)
from ..ops import identity_loss
from ..options import Options
from ..strategies import PipelinedExecution, Stage
from ..wrapper import inferenceModel, trainingModel


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


def _modules_of(stage) -> tuple:
    """The modules a stage computes with, and whether exactly those (not merely reachable).

    A module stage or a bound method of a module computes with that module; a
    function may use only part of the modules its closure and globals reach (a
    global ``model`` whose layers several stages share out).
    """
    if isinstance(stage, torch.nn.Module):
        return [stage], True
    owner = getattr(stage, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return [owner], True
    found = []
    try:
        refs = inspect.getclosurevars(stage)
        values = list(refs.nonlocals.values()) + list(refs.globals.values())
    except TypeError:  # a builtin or a callable object: nothing to inspect
        values = [vars(stage)] if hasattr(stage, "__dict__") else []
    for v in values:
        items = list(v.values()) if isinstance(v, dict) else (
            list(v) if isinstance(v, (list, tuple)) else [v])
        found += [m for m in items if isinstance(m, torch.nn.Module)]
    return found, False


class _StageModel(torch.nn.Module):
    """The computational stages as one module: stage k in ``Block("stage<k>")`` on its IPU.

    ``training`` containers return ``(last stage's outputs, loss)``; see
    [Note: TF1 loss and labels] for where the loss and labels come from.
    """

    def __init__(self, stages, owned: dict, mapping, loss, training: bool):
        super().__init__()
        for name, module in owned.items():
            self.add_module(name, module)
        if isinstance(loss, torch.nn.Module):  # a loss module (nn.CrossEntropyLoss()) is a layer
            self.add_module("loss", loss)
        self._stages, self._mapping, self._with_loss = stages, mapping, training
        object.__setattr__(self, "_loss", loss)  # not registered a second time

    def forward(self, *inputs):
        labels = None
        if self._with_loss and self._loss is not None:
            if len(inputs) < 2:
                raise InputError(f"with loss=..., a training call takes the first stage's inputs "
                                 f"and then the labels, pipe(*inputs, labels); got {len(inputs)} "
                                 f"argument(s)")
            *inputs, labels = inputs
        values, last = tuple(inputs), len(self._stages) - 1
        for k, stage in enumerate(self._stages):
            with Block(f"stage{k}", ipu_id=self._mapping[k]):
                values = _call(stage, values)
                if k == last and self._with_loss:
                    return values, _mark_loss(self._loss(values, labels) if self._loss else (
                        values[-1] if isinstance(values, (tuple, list)) and values else values))
        return values


def _call(stage, values):
    """Stage k+1 of stage k's outputs: a tuple or list unpacks, a dict gives keywords."""
    if isinstance(values, dict):
        return stage(**values)
    if isinstance(values, (tuple, list)):
        return stage(*values)
    return stage(values)


def _mark_loss(loss):
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"{type(loss).__name__} {loss!r}"
        raise LossError(f"the pipeline's loss must be a scalar tensor, got {got}; with loss=None "
                        f"the last stage returns the loss alone or last in a tuple (return logits, "
                        f"loss), with loss=fn fn(outputs, labels) returns it; reduce it with "
                        f".mean() or .sum()")
    return identity_loss(loss, reduction="none")


class Pipeline:
    """What :func:`pipeline` returns: call it to train, ``inference(...)`` to predict.

    Attributes:
        model: the ``nn.Module`` that holds every stage's modules (its
            ``state_dict()``, ``parameters()``).
        options: the training options (``poptorch_lite.DataLoader(pipe.options,
            dataset, batch_size=b)`` yields one call's combined batch).
        training_model: the ``trainingModel`` (None without an optimizer);
            ``runStatistics()``, ``setOptimizer`` and the rest of PopTorch's API.
        inference_model: the ``inferenceModel``.
    """

    def __init__(self, stages, owned, mapping, loss, optimizer, strategy, base: Options,
                 repeat_count: int, G: int, outfeed_loss: bool, reduction):
        self._repeat_count, self._G, self._S = repeat_count, G, _runs(mapping)
        self._outfeed_loss = outfeed_loss
        self._schedule = strategy.schedule
        self.model = _StageModel(stages, owned, mapping, loss, True)
        self._predictor = _StageModel(stages, owned, mapping, loss, False)
        self.options = base.clone().deviceIterations(repeat_count).setExecutionStrategy(strategy)
        self.options.Training.gradientAccumulation(G)
        self.options.Training.accumulationAndReplicationReductionType(reduction)
        self.options.outputMode(OutputMode.All)
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(self.model.parameters())
        self.training_model = None if optimizer is None else trainingModel(
            self.model, self.options, optimizer)
        infer = base.clone().deviceIterations(repeat_count * G).setExecutionStrategy(strategy)
        infer.Training.gradientAccumulation(1)  # an inference model accumulates nothing
        self.inference_model = inferenceModel(self._predictor, infer.outputMode(OutputMode.All))

    def __call__(self, *inputs):
        """Train on ``repeat_count x G`` micro-batches: ``repeat_count`` optimizer steps.

        Args:
            *inputs: the first stage's inputs (then the labels when ``loss`` is a
                function), each with ``micro-batch x G x repeat_count`` rows.

        Returns:
            The outfeed: with ``outfeed_loss`` the loss of every micro-batch, shape
            ``(repeat_count * G,)`` in order (``.view(repeat_count, G)`` per step;
            ``× replicas`` with a base ``options.replicationFactor``);
            otherwise the last stage's outputs, every micro-batch's concatenated
            along dim 0 (scalars stacked), as PopTorch's ``OutputMode.All``.

        Raises:
            WrapError: the pipeline has no optimizer.
        """
        if self.training_model is None:
            raise WrapError("this pipeline has no optimizer, so it cannot train: pass "
                            "optimizer=... to poptorch_lite.pipeline(), or call "
                            "pipe.inference(*inputs) to run it forward only")
        outputs, losses = self.training_model(*inputs)
        return losses if self._outfeed_loss else outputs

    def inference(self, *inputs):
        """Run the stages forward on ``repeat_count x G`` micro-batches, without an optimizer.

        Every argument goes to the first stage. Returns the last stage's outputs,
        every micro-batch's concatenated along dim 0 (scalars stacked).

        Raises:
            PipelineError: fewer micro-batches per call than pipeline stages.
        """
        D, S = self._repeat_count * self._G, self._S
        if self._schedule is not PipelineSchedule.Sequential and S > 1 and D < S:
            raise PipelineError(
                f"an inference pipeline of {S} stages needs at least {S} micro-batches per call "
                f"to fill, but repeat_count x gradient_accumulation_count = {self._repeat_count} x "
                f"{self._G} = {D}; raise repeat_count to {-(-S // self._G)} or more")
        return self.inference_model(*inputs)

    def destroy(self) -> None:
        """Release both wrapped models (the stages' modules keep their trained weights)."""
        if self.training_model is not None:
            self.training_model.destroy()
        self.inference_model.destroy()


def pipeline(computational_stages: Sequence, gradient_accumulation_count: int,
             repeat_count: int = 1, optimizer=None, loss: Optional[Callable] = None,
             pipeline_schedule=PipelineSchedule.Grouped, device_mapping=None,
             recomputation_mode=None, outfeed_loss: bool = True,
             reduction_method=ReductionType.Mean, options: Optional[Options] = None) -> Pipeline:
    """TF1's ``pipelining_ops.pipeline`` on torch: a list of stages, pipelined over IPUs.

    Args:
        computational_stages: ``nn.Module``s or functions; stage k+1 takes stage
            k's outputs (a tuple unpacks into its arguments, a dict into keywords).
            A function's parameters must belong to modules it reaches: itself as a
            bound method, or modules (or lists of them) in its closure or globals.
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
            stage's outputs (False).
        reduction_method: ``ReductionType.Mean`` (PopTorch's default) or ``Sum``
            (TF1's default) over the G micro-batches of a step.
        options: base ``Options`` (devices, seeds, replication), cloned; the
            pipeline sets device iterations, accumulation, strategy and output mode.

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
    if optimizer is not None and schedule is not PipelineSchedule.Sequential and n > 1 \
            and G < 2 * n - 1:
        raise PipelineError(
            f"gradient_accumulation_count({G}) is too small for the {schedule.name} schedule of "
            f"{n} pipeline stages: it needs at least {2 * n - 1} (2 x stages - 1); pass "
            f"gradient_accumulation_count={2 * n - 1} or more, or "
            f"pipeline_schedule=PipelineSchedule.Sequential")
    owned = _owned_modules(stages, mapping)
    if isinstance(optimizer, torch.optim.Optimizer):
        held = {id(p) for m in owned.values() for p in m.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in held:
                    raise OptimizerError(
                        f"the optimizer trains a parameter of shape {tuple(p.shape)} that no "
                        f"stage holds: a function stage reaches its modules only as a bound "
                        f"method or through its closure or globals; make the stage an nn.Module "
                        f"(or a method of one) that owns the layer")
    strategy = PipelinedExecution(*[Stage(f"stage{k}").ipu(mapping[k]).recompute(recompute[k])
                                    for k in range(S)], schedule=schedule)
    return Pipeline(list(stages), owned, mapping, loss, optimizer, strategy,
                    Options() if options is None else options, repeat_count, G, outfeed_loss,
                    reduction_method)


def _owned_modules(stages, mapping) -> dict:
    """Every module the stages use, once, named ``stage<k>`` or ``stage<k>_<j>``.

    Raises:
        OptionsError: two stages on different IPUs share a parameter (TF1: stages
            that share variables must be placed on the same IPU); checked for
            module stages and bound methods, whose modules are known to be used.
    """
    owned, seen, home = {}, set(), {}
    for k, stage in enumerate(stages):
        modules, exact = _modules_of(stage)
        for j, m in enumerate(modules):
            for p in (m.parameters() if exact else ()):
                s = home.setdefault(id(p), k)
                if mapping[s] != mapping[k]:
                    raise OptionsError(
                        f"stages {s} and {k} share a parameter of shape {tuple(p.shape)} but "
                        f"device_mapping puts them on IPUs {mapping[s]} and {mapping[k]}; map "
                        f"stages that share parameters to one IPU, as TF1 requires")
            if id(m) in seen:
                continue
            seen.update(id(sub) for sub in m.modules())
            owned[f"stage{k}" if isinstance(stage, torch.nn.Module) else f"stage{k}_{j}"] = m
    return owned
