"""The TF1 pipeline's stages as one module: which modules each stage uses, and its forward.

[Note: TF1 stage modules]
A stage is an ``nn.Module``, a bound method of one, or a function. A function
stage may reach its layers any way Python allows: layer functions it calls
(the TF1 tutorial's ``layer2_dense256``), globals, closures, attributes of
objects, a list its ``make_pipeline_stage`` closure was built from. Its
modules are therefore found by what it actually calls: the stages run on the
first micro-batch under a module-call hook ([Note: dry run] in ``dry_run``,
which changes no state), and every module a stage calls (the outermost ones)
is registered in the pipeline's module. Each stage runs twice, so that a stage
making new modules on every run (TF1's ``layers.Dense(256)(x)`` translated
word for word) is refused: its weights would never train. The modules a function
reaches directly through its closure and globals are registered too (a
parameter used without calling its module, ``F.linear(x, layer.weight)``, is
still trained). Module stages and bound methods are known without running.
"""

from __future__ import annotations

import inspect

import torch

from ..annotations import Block
from ..errors import InputError, LossError, OptimizerError, OptionsError
from ..ops import identity_loss
from .dry_run import module_calls, outermost
from .tf1_feeds import OptimizerFunctionOutput


def modules_of(stage) -> tuple:
    """The modules a stage computes with, and whether exactly those (not merely reachable).

    A module stage or a bound method of a module computes with that module; a
    function may use only part of the modules its closure and globals reach (a
    global ``model`` whose layers several stages share out).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> modules_of(layer) == ([layer], True)
        True
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


def all_exact(stages) -> bool:
    """Whether every stage is a module or a bound method of one (no dry run needed)."""
    return all(modules_of(stage)[1] for stage in stages)


def called_modules(stages, values, tail=None) -> tuple:
    """Run the stages on ``values`` ([Note: dry run]); the modules each one calls.

    Each stage runs twice, to refuse a stage that makes new modules on each run
    (a literal translation of TF1's ``layers.Dense(256)(x)``), whose weights
    would never train.

    Args:
        stages: the computational stages.
        values: the first stage's arguments (one micro-batch).
        tail: None, or a function of the last stage's outputs run after it (the
            loss or TF1's ``optimizer_function``), its calls counted in the last stage.

    Returns:
        ``(per_stage, tail_result)``: for each stage, the outermost modules it calls,
        in the order of their first call; and what ``tail`` returned.

    Raises:
        OptionsError: a stage makes new modules each time it runs.
    """
    per_stage, result = [], None
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1

        def run(v, stage=stage, last=last):
            out = call(stage, v)
            return (out, tail(out)) if last and tail is not None else (out, None)
        (out, result), calls = module_calls(run, values)
        _, again = module_calls(run, values)  # the first run's modules are still alive here
        if len(calls) != len(again) or any(a is not b for (a, _), (b, _) in zip(calls, again)):
            fresh = next((type(b).__name__ for (a, _), (b, _) in zip(calls, again)
                          if a is not b), "a module")
            raise OptionsError(f"stage {k} makes new modules each time it runs ({fresh} is a "
                               f"new object on the second run), so their weights would never "
                               f"train: create the layers once, outside the stage function "
                               f"(TF1's layers.Dense(...) inside it becomes a torch module made "
                               f"beforehand, e.g. a global or an attribute of an object)")
        per_stage.append(outermost(calls))
        values = out
    return per_stage, result


def owned_modules(stages, mapping, called=None) -> dict:
    """Every module the stages use, once, named ``stage<k>`` or ``stage<k>_<j>``.

    Args:
        stages, mapping: the stages and their IPUs.
        called: per stage, the modules its dry run called (None: not run; module
            stages and bound methods only).

    Raises:
        OptionsError: two stages on different IPUs use one parameter (TF1: stages
            that share variables must be placed on the same IPU); checked for the
            modules a stage is known to use (its own, or the ones its run called).
    """
    owned, seen, home = {}, set(), {}
    for k, stage in enumerate(stages):
        modules, exact = modules_of(stage)
        used = modules if exact else list(called[k]) if called is not None else []
        for m in used:
            for p in m.parameters():
                s = home.setdefault(id(p), k)
                if mapping[s] != mapping[k]:
                    raise OptionsError(
                        f"stages {s} and {k} share a parameter of shape {tuple(p.shape)} but "
                        f"device_mapping puts them on IPUs {mapping[s]} and {mapping[k]}; map "
                        f"stages that share parameters to one IPU, as TF1 requires")
        j = 0
        for m in modules + ([] if exact else used):
            if id(m) in seen:
                continue
            seen.update(id(sub) for sub in m.modules())
            owned[f"stage{k}" if isinstance(stage, torch.nn.Module) else f"stage{k}_{j}"] = m
            j += 1
    return owned


def check_optimizer_params(optimizer, owned: dict) -> None:
    """Refuse an optimizer that trains a parameter no stage uses (E-TF-11)."""
    held = {id(p) for m in owned.values() for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in held:
                raise OptimizerError(
                    f"the optimizer trains a parameter of shape {tuple(p.shape)} that no "
                    f"stage uses (no stage is, calls, or holds in its closure or globals a "
                    f"module with it); call its layer as a module in a stage (layer(x), not "
                    f"F.linear(x, layer.weight)), or leave it out of the optimizer")


class StageModel(torch.nn.Module):
    """The computational stages as one module: stage k in ``Block("stage<k>")`` on its IPU.

    ``training`` containers return ``(last stage's outputs, loss)``; see
    [Note: TF1 loss and labels] in ``tf1`` for where the loss and labels come from.
    ``prefix`` (TF1's ``inputs=[...]``) goes to the first stage ahead of each call's
    arguments.
    """

    def __init__(self, stages, mapping, loss, training: bool, prefix=(),
                 optimizer_function=None):
        super().__init__()
        if isinstance(loss, torch.nn.Module):  # a loss module (nn.CrossEntropyLoss()) is a layer
            self.add_module("loss", loss)
        self._stages, self._mapping, self._with_loss = stages, mapping, training
        self._prefix, self._optimizer_function = tuple(prefix), optimizer_function
        object.__setattr__(self, "_loss", loss)  # not registered a second time

    def own(self, owned: dict) -> None:
        """Register the stages' modules (once, before wrapping)."""
        loss = self._modules.pop("loss", None)
        for name, module in owned.items():
            self.add_module(name, module)
        if loss is not None:  # the loss module after the stages' layers, as they run
            self.add_module("loss", loss)

    def split(self, inputs) -> tuple:
        """``(first stage's arguments, labels)`` of one call's arguments."""
        labels = None
        if self._with_loss and self._loss is not None:
            if len(inputs) < 2:
                raise InputError(f"with loss=..., a training call takes the first stage's inputs "
                                 f"and then the labels, pipe(*inputs, labels); got {len(inputs)} "
                                 f"argument(s)")
            *inputs, labels = inputs
        return (*self._prefix, *inputs), labels

    def loss_of(self, values, labels):
        """The loss of the last stage's outputs ([Note: TF1 loss and labels])."""
        if self._optimizer_function is not None:
            return optimizer_output(self._optimizer_function, values).loss
        if self._loss is not None:
            return self._loss(values, labels)
        return values[-1] if isinstance(values, (tuple, list)) and values else values

    def forward(self, *inputs):
        values, labels = self.split(inputs)
        last = len(self._stages) - 1
        for k, stage in enumerate(self._stages):
            with Block(f"stage{k}", ipu_id=self._mapping[k]):
                values = call(stage, values)
                if k == last and self._with_loss:
                    return values, mark_loss(self.loss_of(values, labels))
        return values


def optimizer_output(optimizer_function, values) -> OptimizerFunctionOutput:
    """``optimizer_function(*last stage's outputs)``, checked."""
    out = call(optimizer_function, values)
    if not isinstance(out, OptimizerFunctionOutput):
        raise OptimizerError(f"optimizer_function returned {type(out).__name__}, not an "
                             f"OptimizerFunctionOutput; return OptimizerFunctionOutput("
                             f"lambda params: torch.optim.SGD(params, lr=learning_rate), loss)")
    return out


def call(stage, values):
    """Stage k+1 of stage k's outputs: a tuple or list unpacks, a dict gives keywords."""
    if isinstance(values, dict):
        return stage(**values)
    if isinstance(values, (tuple, list)):
        return stage(*values)
    return stage(values)


def mark_loss(loss):
    """The loss, checked to be a scalar tensor and marked as the model's loss."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"{type(loss).__name__} {loss!r}"
        raise LossError(f"the pipeline's loss must be a scalar tensor, got {got}; with loss=None "
                        f"the last stage returns the loss alone or last in a tuple (return logits, "
                        f"loss), with loss=fn fn(outputs, labels) returns it; reduce it with "
                        f".mean() or .sum()")
    return identity_loss(loss, reduction="none")
