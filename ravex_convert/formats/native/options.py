"""The options of a native store output (light: the registry and the CLI import it, not the writer)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import RavexError
from ..options import Flag, WriteOptions, option

__all__ = ["COMPRESSION", "NativeOptions"]

COMPRESSION = Flag("--compression", choices=("none", "zstd"), help="native: compress chunks with zstd.")


@dataclass(frozen=True)
class NativeOptions(WriteOptions):
    """``compression``: None or ``"none"`` (raw, mmap-able chunks) or ``"zstd"``."""

    compression: str | None = option(None, COMPRESSION, on_options=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compression not in (None, "none", "zstd"):
            raise RavexError(f"--compression {self.compression}: unknown", hint="use none or zstd")
        if self.compression == "none":
            object.__setattr__(self, "compression", None)
