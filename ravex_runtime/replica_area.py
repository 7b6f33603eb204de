"""The replica area on a machine's own disk: copies of other machines' stores (``replicate_every``).

Beside a store ``<dir>/<name>`` its machine keeps ``<dir>/<name>.replicas/``:

- ``rank<r>/`` (5 digits): a replica of the store rank ``r`` writes on another machine, an
  ordinary native store (docs/format.md) whose checkpoints keep the indices, files and
  manifest entries of the originals, byte for byte;
- ``copies.json``: where the copies of *this* machine's store went (written by the rank that
  sends them): for each holder, the checkpoint copied last, when its replica committed, how
  many bytes went and how long it took (and the last 50 copies, for measuring). ``ravex status``
  shows both.

A checkpoint is added to a store here (a replica, or the store of a rank that lost its own at a
resume) with the store's own protocol (docs/format.md section 3): data into
``checkpoints/<i>.tmp-<run_id>/``, the directory renamed, then the manifest, under the store's lock,
so nothing half-copied ever looks complete. Before the manifest lists it the copy is checked as a
reader checks it: the metadata checksum the original's manifest entry records, every file present
and long enough, and every chunk's xxh3-64 checksum. Nothing here imports torch (``ravex status``
reads the area).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Self

from ravex_convert._output import fsync_dir, fsync_fd
from ravex_convert.errors import RavexError

__all__ = ["AREA_SUFFIX", "COPIES", "Ingest", "adopt", "area_of", "checkpoint_files", "held_here", "newest", "read_copies",
           "record_copy", "replica_of"]

AREA_SUFFIX = ".replicas"
COPIES = "copies.json"
_HISTORY = 50  # copies.json keeps the last copies this many (bytes and seconds of each: what the cost is measured from)


def area_of(store: Path) -> Path:
    """The replica area beside ``store`` on this machine's disk."""
    return store.with_name(store.name + AREA_SUFFIX)


def replica_of(store: Path, rank: int) -> Path:
    """Where this machine keeps the replica of rank ``rank``'s store (``store``: this machine's storage.path)."""
    return area_of(store) / f"rank{rank:05d}"


def held_here(store: Path) -> dict[int, Path]:
    """The replicas this machine holds, by the rank whose store each protects."""
    area = area_of(store)
    out: dict[int, Path] = {}
    if area.is_dir() and not area.is_symlink():
        for p in sorted(area.iterdir()):
            if p.name.startswith("rank") and p.name[4:].isdigit() and p.is_dir() and not p.is_symlink():
                out[int(p.name[4:])] = p
    return out


def newest(store: Path) -> dict[str, Any] | None:
    """The manifest entry of the newest complete checkpoint of ``store`` (None: none, or no store).
    Reads the manifest only: a resume checks the checkpoint itself."""
    from ravex_convert.formats.native.reader import STORE_MARKER, read_manifest

    if not (store / STORE_MARKER).is_file():
        return None
    try:
        entries = [e for e in read_manifest(store)["checkpoints"] if isinstance(e, dict) and e.get("status") == "complete"]
    except RavexError:
        return None
    return dict(entries[-1]) if entries else None


def checkpoint_files(store: Path, entry: dict[str, Any]) -> list[str]:
    """Every file checkpoint ``entry`` of ``store`` needs, relative to the store: its checkpoint.json
    (first) and each data file its chunks name (some may lie in an earlier checkpoint's directory)."""
    from ravex_convert.formats.native.reader import CHECKPOINT

    rel_dir = str(entry["dir"])
    doc = json.loads((store / rel_dir / CHECKPOINT).read_bytes())
    files = {str(c["file"]) for t in doc.get("tensors", {}).values() for c in t.get("chunks", []) if c.get("file")}
    return [f"{rel_dir}/{CHECKPOINT}", *sorted(files)]


