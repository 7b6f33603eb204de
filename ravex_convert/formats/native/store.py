"""A native store's own files, on either storage backend (spec: docs/format.md sections 2 to 5).

The writer (:mod:`.native_write`) reaches the lock, the marker, the manifest,
the crash cleanup and the sweep only through here. A store on the local
filesystem keeps the POSIX protocol of the spec, byte for byte and fsync for
fsync: an flock on ``<store>/lock`` (``storage.lease``), small files written
to ``<name>.tmp-<run_id>``, fsynced and renamed, directories swept with
``rmtree``. A store on object storage (``objdir:``; ``RAVEX_STORAGE=objdir``)
has no rename, no directory and no flock: its lock is a lease object created
only if absent, its manifest one put conditional on the generation the writer
read (the commit point), and its sweep lists keys and deletes objects.
Readers open either kind through its view (:attr:`~ravex_convert.storage.Location.path`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._output import fsync_dir, fsync_fd
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, UnsafeCheckpointError
from ...storage import ABSENT, Lease, Location, PreconditionFailed, resolve
from . import reader as native
from .check import check_manifest
from .reader import CHECKPOINT, FORMAT_VERSION, MANIFEST, STORE_MARKER, read_manifest

__all__ = ["CHECKPOINTS", "LOCK", "RUN_LOCK", "Entry", "Where", "claim", "create", "empty_manifest", "highest_dir_index", "locked", "open_store", "prepare",
           "refuse_links", "remove_checkpoint", "remove_store", "sweep", "where", "write_manifest"]

CHECKPOINTS = "checkpoints"
LOCK = "lock"
# On object storage, the lease a training run holds for its whole life (section 3); locally the
# run's lock is an flock on the store directory, which has no object to stand for it.
RUN_LOCK = "run-lock"
_NUMBERED = re.compile(r"(\d{8})")
_ANY_INDEX = re.compile(r"(\d{8})(?:\.tmp-.*)?")
_LINK_HINT = ("a store's own files and directories are never links; replace the link by what it points to, or write to another "
              "store. If others can write to this directory, check what else they changed")


# ---------------------------------------------------------------- where the store lives


# A store: its backend, its key there, the view readers open, its name in messages (resolved once).
Where = Location


def where(store: str | Path | Location) -> Where:
    return resolve(store)


# ---------------------------------------------------------------- the lock


@contextlib.contextmanager
def locked(w: Where, run_id: str) -> Iterator[None]:
    """Hold the store's lock for the block (section 2): ``storage.lease`` of ``<store>/lock``.
    Locally an exclusive, non-blocking flock on a regular file opened without following a
    link (O_NOFOLLOW), its contents rewritten, never deleted; on object storage a lease
    object put only if absent and deleted on release."""
    path = w.path / LOCK
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(w.storage.lease(w.key_of(LOCK), run_id))
        except PreconditionFailed as held:
            hint = "only one process may write to a store at a time: wait for that run to finish or stop it, or write to another store"
            if not w.posix:
                hint += (f"; on object storage a writer killed on another machine leaves its lease behind: once it is certainly gone, "
                         f"delete the object {w.shown(LOCK)}")
            raise RavexError(f"{w.label}: another process is writing to this store ({held}); Ravex does not wait for it",
                             hint=hint, path=w.path) from None
        except OSError as exc:
            if w.posix and exc.errno == errno.ELOOP:
                raise _unsafe(path) from None
            if w.posix and exc.errno == errno.EINVAL and os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                raise UnsafeCheckpointError(f"{path}: is not a regular file, so it cannot be the store's lock",
                                            hint=_LINK_HINT, path=path) from None
            raise
        yield


# ---------------------------------------------------------------- small files


def _json_bytes(doc: dict[str, Any], indent: int | None) -> bytes:
    return (json.dumps(doc, indent=indent, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")


def _write_json(path: Path, doc: dict[str, Any], tmp: Path, indent: int | None = None) -> bytes:
    """``tmp`` written and fsynced, then renamed to ``path`` (the caller fsyncs
    the directory); returns the bytes written. ``tmp`` is never opened through a
    symbolic link, and the rename replaces ``path`` itself, never what a link there names."""
    data = _json_bytes(doc, indent)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unsafe(tmp) from None
        raise
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        fsync_fd(f.fileno())
    os.replace(tmp, path)
    return data


def _unsafe(path: Path) -> UnsafeCheckpointError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return UnsafeCheckpointError(
        f"{path}: is a symbolic link{to}; Ravex does not follow links inside a store, so that nothing outside it is written or deleted",
        hint=_LINK_HINT, path=path)


def refuse_links(store: Path) -> None:
    """A store whose own entries (lock, manifest, marker, checkpoints/ and the
    checkpoint directories in it) are symbolic links is refused: writing,
    cleaning up or sweeping through one would change files outside the store.
    (Object storage has no links, but the objdir backend keeps its objects in a local
    directory: a link planted there is refused the same way.)"""
    for name in (LOCK, MANIFEST, STORE_MARKER, CHECKPOINTS):
        if (store / name).is_symlink():
            raise _unsafe(store / name)
    root = store / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if _ANY_INDEX.fullmatch(p.name) and p.is_symlink():
                raise _unsafe(p)


def manifest_generation(w: Where) -> int:
    """The manifest's generation (:data:`ABSENT` when there is none), read before the manifest itself:
    a change after this makes the commit's conditional put fail rather than pass unnoticed."""
    st = w.storage.stat(w.key_of(MANIFEST))
    return ABSENT if st is None else st.generation


