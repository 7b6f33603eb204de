"""Writing DCP (torch.distributed.checkpoint) checkpoints, laid out as FSDP2 saves them.

The output is what ``dcp.save({"model": msd, "optim": osd, ...})`` writes after
``msd, osd = get_state_dict(model, optimizer)`` on an FSDP2 model at world size N
(``Options.world_size``), so ``dcp.load`` + ``set_state_dict`` restore it at any
world size, FSDP2 or a single process:

- every model and optimizer tensor of dim >= 1 is cut on dim 0 in ``torch.chunk``
  sizes (ceil(rows / N) rows per rank; ranks past the data get an empty chunk at
  offset ``rows``, recorded once, as DCP's save planner de-duplicates equal chunks);
- 0-d tensors (Adam's ``step``, 0-d buffers) and tensors held in extra state
  (an RNG state) are one whole chunk, stored once, on the least loaded rank;
- non-tensor values are flattened the way DCP flattens nested state (dicts
  always; a list only when it holds a tensor or a dict) and each leaf is its own
  ``torch.save``\\ d item: ``optim.param_groups.<i>.<key>`` per hyper-parameter,
  ``optim.param_groups.<i>.params`` the list of parameter names;
- tied names are each their own key holding the same values, as ``state_dict()``
  lists them; optimizer state is keyed by parameter name.

Files: ``__<rank>_0.distcp`` per rank, each a gap-free run of items, every item a
complete ``torch.save`` archive (laid out here and filled by the Rust executor, so
tensor bytes are copied once, in parallel, and cast where ``--dtype`` asks);
``.metadata`` last, the commit point: the pickle ``FileSystemWriter.finish`` writes,
naming torch 2.15's classes without importing torch (a conversion never loads
torch: it costs seconds and hundreds of MB) (``planner_data``: each key's real nesting;
``storage_data``: ``MetadataIndex(key, chunk offsets, chunk position)`` ->
``_StorageInfo(file, offset, length)``; for a non-tensor, ``MetadataIndex(key)``).

Metadata forms (``metadata_form``), and which torch reads each:

- ``"current"`` (default): ``TensorProperties`` pickled with its ``strides`` field,
  as torch 2.15 writes it. torch 2.15 reads it; torch 2.14 and earlier cannot
  unpickle it ("too many values to unpack": their ``__setstate__`` takes five).
- ``"compat"``: ``TensorProperties`` pickled with those five fields, as torch
  before 2.15 writes it. torch 2.15 reads it (``strides`` becomes None), and so
  does torch 2.4 to 2.14 (the five fields they unpickle; nested state flattened to
  the keys they flatten it to since 2.4). Checked with 2.15 itself and with the
  pre-2.15 ``__setstate__`` put back in its place (tests/test_dcp_write.py).

The data files are the same bytes in both forms, and neither depends on the torch
installed where Ravex runs. The tests unpickle both with torch and compare them
with the same metadata built from torch's own classes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import _core
from ..._layout import PathItem, StateLayout, layout_of, optimizer_tree, place
from ..._output import Options, out_dtype
from ..._torchfile.write import STORAGE_TYPES, StorageOut, TensorOut, ZipLayout, dumps
from ...errors import RavexError
from ...model import MODEL, OPTIM, Box, Checkpoint, TensorLink, itemsize, numel
from ...plan import OutFile, WritePlan, run
from ...storage import Location
from .reader import METADATA

__all__ = ["METADATA_FORMS", "plan_write", "write"]

METADATA_FORMS = ("current", "compat")
_DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION (2.6 to 2.15)


# ---------------------------------------------------------------- the state to write


@dataclass(frozen=True)
class _Leaf:
    """A tensor of the state: logical tensor ``source`` (the stored one, for a tied alias)."""

    source: str
    shape: tuple[int, ...]
    dtype: str  # output dtype
    sharded: bool  # cut on dim 0 across ranks as FSDP2 does; otherwise one whole chunk


# The layouts ``write`` takes: the source's own (where its reader recorded one, else the
# portable one), Ravex's portable {"model", "optim"} (the DCP recipe's keys), torchtitan's
# ("model", and "optimizer" flattened by flatten_optimizer_state_dict).
LAYOUTS = ("source", "portable", "torchtitan")
TORCHTITAN = StateLayout(("model",), ("optimizer",), optim_flat=True)


def _layout(ckpt: Checkpoint, layout: str | None = None) -> tuple[StateLayout, list[str]]:
    """Where the model and optimizer go: ``layout`` "portable" or "torchtitan",
    else where the source kept them ({"app": {"model", "optim"}}, torchtitan's
    "optimizer", ...), and a note where that has no DCP form: an optimizer keyed
    by position (torch's optimizer.state_dict(); DCP's loaders key optimizer
    state by name) or one in a list (Lightning's "optimizer_states") is written
    in the portable layout."""
    if layout == "portable":
        return StateLayout(), []
    if layout == "torchtitan":
        return TORCHTITAN, []
    if layout not in (None, "source"):
        raise RavexError(f"--layout {layout}: not a dcp layout", hint=f"use one of {', '.join(LAYOUTS)}")
    found = layout_of(ckpt.source)
    if not found.optim_by_position and not any(isinstance(p, int) for p in found.optim):
        return found, []
    where = ".".join(map(str, found.optim))
    keyed = ", keyed by position" if found.optim_by_position else ""
    note = (f"the source keeps its optimizer at '{where}'{keyed}, which DCP's loaders do not read: written in the portable "
            "layout (the model at 'model', the optimizer at 'optim' keyed by parameter name; the source's other keys at the top; "
            "--layout torchtitan for torchtitan's keys)")
    return StateLayout(), [note]


def _state(ckpt: Checkpoint, opts: Options, layout: str | None = None) -> dict[str, Any]:
    """The portable layout ``{"model": sd, "optim": {"state", "param_groups"}, ...extra}``,
    or where the source's ``state_layout`` puts the model and optimizer (a DCP
    source's own nesting, kept by a reshard), tensors as :class:`_Leaf`."""

    def leaf(name: str, sharded: bool) -> _Leaf:
        if name not in ckpt.tensors and name not in ckpt.aliases:
            raise RavexError(f"the state names tensor '{name}', which is not in the checkpoint")
        t = ckpt.resolve(name)
        dtype = out_dtype(t, opts)
        if dtype not in STORAGE_TYPES:
            raise RavexError(f"tensor '{name}' has dtype {dtype}, which Ravex cannot write to DCP yet")
        return _Leaf(t.name, t.shape, dtype, sharded)

    def values(v: Any) -> Any:
        if isinstance(v, TensorLink):
            return leaf(v.name, False)  # a plain (unsharded) tensor, as torch saves one
        if isinstance(v, dict):
            return type(v)((k, values(x)) for k, x in v.items())
        if isinstance(v, list):
            return [values(x) for x in v]
        if isinstance(v, tuple):
            return tuple(values(x) for x in v)
        return v

    names = list(ckpt.tensors) + list(ckpt.aliases)
    nesting = _layout(ckpt, layout)[0]
    root: dict[str, Any] = {}
    place(root, nesting.model, {n[len(MODEL):]: leaf(n, True) for n in names if n.startswith(MODEL)})
    optim_state: dict[str, dict[str, Any]] = {}
    for n in names:
        if n.startswith(OPTIM):
            _, state, fqn = n.split("/", 2)
            optim_state.setdefault(fqn, {})[state] = leaf(n, True)
    if optim_state or "optim.param_groups" in ckpt.objects:
        place(root, nesting.optim, optimizer_tree(nesting, optim_state, values(ckpt.objects.get("optim.param_groups", []))))
    for key, value in ckpt.objects.items():
        if key == "optim.param_groups":
            continue
        if key == "extra" and isinstance(value, dict):
            for k, v in value.items():  # the source's own keys, at their nesting (merged where they share a dict with the model)
                place(root, (str(k),), values(v))
        else:
            place(root, (key,), values(value))
    # No top-level "step" of our own: DCP has no such key (Ravex's reader takes the
    # step from the optimizer's), and a source's own step counters are in its objects.
    return root


def _flatten(root: dict[str, Any]) -> list[tuple[str, tuple[PathItem, ...], Any]]:
    """(flat key, nesting, value) for every leaf, by DCP's rules (torch >= 2.4,
    ``_traverse.traverse_state_dict``): dicts are always entered (an empty one
    vanishes); a list only when it holds a tensor or an entered container; a
    tuple never. The flat key is the nesting joined by dots."""

    def terminal(v: Any) -> bool:
        if isinstance(v, Mapping):
            return False
        if not isinstance(v, list):
            return True
        return not any(isinstance(e, _Leaf) or (isinstance(e, (Mapping, list)) and not terminal(e)) for e in v)

    out: list[tuple[str, tuple[PathItem, ...], Any]] = []
    seen: set[str] = set()

    def visit(path: tuple[PathItem, ...], v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                visit((*path, str(k)), x)
        elif terminal(v):
            key = ".".join(map(str, path))
            if key in seen:
                raise RavexError(f"two values of the state flatten to the same DCP key '{key}'",
                                 hint="rename one of them (DCP joins nested keys with dots)")
            seen.add(key)
            out.append((key, path, v))
        else:
            for i, x in enumerate(v):
                visit((*path, i), x)

    for k, v in root.items():
        visit((str(k),), v)
    return out


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, _Leaf):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    return False


# ---------------------------------------------------------------- torch.save items


@dataclass
class _ItemLayout(ZipLayout):
    """A torch.save archive inside a ``.distcp`` file (ZipLayout's offsets count
    from the archive's first byte; each item places it at its ``file_offset``).
    Items of equal dtype and shape share one layout, which is never changed
    after planning (the CRC-32s are per item, given to ``late``)."""

    data_entries: list[int] = field(default_factory=list)  # entries whose bytes the executor writes


def _archive(pickle_bytes: bytes, data_nbytes: int | None) -> _ItemLayout:
    """The records torch.save writes, in its order; ``data/0`` when the item is a tensor."""
    layout = _ItemLayout("archive")
    layout.data_entries = layout.add_torch_save(pickle_bytes, [] if data_nbytes is None else [("0", data_nbytes, None)])
    return layout


@dataclass
class _Item:
    key: str
    layout: _ItemLayout
    box: Box | None = None  # None: a non-tensor value
    index: int | None = None  # the chunk's position in the key's chunk list
    rank: int = -1
    file_offset: int = 0

    @property
    def data_offset(self) -> int:
        """Absolute offset of the tensor's bytes in the rank file."""
        return self.file_offset + self.layout.entries[self.layout.data_entries[0]].data_offset


# A key's kind, as the core's DcpLayout takes it
_SHARDED, _WHOLE, _BYTES = 0, 1, 2


@dataclass
class _Plan:
    """The output, one entry per key: the core's :class:`~ravex_convert._core.DcpLayout`
    places every item (FSDP2's dim-0 shards, the rest on the least loaded rank)
    and writes ``.metadata``; each key keeps the archive layouts of its few
    distinct shard shapes (full, last, empty), so a rank file's items are built
    only when that file is written (:meth:`items_of`)."""

    world_size: int
    flat: list[tuple[str, tuple[PathItem, ...], Any]]
    layout: _core.DcpLayout
    # per key: (full, last, empty) archive layouts of a sharded tensor; (whole,) otherwise
    archives: list[tuple[_ItemLayout | None, ...]]
    # per key: rows per full shard (a sharded tensor), else 0
    per: list[int]

    @property
    def file_sizes(self) -> list[int]:
        return list(self.layout.file_sizes)

    def _item(self, leaf: int, index: int, rank: int, offset: int, row0: int, rows: int) -> _Item:
        key, _, value = self.flat[leaf]
        archives = self.archives[leaf]
        if not isinstance(value, _Leaf):
            return _Item(key, archives[0], None, None, rank, offset)  # type: ignore[arg-type]
        if len(archives) == 1:
            return _Item(key, archives[0], Box(tuple(0 for _ in value.shape), value.shape), index, rank, offset)  # type: ignore[arg-type]
        which = 2 if rows == 0 else 0 if rows == self.per[leaf] else 1
        box = Box((row0, *(0 for _ in value.shape[1:])), (rows, *value.shape[1:]))
        return _Item(key, archives[which], box, index, rank, offset)  # type: ignore[arg-type]

    def items_of(self, rank: int) -> list[_Item]:
        """Rank ``rank``'s items, in their file's order."""
        return [self._item(leaf, index, rank, offset, row0, rows)
                for leaf, index, offset, _, row0, rows in self.layout.items_of(rank)]

    def by_key(self) -> dict[str, list[_Item]]:
        """Every item, by key (every item of the output as an object: for tests and small outputs)."""
        out: dict[str, list[_Item]] = {key: [] for key, _, _ in self.flat}
        for leaf, index, rank, offset, _, row0, rows in self.layout.items():
            out[self.flat[leaf][0]].append(self._item(leaf, index, rank, offset, row0, rows))
        return out


def _plan(ckpt: Checkpoint, opts: Options, layout: str | None = None) -> _Plan:
    ws = opts.world_size
    flat = _flatten(_state(ckpt, opts, layout))
    layouts: dict[tuple[str, tuple[int, ...]], _ItemLayout] = {}

    def tensor_archive(dtype: str, sizes: tuple[int, ...]) -> _ItemLayout:
        # equal shards (same dtype and shape) have equal archives: one layout serves them all
        shared = layouts.get((dtype, sizes))
        if shared is None:
            n = numel(sizes)
            pkl = dumps(TensorOut(StorageOut("0", dtype, n), sizes))
            shared = layouts[(dtype, sizes)] = _archive(pkl, n * itemsize(dtype))
        return shared

    leaves: list[tuple[str, tuple[PathItem, ...], int, str, list[int], tuple[int, int, int]]] = []
    archives: list[tuple[_ItemLayout | None, ...]] = []
    pers: list[int] = []
    for key, path, value in flat:
        if isinstance(value, _Leaf):
            if value.sharded and value.shape:
                rows, rest = value.shape[0], value.shape[1:]
                per = -(-rows // ws)
                nonempty = -(-rows // per) if per else 0
                full = tensor_archive(value.dtype, (per, *rest)) if rows else None
                last = tensor_archive(value.dtype, (rows - per * (nonempty - 1), *rest)) if rows and rows % per else None
                empty = tensor_archive(value.dtype, (0, *rest)) if nonempty < ws else None
                three = (full, last, empty)
                leaves.append((key, path, _SHARDED, value.dtype, list(value.shape), tuple(a.total if a else 0 for a in three)))  # type: ignore[arg-type]
                archives.append(three)
                pers.append(per)
                continue
            whole = tensor_archive(value.dtype, value.shape)
            leaves.append((key, path, _WHOLE, value.dtype, list(value.shape), (whole.total, 0, 0)))
        else:
            if _holds_tensor(value):
                where = "/".join(map(str, path))
                raise RavexError(f"the state value at '{where}' holds a tensor inside a tuple or set, which DCP would pickle whole",
                                 hint="keep tensors in dicts or lists in the extra state")
            whole = _archive(dumps(value), None)
            leaves.append((key, path, _BYTES, "", [], (whole.total, 0, 0)))
        archives.append((whole,))
        pers.append(0)
    try:
        placed = _core.DcpLayout(leaves, ws)
    except ValueError as exc:
        raise RavexError(f"the DCP output cannot be laid out: {exc}") from None
    return _Plan(ws, flat, placed, archives, pers)


# ---------------------------------------------------------------- .metadata

# ``.metadata`` is written by the core (``DcpLayout.metadata``, src/dcp.rs), as
# ``FileSystemWriter.finish`` pickles torch 2.15's classes, without importing
# torch: ``Metadata`` with ``state_dict_metadata``, ``planner_data`` (each key's
# nesting), ``storage_data`` (``MetadataIndex(key, chunk offsets, chunk position)``
# -> ``_StorageInfo(file, offset, length)``, which pickles without its None
# fields; a non-tensor's index is ``MetadataIndex(key)``), ``storage_meta`` and
# ``version``. ``TensorProperties`` pickles through its ``__getstate__``: dtype,
# layout, requires_grad, the memory-format enum, pin_memory and (form
# "current") strides. tests/test_dcp_plan.py holds the same pickle built from
# Python objects, and torch's own classes, as its oracles.


def _file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


# ---------------------------------------------------------------- writing


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options, *, metadata_form: str = "current", layout: str | None = None) -> WritePlan:
    """Plan ``ckpt`` as a DCP checkpoint directory sharded as FSDP2 shards at
    ``opts.world_size`` ranks (see the module docstring), built beside ``dst``
    and renamed into place; ``.metadata`` is written last. ``metadata_form``:
    ``"current"`` (torch >= 2.15 reads it) or ``"compat"`` (torch 2.4 and later).

    The plan holds one entry per key, not per item: each rank file's records
    are built by the rank that writes it (``OutFile.build``), and ``.metadata``
    by the coordinator at the commit."""
    if metadata_form not in METADATA_FORMS:
        raise RavexError(f"metadata form '{metadata_form}' is unknown", hint=f"use one of {', '.join(METADATA_FORMS)}")
    if opts.world_size < 1:
        raise RavexError(f"--world-size {opts.world_size}: a DCP checkpoint needs at least one rank", hint="pass --world-size 1 or more")
    plan = _plan(ckpt, opts, layout)
    ws = plan.world_size
    sizes = plan.file_sizes
    files = [OutFile(_file_name(r), sizes[r], build=_builder(plan, ckpt, r)) for r in range(ws)]
    current = metadata_form == "current"
    save_id = str(uuid.uuid4())
    meta_len = plan.layout.metadata_size(current, save_id)
    summary = {"files": [_file_name(r) for r in range(ws)] + [METADATA], "tensors": len(ckpt.tensors), "keys": len(plan.flat),
               "items": len(plan.layout), "bytes": sum(sizes) + meta_len, "world_size": ws, "metadata_form": metadata_form}
    notes = _layout(ckpt, layout)[1]
    if notes:
        summary["notes"] = notes

    def commit(_: dict[str, Any]) -> list[tuple[str, bytes]]:
        return [(METADATA, plan.layout.metadata(current, save_id))]

    # the commit point: .metadata, once every data file is complete and durable
    return WritePlan(True, files, commit, summary, threads=opts.threads)


def _builder(plan: _Plan, ckpt: Checkpoint, rank: int) -> Callable[[OutFile], None]:
    """Fills rank ``rank``'s file records: each item archive's small records,
    the ranges whose CRC-32 its late records need, its tensor's bytes, and the
    late records (headers with the CRC-32s, the central directory)."""

    def build(f: OutFile) -> None:
        items = plan.items_of(rank)
        values = {key: value for key, _, value in plan.flat}
        for it in items:
            f.small += it.layout.small(it.file_offset)
            f.crc_ranges += it.layout.ranges(it.file_offset)
            value = values[it.key]
            if it.box is not None and it.box.numel:
                f.fills.append((ckpt.tensors[value.source], it.data_offset, it.box, value.dtype))
        f.finish = _finisher(items)

    return build


def _finisher(items: list[_Item]) -> Callable[[list[int]], list[tuple[int, bytes]]]:
    """A rank file's late bytes: each item archive's CRC-filled headers and central directory."""

    def finish(crcs: list[int]) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        at = 0
        for it in items:
            n = len(it.layout.data_entries)
            out += it.layout.late(crcs[at:at + n], it.file_offset)
            at += n
        return out

    return finish


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Any = None, *, metadata_form: str = "current",
          layout: str | None = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed (``layout``: one of :data:`LAYOUTS`)."""
    return run(plan_write(ckpt, dst, opts, metadata_form=metadata_form, layout=layout), dst, force=opts.force, progress=progress)
