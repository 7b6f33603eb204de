"""The session's background writer: each committed snapshot becomes a checkpoint of the store.

One thread, one snapshot queued while one is written. A write goes through the
converter's writers (``native_write``, or ``torch_save`` for that backend):
data first, the manifest entry last, so a crash leaves the previous checkpoint
loadable. Then ``keep_last`` prunes, never the checkpoint the run resumed from,
and nothing at all while a checkpoint of the store was skipped at resume.

A write that fails stops the writing (:attr:`Writer.error`, ``on_error``); the
training goes on. The buffers of the last snapshot written are handed back to
the next capture (:meth:`Writer.take_spare`), which copies into them.

Checkpoints do not slow training more than they must: the writer copies with
one thread and at a lower CPU priority (nice +10, Linux: per thread), so
training, which owns the other cores, is not slowed by its own checkpoints.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ravex_convert import _dist
from ravex_convert._output import Options
from ravex_convert.errors import RavexError
from ravex_convert.formats import torch_save
from ravex_convert.formats.native import writer as native_write
from ravex_convert.model import Checkpoint
from ravex_convert.storage import Lease, Location, StoreTakenOverError, resolve

from .config import Config
from .dist import StoreGroup
from .loading import torch_save_files
from .resume import Resume
from .state import Snapshot, to_checkpoint

__all__ = ["WRITER_NICE", "WRITER_THREADS", "Job", "Writer"]

log = logging.getLogger("ravex")
WRITER_THREADS = 1
WRITER_NICE = 10


def _background_priority() -> None:
    """Lower the calling thread's priority (threads it starts inherit it); best effort."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS with a thread id would renice the process
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except OSError:
        pass


@dataclass
class Job:
    """Who writes: the run's id and this rank of the job. The session changes it when the ranks join
    (one run id for all: rank 0's); the writer reads it at each write."""

    run_id: str
    rank: int = 0
    world_size: int = 1
    writers: Any = None  # per_rank: the job's store the ranks' writers agree through
    prefix: str | None = None  # the job's keys in that store (dist.Coord.prefix)
    fence: Lease | None = None  # object storage, rank 0: the run's lease; every commit is fenced by it