def write_manifest(w: Where, manifest: dict[str, Any], run_id: str, generation: int, fence: Lease | None = None) -> None:
    """Section 3, step 4, the commit point: a put of the whole manifest, conditional on the
    generation this writer read. Locally ``manifest.json.tmp-<run_id>`` is written, fsynced,
    renamed over ``manifest.json`` and the store directory fsynced; on object storage the one
    conditional put is the commit. ``fence``: the run's lease on object storage; the manifest
    records its generation, and a lease lost (or a manifest written under a newer generation)
    commits nothing (:class:`StoreTakenOverError`)."""
    tmp = f"{MANIFEST}.tmp-{run_id}"
    if fence is not None:
        check_fence(manifest, fence)
        manifest = {**manifest, "lease": fence.record()}
    try:
        w.storage.put(w.key_of(MANIFEST), _json_bytes(manifest, 1), if_generation=generation, staging=tmp)
    except PreconditionFailed:
        if fence is not None:
            try:  # lost to the run that took the store over? then say that, not "changed"
                now: Any = json.loads(w.storage.get(w.key_of(MANIFEST))[0])
            except (OSError, ValueError, RavexError):
                now = None
            check_fence(now, fence)
        raise RavexError(
            f"{w.label}: {MANIFEST} changed while this writer held the store's lock (another writer that ignored the lock, or an "
            "edit by hand), so nothing was committed: the checkpoint being written is not in the store",
            hint="make sure only one process writes to the store, then write again (the next write removes what this one left)",
            path=w.path) from None
    except OSError as exc:
        if w.posix and exc.errno == errno.ELOOP:
            raise _unsafe(w.path / tmp) from None
        raise


def check_fence(manifest: Any, fence: Lease) -> None:
    """Raise :class:`StoreTakenOverError` when ``fence`` was lost, or ``manifest`` was written under
    a newer generation than its (another run took the store over)."""
    fence.check()
    if isinstance(manifest, dict) and fence.fenced_by(manifest.get("lease")):
        fence.check()


def _recorded_writer(w: Where, fence: Lease) -> str | None:
    """``run R on host H``: the writer the manifest records (``lease``) where it is newer than ``fence``, else None."""
    try:
        held = json.loads(w.storage.get(w.key_of(MANIFEST))[0]).get("lease")
    except (OSError, ValueError, AttributeError, RavexError):
        return None
    if not isinstance(held, dict) or not isinstance(held.get("generation"), int) or held["generation"] <= fence.generation:
        return None
    return f"run {held.get('run_id', '?')} on host {held.get('host', '?')}"


