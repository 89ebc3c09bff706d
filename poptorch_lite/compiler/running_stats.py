"""Running statistics: which buffer writes of a trace are normalisations' own updates.

[Note: running statistics on replicas]
PopTorch refuses a model that writes a buffer in place when it has replicas, with
"PopTorch does not support broadcasting buffers ... broadcastBuffers(False)", unless
``broadcastBuffers(False)`` lets each replica keep its own buffers. That refusal is raised
for the in-place ops its tracer records on a buffer (``InplaceInputsTracker::
finalizeGraph``, poptorch/source/InplaceOps.cpp), and a normalisation's statistics are
not among them: PopTorch lowers ``aten::batch_norm`` to a PopART BatchNormalization that
updates its running mean and variance itself, on each replica from that replica's batch,
and never broadcasts them (``NormalizationOps.cpp``); an integer buffer such as
``num_batches_tracked`` is a constant there (``JITDispatch::addParameter``). So PopTorch
trains BatchNorm on replicas as it is (Graphcore's CNN application trains it on 16
replicas without ``broadcastBuffers(False)``), each replica with statistics of its own.

poptorch_lite does the same. While a model is traced, :class:`StatisticsWatch` tells a
normalisation's own updates from the other writes to buffers:

- the writes a normalisation layer (torch's ``_NormBase``: ``BatchNorm1d/2d/3d``,
  ``SyncBatchNorm``, ``InstanceNorm1d/2d/3d`` with ``track_running_stats``, their lazy and
  user subclasses) makes to its own ``running_mean``, ``running_var`` and
  ``num_batches_tracked`` while its forward runs;
- the writes ``F.batch_norm`` and ``F.instance_norm`` make to the running statistics they
  are given, wherever they are called (PopTorch's criterion is the op, not the layer).

Every other change of a buffer is the model's own write: one made outside those windows
(``self.bn.running_mean += d`` in a parent's forward, a ``copy_`` into a buffer of one's
own, a write through ``.data``) is found by the buffer's version counter and its value at
each window's edges and at the trace's end. With replicas (in this process or in others),
``broadcastBuffers(True)`` (the default) refuses a model that makes any such write, with
PopTorch's message; a model whose only writes are normalisations' updates runs, each
replica keeping its own buffers as ``broadcastBuffers(False)`` makes it
([Note: weight homes] in ``runtime/weights``).

Replicas get buffers of their own when the wrapper's first program is made, if the model
has a normalisation layer that tracks statistics (:func:`tracks_statistics`) or the program
updates some (``F.batch_norm`` on buffers of the model's own): a later input signature
whose program first updates statistics that the replicas share is refused as above.

What the numbers are: replica r normalises with its own slice's batch statistics and
updates its own running statistics from them, exactly as R independent copies of the
model would, each fed its slice, their gradients averaged (a training batch norm
normalises with its batch's statistics: the running ones change no gradient).
``num_batches_tracked`` counts each replica's micro-batches, as plain PyTorch's does
(PopTorch's stays at its initial value, a constant on the IPU).
The host model receives replica 0's buffers (``copyWeightsToHost``, reading the wrapped
model, a checkpoint), as PopART returns a replicated variable's first replica; replicas in
other processes keep theirs in their own process (``distributed``), and the main process's
are its replica 0's. ``copyWeightsToDevice`` (and so loading a state dict or a
checkpoint) gives every replica the host's buffers; an edit of the host copy between calls
reaches replica 0, whose copy it is ([Note: weight homes] in ``runtime/weights``).

[Note: cumulative averages]
A training BatchNorm with ``momentum=None`` keeps a cumulative moving average: torch's
forward counts the batch (``num_batches_tracked += 1``) and reads the count into Python
as the kernel's momentum, ``1.0 / float(num_batches_tracked)``, which a trace would fix
at the first micro-batch's count ([Note: values read while tracing] in ``trace_modes``).
While tracing, :func:`cumulative_averages` gives such a layer (torch's own forward) one
whose count is traced as an op and whose statistics are updated by one node of the graph,
:func:`cumulative_batch_norm`, that reads the count when it runs: every micro-batch, and
every replica with its own buffers, updates its statistics with its own count, through the
very kernel plain PyTorch's forward calls, so to the bit. The output the model reads is a
training batch norm without statistics, traced as ops (the same numbers: in training the
kernel normalises by the batch's own), so that a gradient the forward takes through the
layer (a gradient penalty) differentiates the graph, not values fixed at the trace. Its
statistics are written inside the layer's forward, so :class:`StatisticsWatch` counts
them as its updates. The read is a host sync on a GPU, as in plain PyTorch: a step graph
is not captured around one, and a compiled stage that holds one runs eagerly (both say why).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import (disable_proxy_modes_tracing, get_proxy_mode,
                                                track_tensor_tree)
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.overrides import TorchFunctionMode

from .trace_state import version_of

_LAYER_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
_UPDATING = (F.batch_norm, F.instance_norm)  # both take running_mean, running_var at 1, 2
# whether a normalisation updates its running statistics: its argument at 5, and its default
_TRAINING = {F.batch_norm: ("training", False), F.instance_norm: ("use_input_stats", True)}


def unread_by_training_backwards(gm: fx.GraphModule) -> None:
    """A batch norm's backward that the forward runs itself (a gradient penalty through a
    BatchNorm) is given the running statistics, which its training kernel never reads (it
    reads the batch's saved mean and inverse deviation): drop them from its arguments, so
    that the stage running it does not read statistics another stage writes ([Note: state
    across stages] in ``state``)."""
    changed = False
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.native_batch_norm_backward.default and n.args[7] is True:
            n.args = (*n.args[:3], None, None, *n.args[5:])
            changed = True
    if changed:
        gm.recompile()


def tracks_statistics(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a normalisation layer with running statistics.

    Example:
        >>> tracks_statistics(torch.nn.BatchNorm1d(2)), tracks_statistics(torch.nn.LayerNorm(2))
        (True, False)
    """
    return any(isinstance(m, _NormBase) and m.track_running_stats for m in model.modules())


@contextlib.contextmanager
def cumulative_averages(model: torch.nn.Module):
    """While inside, ``model``'s BatchNorm layers with ``momentum=None`` (torch's own forward)
    record their cumulative averages' kernel call as :func:`cumulative_batch_norm`
    ([Note: cumulative averages])."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.momentum is None
              and type(m).forward is _BatchNorm.forward and "forward" not in vars(m)]
    for m in layers:
        m.forward = _cumulative_forward.__get__(m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward


def cumulative_batch_norm(input, weight, bias, running_mean, running_var, count, eps: float):
    """The statistics' update of a training ``F.batch_norm`` whose momentum is ``1 / count``
    read now, as torch's BatchNorm with ``momentum=None`` reads it ([Note: cumulative
    averages]); its output, which nothing reads, carries no gradient."""
    if is_fake(count):  # a compile (AOTAutograd's trace) has no count to read: it refuses
        raise NotImplementedError("a BatchNorm with momentum=None reads its count "
                                  "(num_batches_tracked) on the host in every micro-batch")
    with torch.no_grad():
        return F.batch_norm(input, running_mean, running_var, weight, bias, True,
                            1.0 / float(count), eps)


def reads_count(graphs) -> bool:
    """Whether any of ``graphs`` calls :func:`cumulative_batch_norm` (a read on the host)."""
    return any(n.target is cumulative_batch_norm for gm in graphs for n in gm.graph.nodes)


def _cumulative_forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward``, its ``float(num_batches_tracked)`` read in the graph's node."""
    mode = get_proxy_mode()
    if mode is None or not (self.training and self.track_running_stats
                            and self.num_batches_tracked is not None):
        return _BatchNorm.forward(self, input)  # reads no count
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    args = (input, self.weight, self.bias, self.running_mean, self.running_var,
            self.num_batches_tracked)
    with disable_proxy_modes_tracing():
        updated = cumulative_batch_norm(*args, self.eps)
    proxy = mode.tracer.create_proxy("call_function", cumulative_batch_norm, tuple(
        mode.tracer.unwrap_proxy(a) if isinstance(a, torch.Tensor) else a for a in args)
        + (self.eps,), {})
    with disable_proxy_modes_tracing():
        track_tensor_tree(updated, proxy, constant=None, tracer=mode.tracer)
    return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)


