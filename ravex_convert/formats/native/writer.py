"""Writing the native Ravex store (spec: docs/format.md, version 1).

:func:`write` appends one checkpoint to a store, creating the store first when
the directory is absent or empty, and :func:`prune` keeps the newest N. Both
hold the store lock (section 2), clean up after a crashed writer and run the
sweep (sections 4, 5), through :mod:`.native_store` on either storage backend.
A checkpoint becomes visible only when the manifest lists it (section 3, step 4:
its rename, or on object storage its conditional put); every failure before that
removes what it wrote and leaves the manifest untouched.

Layout: ``opts.world_size`` ranks, each tensor split on dim 0 as
``torch.chunk`` splits it, rank ``r`` writing ``rank<r>.safetensors`` (or
``rank<r>.zst``). A chunk whose bytes are those of the same chunk in the
newest checkpoint (same name, shape, dtype and region, same xxh3 of the source
bytes) is not written again: its entry is copied and points at the old file.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import re
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _core
from ..._dist import ambient
from ..._dtypes import SAFETENSORS_CODES as ALL_SAFETENSORS_CODES
from ..._dtypes import V1_DTYPES
from ..._engine import flat_range
from ..._layout import SOURCE_KEY, StateLayout
from ..._output import Options, out_dtype
from ..._tagged import encode
from ...errors import NotFoundError, RavexError
from ...model import OBJ, Box, Checkpoint, LogicalTensor, TensorLink, dim0_shards, itemsize, numel
from ...plan import OutFile, WritePlan, run
from ...storage import Lease
from .check import metadata_checksum
from .reader import CHECKPOINT, FORMAT_VERSION, MANIFEST, STORE_MARKER
from .store import (
    CHECKPOINTS,
    Entry,
    Where,
    create,
    locked,
    open_store,
    prepare,
    refuse_links,
    remove_checkpoint,
    remove_store,
    sweep,
    where,
)
from .store import write_manifest as _write_manifest  # by this name: tests make it fail

__all__ = ["SAFETENSORS_CODES", "prune", "write"]

# the dtypes a store (format version 1) holds, with the codes its safetensors data files name them by
SAFETENSORS_CODES = {name: code for name, code in ALL_SAFETENSORS_CODES.items() if name in V1_DTYPES}
MAX_INDEX = 99_999_999
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHECKSUM = re.compile(r"xxh3-64:[0-9a-f]{16}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_IO_HINT = "check free space and permissions at the store"


# ---------------------------------------------------------------- planning a checkpoint


@dataclass
class _Out:
    """One chunk of the new checkpoint."""

    tensor: LogicalTensor
    k: int  # position in the tensor's chunks
    rank: int
    region: Box
    dtype: str
    entry: dict[str, Any] | None = None  # the chunk entry, reused or written
    file: str = ""  # data file name, for a chunk written now
    offset: int = 0  # in the file (the raw temporary file when compressing)

    @property
    def nbytes(self) -> int:
        return self.region.numel * itemsize(self.dtype)


def _split(name: str, shape: tuple[int, ...], world_size: int) -> list[tuple[int, Box]]:
    """(rank, region) per chunk: dim 0 in ``torch.chunk`` sizes (FSDP2's shards,
    :func:`~ravex_convert.model.dim0_shards`); no chunks for no elements, so the
    ranks past the data hold none (deliberately unlike DCP, which records their
    empty box once). 0-d tensors and ``obj/`` tensors (state inside objects, such
    as an RNG state: per process, not sharded) go whole to rank 0, as in the
    spec's worked example (docs/format.md section 16)."""
    if numel(shape) == 0:
        return []
    if not shape or world_size == 1 or name.startswith(OBJ):
        return [(0, Box(tuple(0 for _ in shape), shape))]
    return [(r, box) for r, box in dim0_shards(shape, world_size) if box.numel]


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 1024 or "@" in name or _CONTROL.search(name):
        raise RavexError(
            f"{what} {name!r} cannot be stored: a logical name is 1 to 1024 UTF-8 bytes, without '@' or control characters",
            hint="rename the tensor (e.g. --strip-prefix) before writing a Ravex store",
        )


