"""The runtime's own error (no torch import: ``import ravex`` stays light)."""

from __future__ import annotations

from ravex_convert.errors import RavexError

__all__ = ["ResumeError"]


class ResumeError(RavexError):
    """The run cannot continue from its store: no checkpoint could be restored into the live
    objects, or a failed restore could not be undone. Raised out of the decorated function
    before the first training step; the objects hold no part of any checkpoint."""
