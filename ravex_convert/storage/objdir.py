"""A backend with object-store semantics, over a local directory (``objdir://``).

It exists so that no code path can quietly assume POSIX: every writer and
reader test runs against it as well as against :mod:`.local`. It offers only
what S3, GCS and Azure Blob offer:

- no rename, no directories (a "directory" is a key prefix), no flock;
- an object appears whole when its sink closes (a spool file outside the
  store, uploaded in one put: positional writes only while the sink is open,
  as a multipart upload takes parts in any order), and never changes after;
- replacing an object is a whole, conditional put (generation match);
- a lease is an object created only if absent (and deleted on release).

The backing directory holds exactly the objects (``BUCKET/KEY``), so readers map
them read-only as they map local files: the equivalent of ranged GETs.
Anything else that writes, renames or locks inside a bucket while an objdir
output is open there is refused by an audit hook (:class:`SemanticsViolation`), and :meth:`ObjectDirStorage.audit`
finds objects changed behind the backend's back (the Rust executor is not seen by
audit hooks; it may only write spool files).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from .._output import fsync_fd
from ..errors import RavexError
from .base import ABSENT, PreconditionFailed, Stat, holder_text, lease_note

__all__ = ["ObjectDirStorage", "SemanticsViolation", "in_use"]

SCHEME = "objdir://"
_UPLOADS = ".objdir-part-"  # in the name of a put being assembled, before it appears


class SemanticsViolation(RuntimeError):
    """Code above the storage layer did something an object store cannot do."""


_inside = threading.local()  # set while the backend itself touches its bucket
# backing file -> (inode, mtime_ns) as the backend put it; shared by every instance, so that a
# bucket opened twice (or one inside another) audits the same objects the same way
_gens: dict[str, tuple[int, int]] = {}
_buckets: dict[str, int] = {}  # bucket root -> outputs and leases open in it (the audit hook watches those buckets)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _in_bucket(path: object) -> str | None:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    p = os.path.abspath(os.fsdecode(path))
    for b in _buckets:
        if p == b or p.startswith(b + os.sep):
            return p
    return None


def _audit(event: str, args: tuple[object, ...]) -> None:
    if not _buckets or getattr(_inside, "on", False):
        return
    hit = None
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS)
        hit = _in_bucket(path) if writing else None
    elif event in ("os.rename", "os.link", "os.symlink", "os.truncate", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.move"):
        hit = next((h for a in args[:2] if (h := _in_bucket(a)) is not None), None)
    elif event == "fcntl.flock":
        with contextlib.suppress(OSError, TypeError):
            hit = _in_bucket(os.readlink(f"/proc/self/fd/{args[0]}"))
    if hit is not None:
        raise SemanticsViolation(f"{event} on {hit}: an object store has no such operation; go through ravex_convert.storage")


_hooked = False


def in_use() -> list[str]:
    """The buckets (roots) where an output or a lease is open now."""
    return list(_buckets)


def _watch(root: str) -> None:
    """The audit hook refuses POSIX changes inside ``root`` until the matching :func:`_unwatch`."""
    _buckets[root] = _buckets.get(root, 0) + 1


def _unwatch(root: str) -> None:
    n = _buckets.get(root, 1) - 1
    if n:
        _buckets[root] = n
    else:
        _buckets.pop(root, None)


def _gone(raw: bytes) -> bool:
    """Whether a lease's holder has certainly exited: a process of this machine that no
    longer runs (what the kernel's release of an flock gives a local store)."""
    try:
        note = json.loads(raw.decode())
        pid, host = note["pid"], note["host"]
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or host != socket.gethostname():
        return False
    return not _running(pid)


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (or may: one not ours to signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _dead_part(name: str) -> bool:
    """Whether ``name`` is the part of a put (``.<name>{_UPLOADS}<pid>-<thread>``) whose process
    no longer runs."""
    if _UPLOADS not in name:
        return False
    pid = name.rsplit(_UPLOADS, 1)[-1].split("-", 1)[0]
    return pid.isdigit() and not _running(int(pid))


@contextlib.contextmanager
def _backend() -> Iterator[None]:
    prev = getattr(_inside, "on", False)
    _inside.on = True
    try:
        yield
    finally:
        _inside.on = prev


class _SpoolSink:
    def __init__(self, store: ObjectDirStorage, key: str, size: int, spool: Path):
        self.key, self._store = key, store
        self.path = spool
        self.target = str(spool)
        self.direct = False  # close reads the spool back to upload it
        with open(spool, "wb") as f:
            f.truncate(size)
        self._open = True

    def pwrite(self, data: bytes, offset: int) -> None:
        if not self._open:
            raise SemanticsViolation(f"{self.key}: written after its sink closed")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._store._upload(self.key, self.path)
            self.path.unlink()

    def abort(self) -> None:
        self._open = False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class _Output:
    def __init__(self, store: ObjectDirStorage, dst: str, force: bool, directory: bool, token: str, create: bool,
                 commit: tuple[str, ...] = ()):
        self.store, self.key, self.directory = store, dst, directory
        self.spool = Path(tempfile.gettempdir()) / f"ravex-spool-{token}"
        self._written: list[str] = []
        self._sinks: list[_SpoolSink] = []
        self._watch()
        try:
            self._create(dst, force, create, commit)
        except BaseException:
            self._unwatch()  # refused before it began: nothing of it may stay watched in this process
            raise
        self.spool.mkdir(exist_ok=True)

    def _create(self, dst: str, force: bool, create: bool, commit: tuple[str, ...]) -> None:
        store = self.store
        if create:
            if not os.path.isdir(store.root):
                raise RavexError(f"{store.root}: the destination's bucket (directory) does not exist", hint="create it first", path=store.root)
            old = store.list(dst) if store.exists(dst + "/") else ([dst] if store.exists(dst) else [])
            # Something at the key, even an empty "folder" (a directory here), is there already.
            # Unfinished uploads are not: a writer killed mid-put leaves its part behind, which
            # an object store never shows (its lifecycle rule aborts the upload later).
            store.abort_dead_parts(dst)
            here = store.local_path(dst)
            if (old or (here.exists() and not store.only_uploads(dst))) and not force:
                raise RavexError(f"{SCHEME}{store.root}/{dst}: already exists", hint="pass --force to replace it, or choose another destination")
            # No atomic replace of many objects exists: the old output's commit objects go
            # first, so it stops being a checkpoint before any new object lands.
            for k in sorted(old, key=lambda k: k.rsplit("/", 1)[-1] not in commit):
                store.delete(k)
            if not old and here.is_dir() and not any(here.iterdir()):
                with _backend():
                    here.rmdir()  # an empty folder marker

    def _watch(self) -> None:
        _watch(self.store.root)
        self._watching = True

    def _unwatch(self) -> None:
        if getattr(self, "_watching", False):
            self._watching = False
            _unwatch(self.store.root)

    def _key(self, rel: str) -> str:
        return f"{self.key}/{rel}" if rel else self.key

    def sink(self, rel: str, size: int) -> _SpoolSink:
        key = self._key(rel)
        s = _SpoolSink(self.store, key, size, self.spool / f"{len(self._sinks)}-{os.getpid()}-{threading.get_native_id()}")
        self._sinks.append(s)
        self._written.append(key)
        return s

    def scratch(self, size: int) -> _SpoolSink:
        s = _SpoolSink(self.store, "", size, self.spool / f"scratch-{len(self._sinks)}-{os.getpid()}-{threading.get_native_id()}")
        self._sinks.append(s)
        return s

    def put(self, rel: str, data: bytes) -> None:
        key = self._key(rel)
        self.store.put(key, data, if_generation=ABSENT)
        self._written.append(key)

    def publish(self, commit: list[tuple[str, bytes]]) -> None:
        for s in self._sinks:
            if s._open:
                raise SemanticsViolation(f"{s.key}: still open at commit")
        for rel, data in commit:
            self.put(rel, data)
        shutil.rmtree(self.spool, ignore_errors=True)
        self._unwatch()

    def abort(self) -> None:
        """Every object under the output's key goes (other ranks' too: they are all this output's)."""
        for s in self._sinks:
            s.abort()
        keys = set(self._written) | set(self.store.list(self.key)) | ({self.key} if self.store.exists(self.key) else set())
        for key in sorted(keys):
            with contextlib.suppress(FileNotFoundError):
                self.store.delete(key)
        shutil.rmtree(self.spool, ignore_errors=True)
        self._unwatch()


class ObjectDirStorage:
    """Objects as files under ``root`` (the bucket); keys are relative, '/'-separated."""

    scheme = "objdir"

    def __init__(self, root: str | Path):
        global _hooked
        self.root = os.path.abspath(root)
        self._lock = threading.Lock()
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True

    def _file(self, key: str) -> Path:
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.rstrip("/").split("/")):
            raise RavexError(f"{key!r}: not an object key (relative, '/'-separated, no '.' or '..')")
        return Path(self.root, key)

    def output(self, dst: str, *, force: bool, directory: bool, token: str, create: bool = True, staging: str | None = None,
               commit: tuple[str, ...] = ()) -> _Output:
        return _Output(self, dst, force, directory, token, create, commit)

    def exists(self, key: str) -> bool:
        if key.endswith("/"):
            return bool(self.list(key.rstrip("/")))
        return self._file(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._file(prefix) if prefix else Path(self.root)
        if not base.is_dir():
            return []
        keys = (str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())
        return sorted(k for k in keys if _UPLOADS not in k)

    def only_uploads(self, prefix: str) -> bool:
        """Whether ``prefix`` is a directory holding unfinished uploads and nothing else: no object,
        and not an empty "folder" either."""
        base = self._file(prefix)
        files = [p for p in base.rglob("*") if p.is_file()] if base.is_dir() else []
        return bool(files) and all(_UPLOADS in p.name for p in files)

    def abort_unfinished(self, prefix: str) -> None:
        """What an object store's lifecycle rule does to uploads never completed: the parts under
        ``prefix`` of puts whose process (of this machine) no longer runs are deleted, and so are
        the directories under it left holding nothing (a put killed between making its key's
        directory and opening its part leaves one: an object store has no such folder)."""
        base = self._file(prefix)
        if not base.is_dir():
            return
        with _backend():
            for top, _, names in os.walk(base, topdown=False):
                for name in names:
                    if _dead_part(name):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(top, name))
                if top != str(base):
                    with contextlib.suppress(OSError):  # not empty: it holds objects or live parts
                        os.rmdir(top)

    def abort_dead_parts(self, prefix: str) -> None:
        """Delete the parts under ``prefix`` of puts whose process (of this machine) no longer runs,
        and the directories that held nothing else (the put made them)."""
        base = self._file(prefix)
        if not base.is_dir():
            return
        for part in list(base.rglob(f"*{_UPLOADS}*")):
            if _dead_part(part.name):
                with _backend():
                    with contextlib.suppress(FileNotFoundError):
                        part.unlink()
                    self._drop_empty_parents(part)

    def stat(self, key: str) -> Stat | None:
        try:
            st = self._file(key).stat()
        except FileNotFoundError:
            return None
        return Stat(st.st_size, self._generation(key, st))

    @staticmethod
    def _generation(key: str, st: os.stat_result) -> int:
        # Each put makes a new file: a new inode beside the one it replaces, and a new mtime
        # (both, since a filesystem's clock may tick coarser than the puts come).
        return (st.st_ino << 64) | st.st_mtime_ns

    def get(self, key: str) -> tuple[bytes, int]:
        with open(self._file(key), "rb") as f:
            return f.read(), self._generation(key, os.fstat(f.fileno()))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with open(self._file(key), "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def _place(self, key: str, write: object) -> int:
        """The backend's own atomic put (what the object store's server does)."""
        path = self._file(key)
        with _backend():
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.parent / f".{path.name}{_UPLOADS}{os.getpid()}-{threading.get_native_id()}"
            with open(part, "wb") as f:
                write(f)  # type: ignore[operator]
                f.flush()
                fsync_fd(f.fileno())
            os.replace(part, path)
            st = path.stat()
            _gens[str(path)] = (st.st_ino, st.st_mtime_ns)
        return self._generation(key, st)

    def _upload(self, key: str, spool: Path) -> None:
        with self._lock:
            if self._file(key).exists():
                raise PreconditionFailed(f"{key}: exists; an object store does not update objects in place")

            def copy(f: object) -> None:
                with open(spool, "rb") as src:
                    shutil.copyfileobj(src, f, 16 << 20)  # type: ignore[arg-type]

            self._place(key, copy)

    def put(self, key: str, data: bytes, *, if_generation: int | None = None, staging: str | None = None) -> int:
        """A whole object, conditionally (``staging`` means nothing here: no rename)."""
        with self._lock:
            if if_generation is not None:
                now = self.stat(key)
                if (now is None) != (if_generation == ABSENT) or (now is not None and now.generation != if_generation):
                    raise PreconditionFailed(f"{key}: not at the generation the writer read")
            return self._place(key, lambda f: f.write(data))

    def delete(self, key: str) -> None:
        """The object goes; so does the backing directory of every prefix left with no
        object (a "directory" of an object store exists only while it holds objects)."""
        path = self._file(key)
        with _backend(), self._lock:
            path.unlink()
            _gens.pop(str(path), None)
            self._drop_empty_parents(path)

    def _drop_empty_parents(self, path: Path) -> None:
        """The directories above ``path``, up to the bucket, that hold nothing now (inside the backend)."""
        root = Path(self.root)
        parent = path.parent
        while parent != root and root in parent.parents:
            try:
                parent.rmdir()
            except OSError:  # not empty (or not ours to remove): a prefix still in use
                break
            parent = parent.parent

    def local_path(self, key: str) -> Path:
        return self._file(key)

    @contextlib.contextmanager
    def lease(self, key: str, holder: str) -> Iterator[None]:
        """A lease object at ``key``, put only if absent and deleted on release. One left by a
        process of this machine that no longer runs is taken over by a put conditional on its
        generation (only one taker wins); any other is the holder's, named in the
        :class:`PreconditionFailed`. While it is held, the audit hook watches the bucket: what
        the holder does there goes through the backend."""
        gen = self._take(key, lease_note(holder))
        owner = os.getpid()
        _watch(self.root)
        try:
            yield
        finally:
            _unwatch(self.root)
            # A forked child (a DataLoader worker) finalizing its copy of the holder's state never
            # releases: the lease is the parent's, who still holds it.
            now = self.stat(key) if os.getpid() == owner else None
            if now is not None and now.generation == gen:  # still ours
                with contextlib.suppress(FileNotFoundError):
                    self.delete(key)

    def _take(self, key: str, note: bytes) -> int:
        try:
            return self.put(key, note, if_generation=ABSENT)
        except PreconditionFailed:
            pass
        try:
            raw, gen = self.get(key)
        except FileNotFoundError:  # released in between
            return self.put(key, note, if_generation=ABSENT)
        if not _gone(raw):
            raise PreconditionFailed(holder_text(raw))
        try:
            return self.put(key, note, if_generation=gen)
        except PreconditionFailed:  # another writer took it over first
            raise PreconditionFailed(holder_text(self.get(key)[0])) from None

    def audit(self) -> builtins.list[str]:
        """Objects in the bucket that the backend did not put, or that changed since."""
        bad = []
        for key in self.list(""):
            st = self._file(key).stat()
            g = _gens.get(str(self._file(key)))
            if g is None or g != (st.st_ino, st.st_mtime_ns):
                bad.append(key)
        return bad
