"""S3 and S3-compatible object stores (AWS S3, Cloudflare R2, MinIO, SeaweedFS): ``s3://BUCKET/KEY``.

The bytes move in the Rust core (``_core.S3Bucket``, the ``object_store`` crate): readers
get an :class:`S3Path`, which answers the few ``pathlib`` questions they ask from listings
and reads objects by range; the executor reads source objects by range and writes each
output object as a multipart upload of equal parts, uploaded as they fill. Nothing is
spooled to local disk, and nothing is ever replaced in place:

- an output's data objects go up first; its format's commit objects (DCP ``.metadata``,
  ZeRO ``latest``, a safetensors index, the native manifest) are put last, each with
  ``If-None-Match: *``, so a reader sees the old state or the new one, never half of it;
- a replaced object (the native manifest) is put with ``If-Match`` on the ETag it was read
  at; a conditional put whose answer was lost (a retry that gets 412 against its own first
  attempt) is settled by reading the object back: the bytes Ravex writes there carry the
  writer's run id, so they are its own only if they are equal;
- the run lock is a lease object (a fencing token, :mod:`.lease`), created only where absent,
  renewed every ``RAVEX_S3_LEASE_TTL``/4 seconds while held, taken over only when its holder's
  process is gone (the same boot and PID namespace) or it lapsed by the holder's TTL on the
  server's clock, and released with a conditional delete;
- multipart uploads a killed writer left behind are listed and aborted when the next
  writer begins at that prefix.

Credentials come from the environment only: ``RAVEX_S3_ACCESS_KEY`` / ``RAVEX_S3_SECRET_KEY``
where set, else the standard ``AWS_*`` variables (and web identity, container or instance
credentials), as the AWS tools read them; ``AWS_ENDPOINT_URL`` (or ``RAVEX_S3_ENDPOINT``)
for R2, MinIO and other S3-compatible stores. They never appear in a message.
"""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import io
import os
import stat as stat_mod
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from .. import _core
from ..errors import FileSystemError, RavexError, translate_os_errors
from .base import PreconditionFailed, Stat
from .lease import probe_clock
from .objstore import ObjectStore
from .s3conf import SCHEME, answered, client_key, client_settings, configure, error, lease_ttl, split, unreachable

__all__ = ["SCHEME", "S3Path", "S3Storage", "bucket", "configure", "split"]

# listings a reader asked for, kept briefly: detection and a reader ask about the same directory
# many times within a second; this process's own writes to the bucket drop them at once
_LISTING_TTL_S = 2.0
_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def bucket(name: str) -> Any:
    """The client of bucket ``name`` in this process, configured from the environment."""
    settings = client_settings(name)
    key = client_key(name, settings)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            try:
                client = _core.S3Bucket(name, **settings)
            except _core.S3Error as exc:
                raise error(exc) from None
            _clients[key] = client
    return client


def _translate(exc: OSError) -> FileSystemError | None:
    return error(exc) if isinstance(exc, _core.S3Error) else None


translate_os_errors(_translate)  # an S3Error from any call (the executor's too) is reported as one


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    """Core S3 errors inside the block as :class:`RavexError`; a lost condition as
    :class:`PreconditionFailed`; a missing object as ``FileNotFoundError``."""
    try:
        yield
    except _core.S3Error as exc:
        if exc.kind == "precondition":
            raise PreconditionFailed(str(exc)) from None
        if exc.kind == "not_found":
            raise FileNotFoundError(2, "no such object", exc.url) from None
        raise error(exc) from None


# ------------------------------------------------------------------------------ listing cache

_listings: dict[tuple[str, str], tuple[float, dict[str, tuple[int, str]], set[str]]] = {}


def _forget(bucket_name: str) -> None:
    """A write in ``bucket_name``: what was listed there is stale."""
    for k in [k for k in _listings if k[0] == bucket_name]:
        _listings.pop(k, None)


def _listing(bucket_name: str, prefix: str) -> tuple[dict[str, tuple[int, str]], set[str]]:
    """``({name: (size, etag)}, {directory names})`` directly under ``prefix``."""
    now = time.monotonic()
    hit = _listings.get((bucket_name, prefix))
    if hit is not None and now - hit[0] < _LISTING_TTL_S:
        return hit[1], hit[2]
    with _mapped():
        objects, prefixes = bucket(bucket_name).list_dir(prefix)
    base = len(prefix) + 1 if prefix else 0
    files = {k[base:]: (size, etag) for k, size, etag in objects}
    dirs = {p[base:].rstrip("/") for p in prefixes}
    _listings[(bucket_name, prefix)] = (now, files, dirs)
    return files, dirs


# ------------------------------------------------------------------------------ paths


