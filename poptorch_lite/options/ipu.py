"""IPU-only options: accepted, stored, and ignored with one warning each.

These options only tune IPU hardware, memory placement, compilation or
profiling (POPTORCH_REFERENCE.md §4, class "IPU-only"). poptorch_lite accepts
them with PopTorch's names and validation, stores the value (it reads back as
a snake_case attribute) and warns once per option per process that it has no
effect (see [Note: warnings] in errors.py). ``Options`` inherits
:class:`IpuOnlyOptions`; ``Options.Precision``, ``.TensorLocations``, ``.Jit``
and ``._Popart`` are the groups below.

Example:
    >>> TensorLocationSettings().useOnChipStorage(False).toDict()
    {'onChip': 0}
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import errors
from ..enums import HalfFloatCastingBehavior, SyntheticDataMode
from .base import OptionGroup, check_bool, coerce_enum, setter, via_setter, warn_ipu_only



class _PrecisionOptions(OptionGroup):
    """``Options.Precision``: numerics of IPU float16 (IPU-only).

    Example:
        >>> _PrecisionOptions().setPartialsType(torch.half).partials_type
        torch.float16
    """

    _PATH = "Options.Precision"
    _ATTRIBUTES = {
        "floating_point_exceptions": via_setter("enableFloatingPointExceptions"),
        "stochastic_rounding": via_setter("enableStochasticRounding"),
        "partials_type": via_setter("setPartialsType"),
        "half_float_casting": via_setter("halfFloatCasting"),
        "running_statistics_always_float": via_setter("runningStatisticsAlwaysFloat"),
    }

    def __init__(self):
        super().__init__(floating_point_exceptions=False, stochastic_rounding=False,
                         partials_type=torch.float32,
                         half_float_casting=HalfFloatCastingBehavior.Default,
                         running_statistics_always_float=True)

    @setter
    def enableFloatingPointExceptions(self, enabled: bool):
        """Raise on IPU floating-point exceptions (IPU-only).

        Example:
            >>> _PrecisionOptions().enableFloatingPointExceptions(True).floating_point_exceptions
            True
        """
        self._store(floating_point_exceptions=check_bool(enabled, "enableFloatingPointExceptions"))
        warn_ipu_only(f"{self._PATH}.enableFloatingPointExceptions")

    @setter
    def enableStochasticRounding(self, enabled: bool):
        """Round float16 stochastically on the IPU (IPU-only).

        Example:
            >>> _PrecisionOptions().enableStochasticRounding(True).stochastic_rounding
            True
        """
        self._store(stochastic_rounding=enabled)
        warn_ipu_only(f"{self._PATH}.enableStochasticRounding")

    @setter
    def setPartialsType(self, dtype: torch.dtype):
        """Type of matmul/convolution partials: ``torch.float`` or ``torch.half``.

        Example:
            >>> _PrecisionOptions().setPartialsType(torch.float).partials_type
            torch.float32
        """
        if dtype not in (torch.float32, torch.float16):
            raise errors.OptionsError(
                f"parameter to setPartialsType should be either torch.float or "
                f"torch.half, got {dtype!r}; call Precision.setPartialsType(torch.float)")
        self._store(partials_type=dtype)
        warn_ipu_only(f"{self._PATH}.setPartialsType")

    @setter
    def halfFloatCasting(self, behavior: HalfFloatCastingBehavior):
        """Deprecated casting rule for mixed float16/float32 ops (IPU-only).

        Example:
            >>> _PrecisionOptions().halfFloatCasting(HalfFloatCastingBehavior.HalfUpcastToFloat).half_float_casting
            <HalfFloatCastingBehavior.HalfUpcastToFloat: 1>
        """
        self._store(half_float_casting=coerce_enum(
            behavior, HalfFloatCastingBehavior, "Precision.halfFloatCasting"))
        warn_ipu_only(f"{self._PATH}.halfFloatCasting")

    @setter
    def runningStatisticsAlwaysFloat(self, value: bool):
        """Keep BatchNorm running statistics in float32 (IPU-only).

        Example:
            >>> _PrecisionOptions().runningStatisticsAlwaysFloat(False).running_statistics_always_float
            False
        """
        self._store(running_statistics_always_float=check_bool(
            value, "runningStatisticsAlwaysFloat"))
        warn_ipu_only(f"{self._PATH}.runningStatisticsAlwaysFloat")


class _JitOptions(OptionGroup):
    """``Options.Jit``: ``traceModel``, PopTorch 3.0's way back to its tracer before the
    dispatcher.

    Example:
        >>> _JitOptions().trace_model
        False
    """

    _PATH = "Options.Jit"
    _ATTRIBUTES = {"trace_model": via_setter("traceModel")}

    def __init__(self):
        super().__init__(trace_model=False)

    @setter
    def traceModel(self, trace_model: bool):
        """True: the tensor names of PopTorch before 3.0, whose ``torch.jit.trace`` named the
        model's tensors under ``model.`` (``Gradient___model.<name>``, as SDK 2 programs
        anchor them: [Note: anchored tensors] in ``runtime/anchors``); the model is traced as
        always. PopTorch 3.0 kept the old tracer behind this option, deprecated.

        Example:
            >>> _JitOptions().traceModel(False).trace_model
            False
        """
        self._store(trace_model=check_bool(trace_model, "Jit.traceModel"))
        if trace_model:
            errors.warn_once("Jit.traceModel", "Options.Jit.traceModel(True) is deprecated "
                             "(PopTorch 3.0): the model is traced as always, and only the "
                             "tensor names are those before PopTorch 3.0 "
                             "(Gradient___model.<name>)", errors.PoptorchLiteWarning)
        else:
            warn_ipu_only(f"{self._PATH}.traceModel")


def _synthetic_data_mode(value: Any) -> SyntheticDataMode:
    """``value`` as PopART's SyntheticDataMode, warning once that it replaces the inputs."""
    if isinstance(value, bool) or value not in set(SyntheticDataMode):
        raise errors.OptionsError(
            f"syntheticDataMode must be PopART's SyntheticDataMode, 0 (Off), 1 (Zeros) or 2 "
            f"(RandomNormal), got {value!r}; call e.g. "
            f"opts.enableSyntheticData(int(popart.SyntheticDataMode.RandomNormal))")
    mode = SyntheticDataMode(value)
    if mode != SyntheticDataMode.Off:
        errors.warn_once(
            "syntheticDataMode",
            f"synthetic data ({mode.name}): the host's inputs are not used; the model sees "
            f"{'zeros' if mode == SyntheticDataMode.Zeros else 'random-normal data'} of the "
            f"same shapes, so its outputs, losses and trained weights differ from what the "
            f"inputs would give", errors.PoptorchLiteWarning, stacklevel=5)
    return mode


