"""Ravex: make PyTorch training checkpoints portable.

This is the small public face. The work lives in ``ravex_convert`` (formats,
detection, conversion) and ``ravex_runtime`` (live checkpointing of a training
run, coming with the runtime issue). Importing ``ravex`` does not import torch.
"""

from __future__ import annotations

from ravex_convert import (
    CheckpointInfo,
    RavexError,
    __version__,
    detect,
    inspect,
)

__all__ = ["CheckpointInfo", "RavexError", "__version__", "detect", "inspect"]
