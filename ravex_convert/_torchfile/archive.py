"""Reading ``torch.save`` archives without torch.

A torch.save file is an uncompressed zip: ``<name>/data.pkl`` (the pickle),
``<name>/data/<key>`` (one entry per storage, raw little-endian bytes) and a few
small records. We unpickle ``data.pkl`` with the restricted unpickler and find
each storage's absolute byte range from the zip directory, so a tensor's bytes
can be located (and later memory-mapped) without loading anything.

The archive may sit inside a bigger file (each item of a DCP ``.distcp`` file
is a complete torch.save archive at some offset): ``base`` and ``length`` give
that window.

What the archive declares is checked before anyone uses it: every storage's
size against its zip entry, every tensor's shape, strides and storage offset
against its storage (a crafted view would read other memory when gathered),
and the pickle's size (:func:`~ravex_convert._unpickle.max_pickle_bytes`).
The CRC-32 the zip records for ``data.pkl`` is checked when it is read (by
``zipfile``); those of the storages by :func:`verify_crcs`, which the readers
call before converting (it reads every byte once more). A conversion in one
process defers those checks to its copy (:func:`deferred_crcs`): the executor
hashes the bytes as it copies them, and only what it did not copy unchanged is
read again, all before the output is committed.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import struct
import zipfile
import zlib
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .._dtypes import DTYPE_SIZES, SCALAR_DTYPES, scalar_value
from ..errors import CorruptCheckpointError, UnsafeCheckpointError, from_os_error
from ..storage import as_path, core_source, open_read
from .unpickle import Record, StorageRef, TensorRef, max_pickle_bytes, restricted_loads

__all__ = ["TorchArchive", "check_archive", "check_deferred", "crc_enabled", "deferred_crcs", "deferring", "gather_strided", "is_torch_zip",
           "open_archive", "storages_at", "verify_crcs", "verify_many"]

# A strided view (a transpose, an expand) is gathered into memory; one that
# overlaps itself (stride 0) can be far larger than its storage.
_MAX_GATHER_BYTES = 2**30
_DAMAGED_HINT = "the file is damaged, or was crafted to make a reader go outside its data; copy it again from where the run saved it"

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of a file starting at ``base``."""

    def __init__(self, f: BinaryIO, base: int, length: int):
        self._f = f
        self._base = base
        self._len = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self._pos = offset
        elif whence == os.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self._len + offset
        self._pos = max(0, self._pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._len - self._pos
        n = max(0, min(n, self._len - self._pos))
        self._f.seek(self._base + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


@dataclass
class TorchArchive:
    """One torch.save archive: the unpickled object tree (tensors as
    :class:`TensorRef`) and where each storage's bytes are in the file."""

    path: Path
    base: int
    root: Any
    storage_offsets: dict[str, int]  # storage key -> absolute byte offset in ``path``
    storage_sizes: dict[str, int]  # storage key -> byte length of the zip entry
    storage_crcs: dict[str, int] = field(default_factory=dict)  # storage key -> the CRC-32 the zip directory records
    entry_prefix: str = ""  # "archive/" (the name of each storage's entry is f"{entry_prefix}data/{key}")
    where: str = ""  # how messages name the archive (the file, and the item's offset inside a .distcp)

    def tensor_offset(self, t: TensorRef) -> int:
        """Absolute file offset of the first element of ``t``."""
        return self.storage_offsets[t.storage.key] + t.storage_offset * DTYPE_SIZES.get(t.dtype, 1)

    def read_tensor_bytes(self, t: TensorRef) -> bytes:
        """The raw bytes of a contiguous tensor (small tensors: steps, scalars)."""
        if not t.is_contiguous():
            raise CorruptCheckpointError(
                f"{self.where or self.path}: a strided tensor (strides {list(t.stride)}) where a plain one was expected",
                hint="the file is damaged or not what it looks like; copy it again",
                path=self.path,
            )
        with open_read(self.path) as f:
            f.seek(self.tensor_offset(t))
            data = f.read(t.nbytes)
        if len(data) != t.nbytes:
            raise CorruptCheckpointError(f"{self.path}: tensor bytes run past the end of the file", hint="the file is truncated", path=self.path)
        return data

    def read_scalar(self, t: TensorRef) -> float | int | bool:
        """The value of a one-element tensor (a step counter)."""
        if t.numel != 1 or t.dtype not in SCALAR_DTYPES:
            raise CorruptCheckpointError(
                f"{self.where or self.path}: a {t.dtype} tensor of shape {list(t.shape)} where a number (a step) was expected",
                hint="the file is damaged, or not the kind of checkpoint it looks like; copy it again",
                path=self.path,
            )
        return scalar_value(t.dtype, self.read_tensor_bytes(t))


def check_archive(path: Path) -> None:
    """Cheap whole-file check without parsing the pickle: the zip directory at
    the end of the file is intact, names a ``data.pkl``, and every entry it
    lists lies inside the file (a truncated or overwritten file fails this).
    Reads only the directory: a few hundred bytes to a few KB."""
    bad = CorruptCheckpointError(
        f"{path}: the zip directory at the end of the file is missing or damaged (the file is truncated or overwritten)",
        hint="copy the file again from where the run saved it; a file that was still being written when copied is truncated",
        path=path,
    )
    try:
        size = path.stat().st_size
        with open_read(path) as zf, zipfile.ZipFile(zf) as z:
            infos = z.infolist()
    except OSError as exc:
        raise from_os_error(exc, path=path) from None
    except (zipfile.BadZipFile, ValueError, EOFError, UnicodeDecodeError, NotImplementedError):
        raise bad from None
    if not any(i.filename.endswith("data.pkl") for i in infos):
        raise bad
    for info in infos:
        if info.header_offset + info.compress_size > size:
            raise CorruptCheckpointError(
                f"{path}: the zip directory lists {info.filename} up to byte {info.header_offset + info.compress_size}, but the file has {size} bytes",
                hint="the file is truncated; copy it again from where the run saved it",
                path=path,
            )


def is_torch_zip(path: Path) -> bool:
    """Cheap sniff: a zip local-file header at the start and a data.pkl inside."""
    try:
        with open_read(path) as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        with open_read(path) as zf, zipfile.ZipFile(zf) as z:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def open_archive(path: str | Path, base: int = 0, length: int | None = None) -> TorchArchive:
    """Parse the torch.save archive at ``path`` (or in the window ``base``..``base+length``)."""
    path = as_path(path)
    where = f"{path}" if base == 0 and length is None else f"{path} (item at byte {base})"
    bad = CorruptCheckpointError(
        f"{where}: not a readable torch.save archive (truncated, overwritten, or not written by torch.save)",
        hint="copy the file again from where the run wrote it; a file that was still being written when copied is truncated",
        path=path,
    )
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise from_os_error(exc, path=path) from None
    if length is None:
        length = size - base
    if base + length > size:
        raise bad
    with open_read(path) as raw:
        window = _Window(raw, base, length)
        if window.read(4) != b"PK\x03\x04":
            raise bad
        window.seek(0)
        try:
            z = zipfile.ZipFile(io.BufferedReader(window))
            infos = z.infolist()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError, RuntimeError, zlib.error):
            # zipfile raises NotImplementedError for a version or feature it does not know (a damaged header says 10.8)
            raise bad from None
        pkl = [i for i in infos if i.filename.endswith("data.pkl")]
        if len(pkl) != 1:
            raise bad
        prefix = pkl[0].filename[: -len("data.pkl")]
        cap = max_pickle_bytes()
        if pkl[0].file_size > cap or pkl[0].compress_size > cap:
            raise UnsafeCheckpointError(
                f"{where}: {pkl[0].filename} is {max(pkl[0].file_size, pkl[0].compress_size)} bytes, more than the {cap} bytes Ravex unpickles",
                hint=f"real checkpoints' pickles are a few MB; if the file is genuine, raise the limit: RAVEX_MAX_PICKLE_BYTES={max(pkl[0].file_size, pkl[0].compress_size)}",
                path=path,
            )
        try:
            # zipfile checks the CRC-32 of what it reads (data.pkl, byteorder)
            pickle_bytes = z.read(pkl[0])
            byteorder = z.read(prefix + "byteorder").decode() if prefix + "byteorder" in z.namelist() else "little"
        except zipfile.BadZipFile as exc:
            if "CRC" in str(exc):
                raise CorruptCheckpointError(
                    f"{where}: the entry {exc.args[0].rsplit(' ', 1)[-1]} fails its CRC-32 check (its bytes changed after torch.save wrote it)",
                    hint="the file is damaged (bit rot, a bad copy); copy it again from where the run saved it",
                    path=path,
                ) from None
            raise bad from None
        except (OSError, EOFError, KeyError, UnicodeDecodeError, ValueError, NotImplementedError, RuntimeError, zlib.error):
            raise bad from None
        if byteorder != "little":
            raise CorruptCheckpointError(
                f"{where}: written on a big-endian machine; Ravex reads little-endian checkpoints only",
                hint="load it with torch on any machine and save it again (torch.save writes little-endian on x86 and ARM)",
                path=path,
            )
        offsets: dict[str, int] = {}
        sizes: dict[str, int] = {}
        crcs: dict[str, int] = {}
        data_prefix = prefix + "data/"
        for info in infos:
            if not info.filename.startswith(data_prefix) or info.filename.endswith("/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(
                    f"{where}: storage {info.filename} is compressed; torch.save never compresses",
                    hint="the archive was rewritten by another tool; use the file torch.save wrote",
                    path=path,
                )
            if not 0 <= info.header_offset < length:
                raise bad
            raw.seek(base + info.header_offset)
            header = raw.read(_LOCAL_HEADER.size)
            if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise bad
            fields = _LOCAL_HEADER.unpack(header)
            name_len, extra_len = fields[9], fields[10]
            start = base + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if start + info.file_size > base + length:
                raise bad
            key = info.filename[len(data_prefix):]
            offsets[key] = start
            sizes[key] = info.file_size
            crcs[key] = info.CRC

    def storage(pid: tuple[Any, ...]) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise CorruptCheckpointError(f"{where}: unexpected persistent id in the pickle", hint=_DAMAGED_HINT, path=path)
        _, stype, key, location, numel = pid
        dtype = getattr(stype, "dtype", None) if isinstance(stype, type) else None
        if not isinstance(key, str) or not isinstance(location, str) or not isinstance(numel, int) or isinstance(numel, bool) or dtype not in DTYPE_SIZES:
            raise CorruptCheckpointError(f"{where}: a storage id in the pickle is malformed (key, type, location or size)", hint=_DAMAGED_HINT, path=path)
        if key not in offsets:
            raise CorruptCheckpointError(f"{where}: the pickle names storage '{key}' but the archive has no data/{key}", hint="the file is truncated or damaged", path=path)
        need = numel * DTYPE_SIZES[dtype]
        if numel < 0 or need > sizes[key]:
            raise CorruptCheckpointError(
                f"{where}: storage data/{key} is declared as {numel} {dtype} elements ({need} bytes), but its zip entry holds {sizes[key]} bytes",
                hint=_DAMAGED_HINT,
                path=path,
            )
        return StorageRef(key, dtype, numel, location)

    root = restricted_loads(pickle_bytes, where, storage)
    _check_views(root, where, path)
    return TorchArchive(path, base, root, offsets, sizes, crcs, prefix, where)


def view_problem(t: TensorRef) -> str | None:
    """What is wrong with ``t`` as a view of its storage (None: every element it
    addresses lies inside the storage). Python ints: no overflow."""
    shape, stride, offset, n = t.shape, t.stride, t.storage_offset, t.storage.numel
    if len(shape) != len(stride):
        return f"has {len(shape)} dimensions but {len(stride)} strides"
    if any(d < 0 for d in shape):
        return f"has a negative dimension (shape {list(shape)})"
    if any(s < 0 for s in stride):
        return f"has a negative stride (strides {list(stride)})"
    if offset < 0:
        return f"starts at storage offset {offset}, before its storage"
    if any(d == 0 for d in shape):
        if offset > n:
            return f"starts at storage offset {offset}, past the end of its {n}-element storage data/{t.storage.key}"
        return None
    last = offset + sum((d - 1) * s for d, s in zip(shape, stride))
    if last >= n:
        return (
            f"(shape {list(shape)}, strides {list(stride)}, storage offset {offset}) reaches element {last} "
            f"of its storage data/{t.storage.key}, which holds {n} elements"
        )
    return None


def _check_views(root: Any, where: str, path: Path) -> None:
    """Every tensor of the pickle against its storage, before any view is built
    (a reader gathering a crafted view would copy memory that is not the file's,
    or crash). Each object once (shared references are not walked again)."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, name = stack.pop()
        if isinstance(obj, TensorRef):
            problem = view_problem(obj)
            if problem is not None:
                raise CorruptCheckpointError(f"{where}: tensor '{name or '<top level>'}' {problem}", hint=_DAMAGED_HINT, path=path)
            continue
        if not isinstance(obj, (dict, list, tuple, set, frozenset, Record)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend((v, _join(name, k)) for k, v in obj.items())
            stack.extend((k, _join(name, f"<key {i}>")) for i, k in enumerate(obj) if not isinstance(k, (str, int)))
        elif isinstance(obj, Record):
            stack.extend((a, _join(name, f"<{obj.cls} arg {i}>")) for i, a in enumerate(obj.args))
            stack.append((obj.state, name))
            stack.extend((v, _join(name, k)) for k, v in obj.items.items())
        else:
            stack.extend((v, _join(name, i)) for i, v in enumerate(obj))


def _join(name: str, key: Any) -> str:
    return f"{name}/{key}" if name else str(key)


def gather_strided(archive: TorchArchive, ref: TensorRef, what: str) -> bytes:
    """The elements of a strided view (a transpose saved as is), gathered in C
    order. Rare and small; the view was checked against its storage when the
    archive was opened, and is checked again here (a caller may have built it)."""
    import numpy as np

    size = DTYPE_SIZES[ref.dtype]
    problem = view_problem(ref)
    if problem is not None:
        raise CorruptCheckpointError(f"{archive.where or archive.path}: {what} {problem}", hint=_DAMAGED_HINT, path=archive.path)
    stored = archive.storage_sizes.get(ref.storage.key, 0)
    if ref.nbytes > max(_MAX_GATHER_BYTES, stored):
        raise CorruptCheckpointError(
            f"{archive.where or archive.path}: {what} is a {list(ref.shape)} view with strides {list(ref.stride)} of a {stored}-byte storage: "
            f"{ref.nbytes} bytes once gathered",
            hint="a view repeating its storage this many times is not a real checkpoint's; " + _DAMAGED_HINT,
            path=archive.path,
        )
    lanes = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(size)
    if lanes is None:  # complex128: two 8-byte lanes per element
        raise CorruptCheckpointError(
            f"{archive.where or archive.path}: {what} is a strided {ref.dtype} view; Ravex gathers 1- to 8-byte elements",
            hint="save the tensor contiguous (tensor.contiguous()) and convert again",
            path=archive.path,
        )
    extent = 1 + sum((n - 1) * st for n, st in zip(ref.shape, ref.stride)) if ref.numel else 0
    if (ref.storage_offset + extent) * size > stored:
        raise CorruptCheckpointError(f"{archive.where or archive.path}: {what} runs past the end of its storage", hint="the file is truncated or damaged; copy it again", path=archive.path)
    with open_read(archive.path) as f:
        f.seek(archive.tensor_offset(ref))
        raw = f.read(extent * size)
    if len(raw) != extent * size:
        raise CorruptCheckpointError(f"{archive.path}: {what} runs past the end of the file", hint="the file is truncated; copy it again", path=archive.path)
    storage = np.frombuffer(raw, dtype=lanes)
    view = np.lib.stride_tricks.as_strided(storage, shape=ref.shape, strides=tuple(s * size for s in ref.stride), writeable=False)
    return bytes(np.ascontiguousarray(view).tobytes())


def storages_at(archive: TorchArchive, offsets: Iterable[int]) -> set[str]:
    """The keys of the storages holding the given absolute file offsets (the
    storages a reader's chunks point into, for :func:`verify_crcs`)."""
    from bisect import bisect_right

    starts = sorted((start, key) for key, start in archive.storage_offsets.items())
    firsts = [s for s, _ in starts]
    out: set[str] = set()
    for off in offsets:
        i = bisect_right(firsts, off) - 1
        if i >= 0:
            start, key = starts[i]
            if off < start + archive.storage_sizes[key] or archive.storage_sizes[key] == 0:
                out.add(key)
    return out


def crc_enabled() -> bool:
    """False when ``RAVEX_NO_CRC=1`` asks to skip :func:`verify_crcs`."""
    return os.environ.get("RAVEX_NO_CRC", "") not in ("1", "true", "yes")


def verify_crcs(archive: TorchArchive, keys: Iterable[str] | None = None) -> None:
    """Check the CRC-32 the zip directory records for each storage (all of them,
    or those in ``keys``) against the bytes in the file; raise
    :class:`CorruptCheckpointError` naming the file and the entry that differs.

    Reads every byte of those entries once (in parallel, in Rust: about a
    second per 10 GB from the page cache), or, inside :func:`deferred_crcs`,
    notes them for the copy to check. Skipped when ``RAVEX_NO_CRC=1``."""
    if not crc_enabled():
        return
    wanted = sorted(archive.storage_offsets) if keys is None else sorted(set(keys))
    verify_many([(archive, k) for k in wanted])


def verify_many(entries: Sequence[tuple[TorchArchive, str]]) -> None:
    """:func:`verify_crcs` of many archives' storages (one read per file), or noted for the
    copy inside :func:`deferred_crcs`. Storages without a recorded CRC are skipped."""
    if not crc_enabled():
        return
    entries = [(a, k) for a, k in entries if k in a.storage_crcs]
    pending = _deferred.get()
    if pending is not None:
        pending.extend(entries)
        return
    _check(entries, {})


# The storages whose CRC-32 a conversion checks from its copy (deferred_crcs), this context's.
_deferred: contextvars.ContextVar[list[tuple[TorchArchive, str]] | None] = contextvars.ContextVar("ravex_deferred_crcs", default=None)


@contextlib.contextmanager
def deferred_crcs() -> Iterator[None]:
    """Within the block, the readers' CRC-32 checks wait for the copy: the executor job of
    the write hashes the bytes it copies unchanged and :func:`check_deferred` (called by
    ``plan`` after the copy, before any output file is closed) compares them, reading only
    the bytes the copy did not. What no copy checked (a dry run) is checked, by one read,
    when the block ends. The guarantee is the one of :func:`verify_crcs`: every storage a
    checkpoint's chunks point into is checked before an output is committed."""
    token = _deferred.set([])
    try:
        yield
        check_deferred()
    finally:
        _deferred.reset(token)


def deferring() -> bool:
    """Whether CRC-32 checks wait for the copy here (:func:`deferred_crcs`)."""
    return _deferred.get() is not None


def check_deferred(sources: Sequence[object] = (), read: Sequence[tuple[int, int, int, int]] = ()) -> None:
    """Check every deferred storage now: from ``read`` (the executor's ``read_crcs``:
    ``(source index, offset, length, crc)`` of bytes it copied unchanged from
    ``sources[index]``) where they cover it, by reading the rest."""
    pending = _deferred.get()
    if not pending:
        return
    entries = list(pending)
    pending.clear()
    by_index: dict[int, list[tuple[int, int, int]]] = {}
    for i, off, n, crc in read:
        by_index.setdefault(i, []).append((off, n, crc))
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for i, got in by_index.items():
        if i < len(sources) and isinstance(sources[i], str):
            pieces.setdefault(str(sources[i]), []).extend(got)
    _check(entries, pieces)


def _segments(pieces: list[tuple[int, int, int]], starts: list[int], off: int, n: int) -> list[tuple[int, int, int | None]]:
    """``[off, off + n)`` as consecutive ``(offset, length, crc)`` stretches: pieces the copy
    hashed (sorted by offset, longest first), and the gaps between them (crc None)."""
    end, at = off + n, off
    out: list[tuple[int, int, int | None]] = []
    i = bisect_left(starts, off)
    while i < len(pieces) and pieces[i][0] < end:
        o, m, crc = pieces[i]
        i += 1
        if o < at or o + m > end:
            continue  # overlaps what is covered, or reaches past the storage
        if o > at:
            out.append((at, o - at, None))
        out.append((o, m, crc))
        at = o + m
    if at < end:
        out.append((at, end - at, None))
    return out


def _check(entries: Sequence[tuple[TorchArchive, str]], pieces: dict[str, list[tuple[int, int, int]]]) -> None:
    from .. import _core

    per_file: dict[str, list[tuple[TorchArchive, str]]] = {}
    for a, k in entries:
        per_file.setdefault(str(a.path), []).append((a, k))
    for path, es in per_file.items():
        known = sorted(pieces.get(path, []), key=lambda p: (p[0], -p[1]))
        starts = [p[0] for p in known]
        segs = [_segments(known, starts, a.storage_offsets[k], a.storage_sizes[k]) for a, k in es]
        gaps = [(o, m) for ss in segs for o, m, crc in ss if crc is None]
        try:
            read = iter(_core.checksum_ranges(core_source(path), gaps, "crc32") if gaps else [])
        except OSError as exc:
            raise from_os_error(exc, path=es[0][0].path) from None
        except ValueError:  # a range past the end of the file: truncated since it was opened
            try:
                size = as_path(path).stat().st_size
            except OSError:
                size = 0
            a = next((a for a, k in es if a.storage_offsets[k] + a.storage_sizes[k] > size), es[0][0])
            raise CorruptCheckpointError(f"{a.where or a.path}: the file is shorter than its zip directory says",
                                         hint="the file is truncated; copy it again", path=a.path) from None
        for (a, k), ss in zip(es, segs, strict=True):
            crc = _core.crc32_concat([(c if c is not None else next(read), m) for _, m, c in ss])
            if crc != a.storage_crcs[k]:
                raise CorruptCheckpointError(
                    f"{a.where or a.path}: the entry {a.entry_prefix}data/{k} fails its CRC-32 check "
                    f"(recorded {a.storage_crcs[k]:08x}, the bytes give {crc:08x}): its data changed after it was written",
                    hint="the file is damaged (bit rot, a bad copy or disk); copy it again from where the run saved it. "
                    "RAVEX_NO_CRC=1 skips this check",
                    path=a.path,
                )
