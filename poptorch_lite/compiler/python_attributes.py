"""The model's plain Python attributes while it is traced: those the forward reads or changes.

[Note: Python attributes of the model]
The trace runs the forward's Python once ([Note: partition] in ``partition``), so a plain
Python value the forward reads from the model (``h / self.temperature``, a dropout's ``p``,
a flag choosing a branch) is baked into the graph with the value it had then. Plain
PyTorch reads it again in every forward, so the trace finds which ones it read and the
program is kept for those values only: while it traces, ``nn.Module.__getattribute__``
notes each read of an attribute of one of the model's modules whose value is plain and
immutable (bool, int, float, complex, str, bytes, None, an enum member, a numpy scalar, a
``torch.dtype`` or ``torch.device``, or a tuple of them), or a tensor kept as a plain
attribute (``self.scale = torch.tensor(2.0)``, not a buffer), which the graph holds
(a stage on a GPU a copy, [Note: graphs on their devices] in ``retarget``) and which is
compared as the object and its version (:class:`Held`: another tensor put there, or one
edited in place, traces again; one the forward writes keys nothing, and is written where
plain PyTorch's would be or refused, E-PART-28 in ``retarget``), or a callable kept in
a module's own ``__dict__`` (a ``forward`` patched onto an instance, ``self.act =
F.gelu``), compared as the object (:class:`Same`); a submodule's
``training`` flag too, but not the model's own, which is the wrapper's, fixed when it
wrapped ([Note: train and eval modes] in ``runtime/compiled``); the names ``nn.Module``
itself keeps (its hook tables, ``_compiled_call_impl``, ...) are its machinery, not the
model's. A user's private names
(``self._scale``) are read like any other. :class:`Reads` is what one trace read: a call
compares those values (one C-level getter per module, by type and value: ``0.0`` and
``-0.0`` are one value) and a changed one traces again ([Note: attributes the forward
reads] in ``runtime/compiled``). Values reached through other objects
(``self.config.scale``) and globals are not watched: they stay as traced.

The forward and backward hooks of the model's modules and torch's global module hooks
are read too, and whether a module has a ``forward`` of its own: ``Module.__call__``
reads them in every forward of plain PyTorch, and the trace bakes in those of its time,
so a hook registered or removed between calls (a feature probe, ``poptorch.BeginBlock``
or ``removeBlocks`` after wrapping), or a forward patched onto a module, traces again,
keyed like an attribute (:class:`Hooks`). What a hook's own code reads stays as traced.

An attribute the forward itself changes (``self.steps += 1``) cannot be made exact: plain
PyTorch changes it once per micro-batch, and the program, traced once, computes every
micro-batch with the value of the trace. PopTorch does the same (its trace runs the
Python once). It is found by comparing the modules' plain attributes before and after the
trace (so ``self.__dict__[name] = v`` counts too), warned of once, naming the attribute
and the line that wrote it (seen through ``nn.Module.__setattr__`` while tracing; the
forward's ``def`` where the write went around it), and put back as it was before the
trace: a trace changes no state ([Note: partition]), so the value the user sees does not
depend on how many times the model happened to be traced (a second signature, an
``inferenceModel`` of the same model, the generic trace some devices ask for), where
PopTorch leaves it changed by each trace. Such an attribute is never part of the program's
key (it would trace again at every call). An attribute the forward turns into another
kind of value (``self.cache = tensor`` where it was None) is left as the trace left it, as
before, and is not part of the key either.
"""

from __future__ import annotations

import enum
import itertools
import operator
import threading
import traceback
import types

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from ..errors import PoptorchLiteWarning, warn_once
from .trace_modes import _user_frame
from .trace_state import version_of

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            enum.Enum, np.generic)
# nn.Module's own machinery (its instances' hook tables, its class's ``_compiled_call_impl``
# and ``_version``, ...); ``training`` is the user's flag (the root's aside: _getattribute).
_NOT_WATCHED = (frozenset(vars(torch.nn.Module())) | frozenset(vars(torch.nn.Module))) - {
    "training"}