def _plan(ckpt: Checkpoint, opts: Options) -> list[_Out]:
    for name in ckpt.tensors:
        _check_name(name, "tensor")
    for alias, target in ckpt.aliases.items():
        _check_name(alias, "alias")
        if alias in ckpt.tensors:
            raise RavexError(f"'{alias}' is both a stored tensor and an alias", hint="a logical name is unique across tensors and aliases")
        if target not in ckpt.tensors:
            raise RavexError(f"alias '{alias}' names '{target}', which is not a stored tensor", hint="an alias must point at a tensor the checkpoint stores")
    outs: list[_Out] = []
    for name, t in ckpt.tensors.items():
        dtype = out_dtype(t, opts)
        if dtype not in SAFETENSORS_CODES:
            raise RavexError(f"tensor '{name}' has dtype {dtype}, which a Ravex store (format version 1) cannot hold",
                             hint=f"the store holds {', '.join(SAFETENSORS_CODES)}; leave the tensor out or convert it first")
        if any(not isinstance(s, int) or s < 0 for s in t.shape):
            raise RavexError(f"tensor '{name}' has shape {list(t.shape)}", hint="a shape lists non-negative integers")
        t = t if t.name == name else t.renamed(name)
        if opts.keep_chunks:
            for k, c in enumerate(t.chunks):
                if not isinstance(c.region, Box):
                    raise RavexError(f"tensor '{name}': a chunk kept as it is must be a box", hint="this is a bug in Ravex")
                if c.region.numel:
                    outs.append(_Out(t, k, c.owner or 0, c.region, dtype))
        else:
            outs.extend(_Out(t, k, rank, box, dtype) for k, (rank, box) in enumerate(_split(name, tuple(t.shape), opts.world_size)))
    return outs


def _check_links(value: Any, path: str, known: set[str]) -> None:
    if isinstance(value, TensorLink):
        if value.name not in known:
            raise RavexError(f"{path} refers to tensor '{value.name}', which the checkpoint does not hold",
                             hint="every tensor inside objects must be one of the checkpoint's logical tensors")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_links(v, f"{path}.{k}", known)
    elif isinstance(value, (list, tuple, set)):
        for i, v in enumerate(value):
            _check_links(v, f"{path}[{i}]", known)


def _objects(ckpt: Checkpoint) -> dict[str, Any]:
    known = set(ckpt.tensors) | set(ckpt.aliases)
    out: dict[str, Any] = {}
    for key, value in ckpt.objects.items():
        if not isinstance(key, str):
            raise RavexError(f"objects key {key!r} is not a string", hint="objects are keyed by name (optim.param_groups, lr_scheduler, extra, ...)")
        _check_links(value, f"objects.{key}", known)
        out[key] = encode(value, f"objects.{key}")
    return out


def _source(ckpt: Checkpoint) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version  # here: slow to import, needed only here

    versions = {"ravex": _core.__version__, "python": platform.python_version()}
    with contextlib.suppress(PackageNotFoundError):
        versions["torch"] = version("torch")
    src = dict(ckpt.source)
    if isinstance(src.get("ds_version"), str):
        versions["deepspeed"] = src["ds_version"]
    out: dict[str, Any] = {"format": ckpt.format, "versions": versions, "path": str(ckpt.path), "world_size": ckpt.world_size}
    if ckpt.notes:
        out["notes"] = [str(n) for n in ckpt.notes]
    for k, v in src.items():  # the reader's provenance (variant, tag, ...), where it is a plain value
        if k not in out and (v is None or isinstance(v, (str, int, bool)) or (isinstance(v, float) and math.isfinite(v))):
            out[k] = v
    layout = src.get(SOURCE_KEY)
    if layout is not None and StateLayout.from_json(layout).to_json() == layout:
        # where the source kept its model and optimizer (already JSON): an export to torch_save or DCP puts them back there
        out[SOURCE_KEY] = layout
    return out


# ---------------------------------------------------------------- reusing unchanged chunks


