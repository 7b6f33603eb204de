"""Live checkpointing and exact resume of a training run (``@ravex.train_loop``).

Imports go one way: ravex_runtime uses ravex_convert, never the reverse.
Importing this package does not import torch; the runtime's modules do, when
the decorated function is called.
"""

from __future__ import annotations

from .api import batch_boundary, checkpoint, deactivate, flush, is_active, load_weights, restore, status, step, track, train_loop
from .errors import ResumeError

__all__ = [
    "ResumeError", "batch_boundary", "checkpoint", "deactivate", "flush", "is_active", "load_weights", "restore", "status", "step", "track", "train_loop",
]
