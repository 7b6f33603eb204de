"""Live checkpointing and exact resume of a training run (``@ravex.train_loop``).

Imports go one way: ravex_runtime uses ravex_convert, never the reverse.
``Session`` is the layer under the decorator: capture, commit and restore on
this rank, driven by a hand-written loop or a framework's callbacks.

Importing this package does not import torch: the decorator and its helpers
(``api``) import the runtime when the decorated function is called, and
``Session`` is exported lazily (:func:`__getattr__`): naming it imports
``session`` and torch with it. The runtime's own modules import torch at the top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api import (
    batch_boundary,
    checkpoint,
    deactivate,
    flush,
    is_active,
    load_model,
    load_weights,
    restore,
    status,
    step,
    track,
    train_loop,
)
from .errors import RecipeError, ResumeError, UntrustedRecipeError

if TYPE_CHECKING:
    from .session import Session

__all__ = [
    "RecipeError", "ResumeError", "Session", "UntrustedRecipeError", "batch_boundary", "checkpoint", "deactivate", "flush", "is_active", "load_model",
    "load_weights", "restore", "status", "step", "track", "train_loop",
]


def __getattr__(name: str) -> Any:
    """``ravex_runtime.Session``, imported on first use (it imports torch)."""
    if name == "Session":
        from .session import Session

        return Session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
