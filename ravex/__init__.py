"""Ravex: make PyTorch training checkpoints portable.

This is the small public face. The work lives in ``ravex_convert`` (formats,
detection, conversion) and ``ravex_runtime`` (live checkpointing of a training
run: ``@ravex.train_loop`` and its helpers). Importing ``ravex`` does not import
torch: ``ravex.Session`` is exported lazily (:func:`__getattr__`), and naming it
imports the runtime's session, and torch with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ravex_convert import (
    CheckpointInfo,
    RavexError,
    __version__,
    detect,
    inspect,
)
from ravex_runtime import (
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

if TYPE_CHECKING:
    from ravex_runtime.session import Session

__all__ = [
    "CheckpointInfo", "RavexError", "Session", "__version__", "batch_boundary", "checkpoint", "deactivate", "detect", "flush", "inspect",
    "is_active", "load_model", "load_weights", "restore", "status", "step", "track", "train_loop",
]


def __getattr__(name: str) -> Any:
    """``ravex.Session``, imported on first use (it imports torch)."""
    if name == "Session":
        from ravex_runtime.session import Session

        return Session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