_MISSING = object()
_call = getattr(operator, "call", lambda f, x: f(x))  # operator.call: Python 3.11


def plain(value) -> bool:
    """Whether ``value`` is a plain immutable value a program can be keyed by."""
    if isinstance(value, _SCALARS):
        return True
    return type(value) is tuple and all(map(plain, value))


def same(a, b) -> bool:
    """Whether two plain values are the same value (type and value; NaN is itself); a
    tensor attribute (:class:`Held`) or a callable (:class:`Same`) is the same object."""
    return a is b or (a == b if type(a) in _BY_OBJECT else type(a) is type(b) and a == b)


class Same:
    """A callable the forward reads from a module's own ``__dict__`` (a ``forward`` patched
    onto an instance, ``self.act = F.gelu``), as a program's key: the object itself (held,
    so that its ``id`` is never another's). Another one put there traces again."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other) -> bool:
        return (other.value if type(other) is Same else other) is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class Held:
    """A tensor the forward reads from a plain attribute (``self.scale = torch.tensor(2.0)``,
    not a buffer), as a program's key: the object itself (held, so that its ``id`` is never
    another's) at its version when traced. Another tensor put there, or an edit in place
    (which a stage on a GPU, holding the copy it made when it compiled, would not see),
    traces again."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, version_of(tensor)  # None: an inference tensor

    def __eq__(self, other) -> bool:
        if type(other) is Held:
            return other.tensor is self.tensor and other.version == self.version
        return other is self.tensor and version_of(other) == self.version

    def __hash__(self) -> int:
        return hash((id(self.tensor), self.version))

    def __repr__(self) -> str:
        return f"a tensor of shape {tuple(self.tensor.shape)}"

    def now(self, value) -> "_Text":
        """What ``value``, the attribute now, is to this one, for a message."""
        return _Text("the same tensor, edited in place" if value is self.tensor else
                     shown(value))


_BY_OBJECT = (Held, Same)


class _Text(str):
    def __repr__(self) -> str:
        return str(self)


def _kind(value) -> type:
    if type(value) is Held:
        return type(value.tensor)
    return type(value.value) if type(value) is Same else type(value)


def _watched(name: str) -> bool:
    return name not in _NOT_WATCHED and not (name.startswith("__") and name.endswith("__"))


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _MODULE_HOOKS)


class Hooks:
    """What ``Module.__call__`` reads of the model's modules besides their attributes, as it
    was when a trace began: each module's forward (pre-)hooks and backward (pre-)hooks,
    torch's global ones, and whether a module has a ``forward`` of its own (one patched onto
    the instance, which its class's gives way to).

    A call's check costs nothing for the hooks where none was registered anywhere since
    (``RemovableHandle`` numbers every registration), as a removal can only shrink a table
    that held one; otherwise (a forward that registers a tensor's hook does so in every
    call) the tables' sizes are compared, and the keys (the handles' numbers) of those that
    held hooks. Whether each module has its own forward is one C-level lookup a module.

    Args:
        names: module -> its qualified name in the model ("" for the model itself).
    """

    __slots__ = ("tables", "keys", "where", "names", "_held", "_sizes", "_epoch", "_dicts",
                 "_own")

    def __init__(self, names: dict):
        module = torch.nn.modules.module
        where = [(name, table) for name in names.values() for table in _MODULE_HOOKS]
        self.tables = tuple(getattr(m, table) for m in names for table in _MODULE_HOOKS) + \
            tuple(getattr(module, table) for table in _GLOBAL_HOOKS)
        self.where = tuple(where) + tuple((None, table) for table in _GLOBAL_HOOKS)
        self.keys = tuple(map(tuple, self.tables))
        self._held = tuple((t, k) for t, k in zip(self.tables, self.keys) if k)
        self._sizes = tuple(map(len, self.keys))
        self._epoch = RemovableHandle.next_id
        self.names = tuple(names.values())
        self._dicts = tuple(object.__getattribute__(m, "__dict__") for m in names)
        self._own = tuple(map(dict.__contains__, self._dicts, _FORWARD))

    def same(self) -> bool:
        """Whether every table holds the hooks it held, and every module's forward is its
        class's or its own as it was."""
        if tuple(map(dict.__contains__, self._dicts, _FORWARD)) != self._own:
            return False
        if RemovableHandle.next_id == self._epoch:
            return all(len(t) == len(k) for t, k in self._held)
        # a table empty then and as long now is empty still
        if tuple(map(len, self.tables)) != self._sizes or \
                not all(tuple(t) == k for t, k in self._held):
            return False
        self._epoch = RemovableHandle.next_id  # (hooks of tensors, or made and removed)
        return True

    def changed(self) -> list:
        """``(what, when traced, now)`` of each table and module forward that changed."""
        own = [(_qualified(name, "forward"), _Text(_FORWARDS[was]),
                _Text(_FORWARDS["forward" in d]))
               for name, d, was in zip(self.names, self._dicts, self._own)
               if ("forward" in d) != was]
        return own + [
            (_qualified(name, table[1:]) if name is not None
             else f"torch.nn.modules.module.{table}", _Text(_count(len(keys))),
             _Text(_count(len(t)) if len(t) != len(keys) else f"{len(t)} other"))
            for (name, table), t, keys in zip(self.where, self.tables, self.keys)
            if tuple(t) != keys]


