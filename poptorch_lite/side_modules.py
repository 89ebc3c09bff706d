"""What PopTorch scripts import beside ``poptorch``: PopART's enums, and PopDist.

``poptorch-lite run`` installs them as ``popart``, ``popdist`` and ``popdist.poptorch`` when no
real module of that name can be imported (``alias.alias_poptorch``). Scripts use ``popart`` only
for the enums they pass to ``opts._Popart.set`` (IPU-only options: stored and ignored, one
warning each), and ``popdist`` to ask which instance of a ``poprun`` (or ``torchrun``) launch
they are: ``distributed/popdist.py`` ([Note: instances]).
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import os
import sys
import types

from .distributed.popdist import popdist_modules
from .enums import SyntheticDataMode

__all__ = ["popart_module", "popdist_modules", "install", "in_child"]


# PopART's SessionOptions enums, with PopART's values (popart/sessionoptions.hpp).
class AccumulateOuterFragmentSchedule(enum.IntEnum):
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    OnEnterAndExit = 0
    JustInTime = 1


class RecomputationType(enum.IntEnum):
    NoRecompute = 0
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4


class VirtualGraphMode(enum.IntEnum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class MergeVarUpdateType(enum.IntEnum):
    NoMerge = 0
    All = 1
    AutoLoose = 2
    AutoTight = 3


class ExecutionPhaseSchedule(enum.IntEnum):
    Interleaving = 0
    Batch = 1
    BatchClusteredIO = 2


class BatchSerializationMethod(enum.IntEnum):
    UnrollDynamic = 0
    UnrollStatic = 1
    Loop = 2


class SyncPattern(enum.IntEnum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MeanReductionStrategy(enum.IntEnum):
    Running = 0
    Post = 1
    PostAndLoss = 2


class ReductionType(enum.IntEnum):
    Sum = 0
    Mean = 1
    NoReduction = 2


_POPART_ENUMS = (AccumulateOuterFragmentSchedule, SubgraphCopyingStrategy, RecomputationType,
                 VirtualGraphMode, MergeVarUpdateType, ExecutionPhaseSchedule,
                 BatchSerializationMethod, SyncPattern, MeanReductionStrategy, ReductionType,
                 SyntheticDataMode)


def popart_module() -> types.ModuleType:
    """A ``popart`` module holding PopART's SessionOptions enums (PopART's values).

    ``None`` is a Python keyword, so PopART's ``RecomputationType.None`` and
    ``MergeVarUpdateType.None`` are also reachable as ``getattr(X, "None")``.

    Example:
        >>> popart = popart_module()
        >>> int(popart.SubgraphCopyingStrategy.JustInTime)
        1
    """
    module = types.ModuleType("popart", "PopART's option enums (poptorch_lite's stand-in).")
    for cls in _POPART_ENUMS:
        setattr(module, cls.__name__, cls)
    for cls, none in ((RecomputationType, RecomputationType.NoRecompute),
                      (MergeVarUpdateType, MergeVarUpdateType.NoMerge)):
        type.__setattr__(cls, "None", none)
    module.__version__ = "poptorch_lite"
    module.__spec__ = importlib.machinery.ModuleSpec("popart", None)  # find_spec works on it
    return module


def install() -> list[str]:
    """Put ``popart``, ``popdist`` and ``popdist.poptorch`` in ``sys.modules`` where no real
    one is importable; returns the names installed.

    Example:
        >>> _ = install()
        >>> importlib.util.find_spec("popart") is not None  # a real one, or the stand-in
        True
    """
    installed = []
    if "popart" not in sys.modules and importlib.util.find_spec("popart") is None:
        sys.modules["popart"] = popart_module()
        installed.append("popart")
    if "popdist" not in sys.modules and importlib.util.find_spec("popdist") is None:
        sys.modules["popdist"], sys.modules["popdist.poptorch"] = popdist_modules()
        installed += ["popdist", "popdist.poptorch"]
    return installed


def in_child(name: str, placeholder: str) -> None:
    """``import popart`` or ``import popdist`` in a child process of ``poptorch-lite run``
    (``alias.CHILD_PATH``, the folder of the ``placeholder`` file being imported, comes first on
    its path: ``alias.reach_children``): the real module further down the path where there is
    one, else the stand-in, as :func:`install` gives the parent. The placeholder is replaced."""
    children = os.path.dirname(os.path.dirname(os.path.abspath(placeholder)))
    del sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec(
        name, [p for p in sys.path if os.path.abspath(p or ".") != children])
    if spec is not None:
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif name == "popart":
        sys.modules[name] = popart_module()
    else:
        sys.modules["popdist"], sys.modules["popdist.poptorch"] = popdist_modules()
