"""Writing ``torch.save`` archives without torch.

Two pieces no library provides without torch itself:
- :func:`dumps`: a small pickle writer (protocol 2) that emits exactly the
  opcodes torch.save does for tensors (``torch._utils._rebuild_tensor_v2`` over
  a persistent storage id), so ``torch.load(weights_only=True)`` accepts it;
- :class:`ZipLayout`: the uncompressed zip64 archive around it, laid out in
  advance so the Rust executor can write every storage's bytes in place
  (positional writes, 64-byte aligned like torch) and CRC-32s are filled in
  afterwards.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from .._dtypes import STORAGE_CLASSES, V1_DTYPES
from ..errors import RavexError
from .unpickle import DType, Record

__all__ = ["SERIALIZATION_ID", "STORAGE_TYPES", "PickleDict", "PickleGlobal", "PickleObject", "StorageOut", "TensorOut", "ZipLayout", "dumps"]

# the dtypes Ravex writes into torch.save archives, and their storage classes
STORAGE_TYPES = {name: STORAGE_CLASSES[name] for name in V1_DTYPES}


@dataclass(frozen=True)
class StorageOut:
    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorOut:
    """A tensor to pickle: a whole, contiguous view of a storage."""

    storage: StorageOut
    shape: tuple[int, ...]
    requires_grad: bool = False  # as torch.save records it (DeepSpeed's fp32 partitions carry True)


@dataclass(frozen=True)
class PickleObject:
    """An instance of a class the writer names but never imports (DeepSpeed's
    ``LossScaler``, ``ZeroStageEnum``, ``fragment_address``; ``torch.Size``),
    pickled as pickle itself would: ``GLOBAL module name``, the ``args`` tuple,
    ``REDUCE`` (call the class) or, with ``newobj``, ``NEWOBJ``
    (``cls.__new__(cls, *args)``), then ``state`` and ``BUILD`` when given."""

    module: str
    name: str
    args: tuple[Any, ...] = ()
    state: dict[str, Any] | tuple[Any, ...] | None = None  # BUILD's argument: __dict__ or __setstate__'s
    newobj: bool = False


@dataclass(frozen=True)
class PickleGlobal:
    """A module-level object referenced by name (``torch.strided``), written as ``GLOBAL``."""

    module: str
    name: str


@dataclass(frozen=True)
class PickleDict:
    """A dict whose keys are objects Python cannot hash here (``PickleObject``\\ s
    with state): its ``(key, value)`` pairs, pickled as a dict."""

    items: tuple[tuple[Any, Any], ...]


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


class _Pickler:
    """With ``memo``, each class name and string is written once and fetched
    from the pickle memo after that (``BINPUT``/``BINGET``), as pickle itself
    does; without it, every value is written out where it occurs (the form the
    torch.save archives were tested in against torch.load and DeepSpeed)."""

    def __init__(self, memo: bool = False) -> None:
        self.out = io.BytesIO()
        self.w = self.out.write
        self.memo: dict[Any, int] | None = {} if memo else None

    def _fetch(self, key: Any) -> bool:
        """Push ``key``'s value from the memo (True), or say it must be written out (False)."""
        memo = self.memo
        if memo is None:
            return False
        idx = memo.get(key)
        if idx is not None:
            self.w(b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx))
            return True
        return False

    def _put(self, key: Any) -> None:
        memo = self.memo
        if memo is not None:
            idx = memo[key] = len(memo)
            self.w(b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx))

    def global_(self, module: str, name: str) -> None:
        key = ("global", module, name)
        if not self._fetch(key):
            self.w(b"c" + module.encode() + b"\n" + name.encode() + b"\n")
            self._put(key)

    def save(self, v: Any, path: str) -> None:
        w = self.w
        if v is None:
            w(b"N")
        elif v is True:
            w(b"\x88")
        elif v is False:
            w(b"\x89")
        elif isinstance(v, int):
            if -(2**31) <= v < 2**31:
                w(b"J" + struct.pack("<i", v))
            else:
                data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                w(b"\x8a" + bytes([len(data)]) + data)
        elif isinstance(v, float):
            w(b"G" + struct.pack(">d", v))
        elif isinstance(v, str):
            if not self._fetch(v):
                data = v.encode("utf-8")
                w(b"X" + struct.pack("<I", len(data)) + data)
                self._put(v)
        elif isinstance(v, bytes):
            self.global_("_codecs", "encode")
            self.save((v.decode("latin-1"), "latin1"), path)
            w(b"R")
        elif isinstance(v, tuple):
            if not v:
                w(b")")
            else:
                w(b"(")
                for i, x in enumerate(v):
                    self.save(x, f"{path}[{i}]")
                w(b"t")
        elif isinstance(v, list):
            w(b"]")
            if v:
                w(b"(")
                for i, x in enumerate(v):
                    self.save(x, f"{path}[{i}]")
                w(b"e")
        elif isinstance(v, dict):
            if type(v).__name__ == "OrderedDict":
                self.global_("collections", "OrderedDict")
                w(b")R")
            else:
                w(b"}")
            if v:
                w(b"(")
                for k, x in v.items():
                    self.save(k, f"{path}<key>")
                    self.save(x, f"{path}[{k!r}]")
                w(b"u")
        elif isinstance(v, set):
            self.global_("builtins", "set")
            self.save(sorted(v) if all(isinstance(x, (int, str)) for x in v) else list(v), path)
            w(b"\x85R")
        elif isinstance(v, DType):
            self.global_("torch", v.name)
        elif isinstance(v, TensorOut):
            self.tensor(v)
        elif isinstance(v, PickleGlobal):
            self.global_(v.module, v.name)
        elif isinstance(v, PickleDict):
            w(b"}")
            if v.items:
                w(b"(")
                for i, (k, x) in enumerate(v.items):
                    self.save(k, f"{path}<key {i}>")
                    self.save(x, f"{path}[{i}]")
                w(b"u")
        elif isinstance(v, Record) and v.cls == "_io.BytesIO" and not v.args and not v.items:
            # a BytesIO saved whole (torchtitan's loss history) goes back as it came: its bytes, never opened
            self.save(PickleObject("_io", "BytesIO", (), v.state, newobj=True), path)
        elif isinstance(v, PickleObject):
            self.global_(v.module, v.name)
            self.save(tuple(v.args), f"{path}<args>")
            w(b"\x81" if v.newobj else b"R")
            if v.state is not None:
                self.save(v.state, f"{path}<state>")
                w(b"b")
        else:
            raise RavexError(f"cannot write the value at {path} ({type(v).__name__}) into a torch.save file",
                             hint="only plain Python data and tensors are written")

    def tensor(self, t: TensorOut) -> None:
        w = self.w
        self.global_("torch._utils", "_rebuild_tensor_v2")
        w(b"(")
        # the storage, as a persistent id: ("storage", <type>, key, location, numel)
        w(b"(")
        self.save("storage", "")
        self.global_("torch", STORAGE_TYPES[t.storage.dtype])
        self.save(t.storage.key, "")
        self.save("cpu", "")
        self.save(t.storage.numel, "")
        w(b"tQ")
        self.save(0, "")  # storage offset
        self.save(tuple(t.shape), "")
        self.save(_strides(t.shape), "")
        w(b"\x88" if t.requires_grad else b"\x89")  # requires_grad
        self.global_("collections", "OrderedDict")
        w(b")R")  # backward hooks
        w(b"tR")


