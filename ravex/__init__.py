"""Ravex: make PyTorch training checkpoints portable.

This is the small public face. The work lives in ``ravex_convert`` (formats,
detection, conversion) and ``ravex_runtime`` (live checkpointing of a training
run: ``@ravex.train_loop`` and its helpers). Importing ``ravex`` does not import torch.
"""

from __future__ import annotations

from ravex_convert import (
    CheckpointInfo,
    RavexError,
    __version__,
    detect,
    inspect,
)
from ravex_runtime import (
    Session,
    batch_boundary,
    checkpoint,
    deactivate,
    flush,
    is_active,
    load_weights,
    restore,
    status,
    step,
    track,
    train_loop,
)

__all__ = [
    "CheckpointInfo", "RavexError", "Session", "__version__", "batch_boundary", "checkpoint", "deactivate", "detect", "flush", "inspect",
    "is_active", "load_weights", "restore", "status", "step", "track", "train_loop",
]