class _RangeReader(io.RawIOBase):
    """An object read by range: what ``open(path, "rb")`` gives a reader."""

    def __init__(self, obj: Any, size: int, name: str):
        self._obj, self._size, self._pos, self.name = obj, size, 0, name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n == 0:
            return 0
        try:
            data = self._obj.read(self._pos, n)
        except OSError as exc:
            raise OSError(f"{self.name}: {exc}") from None
        b[:n] = data
        self._pos += n
        return n


def _stat_result(mode: int, size: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, 0, 0, size, 0, 0, 0))


class S3Path(PurePosixPath):
    """``s3://bucket/key`` as the read-only path a reader is given: ``/``, ``name``,
    ``suffix``, ``parent`` as for any path; ``is_file``, ``is_dir``, ``exists``, ``iterdir``,
    ``glob``, ``stat`` from listings; ``read_bytes`` and ``open("rb")`` by ranged GETs."""

    # pathlib (3.11) builds derived paths with object.__new__: the class carries over, and
    # everything else is in the parts ('s3:', bucket, key...)

    @classmethod
    def of(cls, url: str) -> S3Path:
        name, key = split(url)
        return cls("s3:", name, *(key.split("/") if key else []))

    def __str__(self) -> str:
        if not self.parts or self.parts[0] != "s3:":
            return super().__str__()  # relative to a prefix (a file's name inside its checkpoint)
        return SCHEME + "/".join(self.parts[1:])

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"S3Path({str(self)!r})"

    @property
    def bucket_name(self) -> str:
        return self.parts[1]

    @property
    def key(self) -> str:
        return "/".join(self.parts[2:])

    def _entry(self) -> tuple[int, str] | None:
        if not self.key:
            return None
        parent = "/".join(self.parts[2:-1])
        files, _ = _listing(self.bucket_name, parent)
        return files.get(self.name)

    def is_file(self) -> bool:
        return self._entry() is not None

    def is_dir(self) -> bool:
        if not self.key:
            return True
        _, dirs = _listing(self.bucket_name, "/".join(self.parts[2:-1]))
        return self.name in dirs

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> S3Path:
        return self

    def absolute(self) -> S3Path:
        return self

    def expanduser(self) -> S3Path:
        return self

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        entry = self._entry()
        if entry is not None:
            return _stat_result(stat_mod.S_IFREG | 0o444, entry[0])
        if self.is_dir():
            return _stat_result(stat_mod.S_IFDIR | 0o555, 0)
        raise FileNotFoundError(2, "no such object", str(self))

    def lstat(self) -> os.stat_result:
        return self.stat()

    def iterdir(self) -> Iterator[S3Path]:
        files, dirs = _listing(self.bucket_name, self.key)
        if not files and not dirs and not self.is_dir():
            raise FileNotFoundError(2, "no such prefix", str(self))
        for name in sorted(set(files) | dirs):
            yield self / name

    def glob(self, pattern: str) -> Iterator[S3Path]:
        if pattern.startswith("**/"):
            yield from self.rglob(pattern[3:])
            return
        if "/" in pattern:
            head, rest = pattern.split("/", 1)
            for p in self.glob(head):
                if p.is_dir():
                    yield from p.glob(rest)
            return
        for p in self.iterdir():
            if fnmatch.fnmatchcase(p.name, pattern):
                yield p

    def rglob(self, pattern: str) -> Iterator[S3Path]:
        with _mapped():
            listed = bucket(self.bucket_name).list(self.key)
        base = len(self.key) + 1 if self.key else 0
        seen: set[str] = set()
        for k, _, _ in listed:
            rel = k[base:].split("/")
            for i in range(1, len(rel) + 1):  # the object and every "directory" above it
                sub = "/".join(rel[:i])
                if sub not in seen and fnmatch.fnmatchcase(rel[i - 1], pattern):
                    seen.add(sub)
                    yield self.joinpath(*rel[:i])

    def object(self) -> Any:
        """The core's handle of this object, for the executor (its size from the listing)."""
        entry = self._entry()
        if entry is None:
            raise FileNotFoundError(2, "no such object", str(self))
        return bucket(self.bucket_name).object(self.key, entry[0])

    def read_bytes(self) -> bytes:
        with _mapped():
            return bytes(bucket(self.bucket_name).get(self.key)[0])

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def open(self, mode: str = "r", buffering: int = -1, encoding: str | None = None, errors: str | None = None,
             newline: str | None = None) -> Any:
        if any(c in mode for c in "wax+"):
            raise RavexError(f"{self}: objects are written through the storage layer, not opened for writing")  # Ravex's own bug
        raw = _RangeReader(self.object(), self.stat().st_size, str(self))
        buffered = io.BufferedReader(raw, buffer_size=buffering if buffering > 0 else 1 << 20)
        return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding=encoding or "utf-8", errors=errors, newline=newline)


