"""PopTorch's data loading: ``DataLoader`` and loading ahead in a background thread."""

from .async_data import AsynchronousDataAccessor
from .dataloader import DataLoader

__all__ = ["AsynchronousDataAccessor", "DataLoader"]
