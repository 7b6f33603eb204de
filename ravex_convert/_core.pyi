"""Ravex's compiled core (Rust): the reshard planner, the copy executor,
checksums, zstd frames and element-wise comparison.

Private: call it through ``ravex_convert``; its surface may change.
Heavy calls release the GIL. Malformed arguments raise ``ValueError``;
failing file operations raise ``OSError`` (the subclass for the errno, with
``filename`` set); source bytes that do not match their metadata raise
:class:`CorruptSourceError` (a ``ValueError``); a failed invariant of Ravex's
own (a plan that does not tile, a bad argument built by the Python side)
raises :class:`InternalError` (a ``RuntimeError``): a bug, not bad data.
"""

import builtins
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, final

__all__ = [
    "CorruptSourceError",
    "DcpLayout",
    "InternalError",
    "S3Bucket",
    "S3Error",
    "S3Object",
    "S3Upload",
    "__version__",
    "checksum_ranges",
    "compare",
    "compress_range",
    "crc32_concat",
    "decompress_frame",
    "decompress_frame_to",
    "execute",
    "plan_runs",
    "plan_summary",
    "xxh3_64",
]

__version__: str

class CorruptSourceError(ValueError):
    """A source's bytes are not what its metadata says (a file shorter than its
    chunks, a zstd frame that does not decode, chunks that leave a tensor uncovered)."""

    tensor: int | None  # the tensor's index in the job, where known
    path: str | None  # the file, where known

class InternalError(RuntimeError):
    """An invariant of Ravex's own failed: a bug to report, not bad data."""

    tensor: int | None
    path: str | None

