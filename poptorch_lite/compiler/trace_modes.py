"""What the trace watches: the TorchFunctionModes around a traced forward.

``_TraceMode`` marks the result of every torch loss function ([Note: loss provenance] in
``losses``) and refuses values read into Python; ``_InferenceSession`` runs every
dropout of an inference trace as the identity; ``PythonDraws`` watches Python's and numpy's
random; ``PlainFastPaths`` keeps torch's fused fast paths where plain PyTorch takes them.
``tracing.trace`` enters them.

[Note: fused fast paths]
In eval mode without gradients, torch's ``TransformerEncoderLayer`` and
``MultiheadAttention`` run one fused kernel (``aten._transformer_encoder_layer_fwd``,
``aten._native_multi_head_attention``) in place of their ops, unless an argument "has a
torch function", which they ask ``torch.overrides.has_torch_function``, and which the
trace's own modes make true of every tensor (and MultiheadAttention also declines under
``make_fx``). Traced so, an inference model of a transformer in eval mode ran the separate
ops where plain PyTorch runs the fused kernel: 1e-8 off in float32, and under a CPU autocast
(which those checks do not see) a float32 result where plain PyTorch's is bfloat16. So
while a trace runs, ``has_torch_function`` answers on the tracing thread without the modes
the trace pushed, and MultiheadAttention is told it is not traced (:class:`PlainFastPaths`):
the graph holds the fused kernel wherever plain PyTorch would run it, and a user's own mode
or tensor subclass still counts. The layers also decline when a module of theirs has a
forward hook, so the trace's own hooks are global ones, never the model's. One case is
left: ``make_fx`` cannot trace the encoder layer's kernel under autocast (its inner products
meet a float32 weight uncast), so under an autocast that layer runs its separate ops, with
a warning (W-LITE-20).

[Note: inference session]
PopTorch compiles an ``inferenceModel`` as a PopART *inference session*, in
which a dropout is the identity whatever the module's ``training`` flag
(PopTorch lowers ``aten::dropout`` with ``train=True`` to a PopART Dropout,
``poptorch/source/popart_canonicalization/DropoutOps.cpp``, and an inference
session turns that op into an identity). Scripts rely on it: they train, then
wrap the same model with ``inferenceModel`` without calling ``model.eval()``.
So an inference trace runs every dropout as the identity: ``F.dropout``,
``F.dropout1d/2d/3d``, ``F.alpha_dropout``, ``F.feature_alpha_dropout`` (hence
``nn.Dropout*``, ``nn.AlphaDropout``, the Transformer layers) and the dropout
inside ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``
(``dropout_p`` = 0). Every other op follows the module's own flag, as PopTorch's
lowering does: BatchNorm passes ``training`` on
(``NormalizationOps.cpp``: a training BatchNorm becomes a 5-output PopART
BatchNormalization, which normalises with the batch statistics and updates the
running ones, in inference sessions too: PopTorch's ``test_batchNorm3D`` compares
an ``inferenceModel`` of a training-mode BatchNorm with the native training-mode
output). The user's modules keep their ``training`` flags.

[Note: values read while tracing]
Some ops read a tensor's value to do their work: ``F.one_hot`` checks its
classes, ``torch.bincount``, ``nonzero``, boolean-mask indexing, ``unique`` and
``repeat_interleave`` size their outputs by the data. ``make_fx`` refuses every
such read by default ("trying to get value out of a tracing tensor"); the trace
here allows them (``_error_on_data_dependent_ops=False``): the op itself lands
in the graph, so every micro-batch recomputes it from its own data, as plain
PyTorch does. What is refused is a value read *into Python* from a traced
tensor (``t.item()``, ``if t:``, ``int(t)``, ``float(t)``, ``t.tolist()``,
indexing a list with ``t``): it would be fixed at the first micro-batch's
value for every later one (PopTorch's tracer fixes it the same way, silently).
A value computed from constants alone (no input, weight or buffer, no random op:
a causal mask built in ``forward``, ``torch.distributions``' checks of constant
parameters) is the same in every micro-batch, so it is read.
``F.one_hot(x)`` without ``num_classes`` is refused as PopTorch refuses it: its
width would be the first micro-batch's largest class. A tensor passed where
torch wants a Python number (``torch.arange(t)``) is converted inside torch's
C++ and cannot be told apart from an op's own read; it is fixed at trace time.
A sequence packed by lengths that come from the data (``pack_padded_sequence``) is
refused where it is packed: its layout, ``batch_sizes``, is read inside torch's C++
where no check can see it (the RNNs' packed kernels read it through a pointer and record
their steps with its sizes; ``nn.LSTM`` sizes its initial state by ``batch_sizes[0]``;
``pad_packed_sequence`` pads to ``batch_sizes.size(0)``), so every micro-batch would be
cut as the first one is (wrong numbers where the total length matches, a failed run
where it does not). Lengths computed from constants alone are fine, as above.

[Note: Python's random while tracing]
Python runs only while the model is traced, so a number the forward draws from Python's
``random`` or numpy's global random state (``random.random()``, ``np.random.rand()``) is
drawn once, and that value is part of the graph for every micro-batch and every call.
PopTorch does the same (its trace runs the Python once), where a plain PyTorch loop
draws anew in every forward. Neither can be made exact without running Python per
micro-batch, so the trace says so: a warning (once per line) naming the line of the
draw. A draw is seen as a change of the two global states across the trace (the states
are read twice per trace, nothing per call); the line is that of the first call of a
module-level function of ``random`` or ``numpy.random`` on the tracing thread (wrapped
while it traces), or the forward's own where the draw went another way (``from random
import random``, a ``random.Random`` of the model's own is not watched). A successful
trace leaves the states advanced by its draws, as PopTorch's does; one that fails puts
them back, as it puts back everything else, and so does a compile refused after its trace
(``host_random``: E-PART-10, 25, 26, E-OPT-41 change nothing). A second trace of the same
compile (for a device's kernels, [Note: graphs on their devices]) starts from the states
the first started from, so the graph keeps the numbers the first drew. torch's random ops are not of this kind:
they are ops of the graph and draw per micro-batch ([Note: micro-batch RNG] in ``rng``).
"""

