"""The one exception the checkpoint code raises for bad files and bad tensors."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be read as asked: a missing file or tensor, a tensor of the wrong
    dtype or shape, a truncated or corrupt file, tensors that do not fit together. The message
    names the tensor (and file) concerned."""
