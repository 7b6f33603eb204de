"""Bounds on what a checkpoint may declare, so a crafted file cannot make Ravex
run for hours or fill the disk. Each limit is documented (docs/security.md) and,
where a real checkpoint could need more, overridable by an environment variable.
"""

from __future__ import annotations

import os

from .errors import RavexError

__all__ = ["MAX_CHUNKS_PER_TENSOR", "MAX_CHUNKS_PER_TENSOR_ENV", "MAX_EXPANSION", "MAX_EXPANSION_ENV", "env_limit", "max_chunks_per_tensor", "max_expansion"]

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


# How many times the bytes its source holds on disk a conversion may write. Readers
# refuse sources whose tensors share bytes, so an uncompressed source can only grow by
# dtype casts (bf16 -> fp32: 2x); what is left is compression: zstd turns a few KB
# into gigabytes of zeros, honestly declared. Real compressed checkpoints stay far
# below 64x (weights and moments compress to 0.7-0.95 of their size).
MAX_EXPANSION = 64
MAX_EXPANSION_ENV = "RAVEX_MAX_EXPANSION"


def max_expansion() -> int:
    """Output bytes a conversion may write per byte of its source (``RAVEX_MAX_EXPANSION``)."""
    return env_limit(MAX_EXPANSION_ENV, MAX_EXPANSION)
