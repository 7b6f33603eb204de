"""Writing the native Ravex store (spec: docs/format.md, version 1).

:func:`write` appends one checkpoint to a store, creating the store first when
the directory is absent or empty, and :func:`prune` keeps the newest N. Both
hold the store lock (section 2), clean up after a crashed writer and run the
sweep (sections 4, 5). A checkpoint becomes visible only when the manifest is
renamed into place (section 3, step 4); every failure before that removes what
it wrote and leaves the manifest untouched.

Layout: ``opts.world_size`` ranks, each tensor split on dim 0 as
``torch.chunk`` splits it, rank ``r`` writing ``rank<r>.safetensors`` (or
``rank<r>.zst``). A chunk whose bytes are those of the same chunk in the
newest checkpoint (same name, shape, dtype and region, same xxh3 of the source
bytes) is not written again: its entry is copied and points at the old file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import platform
import re
import shutil
import socket
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _core
from .._dist import ambient
from .._dtypes import SAFETENSORS_CODES as ALL_SAFETENSORS_CODES
from .._dtypes import V1_DTYPES
from .._engine import flat_range
from .._layout import SOURCE_KEY, StateLayout
from .._output import Options, fsync_dir, fsync_fd, out_dtype
from .._tagged import encode
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, NotFoundError, RavexError, UnsafeCheckpointError
from ..model import OBJ, Box, Checkpoint, LogicalTensor, TensorLink, dim0_shards, itemsize, numel
from ..plan import OutFile, WritePlan, run
from ..storage import is_objdir
from ..storage.local import holder_of
from . import native
from .native import CHECKPOINT, FORMAT_VERSION, MANIFEST, STORE_MARKER, read_manifest
from .native_check import check_manifest, metadata_checksum

__all__ = ["SAFETENSORS_CODES", "prune", "write"]

# the dtypes a store (format version 1) holds, with the codes its safetensors data files name them by
SAFETENSORS_CODES = {name: code for name, code in ALL_SAFETENSORS_CODES.items() if name in V1_DTYPES}
MAX_INDEX = 99_999_999
CHECKPOINTS = "checkpoints"
LOCK = "lock"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NUMBERED = re.compile(r"(\d{8})")
_ANY_INDEX = re.compile(r"(\d{8})(?:\.tmp-.*)?")
_CHECKSUM = re.compile(r"xxh3-64:[0-9a-f]{16}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_IO_HINT = "check free space and permissions at the store"
_LINK_HINT = ("a store's own files and directories are never links; replace the link by what it points to, or write to another "
              "store. If others can write to this directory, check what else they changed")


# ---------------------------------------------------------------- the lock


@contextlib.contextmanager
def _locked(store: Path, run_id: str) -> Iterator[None]:
    """Hold ``<store>/lock`` (exclusive, non-blocking flock) for the block.
    The lock is opened without following a symbolic link (O_NOFOLLOW) and must
    be a regular file: its contents are truncated and rewritten."""
    path = store / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unsafe(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeCheckpointError(f"{path}: is not a regular file, so it cannot be the store's lock",
                                        hint=_LINK_HINT, path=path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RavexError(
                f"{store}: another process is writing to this store ({holder_of(fd)}); Ravex does not wait for it",
                hint="only one process may write to a store at a time: wait for that run to finish or stop it, or write to another store",
                path=store,
            ) from None
        note = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "since_unix": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(note).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file itself is never deleted


# ---------------------------------------------------------------- small files


def _write_json(path: Path, doc: dict[str, Any], tmp: Path, indent: int | None = None) -> bytes:
    """``tmp`` written and fsynced, then renamed to ``path`` (the caller fsyncs
    the directory); returns the bytes written. ``tmp`` is never opened through a
    symbolic link, and the rename replaces ``path`` itself, never what a link there names."""
    data = (json.dumps(doc, indent=indent, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")
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


def _refuse_links(store: Path) -> None:
    """A store whose own entries (lock, manifest, marker, checkpoints/ and the
    checkpoint directories in it) are symbolic links is refused: writing,
    cleaning up or sweeping through one would change files outside the store."""
    for name in (LOCK, MANIFEST, STORE_MARKER, CHECKPOINTS):
        if (store / name).is_symlink():
            raise _unsafe(store / name)
    root = store / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if _ANY_INDEX.fullmatch(p.name) and p.is_symlink():
                raise _unsafe(p)


def _write_manifest(store: Path, manifest: dict[str, Any], run_id: str) -> None:
    """Section 3, step 4: the rename is the commit point."""
    _write_json(store / MANIFEST, manifest, store / f"{MANIFEST}.tmp-{run_id}", indent=1)
    fsync_dir(store)


def _empty_manifest(p: Path) -> bool:
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
        return p.is_file() and _empty_manifest(p)
    return p.name.startswith((f"{MANIFEST}.tmp-", f"{STORE_MARKER}.tmp-")) and p.is_file()


def _prepare_dir(store: Path) -> None:
    if store.exists() and not store.is_dir():
        raise RavexError(f"{store}: exists and is not a directory, so it cannot be a Ravex store", hint="choose another destination", path=store)
    if store.is_dir():
        _refuse_links(store)
    if store.is_dir() and not (store / STORE_MARKER).exists():
        held = [n for n in (MANIFEST, CHECKPOINTS) if (store / n).exists() and not _creation_leftover(store / n)]
        if held:
            # A store that lost its marker is still a store: starting a fresh one here would discard its checkpoints.
            raise IncompleteCheckpointError(
                f"{store}: has {' and '.join(held)} but no {STORE_MARKER}: a Ravex store that lost its marker file "
                "(or a damaged one); Ravex will not start a new store over its checkpoints",
                hint=f"restore {STORE_MARKER} from a copy of the store (then the store can be written again), or write to another directory",
                path=store,
            )
        other = sorted(p.name for p in store.iterdir() if not _creation_leftover(p))
        if other:
            shown = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
            raise RavexError(
                f"{store}: exists and is not a Ravex store (no {STORE_MARKER}; it holds {shown})",
                hint="write to a new or empty directory, or to an existing store (a directory with ravex-store.json)",
                path=store,
            )
    store.mkdir(parents=True, exist_ok=True)
    (store / CHECKPOINTS).mkdir(exist_ok=True)
    _refuse_links(store)


def _create(store: Path, run_id: str) -> None:
    """Section 2: the manifest first, the marker last, so a half-made store never looks like one."""
    for leftover in store.glob("*.tmp-*"):
        leftover.unlink()
    manifest = {"format": "ravex-store", "format_version": FORMAT_VERSION, "next_index": 0, "checkpoints": []}
    _write_json(store / MANIFEST, manifest, store / f"{MANIFEST}.tmp-{run_id}", indent=1)
    marker = {"format": "ravex-store", "format_version": FORMAT_VERSION, "created_unix": time.time(), "store_id": uuid.uuid4().hex}
    _write_json(store / STORE_MARKER, marker, store / f"{STORE_MARKER}.tmp-{run_id}", indent=1)
    fsync_dir(store)


# ---------------------------------------------------------------- the manifest and its entries


@dataclass
class _Entry:
    entry: dict[str, Any]
    doc: dict[str, Any] | None = None
    refs: frozenset[str] = frozenset()
    problem: str | None = None  # why it is not loadable (section 6)

    @property
    def index(self) -> int:
        return int(self.entry["index"])


def _entries(store: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return check_manifest(manifest, store / MANIFEST)


def _load_entry(store: Path, manifest: dict[str, Any], entry: dict[str, Any]) -> _Entry:
    """An entry and its checkpoint.json, checked as a reader checks it (its
    metadata checksum, section 17, chunk files inside the store and present);
    ``problem`` says why it is not loadable. A checkpoint.json of a newer
    format version raises: its references are unknown."""
    out = _Entry(entry)
    if entry.get("status") != "complete":
        out.problem = f"its status is {entry.get('status')!r}"
        return out
    try:
        opened = native._open_entry(store, manifest, entry, "store")
    except (CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError) as exc:
        out.problem = exc.message
        return out
    out.doc = opened.doc
    out.refs = frozenset({f"{entry['dir']}/{CHECKPOINT}", *opened.checked.files})
    return out


def _highest_dir_index(store: Path) -> int:
    found = [int(m.group(1)) for p in (store / CHECKPOINTS).iterdir() if (m := _ANY_INDEX.fullmatch(p.name))]
    return max(found, default=-1)


def _remove(p: Path) -> None:
    """Delete ``p``: a directory with all it holds, anything else (a symbolic link
    included) as an entry. Never through a link: ``rmtree`` does not follow them."""
    if stat.S_ISDIR(os.lstat(p).st_mode):
        shutil.rmtree(p)
    else:
        p.unlink()


def _cleanup(store: Path) -> None:
    """Section 4: under the lock, whatever a crashed writer left is garbage."""
    for p in (store / CHECKPOINTS).glob("*.tmp-*"):
        _remove(p)
    for p in store.glob(f"{MANIFEST}.tmp-*"):
        _remove(p)


def _sweep(store: Path, entries: list[_Entry]) -> list[str]:
    """Section 5: delete unlisted numbered directories, keeping files a listed
    checkpoint references. Returns warnings."""
    broken = [e for e in entries if e.problem is not None]
    if broken:
        return [f"{store}: checkpoint {e.index} is not loadable ({e.problem}); the sweep deleted nothing" for e in broken]
    warnings: list[str] = []
    refs = frozenset().union(*(e.refs for e in entries))
    listed = {str(e.entry["dir"]).rsplit("/", 1)[-1] for e in entries}
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


def _open(store: Path, run_id: str) -> tuple[dict[str, Any], list[_Entry], int, list[str]]:
    """Under the lock: the manifest, its entries, the highest index any directory
    name holds, and the sweep's warnings (after the crash cleanup)."""
    _refuse_links(store)
    manifest = read_manifest(store)
    raw = _entries(store, manifest)
    highest = _highest_dir_index(store)
    _cleanup(store)
    entries = [_load_entry(store, manifest, e) for e in raw]
    return manifest, entries, highest, _sweep(store, entries)


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


