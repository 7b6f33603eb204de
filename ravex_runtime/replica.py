"""``replicate_every``: copies of a store on another machine, over the job's own process group.

For a job on several machines without shared storage (each rank's ``storage.path`` on its own
disk). Every N-th checkpoint the store's writer commits, the store's rank sends the checkpoint's
files to a rank on another machine, which adds it to the replica area on its own disk
(replica_area.py: the store's own commit protocol, checked by its checksums, pruned with
``keep_last``). At the start of a resumed run the ranks agree, in one all-gather, on the newest
checkpoint that survived (a rank's own store, or a replica any rank holds); a rank whose store
lacks it receives it from the holder and commits it into its own store before the restore, which
then goes on as usual.

How the bytes move: point-to-point ``send``/``recv`` of uint8 tensors on a gloo group of Ravex's
own (made once, when the ranks join; on CPU whatever backend the training uses), from a thread of
their own on each end, so the training thread never waits for a copy and the training's
collectives never interleave with it. Messages between the two ends are JSON; files go in pieces
of ``PIECE`` bytes. No transport or port of Ravex's own.

Machines are told apart as the launcher tells them: torchrun's node rank (``GROUP_RANK``), else
the hostname. Rank ``r``'s copies go to the next rank after it (in rank order, cyclically) on
another machine. Only rank 0 has a store under ``gather`` (and for an unsharded model): its
checkpoints are the ones copied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import RavexError

from .dist import Coord
from .replica_area import Ingest, checkpoint_files, held_here, newest, record_copy, replica_of

__all__ = ["PIECE", "Replicator", "start"]

log = logging.getLogger("ravex")

PIECE = 16 << 20  # bytes per send of a file's bytes
# The copies' group waits this long for a message: a holder waits for the next checkpoint for as long
# as training takes to make it (a peer that is gone ends the wait at once: its connection closes).
_GROUP_TIMEOUT = timedelta(days=7)
# At exit, how long a holder waits for the last copy and the sender's goodbye.
CLOSE_WAIT_S = 300.0


def machine_id() -> str:
    """This process's machine, as the launcher tells them apart: torchrun's node rank, else the hostname."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group not in (None, "") else f"host {socket.gethostname()}"


