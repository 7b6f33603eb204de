"""The one shape of Ravex's DataLoader iterator wrappers (no torch import here:
``ravex_runtime.session`` must import without it)."""

from __future__ import annotations

from typing import Any

__all__ = ["Passthrough"]


class Passthrough:
    """A DataLoader iterator seen through Ravex: itself as its iterator, the inner
    one's length and attributes; subclasses define ``__next__``."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __iter__(self) -> Passthrough:
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
