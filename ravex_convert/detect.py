"""Which format is this path? Layout first, fields second, with reasons.

``detect`` asks each registered format's sniffer in turn (the registry's
detection order, ``formats/registry.py``), which look only at names and small
files (a marker, ``latest``, a header); ``inspect`` and ``read_checkpoint``
then hand the path to that format. Nothing here names a format. None of it
imports torch or executes anything from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import NotFoundError, RavexError, UnknownFormatError, from_os_error
from .formats import registry
from .info import CheckpointInfo
from .model import Checkpoint
from .storage import open_read, resolve

__all__ = ["Detection", "detect", "inspect", "read_checkpoint"]


@dataclass
class Detection:
    format: str
    path: Path
    reasons: list[str] = field(default_factory=list)


def detect(path: str | Path) -> Detection:
    """Recognise the checkpoint at ``path`` (a directory or a file).

    Raises :class:`NotFoundError` for a missing path and
    :class:`UnknownFormatError` for anything that is not a checkpoint.
    """
    p = resolve(path).path  # an object is read where its backend keeps it (what ranged GETs would return)
    if not p.exists():
        raise NotFoundError(
            f"{p}: no such file or directory",
            hint="check the path; Ravex takes a checkpoint directory (or a .pt / .safetensors file)",
            path=p,
        )
    if p.is_dir():
        try:
            entries = list(p.iterdir())
        except PermissionError:
            raise NotFoundError(f"{p}: permission denied", hint="run as a user who can read the checkpoint", path=p) from None
        if not entries:
            raise UnknownFormatError(f"{p}: the directory is empty", hint="point Ravex at the directory the training run saved into", path=p)
    for fmt in registry.formats():
        reasons = fmt.sniff(p)
        if reasons:
            return Detection(fmt.name, p, reasons)
    # A sniffer that cannot open a file sees no format in it: say that the file
    # cannot be read rather than that it is no checkpoint.
    _readable(p)
    if p.is_dir():
        seen = ", ".join(sorted(e.name for e in p.iterdir())[:6])
        raise UnknownFormatError(
            f"{p}: not a checkpoint Ravex recognises (it holds: {seen}{', ...' if len(list(p.iterdir())) > 6 else ''})",
            hint=f"{_what_ravex_reads()}; point it at one of those",
            path=p,
        )
    raise UnknownFormatError(
        f"{p}: not a checkpoint file Ravex recognises",
        hint=f"{_what_ravex_reads()}; for a checkpoint that is a directory, pass the directory rather than a file inside it",
        path=p,
    )


def _what_ravex_reads() -> str:
    """The formats Ravex reads, for a hint, from the registry (in the order people read them)."""
    shown = [registry.get(n) for n in registry.names()]
    parts = [f"{f.title} ({f.looks_like})" if f.looks_like else f.title for f in shown]
    return "Ravex reads " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts))


def _readable(p: Path) -> None:
    """Raise :class:`FileSystemError` for the first file at ``p`` (the file, or
    the files directly in the directory) that cannot be read."""
    files = [p] if not p.is_dir() else sorted(e for e in p.iterdir() if e.is_file())
    for f in files:
        try:
            with open_read(f) as fh:
                fh.read(1)
        except OSError as exc:
            raise from_os_error(exc, path=f) from None


def inspect(path: str | Path, *, tag: str | None = None, index: int = -1) -> CheckpointInfo:
    """Describe the checkpoint at ``path``: format, variant, world size, stage,
    step, tensors, files. Reads metadata only; never loads tensor data.
    ``tag`` and ``index`` pick one checkpoint where the format holds several
    (a DeepSpeed tag, a store's index); formats holding one ignore them."""
    d = detect(path)
    fmt = registry.get(d.format)
    return fmt.describe(d.path, d.reasons, **fmt.given(tag=tag, index=index))


def read_checkpoint(path: str | Path, *, tag: str | None = None, index: int = -1, param_names: list[str] | None = None) -> Checkpoint:
    """The checkpoint at ``path`` in the one model every format is read into
    (logical tensors located in their files; nothing loaded). ``param_names``:
    for a torch.save file whose optimizer state is keyed by position, the
    parameter names in that order (refused for a format that takes none)."""
    d = detect(path)
    fmt = registry.get(d.format)
    if param_names is not None and "param_names" not in fmt.options:
        takers = [f.title for f in registry.formats() if "param_names" in f.options]
        raise RavexError(f"--param-names applies to {' and '.join(takers)} with position-keyed optimizer state only", hint="leave it out")
    return fmt.read(d.path, **fmt.given(tag=tag, index=index, param_names=param_names))
