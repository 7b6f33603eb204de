"""Building copy jobs for the Rust executor (``ravex_convert._core``).

A writer decides where each logical tensor goes (target file, byte offset,
region, dtype); :class:`CopyJob` collects those decisions together with the
source chunks and hands both layouts to the planner/executor in one call, so
the bytes go through once, in parallel, in bounded memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from . import _core
from ._output import direct_io, durable, fsync_dir
from .errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, from_os_error
from .model import Box, Chunk, Flat, LogicalTensor, Region, itemsize
from .storage import core_source, open_read

__all__ = ["PAGE", "CopyJob", "SourceTable", "Target", "chunk_bytes", "flat_range", "page_residue", "read_into", "read_many", "source_bytes", "vote_residue"]


def source_bytes(chunk: Chunk) -> bytes | memoryview | None:
    """Inline or decompressed bytes of a chunk the executor cannot map directly."""
    if chunk.data is not None:
        return chunk.data
    if chunk.compression == "zstd":
        assert chunk.file is not None and chunk.stored_nbytes is not None
        return bytes(_core.decompress_frame(core_source(chunk.file), chunk.offset, chunk.stored_nbytes, chunk.nbytes))
    return None


def chunk_bytes(chunk: Chunk) -> bytes | memoryview:
    """A chunk's (uncompressed) bytes, read from its file when they are not
    inline: for scalars and checks; the executor moves anything large."""
    data = source_bytes(chunk)
    if data is not None:
        return data
    if chunk.file is None:
        raise RavexError("a chunk has neither a file nor data")
    with open_read(chunk.file) as f:
        f.seek(chunk.offset)
        return f.read(chunk.nbytes)


@dataclass
class Target:
    """Where a writer puts (part of) a logical tensor."""

    file: int  # index into CopyJob.targets
    offset: int  # absolute byte offset of the region's first element
    region: Region
    dtype: str


# A decoded zstd chunk larger than this goes to a temporary file, not to memory.
INLINE_ZSTD_BYTES = 4 << 20


@dataclass
class SourceTable:
    """The sources of one executor call: file paths (each listed once) and
    inline byte strings, and each chunk as the executor's tuple.

    A zstd chunk is decoded in bounded pieces (the frame checked against the
    size its chunk declares first), into memory when small, else into a
    temporary file under TMPDIR; with ``defer`` (a :class:`CopyJob`) only while
    the batch that reads it runs (:meth:`decode`, :meth:`release`), so neither
    memory nor temporary disk grows with the checkpoint."""

    sources: list[Any] = field(default_factory=list)  # paths, bytes, or objects in a bucket (_core.S3Object)
    _paths: dict[str, int] = field(default_factory=dict)
    defer: bool = False
    _zstd: dict[int, Chunk] = field(default_factory=dict)  # source index -> its compressed chunk
    _spill: str | None = None  # a temporary directory, made when first needed

    def chunk(self, c: Chunk) -> tuple[Any, ...]:
        """``(source index, byte offset, region, dtype)`` for the executor."""
        if c.data is not None:  # inline bytes
            if len(c.data) != c.nbytes:
                raise CorruptCheckpointError(f"a chunk holds {len(c.data)} bytes, expected {c.nbytes}")
            self.sources.append(c.data)
            return (len(self.sources) - 1, 0, c.region.to_core(), c.dtype)
        if c.compression == "zstd":
            i = len(self.sources)
            self.sources.append(b"")
            self._zstd[i] = c
            if not self.defer:
                self.decode([i])
            return (i, 0, c.region.to_core(), c.dtype)
        if c.file is None:
            raise RavexError("a chunk has neither a file nor data")
        key = str(c.file)  # the usual chunk: a range of a file, listed once
        listed = self._paths.get(key)
        if listed is None:
            if not c.file.is_file():
                raise IncompleteCheckpointError(f"{c.file}: missing", hint="copy the whole checkpoint", path=c.file)
            listed = self._paths[key] = len(self.sources)
            self.sources.append(core_source(c.file))
        return (listed, c.offset, c.region.to_core(), c.dtype)

    @property
    def files(self) -> int:
        return len(self._paths)

    @property
    def paths(self) -> list[str]:
        """The source files, each once."""
        return list(self._paths)

    def decode(self, indices: list[int]) -> None:
        """Decode the zstd chunks among the sources ``indices`` not decoded yet."""
        for i in indices:
            c = self._zstd.get(i)
            if c is None or self.sources[i] != b"":
                continue
            if c.file is None or c.stored_nbytes is None:
                raise RavexError("a compressed chunk names no file or stored size")
            decoded: str | bytes
            try:
                if c.nbytes <= INLINE_ZSTD_BYTES:
                    raw = _core.decompress_frame(core_source(c.file), c.offset, c.stored_nbytes, c.nbytes)
                    h, decoded = _core.xxh3_64(raw), raw
                else:
                    if self._spill is None:
                        self._spill = tempfile.mkdtemp(prefix="ravex-zstd-")
                        weakref.finalize(self, shutil.rmtree, self._spill, ignore_errors=True)  # gone with the table
                    spilled = os.path.join(self._spill, f"{i}.raw")
                    with open(spilled, "wb"):
                        pass
                    h, decoded = _core.decompress_frame_to(core_source(c.file), c.offset, c.stored_nbytes, c.nbytes, spilled), spilled
            except ValueError as exc:
                raise CorruptCheckpointError(f"{c.file}: {str(exc).split(chr(10))[0]}",
                                             hint="the file is damaged; restore it from a copy", path=c.file) from None
            except OSError as exc:
                raise from_os_error(exc) from None
            if c.checksum is not None and c.checksum != f"xxh3-64:{h:016x}":
                raise CorruptCheckpointError(f"{c.file}: the zstd frame at byte {c.offset} decodes to bytes whose checksum is "
                                             f"xxh3-64:{h:016x}, not the recorded {c.checksum}",
                                             hint="the file is damaged (or changed while being read); restore it from a copy", path=c.file)
            self.sources[i] = decoded

    def release(self, indices: list[int]) -> None:
        """Forget decoded zstd chunks among ``indices`` (their temporary files go)."""
        for i in indices:
            src = self.sources[i] if i in self._zstd else b""
            if isinstance(src, str):
                os.unlink(src)
            if i in self._zstd:
                self.sources[i] = b""


@dataclass
class CopyJob:
    table: SourceTable = field(default_factory=lambda: SourceTable(defer=True))
    targets: list[Any] = field(default_factory=list)  # files, memory (a live tensor's bytes), or uploads
    tensors: list[tuple[list[int], list[tuple[Any, ...]], list[tuple[Any, ...]]]] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)  # of crc_ranges, after run()
    read_crcs: list[tuple[int, int, int, int]] = field(default_factory=list)  # run(read_crcs=True): (source, offset, length, crc)
    hashes: list[int | None] = field(default_factory=list)  # of hash_ranges, after run() (None: not hashed by the copy)
    names: list[str] = field(default_factory=list)  # each tensor's logical name, for messages

    @property
    def sources(self) -> list[Any]:
        return self.table.sources

    def target(self, where: Any) -> int:
        """A target: a file that exists at its final size (a path), writable memory (C-contiguous
        bytes), or an object being uploaded (a sink's ``target`` that is no path: the core's upload)."""
        self.targets.append(str(where) if isinstance(where, (str, os.PathLike)) else where)
        return len(self.targets) - 1

    def add(self, tensor: LogicalTensor, targets: list[Target]) -> None:
        # another rank's chunk (a run on many ranks writing its shards where they are) has no bytes here
        chunks = [c for c in tensor.chunks if not (c.owner is not None and c.data is None and c.file is None)]
        spans = [s for s in (span(t.region, tensor.shape) for t in targets) if s is not None]
        if spans:
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
            if lo > 0 or hi < _prod(tensor.shape):
                # targets in part of the tensor (one rank's shards of it): only the chunks whose
                # elements reach that part, so a rank's job does not list every rank's chunks
                chunks = [c for c in chunks if (cs := span(c.region, tensor.shape)) is not None and cs[0] < hi and cs[1] > lo]
        src = [self.table.chunk(c) for c in chunks]
        dst = [(t.file, t.offset, t.region.to_core(), t.dtype) for t in targets]
        self.tensors.append((list(tensor.shape), src, dst))
        self.names.append(tensor.name)

    def run(self, *, sync: bool = True, progress: Any = None, batch_bytes: int = 256 << 20,
            crc_ranges: list[tuple[int, int, int]] | None = None, threads: int = 0, writeback: bool | None = None,
            read_crcs: bool = False, direct: bool | None = None, hash_ranges: list[tuple[int, int, int]] | None = None) -> dict[str, int]:
        """Execute in batches of about ``batch_bytes`` so a progress bar can move:
        ``progress(n)`` after each batch, with the bytes it wrote, and first
        ``progress.add_total(bytes)`` where ``progress`` has that method.
        With ``crc_ranges`` (target, offset, length), ``self.crcs`` gets each
        range's CRC-32, gathered while copying (a zip entry's CRC without
        reading the output again). With ``writeback`` (the default: every
        writer fsyncs its files before it commits) the disk starts writing each
        piece as soon as it is copied, so that fsync waits for little. With
        ``read_crcs``, ``self.read_crcs`` gets the CRC-32 of every stretch of
        source bytes copied unchanged (to check the source's own CRCs without
        reading it again: ``_torchzip.check_deferred``). With ``direct`` (the
        default where the output is durable, unless ``RAVEX_DIRECT_IO=0``) the
        whole pages of file targets are written around the page cache; pass
        False for files that are read back before they are closed. With
        ``hash_ranges`` (target, offset, length), ``self.hashes`` gets each
        range's xxh3-64, hashed as its bytes were written, or None where one
        copy thread did not write all of it (the caller hashes the file there)."""
        if writeback is None:
            writeback = durable()
        if direct is None:
            direct = writeback and direct_io()
        totals: dict[str, int] = {}
        found: list[int | None] = [None] * len(crc_ranges or [])
        parts: dict[int, list[tuple[int, int, int]]] = {}  # range -> pieces written in it, from every batch
        self.hashes = [None] * len(hash_ranges or [])
        batch: list[tuple[list[int], list[tuple[Any, ...]], list[tuple[Any, ...]]]] = []
        size = 0
        done = 0  # tensors executed before this batch

        def flush() -> None:
            nonlocal batch, size, done
            if not batch:
                return
            used = sorted({c[0] for t in batch for c in t[1]})
            self.table.decode(used)  # compressed chunks: decoded for this batch only
            try:
                stats = _core.execute(self.sources, self.targets, batch, threads=threads, sync=False, crc_ranges=crc_ranges, writeback=writeback,
                                      read_crcs=read_crcs, direct=direct, hash_ranges=hash_ranges)
            except OSError as exc:
                raise from_os_error(exc) from None
            except _core.CorruptSourceError as exc:
                raise self._corrupt(exc, done) from None
            finally:
                self.table.release(used)
            # Anything else from the core (InternalError, a ValueError about the
            # arguments) is Ravex's own bug: the CLI reports it as one.
            done += len(batch)
            self.read_crcs += stats.pop("read_crcs", [])
            for i, crc in enumerate(stats.pop("crcs", [])):
                if crc is not None and found[i] is None:
                    found[i] = crc
            for i, h in enumerate(stats.pop("hashes", [])):
                if h is not None:  # a tensor's pieces are all in one batch: a range is hashed in its batch or not at all
                    self.hashes[i] = h
            for i, offset, n, crc in stats.pop("crc_parts", []):
                parts.setdefault(i, []).append((offset, n, crc))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + int(v)
            if progress is not None:
                progress(size)
            batch, size = [], 0

        sizes = [sum((r[2][2] if r[2][0] == "flat" else _prod(r[2][2])) * itemsize(r[3]) for r in t[2]) for t in self.tensors]
        add_total = getattr(progress, "add_total", None)
        if callable(add_total):
            add_total(sum(sizes))
        for t, n in zip(self.tensors, sizes):
            batch.append(t)
            size += n
            if size >= batch_bytes:
                flush()
        flush()
        if crc_ranges:
            _join_parts(crc_ranges, found, parts)
            # an upload cannot be read back before it completes: there, bytes no copy wrote are the
            # zeros every new object starts as (as a new file's are), and the CRC joins across them
            uploads = {i for i, t in enumerate(self.targets) if not isinstance(t, (str, bytearray, memoryview))}
            if uploads:
                _join_parts(crc_ranges, found, parts, zero_gaps=uploads)
            self.crcs = self._complete_crcs(crc_ranges, found)
        if sync:
            for path in self.targets:
                if isinstance(path, str):
                    fsync_dir(path)
        return totals


    def _corrupt(self, exc: Any, done: int) -> CorruptCheckpointError:
        """The core's CorruptSourceError as one error naming the file and the tensor."""
        text = str(exc).split("\nhint: ")
        i = exc.tensor
        name = self.names[done + i] if i is not None and done + i < len(self.names) else None
        files = [exc.path] if exc.path else []
        if not files and i is not None and done + i < len(self.tensors):
            files = sorted({str(self.sources[c[0]]) for c in self.tensors[done + i][1] if isinstance(self.sources[c[0]], str)})
        where = ", ".join(files) or "the source"
        what = f"tensor '{_shown_name(name)}'" if name else "a tensor"
        return CorruptCheckpointError(f"{where}: {what}: the file does not hold what the checkpoint's metadata says ({text[0]})",
                                      hint=text[1] if len(text) > 1 else "a file is truncated or damaged; copy the checkpoint again",
                                      path=files[0] if files else None)

    def _complete_crcs(self, ranges: list[tuple[int, int, int]], found: list[int | None]) -> list[int]:
        """Ranges no single tensor's writes tiled are read back and hashed."""
        missing: dict[int, list[int]] = {}
        for i, crc in enumerate(found):
            if crc is None:
                missing.setdefault(ranges[i][0], []).append(i)
        for target, idx in missing.items():
            where = self.targets[target]
            if not isinstance(where, str):
                raise RavexError("a CRC range of an in-memory target that no copy tiled")  # Ravex's own bug
            values = _core.checksum_ranges(where, [(ranges[i][1], ranges[i][2]) for i in idx], "crc32")
            for i, v in zip(idx, values):
                found[i] = v
        return [int(c) for c in found if c is not None]