def claim(w: Where, fence: Lease) -> None:
    """A run that took the store's lease marks the manifest with its generation (a put conditional
    on the ETag read), so that no writer of an older generation can commit after this point: its
    manifest put is conditional on an ETag from before it, or it reads the newer generation. A
    run that took the lease over from a holder that may still run (its lease lapsed) also moves
    ``next_index`` past the one a write of that holder still in flight may be building, so the
    two never share a directory.
    Nothing to do where there is no manifest yet. The lease learns whom to name should it find
    itself replaced and the taker gone: the writer the manifest records."""
    fence.name_taker_by(lambda: _recorded_writer(w, fence))
    for _ in range(8):
        try:
            raw, generation = w.storage.get(w.key_of(MANIFEST))
        except FileNotFoundError:
            return
        try:
            manifest = json.loads(raw)
        except ValueError:
            return  # the reader says what is wrong with it
        if not isinstance(manifest, dict) or not isinstance(manifest.get("next_index"), int):
            return
        # not check_fence: a newer generation here is history (the lease was deleted and created again,
        # by a release or by hand) while this run holds the lease; advance() fails if it does not
        fence.check()
        held = manifest.get("lease")
        seen = held.get("generation") if isinstance(held, dict) else None
        if isinstance(seen, int) and not isinstance(seen, bool) and seen >= fence.generation:
            # written under a generation as new as this lease's: the lease was released (deleted)
            # and created again since; a token must only grow
            fence.advance(seen + 1)
        update = {**manifest, "lease": fence.record()}
        if fence.holder_may_run:
            update["next_index"] = max(int(manifest["next_index"]), highest_dir_index(w) + 1) + 1
        try:
            w.storage.put(w.key_of(MANIFEST), _json_bytes(update, 1), if_generation=generation)
            return
        except PreconditionFailed:
            continue  # a commit landed meanwhile (the old holder's last, before this claim): read it again
    raise RavexError(f"{w.label}: {MANIFEST} kept changing while this run claimed the store", hint="another process writes to it; stop it",
                     path=w.path)


def empty_manifest(p: Path) -> bool:
    """A manifest that lists nothing, as an interrupted creation writes it."""
    try:
        doc = json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("checkpoints") == [] and doc.get("next_index") == 0


def _creation_leftover(p: Path) -> bool:
    """What an interrupted creation (section 2) may have left: never a store, safe to finish."""
    if p.is_symlink():
        return False
    if p.name == CHECKPOINTS:
        return p.is_dir() and not any(p.iterdir())
    if p.name == LOCK:
        return p.is_file()
    if p.name == MANIFEST:
        return p.is_file() and empty_manifest(p)
    return p.name.startswith((f"{MANIFEST}.tmp-", f"{STORE_MARKER}.tmp-")) and p.is_file()


def _lost_marker(w: Where, held: list[str]) -> IncompleteCheckpointError:
    # A store that lost its marker is still a store: starting a fresh one here would discard its checkpoints.
    return IncompleteCheckpointError(
        f"{w.label}: has {' and '.join(held)} but no {STORE_MARKER}: a Ravex store that lost its marker file "
        "(or a damaged one); Ravex will not start a new store over its checkpoints",
        hint=f"restore {STORE_MARKER} from a copy of the store (then the store can be written again), or write to another directory",
        path=w.path,
    )


def _not_a_store(w: Where, other: list[str]) -> RavexError:
    shown = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
    return RavexError(
        f"{w.label}: exists and is not a Ravex store (no {STORE_MARKER}; it holds {shown})",
        hint="write to a new or empty directory, or to an existing store (a directory with ravex-store.json)",
        path=w.path,
    )


def prepare(w: Where) -> None:
    """Before the lock: refuse what is not a store and not empty (section 2), links (section 1);
    locally make the directory and ``checkpoints/`` (object storage has no directories)."""
    if not w.posix:
        _prepare_objects(w)
        return
    store = w.path
    fresh = not store.exists()
    if store.exists() and not store.is_dir():
        raise RavexError(f"{store}: exists and is not a directory, so it cannot be a Ravex store", hint="choose another destination", path=store)
    if store.is_dir():
        refuse_links(store)
    if store.is_dir() and not (store / STORE_MARKER).exists():
        held = [n for n in (MANIFEST, CHECKPOINTS) if (store / n).exists() and not _creation_leftover(store / n)]
        if held:
            raise _lost_marker(w, held)
        other = sorted(p.name for p in store.iterdir() if not _creation_leftover(p))
        if other:
            raise _not_a_store(w, other)
    store.mkdir(parents=True, exist_ok=True)
    (store / CHECKPOINTS).mkdir(exist_ok=True)
    refuse_links(store)
    if fresh:
        fsync_dir(store.parent)


def _prepare_objects(w: Where) -> None:
    if w.path.is_dir():
        refuse_links(w.path)
    bucket = w.missing_bucket()
    if bucket is not None:
        raise RavexError(f"{bucket}: the store's bucket (directory) does not exist", hint="create it first", path=Path(bucket))
    if w.storage.exists(w.key):
        raise RavexError(f"{w.label}: exists and is an object, not a directory (a prefix of objects), so it cannot be a Ravex store",
                         hint="choose another destination", path=w.path)
    rels = w.objects()
    if STORE_MARKER in rels:
        return
    held = [n for n, there in ((MANIFEST, MANIFEST in rels and not empty_manifest(w.path / MANIFEST)),
                               (CHECKPOINTS, any(r.startswith(f"{CHECKPOINTS}/") for r in rels))) if there]
    if held:
        raise _lost_marker(w, held)
    leftover = {LOCK, RUN_LOCK} | ({MANIFEST} if MANIFEST in rels else set())
    other = sorted({r.split("/", 1)[0] for r in rels if r not in leftover
                    and not r.startswith((f"{MANIFEST}.tmp-", f"{STORE_MARKER}.tmp-"))})
    if other:
        raise _not_a_store(w, other)


