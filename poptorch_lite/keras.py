"""The Keras face of the IPU tutorials (``poptorch_lite.keras``), re-exported from ``frontends``.

``from poptorch_lite import keras``; then ``keras.Sequential([...])``,
``model.compile("adam", "sparse_categorical_crossentropy", ["accuracy"],
steps_per_execution=N)``, ``model.fit(x, y)``. See [Note: Keras face] in
``frontends/keras.py``.
"""

from .enums import PipelineSchedule
from .frontends import keras_callbacks as callbacks
from .frontends.keras import Model, Sequential
from .frontends.keras_ipu import IPUConfig, IPUStrategy, PipelineStage, RecomputationMode
from .frontends.keras_losses import losses, optimizers

__all__ = ["IPUConfig", "IPUStrategy", "Model", "PipelineSchedule", "PipelineStage",
           "RecomputationMode", "Sequential", "callbacks", "losses", "optimizers"]