def _cheap_source(o: _Out) -> tuple[Path, int, int] | bytes | memoryview | None:
    """The source bytes of ``o`` when one uncompressed source chunk of the same
    dtype holds them as one contiguous range (file range or inline bytes); else None."""
    shape = tuple(o.tensor.shape)
    want = flat_range(o.region, shape)
    size = itemsize(o.dtype)
    if want is None:
        return None
    for c in o.tensor.chunks:
        if c.dtype != o.dtype or c.compression is not None:
            continue
        have = flat_range(c.region, shape)
        if have is None or not (have[0] <= want[0] and want[0] + want[1] <= have[0] + have[1]):
            continue
        skip = (want[0] - have[0]) * size
        if c.data is not None:
            return c.data[skip:skip + want[1] * size]
        if c.file is not None:
            return c.file, c.offset + skip, want[1] * size
    return None


def _reusable(store: Path, o: _Out, prev: dict[str, Any], compression: str | None) -> dict[str, Any] | None:
    """The previous checkpoint's entry for the same chunk, when its layout matches and its file is intact in size."""
    t = prev.get(o.tensor.name)
    if not isinstance(t, dict) or t.get("dtype") != o.dtype or t.get("shape") != list(o.tensor.shape) or not isinstance(t.get("chunks"), list):
        return None
    region = o.region.to_json()
    for c in t["chunks"]:
        if not isinstance(c, dict) or c.get("region") != region:
            continue
        ok = (c.get("compression") == compression and c.get("nbytes") == o.nbytes and isinstance(c.get("offset"), int)
              and isinstance(c.get("stored_nbytes"), int) and isinstance(c.get("checksum"), str) and _CHECKSUM.fullmatch(c["checksum"]))
        if not ok:
            return None
        try:
            if (store / str(c["file"])).stat().st_size < c["offset"] + c["stored_nbytes"]:
                return None
        except OSError:
            return None
        return dict(c)
    return None


def _reuse(store: Path, outs: list[_Out], prev: Entry | None, compression: str | None) -> None:
    """Point unchanged chunks at the previous checkpoint's bytes (section 5, reuse by content)."""
    if prev is None or prev.doc is None or not isinstance(prev.doc.get("tensors"), dict):
        return
    by_file: dict[Path, list[tuple[_Out, dict[str, Any], int, int]]] = {}
    for o in outs:
        old = _reusable(store, o, prev.doc["tensors"], compression)
        src = _cheap_source(o) if old is not None else None
        if old is None or src is None:
            continue
        if not isinstance(src, tuple):
            if f"xxh3-64:{_core.xxh3_64(src):016x}" == old["checksum"]:
                o.entry = old
        else:
            by_file.setdefault(src[0], []).append((o, old, src[1], src[2]))
    for path, items in by_file.items():
        try:
            sums = _core.checksum_ranges(str(path), [(off, n) for _, _, off, n in items], "xxh3-64")
        except (OSError, ValueError):
            continue  # an unreadable or short source: the copy will report it
        for (o, old, _, _), h in zip(items, sums):
            if f"xxh3-64:{h:016x}" == old["checksum"]:
                o.entry = old


# ---------------------------------------------------------------- data files


def _header(outs: list[_Out]) -> bytes:
    """A safetensors header for the chunks in one file, space-padded to a multiple of 8 (section 12)."""
    header: dict[str, Any] = {}
    pos = 0
    for o in outs:
        header[f"{o.tensor.name}@{o.k}"] = {"dtype": SAFETENSORS_CODES[o.dtype], "shape": list(o.region.sizes), "data_offsets": [pos, pos + o.nbytes]}
        pos += o.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _data_files(outs: list[_Out], compression: str | None, keep_chunks: bool = False) -> list[OutFile]:
    """One data file per rank for every chunk without an entry (section 12), each
    chunk's place set; the seal checksums what was copied (and compresses it:
    one zstd frame per chunk, memory bounded by one chunk) and returns
    ``(offsets, stored sizes, checksums, file size)``."""
    by_rank: dict[int, list[_Out]] = {}
    for o in outs:
        if o.entry is None:
            by_rank.setdefault(o.rank, []).append(o)
    files = []
    for rank, chunks in sorted(by_rank.items()):
        name = f"rank{rank:05d}.safetensors" if compression is None else f"rank{rank:05d}.zst"
        head = _header(chunks) if compression is None else b""
        pos = len(head)
        for o in chunks:
            o.file, o.offset = name, pos
            pos += o.nbytes
        f = OutFile(name, pos, small=[(0, head)] if head else [], scratch=compression is not None, seal=_sealer(name, chunks, compression, pos),
                    rank=rank if keep_chunks else None, hash_ranges=[(o.offset, o.nbytes) for o in chunks])
        f.fills = [(o.tensor, o.offset, o.region, o.dtype) for o in chunks]
        files.append(f)
    return files


