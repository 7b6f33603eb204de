"""The geometry and the files of the ZeRO writer (``zero_write``).

Geometry: where DeepSpeed 0.19.8, started at world size N, expects each
parameter's elements in its flat partitions, computed the way its optimizers
build them (``stage_1_and_2.py`` and ``stage3.py`` ``__init__``), so that what
``load_state_dict`` copies back lands on the right parameters:

- stage 1/2 (``DeepSpeedZeroOptimizer``; ``BF16_Optimizer`` partitions the same
  way): a param group is one flat buffer, the params in group order
  (``round_robin_gradients`` reorders them first), each followed by its
  ``parameter_alignment`` padding (none unless that option is on), padded at the
  end to a multiple of ``2 * N`` and cut into N equal partitions;
- stage 3: every param is cut on its own into ``ceil(numel / N)``-element pieces
  (the last rank's padded); each rank concatenates its pieces group by group and
  cuts them into sub-groups of about ``sub_group_size`` elements, at param
  boundaries.

Files: :class:`ArchiveOut` collects one ``torch.save`` archive (the object to
pickle, its tensors and which logical-tensor elements fill them) and
:func:`archive_files` lays every archive out for the Rust executor to copy (and
cast) the bytes in place, then fills in the zip CRCs. Padding is never written:
the files are created at their final size, so padding reads as zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._engine import PAGE, page_residue, vote_residue
from ..._torchfile.write import StorageOut, TensorOut, ZipLayout, dumps
from ...model import Checkpoint, Region, itemsize, numel
from ...plan import OutFile
from .layout import Piece, flat_group_pieces, stage3_partition, stage3_pieces

__all__ = ["ArchiveOut", "FlatGroup", "Stage3Layout", "archive_files", "by_rank", "plan_flat_group", "plan_stage3", "round_robin_order"]

# DeepSpeed 0.19.8: ``nccl_start_alignment_factor`` (2) times the world size.
_ALIGNMENT_FACTOR = 2


def round_robin_order(n: int, world_size: int) -> list[int]:
    """``DeepSpeedZeroOptimizer._round_robin_reorder``: indices i % N == 0 first, then 1, ..."""
    return [i for j in range(min(n, world_size)) for i in range(j, n, world_size)]


@dataclass
class FlatGroup:
    """One stage 1/2 param group laid out at ``world_size`` ranks."""

    index: int
    names: list[str]  # flat-buffer order (what ``param_shapes`` lists)
    numels: list[int]
    paddings: list[int]  # ``param_alignment_paddings``: after each param, in flat-buffer order
    world_size: int
    partition: int  # elements per rank, padding included
    used: int  # params plus their alignment paddings
    pieces: list[list[Piece]]  # per param (flat-buffer order): what each rank holds
    mappings: list[dict[str, tuple[int, int]]]  # per rank: name -> (numel, start), as DeepSpeed records them
    held: list[list[tuple[int, Piece]]] = field(default_factory=list)  # per rank: (index into names, piece)

    def __post_init__(self) -> None:
        self.held = by_rank(self.pieces, self.world_size)

    def group_padding(self, rank: int) -> int:
        """``groups_padding``: the padding elements at the end of ``rank``'s partition."""
        left = rank * self.partition
        if self.used <= left:
            return self.partition
        if self.used < left + self.partition:
            return left + self.partition - self.used
        return 0

    def lean(self, rank: int) -> int:
        """Elements of ``rank``'s saved fp32 partition (DeepSpeed cuts the padding off it)."""
        return self.partition - self.group_padding(rank)


def _alignment_paddings(numels: list[int], param_alignment: int) -> list[int]:
    out = []
    offset = 0
    for i, n in enumerate(numels):
        offset += n
        pad = 0 if i == len(numels) - 1 else (-offset) % param_alignment
        out.append(pad)
        offset += pad
    return out


def _mappings(names: list[str], pieces: list[list[Piece]], world_size: int) -> list[dict[str, tuple[int, int]]]:
    out: list[dict[str, tuple[int, int]]] = [{} for _ in range(world_size)]
    for name, per in zip(names, pieces):
        for pc in per:
            out[pc.rank][name] = (pc.length, pc.tensor_start)
    return out


def plan_flat_group(index: int, names: list[str], numels: list[int], world_size: int, *, param_alignment: int = 1,
                    round_robin: bool = False) -> FlatGroup:
    """Lay out one stage 1/2 param group (``names`` in optimizer order)."""
    order = round_robin_order(len(names), world_size) if round_robin else list(range(len(names)))
    flat_names = [names[i] for i in order]
    flat_numels = [numels[i] for i in order]
    paddings = _alignment_paddings(flat_numels, param_alignment)
    used = sum(flat_numels) + sum(paddings)
    alignment = _ALIGNMENT_FACTOR * world_size
    partition = math.ceil(used / alignment) * alignment // world_size
    pieces, _ = flat_group_pieces(flat_numels, paddings, partition, world_size, index)
    if round_robin:
        # DeepSpeed computes param_slice_mappings over the unshuffled group, as if
        # no shuffle had happened (zero_layout.check_slice_mappings): write what it writes.
        plain, _ = flat_group_pieces(numels, None, partition, world_size, index)
        mappings = _mappings(names, plain, world_size)
    else:
        mappings = _mappings(flat_names, pieces, world_size)
    return FlatGroup(index, flat_names, flat_numels, paddings, world_size, partition, used, pieces, mappings)