from __future__ import annotations

import operator
import os
import random
import re
import sys
import sysconfig
import threading
import traceback
import types
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import (disable_proxy_modes_tracing, get_proxy_mode,
                                                get_proxy_slot)
from torch.overrides import TorchFunctionMode

from ..errors import (PoptorchLiteWarning, TraceError, hide_when_refused as __tracebackhide__,
                      warn_once)
from . import backward_hooks, grad_semantics, markers
from .casting import ambient_autocast
from .markers import LOSS_FUNCTIONS


# Reading a tensor's value into Python ([Note: values read while tracing]).
_PYTHON_READS = {torch.Tensor.item: "t.item()", torch.Tensor.tolist: "t.tolist()",
                 torch.Tensor.__bool__: "bool(t) (an if or while on a tensor)",
                 torch.Tensor.__int__: "int(t)", torch.Tensor.__float__: "float(t)",
                 torch.Tensor.__index__: "t used as an index or size",
                 torch.Tensor.__complex__: "complex(t)"}


def _user_frame(frames):
    """The innermost frame of user code among ``frames`` (see :func:`_user_line`), or None."""
    is_user = user_file_test()
    users = [fr for fr in frames if is_user(fr.filename)]
    return users[-1] if users else None


def _user_line(frames) -> str:
    """The innermost frame of user code, for messages.

    Library frames are recognised by the folder they come from (torch's, this
    package's, the standard library's, pytest's and pluggy's), never by a name in the
    path: a clone of this project lives in a folder called ``poptorch_lite`` too, and
    its tests are user code. Frames of generated code (``<string>``: a dataclass's
    ``__init__``, code that ``exec`` made; ``<eval_with_key>``: an fx graph) name no
    file a user can open, so they are skipped as well.
    """
    frame = _user_frame(frames)
    if frame is None:
        return "(no line of user code in the traceback)"
    return f'{frame.filename}:{frame.lineno}: {frame.line}'


def user_file_test():
    """A test of a file name: is code there the user's (not generated, in no library folder)?"""
    library = _library_folders()
    return lambda filename: (not filename.startswith("<")
                             and not os.path.realpath(filename).startswith(library))


