"""PopTorch's ``Options``: the options object and its groups (no torch).

- ``options``: :class:`Options` itself, ``combined_batch_size`` and the batch factor;
- ``base``: the machinery of an option group (setters, checks, IPU-only names);
- ``groups``: the ``Training`` and ``Distributed`` groups;
- ``ipu``: the IPU-only groups (``Precision``, ``TensorLocations``, ``_Popart``, ``Jit``);
- ``device``: the poptorch_lite device group (``opts.device``) and device names;
- ``config``: ``loadFromFile``, ``toDict``/``fromDict`` and the options' text form.
"""

from .ipu import TensorLocationSettings
from .options import Options, combined_batch_size

__all__ = ["Options", "TensorLocationSettings", "combined_batch_size"]
