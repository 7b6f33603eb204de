"""The native Ravex store (spec: docs/format.md, version 1).

This module holds what detection, inspection and loading need: recognising a
store or one of its checkpoints, reading the manifest, choosing a checkpoint
(``-1``: the newest), and turning its metadata into a :class:`Checkpoint`.
Every JSON file is read and checked by :mod:`.native_check` first; every path
the metadata names is kept inside the store (``_paths.inside``); chunk bytes
are verified by :func:`verify_chunks` before they are used.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..._paths import inside
from ..._tagged import decode
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, from_os_error
from ...info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ...model import Checkpoint, Chunk
from ...objects import check as check_objects
from ...recipes import KEY as RECIPES
from ...storage import core_source
from .check import FORMAT_VERSION, Checked, check_checkpoint, check_manifest, load_json, metadata_checksum

__all__ = ["CHECKPOINT", "FORMAT_VERSION", "MANIFEST", "STORE_MARKER", "Opened", "check_chunks", "describe", "open_entry", "read", "read_manifest", "resolve", "sniff",
           "verify_chunks", "verify_read"]

STORE_MARKER = "ravex-store.json"
MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.json"
_NUMBERED = re.compile(r"\d{8}")
_MANIFEST_HINT = "the manifest is damaged; restore it from a copy of the store"
_META_HINT = "the checkpoint's metadata is damaged or was edited; restore the store from a copy, or read another checkpoint (--index)"


def sniff(path: Path) -> list[str] | None:
    if path.is_dir() and (path / STORE_MARKER).is_file():
        return [f"found {STORE_MARKER} (a Ravex store)"]
    if path.is_dir() and (path / CHECKPOINT).is_file():
        if ".tmp-" in path.name:
            raise IncompleteCheckpointError(
                f"{path}: a Ravex checkpoint that was still being written (its name has '.tmp-'); it was never committed",
                hint="open the store directory instead: `ravex inspect` picks the newest complete checkpoint",
                path=path,
            )
        return [f"found {CHECKPOINT} (one checkpoint of a Ravex store)"]
    if path.is_file() and path.name in (STORE_MARKER, MANIFEST, CHECKPOINT):
        return [f"{path.name} is a Ravex store file"]
    return None


def _load_json(path: Path, expected_format: str) -> dict[str, Any]:
    """One of the store's JSON files, strictly parsed, format and version checked."""
    hint = _MANIFEST_HINT if path.name == MANIFEST else _META_HINT if path.name == CHECKPOINT else \
        f"{path.name} is damaged; restore it from a copy of the store"
    return load_json(path, expected_format, hint=hint)[0]


def _store_file(store: Path, name: str) -> Path:
    """``store / name``, refused when it is a link leading out of the store."""
    return inside(store, name, "the store file", store)


def read_manifest(store: Path) -> dict[str, Any]:
    """The store's manifest, with the marker and every entry checked (section 17.1, 17.2)."""
    marker = _store_file(store, STORE_MARKER)
    load_json(marker, "ravex-store", hint=f"{STORE_MARKER} is damaged; restore it from a copy of the store")
    path = _store_file(store, MANIFEST)
    manifest = load_json(path, "ravex-store", hint=_MANIFEST_HINT,
                         missing_hint="the store has lost its manifest; restore the store from a copy")[0]
    check_manifest(manifest, path)
    return manifest


# ---------------------------------------------------------------- choosing and opening a checkpoint


@dataclass
class Opened:
    """One checkpoint of a store (or copied out of one), opened and checked: what the reader and the store's
    sweep read from it."""

    store: Path  # the store root (for a checkpoint copied out of its store: where it would be)
    ckpt_dir: Path
    variant: str  # "store" or "checkpoint"
    manifest: dict[str, Any] | None
    entry: dict[str, Any] | None
    doc: dict[str, Any]
    checked: Checked
    notes: list[str] = field(default_factory=list)

    @property
    def json_path(self) -> Path:
        return self.ckpt_dir / CHECKPOINT