def _library_folders() -> tuple:
    """The folders whose code runs the user's code but is not it (each ending in a separator)."""
    folders = [sysconfig.get_paths()["stdlib"]]
    for name in ("torch", __name__.split(".")[0], "_pytest", "pluggy"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            folders.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<code>[^\n]*)')


def node_source(node: torch.fx.Node) -> Optional[tuple]:
    """``(file, line, code)`` of the line of the model's code that made ``node`` (the
    innermost frame of user code in the trace's stack, which starts in the forward), or
    None."""
    is_user = user_file_test()
    frames = [f for f in _FRAME.finditer(node.meta.get("stack_trace") or "")
              if is_user(f["file"])]
    frame = frames[-1] if frames else None
    return (frame["file"], int(frame["line"]), frame["code"].strip()) if frame else None


def user_caller() -> tuple:
    """``(file, line)`` of the innermost line of user code on the stack (the model's call)."""
    is_user = user_file_test()
    frames = [f for f in traceback.extract_stack() if is_user(f.filename)]
    return (frames[-1].filename, frames[-1].lineno) if frames else ("<unknown>", 0)


def node_line(node: torch.fx.Node) -> str:
    """``file:line: code`` of the user's line that made ``node``, for messages."""
    source = node_source(node)
    return f"{source[0]}:{source[1]}: {source[2]}" if source else f"op {node.target}"



def _from_constants(t: torch.Tensor, mode) -> bool:
    """Whether the traced tensor ``t`` is computed from constants alone: no input, weight or
    buffer of the trace and no random op among the ops that made it."""
    proxy = get_proxy_slot(t, mode.tracer, None)
    if proxy is None:
        return True
    stack, seen = [proxy.proxy.node], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" or torch.Tag.nondeterministic_seeded in getattr(
                node.target, "tags", ()):
            return False
        stack.extend(node.all_input_nodes)
    return True


# Where torch hands an op to the trace's modes: not where a value is read.
_DISPATCH = tuple(os.path.join("torch", *p.split("/")) for p in (
    "fx/", "overrides.py", "utils/_python_dispatch.py", "_tensor.py", "_ops.py"))


def _library_reader(frames) -> str:
    """Where in a library a read of a tensor's value happened, when the user's line only
    calls it (torch's ``nn.Transformer`` comparing a mask given as an input with a causal
    one): ``" (in <file>:<line>, <function>)"``, or "" where the read is the user's own."""
    ours = os.path.join(os.path.realpath(os.path.dirname(os.path.dirname(__file__))), "")
    is_user = user_file_test()
    for frame in reversed(frames):
        path = os.path.realpath(frame.filename)
        if path.startswith(ours) or frame.name.startswith("__torch_") or \
                any(d in path for d in _DISPATCH):
            continue
        if is_user(frame.filename):
            return ""
        return f" (in {frame.filename}:{frame.lineno}, {frame.name})"
    return ""


def _read_into_python(func, args: tuple, kwargs: dict):
    """Run a read of a tensor's value into Python: a constant's is fine (make_fx's own, or one
    computed from constants alone: the same in every micro-batch), a traced one's refused."""
    tracer = get_proxy_mode()
    if tracer is None:
        return func(*args, **kwargs)
    allowed = tracer._error_on_data_dependent_ops
    tracer._error_on_data_dependent_ops = True  # make_fx refuses traced values, computes constants
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        if "value out of a tracing tensor" not in str(exc):
            raise
        if isinstance(args[0], torch.Tensor) and _from_constants(args[0], tracer):
            with disable_proxy_modes_tracing():  # the traced value is real: read it
                return func(*args, **kwargs)
        frames = traceback.extract_stack()[:-1]
        raise TraceError(
            f"the forward reads a tensor's value into Python with {_PYTHON_READS[func]} at "
            f"{_user_line(frames)}{_library_reader(frames)}: the model is traced once, so "
            f"that value would be the first micro-batch's for every micro-batch. Keep it a "
            f"tensor (torch.where(cond, a, b) instead of an if, tensor arithmetic instead of "
            f".item())") from None
    finally:
        tracer._error_on_data_dependent_ops = allowed


