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

from .._layout import PathItem, StateLayout, layout_of, optimizer_tree, place
from .._output import Options, out_dtype
from .._torchwrite import STORAGE_TYPES, PickleDict, PickleGlobal, PickleObject, StorageOut, TensorOut, ZipLayout, dumps
from ..errors import RavexError
from ..model import MODEL, OPTIM, Box, Checkpoint, TensorLink, dim0_shards, itemsize
from ..plan import OutFile, WritePlan, run
from .dcp import METADATA

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


def _dim0_boxes(shape: tuple[int, ...], world_size: int) -> list[tuple[int, Box]]:
    """FSDP2's dim-0 shards (:func:`~ravex_convert.model.dim0_shards`), equal boxes
    once (the first rank keeps it). Unlike the native store, which records no
    empty chunk, DCP records the empty box of the ranks past the data, once, at
    offset ``rows``, as DCP's save planner de-duplicates equal chunks: deliberate,
    it is what ``dcp.save`` writes from an FSDP2 model."""
    out: list[tuple[int, Box]] = []
    seen: set[int] = set()
    for r, box in dim0_shards(shape, world_size):
        if box.offsets[0] in seen:
            continue
        seen.add(box.offsets[0])
        out.append((r, box))
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@dataclass
class _Plan:
    world_size: int
    flat: list[tuple[str, tuple[PathItem, ...], Any]]
    items: list[_Item] = field(default_factory=list)
    by_key: dict[str, list[_Item]] = field(default_factory=dict)
    file_sizes: list[int] = field(default_factory=list)


def _plan(ckpt: Checkpoint, opts: Options, layout: str | None = None) -> _Plan:
    ws = opts.world_size
    plan = _Plan(ws, _flatten(_state(ckpt, opts, layout)))
    load = [0] * ws
    floating: list[_Item] = []  # placed after the shards, on the least loaded rank
    layouts: dict[tuple[str, tuple[int, ...]], _ItemLayout] = {}
    for key, path, value in plan.flat:
        items: list[_Item] = []
        if isinstance(value, _Leaf):
            if value.sharded and value.shape:
                boxes = _dim0_boxes(value.shape, ws)
            else:
                boxes = [(-1, Box(tuple(0 for _ in value.shape), value.shape))]
            for i, (rank, box) in enumerate(boxes):
                # equal shards (same dtype and shape) have equal archives: one layout serves them all
                shared = layouts.get((value.dtype, box.sizes))
                if shared is None:
                    pkl = dumps(TensorOut(StorageOut("0", value.dtype, box.numel), box.sizes))
                    shared = layouts[(value.dtype, box.sizes)] = _archive(pkl, box.numel * itemsize(value.dtype))
                items.append(_Item(key, shared, box, i, rank))
        else:
            if _holds_tensor(value):
                where = "/".join(map(str, path))
                raise RavexError(f"the state value at '{where}' holds a tensor inside a tuple or set, which DCP would pickle whole",
                                 hint="keep tensors in dicts or lists in the extra state")
            items.append(_Item(key, _archive(dumps(value), None)))
        for it in items:
            if it.rank >= 0:
                load[it.rank] += it.layout.total
            else:
                floating.append(it)
        plan.by_key[key] = items
        plan.items.extend(items)
    for it in floating:
        it.rank = min(range(ws), key=lambda r: load[r])
        load[it.rank] += it.layout.total
    plan.file_sizes = [0] * ws
    for it in plan.items:
        it.file_offset = plan.file_sizes[it.rank]
        plan.file_sizes[it.rank] += it.layout.total
    return plan


# ---------------------------------------------------------------- .metadata


_MD = "torch.distributed.checkpoint.metadata"


def _dataclass(name: str, state: dict[str, Any] | None, module: str = _MD) -> PickleObject:
    """A dataclass instance as pickle writes it: ``cls.__new__(cls)``, then its ``__dict__``."""
    return PickleObject(module, name, (), state=state or None, newobj=True)


def _size(dims: tuple[int, ...]) -> PickleObject:
    return PickleObject("torch", "Size", (tuple(dims),))