def _join_parts(ranges: list[tuple[int, int, int]], found: list[int | None], parts: dict[int, list[tuple[int, int, int]]],
                zero_gaps: Collection[int] = ()) -> None:
    """A range no batch tiled on its own gets its CRC-32 from the pieces every batch wrote in it,
    where together they tile it (one stretch after another, no gap); else it stays None and is
    read back. For a range of a target in ``zero_gaps``, a gap joins as the zeros it holds."""
    for i, found_crc in enumerate(found):
        if found_crc is not None or (i not in parts and ranges[i][0] not in zero_gaps):
            continue
        target, at, length = ranges[i]
        end, joined = at + length, []
        for offset, n, crc in sorted(parts.get(i, [])):
            if offset != at:
                if target not in zero_gaps or offset < at:
                    break
                joined.append((_zeros_crc(offset - at), offset - at))
                at = offset
            joined.append((crc, n))
            at += n
        if at < end and target in zero_gaps:
            joined.append((_zeros_crc(end - at), end - at))
            at = end
        if at == end:
            found[i] = _core.crc32_concat(joined)


def _zeros_crc(n: int) -> int:
    """The CRC-32 of ``n`` zero bytes."""
    crc, block = 0, bytes(min(n, 1 << 20))
    while n > 0:
        crc = zlib.crc32(block[:min(n, len(block))], crc)
        n -= len(block)
    return crc


