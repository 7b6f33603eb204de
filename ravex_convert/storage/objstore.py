"""The object-store layer: outputs, commits, leases and cleanup, once, over a small client.

An object store offers a few calls (:class:`Client`): a conditional put, a whole or ranged
get, a listing, a delete (conditional too), and a multipart upload the executor writes by
range. Everything Ravex builds on them lives here, for every object store alike:

- an output (:class:`Output`): what was at its key before is refused, or with ``force``
  deleted commit objects first (no atomic replace of many objects exists, so the old output
  stops being a checkpoint before a new object lands); its data objects are uploads; its
  commit objects are put last, each only if absent;
- a conditional put (:meth:`ObjectStore.put`): a put that loses its condition is settled by
  reading the object back, since a retried put can lose against its own first attempt whose
  answer was lost: equal bytes (Ravex's commit objects carry the writer's run id) are its own;
- a lease (:meth:`ObjectStore.lease`, :mod:`.lease`): a fencing token, an object created only
  where absent, renewed while held where the client has a TTL, taken over by a put conditional
  on the ETag read once its holder is gone (by the holder's TTL and the server's clock), and
  released by a delete conditional on the ETag last put.

``objdir`` (a local directory with object-store rules, for tests) and ``s3`` are two clients.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

from ..errors import RavexError
from .base import ABSENT, PreconditionFailed, Sink, Stat
from .lease import Lease, hold

__all__ = ["Client", "Lease", "ObjectStore", "Output", "pwrite_file"]


class Client(Protocol):
    """What an object store's server does for Ravex: the calls, and the few rules where stores differ."""

    name: str  # the bucket, for messages

    @property
    def lease_ttl(self) -> float | None:
        """Seconds a lease this client takes may go unrenewed before another writer takes it over
        (it is renewed every quarter of that); None where a lease never lapses (only its holder's
        death on this machine frees it)."""

    def clock(self, key: str) -> float:
        """The server's time now (Unix seconds), by which a lease's age (its ``Stat.modified``) is judged."""

    def url(self, key: str) -> str:
        """How messages name the object."""

    def head(self, key: str) -> Stat | None: ...

    def get(self, key: str) -> tuple[bytes, Any]:
        """An object's bytes and generation (``FileNotFoundError`` where there is none)."""

    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    def put(self, key: str, data: bytes, mode: str, generation: Any) -> Any:
        """A whole object: ``mode`` is ``overwrite``, ``create`` (only if absent) or ``replace``
        (only at ``generation``); a lost condition raises :class:`PreconditionFailed`. Returns the
        new generation."""

    def delete(self, key: str) -> None: ...

    def delete_if(self, key: str, generation: Any) -> None:
        """Delete ``key`` only while it is at ``generation``."""

    def list(self, prefix: str) -> list[str]:
        """Every object key under the "directory" ``prefix``, sorted."""

    def upload(self, key: str, size: int, token: str) -> Sink:
        """A new object written by range while open, appearing whole when closed (a multipart upload)."""

    def abort_unfinished(self, prefix: str) -> None:
        """Abort the uploads under ``prefix`` that a writer left unfinished."""

    def abort_dead(self, prefix: str) -> None:
        """Before an output begins at ``prefix``: abort the uploads there whose writer is certainly gone."""

    def view(self, key: str) -> Path:
        """What a reader opens for the object (a path that reads by range)."""

    def reachable(self) -> bool:
        """False once the server stopped answering in this process: cleanup is left to the next writer."""

    def begin(self, key: str) -> None:
        """An output begins at ``key``: refuse a key no output may have (its server answers)."""

    def occupied(self, key: str) -> bool:
        """Something other than objects holds ``key`` (an empty "folder" of a directory-backed store)."""

    def cleared(self, key: str) -> None:
        """``key`` holds nothing now, as an output begins there: drop what :meth:`occupied` saw."""

    def watch(self) -> None:
        """An output or a lease opens in the bucket."""

    def unwatch(self, token: str | None) -> None:
        """It closes (``token``: an output's, else None for a lease)."""