def _load_entry(store: Path, entry: dict[str, Any], notes: list[str]) -> tuple[dict[str, Any], Path]:
    """The checkpoint.json of a manifest entry, its bytes checked against the
    entry's ``metadata_checksum`` (section 8); entries written before it have none."""
    index = entry["index"]
    ckpt_dir = inside(store, str(entry["dir"]), "checkpoint directory", store / MANIFEST)
    path = inside(store, f"{entry['dir']}/{CHECKPOINT}", "checkpoint metadata", store / MANIFEST)
    doc, raw = load_json(path, "ravex-checkpoint", hint=_META_HINT,
                         missing_hint=f"checkpoint {index} is listed in {MANIFEST} but its metadata is gone; "
                                      "restore the store from a copy, or read another checkpoint (--index)")
    recorded = entry.get("metadata_checksum")
    if recorded is None:
        notes.append(f"checkpoint {index}: its manifest entry records no metadata_checksum (written by an older Ravex), "
                     f"so {CHECKPOINT} was read without checking it")
    elif (computed := metadata_checksum(raw)) != recorded:
        raise CorruptCheckpointError(
            f"{path}: checkpoint {index}: the file does not match the checksum its manifest entry records "
            f"(recorded {recorded}, computed {computed}); it was damaged or edited after it was written",
            hint="restore the store from a copy, or read another checkpoint (--index)",
            path=path,
        )
    return doc, ckpt_dir


def _check(store: Path, ckpt_dir: Path, doc: dict[str, Any], entry: dict[str, Any] | None, copied_out: bool) -> Checked:
    path = ckpt_dir / CHECKPOINT
    index = entry["index"] if entry is not None else (int(ckpt_dir.name) if _NUMBERED.fullmatch(ckpt_dir.name) else None)

    def locate(rel: str, file_index: int) -> Path:
        if not copied_out:
            return inside(store, rel, "chunk file", path)
        own = doc["index"]
        if file_index != own:
            raise IncompleteCheckpointError(
                f"{path}: chunk file '{rel}' lives in checkpoint {file_index} of the store this was copied from",
                hint="open the whole store, or convert the checkpoint into a self-contained one",
                path=path,
            )
        return inside(ckpt_dir, rel.split("/", 2)[2], "chunk file", path)

    checked = check_checkpoint(doc, path, index=index, run_id=entry.get("run_id") if entry is not None else None, locate=locate)
    sizes: dict[Path, int] = {}
    for rel, p in checked.files.items():
        try:
            st = p.stat()
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise from_os_error(exc, path=p) from None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise IncompleteCheckpointError(f"{path}: chunk file '{rel}' is missing", hint="copy the whole store directory; checkpoints can share data files",
                                            path=p)
        sizes[p] = st.st_size
    # Section 17.6, before reading: every chunk lies inside its file (a truncated file shows here, without reading it).
    for name, t in checked.tensors.items():
        for k, c in enumerate(t.chunks):
            assert c.file is not None and c.stored_nbytes is not None  # check_checkpoint sets both
            if c.offset + c.stored_nbytes > sizes[c.file]:
                raise CorruptCheckpointError(
                    f"{path}: tensor '{name}', chunk {k}: it ends at byte {c.offset + c.stored_nbytes} of {c.file}, "
                    f"but the file has {sizes[c.file]} bytes (truncated?)",
                    hint="the data file is damaged; restore the store from a copy, or read another checkpoint (--index)", path=c.file)
    return checked


def open_entry(store: Path, manifest: dict[str, Any], entry: dict[str, Any], variant: str) -> Opened:
    """The checkpoint of manifest ``entry`` in ``store``, opened and checked as :func:`read` checks it."""
    notes: list[str] = []
    doc, ckpt_dir = _load_entry(store, entry, notes)
    checked = _check(store, ckpt_dir, doc, entry, copied_out=False)
    return Opened(store, ckpt_dir, variant, manifest, entry, doc, checked, notes)


def _open_store(store: Path, index: int) -> Opened:
    """Section 6: the entry ``index`` names (negative: counted from the newest complete one).

    Ravex never substitutes another checkpoint: when the one asked for (or, for
    ``-n``, any newer complete one) cannot be read, that is the error, with the
    index to pass to read the one before it."""
    manifest = read_manifest(store)
    entries = manifest["checkpoints"]
    complete = [e for e in entries if e["status"] == "complete"]
    others = [f"checkpoint {e['index']} has status {e['status']!r} and is never loaded" for e in entries if e["status"] != "complete"]
    if not complete:
        raise IncompleteCheckpointError(
            f"{store}: the store holds no complete checkpoint",
            hint="a run that was killed before its first checkpoint committed leaves an empty store; start the run again",
            path=store,
        )
    if index >= 0:
        found = [e for e in entries if e["index"] == index]
        if not found or found[0]["status"] != "complete":
            have = ", ".join(str(e["index"]) for e in complete)
            why = "no" if not found else f"status {found[0]['status']!r}, not a"
            raise RavexError(f"{store}: {why} complete checkpoint with index {index} (complete ones: {have})",
                             hint="run `ravex inspect` on the store to list them", path=store)
        opened = open_entry(store, manifest, found[0], "store")
    else:
        if -index > len(complete):
            raise RavexError(f"{store}: index {index} asked for, but the store holds {len(complete)} complete checkpoint(s)",
                             hint="use -1 for the newest", path=store)
        at = len(complete) + index
        for k in range(len(complete) - 1, at - 1, -1):  # every newer complete one, then the one asked for
            try:
                opened = open_entry(store, manifest, complete[k], "store")
            except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                raise _no_fallback(store, complete, k, exc) from None
    opened.notes[:0] = others
    return opened