class Ingest:
    """One checkpoint added to a store under its index (docs/format.md section 3), as a copy of
    another store's: :meth:`need` says which of its files the store lacks, :meth:`open` writes each
    one, :meth:`commit` checks the copy and lists it. Holds the store's lock from construction to
    :meth:`close` (a ``with`` block).

    Raises :class:`RavexError` when the store already used the index (its checkpoints are of another
    lineage: ``replace`` empties it first, for a replica, which is only a copy)."""

    def __init__(self, store: Path, entry: dict[str, Any], run_id: str, *, replace: bool = False) -> None:
        from ravex_convert.formats.native.store import create, locked, open_store, prepare, remove_store, where

        self.store, self.entry, self.run_id = store, dict(entry), run_id
        self.index = int(entry["index"])
        self.rel_dir = f"checkpoints/{self.index:08d}"
        self._stack = contextlib.ExitStack()
        w = self._w = where(store)
        for attempt in (0, 1):
            prepare(w)
            self._stack.enter_context(locked(w, run_id))
            if not (store / "ravex-store.json").is_file():
                create(w, run_id)
            self.manifest, self.generation, _, highest, _ = open_store(w)
            first = max(int(self.manifest["next_index"]), highest + 1)
            if self.index >= first:
                break
            self._stack.close()
            if not replace or attempt:
                raise RavexError(f"{store}: cannot take checkpoint {self.index} of another store: this store already used indices up to "
                                 f"{first - 1}", hint="its checkpoints are of another run; resume from it, or move it away")
            remove_store(w)  # a replica of an older lineage of the store it protects (that store started over)
        self._tmp = store / "checkpoints" / f"{self.index:08d}.tmp-{run_id}"
        self._tmp.mkdir()
        self._dirs: set[Path] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the lock back; a copy not committed is removed (the next writer would sweep it anyway)."""
        with contextlib.suppress(OSError):
            if self._tmp.exists():
                import shutil

                shutil.rmtree(self._tmp)
        self._stack.close()

    def need(self, files: list[tuple[str, int]]) -> list[str]:
        """Of ``files`` (relative path, size), those to copy: every file of the checkpoint's own
        directory, and a file of an earlier checkpoint's directory unless the store has it already."""
        out = []
        for rel, size in files:
            if rel.startswith(self.rel_dir + "/"):
                out.append(rel)
                continue
            p = self._dest(rel)
            if not (p.is_file() and not p.is_symlink() and p.stat().st_size == size):
                out.append(rel)
        return out

    def _dest(self, rel: str) -> Path:
        parts = rel.split("/")
        if len(parts) != 3 or parts[0] != "checkpoints" or not (len(parts[1]) == 8 and parts[1].isdigit()) or parts[2] in ("", ".", ".."):
            raise RavexError(f"{self.store}: a file named {rel!r} is not a data file of a checkpoint", hint="this is a bug in Ravex")
        if int(parts[1]) > self.index:
            raise RavexError(f"{self.store}: checkpoint {self.index} cannot use a file of a later checkpoint ({rel})", hint="this is a bug in Ravex")
        return self._tmp / parts[2] if parts[1] == f"{self.index:08d}" else self.store / rel

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[IO[bytes]]:
        """Write the file ``rel`` (fsynced when the block ends). A file of an earlier checkpoint's
        directory goes there under a temporary name and is renamed into place: a directory the
        manifest does not list holds it as data retained (docs/format.md section 5) until this
        checkpoint is listed, and the sweep deletes it if it never is."""
        dest = self._dest(rel)
        tmp = dest if dest.parent == self._tmp else dest.with_name(f"{dest.name}.tmp-{self.run_id}")
        tmp.parent.mkdir(exist_ok=True)
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            fsync_fd(f.fileno())
        if tmp != dest:
            os.replace(tmp, dest)
            self._dirs.add(dest.parent)

    def commit(self) -> None:
        """Check the copy (its metadata checksum, its files, every chunk's checksum) and list it in the
        manifest: rename the directory into place, then the manifest, the commit point."""
        from ravex_convert.formats.native import reader as native
        from ravex_convert.formats.native.store import remove_checkpoint, write_manifest
        from ravex_convert.model import Checkpoint

        final = self.store / self.rel_dir
        os.replace(self._tmp, final)
        for d in self._dirs:
            fsync_dir(d)
        fsync_dir(final.parent)
        try:
            opened = native.open_entry(self.store, self.manifest, self.entry, "store")
            ckpt = Checkpoint("native", self.store, step=opened.doc.get("step"))
            ckpt.source = {"index": self.index}
            for t in opened.checked.tensors.values():
                ckpt.add(t)
            native.verify_chunks(ckpt)
            checkpoints = [e for e in self.manifest["checkpoints"] if e.get("index") != self.index]
            write_manifest(self._w, {**self.manifest, "next_index": max(int(self.manifest["next_index"]), self.index + 1),
                                     "checkpoints": [*checkpoints, self.entry]}, self.run_id, self.generation)
        except BaseException:
            remove_checkpoint(self._w, self.rel_dir)
            raise