@dataclass
class Stage3Layout:
    """Every trainable param of every group laid out for ZeRO-3 at ``world_size`` ranks."""

    names: list[str]  # param_shapes order, all groups
    sub_sizes: list[int]  # elements of each sub-group tensor (the same on every rank)
    sub_to_group: list[int]  # sub-group -> param group
    sub_members: list[list[int]]  # sub-group -> its params (indices into names); DeepSpeed's param_shapes has one dict per sub-group
    pieces: list[list[Piece]]  # per param: (rank, sub-group, element in it, element of the param, length)


def plan_stage3(groups: Sequence[Sequence[tuple[str, int]]], world_size: int, sub_group_size: int) -> Stage3Layout:
    """``groups``: per param group, (name, numel) in optimizer order.
    Sub-groups as ``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``
    makes them: a group whose partitioned size fits ``sub_group_size`` is one
    sub-group; otherwise params are taken until the running size reaches it."""
    names: list[str] = []
    numels: list[int] = []
    sub_sizes: list[int] = []
    sub_to_group: list[int] = []
    sub_members: list[list[int]] = []
    for g, members in enumerate(groups):
        parts = [stage3_partition(n, world_size) for _, n in members]
        if sub_group_size >= sum(parts):
            cuts = [len(members)]
        else:
            cuts, running = [], 0
            for i, p in enumerate(parts):
                running += p
                if running >= sub_group_size or i == len(parts) - 1:
                    cuts.append(i + 1)
                    running = 0
        start = 0
        for end in cuts:
            sub_sizes.append(sum(parts[start:end]))
            sub_to_group.append(g)
            sub_members.append(list(range(len(names) + start, len(names) + end)))
            start = end
        names.extend(n for n, _ in members)
        numels.extend(n for _, n in members)
    pieces, _ = stage3_pieces(numels, sub_sizes, world_size)
    return Stage3Layout(names, sub_sizes, sub_to_group, sub_members, pieces)


def by_rank(pieces: list[list[Piece]], world_size: int) -> list[list[tuple[int, Piece]]]:
    """Per rank, (param index, piece) of what it holds: each rank's file visits
    only its own pieces (stage 3 has one per param and rank)."""
    out: list[list[tuple[int, Piece]]] = [[] for _ in range(world_size)]
    for i, per in enumerate(pieces):
        for pc in per:
            out[pc.rank].append((i, pc))
    return out


# ----------------------------------------------------------------------------
# Files


@dataclass
class _Fill:
    storage: int
    source: str  # logical tensor
    region: Region  # of the logical tensor
    at: int  # element of the storage its first element goes to


@dataclass
class ArchiveOut:
    """One ``torch.save`` archive to write, at ``relpath`` under the output root."""

    relpath: str
    root: Any = None  # the object to pickle (TensorOut where tensors go)
    storages: list[StorageOut] = field(default_factory=list)
    fills: list[_Fill] = field(default_factory=list)

    def tensor(self, dtype: str, shape: tuple[int, ...], *, requires_grad: bool = False) -> TensorOut:
        """A new tensor of its own storage (zeros where nothing fills it)."""
        s = StorageOut(str(len(self.storages)), dtype, numel(shape))
        self.storages.append(s)
        return TensorOut(s, shape, requires_grad)

    def fill(self, t: TensorOut, source: str, region: Region, at: int = 0) -> None:
        """Elements ``region`` of logical tensor ``source`` go to element ``at`` of ``t`` (cast to its dtype)."""
        if region.numel:
            self.fills.append(_Fill(int(t.storage.key), source, region, at))

    def residues(self, ckpt: Checkpoint) -> list[int | None]:
        """Per storage, the page offset most of its source bytes have (see ``_engine.page_residue``)."""
        votes: list[list[tuple[int, int]]] = [[] for _ in self.storages]
        for f in self.fills:
            s = self.storages[f.storage]
            found = page_residue(ckpt.tensors[f.source], f.region, s.dtype)
            if found is not None:
                votes[f.storage].append(((found[0] - f.at * itemsize(s.dtype)) % PAGE, found[1]))
        return [vote_residue(v) for v in votes]

    def layout(self, ckpt: Checkpoint) -> ZipLayout:
        # torch.save's record order and its prefix: the file name without ".pt"
        layout = ZipLayout(Path(self.relpath).name.removesuffix(".pt"))
        records = [(s.key, s.numel * itemsize(s.dtype), residue) for s, residue in zip(self.storages, self.residues(ckpt), strict=True)]
        layout.add_torch_save(dumps(self.root), records)
        return layout


def archive_files(ckpt: Checkpoint, archives: list[ArchiveOut]) -> tuple[list[OutFile], int]:
    """Every archive as an output file: small records by Python, tensor bytes by
    the Rust executor, then the zip headers with the CRC-32s gathered while copying
    (padding-only records, which nothing copies into, are read back by the job).
    Returns the files and the bytes they will hold."""
    files = []
    total = 0
    for archive in archives:
        layout = archive.layout(ckpt)
        f = OutFile(archive.relpath, layout.size, small=layout.small(), crc_ranges=layout.ranges(), finish=layout.late)
        first_data = 4  # data/<key> records follow data.pkl and the three small records
        for fill in archive.fills:
            s = archive.storages[fill.storage]
            entry = layout.entries[first_data + fill.storage]
            f.fills.append((ckpt.tensors[fill.source], entry.data_offset + fill.at * itemsize(s.dtype), fill.region, s.dtype))
        total += layout.total
        files.append(f)
    return files, total