def _no_fallback(store: Path, complete: list[dict[str, Any]], k: int, exc: RavexError) -> RavexError:
    """The error for a complete entry that cannot be read while choosing by a
    negative index: where an older checkpoint exists, the message says that
    Ravex did not fall back to it and the hint gives the index to pass."""
    if k == 0:
        return exc
    e, before = complete[k], complete[k - 1]["index"]
    which = "newest" if k == len(complete) - 1 else "a newer"
    hint = (f"{exc.hint.rstrip('.')}; " if exc.hint else "") + \
        f"to read the checkpoint before it instead, pass --index {before} (Ravex does not fall back to an older checkpoint by itself)"
    return type(exc)(f"{store}: checkpoint {e['index']}, the {which} one listed in {MANIFEST}, cannot be read: {exc.message}",
                     hint=hint, path=exc.path)


def _open(path: Path, index: int = -1) -> Opened:
    p = path.parent if path.is_file() else path
    if (p / STORE_MARKER).is_file():
        return _open_store(p, index)
    store = p.parent.parent
    if p.parent.name == "checkpoints" and (store / STORE_MARKER).is_file():
        manifest = read_manifest(store)
        listed = [e for e in manifest["checkpoints"] if e["dir"] == f"checkpoints/{p.name}"]
        if not listed:
            raise IncompleteCheckpointError(
                f"{p}: not listed in {store / MANIFEST}, so it is not a committed checkpoint",
                hint="open the store directory to get the newest complete checkpoint",
                path=p,
            )
        return open_entry(store, manifest, listed[0], "checkpoint")
    # A checkpoint copied out of its store: its own files sit beside checkpoint.json.
    doc = _load_json(inside(p, CHECKPOINT, "checkpoint metadata", p), "ravex-checkpoint")
    checked = _check(store, p, doc, None, copied_out=True)
    return Opened(store, p, "checkpoint", None, None, doc, checked)


def resolve(store: Path, index: int = -1) -> tuple[dict[str, Any], Path]:
    """The manifest entry and directory of checkpoint ``index`` (negative: from the newest complete one)."""
    opened = _open_store(store, index)
    return cast(dict[str, Any], opened.entry), opened.ckpt_dir


# ---------------------------------------------------------------- describe and read


def _kind(name: str) -> str:
    if name.startswith("optim/"):
        return "optim"
    return "param" if name.startswith("model/") else "other"


def _display(name: str) -> str:
    """Logical names as inspect shows them for every format: ``embed.weight``,
    ``optim.exp_avg/embed.weight``."""
    if name.startswith("model/"):
        return name[len("model/"):]
    if name.startswith("optim/") and name.count("/") >= 2:
        _, state, fqn = name.split("/", 2)
        return f"optim.{state}/{fqn}"
    return name


def _read(path: Path, index: int = -1) -> tuple[Checkpoint, Opened]:
    """The checkpoint, and the store it was opened in (its manifest and files: for describe)."""
    o = _open(path, index)
    p = path.parent if path.is_file() else path
    where = str(o.json_path)
    ckpt = Checkpoint("native", p, world_size=o.doc["world_size"], step=o.doc.get("step"))
    ckpt.source = dict(o.doc["source"])
    ckpt.source["index"] = o.doc["index"]
    for t in o.checked.tensors.values():
        ckpt.add(t)
    ckpt.aliases = dict(o.checked.aliases)
    try:
        ckpt.objects = {k: decode(v, f"{where}: objects.{k}") for k, v in o.checked.objects.items()}
    except RavexError as exc:
        raise type(exc)(exc.message, hint=exc.hint or _META_HINT, path=where) from None
    check_objects(ckpt.objects, where)
    ckpt.notes.extend(o.notes)
    return ckpt, o