def _metadata(plan: _Plan, form: str) -> bytes:
    """``.metadata`` as ``FileSystemWriter.finish`` pickles torch 2.15's classes, written
    without importing torch (the classes are named, never loaded): ``Metadata`` with
    ``state_dict_metadata``, ``planner_data``, ``storage_data`` (``MetadataIndex`` ->
    ``_StorageInfo``, which pickles without its None fields), ``storage_meta`` and
    ``version``. ``TensorProperties`` pickles through its ``__getstate__``: dtype, layout,
    requires_grad, the memory-format enum, pin_memory and (form "current") strides."""
    sd_meta: dict[str, Any] = {}
    planner: dict[str, tuple[PathItem, ...]] = {}
    storage: list[tuple[Any, Any]] = []

    def info(it: _Item) -> PickleObject:
        return _dataclass("_StorageInfo", {"relative_path": _file_name(it.rank), "offset": it.file_offset, "length": it.layout.total},
                          module="torch.distributed.checkpoint.filesystem")

    for key, path, value in plan.flat:
        planner[key] = path
        items = plan.by_key[key]
        if isinstance(value, _Leaf):
            props: tuple[Any, ...] = (PickleGlobal("torch", value.dtype), PickleGlobal("torch", "strided"), False,
                                      PickleObject(_MD, "_MEM_FORMAT_ENCODING", (0,)), False)
            if form == "current":
                props += (_strides(value.shape),)  # the global tensor's, as DTensor.stride() gives
            chunks = [_dataclass("ChunkStorageMetadata", {"offsets": _size(it.box.offsets), "sizes": _size(it.box.sizes)})
                      for it in items if it.box]
            properties = PickleObject(_MD, "TensorProperties", (), state=props, newobj=True)
            sd_meta[key] = _dataclass("TensorStorageMetadata", {"properties": properties, "size": _size(value.shape), "chunks": chunks})
            for it in items:
                index = {"fqn": key, "index": it.index, "offset": _size(it.box.offsets if it.box else ())}
                storage.append((_dataclass("MetadataIndex", index), info(it)))
        else:
            sd_meta[key] = _dataclass("BytesStorageMetadata", None)
            storage.append((_dataclass("MetadataIndex", {"fqn": key, "index": None}), info(items[0])))
    meta: dict[str, Any] = {"checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None, "modules": []}
    return dumps(_dataclass("Metadata", {"state_dict_metadata": sd_meta, "planner_data": planner, "storage_data": PickleDict(tuple(storage)),
                                         "storage_meta": _dataclass("StorageMeta", meta), "version": _DCP_VERSION}), memo=True)


def _file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


# ---------------------------------------------------------------- writing


def plan_write(ckpt: Checkpoint, dst: Path, opts: Options, *, metadata_form: str = "current", layout: str | None = None) -> WritePlan:
    """Plan ``ckpt`` as a DCP checkpoint directory sharded as FSDP2 shards at
    ``opts.world_size`` ranks (see the module docstring), built beside ``dst``
    and renamed into place; ``.metadata`` is written last. ``metadata_form``:
    ``"current"`` (torch >= 2.15 reads it) or ``"compat"`` (torch 2.4 and later)."""
    if metadata_form not in METADATA_FORMS:
        raise RavexError(f"metadata form '{metadata_form}' is unknown", hint=f"use one of {', '.join(METADATA_FORMS)}")
    if opts.world_size < 1:
        raise RavexError(f"--world-size {opts.world_size}: a DCP checkpoint needs at least one rank", hint="pass --world-size 1 or more")
    plan = _plan(ckpt, opts, layout)
    meta = _metadata(plan, metadata_form)  # before any byte is written: torch's classes must accept it
    ws = plan.world_size
    files = [OutFile(_file_name(r), plan.file_sizes[r]) for r in range(ws)]
    for it in plan.items:
        f = files[it.rank]
        f.small += it.layout.small(it.file_offset)
        f.crc_ranges += it.layout.ranges(it.file_offset)
    for key, _, value in plan.flat:
        if isinstance(value, _Leaf):
            for it in plan.by_key[key]:
                if it.box and it.box.numel:
                    files[it.rank].fills.append((ckpt.tensors[value.source], it.data_offset, it.box, value.dtype))
    for r, f in enumerate(files):
        f.finish = _finisher([it for it in plan.items if it.rank == r])
    total = sum(plan.file_sizes) + len(meta)
    summary = {"files": [_file_name(r) for r in range(ws)] + [METADATA], "tensors": len(ckpt.tensors), "keys": len(plan.flat),
               "items": len(plan.items), "bytes": total, "world_size": ws, "metadata_form": metadata_form}
    notes = _layout(ckpt, layout)[1]
    if notes:
        summary["notes"] = notes
    # the commit point: .metadata, once every data file is complete and durable
    return WritePlan(True, files, [(METADATA, meta)], summary, threads=opts.threads)


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


def write(ckpt: Checkpoint, dst: Path, opts: Options, progress: Any = None, *, metadata_form: str = "current",
          layout: str | None = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed (``layout``: one of :data:`LAYOUTS`)."""
    return run(plan_write(ckpt, dst, opts, metadata_form=metadata_form, layout=layout), dst, force=opts.force, progress=progress)
