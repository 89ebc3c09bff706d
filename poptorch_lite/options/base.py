"""Option groups: stored values, setters that chain, attribute access, freezing.

:class:`OptionGroup` is the base of ``Options`` and of each of its sub-objects
(``Training``, ``Distributed``, ``Precision``, ...). Values live in one dict
per group and read back as snake_case attributes; assigning a known snake_case
attribute goes through the matching setter (so it validates the same way);
any other public assignment is refused. Methods decorated with :func:`setter`
refuse to run on frozen options and always return the group, for chaining.

[Note: frozen options]
``trainingModel``, ``inferenceModel`` and ``DataLoader`` call
``options._freeze()`` on the user's object and keep a private clone, as in
PopTorch, so options cannot drift after they were used. Every setter and
attribute assignment of a frozen group raises ``FrozenOptionsError``;
``opts.clone()`` gives an unfrozen deep copy.

Example:
    >>> class _Demo(OptionGroup):
    ...     _PATH = "Demo"
    ...     _ATTRIBUTES = {"size": lambda g, v: g.setSize(v)}
    ...     def __init__(self):
    ...         super().__init__(size=1)
    ...     @setter
    ...     def setSize(self, n):
    ...         self._store(size=check_positive_int(n, "setSize"))
    >>> _Demo().setSize(3).size
    3
"""

from __future__ import annotations

import copy
import difflib
import enum
import functools
from typing import Any, Callable, ClassVar, Iterator, Optional, TypeVar

from .. import errors

_E = TypeVar("_E", bound=enum.Enum)


def setter(method: Callable) -> Callable:
    """Mark ``method`` as an option setter: frozen check first, returns ``self``.

    Only setters can be called from an options file or ``from_json``.

    Example:
        >>> setter(lambda self: None).is_setter
        True
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._check_not_frozen(f"{self._PATH}.{method.__name__}()")
        method(self, *args, **kwargs)
        return self

    wrapper.is_setter = True
    return wrapper


class OptionGroup:
    """Base of ``Options`` and its sub-objects.

    Subclasses set ``_PATH`` (their accessor, for messages), ``_ATTRIBUTES``
    (snake_case name -> function ``(group, value)`` that calls the setter) and
    ``_GROUPS`` (names of the properties that return child groups).

    Example:
        >>> OptionGroup(answer=42).answer
        42
    """

    _PATH: ClassVar[str] = "Options"
    _ATTRIBUTES: ClassVar[dict[str, Callable[[Any, Any], Any]]] = {}
    _GROUPS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **defaults: Any):
        object.__setattr__(self, "_values", dict(defaults))
        object.__setattr__(self, "_frozen", False)

    # -- reading and writing ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        if name.startswith("__") or values is None:
            raise AttributeError(name)
        raise errors.UnknownAttributeError(f"{self._PATH} has no option '{name}'{self._suggest(name)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._check_not_frozen(f"{self._PATH}.{name} = {value!r}")
        assign = self._ATTRIBUTES.get(name)
        if assign is None:
            raise errors.OptionsError(
                f"Invalid option: {self._PATH} has no settable option '{name}' "
                f"(tried {self._PATH}.{name} = {value!r}){self._suggest(name)}; "
                f"settable attributes: {sorted(self._ATTRIBUTES)}")
        assign(self, value)

    def _suggest(self, name: str) -> str:
        known = list(self._values) + list(self._ATTRIBUTES)
        close = difflib.get_close_matches(name, known, n=1)
        return f" (did you mean '{close[0]}'?)" if close else ""

    def _store(self, **values: Any) -> None:
        """Record values (setters call this after validating)."""
        self._values.update(values)

    # -- freezing ----------------------------------------------------------------

    def _children(self) -> Iterator[OptionGroup]:
        for name in self._GROUPS:
            yield getattr(self, name)

    def _set_frozen(self, frozen: bool) -> None:
        object.__setattr__(self, "_frozen", frozen)
        for child in self._children():
            child._set_frozen(frozen)

    def _freeze(self) -> None:
        """Refuse every later change (see [Note: frozen options])."""
        self._set_frozen(True)

    def __deepcopy__(self, memo: dict) -> "OptionGroup":
        """An unfrozen deep copy, as PopTorch's ``copy.deepcopy(opts)`` gives (scripts copy a
        wrapped model's options to make another model's)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            object.__setattr__(twin, name, copy.deepcopy(value, memo))
        object.__setattr__(twin, "_frozen", False)
        return twin

    @property
    def is_frozen(self) -> bool:
        """True once a wrapper or DataLoader took these options."""
        return self._frozen

    def _check_not_frozen(self, what: str) -> None:
        if self._frozen:
            raise errors.FrozenOptionsError(
                f"Can't modify frozen Options: {what} after the options were "
                f"given to a wrapper or DataLoader; call opts.clone() to get a "
                f"modifiable copy")

    # -- export ------------------------------------------------------------------

    def toDict(self) -> dict[str, Any]:
        """All values of this group and its children, as a nested dict.

        Example:
            >>> OptionGroup(a=1).toDict()
            {'a': 1}
        """
        out = {k: _plain(v) for k, v in self._values.items()}
        for name in self._GROUPS:
            out[name] = getattr(self, name).toDict()
        return out

    def __repr__(self) -> str:
        body = [f"{k}={v!r}" for k, v in self._values.items()]
        body += [f"{name}={getattr(self, name)!r}" for name in self._GROUPS]
        return f"{type(self).__name__}({', '.join(body)})"