def dumps(obj: Any, *, memo: bool = False) -> bytes:
    """``obj`` pickled (protocol 2). ``memo`` writes repeated strings and class
    names once: DCP's ``.metadata`` repeats every key and class name per shard.
    The ``data.pkl`` of torch.save archives is written without it, unchanged
    since it was checked against torch.load and DeepSpeed."""
    p = _Pickler(memo)
    p.w(b"\x80\x02")
    p.save(obj, "state")
    p.w(b".")
    return p.out.getvalue()


_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ALIGN = 64
_PAGE = 4096
# torch.save's .data/serialization_id record: fixed, so the same input gives the same bytes
SERIALIZATION_ID = b"ravex00000000000"


@dataclass
class _Entry:
    name: bytes
    size: int
    header_offset: int = 0
    data_offset: int = 0
    extra_len: int = 0
    crc: int = 0
    data: bytes | None = None  # small records written by Python; None: tensor data written by the executor


@dataclass
class ZipLayout:
    """An uncompressed zip64 archive planned before any byte is written.

    Records are 64-byte aligned within the archive, as torch.save aligns them.
    A record given a ``residue`` is padded further so that its data starts at
    that offset modulo 4096 in the file (the archive starts ``base`` bytes into
    it): the page offset its source bytes have, so each write moves whole
    pages (``_engine.page_residue``). A residue that would break the 64-byte
    alignment is ignored. The archive's own offsets (local headers, central
    directory) count from its first byte, as when torch.save writes into the
    middle of a stream (a DCP item); only the positional writes move by ``base``."""

    prefix: str
    entries: list[_Entry] = field(default_factory=list)
    size: int = 0
    base: int = 0
    _small: list[tuple[int, bytes]] | None = field(default=None, repr=False)  # the small records, once laid out
    _total: int | None = field(default=None, repr=False)

    def add(self, name: str, size: int, data: bytes | None = None, residue: int | None = None) -> _Entry:
        e = _Entry(f"{self.prefix}/{name}".encode(), size, data=data)
        e.header_offset = self.size
        base = e.header_offset + _LOCAL.size + len(e.name) + 20  # 20: the zip64 extra field
        if residue is not None and (residue - self.base) % _ALIGN == 0:
            pad = (residue - (self.base + base + 4)) % _PAGE
        else:
            pad = (-(base + 4)) % _ALIGN  # + 4: the padding field's own header
        e.extra_len = 20 + 4 + pad
        e.data_offset = e.header_offset + _LOCAL.size + len(e.name) + e.extra_len
        self.size = e.data_offset + size
        self.entries.append(e)
        self._small = self._total = None
        return e

    def add_torch_save(self, pickle_bytes: bytes, storages: list[tuple[str, int, int | None]]) -> list[int]:
        """Add the records torch.save writes, in its order, to an empty layout:
        ``data.pkl``, the three small records, ``data/<key>`` per storage (key,
        byte size, residue), ``version``, ``.data/serialization_id``. Returns the
        indices of the ``data/<key>`` entries."""
        self.add("data.pkl", len(pickle_bytes), pickle_bytes)
        for name, data in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
            self.add(name, len(data), data)
        first = len(self.entries)
        for key, size, residue in storages:
            self.add(f"data/{key}", size, residue=residue)
        data_entries = list(range(first, len(self.entries)))
        self.add("version", 2, b"3\n")
        self.add(".data/serialization_id", len(SERIALIZATION_ID), SERIALIZATION_ID)
        return data_entries

    def _extra(self, e: _Entry) -> bytes:
        pad = e.extra_len - 24
        return struct.pack("<HHQQ", 0x0001, 16, e.size, e.size) + struct.pack("<HH", 0x4246, pad) + b"Z" * pad

    def _local(self, e: _Entry, crc: int | None = None) -> bytes:
        return _LOCAL.pack(0x04034B50, 45, 0, 0, 0, 0x21, e.crc if crc is None else crc, 0xFFFFFFFF, 0xFFFFFFFF,
                           len(e.name), e.extra_len) + e.name + self._extra(e)

    def small(self, base: int | None = None) -> list[tuple[int, bytes]]:
        """The records whose bytes Python holds, with their headers: (offset in the file, bytes).
        ``base``: where the archive starts in its file (default: :attr:`base`); a layout
        shared by several archives (equal DCP items) is placed once per archive this way."""
        at = self.base if base is None else base
        if self._small is None:
            self._small = []
            for e in self.entries:
                if e.data is not None:
                    e.crc = zlib.crc32(e.data)
                    self._small.append((e.header_offset, self._local(e) + e.data))
        return [(at + off, data) for off, data in self._small]

    def ranges(self, base: int | None = None) -> list[tuple[int, int]]:
        """(offset in the file, length) of each record the executor fills, in order: whose CRC-32 ``late`` needs."""
        at = self.base if base is None else base
        return [(at + e.data_offset, e.size) for e in self.entries if e.data is None]

    def directory(self, crcs: dict[int, int] | None = None) -> bytes:
        """The central directory and the end records (zip64), placed at ``size``;
        ``crcs``: entry index -> CRC-32 for the records the executor filled."""
        # fixed timestamps (1980-01-01): the same input gives the same bytes
        dos_time, dos_date = 0, 0x21
        crcs = crcs or {}
        cd = io.BytesIO()
        for i, e in enumerate(self.entries):
            extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.header_offset)
            cd.write(_CENTRAL.pack(0x02014B50, 45, 45, 0, 0, dos_time, dos_date, crcs.get(i, e.crc), 0xFFFFFFFF, 0xFFFFFFFF,
                                   len(e.name), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + e.name + extra)
        cd_bytes = cd.getvalue()
        cd_offset = self.size
        n = len(self.entries)
        eocd64_offset = cd_offset + len(cd_bytes)
        tail = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(cd_bytes), cd_offset)
        tail += struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1)
        tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        return cd_bytes + tail

    @property
    def total(self) -> int:
        """The archive's size in bytes, directory included (its length does not depend on the CRCs)."""
        if self._total is None:
            self._total = self.size + len(self.directory())
        return self._total

    def late(self, crcs: list[int], base: int | None = None) -> list[tuple[int, bytes]]:
        """The executor-written records' headers (``crcs``: their CRC-32s, in the order
        of :meth:`ranges`), then the central directory and the end records. The layout
        is not changed: one layout serves every archive that shares it."""
        at = self.base if base is None else base
        self.small(at)  # the small records' CRCs, which the directory lists
        filled = [i for i, e in enumerate(self.entries) if e.data is None]
        if len(crcs) != len(filled):
            raise ValueError(f"{len(crcs)} CRCs for {len(filled)} records")
        of = dict(zip(filled, crcs))
        out = [(at + self.entries[i].header_offset, self._local(self.entries[i], of[i])) for i in filled]
        out.append((at + self.size, self.directory(of)))
        return out
