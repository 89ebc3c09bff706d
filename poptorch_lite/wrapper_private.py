"""PopTorch's private ``PoplarExecutor`` attributes that its integrations read.

[Note: private attributes]
PopTorch's integrations read a few private attributes of ``PoplarExecutor``
(``python/_poplar_executor.py``). Each gets the meaning PopTorch gives it:

======================  ===============================================  ==========================
name                    meaning (PopTorch's, here)                       read by
======================  ===============================================  ==========================
``_executable``         None until the model is compiled and after       lightning-graphcore's
                        ``destroy()``; then the compiled programs         ``IPUStrategy._compiled``;
                        (input signature -> program, read-only), so       applications (cnns, dino,
                        ``_executable is not None`` is ``isCompiled()``   yolo_v4) before
                                                                          ``attachToDevice()``
``_executable_inputs``  None until the first compile; then the           optimum-graphcore's
                        arguments of the call that compiled last, in     pipelines (the compiled
                        ``forward``'s order (``.args``, ``.arg_names``,  batch size)
                        ``.kwargs``), as PopTorch's ``ArgsParser.Args``
``_user_model``         the model given to the wrapper                   PopTorch's own wrap
                                                                          functions; optimum's
                                                                          pipelines
``_model``              the module a call runs: PopTorch's shallow copy  (kept for scripts)
                        of it; here the user's model itself
``_options``            the wrapper's frozen copy of the options         ``IPUStrategy.replication_
                                                                          factor`` (``toDict()``)
``_training``           True for ``trainingModel``                       (kept for scripts)
``_optimizer``          the optimizer the next call steps with           yolo_v4 (an LR scheduler
                                                                          on it, then
                                                                          ``setOptimizer``)
``_is_attached``        ``isAttachedToDevice()``                         (kept for scripts)
======================  ===============================================  ==========================

The other private names of PopTorch's ``PoplarExecutor`` are its machinery
(PopART's executable, the argument parser, dirty flags, the optimizer's dict
form, hooks); poptorch_lite keeps none of them, so reading one raises
:class:`~poptorch_lite.errors.UnknownAttributeError` (an ``AttributeError``:
``hasattr`` is False) naming the public way (``REFUSED``). Any other ``_``
name is read from the user's model, as PopTorch's ``__getattr__`` does;
dunder names are not.
"""

from __future__ import annotations

import inspect

from .errors import UnknownAttributeError

# PopTorch's private PoplarExecutor names that poptorch_lite gives no meaning, and the public way.
REFUSED = {
    "_outputs_structure": "the model's return value",
    "_args_parser": "a call with forward()'s arguments",
    "_anchor_memory": "getAnchoredTensor(short_name)",
    "_host_weights_version": "copyWeightsToHost() (reading the model syncs it)",
    "_dirty_host_weights": "copyWeightsToHost() (reading the model syncs it)",
    "_poptorch_version": "poptorch.__version__",
    "_ipu_optimizer_is_dirty": "setOptimizer(optimizer)",
    "_dict_optimizer": "setOptimizer(optimizer)",
    "_attribute_tracker": "setOptimizer(optimizer)",
    "_update_optimizer_if_needed": "setOptimizer(optimizer)",
    "_write_optim_state_dict_if_needed": "setOptimizer(optimizer)",
    "_read_optim_state_dict_if_needed": "copyWeightsToHost(), then optimizer.state_dict()",
    "_get_optim_state_dict": "copyWeightsToHost(), then optimizer.state_dict()",
    "_host_rng_state_is_dirty": "Options.randomSeed(seed)",
    "_cached_rng_state": "Options.randomSeed(seed)",
    "_copyRngStateToDevice": "Options.randomSeed(seed)",
    "_trace": "compile(*args)",
    "_compile": "compile(*args)",
    "_compileWithDispatch": "compile(*args)",
    "_preprocessGraph": "compile(*args)",
    "_narrow_tensor": "poptorch.DataLoader(options, ...) for combined batches",
    "_on_device_attach": "attachToDevice()",
    "_install_state_hooks": "load_state_dict(state_dict)",
    "_get_module_and_name": "model.get_submodule(name)",
    "_assign_backward_error": "a trainingModel (it runs the backward)",
    "_computeLatency": "getLatency(), getHostIpuLatency(), getComputeLatency()",
    "_profiling": "runStatistics()",
    "_debugGetPopartIR": "runStatistics() (no PopART graph exists off the IPU)",
    "_precompile_hooks": "a function called before the first call",
    "_postcompile_hooks": "a function called after the first call",
}


class CompiledInputs:
    """A compiling call's arguments in ``forward``'s order, as PopTorch's ``ArgsParser.Args``.

    Example:
        >>> import torch
        >>> def forward(x, y=None, *, z=3): ...
        >>> inputs = CompiledInputs(forward, (torch.ones(2),), {"y": torch.zeros(2)})
        >>> inputs.arg_names, inputs.args[1]
        (['x', 'y', 'z'], tensor([0., 0.]))
    """

    def __init__(self, forward, args: tuple, kwargs: dict):
        try:
            bound = inspect.signature(forward).bind(*args, **kwargs)
            bound.apply_defaults()
        except (TypeError, ValueError):  # no signature, or one the call does not fit
            self.args, self.arg_names, self.kwargs = list(args), [], dict(kwargs)
            return
        self.args, self.arg_names, self.kwargs = [], [], {}
        after_variadic = False
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            if kind == inspect.Parameter.VAR_POSITIONAL:
                after_variadic = True
                self.args += value
                self.arg_names += [f"*{name}[{k}]" for k in range(len(value))]
            elif kind == inspect.Parameter.VAR_KEYWORD:
                self.kwargs.update(value)
            elif after_variadic:  # PopTorch: everything after *args is named
                self.kwargs[name] = value
            else:
                self.args.append(value)
                self.arg_names.append(name)


def check_private(attributes: dict, name: str) -> None:
    """Raises unless ``name``, a private name missing from the wrapper, is read from the
    user's model ([Note: private attributes]).

    Raises:
        UnknownAttributeError: ``name`` is PopTorch's machinery (``REFUSED``).
        AttributeError: a dunder name, or the wrapper is not built yet (unpickling).
    """
    if name in REFUSED:
        raise UnknownAttributeError(
            f"PoplarExecutor.{name} is PopTorch's internal state, which poptorch_lite does not "
            f"keep; use {REFUSED[name]} instead")
    if (name.startswith("__") and name.endswith("__")) or "_user_model" not in attributes:
        raise AttributeError(name)
