"""Ravex's conversion layer: format detection, the checkpoint model, conversion
and verification, as a Python API first (the ``ravex`` command only wraps it).

Importing this package does not import torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .convert import convert, load_state_dict, reshard
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

try:
    __version__ = version("ravex")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

__all__ = [
    "Checkpoint",
    "CheckpointInfo",
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
