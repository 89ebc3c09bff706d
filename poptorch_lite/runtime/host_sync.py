"""Host sync: reading the user's model brings it up to date while it is wrapped.

[Note: weight sync]
Where a stage's memory is the host model's (the CPU, without ``useIpuModel``),
the stage computes with the user's own ``Parameter`` objects: after a call the
model holds the trained values, an ``inferenceModel`` of the same model sees
them, and host edits take effect at once. Elsewhere the weights live on their
stage's device ([Note: weight homes] in ``weights``) and the host copy is
brought up to date when something reads it, as PopTorch does with an implicit
``copyWeightsToHost()``: while wrapped, each module's parameter and buffer
tables are a :class:`HostView`, so any read of the
user's model (``model.fc.weight``, ``parameters()``, ``state_dict()``, calling
it) syncs first; so do attribute access through the wrapper, a call of another
wrapper of the same model, ``copyWeightsToHost``, ``detachFromDevice`` and
``destroy``. Host edits (tensors whose version moved) reach the devices before
the next call; ``copyWeightsToHost``/``copyWeightsToDevice`` force the copies.

Edits through ``.data`` (``p.data.clamp_(-c, c)``, WGAN's weight clipping; a buffer's
``b.data.mul_(2)``) write the host memory but move no version (``.data`` is a tensor with
a version counter of its own). Such an edit needs a host tensor in hand, and a read
hands one out: so every read, and every ``to_host``, marks the host copy *exposed*
(``Weights.exposed``), and the next call pushes every host tensor to its copies, edited
or not. The read synced the host copy first, so an unedited tensor is pushed as the bits
its copies already hold. That costs the read's sync over again (the same bytes, the
other way), only after a read: a call the model was not read before pays nothing.
Comparing the host copy with the devices' would cost as much (the values must cross to
one side to be compared; on a GPU with a synchronization per tensor) and would miss
``0.0`` edited to ``-0.0``. Where homes are shared (the CPU without ``useIpuModel``) the
stages compute with the edited memory itself, and nothing is pushed.

What no call can see: an edit through ``.data`` of a reference held since before the
last call (a list of ``model.parameters()`` made before the loop, the optimizer's
``param_groups``), the model unread in between. Where homes are separate that reference
is the *stale* host copy, so the edit applies to values older than the devices', and it
is lost: the next read brings the devices' values back over it. So it is in PopTorch,
whose host copy reaches the devices only through ``copyWeightsToDevice()`` after such an
edit (which would push the stale values over the training since). Edit through the
model (``for p in model.parameters(): p.data.clamp_(-c, c)``), or after
``copyWeightsToHost()``, and the edit reaches the devices at the next call.

[Note: objects the programs compile with]
A wrapper compiles with the parameter, buffer and submodule *objects* the model holds when
it first compiles: ``Weights`` keeps them by name (the homes, the copies, what the update
binds), the user's optimizer holds those parameters, and every program's trace ran those
modules. A replaced one between calls (``model.l0.weight = nn.Parameter(...)``, a buffer
rebound, ``model.l0 = nn.Linear(...)``, ``load_state_dict(..., assign=True)``) would go
unseen: plain PyTorch computes with the new object (while the user's optimizer still
steps the old one, unless they changed it). Following it exactly would mean new homes,
copies and traces and an optimizer that holds other parameters than the model, so the
next call (and ``attachToDevice``) is refused instead, before anything changes, naming
what changed and the fix: write values in place (``copy_``, ``load_state_dict``), or
``model.destroy()`` and wrap again with an optimizer over the new parameters. It costs
nothing per call: while watched, the ``_parameters``, ``_buffers`` and ``_modules`` tables
are :class:`Watched` dicts whose writes set ``Weights.rebound``, and only then does a call
compare the tables with what they held at the first compile (:func:`tables`, by identity);
a write that put the same object back (the trace's ``functional_call``, which swaps
tensors in and back while it traces, is not counted at all) passes and clears the flag. A
detached model is not watched, so a call or ``attachToDevice`` after ``detachFromDevice``
compares them anyway. A module's ``_modules`` that is not a plain dict (a scripted
module's; a ``ModuleList`` after ``del`` builds an ``OrderedDict``) is not watched.
"""

from __future__ import annotations

import weakref

import torch

from ..compiler.markers import is_tracing
from ..errors import WrapError, hide_when_refused as __tracebackhide__
from .weights import Weights


class Watched(dict):
    """A wrapped module's ``_modules``: a write to it (``model.l0 = nn.Linear(...)``,
    ``del model.l0``) tells each watching wrapper's ``Weights`` (``rebound``) that the
    model's tables may no longer hold what its programs compile with ([Note: objects the
    programs compile with]); reads are the dict's own. Pickling and ``copy.deepcopy`` give a
    plain dict."""

    __slots__ = ("watchers",)

    def __init__(self, items):
        super().__init__(items)
        self.watchers: list = []  # weak references to the Weights of each wrapper

    def _rebound(self) -> None:
        if not is_tracing():  # the trace's functional_call swaps tensors in and back
            for ref in self.watchers:
                weights = ref()
                if weights is not None:
                    weights.rebound = True

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))