class Writer:
    """The background writer of one session.

    Args:
        config: the session's configuration (backend, compression, keep_last).
        path: where the store's bytes are read (an objdir store's local view).
        dst: the store as the writers and the storage layer take it.
        job: who writes (see :class:`Job`).
        resume: the session's resume: the checkpoint it restored is never pruned, nor anything
            while it skipped one of this store's.
        guard: held while writing into the store (the run lock's: a fork waits for it).
        on_error: called with the reason, on the writer thread, when a write fails.
    """

    def __init__(self, config: Config, path: Path, dst: Location, job: Job, resume: Resume, guard: threading.Lock,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.config, self.path, self.dst, self.job, self.resume = config, path, dst, job, resume
        self.error: str | None = None  # why writing stopped: the first background write that failed
        self.last_index: int | None = None  # the index of the last checkpoint written
        self.writes = 0
        self._guard = guard
        self._on_error = on_error
        # called on this thread with each checkpoint's index once it is committed and pruned (replica.py)
        self.after_write: Callable[[int], None] | None = None
        self._warned_prune = False
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._spare: dict[str, torch.Tensor] = {}
        self._spare_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = threading.Thread(target=self._loop, name="ravex-writer", daemon=True)
        self._thread.start()

    def put(self, snap: Snapshot) -> None:
        """Queue ``snap`` (waits while one is queued already)."""
        self._queue.put(snap)

    def drain(self) -> None:
        """Wait until every snapshot queued is written (or failed); never raises."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def take_spare(self) -> dict[str, torch.Tensor]:
        """The buffers of the last snapshot written, for the next capture to copy into (once)."""
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        return spare

    def close(self) -> None:
        """Stop the thread after the writes queued, and drop the spare buffers."""
        self.drain()
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        with self._spare_lock:
            self._spare = {}

    def _loop(self) -> None:
        _background_priority()
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                if self.error is None:
                    self._write(snap)
                elif snap.layout is not None:
                    self._group(snap).abort(f"rank {self.job.rank} writes no more checkpoints: {self.error}")
            except Exception as exc:  # noqa: BLE001 - a failing write stops writing; training goes on
                if isinstance(exc, StoreTakenOverError):
                    self.error = exc.message  # said once at ERROR when the lease learnt it (storage/lease.py)
                else:
                    log.error("ravex: writing the checkpoint of step %d to %s failed: %s", snap.step if snap else -1, self.path, exc)
                    self.error = f"checkpoint write failed: {exc}"
                if self._on_error is not None:
                    try:
                        self._on_error(self.error)
                    except Exception:  # the owner's handler must not stop the writer
                        log.exception("ravex: the write-error handler failed")
            finally:
                if snap is not None and self.error is None and not self._closed:
                    with self._spare_lock:
                        self._spare = snap.tensors  # written: the next capture may overwrite them
                self._queue.task_done()

    def _write(self, snap: Snapshot) -> None:
        fence = self.job.fence
        if fence is not None:
            fence.check()  # taken over: nothing more is written, not even data objects
        ckpt = to_checkpoint(snap, self.path)
        if self.config.backend == "torch_save":
            with self._guard:
                self._write_torch_save(ckpt)
            return
        job = self.job
        opts = Options(compression=None if self.config.compression == "none" else self.config.compression, threads=WRITER_THREADS)
        group = self._group(snap) if snap.layout is not None else None
        with self._guard:
            if group is not None:
                # per_rank: every rank writes its shards into the one checkpoint, rank 0 commits it
                opts.world_size, opts.keep_chunks = job.world_size, True
                try:
                    # StoreGroup has the converter's group surface (broadcast, all_gather) over the job's store
                    with _dist.spread(cast(Any, group)):
                        result = native_write.write(ckpt, self.dst, opts, run_id=job.run_id.replace(".", "-"), fence=fence)
                except BaseException as exc:
                    group.abort(f"rank {job.rank}: {exc}")  # the others stop waiting for this rank's part
                    raise
                if job.rank != 0:
                    self.last_index = int(result["index"])
                    self.writes += 1
                    return
            else:
                result = native_write.write(ckpt, self.dst, opts, run_id=job.run_id.replace(".", "-"), fence=fence)
            for w in result.get("warnings", []):
                log.warning("ravex: %s", w)
            self.last_index = int(result["index"])
            self.writes += 1
            if self.config.keep_last is not None and self._may_prune():
                pinned = {self.resume.index} if self.resume.index is not None else set()
                native_write.prune(self.dst, self.config.keep_last, pinned=pinned, fence=fence)
        if self.after_write is not None:
            self.after_write(self.last_index)

    def _group(self, snap: Snapshot) -> StoreGroup:
        """The messages of the ranks' writers for this per_rank checkpoint, named by its step: a rank
        that missed one checkpoint's messages does not shift every later one's."""
        job = self.job
        if job.writers is None or job.prefix is None:
            raise RavexError("a per_rank checkpoint without the writers' store", hint="this is a bug in Ravex")
        return StoreGroup(job.writers, f"{job.prefix}w/{snap.step}/", job.rank, job.world_size)

    def _write_torch_save(self, ckpt: Checkpoint) -> None:
        """One ``ckpt-<index>.pt`` per checkpoint, in the portable torch.save layout (written to a
        temporary name and renamed into place by the torch_save writer); keep_last by file."""
        files = torch_save_files(self.path)
        index = max(files, default=-1) + 1
        torch_save.write(ckpt, self._in_store(f"ckpt-{index:08d}.pt"), Options(threads=WRITER_THREADS))
        self.last_index = index
        self.writes += 1
        if self.config.keep_last is not None and self._may_prune():
            files = torch_save_files(self.path)
            for i in list(files)[:-self.config.keep_last]:
                if i != self.resume.index:
                    storage, key = resolve(self._in_store(files[i].name))
                    storage.delete(key)

    def _in_store(self, name: str) -> Location:
        """``name`` in the store, on the store's backend."""
        return self.dst / name

    def _may_prune(self) -> bool:
        """keep_last is not applied in a run that skipped a checkpoint of its store it could not read or
        restore: the store is kept whole (the skipped ones for inspection, every good one) until a run
        resumes from its newest checkpoint."""
        if not self.resume.unrestorable:
            return True
        if not self._warned_prune:
            self._warned_prune = True
            log.warning("ravex: keep_last is not applied in this run: checkpoint(s) %s of %s could not be read or restored, so nothing is pruned; "
                        "inspect them with `ravex status`", ", ".join(str(i) for i in self.resume.unrestorable), self.path)
        return False
