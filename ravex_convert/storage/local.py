"""The local filesystem: today's behaviour, behind the storage surface.

An output is built under a temporary sibling name (``.NAME.ravex-tmp-TOKEN``)
and renamed into place in ``publish``, so an interrupted or failed write never
leaves anything at DST that looks finished. Sinks are the files themselves,
pre-sized, which the Rust executor writes positionally (with early
write-back); ``close`` fsyncs. Every fsync obeys ``durability`` (``--no-sync``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from .._output import fsync_dir, fsync_fd
from ..errors import RavexError
from .base import ABSENT, PreconditionFailed, Stat, holder_text, lease_note

__all__ = ["LocalStorage", "holder_of", "remove_tree"]


def remove_tree(path: Path) -> None:
    """Delete ``path`` (a directory with all it holds, or one entry), never through a link."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


class _FileSink:
    def __init__(self, path: Path, size: int):
        self.key = str(path)
        self.path = path
        self.target = str(path)
        self.direct = True  # the file is the object
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def pwrite(self, data: bytes, offset: int) -> None:
        os.pwrite(self.fd, data, offset)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            fsync_fd(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class _StagedOutput:
    """An output built beside ``dst`` and renamed into place."""

    def __init__(self, dst: Path, force: bool, directory: bool, token: str, create: bool, staging: str | None = None):
        self.dst, self.force, self.directory, self.token = dst, force, directory, token
        self.tmp = dst.parent / (staging or f".{dst.name}.ravex-tmp-{token}")
        self._sinks: list[_FileSink] = []
        if not create:
            return
        check_destination(dst, force)
        remove_tree(self.tmp)
        if directory:
            self.tmp.mkdir()

    def _path(self, rel: str) -> Path:
        if not rel:
            if self.directory:
                raise RavexError("a directory output has no object without a name")  # Ravex's own bug
            return self.tmp
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def sink(self, rel: str, size: int) -> _FileSink:
        s = _FileSink(self._path(rel), size)
        self._sinks.append(s)
        return s

    def scratch(self, size: int) -> _FileSink:
        """A temporary file inside the staging area that never becomes an object."""
        s = _FileSink(self.tmp / f".scratch-{len(self._sinks)}-{os.getpid()}", size)
        self._sinks.append(s)
        return s

    def put(self, rel: str, data: bytes) -> None:
        s = self.sink(rel, 0)
        s.pwrite(data, 0)
        s.close()

    def publish(self, commit: list[tuple[str, bytes]]) -> None:
        if self.directory:
            for d in sorted({p.parent for p in self.tmp.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
                fsync_dir(d)
        for rel, data in commit:  # each commit object whole, by rename, after everything it names is durable
            part = self._path(rel + ".tmp")
            with open(part, "wb") as f:
                f.write(data)
                f.flush()
                fsync_fd(f.fileno())
            os.replace(part, self._path(rel))
            fsync_dir(self.tmp)
        dst, parent = self.dst, self.dst.parent
        if dst.exists() or dst.is_symlink():
            old = parent / f".{dst.name}.ravex-old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(self.tmp, dst)
            remove_tree(old)
        else:
            os.replace(self.tmp, dst)
        fsync_dir(parent)

    def abort(self) -> None:
        for s in self._sinks:
            s.abort()
        remove_tree(self.tmp)


def check_destination(dst: Path, force: bool) -> None:
    if (dst.exists() or dst.is_symlink()) and not force:
        raise RavexError(f"{dst}: already exists", hint="pass --force to replace it, or choose another destination", path=dst)
    if not dst.parent.is_dir():
        raise RavexError(f"{dst.parent}: the destination's directory does not exist", hint="create it first", path=dst.parent)


class LocalStorage:
    """Keys are paths."""

    scheme = "file"

    def output(self, dst: str, *, force: bool, directory: bool, token: str, create: bool = True, staging: str | None = None,
               commit: tuple[str, ...] = ()) -> _StagedOutput:
        return _StagedOutput(Path(dst), force, directory, token, create, staging)

    def exists(self, key: str) -> bool:
        return Path(key).exists()

    def list(self, prefix: str) -> list[str]:
        root = Path(prefix)
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

    def stat(self, key: str) -> Stat | None:
        try:
            st = os.stat(key)
        except FileNotFoundError:
            return None
        return Stat(st.st_size, st.st_mtime_ns ^ st.st_ino)

    def get(self, key: str) -> tuple[bytes, int]:
        with open(key, "rb") as f:
            st = os.fstat(f.fileno())
            return f.read(), st.st_mtime_ns ^ st.st_ino

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with open(key, "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def put(self, key: str, data: bytes, *, if_generation: int | None = None, staging: str | None = None) -> int:
        """Write (to ``staging`` beside ``key``, else a name of this process), fsync, rename
        over ``key``, fsync its directory. The generation check is only as strong as the
        caller's lease: on POSIX the store lock is what makes it exclusive."""
        path = Path(key)
        if if_generation is not None:
            now = self.stat(key)
            if (now is None) != (if_generation == ABSENT) or (now is not None and now.generation != if_generation):
                raise PreconditionFailed(f"{key}: changed since it was read")
        part = path.parent / (staging or f"{path.name}.tmp-{os.getpid()}")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            fsync_fd(f.fileno())
        os.replace(part, path)
        fsync_dir(path.parent)
        st = os.stat(path)
        return st.st_mtime_ns ^ st.st_ino

    def delete(self, key: str) -> None:
        remove_tree(Path(key))

    def abort_unfinished(self, prefix: str) -> None:
        """Nothing: a local writer's unfinished files carry temporary names, which the formats' own
        cleanup removes (docs/format.md section 4)."""

    def local_path(self, key: str) -> Path:
        return Path(key)

    @contextlib.contextmanager
    def lease(self, key: str, holder: str) -> Iterator[None]:
        """An exclusive, non-blocking flock on ``key`` (a regular file, never a link),
        with the holder written into it for the message another writer gets."""
        fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise PreconditionFailed(holder_of(fd)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, lease_note(holder), 0)
            yield
        finally:
            os.close(fd)


def holder_of(fd: int) -> str:
    """Who holds a lock file, from the note its holder wrote into it (the native store's lock too)."""
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        raw = b""
    return holder_text(raw)
