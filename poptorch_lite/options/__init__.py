"""PopTorch's ``Options``: the options object and its groups (no torch).

- ``options``: :class:`Options` itself, ``combined_batch_size`` and the batch factor;
- ``base``: the machinery of an option group (setters, checks, IPU-only names);
- ``groups``: the ``Training`` and ``Distributed`` groups;
- ``ipu``: the IPU-only groups (``Precision``, ``TensorLocations``, ``_Popart``, ``Jit``);
- ``device``: the poptorch_lite device group (``opts.device``) and device names;
- ``config``: ``loadFromFile``, ``toDict``/``fromDict`` and the options' text form.
"""

from ..errors import ConfigFileError
from .groups import _DistributedOptions
from .ipu import TensorLocationSettings
from .options import Options, combined_batch_size

# PopTorch's names here: ConfigFileError (loadFromFile's error) and _DistributedOptions, which
# popdist subclasses to wrap Options.Distributed.
__all__ = ["ConfigFileError", "Options", "TensorLocationSettings", "_DistributedOptions",
           "combined_batch_size"]
