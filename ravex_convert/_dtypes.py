"""The dtype table: every element type Ravex knows, in one place.

A dtype is named as torch names it without the ``torch.`` prefix (``float32``,
``bfloat16``); every module keys on these names. For each, the table holds its
size in bytes, its safetensors code, the legacy typed-storage class torch.save
names in persistent ids, the :mod:`struct` format of one element where there is
one, and whether it is one of the ten dtypes of the Ravex store's format
version 1 (docs/format.md section 11), which are also the dtypes Ravex writes
to torch.save, DCP and ZeRO archives. Pure Python: importing it imports no torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["BY_NAME", "DTYPE_SIZES", "SAFETENSORS_CODES", "SCALAR_DTYPES", "STORAGE_CLASSES", "TABLE", "V1_DTYPES", "DTypeInfo", "scalar_value"]


@dataclass(frozen=True)
class DTypeInfo:
    """One row of the table."""

    name: str
    itemsize: int
    safetensors: str | None  # the header's "dtype" code; None: safetensors has none
    storage: str  # torch's typed-storage class (``torch.FloatStorage``)
    struct: str | None  # one little-endian element; None: struct has no format for it
    v1: bool  # in the store's format-version-1 table, and written by the torch.save/DCP/ZeRO writers


TABLE: tuple[DTypeInfo, ...] = (
    DTypeInfo("float64", 8, "F64", "DoubleStorage", "<d", True),
    DTypeInfo("float32", 4, "F32", "FloatStorage", "<f", True),
    DTypeInfo("float16", 2, "F16", "HalfStorage", "<e", True),
    DTypeInfo("bfloat16", 2, "BF16", "BFloat16Storage", None, True),  # see scalar_value
    DTypeInfo("int64", 8, "I64", "LongStorage", "<q", True),
    DTypeInfo("int32", 4, "I32", "IntStorage", "<i", True),
    DTypeInfo("int16", 2, "I16", "ShortStorage", "<h", True),
    DTypeInfo("int8", 1, "I8", "CharStorage", "<b", True),
    DTypeInfo("uint8", 1, "U8", "ByteStorage", "<B", True),
    DTypeInfo("bool", 1, "BOOL", "BoolStorage", "<?", True),
    DTypeInfo("complex64", 8, None, "ComplexFloatStorage", None, False),
    DTypeInfo("complex128", 16, None, "ComplexDoubleStorage", None, False),
    DTypeInfo("float8_e4m3fn", 1, "F8_E4M3", "Float8_e4m3fnStorage", None, False),
    DTypeInfo("float8_e5m2", 1, "F8_E5M2", "Float8_e5m2Storage", None, False),
)

BY_NAME: dict[str, DTypeInfo] = {d.name: d for d in TABLE}
# name -> bytes per element, every dtype Ravex reads
DTYPE_SIZES: dict[str, int] = {d.name: d.itemsize for d in TABLE}
# the ten of format version 1: name -> bytes per element
V1_DTYPES: dict[str, int] = {d.name: d.itemsize for d in TABLE if d.v1}
# name -> safetensors code, every dtype safetensors has
SAFETENSORS_CODES: dict[str, str] = {d.name: d.safetensors for d in TABLE if d.safetensors is not None}
# name -> torch storage class, every dtype torch.save names
STORAGE_CLASSES: dict[str, str] = {d.name: d.storage for d in TABLE}
# the dtypes a one-element tensor may hold to be read as a number
SCALAR_DTYPES = frozenset(d.name for d in TABLE if d.struct is not None) | {"bfloat16"}


def scalar_value(dtype: str, raw: bytes) -> float | int | bool:
    """The value of one element of ``dtype`` (one of :data:`SCALAR_DTYPES`) stored as ``raw``."""
    if dtype == "bfloat16":  # the top half of a float32
        return struct.unpack("<f", b"\x00\x00" + raw)[0]  # type: ignore[no-any-return]
    fmt = BY_NAME[dtype].struct
    if fmt is None:
        raise KeyError(dtype)
    return struct.unpack(fmt, raw)[0]  # type: ignore[no-any-return]
