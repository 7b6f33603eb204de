"""The storage layer: every byte Ravex reads or writes goes through one of these.

``resolve(dst)`` picks the backend from the destination's spelling: a plain
path is the local filesystem (:mod:`.local`); ``objdir:PATH`` (or the URL form
``objdir:///abs/path``) is the test backend with object-store semantics; ``s3://BUCKET/KEY`` is an
S3-compatible bucket (:mod:`.s3`)
(:mod:`.objdir`), whose bucket is PATH's parent directory (or, while a lease
or an output is open in a bucket that holds PATH, that bucket). With ``RAVEX_STORAGE=objdir`` in the environment every plain
path goes through the objdir backend too: the test suite runs the writers'
tests that way, so that no writer can quietly depend on rename, in-place
updates or flock. See :mod:`.base` for the surface.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, cast

from .base import ABSENT, Output, PreconditionFailed, Sink, Stat, Storage
from .local import LocalStorage, remove_tree

from .s3conf import SCHEME  # storage.s3 imports the core: it is loaded only for an s3:// path

__all__ = [
    "ABSENT",
    "LocalStorage",
    "Output",
    "PreconditionFailed",
    "Sink",
    "Stat",
    "Storage",
    "core_source",
    "is_objdir",
    "is_remote",
    "local_view",
    "open_read",
    "remove_tree",
    "resolve",
]

_OBJDIR = "objdir:"
_buckets: dict[str, Storage] = {}


def resolve(dst: str | Path) -> tuple[Storage, str]:
    """(backend, key) for a destination."""
    text = os.fspath(dst)
    if text.startswith(SCHEME):
        from .s3 import S3Storage, split

        name, key = split(text)
        return S3Storage(name), key
    if not text.startswith(_OBJDIR):
        if os.environ.get("RAVEX_STORAGE", "local") != "objdir":
            return LocalStorage(), text
        text = _OBJDIR + text
    from .objdir import ObjectDirStorage, in_use

    rest = text[len(_OBJDIR):]
    path = os.path.abspath(rest.removeprefix("//"))  # pathlib folds "objdir://x" to "objdir:/x"
    root, key = os.path.dirname(path), os.path.basename(path)
    # A path inside a bucket in use (a lease held or an output open there) is a key of that
    # bucket, the outermost one: the checkpoint directories of a native store being written
    # are objects of the store's bucket, not buckets of their own.
    for outer in sorted(in_use(), key=len):
        if path.startswith(outer.rstrip(os.sep) + os.sep):
            root, key = outer, os.path.relpath(path, outer).replace(os.sep, "/")
            break
    if root not in _buckets:
        _buckets[root] = ObjectDirStorage(root)
    return _buckets[root], key


def is_objdir(dst: str | Path) -> bool:
    """Whether ``dst`` is spelled as an objdir destination (not: routed there by RAVEX_STORAGE)."""
    return os.fspath(dst).startswith(_OBJDIR)


def is_remote(src: str | os.PathLike[str]) -> bool:
    """Whether ``src`` names objects in a bucket (``s3://``): read by range, never mapped."""
    return os.fspath(src).startswith(SCHEME)


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    """A source file, or an object in a bucket (read by range), opened for reading."""
    if isinstance(path, Path) or not is_remote(path):
        return open(path, "rb")
    return cast(BinaryIO, local_view(os.fspath(path)).open("rb"))


def as_path(path: str | os.PathLike[str]) -> Path:
    """``Path(path)``, except that an object in a bucket stays one (an :class:`~.s3.S3Path`)."""
    if isinstance(path, Path):
        return path
    return local_view(os.fspath(path)) if is_remote(path) else Path(path)


def core_source(path: str | os.PathLike[str]) -> Any:
    """What the compiled core reads for ``path``: its path as a string, or for an object in a
    bucket the core's handle of it (``_core.S3Object``, read by range)."""
    if is_remote(path):
        return local_view(os.fspath(path) if not isinstance(path, Path) else path).object()  # type: ignore[attr-defined]
    return os.fspath(path)


def local_view(src: str | Path) -> Path:
    """Where readers find a source's bytes: the path itself, an objdir object's backing file
    (read-only; the same bytes a ranged GET would return), or for ``s3://`` an
    :class:`~.s3.S3Path`, which answers a reader's path questions from listings and reads by range."""
    if is_remote(src):
        from .s3 import S3Path

        # an S3Path answers every question a reader asks a Path
        return cast(Path, src if isinstance(src, S3Path) else S3Path.of(os.fspath(src)))
    storage, key = resolve(src)
    return Path(key) if storage.scheme == "file" else storage.local_path(key)

