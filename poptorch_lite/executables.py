"""PopTorch's saved executables: the file ``save`` writes and ``loadExecutable`` and ``load`` read.

[Note: saved executables]
PopTorch compiles a model into an executable that it can save beside the pickled model,
optimizer and random state, and ``poptorch.load(file)`` rebuilds the wrapper without
compiling again. Here a program is a trace, made again in a second, so a saved
"executable" is what the trace needs: the wrapper's options, the arguments of the call
that compiled it (micro-batch 0 is traced from them) and, with ``export_model=True``, the
user's model and optimizer (pickled together, so the optimizer keeps its parameters) and
the model's own random state (``Options.randomSeed``). ``loadExecutable`` and ``load``
compile from those arguments, so the loaded wrapper runs the same program. The file is a
``torch.save`` pickle: load only files you trust, as with PopTorch's.
"""

from __future__ import annotations

import logging
import os

import torch

from .errors import CheckpointError

_LOG = logging.getLogger("poptorch_lite")
FORMAT, VERSION = "poptorch_lite executable", 1


def target_path(filename) -> str:
    """``filename``, or ``<dir>/model.poptorch`` when it is a folder (as PopTorch saves)."""
    filename = os.fspath(filename)
    if os.path.isdir(filename):
        path = os.path.join(filename, "model.poptorch")
        _LOG.warning("save(): %s is a directory, saving model to %s", filename, path)
        return path
    folder = os.path.dirname(filename)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return filename


def read(filename) -> dict:
    """The contents of a file ``save`` wrote.

    Raises:
        CheckpointError: it is missing, or not such a file.
    """
    try:
        data = torch.load(os.fspath(filename), weights_only=False)
    except Exception as e:  # a missing file, or another kind of file
        raise CheckpointError(f"Invalid file {os.fspath(filename)!r}: {type(e).__name__}: {e}; "
                              f"load a file written by save() or compileAndExport()") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"Invalid file {os.fspath(filename)!r}: not a poptorch_lite "
                              f"executable; load a file written by save() or compileAndExport()")
    return data