def read_into(tensor: LogicalTensor, out: bytearray | memoryview, dtype: str | None = None, *, threads: int = 0) -> None:
    """The whole of ``tensor``, row-major in ``dtype`` (default: its own; floats are
    cast), written by the Rust executor straight into ``out``; see :func:`read_many`."""
    read_many([(tensor, out, dtype)], threads=threads)


def read_many(items: list[tuple[LogicalTensor, bytearray | memoryview, str | None]], *, threads: int = 0) -> None:
    """Each logical tensor, whole and row-major in its dtype (or the one given:
    floats are cast), written by the Rust executor straight into its buffer (a
    live tensor's bytes: ``memoryview(t.view(torch.uint8).numpy())`` of a
    contiguous CPU tensor), which must be exactly that many bytes; one job for
    all of them. Nothing else may use the buffers until this returns.
    Compressed chunks are decoded first, in bounded pieces; chunks that do not
    cover a tensor, or bytes that are not what the metadata says, raise
    :class:`CorruptCheckpointError` before anything is written."""
    read_parts([(tensor, flat_all(tensor), out, dtype) for tensor, out, dtype in items], threads=threads)


def read_parts(items: list[tuple[LogicalTensor, Region, bytearray | memoryview, str | None]], *, threads: int = 0) -> None:
    """:func:`read_many` for a region of each tensor (a :class:`Box` of it, row-major in the
    buffer, or a :class:`Flat` range): one rank's shard is read without the rest."""
    job = CopyJob()
    for tensor, region, out, dtype in items:
        dt = dtype or tensor.dtype
        view = memoryview(out)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # a C-contiguous array of any shape, as flat bytes
        want = region.numel * itemsize(dt)
        if len(view) != want:
            raise RavexError(f"tensor '{_shown_name(tensor.name)}': {len(view)} bytes to restore into, {want} needed")  # Ravex's own bug
        if want:
            job.add(tensor, [Target(job.target(view), 0, region, dt)])
    job.run(sync=False, threads=threads, writeback=False)