class _PopartOptions(OptionGroup):
    """``Options._Popart``: raw PopART session options (advanced users).

    Two keys have an effect here. ``set("autoRecomputation", n)`` is
    ``Options.auto_recomputation`` (PopART's RecomputationType: 0 none,
    1 standard, 2 norms only, 3 pipeline = recompute every forward stage, 4 all).
    ``set("syntheticDataMode", m)`` (``enableSyntheticData`` sets it) replaces the
    inputs as PopART does ([Note: synthetic data] in ``runtime/batch.py``). Every
    other key is stored in :attr:`options` and ignored with a warning.

    Example:
        >>> _PopartOptions().set("autoRecomputation", 3).options["autoRecomputation"]
        3
    """

    _PATH = "Options._Popart"

    @property
    def options(self) -> dict[str, Any]:
        """The stored key/value pairs (PopTorch's ``_Popart.options``)."""
        return self._values

    @setter
    def set(self, key: str, value: Any):
        """Set PopART session option ``key``.

        Raises:
            errors.OptionsError: ``key`` is not a str, or autoRecomputation is
                not a non-negative int.

        Example:
            >>> _PopartOptions().set('enableStableNorm', True).options
            {'enableStableNorm': True}
        """
        if not isinstance(key, str):
            raise errors.OptionsError(
                f"_Popart.set needs a str key, got {key!r}; call e.g. "
                f"opts._Popart.set('autoRecomputation', 3)")
        if key == "autoRecomputation":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise errors.OptionsError(
                    f"autoRecomputation must be a non-negative int (PopART's "
                    f"RecomputationType), got {value!r}; call "
                    f"opts._Popart.set('autoRecomputation', 3) to recompute all "
                    f"forward stages, or 0 to disable")
        elif key == "syntheticDataMode":
            value = _synthetic_data_mode(value)
        else:
            warn_ipu_only(f"{self._PATH}.set('{key}')")
        self._store(**{key: value})

    @setter
    def setEngineOptions(self, engine_options: dict):
        """Poplar engine options (IPU-only).

        Example:
            >>> _PopartOptions().setEngineOptions({'opt': '1'}).options
            {'engineOptions': {'opt': '1'}}
        """
        if not isinstance(engine_options, dict):
            raise errors.OptionsError(
                f"setEngineOptions needs a dict, got {engine_options!r}; call e.g. "
                f"opts._Popart.setEngineOptions({{'debug.allowOutOfMemory': 'true'}})")
        self._store(engineOptions=dict(engine_options))
        warn_ipu_only(f"{self._PATH}.setEngineOptions")

    @setter
    def setPatterns(self, patterns: dict, level: int = 2):
        """Override PopART's graph patterns (IPU-only).

        Example:
            >>> _PopartOptions().setPatterns({'PadSum': True}).options['patterns']
            {'PadSum': True}
        """
        if not isinstance(patterns, dict) or isinstance(level, bool) or not isinstance(level, int):
            raise errors.OptionsError(
                f"setPatterns needs a dict of pattern names and an int level, got "
                f"{patterns!r}, {level!r}; call e.g. opts._Popart.setPatterns({{'X': True}}, 2)")
        self._store(patterns=dict(patterns), patterns_level=level)
        warn_ipu_only(f"{self._PATH}.setPatterns")


