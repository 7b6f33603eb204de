"""The storage layer: every byte Ravex reads or writes goes through one of these.

A location a user gives (a path on the command line or in the API, ``storage.path``,
``resume_from``, ``init_from``) is resolved once, by :func:`resolve`, into a
:class:`Location`: a backend and a key in it. The spelling picks the backend:

- a plain path: the local filesystem (:mod:`.local`);
- ``objdir:PATH`` (or ``objdir:///abs/path``): a local directory with object-store semantics
  (:mod:`.objdir`), for tests, whose bucket is PATH's parent directory (or, while a lease or an
  output is open in a bucket that holds PATH, that bucket). With ``RAVEX_STORAGE=objdir`` every
  plain path goes there too: the writers' tests run that way, so that no writer can quietly
  depend on rename, in-place updates or flock;
- ``s3://BUCKET/KEY``: an S3-compatible bucket (:mod:`.s3`, over the compiled core's client).

Both object stores are clients of one object-store layer (:mod:`.objstore`: outputs, commits,
leases). Readers open a location's :attr:`~Location.path` (in a bucket, a path that lists
and reads by range) and hand the executor :func:`core_source` of a file. :mod:`.base` holds the
contracts; :mod:`.settings` checks a run's ``storage.*`` settings; nothing outside this package
names a backend or branches on a spelling.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, cast

from .base import ABSENT, Output, PreconditionFailed, Sink, Stat, Storage
from .lease import Lease, StoreTakenOverError
from .local import LocalStorage, remove_tree
from .s3conf import SCHEME  # storage.s3 imports the core: it is loaded only for an s3:// path

__all__ = [
    "ABSENT",
    "Lease",
    "LocalStorage",
    "Location",
    "Output",
    "PreconditionFailed",
    "Sink",
    "Stat",
    "Storage",
    "StoreTakenOverError",
    "as_path",
    "core_source",
    "open_read",
    "remove_tree",
    "resolve",
    "walk",
]

_OBJDIR = "objdir:"
_buckets: dict[str, Storage] = {}


@dataclass(frozen=True, eq=False)
class Location:
    """A location a user gave (a CLI or API argument, ``storage.path``, ``resume_from``), resolved
    once: its backend and its key there. Readers, writers, ``plan.run`` and the runtime take it as
    it is. Unpacks (and indexes) as ``(storage, key)``; ``str()`` is how it was spelled; ``name``, ``suffix`` and
    ``/`` are its last name's and a location under it, all a writer asks of its destination."""

    storage: Storage
    key: str  # local: the path as given; object storage: the key in its bucket
    spelled: str  # as the user spelled it (normalized): str() and a writer's messages
    label: str  # how a native store's messages name it (an objdir location by its backing path)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.storage, self.key))

    def __getitem__(self, i: int) -> Any:
        return (self.storage, self.key)[i]

    def __len__(self) -> int:
        return 2

    def __str__(self) -> str:
        return self.spelled

    def __repr__(self) -> str:
        return f"Location({self.spelled!r})"

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    def __truediv__(self, rel: str) -> Location:
        return self.child(rel)

    @property
    def posix(self) -> bool:
        """Whether the backend is a POSIX filesystem (rename, flock, directories)."""
        return self.storage.scheme == "file"

    @property
    def path(self) -> Path:
        """What readers open: the path itself, an objdir object's backing file (read-only; the same
        bytes a ranged GET would return), or for a bucket a path that reads by range and lists."""
        return Path(self.key) if self.posix else self.storage.local_path(self.key)

    def key_of(self, rel: str) -> str:
        return str(Path(self.key) / rel) if self.posix else f"{self.key}/{rel}"

    def shown(self, rel: str) -> str:
        """``rel`` under this location, named as :attr:`label` names this location."""
        if self.label.startswith(_OBJDIR):
            return f"{_OBJDIR}//{self.path / rel}"
        return str(self.path / rel)

    def child(self, rel: str) -> Location:
        """``rel`` under this location, on the same backend (in a bucket: a key of the same bucket)."""
        return Location(self.storage, self.key_of(rel), f"{self.spelled.rstrip('/')}/{rel}", self.shown(rel))

    def objects(self, rel: str = "") -> list[str]:
        """Every object key under this location (or under ``rel`` in it), relative to it."""
        prefix = self.key_of(rel) if rel else self.key
        return [k[len(self.key) + 1:] for k in self.storage.list(prefix)]

    def missing_bucket(self) -> str | None:
        """The bucket a location spelled for a directory-backed object store names, where that
        directory does not exist (a plain path routed there by ``RAVEX_STORAGE`` makes its own)."""
        root = getattr(self.storage, "root", None)
        if self.label.startswith(_OBJDIR) and isinstance(root, str) and not os.path.isdir(root):
            return root
        return None

    def exists(self) -> bool:
        if self.posix:
            return Path(self.key).exists()
        return bool(self.storage.list(self.key)) or self.storage.exists(self.key)


def resolve(dst: str | os.PathLike[str] | Location) -> Location:
    """The backend and key of a location as a user spells it (once; a :class:`Location` is itself)."""
    if isinstance(dst, Location):
        return dst
    text = given = os.fspath(dst)
    if text.startswith(SCHEME):
        from .s3 import S3Storage, split

        name, key = split(text)
        url = f"{SCHEME}{name}/{key}" if key else f"{SCHEME}{name}"
        return Location(S3Storage(name), key, url, url)
    spelled = text.startswith(_OBJDIR)
    if not spelled:
        if os.environ.get("RAVEX_STORAGE", "local") != "objdir":
            return Location(LocalStorage(), text, str(Path(text)), str(Path(text)))
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
    return Location(_buckets[root], key, str(Path(given)), f"{_OBJDIR}//{path}" if spelled else path)


def _ranged(src: str | os.PathLike[str]) -> bool:
    """Whether ``src`` names objects in a bucket (``s3://``): read by range, never mapped."""
    return os.fspath(src).startswith(SCHEME)


def walk(root: Path) -> Iterator[tuple[Path, list[str], list[str]]]:
    """``os.walk`` of a directory a reader was given, or of the objects under a prefix of a bucket."""
    if not _ranged(root):
        for dirpath, dirnames, filenames in os.walk(root):
            yield Path(dirpath), dirnames, filenames
        return
    by_dir: dict[Path, list[str]] = {}
    for p in root.rglob("*"):
        if p.is_file():
            by_dir.setdefault(p.parent, []).append(p.name)
    for d in sorted(by_dir, key=str):
        yield d, [], by_dir[d]


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    """A file a reader was given (a view's path: a local file, or an object in a bucket, read by
    range), opened for reading."""
    return cast(BinaryIO, as_path(path).open("rb"))


def as_path(path: str | os.PathLike[str]) -> Path:
    """The path a reader uses for ``path``: itself where it is one, else the view of what it names."""
    if isinstance(path, Path):
        return path
    return resolve(path).path if _ranged(path) else Path(path)


def core_source(path: str | os.PathLike[str]) -> Any:
    """What the compiled core reads for a file a reader was given: its path as a string, or for
    an object in a bucket the core's handle of it (read by range)."""
    if _ranged(path):
        return as_path(path).object()  # type: ignore[attr-defined]
    return os.fspath(path)
