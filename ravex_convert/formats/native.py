"""The native Ravex store (spec: docs/format.md, version 1).

This module holds what detection and inspection need: recognising a store or
one of its checkpoints, reading the manifest, resolving ``-1`` to the newest
complete checkpoint, and summarising a checkpoint's metadata.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._tagged import decode
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError
from ..info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ..model import Box, Checkpoint, Chunk, Flat, LogicalTensor, Region

__all__ = ["CHECKPOINT", "FORMAT_VERSION", "MANIFEST", "STORE_MARKER", "describe", "read", "read_manifest", "resolve", "sniff", "verify_chunks"]

STORE_MARKER = "ravex-store.json"
MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.json"
FORMAT_VERSION = 1


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
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing", hint="the store is incomplete; copy the whole store directory", path=path) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})", hint="the file is damaged; restore it from a copy of the store", path=path) from None
    if not isinstance(doc, dict) or doc.get("format") != expected_format:
        raise CorruptCheckpointError(f"{path}: not a {expected_format} document (its 'format' field is {doc.get('format') if isinstance(doc, dict) else None!r})", path=path)
    version = doc.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{path}: format_version is missing or invalid ({version!r})", path=path)
    if version > FORMAT_VERSION:
        raise RavexError(
            f"{path}: written in Ravex store format version {version}; this Ravex reads up to version {FORMAT_VERSION}",
            hint="upgrade Ravex (pip install -U ravex) to read this store",
            path=path,
        )
    return doc


def read_manifest(store: Path) -> dict[str, Any]:
    _load_json(store / STORE_MARKER, "ravex-store")
    manifest = _load_json(store / MANIFEST, "ravex-store")
    if not isinstance(manifest.get("checkpoints"), list):
        raise CorruptCheckpointError(f"{store / MANIFEST}: has no 'checkpoints' list", path=store / MANIFEST)
    return manifest


def resolve(store: Path, index: int = -1) -> tuple[dict[str, Any], Path]:
    """The manifest entry and directory of checkpoint ``index`` (negative: from the newest complete one)."""
    manifest = read_manifest(store)
    complete = [e for e in manifest["checkpoints"] if e.get("status") == "complete" and (store / str(e.get("dir", "")) / CHECKPOINT).is_file()]
    if not complete:
        raise IncompleteCheckpointError(
            f"{store}: the store holds no complete checkpoint",
            hint="a run that was killed before its first checkpoint committed leaves an empty store; start the run again",
            path=store,
        )
    if index < 0:
        if -index > len(complete):
            raise RavexError(f"{store}: index {index} asked for, but the store holds {len(complete)} complete checkpoint(s)", hint="use -1 for the newest", path=store)
        entry = complete[index]
    else:
        found = [e for e in complete if e.get("index") == index]
        if not found:
            have = ", ".join(str(e.get("index")) for e in complete)
            raise RavexError(f"{store}: no complete checkpoint with index {index} (complete ones: {have})", hint="run `ravex status` on the store to list them", path=store)
        entry = found[0]
    return entry, store / str(entry["dir"])


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


def describe(path: Path, reasons: list[str], index: int = -1) -> CheckpointInfo:
    if path.is_file():
        path = path.parent
    if (path / STORE_MARKER).is_file():
        store = path
        manifest = read_manifest(store)
        entry, ckpt_dir = resolve(store, index)
        variant = "store"
    else:
        ckpt_dir, manifest, entry = path, None, None
        variant = "checkpoint"
        store = path.parent.parent
        if path.parent.name == "checkpoints" and (store / STORE_MARKER).is_file():
            listed = [e for e in read_manifest(store)["checkpoints"] if e.get("dir") == f"checkpoints/{path.name}"]
            if not listed:
                raise IncompleteCheckpointError(
                    f"{path}: not listed in {store / MANIFEST}, so it is not a committed checkpoint",
                    hint="open the store directory to get the newest complete checkpoint",
                    path=path,
                )
    doc = _load_json(ckpt_dir / CHECKPOINT, "ravex-checkpoint")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise CorruptCheckpointError(f"{ckpt_dir / CHECKPOINT}: has no 'tensors' object", path=ckpt_dir / CHECKPOINT)
    info = CheckpointInfo("native", variant, str(path), world_size=doc.get("world_size"), step=doc.get("step"), reasons=reasons)
    files: dict[str, int] = {}
    state_names: list[str] = []
    for name, t in tensors.items():
        kind = _kind(name)
        display = _display(name)
        info.tensors.append(TensorInfo(display, tuple(t.get("shape", ())), str(t.get("dtype")), kind))
        if kind == "optim":
            sname = name.split("/")[1]
            if sname not in state_names:
                state_names.append(sname)
        for c in t.get("chunks", []):
            files.setdefault(str(c.get("file")), 0)
    own = f"checkpoints/{doc.get('index', -1):08d}/" if isinstance(doc.get("index"), int) else f"checkpoints/{ckpt_dir.name}/"
    for rel in sorted(files):
        p = store / rel
        if variant == "checkpoint" and not (store / STORE_MARKER).is_file():
            # A checkpoint copied out of its store: its own files sit beside it.
            if not rel.startswith(own):
                raise IncompleteCheckpointError(
                    f"{ckpt_dir / CHECKPOINT}: chunk file '{rel}' lives in another checkpoint of the store this was copied from",
                    hint="open the whole store, or convert the checkpoint into a self-contained one",
                    path=ckpt_dir,
                )
            p = ckpt_dir / rel[len(own):]
        if not p.is_file():
            raise IncompleteCheckpointError(f"{ckpt_dir / CHECKPOINT}: chunk file '{rel}' is missing", hint="copy the whole store directory; checkpoints can share data files", path=p)
        info.files.append(FileInfo(rel, p.stat().st_size, "data"))
    info.files.insert(0, FileInfo(str((ckpt_dir / CHECKPOINT).relative_to(store)) if variant == "store" else CHECKPOINT, (ckpt_dir / CHECKPOINT).stat().st_size, "metadata"))
    info.aliases = {_display(k): _display(str(v)) for k, v in (doc.get("aliases") or {}).items()}
    if state_names:
        groups = (doc.get("objects") or {}).get("optim.param_groups")
        info.optimizer = OptimizerInfo("Adam" if {"exp_avg", "exp_avg_sq"} <= set(state_names) else "unknown", state_names, len(groups) if isinstance(groups, list) else None)
    if manifest is not None and entry is not None:
        info.extra["index"] = entry.get("index")
        info.extra["checkpoints"] = [
            {k: e.get(k) for k in ("index", "step", "status", "created_unix", "bytes")} for e in manifest["checkpoints"]
        ]
    return info


def _region(raw: Any, where: str) -> Region:
    if isinstance(raw, dict) and set(raw) == {"box"}:
        b = raw["box"]
        return Box(tuple(int(o) for o in b["offsets"]), tuple(int(s) for s in b["sizes"]))
    if isinstance(raw, dict) and set(raw) == {"flat"}:
        f = raw["flat"]
        return Flat(int(f["start"]), int(f["length"]))
    raise CorruptCheckpointError(f"{where}: a chunk's region is neither a box nor a flat range", path=where)


def read(path: Path, index: int = -1) -> Checkpoint:
    """Describe one checkpoint of a store (``index``; -1 = newest complete)."""
    info = describe(path, [], index=index)  # validates the manifest and that every chunk file exists
    p = path.parent if path.is_file() else path
    if (p / STORE_MARKER).is_file():
        store = p
        _, ckpt_dir = resolve(store, index)
    else:
        ckpt_dir, store = p, p.parent.parent
    doc = _load_json(ckpt_dir / CHECKPOINT, "ravex-checkpoint")
    where = str(ckpt_dir / CHECKPOINT)
    own = f"checkpoints/{doc['index']:08d}/" if isinstance(doc.get("index"), int) else None
    copied_out = not (store / STORE_MARKER).is_file()
    ckpt = Checkpoint("native", p, world_size=int(doc.get("world_size") or 1), step=doc.get("step"))
    ckpt.source = dict(doc.get("source") or {})
    ckpt.source["index"] = doc.get("index")
    try:
        for name, entry in doc["tensors"].items():
            t = ckpt.add(LogicalTensor(name, tuple(int(s) for s in entry["shape"]), str(entry["dtype"])))
            for c in entry["chunks"]:
                rel = str(c["file"])
                file = ckpt_dir / rel[len(own):] if copied_out and own and rel.startswith(own) else store / rel
                compression = c.get("compression")
                if compression not in (None, "zstd"):
                    raise RavexError(f"{where}: chunk of '{name}' uses compression {compression!r}, unknown to this Ravex", hint="upgrade Ravex", path=where)
                t.chunks.append(Chunk(_region(c["region"], where), t.dtype, file, int(c["offset"]), compression=compression,
                                      stored_nbytes=int(c["stored_nbytes"]), checksum=str(c["checksum"])))
        ckpt.aliases = {str(k): str(v) for k, v in (doc.get("aliases") or {}).items()}
        ckpt.objects = {k: decode(v, f"{where}: objects.{k}") for k, v in (doc.get("objects") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed checkpoint metadata ({type(exc).__name__}: {exc})", path=where) from None
    ckpt.notes.extend(info.notes)
    return ckpt


_CHECKSUM = re.compile(r"xxh3-64:[0-9a-f]{16}")


def verify_chunks(ckpt: Checkpoint, names: Iterable[str] | None = None) -> int:
    """Check the xxh3-64 checksum of every chunk of ``names`` (default: every
    tensor; aliases follow their target) over all its uncompressed bytes
    (docs/format.md sections 12 and 17.6). ``ckpt`` comes from :func:`read`.

    Raises :class:`CorruptCheckpointError` naming the tensor, the chunk's
    position, the file, the checkpoint index and the store on the first
    mismatch, truncation or undecodable frame, and
    :class:`IncompleteCheckpointError` for a missing file. Returns the number
    of chunks verified."""
    from .. import _core

    store, index = ckpt.path, ckpt.source.get("index")
    wanted = list(ckpt.tensors) if names is None else [ckpt.aliases.get(n, n) for n in names]
    by_file: dict[Path, list[tuple[str, int, Chunk]]] = {}
    count = 0

    def bad(name: str, k: int, c: Chunk, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{store}: checkpoint {index}: chunk {k} of tensor '{name}' in {c.file}: {why}",
            hint="the data file is damaged; restore the store from a copy, or load another checkpoint (--index)",
            path=c.file,
        )

    for name in dict.fromkeys(wanted):
        t = ckpt.tensors[name]
        for k, c in enumerate(t.chunks):
            if c.checksum is None or not _CHECKSUM.fullmatch(c.checksum):
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
                data = _core.decompress_frame(str(file), c.offset, stored, c.nbytes)
            except ValueError as exc:
                raise bad(name, k, c, f"its zstd frame does not decode to {c.nbytes} bytes ({exc})") from None
            if f"xxh3-64:{_core.xxh3_64(data):016x}" != c.checksum:
                raise bad(name, k, c, f"checksum mismatch (recorded {c.checksum}, computed xxh3-64:{_core.xxh3_64(data):016x})")
            count += 1
        sums = _core.checksum_ranges(str(file), [(c.offset, c.nbytes) for _, _, c in plain], "xxh3-64") if plain else []
        for (name, k, c), h in zip(plain, sums):
            if f"xxh3-64:{h:016x}" != c.checksum:
                raise bad(name, k, c, f"checksum mismatch (recorded {c.checksum}, computed xxh3-64:{h:016x})")
            count += 1
    return count