def _reuse(store: Path, outs: list[_Out], prev: _Entry | None, compression: str | None) -> None:
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
        f = OutFile(name, pos, small=[(0, head)] if head else [], scratch=compression is not None, seal=_sealer(name, chunks, compression),
                    rank=rank if keep_chunks else None)
        f.fills = [(o.tensor, o.offset, o.region, o.dtype) for o in chunks]
        files.append(f)
    return files


def _sealer(name: str, chunks: list[_Out], compression: str | None) -> Callable[[Path, Any], Any]:
    def seal(path: Path, out: Any) -> tuple[list[int], list[int], list[str], int]:
        sums = [f"xxh3-64:{h:016x}" for h in _core.checksum_ranges(str(path), [(o.offset, o.nbytes) for o in chunks], "xxh3-64")]
        if compression is None:
            return [o.offset for o in chunks], [o.nbytes for o in chunks], sums, path.stat().st_size
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


def write(ckpt: Checkpoint, store: Path, opts: Options, *, run_id: str | None = None,
          progress: Callable[[int], None] | None = None) -> dict[str, Any]:
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
    """
    if is_objdir(store):
        raise RavexError(f"{store}: a Ravex store cannot live on object storage yet: its lock, manifest and sweep still use flock "
                         "and rename (its checkpoint data already goes through the storage layer)",
                         hint="write the store to a local or shared filesystem; convert it to dcp or safetensors for a bucket")
    store = Path(store)
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
            fresh = not store.exists()
            try:
                decided = _begin(store, run_id, outs, opts, held)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
                if fresh and not _listed_any(store):
                    shutil.rmtree(store, ignore_errors=True)
                refused = RavexError(f"{store}: writing the store failed: {exc}", hint=_IO_HINT, path=store) if isinstance(exc, OSError) else exc
                if group.size == 1:
                    raise refused from (exc if refused is not exc else None)
                decided = (refused.message, refused.hint) if isinstance(refused, RavexError) else (f"{store}: {refused}", _IO_HINT)
        decided = group.broadcast(decided)
        if refused is not None:
            raise refused  # rank 0 in its own words; the others below
        if isinstance(decided, tuple):
            raise RavexError(f"rank 0 could not open the store: {decided[0]}", hint=decided[1])
        index, reused_entries, warnings, manifest = decided["index"], decided["entries"], decided["warnings"], decided["manifest"]
        for o, e in zip(outs, reused_entries, strict=True):
            o.entry = e
        try:
            return _commit(ckpt, store, opts, run_id, outs, objects, source, progress, index, manifest, warnings)
        except BaseException:
            if group.rank == 0 and fresh and not _listed_any(store):
                # A store made by this call for a checkpoint that failed: leave nothing behind.
                shutil.rmtree(store, ignore_errors=True)
            raise


def _begin(store: Path, run_id: str, outs: list[_Out], opts: Options, held: contextlib.ExitStack) -> dict[str, Any]:
    """The coordinator's part before any data: the store made or checked, the lock
    taken (held until ``held`` closes), the crash cleanup and sweep, the new index,
    and the chunks reused from the newest loadable checkpoint."""
    fresh = not store.exists()
    _prepare_dir(store)
    if fresh:
        fsync_dir(store.parent)
    held.enter_context(_locked(store, run_id))
    if not (store / STORE_MARKER).is_file():
        _create(store, run_id)
    manifest, entries, highest, warnings = _open(store, run_id)
    index = max(int(manifest["next_index"]), highest + 1)
    if index > MAX_INDEX:
        raise RavexError(f"{store}: the store has used every checkpoint index (up to {MAX_INDEX})", hint="start a new store", path=store)
    loadable = [e for e in entries if e.problem is None]
    _reuse(store, outs, loadable[-1] if loadable else None, opts.compression)
    return {"index": index, "entries": [o.entry for o in outs], "warnings": warnings, "manifest": manifest}


def _commit(ckpt: Checkpoint, store: Path, opts: Options, run_id: str, outs: list[_Out], objects: dict[str, Any],
            source: dict[str, Any], progress: Callable[[int], None] | None, index: int, manifest: dict[str, Any],
            warnings: list[str]) -> dict[str, Any]:
    """Section 3: the data files by every rank, checkpoint.json, the directory renamed, then the manifest."""
    rel_dir = f"{CHECKPOINTS}/{index:08d}"
    final = store / rel_dir
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
        """Section 3, step 4: the manifest lists the new checkpoint (its rename is the commit point)."""
        entry = {"index": index, "dir": rel_dir, "step": step, "status": "complete", "created_unix": now, "run_id": run_id,
                 "world_size": opts.world_size, "bytes": logical, "tensors": len(tensors), "metadata_checksum": metadata_checksum(meta)}
        try:
            _write_manifest(store, {**manifest, "next_index": index + 1, "checkpoints": [*manifest["checkpoints"], entry]}, run_id)
        except BaseException:
            if not _listed(store, index):
                shutil.rmtree(final, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (store / f"{MANIFEST}.tmp-{run_id}").unlink()
            raise

    plan = WritePlan(True, files, commit, threads=opts.threads, staging=f"{index:08d}.tmp-{run_id}", after=after)
    done = run(plan, final, force=False, progress=progress)
    bytes_written = sum(r[3] for r in done["sealed"].values())
    return {
        "index": index, "dir": str(final), "step": step, "tensors": len(tensors), "aliases": len(ckpt.aliases), "bytes": logical,
        "bytes_written": bytes_written, "bytes_reused": sum(o.nbytes for o in reused), "chunks_written": len(outs) - len(reused),
        "chunks_reused": len(reused), "files": [f"{rel_dir}/{n}" for n in names], "run_id": run_id, "warnings": warnings,
    }


def prune(store: Path, keep_last: int, *, pinned: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Keep the ``keep_last`` newest loadable checkpoints, every pinned one and
    every one that is not loadable; drop the rest from the manifest, then sweep
    their files (section 5). Returns the indices dropped, in order."""
    store = Path(store)
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise RavexError(f"keep_last {keep_last!r}: keep at least one checkpoint", hint="use keep_last >= 1")
    if not (store / STORE_MARKER).is_file():
        raise NotFoundError(f"{store}: not a Ravex store (no {STORE_MARKER})", hint="point at the store directory", path=store)
    _refuse_links(store)
    run_id = uuid.uuid4().hex[:12]
    try:
        with _locked(store, run_id):
            manifest, entries, _, _ = _open(store, run_id)
            loadable = [e.index for e in entries if e.problem is None]
            keep = set(loadable[-keep_last:]) | set(pinned) | {e.index for e in entries if e.problem is not None}
            dropped = [e.index for e in entries if e.index not in keep]
            if dropped:
                kept = [e for e in entries if e.index in keep]
                _write_manifest(store, {**manifest, "checkpoints": [e.entry for e in kept]}, run_id)
                _sweep(store, kept)
            return dropped
    except OSError as exc:
        raise RavexError(f"{store}: pruning the store failed: {exc}", hint=_IO_HINT, path=store) from exc
