"""Loss scaling: the factor the loss is multiplied by before backward, fixed or automatic.

[Note: loss scaling]
The loss of every micro-batch is multiplied by the scale before its backward,
and the reduced gradients are divided by it again ([Note: gradient arithmetic]
in ``update``), so in exact arithmetic the scale changes nothing; in float16
it keeps small gradients from underflowing. The scale starts at the
optimizer's ``loss_scaling`` (1.0 for torch's optimizers).

With ``opts.Training.setAutomaticLossScaling(True)`` the update action first
checks the reduced gradients: if any is inf or NaN, the optimizer step is
skipped (parameters and optimizer state stay as they are) and the scale is
halved; after ``growth_interval`` finite steps in a row the scale doubles,
unless that would pass float32's largest number (the loss is multiplied by it in
float32). This is ``torch.amp.GradScaler``'s rule. A poptorch_lite optimizer's
``loss_scaling`` attribute follows the current scale.

Without it, a micro-batch whose loss is not finite stops the call with an
``ExecutionError`` naming the micro-batch (and the call changes nothing).

Example:
    >>> scale = LossScale(4.0, automatic=True, growth_interval=2)
    >>> scale.update(finite=False), scale.scale
    (False, 2.0)
    >>> [scale.update(finite=True) for _ in range(2)], scale.scale
    ([True, True], 4.0)
"""

from __future__ import annotations

import dataclasses

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass
class LossScale:
    """The current loss scale and the counters of automatic loss scaling.

    Attributes:
        scale: the factor the loss is multiplied by.
        automatic: whether non-finite steps are skipped and the scale adapts.
        growth_interval: finite steps in a row after which the scale doubles.
        good_steps: finite steps since the last change of the scale.
        skipped_steps: steps skipped so far for non-finite gradients.
    """

    scale: float = 1.0
    automatic: bool = False
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    BACKOFF = 0.5
    GROWTH = 2.0

    def update(self, finite: bool) -> bool:
        """Count one step's outcome; return whether the optimizer should step."""
        if not self.automatic:
            return True
        if not finite:
            self.scale *= self.BACKOFF
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            if self.scale * self.GROWTH <= FLOAT32_MAX:  # GradScaler grows to finite scales only
                self.scale *= self.GROWTH
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        """The counters as plain numbers (for checkpoints)."""
        return {"scale": float(self.scale), "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Take the counters of :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
