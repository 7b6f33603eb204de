"""The one checkpoint model every format is read into and written from.

A :class:`Checkpoint` is named logical tensors (global shape, dtype), each
stored as :class:`Chunk` s located in files, plus small state (``objects``)
and provenance. Reading a format means describing where its bytes are, never
loading them; writing means choosing a target chunking and handing both
layouts to the Rust planner/executor.

Logical names (the same as the native store's, docs/format.md section 10):
- ``model/<fqn>``: parameters and buffers, ``<fqn>`` as in ``state_dict()``;
- ``optim/<state>/<fqn>``: per-parameter optimizer state (``exp_avg``,
  ``exp_avg_sq``, ``step``, ...), keyed by the parameter's name, never by a
  group index or flat offset;
- ``obj/<key>/<path>``: a tensor inside ``objects[key]`` (an RNG state).

``objects`` holds the small state under the well-known keys of
:mod:`ravex_convert.objects` (one schema, docs/format.md section 11).

Each logical tensor of ``model/`` may say what it is (``kind``): a trained
``parameter``, a ``frozen`` parameter (requires_grad False, no optimizer
state) or a ``buffer``. None where the source does not say (a DCP or
torch.save file cannot tell a frozen parameter from a buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._dtypes import DTYPE_SIZES

__all__ = ["BUFFER", "FROZEN", "KINDS", "MODEL", "OBJ", "OPTIM", "PARAMETER", "Box", "Checkpoint", "Chunk", "Flat", "LogicalTensor", "Region", "TensorLink", "dim0_shards", "itemsize", "numel"]

MODEL = "model/"
OPTIM = "optim/"
OBJ = "obj/"

PARAMETER, FROZEN, BUFFER = "parameter", "frozen", "buffer"
KINDS = (PARAMETER, FROZEN, BUFFER)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def itemsize(dtype: str) -> int:
    return DTYPE_SIZES[dtype]


@dataclass(frozen=True)
class Box:
    """An N-d box of the global tensor; its elements are stored row-major within the box."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return numel(self.sizes)

    def to_core(self) -> tuple[str, list[int], list[int]]:
        return ("box", list(self.offsets), list(self.sizes))

    def to_json(self) -> dict[str, Any]:
        return {"box": {"offsets": list(self.offsets), "sizes": list(self.sizes)}}


def dim0_shards(shape: tuple[int, ...], world_size: int) -> list[tuple[int, Box]]:
    """FSDP2's dim-0 shard of a tensor of dim >= 1 on each rank, as (rank, box),
    in ``torch.chunk`` sizes: ceil(rows / N) rows each, the remainder on the last
    rank with data, and an empty box at offset ``rows`` on every rank past it
    (torch.distributed.tensor's ``_local_shard_size_and_offset``). The one split
    rule of the writers; each decides what to record of the empty boxes."""
    rows = shape[0]
    per = -(-rows // world_size)
    out: list[tuple[int, Box]] = []
    for r in range(world_size):
        start = min(r * per, rows)
        stop = min(start + per, rows)
        out.append((r, Box((start, *(0 for _ in shape[1:])), (stop - start, *shape[1:]))))
    return out


@dataclass(frozen=True)
class Flat:
    """Elements ``start .. start+length`` of the row-major flattened tensor (ZeRO partitions)."""

    start: int
    length: int

    @property
    def numel(self) -> int:
        return self.length

    def to_core(self) -> tuple[str, int, int]:
        return ("flat", self.start, self.length)

    def to_json(self) -> dict[str, Any]:
        return {"flat": {"start": self.start, "length": self.length}}


Region = Box | Flat


@dataclass(frozen=True)
class TensorLink:
    """Stands in ``objects`` where the source held a tensor: the tensor itself
    is the logical tensor ``name`` (under ``obj/``)."""

    name: str


@dataclass
class Chunk:
    """Where one region of a logical tensor is stored.

    ``file`` + ``offset``: the absolute byte offset of the region's first
    element; the region's elements follow contiguously in ``dtype``. Small
    values that exist in no file range (a step counter held as a Python int
    in a pickle) are carried inline in ``data`` with ``file`` None; so are the
    runtime's snapshot copies, as memoryviews of their tensors' bytes (read in
    place, never copied again).
    """

    region: Region
    dtype: str
    file: Path | None = None
    offset: int = 0
    data: bytes | memoryview | None = None
    compression: str | None = None  # "zstd": ``offset`` is a frame of ``stored_nbytes`` bytes
    stored_nbytes: int | None = None
    checksum: str | None = None  # "xxh3-64:<hex>" of the uncompressed bytes, when the format records one
    # The rank that holds this chunk's bytes, in a run on many ranks that writes its shards where they
    # are (the runtime's per_rank checkpoints): another rank's chunk has its place, not its bytes.
    owner: int | None = None

    @property
    def nbytes(self) -> int:
        return self.region.numel * itemsize(self.dtype)


@dataclass
class LogicalTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: list[Chunk] = field(default_factory=list)
    kind: str | None = None  # model/ tensors: PARAMETER, FROZEN or BUFFER where the source says

    def renamed(self, name: str) -> LogicalTensor:
        return LogicalTensor(name, self.shape, self.dtype, self.chunks, self.kind)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def whole(self) -> Box:
        return Box(tuple(0 for _ in self.shape), self.shape)


@dataclass
class Checkpoint:
    """A checkpoint of any format, described without loading tensor data."""

    format: str
    path: Path
    world_size: int = 1
    step: int | None = None
    tensors: dict[str, LogicalTensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias logical name -> stored logical name
    objects: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)  # provenance: variant, versions, tag, ...

    def add(self, t: LogicalTensor) -> LogicalTensor:
        self.tensors[t.name] = t
        return t

    def model_names(self) -> list[str]:
        """Parameter and buffer names (fqn), stored tensors and aliases, in order."""
        names = [n[len(MODEL):] for n in self.tensors if n.startswith(MODEL)]
        names += [a[len(MODEL):] for a in self.aliases if a.startswith(MODEL)]
        return names

    def optimizer_state_names(self) -> list[str]:
        out: list[str] = []
        for n in self.tensors:
            if n.startswith(OPTIM):
                s = n.split("/", 2)[1]
                if s not in out:
                    out.append(s)
        return out

    def resolve(self, name: str) -> LogicalTensor:
        """A tensor by logical name, following an alias."""
        return self.tensors[self.aliases.get(name, name)]
