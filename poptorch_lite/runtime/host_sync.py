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
"""

from __future__ import annotations

import weakref

import torch

from ..compiler.markers import is_tracing
from .weights import Weights


class HostView(dict):
    """A wrapped module's ``_parameters`` or ``_buffers``: reading it syncs the host copy.

    [Note: weight sync]. ``nn.Module`` reads its parameters and
    buffers through these dicts (attribute access, ``parameters()``,
    ``state_dict()``, ``forward``), so a read brings the values trained on a
    separate home back first; nothing else of the user's module changes. Pickling
    and ``copy.deepcopy`` give a plain dict.
    """

    __slots__ = ("watchers",)

    def __init__(self, items):
        super().__init__(items)
        self.watchers: list = []  # weak references to the Weights of each wrapper

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

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))


def watch(model: torch.nn.Module, weights: Weights, owner) -> weakref.finalize:
    """Make reads of ``model``'s parameters and buffers sync ``weights`` first, until the
    returned finalizer runs: called, or when ``owner`` (the wrapper) is garbage collected.
    It brings the last trained values to the host copy and unwatches."""
    ref = weakref.ref(weights)
    for m in model.modules():
        for attr in ("_parameters", "_buffers"):
            table = m.__dict__[attr]
            if not isinstance(table, HostView):
                table = m.__dict__[attr] = HostView(table)
            table.watchers.append(ref)
    return weakref.finalize(owner, _release, model, weights)


def _release(model: torch.nn.Module, weights: Weights) -> None:
    weights.to_host()
    unwatch(model, weights)


def unwatch(model: torch.nn.Module, weights: Weights) -> None:
    """Undo :func:`watch` for ``weights``; a table nobody watches is a plain dict again."""
    for m in model.modules():
        for attr in ("_parameters", "_buffers"):
            table = m.__dict__[attr]
            if isinstance(table, HostView):
                table.watchers[:] = [r for r in table.watchers if r() not in (weights, None)]
                if not table.watchers:
                    m.__dict__[attr] = dict(table)
