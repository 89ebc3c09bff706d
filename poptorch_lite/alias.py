"""``import poptorch`` resolves to poptorch_lite: in this process, and in the processes it starts.

``alias_poptorch`` makes ``poptorch`` and ``poptorch.X`` the modules of poptorch_lite, and
``popart``/``popdist`` the stand-ins of ``side_modules`` where no real ones are installed;
``reach_children`` gives the same to child processes, through ``_alias/`` on their path.
``cli`` (``poptorch-lite run``) and ``poprun`` (every instance) use it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

_NOT_ALIASED = {"__main__", "alias", "cli", "poprun", "side_modules"}  # no part of PopTorch's API
# Holds ``poptorch/__init__.py``, which makes the alias in a child process (not a package of
# poptorch_lite: it has no ``__init__.py`` of its own, so the alias never walks into it).
CHILD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_alias")


def alias_poptorch() -> None:
    """Make ``import poptorch`` and ``import poptorch.X`` give poptorch_lite and its modules,
    and ``import popart`` / ``import popdist`` the stand-ins of ``side_modules`` where no real
    one is installed. The alias reaches child processes too (:func:`reach_children`).

    Example:
        >>> alias_poptorch()
        >>> import poptorch, poptorch_lite
        >>> poptorch is poptorch_lite and poptorch.optim is poptorch_lite.optim
        True
    """
    package = importlib.import_module("poptorch_lite")
    sys.modules["poptorch"] = package
    for info in pkgutil.walk_packages(package.__path__, "poptorch_lite."):
        name = info.name.removeprefix("poptorch_lite.")
        if name not in _NOT_ALIASED:  # subpackages too: poptorch.options, poptorch.optim, ...
            sys.modules[f"poptorch.{name}"] = importlib.import_module(info.name)
    importlib.import_module("poptorch_lite.side_modules").install()
    reach_children()


def reach_children() -> None:
    """Give this process's children the alias: a process started with ``spawn`` or
    ``forkserver`` (a DataLoader's workers under those start methods, a user's
    ``multiprocessing``), and a subprocess running Python, do not inherit ``sys.modules``, so
    their ``import poptorch`` (or unpickling an object whose module imports it) would fail, or
    find another poptorch than their parent's. :data:`CHILD_PATH` goes on ``sys.path`` right
    after the script's folder (spawned children copy the parent's path) and first on
    ``PYTHONPATH`` (which every subprocess inherits). Idempotent."""
    if CHILD_PATH not in sys.path:
        sys.path.insert(min(1, len(sys.path)), CHILD_PATH)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if CHILD_PATH not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([CHILD_PATH] + paths)
