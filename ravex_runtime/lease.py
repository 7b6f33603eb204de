"""The run lock: one training run writes to a store, from its session's start to its close.

On a local store the lock is an ``flock`` on the store directory itself (the
writer's own lock, ``<store>/lock``, is taken per write, so the two never meet
in one process); on object storage, where there is no directory to lock, it is
the lease object ``<store>/run-lock`` (docs/format.md section 3). Taking it
also checks that the store is one: a directory or prefix without the store's
marker is refused unless it is empty or what an interrupted creation leaves.

DataLoader workers are forked while a run holds the lock. The fork hooks keep
a write from being in flight at that instant (:attr:`StoreLock.writing`), and
a child never keeps its parent's lock: an flock lives as long as any copy of
its descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path
from typing import Any

from ravex_convert.errors import IncompleteCheckpointError, RavexError
from ravex_convert.formats.native.store import LOCK, RUN_LOCK, claim, empty_manifest, where
from ravex_convert.storage import Lease, Location, PreconditionFailed

from .dist import PROBE_PREFIX
from .loading import TS_FILE

__all__ = ["StoreLock"]

_held: list[StoreLock] = []  # the run locks this process holds, for the fork hooks
_fork_hooks = False


def _before_fork() -> None:
    # No write may be in flight, or the child would inherit the writer's lock on the store.
    for s in _held:
        s.writing.acquire()


def _after_fork_parent() -> None:
    for s in _held:
        s.writing.release()


def _after_fork_child() -> None:
    # The child (a worker) never writes; nor may it keep the store's run lock after its parent is gone.
    for s in _held:
        s.writing.release()
        if s._fd is not None:
            os.close(s._fd)
            s._fd = None
        s._lease = s.fence = None  # the parent's: the child never releases it
    _held.clear()


def _register_fork_hooks() -> None:
    global _fork_hooks
    if not _fork_hooks:  # once, at the first session: nothing happens at import
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
        _fork_hooks = True


class StoreLock:
    """The run lock on the store a session writes to.

    Args:
        path: where the store's bytes are read (an objdir store's local view).
        dst: the store as the writers and the storage layer take it (``objdir:`` kept).
        owner: the run's id, recorded in the lease on object storage.
        source: where the configuration came from, for hints.

    :meth:`take` raises :class:`~ravex_convert.errors.RavexError` when another run
    holds the store or the path is not a store; :meth:`release` gives it back.
    """

    def __init__(self, path: Path, dst: str | Path | Location, owner: str, source: str) -> None:
        self.path, self.dst, self.owner, self.source = path, dst, owner, source
        # Held by the writer while it writes into the store: a fork waits for it.
        self.writing = threading.Lock()
        self._fd: int | None = None
        self._lease: Any = None  # object storage: the run's lease, held open (a context manager)
        self.fence: Lease | None = None  # object storage: what that lease yields, the run's fencing token
        _register_fork_hooks()

    def take(self) -> None:
        """Take the lock: an flock on a local store, the lease object on object storage."""
        w = where(self.dst)
        if not w.posix:
            self._take_lease(w)
            return
        store = self.path
        if store.exists() and not store.is_dir():
            raise RavexError(f"storage.path {store} exists and is not a directory", hint=f"set storage.path in {self.source} to a directory")
        store.mkdir(parents=True, exist_ok=True)
        if not (store / "ravex-store.json").is_file():
            self._refuse_foreign(store, {p.name: p for p in store.iterdir()})
        fd = os.open(store, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RavexError(f"{store}: another training run is using this checkpoint store",
                                 hint="only one run may write to a store at a time: stop the other run, or set storage.path (RAVEX_STORAGE_PATH) to another directory",
                                 path=store) from None
            raise
        self._fd = fd
        _held.append(self)

    def release(self) -> None:
        """Give the lock back (harmless when it is not held)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lease is not None:
            lease, self._lease = self._lease, None
            self.fence = None
            lease.__exit__(None, None, None)
        if self in _held:
            _held.remove(self)

    def _take_lease(self, w: Any) -> None:
        """The run lock on object storage: the lease object ``<store>/run-lock``, held until
        :meth:`release`; the writer's own lease (``<store>/lock``) is taken per write, as the lock file is locally."""
        bucket = getattr(w.storage, "root", None)
        if isinstance(bucket, str) and not os.path.isdir(bucket):
            raise RavexError(f"storage.path {w.label}: its bucket {bucket} (the directory above the store) does not exist",
                             hint="create the bucket first (object storage has no directories to make)", path=Path(bucket))
        if w.storage.exists(w.key):
            raise RavexError(f"storage.path {w.label} is an object, not a store (a prefix of objects)",
                             hint=f"set storage.path in {self.source} to another key", path=w.path)
        rels = w.objects()
        if "ravex-store.json" not in rels:
            # a "directory" of object storage exists only while objects lie under it: checkpoints/ is never empty here
            self._refuse_foreign(w.path, {r.split("/", 1)[0]: None for r in rels}, shown=w.label)
        lease = w.storage.lease(w.key_of(RUN_LOCK), self.owner)
        try:
            fence = lease.__enter__()
        except PreconditionFailed as held:
            raise RavexError(f"{w.label}: another training run is using this checkpoint store ({held})",
                             hint="only one run may write to a store at a time: stop the other run, or set storage.path (RAVEX_STORAGE_PATH) "
                                  f"to another store; a run killed on another machine leaves its lease behind, which the next run takes "
                                  f"over once it lapses by its holder's TTL (RAVEX_S3_LEASE_TTL): start it again then, or, once that run "
                                  f"is certainly gone, delete the object {w.shown(RUN_LOCK)}", path=w.path) from None
        self._lease = lease
        _held.append(self)
        if isinstance(fence, Lease):
            try:
                # from here no run of an older generation can commit to the store (store.claim)
                claim(w, fence)
            except BaseException:
                self.release()
                raise
            self.fence = fence

    def _refuse_foreign(self, store: Path, names: dict[str, Path | None], *, shown: str | None = None) -> None:
        """A store without its marker: refuse what is not an empty directory or what an interrupted
        creation leaves. ``names``: the store's top-level entries (a local path each; None on object storage)."""
        shown = shown or str(store)
        self._refuse_unmarked(store, names, shown)
        other = [n for n in names if n not in (LOCK, RUN_LOCK, "manifest.json", "checkpoints") and ".tmp-" not in n
                 and not TS_FILE.fullmatch(n) and not n.startswith(PROBE_PREFIX)]
        if other:
            raise RavexError(f"storage.path {shown} is not a Ravex store and not empty (it holds {', '.join(sorted(other)[:5])})",
                             hint=f"point storage.path in {self.source} at a new or empty directory", path=store)

    def _refuse_unmarked(self, store: Path, names: dict[str, Path | None], shown: str) -> None:
        """A directory holding a store's manifest or checkpoints but no marker is a damaged store, not an
        empty directory: starting over there would discard its checkpoints."""
        held = [n for n in ("manifest.json", "checkpoints") if n in names]
        if "manifest.json" in held and empty_manifest(store / "manifest.json"):
            # a manifest that lists nothing is what creation writes before the marker: the
            # writer finishes such a store, as it would after a kill at that instant
            held.remove("manifest.json")
        ck = names.get("checkpoints")
        if held == ["checkpoints"] and ck is not None and ck.is_dir() and not ck.is_symlink() and not any(ck.iterdir()):
            held = []  # an empty checkpoints/ is what an interrupted creation leaves: nothing to lose
        if held:
            raise IncompleteCheckpointError(
                f"storage.path {shown} holds {' and '.join(held)} of a Ravex store but not its marker ravex-store.json; "
                "Ravex does not take it for an empty directory (that would start over and discard its checkpoints)",
                hint=f"if it is your store, put its ravex-store.json back (a copy, or see docs/format.md section 2); "
                     f"to start a new run, set storage.path in {self.source} to a new directory", path=store / "ravex-store.json")