class StatisticsWatch(TorchFunctionMode):
    """Entered around a trace: which written buffers only normalisations wrote
    ([Note: running statistics on replicas]).

    Args:
        buffers: the model's buffers by name, as they are when the trace starts.
        values: id(buffer) -> a copy of its value now (taken here when not given).

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> watch = StatisticsWatch(dict(bn.named_buffers()))
        >>> with watch:
        ...     _ = make_fx(bn, tracing_mode="real")(torch.randn(4, 2))
        >>> sorted(watch.statistics(["running_mean", "num_batches_tracked"]))
        ['num_batches_tracked', 'running_mean']
        >>> sorted(watch.updated())
        ['running_mean', 'running_var']
    """

    def __init__(self, buffers: dict, values: Optional[dict] = None):
        super().__init__()
        self._buffers = buffers
        self._by_id = {id(b): b for b in buffers.values()}
        self._first = {key: (version_of(b), values[key]) if values is not None else _state(b)
                       for key, b in self._by_id.items()}  # as the trace found them
        self._open: dict = {}  # id(buffer) -> windows open on it
        self._left: dict = {}  # id(buffer) -> (version, value) as its last window left it
        self._outside: set = set()  # id(buffer): written outside every window
        self._updated: set = set()  # id(buffer): a normalisation in training updated it
        self._hooks: tuple = ()

    def statistics(self, written) -> frozenset:
        """Of the ``written`` buffer names, those that only normalisations wrote."""
        for key, left in self._left.items():  # a write after a buffer's last window
            if _changed(self._by_id[key], left):
                self._outside.add(key)
        return frozenset(n for n in written if id(self._buffers[n]) in self._left
                         and id(self._buffers[n]) not in self._outside)

    def updated(self) -> frozenset:
        """The buffer names a normalisation in training mode was given to update: written,
        though an update may leave a value as it was, as the trace's first batch can (a
        batch mean of exactly 0 after a normalisation), where comparing values would miss
        the write."""
        return frozenset(n for n, b in self._buffers.items() if id(b) in self._updated)

    def __enter__(self):
        self._hooks = (register_module_forward_pre_hook(self._layer_enters),
                       register_module_forward_hook(self._layer_leaves))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = ()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _UPDATING:
            return func(*args, **kwargs)
        given = [args[k] if len(args) > k else kwargs.get(name)
                 for k, name in ((1, "running_mean"), (2, "running_var"))]
        watched = self._watched(given)
        self._enter(watched)
        out = func(*args, **kwargs)
        self._leave(watched)
        name, default = _TRAINING[func]
        if args[5] if len(args) > 5 else kwargs.get(name, default):
            self._updated.update(id(t) for t in watched)
        return out

    # -- windows ----------------------------------------------------------------------------

    def _layer_enters(self, module, args) -> None:
        if isinstance(module, _NormBase):
            self._enter(self._watched(module._buffers.get(s) for s in _LAYER_STATISTICS))

    def _layer_leaves(self, module, args, output) -> None:
        if isinstance(module, _NormBase):
            self._leave(self._watched(module._buffers.get(s) for s in _LAYER_STATISTICS))

    def _watched(self, tensors) -> list:
        """The model's buffers among ``tensors`` (a normalisation may be given other tensors)."""
        return [t for t in tensors if isinstance(t, torch.Tensor) and id(t) in self._first]

    def _enter(self, tensors: list) -> None:
        for t in tensors:
            key = id(t)
            if not self._open.get(key):  # what it holds now was written outside any window
                if _changed(t, self._left.get(key, self._first[key])):
                    self._outside.add(key)
            self._open[key] = self._open.get(key, 0) + 1

    def _leave(self, tensors: list) -> None:
        for t in tensors:
            key = id(t)
            self._open[key] -= 1
            if not self._open[key]:
                self._left[key] = _state(t)


def _state(t: torch.Tensor) -> tuple:
    """``t``'s version and a copy of its value, taken outside the trace."""
    with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        return version_of(t), t.detach().clone()


def _changed(t: torch.Tensor, state: tuple) -> bool:
    """Whether ``t`` was written since ``state`` (a batch-norm kernel's write moves no version)."""
    version, value = state
    if version_of(t) != version:
        return True
    with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        return not same_values(t, value)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds ``b``'s values, a NaN where ``b`` has one (``torch.equal`` says a
    buffer holding a NaN always differs from its copy).

    Example:
        >>> t = torch.tensor([1.0, float("nan")])
        >>> torch.equal(t, t.clone()), same_values(t, t.clone())
        (False, True)
    """
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