def _flagging(name: str):
    method = getattr(dict, name)

    def flagged(self, *args, **kwargs):
        self._rebound()
        return method(self, *args, **kwargs)
    flagged.__name__ = name
    return flagged


for _name in ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault"):
    setattr(Watched, _name, _flagging(_name))


class HostView(Watched):
    """A wrapped module's ``_parameters`` or ``_buffers``: reading it syncs the host copy.

    [Note: weight sync]. ``nn.Module`` reads its parameters and
    buffers through these dicts (attribute access, ``parameters()``,
    ``state_dict()``, ``forward``), so a read brings the values trained on a
    separate home back first; nothing else of the user's module changes. A write
    (``model.l0.weight = nn.Parameter(...)``) is a :class:`Watched` table's.
    """

    __slots__ = ()

    def _sync(self) -> None:
        for ref in self.watchers:
            weights = ref()
            if weights is not None:
                if weights.host_stale and not is_tracing():
                    weights.to_host()
                weights.exposed = True  # edits through .data may follow: pushed at the call

    def __getitem__(self, key):
        self._sync()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._sync()
        return dict.get(self, key, default)

    def items(self):
        self._sync()
        return dict.items(self)

    def values(self):
        self._sync()
        return dict.values(self)


_TABLES = (("_parameters", HostView), ("_buffers", HostView), ("_modules", Watched))


def watch(model: torch.nn.Module, weights: Weights, owner) -> weakref.finalize:
    """Make reads of ``model``'s parameters and buffers sync ``weights`` first, until the
    returned finalizer runs: called, or when ``owner`` (the wrapper) is garbage collected.
    It brings the last trained values to the host copy and unwatches."""
    ref = weakref.ref(weights)
    for m in model.modules():
        for attr, kind in _TABLES:
            table = m.__dict__[attr]
            if not isinstance(table, kind):
                if kind is Watched and type(table) is not dict:  # a scripted module's own
                    continue
                table = m.__dict__[attr] = kind(table)
            table.watchers.append(ref)
    return weakref.finalize(owner, _release, model, weights)


def _release(model: torch.nn.Module, weights: Weights) -> None:
    weights.to_host()
    unwatch(model, weights)


def unwatch(model: torch.nn.Module, weights: Weights) -> None:
    """Undo :func:`watch` for ``weights``; a table nobody watches is a plain dict again."""
    for m in model.modules():
        for attr, _ in _TABLES:
            table = m.__dict__[attr]
            if isinstance(table, Watched):
                table.watchers[:] = [r for r in table.watchers if r() not in (weights, None)]
                if not table.watchers:
                    m.__dict__[attr] = dict(table)


# -- the objects the programs compile with ---------------------------------------------------

_KINDS = (("parameter", "_parameters"), ("buffer", "_buffers"), ("submodule", "_modules"))


def tables(model: torch.nn.Module) -> dict:
    """``(kind, qualified name) -> object`` of every parameter, buffer and submodule the
    model's modules register, read without a sync ([Note: objects the programs compile
    with])."""
    found = {}
    for prefix, m in model.named_modules():
        for kind, attr in _KINDS:
            table = m.__dict__.get(attr)
            items = dict.items(table) if isinstance(table, dict) else \
                table.items() if table is not None else ()
            for name, value in items:
                found[kind, f"{prefix}.{name}" if prefix else name] = value
    return found


def check_unchanged(model: torch.nn.Module, compiled: dict) -> None:
    """Refuse a call of a model whose parameters, buffers or submodules are other objects
    than ``compiled`` (:func:`tables` when it first compiled) ([Note: objects the programs
    compile with]).

    Raises:
        WrapError: one was replaced, removed or added; nothing has changed.
    """
    now = tables(model)
    changes = sorted(
        [f"{k} '{n}' is another object" for (k, n), v in compiled.items()
         if (k, n) in now and now[k, n] is not v]
        + [f"{k} '{n}' was removed" for k, n in compiled.keys() - now.keys()]
        + [f"{k} '{n}' was added" for k, n in now.keys() - compiled.keys()],
        key=lambda c: c.split("'")[1])
    if changes:
        first = changes[0].split("'")[1]
        raise WrapError(
            f"the model's parameters, buffers or submodules changed since it was compiled "
            f"({'; '.join(changes)}): the wrapper computes and trains with the objects it "
            f"compiled with (and the optimizer holds the parameters it was given), so the "
            f"call would silently use the old ones. To change values, write them in place "
            f"(with torch.no_grad(): model.{first}.copy_(new), or model.load_state_dict(...)); "
            f"to compute with the new objects, call model.destroy() (or destroy() on the "
            f"wrapper) and wrap the model again, with an optimizer over its new parameters")