# Ops that cut a batch by a packed sequence's lengths: their argument 1 is the lengths
# (``_pack_padded_sequence``) or the layout they make (the RNNs' packed overloads).
_VF = torch._C._VariableFunctions
_PACKING = {_VF._pack_padded_sequence: "pack_padded_sequence",
            **{getattr(_VF, n): f"a packed {n}" for n in ("lstm", "gru", "rnn_tanh", "rnn_relu")}}


def _refuse_packing(func, args: tuple) -> None:
    """Refuse a sequence packed by lengths that come from the data ([Note: values read while
    tracing])."""
    sizes, mode = (args[1] if len(args) > 1 else None), get_proxy_mode()
    if not isinstance(sizes, torch.Tensor) or mode is None or _from_constants(sizes, mode):
        return  # not a packed overload, or the same layout in every micro-batch
    proxy = get_proxy_slot(sizes, mode.tracer, None)
    made = proxy.proxy.node if proxy is not None else None
    if made is not None and made.target is operator.getitem and made.args[1] == 1 and \
            getattr(made.args[0], "target", None) is torch.ops.aten._pack_padded_sequence.default:
        return  # the layout of a pack whose lengths were let through (constants)
    raise TraceError(
        f"the forward packs sequences by lengths that come from the data ({_PACKING[func]} at "
        f"{_user_line(traceback.extract_stack()[:-2])}): the model is traced once, and a "
        f"packed sequence's layout (its batch_sizes, which torch's RNNs and "
        f"pad_packed_sequence read inside C++) would be the first micro-batch's for every "
        f"micro-batch. Run the RNN over the padded batch instead and use the lengths as a "
        f"mask: for a one-directional RNN, out, _ = rnn(padded) gives the packed outputs at "
        f"the valid steps, out[torch.arange(len(lengths)), lengths - 1] the last ones, and "
        f"out * (torch.arange(out.shape[1]) < lengths[:, None])[..., None] zeros the padding")


class _TraceMode(TorchFunctionMode):
    """Marks torch losses' results; refuses values read into Python and ``one_hot`` without a
    width; tells ``saw`` of each user's generator a random op draws from."""

    def __init__(self, saw=lambda generator: None, generic: bool = False):
        super().__init__()
        self.saw = saw
        self.generic = generic  # the graph may run on a GPU: dropout as the fused op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(kwargs.get("generator"), torch.Generator):  # [Note: a user's generator]
            self.saw(kwargs["generator"])  # in ``rng``
        if func in _PYTHON_READS:
            return _read_into_python(func, args, kwargs)
        if func in _PACKING:
            _refuse_packing(func, args)
        if func is F.one_hot and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:
            raise TraceError(
                f"OneHot num classes must be specified and must be constant: F.one_hot at "
                f"{_user_line(traceback.extract_stack()[:-1])} has no num_classes, so its width "
                f"would be the first micro-batch's largest class; pass num_classes=<classes>")
        if func is F.dropout:
            return _dropout(self.generic, *args, **kwargs)
        # [Note: gradients the forward shapes] in ``grad_semantics``
        if func == grad_semantics.DATA_GET:
            return grad_semantics.traced_data(func, args)
        if func is torch.Tensor.detach or func is torch.detach:
            return grad_semantics.traced_detach(func, args, kwargs)
        if func is torch.Tensor.register_hook:
            return backward_hooks.traced_register_hook(func, *args, **kwargs)
        out = func(*args, **kwargs)
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            markers.mark_loss(out)
        markers.record_requires_grad(out)
        return out


