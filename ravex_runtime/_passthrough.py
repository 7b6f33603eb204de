"""The one shape of Ravex's DataLoader iterator wrappers: the decorator's (patches.py), the
sampler's, and :meth:`Session.iterate`'s."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Counted", "Passthrough"]


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


class _Position(Protocol):
    consumed: int  # batches handed out in this epoch (sampler.LoaderState)


class Counted(Passthrough):
    """A DataLoader iterator through ``Session.iterate``: counts the batches handed out."""

    def __init__(self, inner: Any, position: _Position):
        super().__init__(inner)
        self._position = position

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._position.consumed += 1
        return batch
