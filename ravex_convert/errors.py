"""The errors Ravex raises. One root, a few kinds that mean something to a user.

Every message says what failed and names the file; ``hint`` says what to do.
The CLI prints ``error: <message>`` then ``hint: <hint>`` and exits with
``exit_code`` (2 or more: 1 is reserved for "verify found a difference").
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LayoutMismatchError",
    "NotFoundError",
    "RavexError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
]


class RavexError(Exception):
    """Root of every error Ravex raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, path: str | Path | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\nhint: {self.hint}"
        return self.message


class NotFoundError(RavexError):
    """A path the user named does not exist."""

    exit_code = 3


class UnknownFormatError(RavexError):
    """The path exists but is no checkpoint Ravex recognises."""

    exit_code = 4


class IncompleteCheckpointError(RavexError):
    """A checkpoint whose layout is recognised but which lacks files it needs."""

    exit_code = 5


class CorruptCheckpointError(RavexError):
    """A file of a checkpoint cannot be parsed (truncated, overwritten, random bytes)."""

    exit_code = 6


class UnsafeCheckpointError(RavexError):
    """A pickle asks for something the restricted unpickler does not allow."""

    exit_code = 7


class LayoutMismatchError(RavexError):
    """The layout asked for does not fit the checkpoint (world size, shapes, stage)."""

    exit_code = 8
