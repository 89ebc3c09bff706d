"""Wrapping a model: ``trainingModel`` and ``inferenceModel`` (``poptorch.trainingModel``, ...).

Each freezes the options (the wrapper keeps a frozen copy of its own) and returns a
:class:`~poptorch_lite.wrapper.PoplarExecutor`; a model has at most one live training
wrapper at a time.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from . import optim as poptorch_optim
from .enums import ConnectionType, MeanReductionStrategy, OutputMode
from .errors import CheckpointError, OptionsError
from .executables import read
from .options.options import Options
from .trainers import refuse_second_trainer, register_trainer
from .wrapper import PoplarExecutor


def _check_options(options) -> Options:
    if options is None:
        return Options()
    if not isinstance(options, Options):
        raise OptionsError(f"Invalid type: 'options' is of type {type(options)} "
                           f"(Expected poptorch.Options)")
    return options


def _in_force(options: Options, training: bool) -> Options:
    """The wrapper's own copy of ``options``, with the output mode it runs in: PopTorch's
    wrapper reads ``OutputMode.Default`` back as Final (training) or All (inference)."""
    private = options.clone()
    if private.output_mode == OutputMode.Default:
        private._store(output_mode=OutputMode.Final if training else OutputMode.All)
    return private


def trainingModel(model, options: Optional[Options] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> PoplarExecutor:
    """Wrap ``model`` for training: each call runs forward, backward and optimizer steps.

    Args:
        model: an ``nn.Module`` whose forward returns (or includes) a loss, or a
            wrapped model (its ``.model`` is wrapped).
        options: ``Options`` (default: ``Options()``); frozen by this call.
        optimizer: default ``poptorch_lite.optim.SGD(model.parameters(), lr=0.01)``.

    Raises:
        OptionsError: ``options`` is not an Options.
        WrapError: the model is already wrapped for training.
        OptimizerError: the optimizer is not supported.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(2, 1)
        ...     def forward(self, x, y):
        ...         out = self.fc(x)
        ...         return out, torch.nn.functional.mse_loss(out, y)
        >>> net = Net()
        >>> train = trainingModel(net)
        >>> out, loss = train(torch.ones(4, 2), torch.zeros(4, 1))
    """
    if isinstance(model, PoplarExecutor):
        model = model.model
    options = _check_options(options)
    refuse_second_trainer(model, None)
    if optimizer is None:
        optimizer = poptorch_optim.SGD(model.parameters(), lr=0.01)
    poptorch_optim.check_optimizer(optimizer)
    private = _in_force(options, True)
    if poptorch_optim.needs_running_mean(optimizer):  # as PopTorch sets it
        private.Training._store(mean_reduction_strategy=MeanReductionStrategy.Running)
    options._freeze()
    private._freeze()
    wrapper = PoplarExecutor(model, private, True, optimizer)
    register_trainer(model, wrapper)
    return wrapper


def inferenceModel(model, options: Optional[Options] = None) -> PoplarExecutor:
    """Wrap ``model`` for inference: each call runs forwards only.

    Raises:
        OptionsError: ``options`` is not an Options, or gradientAccumulation is not 1.

    Example:
        >>> import torch
        >>> infer = inferenceModel(torch.nn.Linear(2, 1))
        >>> infer(torch.ones(3, 2)).shape
        torch.Size([3, 1])
    """
    if isinstance(model, PoplarExecutor):
        model = model.model
    options = _check_options(options)
    if options.Training.gradient_accumulation != 1:
        hint = (" Use poptorch.Options().deviceIterations to process a sufficient number of "
                "batches each run for pipelined execution instead."
                if options.execution_strategy.pipelined else "")
        raise OptionsError(
            f"You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as "
            f"its default value (1) when running a poptorch.inferenceModel().{hint} (It is "
            f"{options.Training.gradient_accumulation}.)")
    private = _in_force(options, False)
    options._freeze()
    private._freeze()
    return PoplarExecutor(model, private, False)


def load(filename, edit_opts_fn: Optional[Callable] = None):
    """The wrapper a file written with ``export_model=True`` holds, compiled (PopTorch's
    ``poptorch.load``, [Note: saved executables] in ``executables``); ``edit_opts_fn`` may
    edit its options first. A model compiled for an offline target
    (``useOfflineIpuTarget``: ``ConnectionType.Never``) loads to run.

    Raises:
        CheckpointError: the file is not one ``save`` wrote, or holds no model.
    """
    data = read(filename)
    if data["model"] is None:
        raise CheckpointError(
            f"{os.fspath(filename)} is a valid PopTorch file but was created with "
            f"'export_model=False' which means you need to re-create the PopTorch model using "
            f"poptorch.inferenceModel or poptorch.trainingModel then call "
            f"poptorch_model.loadExecutable(\"{os.fspath(filename)}\").")
    options = data["options"]
    if options.connection_type == ConnectionType.Never:
        options.connectionType(ConnectionType.Always)
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    wrapper = (trainingModel(data["model"], options, data["optimizer"]) if data["training"]
               else inferenceModel(data["model"], options))
    wrapper.loadExecutable(filename)
    return wrapper