class TensorLocationSettings:
    """Where one kind of tensor is stored on an IPU (IPU-only; chainable).

    Passed to ``Options.TensorLocations.set*Location``.

    Example:
        >>> TensorLocationSettings().minElementsForOffChip(128).useIOTilesToLoad().toDict()
        {'minElementsForOffChip': 128, 'useIOTilesToLoad': 1}
    """

    def __init__(self):
        self._values: dict[str, int] = {}

    def _int(self, key: str, value: Any) -> TensorLocationSettings:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise errors.OptionsError(
                f"TensorLocationSettings.{key} needs a non-negative int, got {value!r}; "
                f"call e.g. TensorLocationSettings().{key}(0)")
        self._values[key] = value
        return self

    def _flag(self, key: str, method: str, use: Any) -> TensorLocationSettings:
        self._values[key] = int(check_bool(use, f"TensorLocationSettings().{method}"))
        return self

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        """Tensors with fewer elements are never off-chip.

        Example:
            >>> TensorLocationSettings().minElementsForOffChip(64).toDict()
            {'minElementsForOffChip': 64}
        """
        return self._int("minElementsForOffChip", min_elements)

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> TensorLocationSettings:
        """Tensors with fewer elements are never sharded across replicas.

        Example:
            >>> TensorLocationSettings().minElementsForReplicatedTensorSharding(8).toDict()
            {'minElementsForReplicatedTensorSharding': 8}
        """
        return self._int("minElementsForReplicatedTensorSharding", min_elements)

    def useOnChipStorage(self, use: Optional[bool] = True) -> TensorLocationSettings:
        """On-chip (True) or off-chip (False) storage; None leaves it undefined.

        Example:
            >>> TensorLocationSettings().useOnChipStorage(True).toDict()
            {'onChip': 1}
        """
        if use is None:
            self._values.pop("onChip", None)
            return self
        return self._flag("onChip", "useOnChipStorage", use)

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        """Shard the tensor across replicas.

        Example:
            >>> TensorLocationSettings().useReplicatedTensorSharding().toDict()
            {'useReplicatedTensorSharding': 1}
        """
        return self._flag("useReplicatedTensorSharding", "useReplicatedTensorSharding", use)

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        """Load the tensor through IO tiles.

        Example:
            >>> TensorLocationSettings().useIOTilesToLoad(False).toDict()
            {'useIOTilesToLoad': 0}
        """
        return self._flag("useIOTilesToLoad", "useIOTilesToLoad", use)

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        """Store the tensor through IO tiles.

        Example:
            >>> TensorLocationSettings().useIOTilesToStore().toDict()
            {'useIOTilesToStore': 1}
        """
        return self._flag("useIOTilesToStore", "useIOTilesToStore", use)

    def toDict(self) -> dict[str, int]:
        """The settings as a dict of PopART names.

        Example:
            >>> TensorLocationSettings().toDict()
            {}
        """
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorLocationSettings) and other._values == self._values

    def __repr__(self) -> str:
        return f"TensorLocationSettings({self._values})"


