"""The lease of the object-store layer: one writer per store, as a fencing token.

A lease is an object whose note (JSON) names its holder: run id, host, pid, the machine's boot
id and the holder's PID namespace, the TTL it renews under, and a generation that grows with
every takeover. The rules, for every object store alike (objdir and s3 are clients):

- taken where absent with ``If-None-Match: *`` (generation 1), renewed every TTL/4 with
  ``If-Match`` on the ETag last put, released with a delete conditional on that ETag;
- a held lease is judged by the holder's TTL (recorded in its note) and the server's clock (the
  object's Last-Modified against the server's time now), never by the taker's settings or clock;
- a holder on this machine whose process is gone (same boot id AND same PID namespace: a
  hostname proves nothing, containers share one and ``unshare -u`` changes it) is taken over at
  once; otherwise a lease that is renewed is refused at once (seen renewed within one renewal
  interval), and one that is not is waited out, said once, then taken over with ``If-Match`` on
  the ETag seen (generation + 1; of several takers one wins);
- a renewal answered with a lost condition means another run took over: the lease is lost for
  good, said once at ERROR with the taker's run and host, and :meth:`Lease.check` raises from
  then on. What the lease protects (the native manifest) records the generation of its last
  writer and is replaced only conditionally, so a holder paused past its TTL cannot write after
  a takeover even before its renewal thread notices (formats/native/store.py: ``claim``).

A client without a TTL (objdir, a local directory) never renews: its leases are freed by the
holder's death on this machine only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import RavexError
from .base import ABSENT, PreconditionFailed, Stat, holder_text, lease_note, machine
from .s3conf import MAX_LEASE_TTL_S

__all__ = ["TAKEN_HINT", "Lease", "StoreTakenOverError", "hold"]

log = logging.getLogger("ravex")


class LeaseStore(Protocol):
    """What a lease needs of the object-store layer (``objstore.ObjectStore``, which holds its leases)."""

    client: Any  # objstore.Client: url, clock, lease_ttl, delete_if, watch, unwatch

    def stat(self, key: str) -> Stat | None: ...

    def get(self, key: str) -> tuple[bytes, Any]: ...

    def put(self, key: str, data: bytes, *, if_generation: Any = None, staging: str | None = None) -> Any: ...

    def delete(self, key: str) -> None: ...

# Last-Modified has a resolution of one second (HTTP dates), and a request takes a moment: a
# renewal is expected within TTL/4 + this, and a lease lapses at TTL + this.
_SLACK_S = 2.0
_said: set[str] = set()  # stores whose takeover was said at ERROR in this process
# store -> who wrote what its leases protect last (store.claim sets it): named where a lease object
# no longer says who took it over (the taker finished and released it)
_witnesses: dict[str, Callable[[], str | None]] = {}


class StoreTakenOverError(RavexError):
    """This run's lease was taken over by another run: it commits nothing more to the store."""


@dataclass(frozen=True)
class Holder:
    """A lease's note, read back."""

    raw: bytes
    run_id: str | None = None
    host: str | None = None
    pid: int | None = None
    boot_id: str | None = None
    pid_ns: int | None = None
    ttl: float | None = None
    generation: int = 0

    @classmethod
    def of(cls, raw: bytes) -> Holder:
        try:
            note = json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            return cls(raw)
        if not isinstance(note, dict):
            return cls(raw)

        def typed(name: str, kind: type | tuple[type, ...]) -> Any:
            v = note.get(name)
            return v if isinstance(v, kind) and not isinstance(v, bool) else None

        ttl = typed("ttl_s", (int, float))
        return cls(raw, typed("run_id", str), typed("host", str), typed("pid", int), typed("boot_id", str), typed("pid_ns", int),
                   float(ttl) if ttl is not None and ttl > 0 else None, typed("generation", int) or 0)

    def who(self) -> str:
        return f"run {self.run_id or '?'} on host {self.host or '?'}"

    def gone_here(self) -> bool:
        """Its process certainly no longer runs: it ran on this boot of this machine, in this PID
        namespace (so its pid means the same process here), and that pid is free."""
        here = machine()
        if self.boot_id is None or self.pid_ns is None or self.boot_id != here["boot_id"] or self.pid_ns != here["pid_ns"]:
            return False
        if self.pid is None or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