# A piece of a logical tensor (row-major, C order): an N-d box, stored
# row-major within the box, or a range of the flattened tensor (ZeRO).
_Box: TypeAlias = tuple[Literal["box"], Sequence[int], Sequence[int]]  # offsets, sizes
_Flat: TypeAlias = tuple[Literal["flat"], int, int]  # start, length
_Region: TypeAlias = _Box | _Flat
_DType: TypeAlias = Literal["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
# A chunk stored in a file: (file index, byte offset of its first element, region, dtype).
_FileChunk: TypeAlias = tuple[int, int, _Region, _DType]
# One logical tensor to copy: (global shape, source chunks, target chunks).
_Tensor: TypeAlias = tuple[Sequence[int], Sequence[_FileChunk], Sequence[_FileChunk]]

# One key of a DCP output: (key, nesting, kind, dtype, shape, totals); kind 0 a tensor cut
# on dim 0, 1 a tensor stored whole, 2 a non-tensor; totals the item archive's size for a
# full, the last (shorter) and an empty shard (kinds 1 and 2: the first only).
_DcpLeaf: TypeAlias = tuple[str, Sequence[str | int], int, str, Sequence[int], tuple[int, int, int]]

@final
class DcpLayout:
    """A DCP output laid out from one description per key: FSDP2's dim-0 shards
    in ``torch.chunk`` sizes (ranks past the data share one empty item at offset
    ``rows``), then each whole tensor or non-tensor on the least loaded rank;
    every rank file's items in key order, back to back.

    Raises ``ValueError`` for a malformed leaf, a world size of 0, or a rank
    file that would pass 2**63 bytes."""

    def __new__(cls, leaves: Sequence[_DcpLeaf], world_size: int) -> DcpLayout: ...
    @property
    def file_sizes(self) -> list[int]:
        """Each rank file's size in bytes."""
    def __len__(self) -> int:
        """How many items."""
    def items_of(self, rank: int) -> list[tuple[int, int, int, int, int, int]]:
        """Rank ``rank``'s items in file order: ``(leaf, index, offset, total, row0, rows)``."""
    def items(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Every item in key order: ``(leaf, index, rank, offset, total, row0, rows)``."""
    def metadata(self, current: bool, save_id: str) -> bytes:
        """The ``.metadata`` pickle, as ``FileSystemWriter.finish`` pickles torch 2.15's
        classes (``current``: ``TensorProperties`` with its ``strides``; else the five
        fields torch 2.4 to 2.14 read)."""
    def metadata_size(self, current: bool, save_id: str) -> int:
        """The length of :meth:`metadata`'s bytes, without making them."""

def plan_runs(
    global_shape: Sequence[int],
    sources: Sequence[_Region],
    targets: Sequence[_Region],
) -> list[tuple[int, int, int, int, int]]:
    """Plan the copies that fill every target chunk of one tensor from its source chunks.

    Returns ``(target_index, source_index, src_elem, dst_elem, len)`` tuples,
    grouped by target in target order and sorted by ``dst_elem`` within a
    target. Offsets and lengths count elements of each chunk's own storage.
    Every target element is written exactly once; where source chunks
    overlap, the first one listed wins. The GIL is released while planning.

    Raises ``ValueError`` for a malformed or out-of-bounds region, or when a
    target element lies in no source chunk.

    >>> plan_runs([4, 3], [("flat", 0, 6), ("flat", 6, 6)],
    ...           [("box", [0, 0], [1, 3]), ("box", [1, 0], [3, 3])])
    [(0, 0, 0, 0, 3), (1, 0, 3, 0, 3), (1, 1, 0, 3, 6)]
    """

def execute(
    sources: Sequence[str | bytes | memoryview | S3Object],
    targets: Sequence[str | bytearray | memoryview | S3Upload],
    tensors: Sequence[_Tensor],
    threads: int = 0,
    window_bytes: int = 67108864,
    sync: bool = True,
    crc_ranges: Sequence[tuple[int, int, int]] | None = None,
    writeback: bool = False,
    read_crcs: bool = False,
    direct: bool = False,
    hash_ranges: Sequence[tuple[int, int, int]] | None = None,
) -> dict[str, Any]:
    """Copy every target chunk's elements from the source chunks.

    With ``crc_ranges`` (``(target index, offset, length)``), the result also
    has ``crcs``: each range's CRC-32 combined from the pieces written (None
    where this call's writes do not tile the range), and ``crc_parts``:
    ``(range index, offset, length, crc)`` of every piece written inside a
    range left None, for a caller that joins ranges across calls. With ``read_crcs``, also
    ``read_crcs``: ``(source index, offset, length, crc)`` of each stretch of
    source bytes copied unchanged (a cast's are left out), to check a source's
    own CRC-32s without reading it again (:func:`crc32_concat` joins them).
    With ``hash_ranges`` (``(target index, offset, length)``), also ``hashes``:
    the xxh3-64 of each range, hashed from its bytes as they were written (in
    order, by one copy thread), or None where one thread did not write it all
    (two threads' stretches meet inside it): hash those from the file.

    ``sources`` are files (mapped read-only), ``bytes`` or other C-contiguous
    byte buffers (a ``memoryview``; it must not change during the call),
    read where they are without the GIL; a source chunk's
    file index points into them, a target chunk's into ``targets``. A target
    is a file that exists at its final size (nothing is created or truncated)
    or a writable C-contiguous byte buffer (a ``bytearray``, a ``memoryview``
    of a live tensor's bytes; nothing else may use it during the call); only
    the target chunks' bytes are written (positional writes), each exactly once.
    Where a target chunk's dtype differs from its source's, floats are cast
    (float32/float64/float16/bfloat16, round to nearest even, as torch does);
    any other dtype change is refused. Runs on ``threads`` threads (0: one per
    CPU), in pieces of at most ``window_bytes / threads`` bytes copied through
    one 64 KiB buffer per thread; fsyncs every
    target at the end when ``sync``. Everything is validated before the first
    byte moves (file indices, regions, coverage, casts, chunk byte ranges
    against file sizes, overlapping target chunks).

    With ``writeback``, each piece's write-back to disk starts as soon as it
    is written (Linux ``sync_file_range``), so a caller's later fsync waits
    for little: the disk works while the copy goes on.

    With ``direct``, the whole pages of file targets are written around the
    page cache (Linux ``O_DIRECT``, from a 1 MiB step buffer per thread), the
    partial pages at a piece's ends through it; a file system that refuses
    either gets the bytes through the page cache. For durable output.

    Returns ``{"bytes_read", "bytes_written", "runs", "pieces",
    "direct_bytes"}`` (``direct_bytes``: of the bytes written, those written
    around the page cache).
    """

def plan_summary(
    sources: Sequence[str | bytes | memoryview | S3Object],
    targets: Sequence[str | bytearray | memoryview | S3Upload],
    tensors: Sequence[_Tensor],
    threads: int = 0,
    window_bytes: int = 67108864,
) -> dict[str, int | list[int]]:
    """What ``execute`` would do with the same arguments, without moving a byte.

    Source files must exist (chunk ranges are checked against their sizes);
    targets need not. Returns ``bytes_read``, ``bytes_written``, ``runs`` and
    ``pieces`` (ints) and ``per_target_bytes`` (a list: bytes written into
    each target).
    """

def crc32_concat(parts: Sequence[tuple[int, int]]) -> int:
    """The CRC-32 of byte strings one after another, from each one's ``(crc, length)``."""

def checksum_ranges(path: str | S3Object, ranges: Sequence[tuple[int, int]], algo: Literal["xxh3-64", "crc32"]) -> list[int]:
    """The checksum of each ``(offset, length)`` byte range of the file, in order.

    ``"xxh3-64"`` is XXH3 64-bit with seed 0; ``"crc32"`` is the CRC-32 that
    zip archives record. Ranges are hashed in parallel; a range past the end
    of the file raises ``ValueError``.
    """

def xxh3_64(data: bytes | memoryview) -> int:
    """XXH3 64-bit (seed 0) of ``data`` (bytes or a C-contiguous byte buffer, unchanged during the call)."""

def compress_range(path: str | S3Object, offset: int, length: int, level: int = 3) -> bytes:
    """``length`` bytes at ``offset`` of the file, compressed into one independent zstd frame."""

def decompress_frame(path: str | S3Object, offset: int, stored_len: int, expected_len: int) -> bytes:
    """The zstd frame of ``stored_len`` bytes at ``offset`` of the file, decompressed.

    Raises ``ValueError`` unless it decompresses to exactly ``expected_len`` bytes.
    """

def decompress_frame_to(path: str | S3Object, offset: int, stored_len: int, expected_len: int, dst: str | None = None) -> int:
    """The zstd frame of ``stored_len`` bytes at ``offset`` of the file, decoded
    in pieces of 1 MiB into the existing file ``dst`` (truncated first), or only
    hashed when ``dst`` is None; returns the XXH3-64 of the decoded bytes.

    Memory stays bounded whatever the frame declares. Raises
    :class:`CorruptSourceError` unless the range is exactly one frame that
    decodes to exactly ``expected_len`` bytes; a header declaring another size
    is refused before decoding.
    """

def compare(
    sources: Sequence[str | bytes | memoryview | S3Object],
    shape: Sequence[int],
    a_chunks: Sequence[_FileChunk],
    b_chunks: Sequence[_FileChunk],
    atol: float = 0.0,
    rtol: float = 0.0,
    exact: bool = True,
) -> tuple[int, int | None, float]:
    """Compare two stored copies of one tensor of global ``shape``, element by element.

    Chunks index ``sources`` on both sides; each side must cover the tensor
    (where chunks are replicas, the first listed is compared). Returns
    ``(n_diff, first_diff, max_abs_diff)``: how many elements differ, the
    flat row-major index of the first that does (``None`` if none), and the
    largest absolute difference over all elements (0 for NaN against NaN,
    ``inf`` for NaN against a number).

    With ``exact``, equal dtypes compare bit patterns and different dtypes
    compare values. Otherwise floats match when
    ``|a - b| <= atol + rtol * |b|``, NaN matches NaN and an infinity matches
    only itself. Integers and bools compare exactly in both modes.
    """

class S3Error(OSError):
    """A request to an S3-compatible store failed; the message never holds credentials."""

    kind: Literal["not_found", "precondition", "denied", "no_bucket", "unreachable", "invalid", "other"]
    url: str | None  # the s3:// URL of the object or prefix

@final
class S3Bucket:
    """One bucket: a client and its connection pool. Unset fields come from the
    ``AWS_*`` environment as the AWS tools read it; an ``http://`` endpoint is used as given."""

    def __new__(
        cls,
        bucket: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        virtual_hosted: bool = False,
        part_size: int = 8388608,
        max_in_flight: int = 8,
        read_ahead: int = 16,
        max_retries: int = 10,
        retry_timeout_s: float = 180.0,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
    ) -> S3Bucket: ...
    @property
    def name(self) -> str: ...
    @property
    def part_size(self) -> int: ...
    def head(self, key: str) -> tuple[str, int, str] | None:
        """``(key, size, etag)``, or None where no object has the key."""
    def stat(self, key: str) -> tuple[int, str, float] | None:
        """``(size, etag, last_modified)`` (Unix seconds, the server's clock), or None where no object has the key."""
    def get(self, key: str) -> tuple[bytes, str]:
        """A whole object and its ETag."""
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...
    def list(self, prefix: str) -> list[tuple[str, int, str]]:
        """Every object under ``prefix``, sorted by key."""
    def list_dir(self, prefix: str) -> tuple[builtins.list[tuple[str, int, str]], builtins.list[str]]:
        """The objects directly under ``prefix``, and the prefixes ("directories") there."""
    def put(self, key: str, data: bytes, mode: Literal["overwrite", "create", "replace"] = "overwrite", etag: str | None = None) -> str:
        """Write a whole object; "create": only where absent; "replace": only while its ETag is ``etag``."""
    def delete(self, key: str) -> None: ...
    def delete_if(self, key: str, etag: str) -> bool:
        """Delete only while the ETag is ``etag`` (False: already gone)."""
    def unfinished(self, prefix: str) -> builtins.list[tuple[str, str, str]]:
        """Unfinished multipart uploads under ``prefix``: ``(key, upload_id, initiated)``."""
    def abort_upload(self, key: str, upload_id: str) -> None: ...
    def object(self, key: str, size: int) -> S3Object:
        """A source :func:`execute` reads by range."""
    def upload(self, key: str, size: int) -> S3Upload:
        """A new object of ``size`` bytes, written by range and uploaded in parts as they fill."""

@final
class S3Object:
    def __len__(self) -> int: ...
    def read(self, offset: int, length: int) -> bytes: ...

@final
class S3Upload:
    @property
    def key(self) -> str: ...
    @property
    def upload_id(self) -> str | None: ...
    @property
    def part_size(self) -> int: ...
    @property
    def parts(self) -> int: ...
    def __len__(self) -> int: ...
    def pwrite(self, data: bytes, offset: int) -> None: ...
    def close(self) -> str:
        """Complete the object and return its ETag (aborted on failure)."""
    def abort(self, cleanup: bool = True) -> None:
        """Discard the upload; ``cleanup=False`` leaves it for the next writer to abort."""