class _TensorLocationOptions(OptionGroup):
    """``Options.TensorLocations``: tensor placement on the IPU (IPU-only).

    Example:
        >>> _TensorLocationOptions().numIOTiles(32).num_io_tiles
        32
    """

    _PATH = "Options.TensorLocations"
    _ATTRIBUTES = {"num_io_tiles": via_setter("numIOTiles")}

    def __init__(self):
        super().__init__(num_io_tiles=0, location_activation=None, location_weight=None,
                         location_optimizer=None, location_accumulator=None)

    @setter
    def numIOTiles(self, num_tiles: int):
        """Reserve IO tiles: an even number between 32 and 192.

        Example:
            >>> _TensorLocationOptions().numIOTiles(64).num_io_tiles
            64
        """
        if (isinstance(num_tiles, bool) or not isinstance(num_tiles, int)
                or not 32 <= num_tiles <= 192 or num_tiles % 2):
            raise errors.OptionsAssertionError(
                f"numIOTiles must be an even number between 32 and 192, got "
                f"{num_tiles!r}; call e.g. opts.TensorLocations.numIOTiles(32)")
        self._store(num_io_tiles=num_tiles)
        warn_ipu_only(f"{self._PATH}.numIOTiles")

    def _location(self, kind: str, location: TensorLocationSettings, ipu_only=True) -> None:
        method = f"set{kind.capitalize()}Location"
        if not isinstance(location, TensorLocationSettings):
            raise errors.OptionsError(
                f"{method} needs a poptorch.TensorLocationSettings, got "
                f"{location!r}; call e.g. opts.TensorLocations.{method}("
                f"poptorch.TensorLocationSettings().useOnChipStorage(False))")
        self._store(**{f"location_{kind}": location.toDict()})
        if ipu_only:
            warn_ipu_only(f"{self._PATH}.{method}")

    @setter
    def setActivationLocation(self, location: TensorLocationSettings):
        """Where activations live (IPU-only).

        Example:
            >>> _TensorLocationOptions().setActivationLocation(TensorLocationSettings().useOnChipStorage(False)).location_activation
            {'onChip': 0}
        """
        self._location("activation", location)

    @setter
    def setWeightLocation(self, location: TensorLocationSettings):
        """Where weights live (IPU-only).

        Example:
            >>> _TensorLocationOptions().setWeightLocation(TensorLocationSettings().useOnChipStorage()).location_weight
            {'onChip': 1}
        """
        self._location("weight", location)

    @setter
    def setOptimizerLocation(self, location: TensorLocationSettings):
        """Where optimizer state lives: ``useOnChipStorage(False)`` offloads it to the host;
        ``useReplicatedTensorSharding(True)`` shards it over data-parallel processes.

        Offloaded, the optimizer state and the update live in host memory: each
        step gathers the gradients onto the host parameters, steps there, and
        refreshes the stages' copies ([Note: weight homes] in ``weights``), which
        saves the devices the optimizer state's memory. Sharded, each of N
        data-parallel processes holds 1/N of it ([Note: sharded optimizer state] in
        ``distributed/sharding.py``; the replicas within one process share one copy
        already). The other settings only tune an IPU (accepted and ignored with one
        warning).

        Example:
            >>> t = _TensorLocationOptions().setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))
            >>> t.location_optimizer, t.offload_optimizer
            ({'onChip': 0}, True)
        """
        tuned = set(location.toDict()) - {"onChip", "useReplicatedTensorSharding"}
        self._location("optimizer", location, ipu_only=tuned)

    @property
    def offload_optimizer(self) -> bool:
        """Whether ``setOptimizerLocation`` put the optimizer state in host memory."""
        return (self.location_optimizer or {}).get("onChip", 1) == 0

    @setter
    def setAccumulatorLocation(self, location: TensorLocationSettings):
        """Where gradient accumulators live (IPU-only).

        Example:
            >>> _TensorLocationOptions().setAccumulatorLocation(TensorLocationSettings()).location_accumulator
            {}
        """
        self._location("accumulator", location)