def read(path: Path, index: int = -1) -> Checkpoint:
    """One checkpoint of a store (``index``; -1 = newest complete), every check of
    docs/format.md section 17 that needs no data bytes done; :func:`verify_chunks`
    checks the bytes."""
    return _read(path, index)[0]


def describe(path: Path, reasons: list[str], index: int = -1) -> CheckpointInfo:
    """What :func:`read` finds, as ``inspect`` shows it, with the store's files
    and its list of checkpoints (the metadata is read once; no chunk is verified)."""
    ckpt, o = _read(path, index)
    info = CheckpointInfo("native", o.variant, str(ckpt.path), world_size=ckpt.world_size, step=ckpt.step, reasons=reasons)
    info.notes = list(ckpt.notes)
    info.tensors = [TensorInfo(_display(name), t.shape, t.dtype, _kind(name)) for name, t in ckpt.tensors.items()]
    try:
        for rel in sorted(o.checked.files):
            info.files.append(FileInfo(rel, o.checked.files[rel].stat().st_size, "data"))
        shown = str(o.json_path.relative_to(o.store)) if o.variant == "store" else CHECKPOINT
        info.files.insert(0, FileInfo(shown, o.json_path.stat().st_size, "metadata"))
    except OSError as exc:
        raise from_os_error(exc) from None
    info.aliases = {_display(k): _display(v) for k, v in ckpt.aliases.items()}
    states = ckpt.optimizer_state_names()
    if states:
        groups = ckpt.objects.get("optim.param_groups")
        info.optimizer = OptimizerInfo("Adam" if {"exp_avg", "exp_avg_sq"} <= set(states) else "unknown", states,
                                       len(groups) if isinstance(groups, list) else None)
    if RECIPES in ckpt.objects:
        info.extra[RECIPES] = ckpt.objects[RECIPES]  # how to rebuild the model (docs/format.md 13.1): inspect shows it
    if o.manifest is not None and o.entry is not None and o.variant == "store":
        info.extra["index"] = o.entry["index"]
        info.extra["checkpoints"] = [
            {k: e.get(k) for k in ("index", "step", "status", "created_unix", "bytes")} for e in o.manifest["checkpoints"]
        ]
    return info


def verify_chunks(ckpt: Checkpoint, names: Iterable[str] | None = None) -> int:
    """Check the xxh3-64 checksum of every chunk of ``names`` (default: every
    tensor; aliases follow their target) over all its uncompressed bytes
    (docs/format.md sections 12 and 17.6). ``ckpt`` comes from :func:`read`.

    Compressed chunks are decoded in bounded pieces and hashed on the way, so
    memory does not grow with what a frame declares.

    Raises :class:`CorruptCheckpointError` naming the tensor, the chunk's
    position, the file, the checkpoint index and the store on the first
    mismatch, truncation or undecodable frame, and
    :class:`IncompleteCheckpointError` for a missing file. Returns the number
    of chunks verified."""
    return _verify(ckpt, names, True, [])


def check_chunks(ckpt: Checkpoint) -> list[tuple[str, int, Chunk]]:
    """:func:`verify_chunks` of every tensor but for the checksums of its uncompressed chunks, which
    are returned (``(tensor, position, chunk)``) for :func:`verify_read` to check on the bytes the
    caller reads anyway: a store in a bucket is then downloaded once, not twice (once to hash, once
    to read). Every other check (files present, chunks inside them, compressed frames) is done."""
    deferred: list[tuple[str, int, Chunk]] = []
    _verify(ckpt, None, False, deferred)
    return deferred


def verify_read(ckpt: Checkpoint, deferred: list[tuple[str, int, Chunk]], read: Callable[[str, Chunk], Any]) -> None:
    """The checksums :func:`check_chunks` left, checked on what the caller read: ``read(tensor,
    chunk)`` gives the chunk's bytes as read (a C-contiguous buffer), or None where it has none
    (a chunk read cast to another dtype): those are hashed from their files."""
    from ... import _core

    from_file: dict[Path, list[tuple[str, int, Chunk]]] = {}
    for name, k, c in deferred:
        data = read(name, c)
        if data is None:
            from_file.setdefault(cast(Path, c.file), []).append((name, k, c))
            continue
        h = _core.xxh3_64(data)
        if f"xxh3-64:{h:016x}" != c.checksum:
            raise _bad(ckpt, name, k, c, f"checksum mismatch (recorded {c.checksum}, computed xxh3-64:{h:016x})")
    for file, chunks in from_file.items():
        _hash_file(ckpt, file, chunks)


