"""What every storage backend offers, and nothing more.

Readers, writers, the runtime and the CLI reach bytes only through these
calls, so that a backend without POSIX (an object store: no rename, no
in-place update, no flock) can hold the same checkpoints. The surface is the
intersection of a local filesystem and an object store:

- ``output(dst)``: a new output (one file, or a directory of objects) under
  construction. Its objects are written through sinks; it becomes visible at
  ``dst`` only in ``publish``, whose last step is the backend's atomic commit.
- a sink: one new object. Positional writes are allowed while it is open (an
  object store spools them, as a multipart upload assembles parts in any
  order); once closed it is durable and never changes again.
- ``put`` / ``get`` with a generation: the conditional put that both backends
  have (POSIX: write, fsync, rename under a lock; object stores: If-Match /
  If-None-Match), the only way anything is ever replaced.
- ``delete``, ``list``, ``exists``, ``local_path``.
- ``lease``: the one-writer rule (POSIX: flock; object stores: a lease object
  created with a conditional put, deleted on release).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["ABSENT", "Output", "PreconditionFailed", "Sink", "Storage", "holder_text", "lease_note", "machine"]

# `put(..., if_generation=ABSENT)`: only if no object has this key
ABSENT = -1


class PreconditionFailed(Exception):
    """A conditional put lost: the object is not at the generation the caller read."""


class Sink(Protocol):
    """A new object being written."""

    key: str
    # Whether the executor may write ``path`` around the page cache (O_DIRECT) for durable
    # output: true where the file is the object itself, false for a spool that ``close`` reads
    # back to upload.
    direct: bool

    @property
    def path(self) -> Path | None:
        """The object's local file, where it has one (None for an upload to a bucket)."""

    @property
    def target(self) -> Any:
        """What the Rust executor writes positionally while the sink is open: a local file's
        path (the object itself, or a spool) or the core's upload of it (``_core.S3Upload``);
        the executor never opens anything else for writing."""

    def pwrite(self, data: bytes, offset: int) -> None: ...

    def close(self) -> None:
        """Make the object durable (within ``durability``) and final."""

    def abort(self) -> None:
        """Drop what was written; the object never appears."""


class Output(Protocol):
    """One output at ``dst`` being built: a single object or a directory of them."""

    directory: bool

    def sink(self, rel: str, size: int) -> Sink:
        """A new object ``rel`` (relative to the output; "" for a single-object output), ``size`` bytes long."""

    def scratch(self, size: int) -> Sink:
        """A temporary local file that never becomes an object (``abort`` it when done)."""

    def put(self, rel: str, data: bytes) -> None:
        """A small object, whole."""

    def publish(self, commit: list[tuple[str, bytes]]) -> None:
        """Write the ``commit`` objects in order (the last one is the format's commit
        point: DCP's ``.metadata``, ZeRO's ``latest``, an index) once every sink is
        closed, then make the output visible at ``dst``."""

    def abort(self) -> None:
        """Remove everything this output wrote."""


@dataclass(frozen=True)
class Stat:
    size: int
    # opaque: compared for equality only (an int on a filesystem, an ETag string in a bucket)
    generation: Any
    # when the object was last written, by the server's clock (Unix seconds; None where unknown)
    modified: float | None = None


class Storage(Protocol):
    scheme: str

    def output(self, dst: str, *, force: bool, directory: bool, token: str, create: bool = True, staging: str | None = None,
               commit: tuple[str, ...] = ()) -> Output:
        """Begin (``create``) or join (another rank began it, with the same ``token``) an output at ``dst``;
        ``staging``: the name it is built under where a format fixes one (a backend without
        rename builds it in place, invisible until the format's commit point lists it);
        ``commit``: the names of the format's commit objects, which a backend without an
        atomic replace deletes first when ``force`` replaces an older output."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` (a "directory"), sorted."""

    def stat(self, key: str) -> Stat | None: ...

    def get(self, key: str) -> tuple[bytes, int]:
        """An object's bytes and generation."""

    def read_range(self, key: str, offset: int, length: int) -> bytes: ...

    def put(self, key: str, data: bytes, *, if_generation: int | None = None, staging: str | None = None) -> int:
        """Replace (or create) ``key`` atomically; with ``if_generation`` only when the
        object is at that generation (:data:`ABSENT`: does not exist), else
        :class:`PreconditionFailed`. Returns the new generation. ``staging``: the name
        (beside ``key``) a backend with rename writes the bytes under first, where a
        format fixes one (the native manifest's ``manifest.json.tmp-<run_id>``); a
        backend without rename has no such name and ignores it."""

    def delete(self, key: str) -> None: ...

    def abort_unfinished(self, prefix: str) -> None:
        """Clear what puts under ``prefix`` that never completed left (a writer killed mid-put):
        an object store's lifecycle rule; nothing to do where writes go under temporary names."""

    def local_path(self, key: str) -> Path:
        """Where a reader may map the object's bytes (read-only)."""

    def lease(self, key: str, holder: str) -> contextlib.AbstractContextManager[Any]:
        """Hold ``key`` as this writer's for the block, or raise :class:`PreconditionFailed`
        naming the holder (:func:`holder_text` of its note). On object storage the block is given
        the :class:`~.lease.Lease` (a fencing token); locally None (the flock is the fence)."""


def machine() -> dict[str, Any]:
    """What tells this machine's processes apart from another's: the kernel's boot id and this
    process's PID namespace (the inode of ``/proc/self/ns/pid``); None where unknown. A hostname
    does not (containers share one; ``unshare -u`` gives a process another)."""
    try:
        boot: str | None = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        boot = None
    try:
        ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = None
    return {"boot_id": boot, "pid_ns": ns}


def lease_note(holder: str) -> bytes:
    """What a lease records of its holder, for the message another writer gets, and for telling
    whether it runs on this machine (:func:`machine`)."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_id": holder, "since_unix": time.time(), **machine()}).encode()


def holder_text(raw: bytes) -> str:
    """A lease's holder, from the note it wrote (:func:`lease_note`), in words."""
    try:
        note = json.loads(raw.decode())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note["since_unix"])))
        return f"pid {note['pid']} on host {note['host']}, run {note['run_id']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: the lock file names no process yet"