def _sealer(name: str, chunks: list[_Out], compression: str | None, size: int) -> Callable[[Path | None, Any, list[int | None]], Any]:
    def seal(path: Path | None, out: Any, hashed: list[int | None]) -> tuple[list[int], list[int], list[str], int]:
        # the copy hashed each chunk as it wrote it; the few it could not (two copy threads
        # met inside the chunk) are hashed from the file
        missing = [i for i, h in enumerate(hashed) if h is None]
        if missing and path is None:  # an upload has no file to read back before it completes
            raise RavexError(f"{name}: {len(missing)} chunk(s) were not hashed while copied, and an upload cannot be read back",
                             hint="rerun with RAVEX_S3_PART_MB set larger; report this to Ravex")
        if missing:
            assert path is not None
            for i, h in zip(missing, _core.checksum_ranges(str(path), [(chunks[i].offset, chunks[i].nbytes) for i in missing], "xxh3-64")):
                hashed[i] = h
        sums = [f"xxh3-64:{h:016x}" for h in hashed]
        if compression is None:
            return [o.offset for o in chunks], [o.nbytes for o in chunks], sums, size if path is None else path.stat().st_size
        sink = out.sink(name, 0)
        offsets, lengths = [], []
        try:
            pos = 0
            for o in chunks:
                frame = _core.compress_range(str(path), o.offset, o.nbytes)
                sink.pwrite(frame, pos)
                offsets.append(pos)
                lengths.append(len(frame))
                pos += len(frame)
            sink.close()
        except BaseException:
            sink.abort()
            raise
        return offsets, lengths, sums, pos

    return seal


# ---------------------------------------------------------------- write and prune


