"""PopTorch's optimizers (``poptorch.optim``): torch's update rules plus PopTorch's arguments.

- ``optimizers``: ``SGD``, ``Adam``, ``AdamW``, ``RMSprop``, ``LAMB`` and their base;
- ``accepted``: the optimizers a wrapper takes, and what it reads of any of them;
- ``extras``: the extra arguments PopTorch's optimizers take, and their checks;
- ``rules``: the update rules torch lacks (LAMB, AdamW without bias correction, TF's RMSprop);
- ``precision``: the optimizer state in the dtypes PopTorch's arguments name;
- ``loss_scale``: the loss scale, fixed or automatic.
"""

from .accepted import (adopt, check_optimizer, copy_hyperparameters, loss_scaling, max_grad_norm,
                       needs_running_mean)
from .optimizers import LAMB, SGD, Adam, AdamW, Optimizer, RMSprop, VariableAttributes

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "LAMB", "VariableAttributes",
           "adopt", "check_optimizer", "loss_scaling", "max_grad_norm", "copy_hyperparameters",
           "needs_running_mean"]
