"""Which format is this path? Layout first, fields second, with reasons.

``detect`` only looks at names and small files (a marker, ``latest``, a
header); ``inspect`` then reads the format's metadata through its module.
Neither imports torch nor executes anything from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import NotFoundError, RavexError, UnknownFormatError, from_os_error
from .formats import dcp, native, safetensors, torch_save, zero
from .info import CheckpointInfo
from .model import Checkpoint

__all__ = ["Detection", "detect", "inspect", "read_checkpoint"]

# Order matters where layouts nest: a native store or a DCP directory may hold
# safetensors or .pt files, and a ZeRO root holds .pt files.
_SNIFFERS = (
    ("native", native.sniff),
    ("dcp", dcp.sniff),
    ("zero", zero.sniff),
    ("safetensors", safetensors.sniff),
    ("torch_save", torch_save.sniff),
)


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
    p = Path(path)
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
    for name, sniff in _SNIFFERS:
        reasons = sniff(p)
        if reasons:
            return Detection(name, p, reasons)
    # A sniffer that cannot open a file sees no format in it: say that the file
    # cannot be read rather than that it is no checkpoint.
    _readable(p)
    if p.is_dir():
        seen = ", ".join(sorted(e.name for e in p.iterdir())[:6])
        raise UnknownFormatError(
            f"{p}: not a checkpoint Ravex recognises (it holds: {seen}{', ...' if len(list(p.iterdir())) > 6 else ''})",
            hint="Ravex reads DeepSpeed ZeRO (a directory with 'latest' or *_optim_states.pt), DCP (.metadata), "
            "torch.save files, safetensors and Ravex stores; point it at one of those",
            path=p,
        )
    raise UnknownFormatError(
        f"{p}: not a checkpoint file Ravex recognises (neither a torch.save archive nor safetensors)",
        hint="for a DeepSpeed or DCP checkpoint, pass the directory rather than a file inside it",
        path=p,
    )


def _readable(p: Path) -> None:
    """Raise :class:`FileSystemError` for the first file at ``p`` (the file, or
    the files directly in the directory) that cannot be read."""
    files = [p] if not p.is_dir() else sorted(e for e in p.iterdir() if e.is_file())
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise from_os_error(exc, path=f) from None


def inspect(path: str | Path, *, tag: str | None = None, index: int = -1) -> CheckpointInfo:
    """Describe the checkpoint at ``path``: format, variant, world size, stage,
    step, tensors, files. Reads metadata only; never loads tensor data."""
    d = detect(path)
    if d.format == "zero":
        return zero.describe(d.path, d.reasons, tag=tag)
    if d.format == "dcp":
        return dcp.describe(d.path, d.reasons)
    if d.format == "native":
        return native.describe(d.path, d.reasons, index=index)
    if d.format == "safetensors":
        return safetensors.describe(d.path, d.reasons)
    return torch_save.describe(d.path, d.reasons)


def read_checkpoint(path: str | Path, *, tag: str | None = None, index: int = -1, param_names: list[str] | None = None) -> Checkpoint:
    """The checkpoint at ``path`` in the one model every format is read into
    (logical tensors located in their files; nothing loaded). ``param_names``:
    for a torch.save file whose optimizer state is keyed by position, the
    parameter names in that order."""
    d = detect(path)
    if param_names is not None and d.format != "torch_save":
        raise RavexError("--param-names applies to torch.save files with position-keyed optimizer state only", hint="leave it out")
    if d.format == "zero":
        return zero.read(d.path, tag=tag)
    if d.format == "dcp":
        return dcp.read(d.path)
    if d.format == "native":
        return native.read(d.path, index=index)
    if d.format == "safetensors":
        return safetensors.read(d.path)
    return torch_save.read(d.path, param_names)