_FORWARD = itertools.repeat("forward")
_FORWARDS = {False: "its class's", True: "its own"}


def _count(n: int) -> str:
    return f"{n} hook{'s' * (n != 1)}"


def is_hooks(name: str) -> bool:
    """Whether a name of :meth:`Reads.changed` is a hook table's or a module's forward
    (:meth:`Hooks.changed`)."""
    return name.rpartition(".")[2] in _TABLE_NAMES


_TABLE_NAMES = frozenset(table[1:] for table in _MODULE_HOOKS) | frozenset(_GLOBAL_HOOKS) | {
    "forward"}


class Reads:
    """The plain attributes a trace read, per module: what its program computed with.

    Args:
        read: module -> {attribute name: the value the trace read}.
        names: module -> its qualified name in the model ("" for the model itself).
        own_mode: whether the trace read the model's own ``training`` flag, which is the
            wrapper's and keys nothing ([Note: train and eval modes] in runtime/compiled).
        hooks: the hook tables when the trace began (None: none watched).
    """

    __slots__ = ("entries", "key", "names", "own_mode", "hooks", "_getters", "_sources",
                 "_want", "_kinds")

    def __init__(self, read: dict, names: dict, own_mode: bool = False,
                 hooks: "Hooks | None" = None):
        self.own_mode, self.hooks = own_mode, hooks
        entries = []  # (module, where it is read from, names, getter)
        for module, values in read.items():
            own = vars(module)
            inside = tuple(sorted(a for a in values if a in own and not hasattr(type(module), a)))
            outside = tuple(sorted(a for a in values if a not in inside))
            for attrs, source, getter in ((inside, own, operator.itemgetter),
                                          (outside, module, operator.attrgetter)):
                if attrs:  # one name asked for twice: every getter's result is a tuple
                    entries.append((module, source, attrs, getter(*attrs, *attrs[:len(attrs) < 2])))
        self.entries = tuple(entries)
        self._getters = tuple(e[3] for e in entries)
        self._sources = tuple(e[1] for e in entries)
        self._want = tuple(tuple(read[m][a] for a in (*attrs, *attrs[:len(attrs) < 2]))
                           for m, _, attrs, _ in entries)
        self._kinds = tuple(map(_kind, itertools.chain.from_iterable(self._want)))
        # hashable (the values are plain), and 1 is not 1.0
        self.key = tuple((id(m), attrs) for m, _, attrs, _ in entries) + (
            self._want, self._kinds, hooks.keys if hooks is not None else ())
        self.names = {id(m): names.get(m, "?") for m in read}

    def __len__(self) -> int:
        return len(self.entries)

    def same(self) -> bool:
        """Whether every attribute still has the value the trace read, by value and type (a
        call's check: one C-level getter per module; nothing where the trace read none),
        and every hook table holds the hooks it held."""
        if self.hooks is not None and not self.hooks.same():
            return False
        if not self.entries:
            return True
        try:
            got = tuple(map(_call, self._getters, self._sources))
        except (KeyError, AttributeError):  # deleted since, or moved between instance and class
            return False
        return self._want == got and tuple(map(type, itertools.chain.from_iterable(got))) \
            == self._kinds

    def changed(self) -> list:
        """``(qualified attribute name, value traced, value now)`` of those that changed,
        and of the hook tables that changed (:meth:`Hooks.changed`)."""
        hooks = self.hooks.changed() if self.hooks is not None else []
        return hooks + [(_qualified(self.names[id(m)], name), old,
                 old.now(now) if type(old) is Held else now)
                for (m, _, attrs, _), want in zip(self.entries, self._want)
                for name, old in zip(attrs, want)
                for now in (getattr(m, name, _MISSING),) if not same(old, now)]

    def attributes(self) -> list:
        """``(qualified name, module, attribute name)`` of every attribute read."""
        return sorted((_qualified(self.names[id(m)], n), m, n)
                      for m, _, attrs, _ in self.entries for n in attrs)