def _shown_name(name: str) -> str:
    """A logical name as users know it: the fqn of a weight, ``optim.<state>/<fqn>``."""
    if name.startswith("model/"):
        return name[len("model/"):]
    if name.startswith("optim/"):
        _, state, fqn = (name.split("/", 2) + ["", ""])[:3]
        return f"optim.{state}/{fqn}"
    return name


def span(region: Region, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The row-major indices from the region's first element to one past its last
    (every element of the region lies in between), or None for an empty region."""
    if isinstance(region, Flat):
        return (region.start, region.start + region.length) if region.length else None
    if len(region.sizes) != len(shape) or _prod(region.sizes) == 0:
        return None
    lo = hi = 0
    stride = 1
    for j in reversed(range(len(shape))):
        lo += region.offsets[j] * stride
        hi += (region.offsets[j] + region.sizes[j] - 1) * stride
        stride *= shape[j]
    return lo, hi + 1


def flat_range(region: Region, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(first element, count) when the region's elements are one contiguous run of the row-major tensor."""
    if isinstance(region, Flat):
        return region.start, region.length
    offs, sizes = region.offsets, region.sizes
    if len(sizes) != len(shape) or _prod(sizes) == 0:
        return None
    d = next((j for j, s in enumerate(sizes) if s != 1), len(sizes))
    if any(sizes[j] != shape[j] for j in range(d + 1, len(shape))):
        return None
    start, stride = 0, 1
    for j in reversed(range(len(shape))):
        start += offs[j] * stride
        stride *= shape[j]
    return start, _prod(sizes)


PAGE = 4096


def page_residue(tensor: LogicalTensor, region: Region, dtype: str) -> tuple[int, int] | None:
    """Where, modulo the page size, a target holding ``region`` of ``tensor`` in
    ``dtype`` should start so that its bytes sit at the same offset within a page
    as in the source file that holds most of them, and how many bytes that is.

    Each copy step then reads whole source pages into whole target pages;
    zip-based writers pad their records to the residue this returns.
    None when no same-dtype, uncompressed file chunk holds a contiguous part of
    the region (a cast, or inline data)."""
    want = flat_range(region, tensor.shape)
    if want is None:
        return None
    best: tuple[int, int] | None = None
    size = itemsize(dtype)
    for c in tensor.chunks:
        if c.file is None or c.compression is not None or c.dtype != dtype:
            continue
        have = flat_range(c.region, tensor.shape)
        if have is None:
            continue
        overlap = min(want[0] + want[1], have[0] + have[1]) - max(want[0], have[0])
        if overlap > 0 and (best is None or overlap * size > best[1]):
            best = ((c.offset + (want[0] - have[0]) * size) % PAGE, overlap * size)
    return best


def vote_residue(votes: list[tuple[int, int]]) -> int | None:
    """The residue with the most bytes behind it (``(residue, bytes)`` votes)."""
    weight: dict[int, int] = {}
    for r, n in votes:
        weight[r] = weight.get(r, 0) + n
    return max(weight, key=lambda r: (weight[r], -r)) if weight else None


def _prod(xs: Any) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def whole(t: LogicalTensor) -> Box:
    return Box(tuple(0 for _ in t.shape), t.shape)


def flat_all(t: LogicalTensor) -> Flat:
    return Flat(0, t.numel)