class Lease:
    """A lease held by this process: its fencing ``generation``, and whether it was lost."""

    def __init__(self, store: LeaseStore, key: str, holder: str, etag: Any, generation: int, ttl: float | None, taken_over: bool,
                 since: float, *, holder_may_run: bool = False):
        self.store, self.key, self.holder = store, key, holder
        self.url = store.client.url(key)
        self.etag, self.generation, self.ttl, self.taken_over, self.since = etag, generation, ttl, taken_over, since
        # taken over from a holder that lapsed but may still run (frozen, cut off): a write of its
        # may be in flight (store.claim keeps clear of it); False for one certainly gone
        self.holder_may_run = holder_may_run
        self.store_url = self.url.rsplit("/", 1)[0]
        self.lost: str | None = None  # why this run no longer holds it (never cleared)
        self.host = socket.gethostname()
        self._lock = threading.Lock()  # one put of the lease at a time: our own puts must not race each other

    def note(self, generation: int) -> bytes:
        return _note(self.holder, generation, self.ttl, self.since)

    def record(self) -> dict[str, Any]:
        """What a write this lease fences records of its writer (the native manifest's ``lease``)."""
        return {"generation": self.generation, "run_id": self.holder, "host": self.host}

    def name_taker_by(self, witness: Callable[[], str | None]) -> None:
        """``witness()`` names who wrote this lease's store last (``run R on host H``), or None: asked
        when a lease of the store is found replaced and gone (the taker finished and released it)."""
        _witnesses[self.store_url] = witness

    def check(self) -> None:
        """Raise :class:`StoreTakenOverError` once the lease is lost."""
        if self.lost is not None:
            raise StoreTakenOverError(self.lost, hint=TAKEN_HINT)

    def lose(self, taker: str, how: str) -> None:
        """Another run took the lease over (``taker``: its run and host; ``how``: how this run
        learnt it): said once at ERROR, and :meth:`check` raises from now on."""
        with self._lock:
            if self.lost is None:
                self.lost = (f"{self.url}: this run ({self.holder} on host {self.host}, lease generation {self.generation}) no longer holds "
                             f"the store: {taker} took it over ({how}); this run commits nothing more there")
            msg = self.lost
        # once per store: the run's lease and the writer's per-write one learn it alike
        if self.store_url not in _said:
            _said.add(self.store_url)
            log.error("ravex: %s", msg)

    def fenced_by(self, record: Any) -> bool:
        """Whether ``record`` (what a fenced write recorded of its writer) is of a newer generation
        than this lease's; if so the lease is lost, and said."""
        if not isinstance(record, dict):
            return False
        g = record.get("generation")
        if not isinstance(g, int) or isinstance(g, bool) or g <= self.generation:
            return False
        self.lose(f"run {record.get('run_id', '?')} on host {record.get('host', '?')}",
                  f"the store's manifest was written under generation {g}, newer than this run's {self.generation}")
        return True

    def advance(self, generation: int) -> None:
        """Hold the lease under ``generation`` from now on (a put conditional on its ETag): a run
        that finds the store written under a generation as new as its own (the lease was deleted
        and created again since) moves past it. Lost to another run: raises."""
        with self._lock:
            try:
                self.etag = self.store.put(self.key, self.note(generation), if_generation=self.etag)
                self.generation = generation
                return
            except PreconditionFailed:
                pass
        self._lost_to_reader("its lease was replaced when this run moved it to a new generation")
        self.check()

    def renew(self) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.etag = self.store.put(self.key, self.note(self.generation), if_generation=self.etag)

    def _lost_to_reader(self, how: str) -> None:
        taker: str | None = None
        try:
            taker = Holder.of(self.store.get(self.key)[0]).who()
        except (FileNotFoundError, RavexError, OSError):
            witness = _witnesses.get(self.store_url)
            with contextlib.suppress(Exception):
                taker = witness() if witness is not None else None
        self.lose(taker or "another run (its lease is gone now)", how)


