"""Ravex's conversion layer: format detection, the checkpoint model, conversion
and verification, as a Python API first (the ``ravex`` command only wraps it).

Importing this package does not import torch.
"""

from __future__ import annotations

from . import _core
from .convert import ConvertOptions, convert, load_state_dict, reshard
from .detect import Detection, detect, inspect, read_checkpoint
from .errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LayoutMismatchError,
    NotFoundError,
    RavexError,
    UnknownFormatError,
    UnsafeCheckpointError,
)
from .info import CheckpointInfo, TensorInfo
from .model import Checkpoint
from .verify import VerifyResult, verify

# The compiled module's version is the package's (pyproject.toml takes it from
# Cargo.toml); importlib.metadata would cost a third of `ravex`'s start-up.
__version__: str = _core.__version__

__all__ = [
    "Checkpoint",
    "CheckpointInfo",
    "ConvertOptions",
    "CorruptCheckpointError",
    "Detection",
    "IncompleteCheckpointError",
    "LayoutMismatchError",
    "NotFoundError",
    "RavexError",
    "TensorInfo",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "VerifyResult",
    "__version__",
    "convert",
    "detect",
    "inspect",
    "load_state_dict",
    "read_checkpoint",
    "reshard",
    "verify",
]
