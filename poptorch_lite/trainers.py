"""Which training wrapper holds a model: one at a time, until ``destroy()``.

[Note: one trainer per model]
A model has at most one live ``trainingModel`` (PopTorch's rule: a second one would train
the same weights from another copy of the optimizer state). The wrapper registers the model
here when it is made or revived and unregisters it in ``destroy()``. While it is registered,
the user's model has PopTorch's ``model.destroy()`` (an attribute of the instance, removed
again on ``destroy()``; a model whose class defines its own ``destroy`` keeps it), so a
script written for PopTorch unwraps the way it does there. Both sides of the registry are
weak: the wrapper holds its model, so a strong value would keep it alive for ever.
"""

from __future__ import annotations

import weakref

from .errors import WrapError

_TRAINING_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def training_wrapper(model):
    """The live training wrapper of ``model``, or None."""
    ref = _TRAINING_WRAPPERS.get(model)
    return None if ref is None else ref()


class _Destroy:
    """PopTorch's ``model.destroy()``: destroys the model's training wrapper. A copy or a
    pickle of the model gets one that holds no wrapper (and does nothing)."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper=None):
        self.wrapper = wrapper  # a weak reference, or None

    def __call__(self) -> None:
        held = self.wrapper() if self.wrapper is not None else None
        if held is not None:
            held.destroy()

    def __reduce__(self):
        return _Destroy, ()

    def __deepcopy__(self, memo):
        return _Destroy()


def register_trainer(model, wrapper) -> None:
    """``wrapper`` trains ``model`` now, until its ``destroy()`` ([Note: one trainer per
    model])."""
    _TRAINING_WRAPPERS[model] = ref = weakref.ref(wrapper)
    if not hasattr(type(model), "destroy"):
        model.__dict__["destroy"] = _Destroy(ref)


def unregister_trainer(model, wrapper) -> None:
    """``wrapper`` no longer trains ``model`` (its ``destroy()``)."""
    if training_wrapper(model) is wrapper:
        del _TRAINING_WRAPPERS[model]
        if not hasattr(type(model), "destroy"):
            model.__dict__.pop("destroy", None)


def refuse_second_trainer(model, wrapper) -> None:
    """Refuse a second live training wrapper of ``model`` (``wrapper``: the one asking).

    Raises:
        WrapError: PopTorch's message; a ``RuntimeError``.
    """
    existing = training_wrapper(model)
    if existing is not None and existing is not wrapper:
        raise WrapError("Model has already been wrapped in 'poptorch.trainingModel'. Call "
                        "model.destroy() on the model to unwrap before wrapping again (or "
                        "destroy() on the wrapper trainingModel returned).")
