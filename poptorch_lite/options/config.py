"""Options set from text: ``loadFromFile`` lines and JSON, parsed, never executed.

PopTorch ``exec()``s each line of an options file with ``poptorch`` in scope.
poptorch_lite parses each line with ``ast`` and accepts only a call of an
option setter by its accessor path (``Training.gradientAccumulation(4)``) whose
arguments are literals, members of poptorch's enums (``poptorch.OutputMode.All``),
or calls of the strategy and settings constructors with the same kind of
arguments (``poptorch.Stage("a").ipu(1)``). Nothing else runs, so a config
file cannot import, open files or call arbitrary code.

``from_json`` / ``POPTORCH_DEFAULT_OPTIONS`` set options by accessor path:
``{"deviceIterations": 4, "Training.gradient_accumulation": 2,
"Distributed.configureProcessId": [0, 2]}``: a setter name receives the value
as its argument (a JSON list is the argument list when the setter takes more
than one); a snake_case name is assigned as an attribute.

Example:
    >>> from poptorch_lite.options import Options
    >>> apply_line(Options(), "Training.gradientAccumulation(4)").gradient_accumulation
    4
"""

from __future__ import annotations

import ast
import inspect
import json
from typing import Any

import torch

from .. import enums, errors, phases, strategies
from .ipu import TensorLocationSettings

#: Setters that cannot be called from an options file or JSON.
_NOT_FROM_TEXT = frozenset({"loadFromFile", "from_json"})

#: ``poptorch.<name>`` values an options file may use.
_NAMES: dict[str, Any] = {
    **{name: getattr(enums, name) for name in (
        "OutputMode", "AnchorMode", "ReductionType", "MeanReductionStrategy",
        "DataLoaderMode", "SharingStrategy", "ConnectionType", "SyncPattern",
        "CommGroupType", "Liveness", "AutoStage", "HalfFloatCastingBehavior",
        "PipelineSchedule")},
    **{name: getattr(strategies, name) for name in (
        "Stage", "PipelinedExecution", "ShardedExecution")},
    **{name: getattr(phases, name) for name in (
        "Phase", "SerialPhasedExecution", "ParallelPhasedExecution")},
    "TensorLocationSettings": TensorLocationSettings,
}
_CONSTRUCTORS = (strategies.Stage, phases.Phase, strategies.PipelinedExecution,
                 strategies.ShardedExecution, phases.SerialPhasedExecution,
                 phases.ParallelPhasedExecution, TensorLocationSettings)
#: Methods that may be chained on a constructed object: (class, names).
_METHODS = (
    (strategies.Stage, {"ipu"}),
    (phases.Phase, {"ipus"}),
    (phases.SerialPhasedExecution, {"useSeparateBackwardPhase", "setTensorsLiveness"}),
    (phases.ParallelPhasedExecution, {"useSeparateBackwardPhase",
                                      "sendTensorsOffChipAfterFwd"}),
    (TensorLocationSettings, {"minElementsForOffChip", "minElementsForReplicatedTensorSharding",
                              "useOnChipStorage", "useReplicatedTensorSharding",
                              "useIOTilesToLoad", "useIOTilesToStore"}),
)
_TORCH_DTYPES = {"float": torch.float32, "float32": torch.float32,
                 "half": torch.float16, "float16": torch.float16}


class _Refused(Exception):
    """A line or value that is not allowed; the message says why."""


def _dotted(node: ast.AST) -> list[str]:
    """``a.b.c`` as ["a", "b", "c"]; refuses anything that is not a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _Refused(f"'{ast.unparse(node)}' is not a name")
    return [node.id, *reversed(parts)]


def _named(node: ast.AST) -> Any:
    """A whitelisted ``poptorch.X[.Member]`` or ``torch.<float dtype>``."""
    parts = _dotted(node)
    text = ".".join(parts)
    if parts[0] == "torch" and len(parts) == 2 and parts[1] in _TORCH_DTYPES:
        return _TORCH_DTYPES[parts[1]]
    if parts[0] not in ("poptorch", "poptorch_lite") or len(parts) < 2 or parts[1] not in _NAMES:
        raise _Refused(f"'{text}' is not allowed; only poptorch.<enum>.<member>, "
                       f"poptorch.<strategy class>, torch.float and torch.half are")
    value = _NAMES[parts[1]]
    for part in parts[2:]:
        members = getattr(value, "__members__", None)
        if members is None or part not in members:
            raise _Refused(f"'{text}' is not allowed: {'.'.join(parts[:2])} has no "
                           f"member '{part}'")
        value = members[part]
    return value


def _call(node: ast.Call) -> Any:
    """A whitelisted constructor call, or a whitelisted method on its result."""
    args, kwargs = _arguments(node)
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
        receiver = _call(func.value)
        allowed = set().union(*(names for cls, names in _METHODS if isinstance(receiver, cls)))
        if func.attr not in allowed:
            raise _Refused(f"method '.{func.attr}()' is not allowed on "
                           f"{type(receiver).__name__}; allowed: {sorted(allowed)}")
        return getattr(receiver, func.attr)(*args, **kwargs)
    target = _named(func)
    if target not in _CONSTRUCTORS:
        raise _Refused(f"'{ast.unparse(func)}' cannot be called; only the "
                       f"constructors {[c.__name__ for c in _CONSTRUCTORS]} can")
    return target(*args, **kwargs)


def _value(node: ast.AST) -> Any:
    """Evaluate an argument: literals, containers, whitelisted names and calls."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_value(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Refused("'**' unpacking is not allowed")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant):
        return ast.literal_eval(node)
    if isinstance(node, ast.Attribute):
        return _named(node)
    if isinstance(node, ast.Call):
        return _call(node)
    raise _Refused(f"'{ast.unparse(node)}' is not allowed; arguments must be "
                   f"literals, poptorch enum members or strategy constructors")


