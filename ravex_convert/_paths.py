"""Paths read from inside a checkpoint, kept inside the checkpoint.

Checkpoints name other files: DeepSpeed's ``latest`` names a tag directory, a
safetensors index names shard files, DCP metadata names ``.distcp`` files, a
native manifest names checkpoint directories and chunk files. A crafted
checkpoint can name ``/etc/passwd`` or ``../../x``; following it reads (and may
copy into the output) a file the user never handed us. :func:`inside` is the one
place that joins such a path to its root and refuses what leaves it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import UnsafeCheckpointError

__all__ = ["inside"]


def inside(root: Path, rel: str, what: str, source: Path) -> Path:
    """``root / rel``, refused unless it stays inside ``root``.

    ``rel`` is a path read from the file ``source`` (``what`` says what it is, for
    the message: "the tag named by 'latest'", "shard file", ...). Refused with
    :class:`UnsafeCheckpointError` (exit 7): an empty path, a NUL character, an
    absolute path (POSIX or Windows style, or a drive), a ``..`` component, and a
    path that leaves ``root`` once symlinks are resolved (``Path.resolve``, on
    both ``root`` and the result). Returns the joined, unresolved path (so
    messages keep the names the user knows); it need not exist.
    """
    hint = (
        f"{source} is damaged or was crafted to read files outside the checkpoint; "
        "a checkpoint only names files inside its own directory. Do not use this checkpoint, or fix the path in it"
    )

    def refuse(why: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{source}: {what} {rel!r} {why}", hint=hint, path=source)

    if not isinstance(rel, str) or not rel:
        raise UnsafeCheckpointError(f"{source}: {what} is empty or not a path ({rel!r})", hint=hint, path=source)
    if "\x00" in rel:
        raise refuse("contains a NUL character")
    posix, windows = PurePosixPath(rel), PureWindowsPath(rel)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or windows.root or rel.startswith(("/", "\\")):
        raise refuse("is an absolute path; only paths relative to the checkpoint are allowed")
    if ".." in posix.parts or ".." in windows.parts:
        raise refuse("has a '..' component and would leave the checkpoint directory")
    joined = root / rel
    try:
        real_root = root.resolve()
        real = joined.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, a too-long path
        raise refuse(f"cannot be resolved ({exc})") from None
    if real != real_root and not real.is_relative_to(real_root):
        raise refuse(f"resolves to {real} (through a symbolic link), outside the checkpoint directory {real_root}")
    return joined
