"""What a run on many ranks needs from torch.distributed, and nothing more.

The decorator serves each rank of a ``torchrun`` job in its own process. The
ranks talk only where they must agree:

- at a checkpoint boundary, one gather over Ravex's own gloo group: each rank's
  random streams and data position go to rank 0, which writes the checkpoint
  (the model's tensors are gathered by torch itself for a sharded model);
- at the first boundary of a resumed run: rank 0 names the checkpoint, every
  rank checks it against its live objects, and they restore it only if all can;
- after a SIGTERM on any rank: through the job's key-value store (torchrun's),
  not a collective, so that no rank blocks on one that is busy in a step: the
  rank that was signalled posts its step; a thread on every rank notices the
  post within a twentieth of a second; once every rank has posted its step, each
  stops at the boundary after the step two past the highest (ranks that train
  together are never more than one step apart, so every rank reaches it);
- at exit, a bounded wait on the same store: the final checkpoint is written
  only when every rank is known to be there.

The group is made at the first iteration boundary that sees an initialized
process group (the script calls ``init_process_group`` inside the decorated
function): every rank passes that boundary, so making it there is safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ravex_convert.storage import Location

__all__ = ["Coord", "Topology", "topology"]

log = logging.getLogger("ravex")

# How often a rank looks for a preemption posted by another one (a background thread).
_WATCH_EVERY_S = 0.05
# How long the ranks wait for each other before the final checkpoint at exit.
EXIT_WAIT_S = 30.0
# After SIGTERM: how long a rank waits for every rank to post its step before it gives up on the
# agreed checkpoint (a rank that never posts is gone; torchrun is tearing the job down).
_PREEMPT_AGREE_S = 120.0
# How long a rank's background writer waits for the others' (they write their shards at the same time).
WRITER_WAIT_S = 1800.0
# The storage probe's token file, left in the store by rank 0 for a moment.
PROBE_PREFIX = ".ravex-probe-"


@dataclass(frozen=True)
class Topology:
    """This process's place in the job: from the process group when one is initialized, else from
    torchrun's environment (known before the script initializes the group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def topology() -> Topology:
    import sys

    dist = sys.modules.get("torch.distributed")
    local = (_env_int("LOCAL_RANK", 0), max(1, _env_int("LOCAL_WORLD_SIZE", 1)))
    if dist is not None and dist.is_available() and dist.is_initialized():
        return Topology(int(dist.get_rank()), int(dist.get_world_size()), *local)
    if "RANK" in os.environ and _env_int("WORLD_SIZE", 1) > 1:
        return Topology(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), *local)
    return Topology()


def initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class Coord:
    """Ravex's own channel between the ranks of one job: a gloo group (CPU, whatever backend the
    training uses) for the messages at checkpoint boundaries, and the job's key-value store for
    preemption and exit, under a prefix fresh for every launch."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist: Any = dist  # (its store classes are not in its exported names)
        self.rank = int(dist.get_rank())
        self.size = int(dist.get_world_size())
        # A group of our own: our messages never interleave with the training's collectives, and
        # gloo carries CPU objects whatever backend the default group has.
        self.group: Any = dist.new_group(backend="gloo")
        self.prefix = f"ravex/{self.broadcast(uuid.uuid4().hex[:12] if self.rank == 0 else None)}/"
        client = self._client()
        # Every rank talks through the same store, or the posts never meet: connections of our own
        # only when every rank has one (else the default group's store, for all).
        self.own_store = all(self.all_gather(client is not None))
        self.store = client if self.own_store else dist.distributed_c10d._get_default_store()
        self.host = socket.gethostname()
        self.remote_preempt = threading.Event()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._exit_round = 0
        self.exit_wait_s = EXIT_WAIT_S
        self._writers: Any = None  # the writers' store connection (False: not every rank has one)

    # ------------------------------------------------------------ collectives (training thread, every rank)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (a list by rank); None on the others."""
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def probe(self, store: str | Path | Location) -> list[bool]:
        """Which ranks see the store rank 0 sees: rank 0 leaves a token object there (through the
        storage layer), each rank looks for it in its own view of ``store``, rank 0 deletes it. By rank."""
        from ravex_convert.formats.native.store import where

        token = f"{PROBE_PREFIX}{self.prefix.split('/')[1]}"
        w = where(store)
        if self.rank == 0:
            try:
                if w.posix:
                    w.path.mkdir(parents=True, exist_ok=True)
                w.storage.put(w.key_of(token), self.host.encode())
            except OSError as exc:  # every rank still takes part in both exchanges below
                log.warning("ravex: storage: cannot write the probe file in %s (%s); taking the store for not shared", w.label, exc)
        self.all_gather(None)  # the token is there before anyone looks
        seen = self.all_gather(w.storage.exists(w.key_of(token)))
        if self.rank == 0:
            with contextlib.suppress(OSError):
                w.storage.delete(w.key_of(token))
        return seen

    # ------------------------------------------------------------ preemption (the store)

    def watch(self) -> None:
        """Start the thread that notices a preemption posted by any rank."""
        if self._watcher is not None:
            return

        own = self._client() if self.own_store else None
        store = own if own is not None else self.store

        def run() -> None:
            # Polls (a blocking wait with a timeout makes the store log each timeout): on a
            # connection of its own when there is one, so the training thread's never waits on it.
            key = [self.prefix + "preempt"]
            while not self._closed.wait(_WATCH_EVERY_S):
                try:
                    if store.check(key):
                        self.remote_preempt.set()
                        return
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                    return

        self._watcher = threading.Thread(target=run, name="ravex-preempt-watch", daemon=True)
        self._watcher.start()

    def _client(self) -> Any:
        """A connection of our own to the job's store (torchrun's, at MASTER_ADDR:MASTER_PORT): one for
        the training thread, one for the watcher, which blocks on it; None where the group was set up
        another way (then the default group's store serves both, and the watcher polls)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port or not port.isdigit():
            return None
        try:
            client = self._dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
            return self._dist.PrefixStore("ravex", client)
        except Exception:  # noqa: BLE001 - the polling watcher does the same, more slowly
            return None

    def post_preempt(self, step: int) -> None:
        """This rank knows of a preemption and is at ``step``: say so to every rank."""
        self.store.set(self.prefix + f"preempt/at/{self.rank}", str(step))
        self.store.set(self.prefix + "preempt", str(self.rank))

    def preempt_stop(self) -> int | None:
        """The step every rank stops after, once every rank has posted its own (else None)."""
        keys = [self.prefix + f"preempt/at/{r}" for r in range(self.size)]
        if not self.store.check(keys):
            return None
        return max(int(v) for v in self.store.multi_get(keys)) + 2

    # ------------------------------------------------------------ exit

    def all_here(self, step: int, timeout_s: float | None = None) -> tuple[bool, list[int]]:
        """A bounded wait for every rank at exit, decided by rank 0 alone (so no rank goes on into
        the final checkpoint while another gave up): every rank posts its step; rank 0 waits up to
        ``timeout_s`` for all of them at the same step and posts its verdict; the others wait for the
        verdict (a while longer: rank 0 may come last). Whether all are here, and who did not come."""
        import json

        self._exit_round += 1
        base = self.prefix + f"exit/{self._exit_round}/"
        wait = self.exit_wait_s if timeout_s is None else timeout_s
        try:
            self.store.set(base + str(self.rank), str(step))
            if self.rank != 0:
                deadline = time.monotonic() + 2 * wait
                while time.monotonic() < deadline:
                    if self.store.check([base + "verdict"]):
                        verdict = json.loads(self.store.get(base + "verdict"))
                        return bool(verdict["go"]), list(verdict["missing"])
                    time.sleep(0.05)
                return False, [0]
            keys = [base + str(r) for r in range(self.size)]
            deadline = time.monotonic() + wait
            go = False
            while time.monotonic() < deadline:
                if self.store.check(keys):
                    go = len({int(v) for v in self.store.multi_get(keys)}) == 1
                    break
                time.sleep(0.05)
            missing = [r for r in range(self.size) if not self.store.check([base + str(r)])]
            self.store.set(base + "verdict", json.dumps({"go": go and not missing, "missing": missing}))
            return go and not missing, missing
        except Exception:  # noqa: BLE001 - the store is gone: the rank hosting it (torchrun's agent, or rank 0) left
            return False, [r for r in range(self.size) if r != self.rank]

    def wait_timeout(self) -> timedelta:
        return timedelta(seconds=_PREEMPT_AGREE_S)

    def writer_store(self) -> Any:
        """A store connection for the background writers of per_rank checkpoints, agreed by every rank
        (a collective: call it where every rank passes); None when some rank has none (per_rank then
        falls back to gather on every rank)."""
        if self._writers is None:
            client = self._client() if self.own_store else None
            self._writers = client if all(self.all_gather(client is not None)) else False
        return self._writers or None

    def close(self) -> None:
        """Stop the watcher (before the process group, and its store, go away) and end Ravex's own
        group while the default one still exists (a gloo group left to the interpreter's teardown
        aborts the process)."""
        self._closed.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
            self._watcher = None
        if self.group is not None and self._dist.is_initialized():
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group(self.group)
        self.group = None


class StoreGroup:
    """The few messages the ranks' background writers exchange for one per_rank checkpoint (rank 0
    names the checkpoint, every rank reports its files, rank 0 commits), over the job's store rather
    than a collective: a writer thread never joins a collective, which would interleave with the
    training's. The same surface as ``ravex_convert._dist.Group``; every rank's writer makes the
    same calls in the same order (one checkpoint after another), so a counter names each message.
    Values are pickled between the processes of this one job."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, timeout_s: float = WRITER_WAIT_S):
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self.timeout = timedelta(seconds=timeout_s)
        self._seq = 0
        self._mine: list[str] = []  # keys this rank set since the all-gather before last
        self._settled = 0  # how many of them every rank has read for sure

    def _next(self) -> str:
        self._seq += 1
        return f"{self.prefix}{self._seq}/"

    def _forget(self) -> None:
        """After an all-gather, every rank has set its key of it, so every rank finished the messages
        before it: this rank's keys up to the previous all-gather are read by all, and deleted."""
        for key in self._mine[:self._settled]:
            with contextlib.suppress(Exception):  # a key left behind costs a few bytes in the store
                self.store.delete_key(key)
        self._mine = self._mine[self._settled:]
        self._settled = len(self._mine)

    def _set(self, key: str, obj: Any) -> None:
        import pickle

        self.store.set(key, pickle.dumps(obj))
        self._mine.append(key)

    def abort(self, why: str) -> None:
        """This rank gives this checkpoint up: every rank waiting on it stops waiting (and fails it)."""
        with contextlib.suppress(Exception):
            self.store.set(self.prefix + "abort", why)

    def _wait(self, keys: list[str]) -> None:
        """Until ``keys`` are all set; raises when a rank gave the checkpoint up, or after the timeout."""
        from ravex_convert.errors import RavexError

        deadline = time.monotonic() + self.timeout.total_seconds()
        abort = [self.prefix + "abort"]
        while not self.store.check(keys):
            if self.store.check(abort):
                raise RavexError(f"another rank gave this checkpoint up: {self.store.get(abort[0]).decode(errors='replace')}")
            if time.monotonic() > deadline:
                raise RavexError(f"the other ranks' writers did not answer in {self.timeout.total_seconds():.0f} s",
                                 hint="a rank is gone or its storage is stuck; the checkpoints before this one are intact")
            time.sleep(0.01)

    def broadcast(self, obj: Any) -> Any:
        import pickle

        key = self._next() + "b"
        if self.rank == 0:
            self._set(key, obj)
            return obj
        self._wait([key])
        return pickle.loads(self.store.get(key))

    def all_gather(self, obj: Any) -> list[Any]:
        import pickle

        base = self._next()
        self._set(base + str(self.rank), obj)
        keys = [base + str(r) for r in range(self.size)]
        self._wait(keys)
        out = [pickle.loads(v) for v in self.store.multi_get(keys)]
        self._forget()
        return out
