"""The errors Ravex raises. One root, a few kinds that mean something to a user.

Every message says what failed and names the file; ``hint`` says what to do.
The CLI prints ``error: <message>`` then ``hint: <hint>`` and exits with
``exit_code`` (2 or more: 1 is reserved for "verify found a difference").
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "INTERNAL_EXIT",
    "CorruptCheckpointError",
    "FileSystemError",
    "IncompleteCheckpointError",
    "LayoutMismatchError",
    "NotFoundError",
    "RavexError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "from_os_error",
    "translate_os_errors",
]

# The exit code of a bug in Ravex (an invariant that failed, an exception no
# code path expected): BSD's EX_SOFTWARE, apart from every checkpoint error.
INTERNAL_EXIT = 70


class RavexError(Exception):
    """Root of every error Ravex raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, path: str | Path | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\nhint: {self.hint}"
        return self.message


class NotFoundError(RavexError):
    """A path the user named does not exist."""

    exit_code = 3


class UnknownFormatError(RavexError):
    """The path exists but is no checkpoint Ravex recognises."""

    exit_code = 4


class IncompleteCheckpointError(RavexError):
    """A checkpoint whose layout is recognised but which lacks files it needs."""

    exit_code = 5


class CorruptCheckpointError(RavexError):
    """A file of a checkpoint cannot be parsed (truncated, overwritten, random bytes)."""

    exit_code = 6


class UnsafeCheckpointError(RavexError):
    """A pickle asks for something the restricted unpickler does not allow."""

    exit_code = 7


class LayoutMismatchError(RavexError):
    """The layout asked for does not fit the checkpoint (world size, shapes, stage)."""

    exit_code = 8


class FileSystemError(RavexError):
    """The operating system refused a read or a write: permissions, a full disk,
    a read-only file system, an I/O error."""

    exit_code = 9

    def __init__(self, message: str, *, hint: str | None = None, path: str | Path | None = None, errno: int | None = None):
        super().__init__(message, hint=hint, path=path)
        self.errno = errno


# A writer builds DST under ``.<name>.ravex-tmp-<token>`` beside it (``storage.local``);
# messages name DST itself.
_STAGED = re.compile(r"\.([^/]+)\.ravex-tmp-[0-9a-f]+")


def _shown(path: str) -> str:
    return _STAGED.sub(r"\1", path)


def _os_hint(code: int | None, path: str, writing: bool) -> str:
    if code in (errno.EACCES, errno.EPERM):
        return f"check the permissions of {path} (and of the directories above it)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space at the destination (or lift the quota) and run again; nothing was left half-written"
    if code == errno.EFBIG:
        return "a file grew past the file-size limit (ulimit -f) or the file system's maximum: raise it or free space; nothing was left half-written"
    if code == errno.EROFS:
        return f"{path} is on a read-only file system: choose a destination on a writable one"
    if code == errno.EIO:
        return f"the disk or the file {path} is damaged (see dmesg); copy the checkpoint from a good copy" if not writing else \
            "the disk at the destination reported an I/O error (see dmesg); write somewhere else"
    if code == errno.ENOTDIR:
        return f"a component of {path} is a file, not a directory: check the path"
    if code == errno.EISDIR:
        return f"{path} is a directory where a file was expected: check the path"
    if code == errno.ENOENT:
        return f"{path} disappeared while Ravex used it; make sure nothing else changes the checkpoint or the destination"
    if code == errno.ELOOP:
        return f"{path} is (or goes through) a symbolic link loop: check the path"
    if code == errno.ENAMETOOLONG:
        return "a path is too long for the file system: choose a shorter destination"
    if code in (errno.EMFILE, errno.ENFILE):
        return "too many open files: raise the limit (ulimit -n) and run again"
    if code == errno.ENOMEM:
        return "the system ran out of memory; close other programs or run on a larger machine"
    return "check the path, its permissions and the free space, and run again"


# Backends whose clients raise OSErrors of their own (the storage package registers them):
# each translator gives the FileSystemError for an exception of its client, or None.
_TRANSLATORS: list[Callable[[OSError], FileSystemError | None]] = []


def translate_os_errors(translator: Callable[[OSError], FileSystemError | None]) -> None:
    """Have :func:`from_os_error` ask ``translator`` first (a storage backend's own errors)."""
    if translator not in _TRANSLATORS:
        _TRANSLATORS.append(translator)


def from_os_error(exc: OSError, *, path: str | Path | None = None, writing: bool = False) -> FileSystemError:
    """One :class:`FileSystemError` for an ``OSError``: ``<file>: <what failed>``
    and a hint for its errno. ``path`` names the file where the ``OSError``
    does not (or names a temporary one)."""
    for translate in _TRANSLATORS:  # a storage client's own errors, from any call that reached it
        if (mapped := translate(exc)) is not None:
            return mapped
    where = exc.filename if exc.filename is not None else path
    if writing and exc.filename is not None and path is not None:
        # an OSError inside a write may still be about a source file
        f = str(exc.filename)
        writing = _STAGED.search(f) is not None or _shown(f).startswith(str(path))
    shown = _shown(str(where)) if where is not None else "a file"
    what = exc.strerror or str(exc) or type(exc).__name__
    return FileSystemError(f"{shown}: {what}", hint=_os_hint(exc.errno, shown, writing), path=shown, errno=exc.errno)