def _arguments(node: ast.Call) -> tuple[list, dict]:
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise _Refused("'*' and '**' arguments are not allowed")
    return [_value(a) for a in node.args], {k.arg: _value(k.value) for k in node.keywords}


def resolve_setter(options, path: list[str]):
    """Return the bound setter at accessor ``path`` (e.g. ["Training", "gradientAccumulation"]).

    Raises:
        _Refused: a step is not an option group or the last is not a setter.

    Example:
        >>> from poptorch_lite.options import Options
        >>> resolve_setter(Options(), ['Training', 'gradientAccumulation'])(2).gradient_accumulation
        2
    """
    group = options
    for name in path[:-1]:
        if name not in type(group)._GROUPS:
            raise _Refused(f"'{name}' is not an option group of {group._PATH}; "
                           f"groups: {list(type(group)._GROUPS)}")
        group = getattr(group, name)
    name = path[-1]
    method = getattr(type(group), name, None)
    if not getattr(method, "is_setter", False) or name in _NOT_FROM_TEXT:
        setters = sorted(n for n in dir(type(group)) if n not in _NOT_FROM_TEXT
                         and getattr(getattr(type(group), n, None), "is_setter", False))
        raise _Refused(f"'{name}' is not a setter of {group._PATH}; setters: {setters}")
    return getattr(group, name)


def apply_line(options, text: str):
    """Apply one options-file line, e.g. ``"deviceIterations(4)"``, to ``options``.

    Raises:
        _Refused: the line is not one allowed setter call.

    Example:
        >>> from poptorch_lite.options import Options
        >>> apply_line(Options(), "outputMode(poptorch.OutputMode.All)").output_mode
        <OutputMode.All: 2>
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise _Refused(f"syntax error: {e.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call):
        raise _Refused("the line is not a setter call")
    try:
        path = _dotted(call.func)
    except _Refused:
        raise _Refused(f"'{ast.unparse(call.func)}' is not a setter path such as "
                       f"'Training.gradientAccumulation'") from None
    setter_fn = resolve_setter(options, path)
    args, kwargs = _arguments(call)
    return setter_fn(*args, **kwargs)


def load_file(options, path) -> None:
    """Apply every non-blank, non-``#`` line of the file at ``path``, in order.

    Raises:
        errors.ConfigFileError: naming the file, line number, text and fix.
        errors.FrozenOptionsError: ``options`` are frozen.

    Example:
        >>> load_file(Options(), "poptorch.conf")  # doctest: +SKIP
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise errors.ConfigFileError(f"Cannot read options file {path}: {e}; pass the "
                                     f"path of an existing text file") from e
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            apply_line(options, text)
        except errors.FrozenOptionsError:
            raise
        except (_Refused, errors.Error, TypeError, ValueError) as e:
            raise errors.ConfigFileError(
                f"{path}:{lineno}: invalid option line {text!r}: {e}. Each line must "
                f"be one setter call without the 'options.' prefix, e.g. "
                f"'deviceIterations(4)' or 'Training.gradientAccumulation(8)', with "
                f"literal or poptorch.<enum> arguments; fix or remove the line") from e


def apply_json(options, text: str, source: str = "from_json") -> None:
    """Set options from a JSON object of ``{"accessor.path": value}``.

    Raises:
        errors.OptionsError: invalid JSON, unknown path or invalid value.

    Example:
        >>> from poptorch_lite.options import Options
        >>> o = Options()
        >>> apply_json(o, '{"deviceIterations": 3, "Training.gradient_accumulation": 2}')
        >>> o.device_iterations, o.Training.gradient_accumulation
        (3, 2)
    """
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise errors.OptionsError(f"{source}: invalid JSON ({e}) in {text!r}; pass an "
                                  f"object such as '{{\"deviceIterations\": 4}}'") from e
    if not isinstance(values, dict):
        raise errors.OptionsError(f"{source}: expected a JSON object of "
                                  f"{{\"accessor.path\": value}}, got {text!r}")
    for key, value in values.items():
        path = key.split(".")
        try:
            group = options
            for name in path[:-1]:
                if name not in type(group)._GROUPS:
                    raise _Refused(f"'{name}' is not an option group")
                group = getattr(group, name)
            if path[-1] in type(group)._ATTRIBUTES:
                setattr(group, path[-1], value)
                continue
            setter_fn = resolve_setter(options, path)
            params = inspect.signature(setter_fn).parameters.values()
            spread = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) > 1 \
                or any(p.kind == p.VAR_POSITIONAL for p in params)
            setter_fn(*value) if spread and isinstance(value, list) else setter_fn(value)
        except errors.FrozenOptionsError:
            raise
        except (_Refused, errors.Error, TypeError) as e:
            raise errors.OptionsError(f"{source}: cannot set {key!r} to {value!r}: {e}; "
                                      f"use a setter path such as 'deviceIterations' "
                                      f"or an attribute such as "
                                      f"'Training.gradient_accumulation'") from e
