"""``Options.compileStages``: poptorch_lite's compiled stages ([Note: compiled stages] in
``compiler/compiled_stages``).

Example:
    >>> from poptorch_lite.options import Options
    >>> Options().compileStages().compile_stages
    True
"""

from __future__ import annotations

from typing import Optional

from .. import errors
from .base import check_bool, setter

#: The backends ``Options.compileStages`` takes (``torch.compile``'s names).
BACKENDS = ("inductor", "aot_eager")


class CompileOptions:
    """The compiling setter of ``Options`` (a mixin)."""

    @setter
    def compileStages(self, enabled: bool = True, backend: Optional[str] = None):
        """Compile each stage's graphs once, as PopTorch compiles its program (poptorch_lite's
        own; off by default).

        Off, every op runs eagerly and a call is bit-exact to plain PyTorch. On, each
        stage's forward and backward (and a recomputed stage's segments) are compiled by
        ``backend`` on the stage's first call: fused kernels, the numbers within float
        reassociation of plain PyTorch (1e-4 relative over 20 steps), dropout masks still
        plain PyTorch's (docs/TUTORIAL.md, section 9). A stage too small for compiling to
        pay, or one the backend cannot compile, runs eagerly, and the log says which and
        why ([Note: compiled stages] in ``compiler/compiled_stages``).

        Args:
            enabled: compile the stages.
            backend: ``"inductor"`` (fused kernels) or ``"aot_eager"`` (AOTAutograd's
                forward and backward graphs, run by eager kernels: quick to compile, for
                checking); None: the default of each stage's device, ``"inductor"`` on
                CPUs and GPUs.

        Raises:
            OptionsError: a backend not among those.

        Example:
            >>> from poptorch_lite.options import Options
            >>> opts = Options().compileStages(True, backend="aot_eager")
            >>> opts.compile_stages, opts.compile_backend
            (True, 'aot_eager')
        """
        if backend is not None and backend not in BACKENDS:
            raise errors.OptionsError(
                f"compileStages: backend {backend!r} is not one of {list(BACKENDS)}; pass one "
                f"of those, or None for the default of each stage's device (inductor)")
        self._store(compile_stages=check_bool(enabled, "compileStages"), compile_backend=backend)