class _Wire:
    """Messages and files between this rank and ``peer`` on the copies' group; ``tag`` keeps each
    store's stream apart (the rank whose store it is)."""

    def __init__(self, group: Any, peer: int, tag: int) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.peer, self.tag = dist, group, peer, tag
        self.sent = 0  # file bytes sent

    def _send(self, t: torch.Tensor) -> None:
        self.dist.send(t, dst=self.peer, group=self.group, tag=self.tag)

    def _recv(self, t: torch.Tensor) -> None:
        self.dist.recv(t, src=self.peer, group=self.group, tag=self.tag)

    def send_obj(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self._send(torch.tensor([len(data)], dtype=torch.int64))
        self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_obj(self) -> Any:
        n = torch.zeros(1, dtype=torch.int64)
        self._recv(n)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self._recv(buf)
        return json.loads(buf.numpy().tobytes())

    def send_file(self, fd: int, size: int) -> None:
        buf = torch.empty(min(PIECE, max(size, 1)), dtype=torch.uint8)
        view = buf.numpy().data
        off = 0
        while off < size:
            k = min(PIECE, size - off)
            got = 0
            while got < k:
                n = os.preadv(fd, [view[got:k]], off + got)
                if n <= 0:
                    raise RavexError(f"a file being copied ended at byte {off + got} of {size}", hint="the store changed under the copy")
                got += n
            self._send(buf[:k])
            off += k
            self.sent += k

    def recv_file(self, out: Any, size: int) -> None:
        buf = torch.empty(min(PIECE, max(size, 1)), dtype=torch.uint8)
        off = 0
        while off < size:
            k = min(PIECE, size - off)
            self._recv(buf[:k])
            out.write(buf.numpy().data[:k])
            off += k


class _Outgoing:
    """A checkpoint to copy: its manifest entry and its files, opened (a prune that removes them
    while the copy runs does not take their bytes away)."""

    def __init__(self, store: Path, entry: dict[str, Any]) -> None:
        self.entry = entry
        self.files: list[tuple[str, int, int]] = []  # (relative path, size, fd)
        try:
            for rel in checkpoint_files(store, entry):
                fd = os.open(store / rel, os.O_RDONLY | os.O_CLOEXEC)
                self.files.append((rel, os.fstat(fd).st_size, fd))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for _, _, fd in self.files:
            os.close(fd)
        self.files = []


def _send(wire: _Wire, out: _Outgoing, run_id: str) -> dict[str, Any] | None:
    """One checkpoint to the holder at the other end: what it lacks, then its commit's answer."""
    wire.send_obj({"kind": "checkpoint", "entry": out.entry, "files": [[rel, size] for rel, size, _ in out.files], "run_id": run_id})
    reply = wire.recv_obj()
    if reply.get("error"):
        raise RavexError(f"the holder cannot take checkpoint {out.entry.get('index')}: {reply['error']}")
    need = set(reply["need"])
    for rel, size, fd in out.files:
        if rel in need:
            wire.send_file(fd, size)
    ack: dict[str, Any] = wire.recv_obj()
    if not ack.get("ok"):
        raise RavexError(f"the copy of checkpoint {out.entry.get('index')} was not committed: {ack.get('error')}")
    return ack


def _receive(wire: _Wire, msg: dict[str, Any], store: Path, run_id: str, keep_last: int | None, *, replace: bool) -> dict[str, Any]:
    """The holder's end of :func:`_send`, after its first message ``msg``: the checkpoint added to ``store``."""
    from ravex_convert.formats.native import writer as native_write

    entry, files = msg["entry"], [(str(r), int(s)) for r, s in msg["files"]]
    try:
        ingest = Ingest(store, entry, run_id, replace=replace)
    except Exception as exc:  # told to the sender, which gives this copy up
        why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
        wire.send_obj({"error": why})
        raise RavexError(why) from exc
    with ingest:
        need = ingest.need(files)
        wire.send_obj({"need": need})
        sizes = dict(files)
        for rel in need:
            with ingest.open(rel) as f:
                wire.recv_file(f, sizes[rel])
        try:
            ingest.commit()
        except Exception as exc:  # told to the sender
            why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
            wire.send_obj({"ok": False, "error": why})
            raise RavexError(why) from exc
    if keep_last is not None:
        native_write.prune(store, keep_last)
    ack = {"ok": True, "path": str(store), "host": socket.gethostname(), "committed_unix": time.time()}
    wire.send_obj(ack)
    return ack


class Replicator:
    """Copies of this job's stores on other machines (see the module's docstring), on this rank.

    Made by :func:`start` when the ranks join (a collective); :meth:`after_write` is the writer's
    hook after each checkpoint it commits; :meth:`fetch` runs before the first restore (a
    collective); :meth:`close` before the job's process group goes (every rank)."""

    def __init__(self, coord: Coord, every: int, keep_last: int | None, store: Path, run_id: str, machines: list[str],
                 hosts: list[str], areas: list[str], group: Any) -> None:
        self.coord, self.every, self.keep_last, self.store, self.run_id = coord, every, keep_last, store, run_id
        self.rank, self.size = coord.rank, coord.size
        self.machines, self.hosts, self.areas, self.group = machines, hosts, areas, group
        self.holder = {r: self._holder_of(r) for r in range(self.size)}
        self.sources = [0]  # the ranks with a store: rank 0 writes every checkpoint (gather, or an unsharded model)
        self.error: str | None = None  # why copying stopped on this rank
        self.copies: list[dict[str, Any]] = []  # this rank's copies committed by their holder: index, bytes_sent, seconds
        self._lock = threading.Condition()
        self._pending: _Outgoing | None = None
        self._closing = False
        self._threads: list[threading.Thread] = []
        if self.rank in self.sources:
            self._threads.append(threading.Thread(target=self._send_loop, name="ravex-replica-send", daemon=True))
        for s in self.sources:
            if self.holder[s] == self.rank:
                self._threads.append(threading.Thread(target=self._receive_loop, args=(s,), name=f"ravex-replica-recv{s}", daemon=True))

    def _holder_of(self, r: int) -> int:
        for k in range(1, self.size):
            q = (r + k) % self.size
            if self.machines[q] != self.machines[r]:
                return q
        raise RavexError("replicate_every: one machine", hint="this is a bug in Ravex")

    def describe(self) -> str:
        return "; ".join(f"rank {s}'s store -> rank {self.holder[s]} ({self.machines[self.holder[s]]}, {self.hosts[self.holder[s]]}), "
                         f"{Path(self.areas[self.holder[s]]) / f'rank{s:05d}'}" for s in self.sources)

    def begin(self) -> None:
        """Start the copying threads, once (after :meth:`fetch`: the resume's transfers use the same group)."""
        for t in self._threads:
            if t.ident is None and not self._closing:
                t.start()

    # ------------------------------------------------------------ at the start: the newest checkpoint anywhere

    def fetch(self) -> bool:
        """Every rank: agree on the newest checkpoint of each store that survived (its own, or a
        replica any rank holds); a store that lacks it receives it from the holder. True on a rank
        whose own store received one (its resume must look again)."""
        mine = {"own": (newest(self.store) or {}).get("index") if self.rank in self.sources else None,
                "held": {str(s): (newest(p) or {}).get("index") for s, p in held_here(self.store).items()}}
        everyone = self.coord.all_gather(mine)
        got = False
        for s in self.sources:
            own = everyone[s]["own"]
            offers = [(int(m["held"][str(s)]), -q) for q, m in enumerate(everyone) if q != s and m["held"].get(str(s)) is not None]
            if not offers:
                continue
            best, q = max(offers)
            q = -q
            if own is not None and best <= int(own):
                continue
            if self.rank == 0:
                log.warning("ravex: replicate_every: rank %d's store %s checkpoint %d; rank %d (%s) holds a replica of it: rank %d receives it",
                            s, "holds no checkpoint newer than" if own is not None else "lacks", best, q, self.machines[q], s)
            if self.rank == q:
                try:
                    out = _Outgoing(replica_of(self.store, s), self._entry(replica_of(self.store, s), best))
                except Exception as exc:  # noqa: BLE001 - the other end waits for a message: tell it
                    _Wire(self.group, s, s).send_obj({"kind": "none", "error": str(exc)})
                    log.error("ravex: replicate_every: the replica of rank %d's checkpoint %d cannot be read: %s", s, best, exc)
                    continue
                try:
                    _send(_Wire(self.group, s, s), out, self.run_id)
                except Exception as exc:  # noqa: BLE001 - the resume goes on with what rank s has
                    log.error("ravex: replicate_every: sending the replica of checkpoint %d to rank %d failed: %s", best, s, exc)
                finally:
                    out.close()
            elif self.rank == s:
                wire = _Wire(self.group, q, s)
                msg = wire.recv_obj()
                if msg.get("kind") != "checkpoint":
                    log.error("ravex: replicate_every: rank %d could not send checkpoint %d: %s", q, best, msg.get("error"))
                    continue
                try:
                    _receive(wire, msg, self.store, self.run_id, None, replace=False)
                    got = True
                    log.warning("ravex: replicate_every: checkpoint %d (step %s) received from rank %d and committed to %s", best,
                                msg["entry"].get("step"), q, self.store)
                except Exception as exc:  # noqa: BLE001 - the resume goes on with what this store has
                    log.error("ravex: replicate_every: checkpoint %d from rank %d could not be added to %s: %s", best, q, self.store, exc)
        return got

    @staticmethod
    def _entry(store: Path, index: int) -> dict[str, Any]:
        from ravex_convert.formats.native.reader import read_manifest

        for e in read_manifest(store)["checkpoints"]:
            if isinstance(e, dict) and e.get("index") == index and e.get("status") == "complete":
                return dict(e)
        raise RavexError(f"{store}: no complete checkpoint {index}", hint="it was pruned meanwhile")

    # ------------------------------------------------------------ sending (the store's rank)

    def after_write(self, index: int) -> None:
        """The writer committed checkpoint ``index`` (writer thread): every N-th one is handed to the
        sending thread, its files opened now, before the next write's prune could remove them. A copy
        waiting to start is replaced by the newer one."""
        if self.error is not None or self._closing or (index + 1) % self.every:
            return
        try:
            out = _Outgoing(self.store, self._entry(self.store, index))
        except Exception as exc:  # noqa: BLE001 - no copy this time; training goes on
            log.error("ravex: replicate_every: checkpoint %d of %s cannot be read for its copy: %s", index, self.store, exc)
            return
        with self._lock:
            if self._pending is not None:
                self._pending.close()
            self._pending = out
            self._lock.notify_all()

    def _send_loop(self) -> None:
        from .writer import _background_priority

        _background_priority()
        holder = self.holder[self.rank]
        wire = _Wire(self.group, holder, self.rank)
        while True:
            with self._lock:
                while self._pending is None and not self._closing:
                    self._lock.wait()
                out, self._pending = self._pending, None
            if out is None:
                break
            t0, sent0 = time.monotonic(), wire.sent
            try:
                ack = _send(wire, out, self.run_id)
            except RavexError as exc:  # the holder refused this one (and said so): the next one may do
                log.error("ravex: replicate_every: checkpoint %s was not copied to rank %d: %s", out.entry.get("index"), holder, exc.message)
                ack = None
            except Exception as exc:  # noqa: BLE001 - the holder is gone: no more copies
                self.error = str(exc)
                log.error("ravex: replicate_every: copying checkpoint %s to rank %d failed (%s); no more copies in this run",
                          out.entry.get("index"), holder, exc)
            finally:
                out.close()
            if self.error is not None:
                return
            if ack is None:
                continue
            copy = {"holder_rank": holder, "holder_host": ack.get("host"), "path": ack.get("path"), "index": out.entry.get("index"),
                    "step": out.entry.get("step"), "committed_unix": ack.get("committed_unix"), "bytes_sent": wire.sent - sent0,
                    "seconds": round(time.monotonic() - t0, 4)}
            self.copies.append(copy)
            record_copy(self.store, copy)
            log.info("ravex: replicate_every: checkpoint %s copied to rank %d (%d bytes, %.2f s)", copy["index"], holder, copy["bytes_sent"],
                     copy["seconds"])
        with contextlib.suppress(Exception):  # the holder is gone
            wire.send_obj({"kind": "bye"})

    # ------------------------------------------------------------ holding (another machine's rank)

    def _receive_loop(self, source: int) -> None:
        from .writer import _background_priority

        _background_priority()
        wire = _Wire(self.group, source, source)
        store = replica_of(self.store, source)
        while True:
            try:
                msg = wire.recv_obj()
            except Exception:  # noqa: BLE001 - the sender is gone (its machine, or the job)
                return
            if msg.get("kind") != "checkpoint":
                return
            try:
                _receive(wire, msg, store, self.run_id, self.keep_last, replace=True)
            except RavexError as exc:  # that copy is refused, and the sender told: the next one may do
                log.error("ravex: replicate_every: the copy of rank %d's checkpoint %s failed: %s", source, msg["entry"].get("index"), exc.message)
            except Exception as exc:  # noqa: BLE001 - the two ends no longer agree on what comes next: stop
                log.error("ravex: replicate_every: the copy of rank %d's checkpoint %s failed (%s); this rank holds no more copies",
                          source, msg["entry"].get("index"), exc)
                return

    # ------------------------------------------------------------ the end

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Every rank, before the job's process group goes: the copy in flight finishes, the sender says
        goodbye, the holders stop; then the group is ended (left alone if a thread is still in it)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        deadline = time.monotonic() + timeout_s
        stuck = False
        for t in self._threads:
            if t.is_alive() or t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
            stuck = stuck or t.is_alive()
        self._threads = []
        if stuck:
            log.error("ravex: replicate_every: a copy did not finish within %.0f s at exit; its replica is the one before", timeout_s)
            return
        import torch.distributed as dist

        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # the job is ending
                dist.destroy_process_group(self.group)
        self.group = None


def start(coord: Coord, every: int | None, keep_last: int | None, store: Path, run_id: str, shared: bool) -> Replicator | None:
    """When the ranks join (every rank: collectives): the copies' group and the pairs, or None (not
    asked for, one machine, or a store every rank sees), said once by rank 0."""
    if every is None:
        return None
    import torch.distributed as dist

    seen = coord.all_gather((machine_id(), socket.gethostname(), str(store.with_name(store.name + ".replicas"))))
    machines, hosts, areas = [m for m, _, _ in seen], [h for _, h, _ in seen], [a for _, _, a in seen]
    if len(set(machines)) == 1:
        if coord.rank == 0:
            log.warning("ravex: replicate_every: every rank of the job is on one machine (%s): a copy there survives nothing its store does "
                        "not, so nothing is copied", machines[0])
        return None
    if shared:
        if coord.rank == 0:
            log.warning("ravex: replicate_every: every rank sees the store (shared storage): nothing is copied")
        return None
    group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
    rep = Replicator(coord, every, keep_last, store, run_id.replace(".", "-"), machines, hosts, areas, group)
    if coord.rank == 0:
        log.warning("ravex: replicate_every %d: every %s checkpoint is copied to another machine: %s", every,
                    "" if every == 1 else _nth(every), rep.describe())
    return rep


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
