"""The structure of a torch.save zip, for cutting and rewriting it."""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

_LOCAL = struct.Struct("<4sHHHHHIIIHH")


@dataclass
class Entry:
    name: str
    header: int  # offset of the local file header
    data: int  # offset of the first data byte
    size: int


@dataclass
class Layout:
    size: int
    entries: list[Entry]
    central: int  # offset of the first central-directory record
    eocd: int  # offset of the end-of-central-directory record (PK\x05\x06)
    zip64_eocd: int | None  # PK\x06\x06, if any

    def entry(self, suffix: str) -> Entry:
        for e in self.entries:
            if e.name.endswith(suffix):
                return e
        raise KeyError(suffix)

    def data_entries(self) -> list[Entry]:
        return [e for e in self.entries if "/data/" in e.name and e.size > 0]


def layout(path: Path, base: int = 0, length: int | None = None) -> Layout:
    raw = path.read_bytes()
    raw = raw[base:base + length] if length is not None else raw[base:]
    import io

    z = zipfile.ZipFile(io.BytesIO(raw))
    entries = []
    for info in z.infolist():
        fields = _LOCAL.unpack_from(raw, info.header_offset)
        data = info.header_offset + _LOCAL.size + fields[9] + fields[10]
        entries.append(Entry(info.filename, info.header_offset, data, info.file_size))
    eocd = raw.rfind(b"PK\x05\x06")
    z64 = raw.rfind(b"PK\x06\x06")
    central = raw.find(b"PK\x01\x02")
    return Layout(len(raw), entries, central, eocd, z64 if z64 >= 0 else None)


def rebuild(src: Path, dst: Path, replace: dict[str, bytes]) -> None:
    """Write ``src``'s entries to ``dst`` in order, uncompressed, with the entries
    whose name ends with a key of ``replace`` given new contents (fresh CRCs)."""
    with zipfile.ZipFile(src) as zin:
        items = [(i.filename, zin.read(i)) for i in zin.infolist()]
    tmp = dst.with_name(dst.name + ".rebuild")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for name, data in items:
            for suffix, new in replace.items():
                if name.endswith(suffix):
                    data = new
            zout.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    tmp.replace(dst)


def write_archive(dst: Path, prefix: str, pickle_bytes: bytes, storages: dict[str, bytes]) -> None:
    """A torch.save-shaped archive: ``<prefix>/data.pkl``, ``byteorder``, ``data/<key>``, ``version``."""
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        def put(name: str, data: bytes) -> None:
            z.writestr(zipfile.ZipInfo(f"{prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)

        put("data.pkl", pickle_bytes)
        put("byteorder", b"little")
        for key, data in storages.items():
            put(f"data/{key}", data)
        put("version", b"3\n")