def create(w: Where, run_id: str) -> None:
    """Section 2: the manifest first, the marker last, so a half-made store never looks like one."""
    manifest = {"format": "ravex-store", "format_version": FORMAT_VERSION, "next_index": 0, "checkpoints": []}
    marker = {"format": "ravex-store", "format_version": FORMAT_VERSION, "created_unix": time.time(), "store_id": uuid.uuid4().hex}
    if w.posix:
        store = w.path
        for leftover in store.glob("*.tmp-*"):
            leftover.unlink()
        _write_json(store / MANIFEST, manifest, store / f"{MANIFEST}.tmp-{run_id}", indent=1)
        _write_json(store / STORE_MARKER, marker, store / f"{STORE_MARKER}.tmp-{run_id}", indent=1)
        fsync_dir(store)
        return
    for rel in w.objects():
        if "/" not in rel and ".tmp-" in rel:
            w.storage.delete(w.key_of(rel))
    try:  # over an empty manifest an interrupted creation left, else where there is none
        w.storage.put(w.key_of(MANIFEST), _json_bytes(manifest, 1), if_generation=manifest_generation(w))
        w.storage.put(w.key_of(STORE_MARKER), _json_bytes(marker, 1), if_generation=ABSENT)
    except PreconditionFailed:
        raise RavexError(f"{w.label}: another writer created this store at the same time, ignoring its lock",
                         hint="make sure only one process writes to the store, then write again", path=w.path) from None


# ---------------------------------------------------------------- the manifest's entries


@dataclass
class Entry:
    entry: dict[str, Any]
    doc: dict[str, Any] | None = None
    refs: frozenset[str] = frozenset()
    problem: str | None = None  # why it is not loadable (section 6)

    @property
    def index(self) -> int:
        return int(self.entry["index"])


def _load_entry(store: Path, manifest: dict[str, Any], entry: dict[str, Any]) -> Entry:
    """An entry and its checkpoint.json, checked as a reader checks it (its
    metadata checksum, section 17, chunk files inside the store and present);
    ``problem`` says why it is not loadable. A checkpoint.json of a newer
    format version raises: its references are unknown."""
    out = Entry(entry)
    if entry.get("status") != "complete":
        out.problem = f"its status is {entry.get('status')!r}"
        return out
    try:
        opened = native.open_entry(store, manifest, entry, "store")
    except (CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError) as exc:
        out.problem = exc.message
        return out
    out.doc = opened.doc
    out.refs = frozenset({f"{entry['dir']}/{CHECKPOINT}", *opened.checked.files})
    return out


def highest_dir_index(w: Where) -> int:
    """The largest index any directory name under ``checkpoints/`` holds (temporary ones included)."""
    if w.posix:
        names = [p.name for p in (w.path / CHECKPOINTS).iterdir()]
    else:
        names = [r.split("/", 2)[1] for r in w.objects(CHECKPOINTS) if r.count("/") >= 2]
    found = [int(m.group(1)) for n in names if (m := _ANY_INDEX.fullmatch(n))]
    return max(found, default=-1)


def _remove(p: Path) -> None:
    """Delete ``p``: a directory with all it holds, anything else (a symbolic link
    included) as an entry. Never through a link: ``rmtree`` does not follow them."""
    if stat.S_ISDIR(os.lstat(p).st_mode):
        shutil.rmtree(p)
    else:
        p.unlink()


def _cleanup(w: Where) -> None:
    """Section 4: under the lock, whatever a crashed writer left is garbage."""
    if w.posix:
        store = w.path
        for p in (store / CHECKPOINTS).glob("*.tmp-*"):
            _remove(p)
        for p in store.glob(f"{MANIFEST}.tmp-*"):
            _remove(p)
        return
    for rel in w.objects():
        parts = rel.split("/")
        in_tmp_dir = len(parts) > 2 and parts[0] == CHECKPOINTS and ".tmp-" in parts[1]
        if in_tmp_dir or (len(parts) == 1 and parts[0].startswith(f"{MANIFEST}.tmp-")):
            w.storage.delete(w.key_of(rel))