def shown(value) -> str:
    """A value of :meth:`Reads.changed` for a message."""
    if isinstance(value, torch.Tensor):  # what replaced a tensor the trace held
        return f"another tensor of shape {tuple(value.shape)}"
    return "(deleted)" if value is _MISSING else repr(value)


def _qualified(module_name: str, name: str) -> str:
    return f"model.{module_name}.{name}" if module_name else f"model.{name}"


# -- the watch ----------------------------------------------------------------------------

_local = threading.local()  # the AttributeWatch of the trace running on this thread
_patched = {"lock": threading.Lock(), "traces": 0, "saved": {}}


def _getattribute(self, name):
    value = object.__getattribute__(self, name)
    watch = getattr(_local, "watch", None)
    if watch is not None and id(self) in watch.modules and not (
            name.startswith("__") and name.endswith("__")):
        if name in _NOT_WATCHED:  # nn.Module's machinery, but a forward of the instance's
            if name == "forward" and name in object.__getattribute__(self, "__dict__"):
                watch.reads.setdefault(self, {}).setdefault(name, Same(value))
        elif name == "training" and self is watch.model:  # the wrapper's own flag
            watch.own_mode_read = True
        elif plain(value):
            watch.reads.setdefault(self, {}).setdefault(name, value)
        elif type(value) is torch.Tensor:  # (parameters and buffers come by __getattr__)
            watch.reads.setdefault(self, {}).setdefault(name, Held(value))
        elif callable(value) and not isinstance(value, torch.nn.Module) and \
                name in object.__getattribute__(self, "__dict__"):
            watch.reads.setdefault(self, {}).setdefault(name, Same(value))
    return value


def _setattr(self, name, value):
    watch = getattr(_local, "watch", None)
    if watch is not None and id(self) in watch.modules and _watched(name) and plain(value) \
            and (id(self), name) not in watch.lines:
        watch.lines[id(self), name] = _user_frame(traceback.extract_stack()[:-1])
    _patched["saved"]["__setattr__"](self, name, value)