def _listed_any(store: Path) -> bool:
    try:
        return bool(json.loads((store / MANIFEST).read_text())["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _listed(store: Path, index: int) -> bool:
    """Whether the manifest on disk lists ``index`` (a failure after the commit rename must keep it)."""
    try:
        return any(e.get("index") == index for e in json.loads((store / MANIFEST).read_text())["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def write(ckpt: Checkpoint, store: Path | str | Where, opts: Options, *, run_id: str | None = None,
          progress: Callable[[int], None] | None = None, fence: Lease | None = None) -> dict[str, Any]:
    """Append ``ckpt`` to the store at ``store`` as a new checkpoint (creating the
    store in an absent or empty directory) and commit it.

    Under ``torchrun`` (``convert`` spreads the call over the group) rank 0 holds
    the lock, opens the store and decides the index and which chunks are reused;
    each rank writes its share of the data files; rank 0 writes checkpoint.json
    and the manifest once every rank's files are durable.

    Returns ``index``, ``dir``, ``step``, ``tensors``, ``bytes`` (logical size),
    ``bytes_written`` (data files written now), ``bytes_reused`` (chunk bytes
    pointing at earlier checkpoints), ``files``, ``run_id`` and ``warnings``.
    Raises :class:`RavexError` subclasses; a failure leaves the store as it was.
    ``fence``: the run's lease of an object store (``storage.lease``): the manifest records its
    generation, and once another run took it over nothing is committed
    (:class:`~ravex_convert.storage.StoreTakenOverError`).
    """
    w = where(store)
    group = ambient()
    if run_id is None:
        run_id = group.broadcast(uuid.uuid4().hex[:12] if group.rank == 0 else None)
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise RavexError(f"run id {run_id!r} is not 1 to 64 letters, digits, '_' or '-'", hint="leave it out to get a fresh one")
    if not isinstance(opts.world_size, int) or opts.world_size < 1:
        raise RavexError(f"--world-size {opts.world_size}: not a positive integer", hint="use 1 or more")
    if opts.compression not in (None, "zstd"):
        raise RavexError(f"--compression {opts.compression}: a Ravex store holds uncompressed or zstd chunks", hint="use none or zstd")
    outs = _plan(ckpt, opts)
    objects = _objects(ckpt)
    source = _source(ckpt)
    fresh = False
    with contextlib.ExitStack() as held:
        decided: Any = None
        refused: BaseException | None = None
        if group.rank == 0:
            fresh = not w.exists()
            try:
                decided = _begin(w, run_id, outs, opts, held, fence)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
                if fresh and not _listed_any(w.path):
                    remove_store(w)
                refused = RavexError(f"{w.label}: writing the store failed: {exc}", hint=_IO_HINT, path=w.path) \
                    if isinstance(exc, OSError) else exc
                if group.size == 1:
                    raise refused from (exc if refused is not exc else None)
                decided = (refused.message, refused.hint) if isinstance(refused, RavexError) else (f"{w.label}: {refused}", _IO_HINT)
        decided = group.broadcast(decided)
        if refused is not None:
            raise refused  # rank 0 in its own words; the others below
        if isinstance(decided, tuple):
            raise RavexError(f"rank 0 could not open the store: {decided[0]}", hint=decided[1])
        index, reused_entries, warnings, manifest = decided["index"], decided["entries"], decided["warnings"], decided["manifest"]
        for o, e in zip(outs, reused_entries, strict=True):
            o.entry = e
        try:
            return _commit(ckpt, w, opts, run_id, outs, objects, source, progress, index, (manifest, decided["generation"]), warnings,
                           fence)
        except BaseException:
            if group.rank == 0 and fresh and not _listed_any(w.path):
                # A store made by this call for a checkpoint that failed: leave nothing behind.
                remove_store(w)
            raise


def _begin(w: Where, run_id: str, outs: list[_Out], opts: Options, held: contextlib.ExitStack, fence: Lease | None) -> dict[str, Any]:
    """The coordinator's part before any data: the store made or checked, the lock
    taken (held until ``held`` closes), the crash cleanup and sweep, the new index,
    and the chunks reused from the newest loadable checkpoint."""
    prepare(w)
    held.enter_context(locked(w, run_id))
    if not (w.path / STORE_MARKER).is_file():
        create(w, run_id)
    manifest, generation, entries, highest, warnings = open_store(w, fence)
    index = max(int(manifest["next_index"]), highest + 1)
    if index > MAX_INDEX:
        raise RavexError(f"{w.label}: the store has used every checkpoint index (up to {MAX_INDEX})", hint="start a new store", path=w.path)
    loadable = [e for e in entries if e.problem is None]
    _reuse(w.path, outs, loadable[-1] if loadable else None, opts.compression)
    return {"index": index, "entries": [o.entry for o in outs], "warnings": warnings, "manifest": manifest, "generation": generation}


def _commit(ckpt: Checkpoint, w: Where, opts: Options, run_id: str, outs: list[_Out], objects: dict[str, Any],
            source: dict[str, Any], progress: Callable[[int], None] | None, index: int, read: tuple[dict[str, Any], int],
            warnings: list[str], fence: Lease | None = None) -> dict[str, Any]:
    """Section 3: the data files by every rank, checkpoint.json, the directory renamed (object
    storage: built in place under its final name), then the manifest, conditional on the
    generation ``read`` with it."""
    manifest, generation = read
    rel_dir = f"{CHECKPOINTS}/{index:08d}"
    reused = [o for o in outs if o.entry is not None]
    files = _data_files(outs, opts.compression, opts.keep_chunks)
    names = [f.rel for f in files]
    now = time.time()
    step = ckpt.step if isinstance(ckpt.step, int) and not isinstance(ckpt.step, bool) else None
    tensors: dict[str, Any] = {name: {"dtype": out_dtype(t, opts), "shape": list(t.shape), "chunks": []} for name, t in ckpt.tensors.items()}
    logical = sum(numel(tuple(t["shape"])) * itemsize(t["dtype"]) for t in tensors.values())
    meta = b""

    by_file: dict[str, list[_Out]] = {}
    for o in outs:
        if o.entry is None:
            by_file.setdefault(o.file, []).append(o)

    def commit(sealed: dict[str, Any]) -> list[tuple[str, bytes]]:
        nonlocal meta
        for f in files:
            offsets, stored, sums, _ = sealed[f.rel]
            for o, off, n, h in zip(by_file[f.rel], offsets, stored, sums, strict=True):
                o.entry = {"file": f"{rel_dir}/{o.file}", "offset": off, "nbytes": o.nbytes, "stored_nbytes": n,
                           "compression": opts.compression, "region": o.region.to_json(), "checksum": h}
        for o in outs:
            tensors[o.tensor.name]["chunks"].append(o.entry)
        doc = {
            "format": "ravex-checkpoint", "format_version": FORMAT_VERSION, "index": index, "step": step, "run_id": run_id,
            "created_unix": now, "world_size": opts.world_size, "source": source, "tensors": tensors,
            "aliases": dict(ckpt.aliases), "objects": objects,
        }
        kinds = {name: t.kind for name, t in ckpt.tensors.items() if t.kind is not None}
        if kinds:
            doc["kinds"] = kinds  # what each model tensor is, where the source said (section 9)
        meta = (json.dumps(doc, indent=None, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")
        return [(CHECKPOINT, meta)]

    def after(sealed: dict[str, Any]) -> None:
        """Section 3, step 4: the manifest lists the new checkpoint (its rename, or on object
        storage its conditional put, is the commit point)."""
        entry = {"index": index, "dir": rel_dir, "step": step, "status": "complete", "created_unix": now, "run_id": run_id,
                 "world_size": opts.world_size, "bytes": logical, "tensors": len(tensors), "metadata_checksum": metadata_checksum(meta)}
        try:
            _write_manifest(w, {**manifest, "next_index": index + 1, "checkpoints": [*manifest["checkpoints"], entry]}, run_id, generation,
                            fence)
        except BaseException:
            if not _listed(w.path, index):
                remove_checkpoint(w, rel_dir)
                if w.posix:
                    with contextlib.suppress(OSError):
                        (w.path / f"{MANIFEST}.tmp-{run_id}").unlink()
            elif not w.posix:
                # The put landed and then something failed: the checkpoint is committed (the
                # manifest lists it), and its objects stay.
                return
            raise

    plan = WritePlan(True, files, commit, threads=opts.threads, staging=f"{index:08d}.tmp-{run_id}", after=after)
    done = run(plan, w.child(rel_dir), force=False, progress=progress)
    bytes_written = sum(r[3] for r in done["sealed"].values())
    return {
        "index": index, "dir": w.shown(rel_dir), "step": step, "tensors": len(tensors), "aliases": len(ckpt.aliases), "bytes": logical,
        "bytes_written": bytes_written, "bytes_reused": sum(o.nbytes for o in reused), "chunks_written": len(outs) - len(reused),
        "chunks_reused": len(reused), "files": [f"{rel_dir}/{n}" for n in names], "run_id": run_id, "warnings": warnings,
    }


def prune(store: Path | str | Where, keep_last: int, *, pinned: set[int] | frozenset[int] = frozenset(),
          fence: Lease | None = None) -> list[int]:
    """Keep the ``keep_last`` newest loadable checkpoints, every pinned one and
    every one that is not loadable; drop the rest from the manifest, then sweep
    their files (section 5). Returns the indices dropped, in order. ``fence``: as for :func:`write`."""
    w = where(store)
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise RavexError(f"keep_last {keep_last!r}: keep at least one checkpoint", hint="use keep_last >= 1")
    if not (w.path / STORE_MARKER).is_file():
        raise NotFoundError(f"{w.label}: not a Ravex store (no {STORE_MARKER})", hint="point at the store directory", path=w.path)
    if w.posix or w.path.is_dir():
        refuse_links(w.path)
    run_id = uuid.uuid4().hex[:12]
    try:
        with locked(w, run_id):
            manifest, generation, entries, _, _ = open_store(w, fence)
            loadable = [e.index for e in entries if e.problem is None]
            keep = set(loadable[-keep_last:]) | set(pinned) | {e.index for e in entries if e.problem is not None}
            dropped = [e.index for e in entries if e.index not in keep]
            if dropped:
                kept = [e for e in entries if e.index in keep]
                _write_manifest(w, {**manifest, "checkpoints": [e.entry for e in kept]}, run_id, generation, fence)
                sweep(w, kept)
            return dropped
    except OSError as exc:
        raise RavexError(f"{w.label}: pruning the store failed: {exc}", hint=_IO_HINT, path=w.path) from exc