# ------------------------------------------------------------------------------ writing


class _UploadSink:
    """One object being uploaded: the executor writes ``target`` (the core's upload) by
    range; the parts go up as they fill."""

    path = None  # no local file
    direct = False

    def __init__(self, client: _S3Client, key: str, size: int):
        self.key, self._client = key, client
        with _mapped():
            self.target = client.core.upload(key, size)
        self.open = True

    def pwrite(self, data: bytes, offset: int) -> None:
        with _mapped():
            self.target.pwrite(bytes(data), offset)

    def close(self) -> None:
        if self.open:
            self.open = False
            try:
                with _mapped():
                    self.target.close()
            finally:
                _forget(self._client.name)

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.target.abort(not unreachable(self._client.name))


class _S3Client:
    """A bucket's calls, through the core's client (``_core.S3Bucket``), its errors mapped."""

    def __init__(self, name: str):
        self.name = name
        self.core = bucket(name)
        self.store: ObjectStore | None = None  # the storage over this client (its lease's clock puts through it)

    @property
    def lease_ttl(self) -> float | None:
        return lease_ttl()

    def clock(self, key: str) -> float:
        assert self.store is not None  # set by S3Storage
        return probe_clock(self.store, key)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.name}/{key}"

    def head(self, key: str) -> Stat | None:
        with _mapped():
            head = self.core.stat(key)
        return None if head is None else Stat(head[0], head[1], head[2])

    def get(self, key: str) -> tuple[bytes, Any]:
        with _mapped():
            data, etag = self.core.get(key)
        return bytes(data), etag

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with _mapped():
            return bytes(self.core.get_range(key, offset, length))

    def list(self, prefix: str) -> builtins.list[str]:
        with _mapped():
            return [k for k, _, _ in self.core.list(prefix)]

    def put(self, key: str, data: bytes, mode: str, generation: Any) -> Any:
        try:
            with _mapped():
                return self.core.put(key, data, mode, None if generation is None else str(generation))
        finally:
            _forget(self.name)

    def delete(self, key: str) -> None:
        try:
            with _mapped():
                self.core.delete(key)
        finally:
            _forget(self.name)

    def delete_if(self, key: str, generation: Any) -> None:
        try:
            with _mapped():
                self.core.delete_if(key, generation)
        finally:
            _forget(self.name)

    def upload(self, key: str, size: int, token: str) -> _UploadSink:
        return _UploadSink(self, key, size)

    def unfinished(self, prefix: str) -> builtins.list[tuple[str, str, str]]:
        with _mapped():
            found = self.core.unfinished(prefix)
        return [u for u in found if not prefix or u[0] == prefix or u[0].startswith(prefix + "/")]

    def abort_unfinished(self, prefix: str) -> None:
        """Multipart uploads a writer left unfinished at ``prefix`` (the object itself, or any under
        it as a "directory") are aborted."""
        with _mapped():
            for key, upload_id, _ in self.unfinished(prefix):
                with contextlib.suppress(_core.S3Error):
                    self.core.abort_upload(key, upload_id)

    def abort_dead(self, prefix: str) -> None:
        answered(self.name)  # it listed the output's key just now: a failure of this output is cleaned up after
        self.abort_unfinished(prefix)  # no writer is alive at a key an output begins at (the caller holds its lease)

    def view(self, key: str) -> Path:
        return S3Path.of(self.url(key))  # type: ignore[return-value]  # a path that lists and reads by range

    def reachable(self) -> bool:
        return not unreachable(self.name)

    def begin(self, key: str) -> None:
        if not key:
            raise RavexError(f"s3://{self.name}: write to a prefix inside the bucket, not to its root",
                             hint=f"give s3://{self.name}/NAME")

    def occupied(self, key: str) -> bool:
        return False  # a bucket has objects only

    def cleared(self, key: str) -> None:
        pass

    def watch(self) -> None:
        pass

    def unwatch(self, token: str | None) -> None:
        pass


class S3Storage(ObjectStore):
    """One bucket; keys are relative, '/'-separated."""

    scheme = "s3"

    def __init__(self, name: str):
        self.name = name
        self.s3 = _S3Client(name)
        super().__init__(self.s3)
        self.s3.store = self

    def url(self, key: str) -> str:
        return self.s3.url(key)

    def unfinished(self, prefix: str) -> builtins.list[tuple[str, str, str]]:
        """``(key, upload id, initiated)`` of the multipart uploads left at ``prefix``: the object
        of that key, or any under it."""
        return self.s3.unfinished(prefix)