def adopt(store: Path, rank: int, run_id: str) -> dict[str, Any] | None:
    """The newest checkpoint of the replica of rank ``rank``'s store that this machine holds, added to
    ``store`` (this machine's own) when that store lacks it: a job restarted with fewer machines, whose
    store's rank now runs on the machine that held the copy. The store's commit protocol and checks
    (:class:`Ingest`). Its manifest entry, or None where the store has it or something newer."""
    import shutil

    held = held_here(store).get(rank)
    best = newest(held) if held is not None else None
    if held is None or best is None:
        return None
    own = newest(store)
    if own is not None and int(own["index"]) >= int(best["index"]):
        return None
    files = checkpoint_files(held, best)
    with Ingest(store, best, run_id) as ingest:
        for rel in ingest.need([(rel, (held / rel).stat().st_size) for rel in files]):
            with ingest.open(rel) as out, open(held / rel, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
        ingest.commit()
    return best


# ---------------------------------------------------------------- copies.json: where a store's copies are


def record_copy(store: Path, copy: dict[str, Any]) -> None:
    """Note in ``copies.json`` of ``store``'s area that a copy committed (one record per holder:
    ``holder_rank``, ``holder_host``, ``path``, ``index``, ``step``, ``committed_unix``, ``bytes_sent``,
    ``seconds``). Written to a temporary name and renamed; best effort (the copy exists either way)."""
    area = area_of(store)
    try:
        area.mkdir(exist_ok=True)
        doc = [c for c in read_copies(store) if c.get("holder_rank") != copy.get("holder_rank")] + [copy]
        history = (_read(store).get("history") or [])[-(_HISTORY - 1):] + [copy]
        tmp = area / f"{COPIES}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"format": "ravex-replica-copies", "copies": doc, "history": history}, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, area / COPIES)
    except OSError:
        pass


def _read(store: Path) -> dict[str, Any]:
    try:
        doc = json.loads((area_of(store) / COPIES).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_copies(store: Path, history: bool = False) -> list[dict[str, Any]]:
    """The newest copy on each holder (``history``: the last copies committed, oldest first, for the cost's measure)."""
    copies = _read(store).get("history" if history else "copies")
    return [c for c in copies if isinstance(c, dict)] if isinstance(copies, list) else []


def status(store: Path, now: float | None = None) -> dict[str, Any] | None:
    """What ``ravex status`` shows of the replicas: ``copies`` (where this store's checkpoints were
    copied, with ``age_s``: seconds since that copy committed, and ``behind``: how many checkpoints
    of the store are newer) and ``held`` (the replicas of other ranks' stores this machine keeps:
    rank, path, newest index and step, ``age_s`` since it was written). None when there is no area."""
    if not area_of(store).is_dir():
        return None
    now = time.time() if now is None else now
    mine = newest(store)
    copies = []
    for c in read_copies(store):
        c = dict(c)
        when = c.get("committed_unix")
        c["age_s"] = round(now - when, 1) if isinstance(when, (int, float)) else None
        if mine is not None and isinstance(c.get("index"), int):
            c["behind"] = sum(1 for e in _complete(store) if int(e["index"]) > c["index"])
        copies.append(c)
    held = []
    for rank, path in held_here(store).items():
        e = newest(path)
        held.append({"rank": rank, "path": str(path), "index": e.get("index") if e else None, "step": e.get("step") if e else None,
                     "age_s": round(now - e["created_unix"], 1) if e and isinstance(e.get("created_unix"), (int, float)) else None})
    return {"area": str(area_of(store)), "copies": copies, "held": held}


def _complete(store: Path) -> list[dict[str, Any]]:
    from ravex_convert.formats.native.reader import read_manifest

    try:
        return [e for e in read_manifest(store)["checkpoints"] if isinstance(e, dict) and e.get("status") == "complete"]
    except RavexError:
        return []
