"""The error hierarchy: every refusal and failure poptorch_lite raises.

Every class derives from :class:`Error` (PopTorch's ``poptorch.Error``). Where
PopTorch raises a plain Python exception for the same case (``ValueError``,
``AttributeError``, ``RuntimeError``, ``TypeError``), the class also derives from
that builtin, so a script written against PopTorch that catches the builtin keeps
working, and code written for poptorch_lite can catch :class:`Error` alone.

A message says what is wrong, the actual values, and the fix.
"""

from __future__ import annotations


class Error(Exception):
    """Base class of every poptorch_lite error (PopTorch's ``poptorch.Error``).

    Attributes:
        message: the full message.
        type: a short category name (the class name), as PopTorch's ``Error.type``.
        location: where it happened, if known (``""`` otherwise).

    Example:
        >>> try:
        ...     raise Error("something is wrong")
        ... except Error as e:
        ...     e.message
        'something is wrong'
    """

    def __init__(self, message: str, location: str = ""):
        super().__init__(message)
        self.message = message
        self.type = type(self).__name__
        self.location = location


class RecoverableError(Error):
    """PopTorch's recoverable runtime error; ``recovery_action`` names what to do."""

    def __init__(self, message: str, recovery_action: str = "FULL_RESET", location: str = ""):
        super().__init__(message, location)
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    """PopTorch's unrecoverable runtime error."""


class ConfigFileError(Error, ValueError):
    """A line of an options file given to ``Options.loadFromFile`` is not a valid setter."""


class OptionsError(Error, ValueError):
    """An option has an invalid value, or options disagree with each other."""


class OptionsAssertionError(OptionsError, AssertionError):
    """An option value PopTorch refuses with an ``assert``: also its ``AssertionError``."""


class FrozenOptionsError(Error, AttributeError):
    """Options were changed after a wrapper or DataLoader took them."""


class BatchSizeError(Error, ValueError):
    """An input's batch dimension does not fit the options' batch arithmetic."""


class PipelineError(Error, ValueError):
    """The options are too small for the pipeline (PopTorch's minimums)."""


class BlockError(Error):
    """Blocks and stages are used wrongly (op outside a Block, unknown block, order)."""


class LossError(Error):
    """A training model has no loss, or more than one independent loss."""


class TraceError(Error):
    """The model's forward could not be traced into stages."""


class InputError(Error, TypeError):
    """An argument has the wrong type or structure (a non-tensor where a tensor is needed)."""


class WrapError(Error, RuntimeError):
    """A wrapper is misused: wrapped twice, moved with ``.to()``, used after ``destroy()``."""


class DeviceError(Error):
    """Attaching or detaching a device that is not in the required state."""


class OfflineDeviceError(DeviceError, AssertionError):
    """A model compiled for an offline target (``ConnectionType.Never``) is run: PopTorch's
    ``AssertionError``."""


class OptimizerError(Error, ValueError):
    """An optimizer or one of its arguments is not supported."""


class DataLoaderError(Error, ValueError):
    """A DataLoader or AsynchronousDataAccessor argument is invalid."""


class CheckpointError(Error):
    """A checkpoint file is missing, truncated, foreign, or does not fit the model."""


class UnknownAttributeError(Error, AttributeError):
    """An options group or an optimizer has no attribute of that name (a typo, usually)."""


class ScheduleError(Error, ValueError):
    """A schedule grid, an action's text form or a timeline is invalid (``schedule``,
    ``schedule_kinds`` and ``timeline``, which take no torch objects)."""


class ExecutionError(Error):
    """An action failed while running: names its stream, stage, micro-batch and schedule row."""


class CustomOpError(Error, ValueError):
    """A custom op nobody registered, or called against what PopTorch allows (``custom_ops``)."""


class ChannelError(Error):
    """A message to or from a stage in another process went astray (that process failed,
    exited or hung): the processes are out of step ([Note: stages in other processes])."""


# [Note: warnings]
# Options and arguments that only tune IPU hardware are accepted and ignored with
# one warning each per process (never silently); `warn_once` keeps the record.


class PoptorchLiteWarning(UserWarning):
    """Base class of poptorch_lite's warnings."""


class IpuOnlyWarning(PoptorchLiteWarning):
    """An option or argument that only means something on an IPU was accepted and ignored."""


_warned: set[str] = set()


def first_time(key: str) -> bool:
    """Whether ``key`` is seen for the first time in this process (then it is remembered):
    what :func:`warn_once` and the log's one-time notes ask."""
    if key in _warned:
        return False
    _warned.add(key)
    return True


def warn_once(key: str, message: str, category: type[Warning] = IpuOnlyWarning,
              stacklevel: int = 3, at: tuple[str, int] | None = None) -> bool:
    """Issue ``message`` as a warning the first time ``key`` is seen in this process.

    Args:
        key: what the warning is about (an option name, say); later calls with the
            same key are silent.
        message: the warning text.
        category: the warning class.
        stacklevel: passed to ``warnings.warn`` (3: the caller of the function that warns).
        at: ``(file, line)`` the warning is about (a line of the user's model, read off the
            trace), given instead of a frame of the call stack.

    Returns:
        True when the warning was issued, False when ``key`` had been seen before.

    Example:
        >>> warn_once("Precision.enableStochasticRounding", "ignored: IPU-only")  # doctest: +SKIP
        True
    """
    import warnings

    if not first_time(key):
        return False
    if at is None:
        warnings.warn(message, category, stacklevel=stacklevel)
    else:
        warnings.warn_explicit(message, category, at[0], at[1])
    return True


# [Note: frames a user sees]
# A refusal is about the user's code, so the user's lines are what its traceback should
# show. Under pytest, the modules a call passes through on its way to the trace set
# ``__tracebackhide__ = hide_when_refused``, which hides their frames when the exception
# is one of ours (an internal bug shows them all; ``pytest --full-trace`` always does).
# The trace itself runs the user's forward under torch's make_fx, so ``tracing.trace``
# also drops torch's frames and ours from a refusal's traceback, and from an exception the
# forward raised itself (``RAISED_IN_TRACE`` marks it), keeping the user's: the forward's
# line is the last one shown.

RAISED_IN_TRACE = "_poptorch_lite_raised_in_trace"  # an exception's attribute


def hide_when_refused(excinfo) -> bool:
    """pytest's ``__tracebackhide__`` hook: hide a frame when a poptorch_lite Error passes it.

    ([Note: frames a user sees].)

    Example:
        >>> __tracebackhide__ = hide_when_refused  # at the top of a module
    """
    return excinfo is not None and (isinstance(excinfo.value, Error)
                                    or getattr(excinfo.value, RAISED_IN_TRACE, False))
