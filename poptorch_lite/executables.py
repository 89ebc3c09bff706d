"""PopTorch's saved executables: ``save``, ``compileAndExport``, ``loadExecutable``, ``load``.

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

from .errors import CheckpointError, DeviceError

_LOG = logging.getLogger("poptorch_lite")
FORMAT, VERSION = "poptorch_lite executable", 1


def _path(filename) -> str:
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


class Executables:
    """The ``save``/``compileAndExport``/``loadExecutable`` methods of ``PoplarExecutor``
    ([Note: saved executables])."""

    def save(self, filename, export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save what the compiled model needs to run again: its options and compiling
        arguments, and with ``export_model`` the model and optimizer.

        Raises:
            DeviceError: the model has not been compiled.
        """
        if not self._compiled or self._executable_inputs is None:
            raise DeviceError("Model has not been compiled or has been destroyed: call "
                              "compile(*args) or the model before save()")
        inputs = self._executable_inputs
        data = {"format": FORMAT, "version": VERSION, "training": self._training,
                "options": self._options.clone(), "args": list(inputs.args),
                "kwargs": dict(inputs.kwargs), "model": None, "optimizer": None, "rng": None}
        if export_model:
            self._weights.to_host()  # [Note: weight sync]
            data["model"], data["optimizer"] = self._user_model, self._optimizer
        if save_rng_state and self._random is not None:
            data["rng"] = self._random.get_state()
        torch.save(data, _path(filename))

    def compileAndExport(self, filename, *args, export_model: bool = True, **kwargs) -> None:
        """Compile for ``args`` and ``kwargs`` (the model's own arguments), then ``save``."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def loadExecutable(self, filename) -> None:
        """Compile this wrapper for the arguments a saved file was compiled for.

        Raises:
            CheckpointError: the file is not one ``save`` wrote.
        """
        data = read(filename)
        self.compile(*data["args"], **data["kwargs"])
        if data["rng"] is not None and self._random is not None:
            self._random.set_state(data["rng"])