TAKEN_HINT = ("another machine runs this job from the store now and resumes from its newest checkpoint; this run's steps since then "
               "are not saved: stop it. To run both, give each its own storage.path (RAVEX_STORAGE_PATH)")


def _note(holder: str, generation: int, ttl: float | None, since: float) -> bytes:
    """A lease's note (:func:`~.base.lease_note`): the holder's TTL and generation; the times are the
    holder's clock, for people (a taker judges by the server's)."""
    note = json.loads(lease_note(holder))
    note.update({"ttl_s": ttl, "generation": generation, "since_unix": since, "renewed_unix": time.time()})
    return json.dumps(note).encode()


@contextlib.contextmanager
def hold(store: LeaseStore, key: str, holder: str) -> Iterator[Lease]:
    """Hold the lease at ``key`` for the block (see the module's rules). Refused (a live holder,
    or one with no TTL that is not certainly gone): :class:`PreconditionFailed` naming it."""
    client = store.client
    ttl = client.lease_ttl
    lease = _take(store, key, holder, ttl)
    stop = threading.Event()
    owner = os.getpid()
    renewer = None
    if ttl:
        renewer = threading.Thread(target=_renew, args=(lease, stop), name="ravex-lease", daemon=True)
        renewer.start()
    client.watch()
    try:
        yield lease
    finally:
        client.unwatch(None)
        stop.set()
        if renewer is not None:
            renewer.join(timeout=5)
        # A forked child (a DataLoader worker) finalizing its copy of the holder's state never
        # releases: the lease is the parent's, who still holds it. A lost lease is not ours to delete.
        if os.getpid() == owner and lease.lost is None:
            with contextlib.suppress(Exception):
                client.delete_if(key, lease.etag)


def _renew(lease: Lease, stop: threading.Event) -> None:
    """Put the lease again every TTL/4 until ``stop``. A lost condition: another run took it over
    (said, and the lease is lost). Any other failure is said (not swallowed) and retried; once
    renewals have failed for the TTL another run may have taken the store over, which the
    fenced manifest settles."""
    assert lease.ttl is not None
    every = lease.ttl / 4
    ok = time.monotonic()
    failing: str | None = None
    while not stop.wait(every):
        try:
            lease.renew()
        except PreconditionFailed:
            lease._lost_to_reader("this run's renewal of its lease found it replaced")
            return
        except Exception as exc:  # noqa: BLE001 - said, then retried: a network blip must not end a lease
            if failing is None:
                log.warning("ravex: renewing the lease %s failed: %s; retrying every %.1f s", lease.url, exc, every)
            elif time.monotonic() - ok > lease.ttl and failing != "lapsed":
                log.error("ravex: the lease %s has not been renewed for %.0f s (its TTL): another run may take the store over, and then "
                          "this run's next commit is refused; last failure: %s", lease.url, lease.ttl, exc)
                failing = "lapsed"
                continue
            failing = failing or "failing"
            continue
        if failing is not None:
            log.warning("ravex: the lease %s is renewed again", lease.url)
        failing, ok = None, time.monotonic()