def _plain(value: Any) -> Any:
    """A value as plain data for toDict (strategies and devices as text)."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict) and getattr(value, "every", None) is None:
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value) if not type(value).__module__ == "torch" else str(value)


# -- validators shared by the option groups ---------------------------------------


def check_positive_int(value: Any, name: str, fix: Optional[str] = None) -> int:
    """Return ``value`` if it is an int >= 1 (a bool is not), else raise.

    Args:
        value: the value given.
        name: the setter, e.g. ``"deviceIterations"``.
        fix: the call to suggest; default ``opts.<name>(1)``.

    Raises:
        errors.OptionsError: naming the value and the fix.

    Example:
        >>> check_positive_int(0, "deviceIterations")
        Traceback (most recent call last):
        ...
        poptorch_lite.errors.OptionsError: deviceIterations must be a positive int, got 0; call opts.deviceIterations(1) or more
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.OptionsError(
            f"{name} must be a positive int, got {value!r}; call "
            f"{fix or f'opts.{name}(1)'} or more")
    return value


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise OptionsError.

    Example:
        >>> check_bool(True, "broadcastBuffers")
        True
    """
    if not isinstance(value, bool):
        raise errors.OptionsError(
            f"{name} needs a bool, got {value!r} ({type(value).__name__}); call "
            f"{name}(True) or {name}(False)")
    return value


def coerce_enum(value: Any, enum_cls: type[_E], name: str) -> _E:
    """Return ``value`` as a member of ``enum_cls``.

    Accepts the member, its value (an int for IntEnums; a bool is refused) or
    its name (``"All"``, ``"OutputMode.All"``), so JSON can name members.

    Raises:
        errors.OptionsError: naming the valid members.

    Example:
        >>> from poptorch_lite.enums import OutputMode
        >>> coerce_enum(2, OutputMode, "outputMode"), coerce_enum("Sum", OutputMode, "outputMode")
        (<OutputMode.All: 2>, <OutputMode.Sum: 3>)
    """
    if isinstance(value, enum_cls):
        return value
    if not isinstance(value, bool):
        if isinstance(value, str):
            member = value.rsplit(".", 1)[-1]
            if member in enum_cls.__members__:
                return enum_cls.__members__[member]
        try:
            return enum_cls(value)
        except (ValueError, TypeError):
            pass
    names = ", ".join(f"{enum_cls.__name__}.{m}" for m in enum_cls.__members__)
    first = next(iter(enum_cls.__members__))
    raise errors.OptionsError(
        f"{name} must be a poptorch.{enum_cls.__name__} (one of {names}), got "
        f"{value!r}; call e.g. {name}(poptorch.{enum_cls.__name__}.{first})")


def warn_ipu_only(option: str, detail: str = "") -> None:
    """Warn once per process that ``option`` is accepted, stored and ignored.

    Args:
        option: its accessor, e.g. ``"Options.useIpuModel"``.
        detail: an extra sentence for options with a consequence here.

    Example:
        >>> warn_ipu_only("Options.useIpuModel")  # doctest: +SKIP
    """
    shown = option if option.endswith(")") else f"{option}()"
    errors.warn_once(
        option,
        f"{shown} only tunes IPU hardware and has no effect in poptorch_lite; "
        f"the value is stored and ignored{'. ' + detail if detail else ''}")


def via_setter(method: str) -> Callable[[Any, Any], Any]:
    """An ``_ATTRIBUTES`` entry: assigning the attribute calls ``method(value)``.

    Example:
        >>> from poptorch_lite.options import Options
        >>> via_setter("deviceIterations")(Options(), 3).device_iterations
        3
    """

    def assign(group, value):
        return getattr(group, method)(value)

    return assign
