"""Live checkpointing and exact resume of a training run (``@ravex.train_loop``).

Imports go one way: ravex_runtime uses ravex_convert, never the reverse.
``Session`` is the layer under the decorator: capture, commit and restore on
this rank, driven by a hand-written loop or a framework's callbacks.

Importing this package does not import torch; the runtime's modules do, when
the decorated function is called or a Session is made.
"""

from __future__ import annotations

from .api import batch_boundary, checkpoint, deactivate, flush, is_active, load_weights, restore, status, step, track, train_loop
from .errors import ResumeError
from .session import Session

__all__ = [
    "ResumeError", "Session", "batch_boundary", "checkpoint", "deactivate", "flush", "is_active", "load_weights", "restore", "status", "step", "track", "train_loop",
]
