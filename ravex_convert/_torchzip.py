"""Reading ``torch.save`` archives without torch.

A torch.save file is an uncompressed zip: ``<name>/data.pkl`` (the pickle),
``<name>/data/<key>`` (one entry per storage, raw little-endian bytes) and a few
small records. We unpickle ``data.pkl`` with the restricted unpickler and find
each storage's absolute byte range from the zip directory, so a tensor's bytes
can be located (and later memory-mapped) without loading anything.

The archive may sit inside a bigger file (each item of a DCP ``.distcp`` file
is a complete torch.save archive at some offset): ``base`` and ``length`` give
that window.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ._unpickle import DTYPE_SIZES, StorageRef, TensorRef, restricted_loads
from .errors import CorruptCheckpointError

__all__ = ["TorchArchive", "is_torch_zip", "open_archive"]

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

    def tensor_offset(self, t: TensorRef) -> int:
        """Absolute file offset of the first element of ``t``."""
        return self.storage_offsets[t.storage.key] + t.storage_offset * DTYPE_SIZES.get(t.dtype, 1)

    def read_tensor_bytes(self, t: TensorRef) -> bytes:
        """The raw bytes of a contiguous tensor (small tensors: steps, scalars)."""
        if not t.is_contiguous():
            raise CorruptCheckpointError(f"{self.path}: tensor is not contiguous; cannot read it as one range", path=self.path)
        with open(self.path, "rb") as f:
            f.seek(self.tensor_offset(t))
            data = f.read(t.nbytes)
        if len(data) != t.nbytes:
            raise CorruptCheckpointError(f"{self.path}: tensor bytes run past the end of the file", hint="the file is truncated", path=self.path)
        return data

    def read_scalar(self, t: TensorRef) -> float | int | bool:
        fmt = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B", "bool": "<?"}
        if t.numel != 1 or t.dtype not in fmt:
            raise ValueError(f"not a readable scalar: {t.dtype} {t.shape}")
        return struct.unpack(fmt[t.dtype], self.read_tensor_bytes(t))[0]  # type: ignore[no-any-return]


def is_torch_zip(path: Path) -> bool:
    """Cheap sniff: a zip local-file header at the start and a data.pkl inside."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def open_archive(path: str | Path, base: int = 0, length: int | None = None) -> TorchArchive:
    """Parse the torch.save archive at ``path`` (or in the window ``base``..``base+length``)."""
    path = Path(path)
    where = f"{path}" if base == 0 and length is None else f"{path} (item at byte {base})"
    bad = CorruptCheckpointError(
        f"{where}: not a readable torch.save archive (truncated, overwritten, or not written by torch.save)",
        hint="copy the file again from where the run wrote it; a file that was still being written when copied is truncated",
        path=path,
    )
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read ({exc.strerror})", path=path) from None
    if length is None:
        length = size - base
    if base + length > size:
        raise bad
    with open(path, "rb") as raw:
        window = _Window(raw, base, length)
        if window.read(4) != b"PK\x03\x04":
            raise bad
        window.seek(0)
        try:
            z = zipfile.ZipFile(io.BufferedReader(window))
            infos = z.infolist()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            raise bad from None
        pkl = [i for i in infos if i.filename.endswith("data.pkl")]
        if len(pkl) != 1:
            raise bad
        prefix = pkl[0].filename[: -len("data.pkl")]
        try:
            pickle_bytes = z.read(pkl[0])
            byteorder = z.read(prefix + "byteorder").decode() if prefix + "byteorder" in z.namelist() else "little"
        except (zipfile.BadZipFile, OSError, EOFError, KeyError):
            raise bad from None
        if byteorder != "little":
            raise CorruptCheckpointError(f"{where}: written on a big-endian machine; Ravex reads little-endian checkpoints only", path=path)
        offsets: dict[str, int] = {}
        sizes: dict[str, int] = {}
        data_prefix = prefix + "data/"
        for info in infos:
            if not info.filename.startswith(data_prefix) or info.filename.endswith("/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(f"{where}: storage {info.filename} is compressed; torch.save never compresses", path=path)
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

    def storage(pid: tuple[Any, ...]) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise CorruptCheckpointError(f"{where}: unexpected persistent id in the pickle", path=path)
        _, stype, key, location, numel = pid
        key = str(key)
        if key not in offsets:
            raise CorruptCheckpointError(f"{where}: the pickle names storage '{key}' but the archive has no data/{key}", hint="the file is truncated or damaged", path=path)
        return StorageRef(key, getattr(stype, "dtype", "uint8"), int(numel), str(location))

    root = restricted_loads(pickle_bytes, where, storage)
    return TorchArchive(path, base, root, offsets, sizes)
