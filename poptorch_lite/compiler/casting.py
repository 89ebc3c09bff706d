"""PopTorch's implicit casting of mixed-precision ops, applied while the model is traced.

[Note: implicit casting]
PopTorch (3.x, the dispatcher frontend) resolves an op whose float inputs mix
``float16`` and ``float32`` instead of failing as plain PyTorch does ("expected
scalar type Float but found Half"). Its user guide ("16-bit float migration"): mixed
precision ops "are now always upcast to float32, in accordance with normal PyTorch
behaviour". Its lowering has two rules, followed here op for op:

- **Convolutions and normalisations take the input's type.** ``aten::convolution``
  (``conv1d/2d/3d``, ``conv_transpose1d/2d/3d``), ``batch_norm``, ``layer_norm``,
  ``group_norm`` and ``instance_norm`` cast their weight and bias to the type of
  their input (``castWeightAndBias`` in ``poptorch/source/Utils.cpp``, called from
  ``ConvolutionOps.cpp`` and ``NormalizationOps.cpp``); running statistics are cast
  with them here, because torch's kernels need them of one type (a training
  BatchNorm's update is written back into the model's own buffers). So a model made
  ``.half()`` and called with ``float32`` inputs, as the YOLOv4 backbone and neck
  tests do, computes in ``float32`` and returns ``float32``. A normalisation of a
  ``bfloat16`` or ``float16`` input with ``float32`` weights, bias and statistics is
  left alone: plain PyTorch runs it as it is (mixed precision keeps its norms in
  ``float32``, and ``torch.autocast`` hands them such inputs), and casting the weights
  down would round them (a BatchNorm under autocast: outputs 1.2e-02 off).
- **Products promote.** ``linear``, ``matmul``, ``mm``, ``bmm``, ``addmm`` and
  ``baddbmm`` (PopART ``matmul``/``gemm``, ``ImplicitCast::All``) cast every tensor
  input to the type torch's own ``torch.result_type`` gives for them
  (``inferExpectedTypeDispatch`` in ``ImplicitCasting.cpp``): ``float32`` wins.

Elementwise ops (``add``, ``mul``, ``where``, ``cat``, ...) already promote in
PyTorch exactly as PopTorch's dispatcher does, so nothing changes for them:
PopTorch's ``half_test.py::test_simple_model`` (half + half -> half, float + float
-> float) and ``test_model_with_weights`` (a half ``Linear`` on a half input ->
half) hold as in plain PyTorch. The casts are ops of the traced graph, so
gradients reach half parameters through them. An op whose inputs agree is never
touched: where plain PyTorch runs, the numbers are plain PyTorch's.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# op -> positions (and names) of the weight-like arguments cast to the input's type.
_TO_INPUT_TYPE = {
    **{f: ((1, "weight"), (2, "bias")) for f in (
        torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
        torch.conv_transpose2d, torch.conv_transpose3d)},
    F.batch_norm: ((1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias")),
    F.instance_norm: ((1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias")),
    F.layer_norm: ((2, "weight"), (3, "bias")),
    F.group_norm: ((2, "weight"), (3, "bias")),
}

# Normalisations plain PyTorch runs on a bfloat16 or float16 input with float32 weights, bias
# and statistics (mixed precision's usual normalisation, and torch.autocast's): left alone.
_MIXED = {F.batch_norm, F.instance_norm, F.layer_norm, F.group_norm}
_LOW = (torch.bfloat16, torch.float16)

# Ops whose tensor inputs are all promoted to torch.result_type of them.
_PROMOTED = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm}

# Running statistics a training normalisation updates in place ([Note: implicit casting]).
_STATISTICS = ("running_mean", "running_var")


def _floats(values) -> list:
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _to_input_type(func, args: tuple, kwargs: dict):
    """Call ``func`` with its weight, bias (and statistics) in its input's type."""
    first = args[0] if args else kwargs.get("input")
    if not isinstance(first, torch.Tensor) or not first.is_floating_point():
        return func(*args, **kwargs)
    if func in _MIXED and first.dtype in _LOW and all(
            t.dtype == torch.float32 for t in _floats(_weight_like(func, args, kwargs))):
        return func(*args, **kwargs)  # plain PyTorch's mixed normalisation
    args, kwargs, swapped = list(args), dict(kwargs), []
    for position, name in _TO_INPUT_TYPE[func]:
        if position < len(args):
            holder, key = args, position
        elif name in kwargs:
            holder, key = kwargs, name
        else:
            continue
        value = holder[key]
        if (isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.dtype != first.dtype):
            holder[key] = value.to(first.dtype)
            if name in _STATISTICS:
                swapped.append((value, holder[key]))
    out = func(*args, **kwargs)
    with torch.no_grad():
        for original, cast in swapped:  # a training norm updated the cast copy
            original.copy_(cast)
    return out


