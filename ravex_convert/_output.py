"""What every writer shares: choosing what goes out (weights only, renamed,
cast) and whether to wait for the disk. Putting the result in place atomically
is the storage layer's (``storage.local``, ``storage.objdir``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RavexError
from .model import MODEL, OBJ, OPTIM, Checkpoint, LogicalTensor

__all__ = ["FLOAT_DTYPES", "Options", "durability", "durable", "fsync_dir", "fsync_fd", "out_dtype", "select", "strip_name"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass
class Options:
    """Options every writer understands (the CLI's flags)."""

    weights_only: bool = False
    dtype: str | None = None  # cast floating-point weights on the way out
    strip_prefix: list[str] = field(default_factory=list)
    force: bool = False
    max_shard_size: int | None = None  # safetensors: bytes per shard
    compression: str | None = None  # native: None or "zstd"
    world_size: int = 1
    threads: int = 0  # copy threads (0: one per CPU); the runtime's background writer uses 1
    # native: keep the chunks as the source has them, each written by the rank that holds it
    # (Chunk.owner), instead of splitting each tensor again over world_size ranks
    keep_chunks: bool = False

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise RavexError(f"--dtype {self.dtype}: not a floating-point dtype Ravex casts to", hint=f"use one of {', '.join(FLOAT_DTYPES)}")


def out_dtype(t: LogicalTensor, opts: Options) -> str:
    """Weights are cast when asked; optimizer state and integer tensors never are."""
    if opts.dtype is not None and t.name.startswith(MODEL) and t.dtype in FLOAT_DTYPES:
        return opts.dtype
    return t.dtype


def strip_name(name: str, prefixes: list[str]) -> str:
    """A logical name with the first of ``prefixes`` that its parameter name starts with taken off
    (``--strip-prefix``), for model, optimizer and ``obj/`` names alike."""
    for area in (MODEL, OBJ):
        if name.startswith(area):
            rest = name[len(area):]
            for p in prefixes:
                if rest.startswith(p):
                    return area + rest[len(p):]
            return name
    if name.startswith(OPTIM):
        _, state, fqn = name.split("/", 2)
        for p in prefixes:
            if fqn.startswith(p):
                return f"{OPTIM}{state}/{fqn[len(p):]}"
    return name


def select(ckpt: Checkpoint, opts: Options) -> Checkpoint:
    """The part of ``ckpt`` that goes out, under its output names."""
    out = Checkpoint(ckpt.format, ckpt.path, ckpt.world_size, ckpt.step, notes=list(ckpt.notes), source=dict(ckpt.source))
    for name, t in ckpt.tensors.items():
        if opts.weights_only and not name.startswith(MODEL):
            continue
        new = strip_name(name, opts.strip_prefix)
        if new in out.tensors:
            raise RavexError(f"--strip-prefix makes two tensors one name: '{new}'", hint="strip a prefix that not every name shares, or none")
        out.tensors[new] = t.renamed(new)
    for alias, target in ckpt.aliases.items():
        if opts.weights_only and not alias.startswith(MODEL):
            continue
        out.aliases[strip_name(alias, opts.strip_prefix)] = strip_name(target, opts.strip_prefix)
    if opts.weights_only:
        out.objects = {}
    else:
        out.objects = dict(ckpt.objects)
        groups = out.objects.get("optim.param_groups")
        if opts.strip_prefix and isinstance(groups, list):
            out.objects["optim.param_groups"] = [
                {**g, "params": [strip_name(MODEL + p, opts.strip_prefix)[len(MODEL):] for p in g.get("params", [])]} for g in groups
            ]
    return out


# Off only for the duration of a `convert(..., ConvertOptions(sync=False))` (`--no-sync`): outputs are then
# renamed into place without waiting for the disk, like `cp`. Everything else, the runtime's
# store included, always syncs.
_DURABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("ravex_durable", default=True)


@contextlib.contextmanager
def durability(sync: bool) -> Iterator[None]:
    """Within the block, :func:`fsync_fd` / :func:`fsync_dir` and the executor's early
    write-back run only when ``sync``."""
    token = _DURABLE.set(sync)
    try:
        yield
    finally:
        _DURABLE.reset(token)


def durable() -> bool:
    return _DURABLE.get()


def direct_io() -> bool:
    """Whether durable output has its whole pages written around the page cache (the executor's
    ``direct``: O_DIRECT where the file system takes it); ``RAVEX_DIRECT_IO=0`` turns it off.
    Durable output goes to the disk anyway, and on a machine where getting pages for the cache
    is slow (a VM whose balloon takes freed memory back) it cost more than the disk write: 2 GiB
    fsynced through the cache took 7-8 s here, 1.4 s direct."""
    return os.environ.get("RAVEX_DIRECT_IO", "1").strip().lower() not in ("0", "false", "no", "off")


def fsync_fd(fd: int) -> None:
    """fsync an open file, unless inside ``durability(False)``."""
    if _DURABLE.get():
        os.fsync(fd)


def fsync_dir(path: Path | str) -> None:
    """fsync a directory (or a file) by path, unless inside ``durability(False)``."""
    if not _DURABLE.get():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
