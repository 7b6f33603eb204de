"""A backend with object-store semantics, over a local directory (``objdir://``).

It is a client of the object-store layer (:mod:`.objstore`), as :mod:`.s3` is: outputs,
commits and leases are that layer's, the same code over either. It exists so that no code path can quietly assume POSIX: every writer and
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
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .._output import fsync_fd
from ..errors import RavexError
from .base import PreconditionFailed, Stat
from .objstore import ObjectStore, pwrite_file
from .objstore import Output as _Output  # noqa: F401 - objdir's outputs are the shared layer's (a test patches them here)

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
    """An upload: a spool file outside the bucket, written by range while open, put whole on close."""

    def __init__(self, client: _DirClient, key: str, size: int, spool: Path):
        self.key, self._client = key, client
        self.path = spool
        self.target = str(spool)
        self.direct = False  # close reads the spool back to upload it
        with open(spool, "wb") as f:
            f.truncate(size)
        self.open = True

    def pwrite(self, data: bytes, offset: int) -> None:
        if not self.open:
            raise SemanticsViolation(f"{self.key}: written after its sink closed")
        pwrite_file(self.path, data, offset)

    def close(self) -> None:
        if self.open:
            self.open = False
            self._client.complete(self.key, self.path)
            self.path.unlink()

    def abort(self) -> None:
        self.open = False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


_sinks = itertools.count()


def _spool(token: str) -> Path:
    return Path(tempfile.gettempdir()) / f"ravex-spool-{token}"


class _DirClient:
    """The objdir "server": objects as files under ``root`` (the bucket); keys are relative,
    '/'-separated. Each object appears by a rename inside the backend, which is its atomic put."""

    @property
    def lease_ttl(self) -> float | None:
        return None  # one machine: a holder's death is seen from its pid, a lease never lapses

    def clock(self, key: str) -> float:
        return time.time()  # the "server" is this machine: its clock is the files' mtime

    def __init__(self, root: str):
        self.root = root
        self.name = root
        self._lock = threading.Lock()

    def file(self, key: str) -> Path:
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.rstrip("/").split("/")):
            raise RavexError(f"{key!r}: not an object key (relative, '/'-separated, no '.' or '..')")
        return Path(self.root, key)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.root}/{key}"

    def head(self, key: str) -> Stat | None:
        try:
            st = self.file(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return Stat(st.st_size, _generation(st), st.st_mtime)

    def get(self, key: str) -> tuple[bytes, int]:
        with open(self.file(key), "rb") as f:
            return f.read(), _generation(os.fstat(f.fileno()))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with open(self.file(key), "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def list(self, prefix: str) -> builtins.list[str]:
        base = self.file(prefix) if prefix else Path(self.root)
        if not base.is_dir():
            return []
        keys = (str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())
        return sorted(k for k in keys if _UPLOADS not in k)

    def _place(self, key: str, write: object) -> int:
        """The backend's own atomic put (what the object store's server does)."""
        path = self.file(key)
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
        return _generation(st)

    def put(self, key: str, data: bytes, mode: str, generation: object) -> int:
        with self._lock:
            if mode != "overwrite":
                now = self.head(key)
                if (now is None) != (mode == "create") or (now is not None and now.generation != generation):
                    raise PreconditionFailed(f"{key}: not at the generation the writer read")
            return self._place(key, lambda f: f.write(data))

    def complete(self, key: str, spool: Path) -> None:
        """An upload completes: its object appears whole, only where none is (no update in place)."""
        with self._lock:
            if self.file(key).exists():
                raise PreconditionFailed(f"{key}: exists; an object store does not update objects in place")

            def copy(f: object) -> None:
                with open(spool, "rb") as src:
                    shutil.copyfileobj(src, f, 16 << 20)  # type: ignore[arg-type]

            self._place(key, copy)

    def upload(self, key: str, size: int, token: str) -> _SpoolSink:
        spool = _spool(token)
        spool.mkdir(exist_ok=True)
        return _SpoolSink(self, key, size, spool / f"{next(_sinks)}-{os.getpid()}-{threading.get_native_id()}")

    def delete(self, key: str) -> None:
        """The object goes; so does the backing directory of every prefix left with no
        object (a "directory" of an object store exists only while it holds objects)."""
        path = self.file(key)
        with _backend(), self._lock:
            path.unlink()
            _gens.pop(str(path), None)
            self.drop_empty_parents(path)

    def delete_if(self, key: str, generation: object) -> None:
        with self._lock:
            now = self.head(key)
            if now is None or now.generation != generation:
                return  # not ours any more
            path = self.file(key)
            with _backend(), contextlib.suppress(FileNotFoundError):
                path.unlink()
                _gens.pop(str(path), None)
                self.drop_empty_parents(path)

    def drop_empty_parents(self, path: Path) -> None:
        """The directories above ``path``, up to the bucket, that hold nothing now (inside the backend)."""
        root = Path(self.root)
        parent = path.parent
        while parent != root and root in parent.parents:
            try:
                parent.rmdir()
            except OSError:  # not empty (or not ours to remove): a prefix still in use
                break
            parent = parent.parent

    def abort_unfinished(self, prefix: str) -> None:
        """What an object store's lifecycle rule does to uploads never completed: the parts under
        ``prefix`` of puts whose process (of this machine) no longer runs are deleted, and so are
        the directories under it left holding nothing (a put killed between making its key's
        directory and opening its part leaves one: an object store has no such folder)."""
        base = self.file(prefix)
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

    def abort_dead(self, prefix: str) -> None:
        """Delete the parts under ``prefix`` of puts whose process (of this machine) no longer runs,
        and the directories that held nothing else (the put made them)."""
        base = self.file(prefix)
        if not base.is_dir():
            return
        for part in list(base.rglob(f"*{_UPLOADS}*")):
            if _dead_part(part.name):
                with _backend():
                    with contextlib.suppress(FileNotFoundError):
                        part.unlink()
                    self.drop_empty_parents(part)

    def only_uploads(self, prefix: str) -> bool:
        """Whether ``prefix`` is a directory holding unfinished uploads and nothing else: no object,
        and not an empty "folder" either."""
        base = self.file(prefix)
        files = [p for p in base.rglob("*") if p.is_file()] if base.is_dir() else []
        return bool(files) and all(_UPLOADS in p.name for p in files)

    def view(self, key: str) -> Path:
        return self.file(key)

    def reachable(self) -> bool:
        return True

    def begin(self, key: str) -> None:
        if not os.path.isdir(self.root):
            raise RavexError(f"{self.root}: the destination's bucket (directory) does not exist", hint="create it first", path=self.root)

    def occupied(self, key: str) -> bool:
        # Something at the key, even an empty "folder" (a directory here), is there already.
        # Unfinished uploads are not: a writer killed mid-put leaves its part behind, which
        # an object store never shows (its lifecycle rule aborts the upload later).
        return self.file(key).exists() and not self.only_uploads(key)

    def cleared(self, key: str) -> None:
        here = self.file(key)
        if here.is_dir() and not any(here.iterdir()):
            with _backend():
                here.rmdir()  # an empty folder marker

    def watch(self) -> None:
        _watch(self.root)

    def unwatch(self, token: str | None) -> None:
        if token is not None:
            shutil.rmtree(_spool(token), ignore_errors=True)
        _unwatch(self.root)


def _generation(st: os.stat_result) -> int:
    # Each put makes a new file: a new inode beside the one it replaces, and a new mtime
    # (both, since a filesystem's clock may tick coarser than the puts come).
    return (st.st_ino << 64) | st.st_mtime_ns


class ObjectDirStorage(ObjectStore):
    """Objects as files under ``root`` (the bucket); keys are relative, '/'-separated."""

    scheme = "objdir"

    def __init__(self, root: str | Path):
        global _hooked
        self.root = os.path.abspath(root)
        self.dir = _DirClient(self.root)
        super().__init__(self.dir)
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True

    def exists(self, key: str) -> bool:
        if key.endswith("/"):
            return bool(self.list(key.rstrip("/")))
        return self.dir.file(key).is_file()

    def only_uploads(self, prefix: str) -> bool:
        return self.dir.only_uploads(prefix)

    def abort_dead_parts(self, prefix: str) -> None:
        self.dir.abort_dead(prefix)

    def audit(self) -> builtins.list[str]:
        """Objects in the bucket that the backend did not put, or that changed since."""
        bad = []
        for key in self.list(""):
            st = self.dir.file(key).stat()
            g = _gens.get(str(self.dir.file(key)))
            if g is None or g != (st.st_ino, st.st_mtime_ns):
                bad.append(key)
        return bad
