"""PopTorch's module path of :class:`PoplarExecutor` (``poptorch._poplar_executor.PoplarExecutor``)."""

from .wrapper import PoplarExecutor

__all__ = ["PoplarExecutor"]
