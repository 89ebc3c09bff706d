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
BACKENDS = ("inductor", "aot_eager", "eager")


class CompileOptions:
    """The compiling setter of ``Options`` (a mixin)."""

    @setter
    def compileStages(self, enabled: bool = True, backend: Optional[str] = None,
                      cuda_graph: bool = True):
        """Compile each stage's graphs once, as PopTorch compiles its program (poptorch_lite's
        own; off by default).

        Off, every op runs eagerly and a call is bit-exact to plain PyTorch. On, each
        stage's forward and backward (and a recomputed stage's segments) are compiled by
        ``backend`` on the stage's first call: fused kernels, the numbers within float
        reassociation of plain PyTorch (1e-4 relative over 20 steps), dropout masks still
        plain PyTorch's (docs/TUTORIAL.md, section 9). A stage too small for compiling to
        pay, or one the backend cannot compile, runs eagerly, and the log says which and
        why ([Note: compiled stages] in ``compiler/compiled_stages``). On a GPU, once the
        program is warm, each optimizer step (every micro-batch's stage actions, the
        reduction and, where it is graph-safe, the optimizer's step) is also captured as
        one CUDA graph and replayed ([Note: step graphs] in ``runtime/step_graph``).

        Args:
            enabled: compile the stages.
            backend: ``"inductor"`` (fused kernels), ``"aot_eager"`` (AOTAutograd's
                forward and backward graphs, run by eager kernels: quick to compile, for
                checking) or ``"eager"`` (no compiler: the stages' own kernels, so a
                captured step replays exactly what the eager path runs); None: the
                default of each stage's device, ``"inductor"`` on CPUs and GPUs.
            cuda_graph: on a GPU, capture each step as one CUDA graph (False: the
                compiled stages run op by op, launched from Python).

        Raises:
            OptionsError: a backend not among those, or a flag that is not a bool.

        Example:
            >>> from poptorch_lite.options import Options
            >>> opts = Options().compileStages(True, backend="aot_eager")
            >>> opts.compile_stages, opts.compile_backend, opts.compile_cuda_graph
            (True, 'aot_eager', True)
        """
        if backend is not None and backend not in BACKENDS:
            raise errors.OptionsError(
                f"compileStages: backend {backend!r} is not one of {list(BACKENDS)}; pass one "
                f"of those, or None for the default of each stage's device (inductor)")
        if not isinstance(cuda_graph, bool):
            raise errors.OptionsError(
                f"compileStages: cuda_graph needs a bool, got {cuda_graph!r} "
                f"({type(cuda_graph).__name__}); pass cuda_graph=True or cuda_graph=False")
        self._store(compile_stages=check_bool(enabled, "compileStages"), compile_backend=backend,
                    compile_cuda_graph=cuda_graph)