def pwrite_file(path: Path, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` of the local file ``path`` (a spool or a scratch file)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


class _ScratchSink:
    """A local temporary file that never becomes an object (compression's input)."""

    direct = False

    def __init__(self, size: int):
        fd, name = tempfile.mkstemp(prefix="ravex-scratch-")
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.key = ""
        self.path = Path(name)
        self.target = name

    def pwrite(self, data: bytes, offset: int) -> None:
        pwrite_file(self.path, data, offset)

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class Output:
    """One output at ``key``: uploads, then the commit objects, put last, each only if absent."""

    def __init__(self, store: ObjectStore, key: str, force: bool, directory: bool, token: str, create: bool, commit: tuple[str, ...]):
        self.store, self.key, self.directory, self.token = store, key, directory, token
        self._written: list[str] = []
        self._sinks: list[Any] = []
        self._watching = True
        store.client.watch()
        try:
            if create:
                self._create(force, commit)
        except BaseException:
            self._unwatch()  # refused before it began: nothing of it may stay watched in this process
            raise

    def _create(self, force: bool, commit: tuple[str, ...]) -> None:
        store, client, key = self.store, self.store.client, self.key
        client.begin(key)
        old = store.list(key) + ([key] if store.exists(key) else [])
        client.abort_dead(key)
        if (old or client.occupied(key)) and not force:
            raise RavexError(f"{client.url(key)}: already exists", hint="pass --force to replace it, or choose another destination")
        # No atomic replace of many objects exists: the old output's commit objects go
        # first, so it stops being a checkpoint before any new object lands.
        for k in sorted(old, key=lambda k: k.rsplit("/", 1)[-1] not in commit):
            store.delete(k)
        if not old:
            client.cleared(key)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self.store.client.unwatch(self.token)

    def _key(self, rel: str) -> str:
        return f"{self.key}/{rel}" if rel else self.key

    def sink(self, rel: str, size: int) -> Sink:
        key = self._key(rel)
        s = self.store.client.upload(key, size, self.token)
        self._sinks.append(s)
        self._written.append(key)
        return s

    def scratch(self, size: int) -> Sink:
        s = _ScratchSink(size)
        self._sinks.append(s)
        return s

    def put(self, rel: str, data: bytes) -> None:
        key = self._key(rel)
        self.store.put(key, data, if_generation=ABSENT)
        self._written.append(key)

    def publish(self, commit: list[tuple[str, bytes]]) -> None:
        for s in self._sinks:
            if getattr(s, "open", False):
                raise RavexError(f"{s.key}: still open at commit")  # Ravex's own bug
        for rel, data in commit:
            self.put(rel, data)
        self._unwatch()

    def abort(self) -> None:
        """Every object under the output's key goes (other ranks' too: they are all this output's).
        Not when the server stopped answering: the cleanup would wait out the same timeouts, and
        what is left is no checkpoint (no commit object) and is cleared by the next writer there."""
        for s in self._sinks:
            with contextlib.suppress(Exception):
                s.abort()
        try:
            if not self.store.client.reachable():
                return
            with contextlib.suppress(RavexError, OSError):
                store = self.store
                keys = set(self._written) | set(store.list(self.key)) | ({self.key} if store.exists(self.key) else set())
                for key in sorted(keys, key=lambda k: k.rsplit("/", 1)[-1] not in (".metadata", "latest", "manifest.json")):
                    with contextlib.suppress(FileNotFoundError, RavexError):
                        store.delete(key)
        finally:
            self._unwatch()


class ObjectStore:
    """The :class:`~.base.Storage` of an object store, over its :class:`Client`."""

    scheme = "object"

    def __init__(self, client: Client):
        self.client = client

    def output(self, dst: str, *, force: bool, directory: bool, token: str, create: bool = True, staging: str | None = None,
               commit: tuple[str, ...] = ()) -> Output:
        """``staging`` means nothing here: no rename; an output is built in place, invisible until its commit objects land."""
        return Output(self, dst, force, directory, token, create, commit)

    def exists(self, key: str) -> bool:
        if key.endswith("/") or not key:
            return bool(self.list(key.rstrip("/")))
        return self.stat(key) is not None

    def list(self, prefix: str) -> builtins.list[str]:
        return self.client.list(prefix)

    def stat(self, key: str) -> Stat | None:
        return self.client.head(key)

    def get(self, key: str) -> tuple[bytes, Any]:
        return self.client.get(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        return self.client.get_range(key, offset, length)

    def put(self, key: str, data: bytes, *, if_generation: Any = None, staging: str | None = None) -> Any:
        """A whole object, conditionally; ``staging`` means nothing here (no rename). A
        conditional put that loses is settled by reading back: equal bytes are this writer's
        own first attempt (a retry after a lost answer), anything else another writer's."""
        mode = "overwrite" if if_generation is None else "create" if if_generation == ABSENT else "replace"
        try:
            return self.client.put(key, bytes(data), mode, None if mode != "replace" else if_generation)
        except PreconditionFailed:
            if mode != "overwrite":
                with contextlib.suppress(FileNotFoundError, RavexError):
                    now, gen = self.get(key)
                    if now == bytes(data):
                        return gen
            raise PreconditionFailed(f"{self.client.url(key)}: another writer changed it first") from None

    def delete(self, key: str) -> None:
        self.client.delete(key)

    def abort_unfinished(self, prefix: str) -> None:
        self.client.abort_unfinished(prefix)

    def local_path(self, key: str) -> Path:
        """What a reader opens for the object."""
        return self.client.view(key)

    def lease(self, key: str, holder: str) -> contextlib.AbstractContextManager[Lease]:
        """A lease object at ``key`` (:mod:`.lease`): held for the block, a fencing token while held."""
        return hold(self, key, holder)