def sweep(w: Where, entries: list[Entry]) -> list[str]:
    """Section 5: delete unlisted numbered directories, keeping files a listed
    checkpoint references. Returns warnings."""
    broken = [e for e in entries if e.problem is not None]
    if broken:
        return [f"{w.label}: checkpoint {e.index} is not loadable ({e.problem}); the sweep deleted nothing" for e in broken]
    refs = frozenset().union(*(e.refs for e in entries))
    listed = {str(e.entry["dir"]).rsplit("/", 1)[-1] for e in entries}
    return _sweep_dirs(w.path, refs, listed) if w.posix else _sweep_objects(w, refs, listed)


def _sweep_dirs(store: Path, refs: frozenset[str], listed: set[str]) -> list[str]:
    warnings: list[str] = []
    root = store / CHECKPOINTS
    for d in sorted(root.iterdir()):
        if not _NUMBERED.fullmatch(d.name) or not d.is_dir() or d.is_symlink():
            warnings.append(f"{d}: not part of the store (ignored)")
            continue
        if d.name in listed:
            continue
        kept = {p.name for p in d.iterdir() if f"{CHECKPOINTS}/{d.name}/{p.name}" in refs}
        if not kept:
            shutil.rmtree(d)
            continue
        # Retained for data: checkpoint.json goes first, so a half-swept directory never looks like a checkpoint.
        with contextlib.suppress(FileNotFoundError):
            _remove(d / CHECKPOINT)
        for p in d.iterdir():
            if p.name not in kept:
                _remove(p)
        fsync_dir(d)
    fsync_dir(root)
    return warnings


def _sweep_objects(w: Where, refs: frozenset[str], listed: set[str]) -> list[str]:
    """The sweep by listing and deleting: a "directory" is the prefix ``checkpoints/<8 digits>/``,
    gone with its last object. Nothing is renamed or rewritten."""
    warnings: list[str] = []
    # a put killed midway left no object, only the backend's remains (a part, an empty prefix)
    w.storage.abort_unfinished(w.key_of(CHECKPOINTS))
    dirs: dict[str, list[str]] = {}
    for rel in w.objects(CHECKPOINTS):
        _, d, *rest = rel.split("/", 2)
        if not rest:
            warnings.append(f"{w.shown(rel)}: not part of the store (ignored)")
            continue
        dirs.setdefault(d, []).append(rest[0])
    for d, files in sorted(dirs.items()):
        if not _NUMBERED.fullmatch(d):
            warnings.append(f"{w.shown(f'{CHECKPOINTS}/{d}')}: not part of the store (ignored)")
            continue
        if d in listed:
            continue
        # checkpoint.json first, so a half-swept prefix never looks like a checkpoint
        for f in sorted(files, key=lambda f: f != CHECKPOINT):
            if f"{CHECKPOINTS}/{d}/{f}" not in refs:
                w.storage.delete(w.key_of(f"{CHECKPOINTS}/{d}/{f}"))
    return warnings


def open_store(w: Where, fence: Lease | None = None) -> tuple[dict[str, Any], int, list[Entry], int, list[str]]:
    """Under the lock: the manifest and its generation, its entries, the highest index any
    directory name holds, and the sweep's warnings (after the crash cleanup). ``fence``: a run
    whose lease was taken over stops here, before its cleanup could touch the new holder's objects."""
    if w.posix or w.path.is_dir():
        refuse_links(w.path)
    generation = manifest_generation(w)
    manifest = read_manifest(w.path)
    if fence is not None:
        check_fence(manifest, fence)
    raw = check_manifest(manifest, w.path / MANIFEST)
    highest = highest_dir_index(w)
    _cleanup(w)
    entries = [_load_entry(w.path, manifest, e) for e in raw]
    return manifest, generation, entries, highest, sweep(w, entries)


def remove_checkpoint(w: Where, rel_dir: str) -> None:
    """A checkpoint directory that never committed, whole."""
    if w.posix:
        shutil.rmtree(w.path / rel_dir, ignore_errors=True)
        return
    for rel in w.objects(rel_dir):
        with contextlib.suppress(FileNotFoundError):
            w.storage.delete(w.key_of(rel))


def remove_store(w: Where) -> None:
    """A store this call made, for a first checkpoint that failed: nothing is left behind."""
    if w.posix:
        shutil.rmtree(w.path, ignore_errors=True)
        return
    for rel in w.objects():
        with contextlib.suppress(FileNotFoundError):
            w.storage.delete(w.key_of(rel))