def _weight_like(func, args: tuple, kwargs: dict) -> list:
    """The arguments of ``func`` that :data:`_TO_INPUT_TYPE` names, as given."""
    return [args[position] if position < len(args) else kwargs.get(name)
            for position, name in _TO_INPUT_TYPE[func]]


def _promoted(func, args: tuple, kwargs: dict):
    """Call ``func`` with its float tensor inputs in the type torch's promotion gives them."""
    floats = _floats(list(args) + list(kwargs.values()))
    dtype: Optional[torch.dtype] = None
    for t in floats:
        dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    if all(t.dtype == dtype for t in floats):
        return func(*args, **kwargs)

    def cast(v):
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})


class _ImplicitCasting(TorchFunctionMode):
    """Resolves mixed float16/float32 ops as PopTorch does ([Note: implicit casting])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_INPUT_TYPE:
            return _to_input_type(func, args, kwargs)
        if func in _PROMOTED:
            return _promoted(func, args, kwargs)
        return func(*args, **kwargs)


_AUTOCAST_DEVICES = ("cpu", "cuda")
# Whether autocast is on for any device type, in one C call without arguments (a device type
# given by name is parsed at every call, and a call's setup runs cold: [Note: one setup per
# call] in runtime/plan); torch's own RNN modules ask it so.
_any_autocast = torch._C._is_any_autocast_enabled


def ambient_autocast() -> tuple:
    """``(device type, dtype)`` of each device type whose autocast is on (around a call, or
    a trace); () outside any, in one C call. [Note: autocast around a call] at
    :func:`outside_autocast`.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     ambient_autocast()
        (('cpu', torch.bfloat16),)
    """
    if not _any_autocast():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def outside_autocast(on: tuple) -> contextlib.ExitStack:
    """A context with autocast off on every device type of ``on`` (:func:`ambient_autocast`'s,
    not empty: where autocast is off, a call enters no context).

    [Note: autocast around a call]
    A call made under ``torch.autocast`` is traced under it, so the program holds the casts
    it made (the forward's own ``torch.autocast`` blocks are the forward's, and always
    traced). Plain PyTorch casts at every forward by the autocast in force then, so the
    state is part of the call's signature: a call outside autocast after one inside it runs
    a program traced without it (one more trace, logged), not the first call's lower
    precision. Each step casts the weights it has then, as a plain loop with autocast
    around each forward does, as PyTorch asks (autocast around a whole plain loop would
    reuse its casts of the weights after ``optimizer.step()``). The program runs with
    autocast off (this context), as its stages on worker threads do anyway (autocast is
    per thread): its casts are its ops, and autocast over the traced ops would cast again
    by the policies of the ops the trace decomposed them into, not of those plain
    PyTorch's forward met, and would reach the backward, which runs inside the call. What
    the trace itself does under autocast must match plain PyTorch's forward too: each
    weight is cast once (``make_fx`` turns autocast's cache off; ``tracing`` turns it on),
    a normalisation of a ``bfloat16`` input with ``float32`` weights runs as it is ([Note:
    implicit casting] in ``compiler/casting``), and a ``bfloat16`` dropout keeps its
    decomposition (``compiler/trace_modes._dropout``).
    """
    stack = contextlib.ExitStack()
    for d, _ in on:
        stack.enter_context(torch.autocast(d, enabled=False))
    return stack