def _bad(ckpt: Checkpoint, name: str, k: int, c: Chunk, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{ckpt.path}: checkpoint {ckpt.source.get('index')}: chunk {k} of tensor '{name}' in {c.file}: {why}",
        hint="the data file is damaged; restore the store from a copy, or load another checkpoint (--index)",
        path=c.file,
    )


def _hash_file(ckpt: Checkpoint, file: Path, plain: list[tuple[str, int, Chunk]]) -> int:
    """Checks the checksums of uncompressed chunks of ``file`` against its bytes; the number checked."""
    from ... import _core

    try:
        sums = _core.checksum_ranges(core_source(file), [(c.offset, c.nbytes) for _, _, c in plain], "xxh3-64") if plain else []
    except OSError as exc:
        raise from_os_error(exc, path=file) from None
    for (name, k, c), h in zip(plain, sums, strict=True):
        if f"xxh3-64:{h:016x}" != c.checksum:
            raise _bad(ckpt, name, k, c, f"checksum mismatch (recorded {c.checksum}, computed xxh3-64:{h:016x})")
    return len(plain)


def _verify(ckpt: Checkpoint, names: Iterable[str] | None, hash_plain: bool, deferred: list[tuple[str, int, Chunk]]) -> int:
    from ... import _core

    store, index = ckpt.path, ckpt.source.get("index")
    wanted = list(ckpt.tensors) if names is None else [ckpt.aliases.get(n, n) for n in names]
    by_file: dict[Path, list[tuple[str, int, Chunk]]] = {}
    count = 0

    def bad(name: str, k: int, c: Chunk, why: str) -> CorruptCheckpointError:
        return _bad(ckpt, name, k, c, why)

    for name in dict.fromkeys(wanted):
        t = ckpt.tensors[name]
        for k, c in enumerate(t.chunks):
            if c.checksum is None or not re.fullmatch(r"xxh3-64:[0-9a-f]{16}", c.checksum):
                raise bad(name, k, c, f"its checksum {c.checksum!r} is not 'xxh3-64:' and 16 lowercase hex digits")
            if c.file is None:
                raise bad(name, k, c, "the chunk names no file")
            by_file.setdefault(c.file, []).append((name, k, c))
    for file, chunks in by_file.items():
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            name, k, _ = chunks[0]
            pruned = index is not None and (store / STORE_MARKER).is_file() and not any(
                e.get("index") == index for e in read_manifest(store)["checkpoints"] if isinstance(e, dict))
            raise IncompleteCheckpointError(
                f"{store}: checkpoint {index}: data file {file} of tensor '{name}' (chunk {k}) is missing"
                + ("; the checkpoint was pruned while being read" if pruned else ""),
                hint="load the newest checkpoint again" if pruned else "copy the whole store directory; checkpoints share data files",
                path=file,
            ) from None
        except OSError as exc:
            raise from_os_error(exc, path=file) from None
        plain: list[tuple[str, int, Chunk]] = []
        for name, k, c in chunks:
            stored = c.stored_nbytes if c.stored_nbytes is not None else c.nbytes
            if c.compression is None and stored != c.nbytes:
                raise bad(name, k, c, f"stored_nbytes {stored} differs from nbytes {c.nbytes} in an uncompressed chunk")
            if c.offset < 0 or c.offset + stored > size:
                raise bad(name, k, c, f"the chunk ends at byte {c.offset + stored}, but the file has {size} bytes (truncated?)")
            if c.compression is None:
                plain.append((name, k, c))
                continue
            try:
                h = _core.decompress_frame_to(core_source(file), c.offset, stored, c.nbytes)
            except ValueError as exc:
                raise bad(name, k, c, f"its zstd frame does not decode to {c.nbytes} bytes ({str(exc).split(chr(10))[0]})") from None
            except OSError as exc:
                raise from_os_error(exc, path=file) from None
            if f"xxh3-64:{h:016x}" != c.checksum:
                raise bad(name, k, c, f"checksum mismatch (recorded {c.checksum}, computed xxh3-64:{h:016x})")
            count += 1
        if hash_plain:
            count += _hash_file(ckpt, file, plain)
        else:
            deferred += plain
    return count