def _take(store: LeaseStore, key: str, holder: str, ttl: float | None) -> Lease:
    """Take the lease: create it, or take over a holder that is gone (waiting for its TTL to lapse
    by the server's clock where it is not seen renewed). Refused: :class:`PreconditionFailed`."""
    client = store.client
    since = time.time()
    said = [False]  # the wait was said (once)
    while True:
        try:
            etag = store.put(key, _note(holder, 1, ttl, since), if_generation=ABSENT)
            return Lease(store, key, holder, etag, 1, ttl, False, since)
        except PreconditionFailed:
            pass
        st = store.stat(key)
        if st is None:
            continue  # released in between
        try:
            raw, etag = store.get(key)
        except FileNotFoundError:
            continue
        if etag != st.generation:
            continue  # renewed in between: look again
        held = Holder.of(raw)
        dead = held.gone_here()
        if not dead:
            if ttl is None or st.modified is None:
                # no TTL here (a local directory): only the holder's death on this machine frees a lease
                raise PreconditionFailed(holder_text(raw))
            if not _wait_out(store, key, held, etag, st.modified, ttl, said):
                continue  # changed while watched, but not by a renewal (released): look again
        generation = held.generation + 1
        try:
            new = store.put(key, _note(holder, generation, ttl, since), if_generation=etag)
        except PreconditionFailed:  # another taker won, or the holder renewed at the last instant
            try:
                now = store.get(key)[0]
            except FileNotFoundError:
                continue
            raise PreconditionFailed(holder_text(now) + ", which took it over first") from None
        if said[0]:
            log.warning("ravex: took over the lease %s from %s (generation %d)", client.url(key), held.who(), generation)
        return Lease(store, key, holder, new, generation, ttl, True, since, holder_may_run=not dead)


def _wait_out(store: LeaseStore, key: str, held: Holder, etag: Any, modified: float, own_ttl: float, said: list[bool]) -> bool:
    """Wait until the lease at ``key`` (at ``etag``, last written at ``modified`` by the server's
    clock) lapses by its holder's TTL; True then. A lease seen renewed raises
    :class:`PreconditionFailed` (a live holder). False: it changed otherwise (released): look again."""
    client = store.client
    ttl = held.ttl or own_ttl  # a note of an older Ravex records none: the taker's is all there is
    if ttl > MAX_LEASE_TTL_S:  # a note is read from the bucket: a TTL of a year is not waited out
        raise PreconditionFailed(holder_text(held.raw) + f" (its note gives a TTL of {ttl:.0f} s, over the {MAX_LEASE_TTL_S:.0f} s "
                                 "Ravex waits out: delete the lease object if that run is gone)")
    every = ttl / 4
    start, server = time.monotonic(), float(client.clock(key))

    def age() -> float:
        return server - modified + (time.monotonic() - start)

    def changed() -> bool | None:
        st = store.stat(key)
        if st is None:
            return None
        return bool(st.generation != etag)

    # A renewing holder puts its lease every TTL/4: one not put for longer is not being renewed.
    left = ttl + _SLACK_S - age()
    if left > 0 and not said[0]:
        said[0] = True
        last = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(modified))
        log.warning("ravex: the lease %s is held by %s (pid %s), last renewed at %s by the store's clock (%.0f s ago); its TTL is %.0f s: "
                    "waiting up to %.0f s for it to lapse, then taking it over (refused as soon as it is seen renewed: a live run)",
                    client.url(key), held.who(), held.pid if held.pid is not None else "?", last, age(), ttl, left)
    due = every + _SLACK_S - age()
    if due > 0:
        time.sleep(due)
        seen = changed()
        if seen is None:
            return False
        if seen:
            raise PreconditionFailed(holder_text(held.raw) + f" (renewing its lease every {every:.1f} s: a live run)")
    left = ttl + _SLACK_S - age()
    while left > 0:
        time.sleep(min(left, max(0.5, min(every / 2, 5.0))))
        seen = changed()
        if seen is None:
            return False
        if seen:
            raise PreconditionFailed(holder_text(held.raw) + " (it renewed its lease while this run waited: a live run)")
        left = ttl + _SLACK_S - age()
    return True


def probe_clock(store: LeaseStore, key: str) -> float:
    """The server's time now: the Last-Modified of a small object put beside ``key`` and deleted."""
    probe = f"{key}.tmp-clock-{uuid.uuid4().hex[:12]}"
    store.put(probe, b"")
    try:
        st = store.stat(probe)
    finally:
        with contextlib.suppress(Exception):
            store.delete(probe)
    if st is None or st.modified is None:
        raise RavexError(f"{store.client.url(probe)}: the server gave no Last-Modified for an object just put",
                         hint="Ravex judges a lease's age by the server's clock; use an S3 server that reports Last-Modified")
    return st.modified
