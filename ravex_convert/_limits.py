"""Bounds on what a checkpoint may declare, so a crafted file cannot make Ravex
run for hours or fill the disk. Each limit is documented (docs/security.md) and,
where a real checkpoint could need more, overridable by an environment variable.
"""

from __future__ import annotations

import os

from .errors import RavexError

__all__ = ["MAX_CHUNKS_PER_TENSOR", "MAX_CHUNKS_PER_TENSOR_ENV", "env_limit", "max_chunks_per_tensor"]

# Chunks (shards) per logical tensor: one per rank that holds a piece of it in the
# largest layouts (FSDP x TP x PP). 2^17 covers a 131,072-rank job; a .metadata
# asking for more is refused before any per-chunk work.
MAX_CHUNKS_PER_TENSOR = 1 << 17
MAX_CHUNKS_PER_TENSOR_ENV = "RAVEX_MAX_CHUNKS_PER_TENSOR"


def env_limit(name: str, default: int) -> int:
    """A positive integer limit from the environment variable ``name``, else ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise RavexError(f"{name}={raw!r}: not a positive integer", hint=f"unset it (default {default}) or set a whole number of 1 or more")
    return value


def max_chunks_per_tensor() -> int:
    """How many chunks one tensor may have (``RAVEX_MAX_CHUNKS_PER_TENSOR``)."""
    return env_limit(MAX_CHUNKS_PER_TENSOR_ENV, MAX_CHUNKS_PER_TENSOR)