def _dropout(generic: bool, input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as the op plain PyTorch runs where the graph will run.

    On a GPU, ``F.dropout`` runs the fused ``native_dropout`` kernel; on the CPU it
    decomposes into ``bernoulli_``, a division and a multiply, which draws different
    numbers on a GPU. A graph traced on the CPU to run on a GPU (``generic``) would then
    mask differently from plain PyTorch there, so it records ``native_dropout``. So does a
    graph for the CPU in float32 or float64, where ``native_dropout`` draws and computes
    exactly what the decomposition does, in one op. In bfloat16 and float16 it does not:
    its backward scales by ``1 / (1 - p)`` in float where the decomposition multiplies by
    the mask divided in the low precision (bfloat16 under ``torch.autocast``: 15 of 20
    gradients differed), so there the trace keeps the decomposition.
    """
    if training and not inplace and 0 < p < 1 and input.numel() > 0 and (
            generic or input.dtype in (torch.float32, torch.float64)):
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return F.dropout(input, p, training, inplace)


def _input_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["input"]


def _without_dropout_p(func, args: tuple, kwargs: dict, position: int):
    """Call ``func`` with its ``dropout_p`` argument (keyword, or at ``position``) set to 0."""
    if len(args) > position:
        args = (*args[:position], 0.0, *args[position + 1:])
    else:
        kwargs = {**kwargs, "dropout_p": 0.0}
    return func(*args, **kwargs)


# How an inference session runs each dropout ([Note: inference session]).
_INFERENCE_DROPOUT = {
    **{f: lambda f, a, k: _input_of(a, k)
       for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                 F.feature_alpha_dropout)},
    F.scaled_dot_product_attention: lambda f, a, k: _without_dropout_p(f, a, k, 4),
    F.multi_head_attention_forward: lambda f, a, k: _without_dropout_p(f, a, k, 10),
}


_ACTIVATION = torch.nn.modules.activation  # MultiheadAttention's module
_ENCODER_FORWARD = torch.nn.TransformerEncoderLayer.forward.__code__


def _warn_encoder_under_autocast() -> None:
    """W-LITE-20: plain PyTorch would take the fused kernel that cannot be traced."""
    warn_once("trace.encoder_fast_path_under_autocast",
              "a TransformerEncoderLayer in eval mode without gradients, under "
              "torch.autocast on the CPU: plain PyTorch runs its fused kernel "
              "(torch._transformer_encoder_layer_fwd), which cannot be traced under "
              "autocast (make_fx fails), so the program runs the layer's separate ops: "
              "they round otherwise in the lower precision, and the layer returns "
              "float32 where plain PyTorch's returns the autocast's type. Call the "
              "inference model outside autocast: the kernel is then traced, and its "
              "numbers are plain PyTorch's", PoptorchLiteWarning)


class PlainFastPaths:
    """Context manager around a trace: ``torch.overrides.has_torch_function`` answers on the
    tracing thread as it would outside the trace, without the trace's own modes
    ([Note: fused fast paths])."""

    def __enter__(self):
        real, depth, thread = torch.overrides.has_torch_function, \
            torch._C._len_torch_function_stack(), threading.get_ident()

        def has_torch_function(args) -> bool:
            above = torch._C._len_torch_function_stack() - depth
            if above <= 0 or threading.get_ident() != thread:
                return real(args)
            popped = [torch._C._pop_torch_function_stack() for _ in range(above)]
            try:
                plain = real(args)
            finally:
                for mode in reversed(popped):
                    torch._C._push_on_torch_function_stack(mode)
            if not plain and sys._getframe(1).f_code is _ENCODER_FORWARD and ambient_autocast() \
                    and not (torch.is_grad_enabled() and any(
                        getattr(a, "requires_grad", False) for a in args)):
                _warn_encoder_under_autocast()
                return True  # its separate ops: make_fx cannot trace the kernel under autocast
            return plain

        # (a private helper of torch's: where a release has none, nothing to answer)
        tracing = getattr(_ACTIVATION, "_is_make_fx_tracing", None)

        def is_make_fx_tracing() -> bool:
            return threading.get_ident() != thread and tracing()
        self.real, self.tracing = real, tracing
        torch.overrides.has_torch_function = has_torch_function
        if tracing is not None:
            _ACTIVATION._is_make_fx_tracing = is_make_fx_tracing
        return self

    def __exit__(self, *exc) -> None:
        torch.overrides.has_torch_function = self.real
        if self.tracing is not None:
            _ACTIVATION._is_make_fx_tracing = self.tracing


class _InferenceSession(TorchFunctionMode):
    """Runs every dropout as the identity while an inference model is traced."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        session = _INFERENCE_DROPOUT.get(func)
        return func(*args, **kwargs) if session is None else session(func, args, kwargs)


# The module-level draws of Python's random and numpy's global state: the functions bound to
# their hidden global generator ([Note: Python's random while tracing]).
_NOT_DRAWS = {"seed", "getstate", "setstate", "get_state", "set_state"}


def _draws(module, generator) -> list:
    return [n for n in dir(module) if n not in _NOT_DRAWS and not n.startswith("_")
            and getattr(getattr(module, n), "__self__", None) is generator]


_local = threading.local()  # the PythonDraws of the trace running on this thread
_watching = {"lock": threading.Lock(), "traces": 0, "saved": []}


def _watched(module, name: str, draw):
    """``draw``, noting its first call on a tracing thread in that trace's PythonDraws."""
    def watched(*args, **kwargs):
        draws = getattr(_local, "draws", None)
        if draws is not None and draws.first is None:
            draws.first = (module.__name__, name, _user_frame(traceback.extract_stack()[:-1]))
        return draw(*args, **kwargs)
    return watched


def host_random() -> tuple:
    """The states of Python's ``random`` and numpy's global random, for
    :func:`set_host_random` ([Note: Python's random while tracing])."""
    return random.getstate(), np.random.get_state()


def set_host_random(states: tuple) -> None:
    """Put back the states :func:`host_random` read."""
    random.setstate(states[0])
    np.random.set_state(states[1])


class PythonDraws:
    """Context manager around a trace: warns of a draw from Python's ``random`` or numpy's
    global random state, naming its line; puts the states back if the trace fails ([Note:
    Python's random while tracing]). ``forward``: the traced model's forward, named when the
    line of a draw is unknown. The module-level functions are wrapped while any thread
    traces; each wrapper does the function's own on every thread."""

    def __init__(self, forward):
        self.forward = forward
        self.first = None  # (module name, function name, user frame) of the first draw seen

    def __enter__(self):
        self.states = host_random()
        with _watching["lock"]:
            if _watching["traces"] == 0:
                _watching["saved"] = [(m, n, getattr(m, n)) for m, g in (
                    (random, random._inst), (np.random, np.random.mtrand._rand))
                    for n in _draws(m, g)]
                for module, name, draw in _watching["saved"]:
                    setattr(module, name, _watched(module, name, draw))
            _watching["traces"] += 1
        self.outer, _local.draws = getattr(_local, "draws", None), self
        return self

    def __exit__(self, kind, exc, tb):
        _local.draws = self.outer
        with _watching["lock"]:
            _watching["traces"] -= 1
            if _watching["traces"] == 0:
                for module, name, draw in _watching["saved"]:
                    setattr(module, name, draw)
        python, numpy = self.states
        if kind is not None:
            set_host_random(self.states)
            return
        now = np.random.get_state()
        moved = [what for what, changed in (
            ("Python's random", random.getstate() != python),
            ("numpy's global random state", now[2] != numpy[2] or now[3] != numpy[3]
             or not np.array_equal(now[1], numpy[1]))) if changed]
        if moved:
            self._warn(moved)

    def _warn(self, moved: list) -> None:
        module, name, frame = self.first or (None, None, None)
        if frame is not None:
            where, at = f"{module}.{name} at {frame.filename}:{frame.lineno}: {frame.line}", (
                frame.filename, frame.lineno)
        else:
            code = getattr(self.forward, "__code__", None) or types.SimpleNamespace(
                co_filename="<unknown>", co_firstlineno=0)
            where = f"{getattr(self.forward, '__qualname__', 'forward')} ({code.co_filename}:" \
                    f"{code.co_firstlineno})"
            at = (code.co_filename, code.co_firstlineno)
        warn_once(
            f"trace.python_random:{at[0]}:{at[1]}",
            f"the forward draws from {' and '.join(moved)} ({where}) while it is traced: the "
            f"model is traced once, so that number is drawn once and used for every "
            f"micro-batch and every call, where plain PyTorch would draw anew in each forward "
            f"(PopTorch does the same: Python runs only while it traces). Draw it with torch "
            f"(torch.rand, torch.randint, ...: drawn per micro-batch), or pass it in as an "
            f"input", PoptorchLiteWarning, at=at)