class AttributeWatch:
    """Context manager around a trace ([Note: Python attributes of the model]): notes the
    plain attributes the forward reads (:attr:`reads`, a :class:`Reads` once it exits, with
    ``hooks``, the hook tables as the trace began, taken before the trace's own), and
    warns of those it changes and puts them back (a failed trace puts them back silently).

    ``nn.Module``'s ``__getattribute__`` and ``__setattr__`` are replaced while any thread
    traces; each replacement does torch's own on every thread, and notes only the tracing
    thread's reads of its model's modules.
    """

    def __init__(self, model: torch.nn.Module, hooks: "Hooks | None" = None):
        self.model, self.hooks = model, hooks
        self.names = {m: name for name, m in model.named_modules()}
        self.modules = {id(m) for m in self.names}
        self.reads: dict = {}   # module -> {name: the value first read}
        self.lines: dict = {}   # (id(module), name) -> the user's frame of its first write
        self.own_mode_read = False  # whether the forward read the model's own ``training``

    def _plain_attributes(self) -> dict:
        return {(m, n): v for m in self.names for n, v in vars(m).items()
                if _watched(n) and plain(v)}

    def __enter__(self):
        self.before = self._plain_attributes()
        with _patched["lock"]:
            if _patched["traces"] == 0:
                saved = _patched["saved"]
                saved.update({k: torch.nn.Module.__dict__.get(k)
                              for k in ("__getattribute__", "__setattr__")})
                torch.nn.Module.__getattribute__ = _getattribute
                torch.nn.Module.__setattr__ = _setattr
            _patched["traces"] += 1
        self.outer, _local.watch = getattr(_local, "watch", None), self
        return self

    def __exit__(self, kind, exc, tb):
        _local.watch = self.outer
        with _patched["lock"]:
            _patched["traces"] -= 1
            if _patched["traces"] == 0:
                saved = _patched["saved"]
                torch.nn.Module.__setattr__ = saved["__setattr__"]
                if saved["__getattribute__"] is None:
                    del torch.nn.Module.__getattribute__
                else:
                    torch.nn.Module.__getattribute__ = saved["__getattribute__"]
        changed = self._put_back()
        if kind is None:
            for m, name, old, new in changed:
                self._warn(m, name, old, new)
        # What the forward changed, and what it read other than it is now (a tensor it
        # wrote in place too), keys nothing.
        for m, values in list(self.reads.items()):
            for name, value in list(values.items()):
                if (m, name) in self.written or not same(value, getattr(m, name, _MISSING)):
                    del values[name]
        self.reads = Reads({m: v for m, v in self.reads.items() if v}, self.names,
                           self.own_mode_read, self.hooks)

    def _put_back(self) -> list:
        """Put back each plain attribute the forward changed (made, deleted, or gave another
        plain value); ``(module, name, before, after)`` of each."""
        before, after = self.before, self._plain_attributes()
        self.written, changed = set(), []
        for key in before.keys() | after.keys():
            m, name = key
            old, new = before.get(key, _MISSING), vars(m).get(name, _MISSING)
            if same(old, new):
                continue
            self.written.add(key)
            if new is not _MISSING and not plain(new):
                continue  # another kind of value (a tensor cached where None was): as before
            if old is _MISSING:
                del m.__dict__[name]
            else:
                m.__dict__[name] = old
            changed.append((m, name, old, new))
        return changed

    def _warn(self, m, name: str, old, new) -> None:
        frame = self.lines.get((id(m), name))
        if frame is not None:
            where, at = f"at {frame.filename}:{frame.lineno}: {frame.line}", (frame.filename,
                                                                              frame.lineno)
        else:
            code = getattr(getattr(type(m), "forward", None), "__code__", None) or \
                types.SimpleNamespace(co_filename="<unknown>", co_firstlineno=0)
            where = f"in {type(m).__qualname__}.forward ({code.co_filename}:{code.co_firstlineno})"
            at = (code.co_filename, code.co_firstlineno)
        attribute = _qualified(self.names[m], name)
        values = [("(none)" if v is _MISSING else repr(v)) for v in (old, new)]
        warn_once(
            f"trace.python_attribute:{type(m).__module__}.{type(m).__qualname__}.{name}",
            f"the forward changes the Python attribute {attribute} ({values[0]} -> {values[1]}) "
            f"{where} while it is traced: the model is traced once, so that Python runs once "
            f"and every micro-batch and every call computes with the value of the trace, "
            f"where plain PyTorch changes it in every forward (PopTorch does the same: Python "
            f"runs only while it traces). It is put back as it was before the trace. Keep a "
            f"value that changes in forward in a buffer (self.register_buffer('{name}', "
            f"torch.zeros(())), then self.{name} += 1), which the program updates in every "
            f"micro-batch", PoptorchLiteWarning, at=at)
