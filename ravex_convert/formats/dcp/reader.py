"""DCP: PyTorch Distributed Checkpoint (what FSDP2 and torchtitan write).

A directory with ``.metadata`` (a pickled ``Metadata``: per key the global
size, dtype and chunks; ``planner_data`` maps each flat key to its nesting in
the saved state dict; ``storage_data`` maps (key, chunk offset) to a byte range
of a ``__<rank>_<n>.distcp`` file) and the data files. Every item in a data
file is a complete torch.save archive; we read ``.metadata`` with the
restricted unpickler, never torch's.

The state may be nested anywhere (``dcp.save({"app": AppState})`` puts the
model at ``app.model.<fqn>``; torchtitan keeps ``model`` and a flattened
``optimizer``): :func:`classify` finds the model and the optimizer wherever
they sit and records where as a :class:`~ravex_convert._layout.StateLayout`, so
writing DCP or torch_save back keeps the source's own structure.

Everything ``.metadata`` declares is checked before use (``_validate``): data
files stay inside the checkpoint, chunks lie inside their tensor and tile it
exactly once, no more than ``RAVEX_MAX_CHUNKS_PER_TENSOR`` of them, and stored
items lie inside their file without overlapping one another, so a conversion
never writes more than the source holds.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._dtypes import DTYPE_SIZES
from ..._layout import SOURCE_KEY, PathItem, StateLayout, dotted, layout_of, regroup, unflatten
from ..._limits import MAX_CHUNKS_PER_TENSOR_ENV, max_chunks_per_tensor
from ..._paths import inside
from ..._torchfile.archive import TorchArchive, open_archive, verify_many
from ..._torchfile.unpickle import Record, TensorRef, restricted_loads
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, from_os_error
from ...info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ...model import MODEL, OBJ, OPTIM, Box, Checkpoint, Chunk, LogicalTensor, TensorLink, numel

__all__ = ["METADATA", "DcpItem", "DcpMetadata", "DcpTensor", "Roles", "classify", "describe", "read", "read_metadata", "sniff"]

METADATA = ".metadata"
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_MODEL_KEYS = ("model", "module", "model_state_dict", "state_dict")
_OPTIM_KEYS = ("optim", "optimizer", "optimizer_state_dict")
_GRID_CELLS = 1 << 22  # N-d chunk layouts are checked on the grid of their cut points, up to this many cells
_RECOPY = "copy .metadata again from where the run saved it (it is written last, so a partial copy lacks it)"


@dataclass
class DcpItem:
    """One stored piece of a key: where its bytes are."""

    offsets: tuple[int, ...]  # chunk offsets in the global tensor (() for non-tensors)
    file: str
    offset: int
    length: int


@dataclass
class DcpTensor:
    key: str
    path: tuple[PathItem, ...]  # the real nesting, e.g. ("app", "optim", "state", "embed.weight", "exp_avg")
    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offsets, sizes)


@dataclass
class DcpMetadata:
    tensors: dict[str, DcpTensor]
    objects: dict[str, tuple[PathItem, ...]]  # non-tensor keys and their nesting
    items: dict[tuple[str, tuple[int, ...]], DcpItem]
    has_strides: bool  # written by a torch whose TensorProperties carry strides (2.15+)
    files: dict[str, Path] = field(default_factory=dict)  # data file name -> its path, checked to lie inside the root


def sniff(path: Path) -> list[str] | None:
    if path.is_file() and path.name == METADATA:
        return [f"{path.name} is DCP's metadata file"]
    if path.is_dir() and (path / METADATA).is_file():
        n = sum(1 for p in path.iterdir() if _DATA_FILE.match(p.name))
        return [f"found {METADATA} and {n} .distcp data file(s)"]
    return None


# ---------------------------------------------------------------- .metadata


class _Bad(Exception):
    """A field of .metadata that is missing or of the wrong kind (turned into one error)."""


def _field(rec: Any, name: str, position: int | None = None) -> Any:
    if isinstance(rec, Record):
        if isinstance(rec.state, dict) and name in rec.state:
            return rec.state[name]
        if isinstance(rec.state, tuple) and len(rec.state) == 2 and isinstance(rec.state[1], dict) and name in rec.state[1]:
            return rec.state[1][name]  # (dict, slots) state of a slotted dataclass
        if position is not None and isinstance(rec.state, tuple) and position < len(rec.state):
            return rec.state[position]
        if position is not None and position < len(rec.args):
            return rec.args[position]
    raise _Bad(f"no field '{name}'")


def _has(rec: Any, name: str) -> bool:
    try:
        _field(rec, name)
        return True
    except _Bad:
        return False


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _Bad(f"{what} is {v!r}, not a non-negative integer")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)):
        raise _Bad(f"{what} is {type(v).__name__}, not a list of integers")
    return tuple(_int(x, what) for x in v)


def _path_of(key: str, planner: dict[Any, Any]) -> tuple[PathItem, ...]:
    """The key's nesting from planner_data (DCP's flattening: the path joined by
    dots is the key); ``(key,)`` where the planner recorded none."""
    raw = planner.get(key)
    if raw is None:
        return (key,)
    if not isinstance(raw, (tuple, list)) or not raw or not all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0) for p in raw):
        raise _Bad(f"planner_data for '{key}' is {raw!r}, not a path of names and list indices")
    path = tuple(raw)
    if ".".join(map(str, path)) != key:
        raise _Bad(f"planner_data places '{key}' at {'.'.join(map(str, path))!r}")
    return path


def read_metadata(root: Path) -> DcpMetadata:
    """``.metadata`` unpickled (restricted) and checked: every later step may
    trust its shapes, chunks and byte ranges."""
    meta_path = inside(root, METADATA, "metadata file", root)
    try:
        data = meta_path.read_bytes()
    except OSError as exc:
        raise from_os_error(exc, path=meta_path) from None
    meta = restricted_loads(data, meta_path)

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{meta_path}: not a valid DCP Metadata object ({why}; the file is damaged or was written by something else)",
                                      hint=_RECOPY, path=meta_path)

    if not isinstance(meta, Record) or not meta.cls.endswith(".Metadata"):
        raise bad(f"it holds {meta.cls if isinstance(meta, Record) else type(meta).__name__}")
    try:
        return _validate(root, meta_path, meta)
    except _Bad as exc:
        raise bad(str(exc)) from None


def _validate(root: Path, meta_path: Path, meta: Record) -> DcpMetadata:
    sd_meta = _field(meta, "state_dict_metadata", 0)
    planner = _field(meta, "planner_data", 1) if _has(meta, "planner_data") else None
    storage = _field(meta, "storage_data", 2)
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise _Bad("state_dict_metadata or storage_data is not a mapping")
    planner = planner if isinstance(planner, dict) else {}
    limit = max_chunks_per_tensor()
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[PathItem, ...]] = {}
    has_strides = False
    for key, m in sd_meta.items():
        if not isinstance(key, str) or not key:
            raise _Bad(f"a key is {key!r}, not a name")
        path = _path_of(key, planner)
        if not (isinstance(m, Record) and m.cls.endswith("TensorStorageMetadata")):
            if not (isinstance(m, Record) and m.cls.endswith("BytesStorageMetadata")):
                raise _Bad(f"'{key}' is described by {m.cls if isinstance(m, Record) else type(m).__name__}")
            objects[key] = path
            continue
        props = _field(m, "properties", 0)
        dtype = str(_field(props, "dtype", 0))
        if dtype not in DTYPE_SIZES:
            raise _Bad(f"tensor '{key}' has dtype {dtype!r}, which Ravex does not know")
        if isinstance(props.state, tuple) and len(props.state) >= 6:
            has_strides = True
        shape = _ints(_field(m, "size", 1), f"the size of '{key}'")
        raw_chunks = _field(m, "chunks", 2)
        if not isinstance(raw_chunks, list):
            raise _Bad(f"the chunks of '{key}' are not a list")
        if len(raw_chunks) > limit:
            raise CorruptCheckpointError(
                f"{meta_path}: tensor '{key}' is stored in {len(raw_chunks)} chunks, more than the limit of {limit}",
                hint=f"a real checkpoint has at most one chunk per rank; if this one is genuine, raise the limit with {MAX_CHUNKS_PER_TENSOR_ENV}",
                path=meta_path)
        chunks = [(_ints(_field(c, "offsets", 0), f"a chunk offset of '{key}'"), _ints(_field(c, "sizes", 1), f"a chunk size of '{key}'"))
                  for c in raw_chunks]
        _check_tiling(meta_path, key, shape, chunks)
        tensors[key] = DcpTensor(key, path, shape, dtype, chunks)
    items: dict[tuple[str, tuple[int, ...]], DcpItem] = {}
    for idx, sinfo in storage.items():
        fqn = _field(idx, "fqn", 0)
        if not isinstance(fqn, str):
            raise _Bad(f"a storage entry names {fqn!r}, not a key")
        offs = _field(idx, "offset", 1) if _has(idx, "offset") else None
        offsets = _ints(offs, f"the storage offset of '{fqn}'") if offs is not None else ()
        rel = _field(sinfo, "relative_path", 0)
        if not isinstance(rel, str):
            raise _Bad(f"the data file of '{fqn}' is {rel!r}, not a file name")
        if _has(sinfo, "transform_descriptors") and _field(sinfo, "transform_descriptors"):
            raise RavexError(f"{meta_path}: '{fqn}' is stored through a transform ({_field(sinfo, 'transform_descriptors')!r}), "
                             "which Ravex cannot read yet", hint="save the checkpoint without DCP's storage extensions (compression)", path=meta_path)
        items[(fqn, offsets)] = DcpItem(offsets, rel, _int(_field(sinfo, "offset", 1), f"the byte offset of '{fqn}'"),
                                        _int(_field(sinfo, "length", 2), f"the byte length of '{fqn}'"))
    for key, t in tensors.items():
        for offsets, _ in t.chunks:
            if (key, offsets) not in items:
                raise _Bad(f"no storage entry for tensor '{key}' at offsets {list(offsets)}")
    for key in objects:
        if (key, ()) not in items:
            raise _Bad(f"no storage entry for '{key}'")
    files = {name: inside(root, name, "data file", meta_path) for name in sorted({it.file for it in items.values()})}
    return DcpMetadata(tensors, objects, items, has_strides, files)


def _check_tiling(meta_path: Path, key: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Every chunk inside the tensor, and the chunks covering each element exactly once."""

    def refuse(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{meta_path}: tensor '{key}' (shape {list(shape)}): {why}",
                                      hint="the metadata is damaged or was not written by DCP; " + _RECOPY, path=meta_path)

    total = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise refuse(f"a chunk at {list(offsets)} of size {list(sizes)} has the wrong number of dimensions")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise refuse(f"the chunk at {list(offsets)} of size {list(sizes)} reaches outside the tensor")
        n = numel(sizes)
        if n:
            boxes.append((offsets, sizes))
            total += n
    if total != numel(shape):
        raise refuse(f"its chunks hold {total} elements, the tensor has {numel(shape)}")
    if len(boxes) <= 1:
        return
    if all(s == d for _, sizes in boxes for s, d in zip(sizes[1:], shape[1:])):
        # cut on dim 0 only (FSDP): the row ranges must follow one another
        rows = sorted((o[0], s[0]) for o, s in boxes)
        for (a, n), (b, _) in itertools.pairwise(rows):
            if a + n > b:
                raise refuse(f"two chunks both hold row {b}")
        return
    import numpy as np  # N-d layouts (tensor parallel) only

    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + s[i] for o, s in boxes)}) for i, d in enumerate(shape)]
    cells = numel(tuple(len(c) - 1 for c in cuts))
    if cells > _GRID_CELLS:
        raise refuse(f"its {len(boxes)} chunks form no regular grid ({cells} cells to check)")
    seen = np.zeros(tuple(len(c) - 1 for c in cuts), dtype=np.uint8)
    where = [{v: j for j, v in enumerate(c)} for c in cuts]
    for offsets, sizes in boxes:
        sl = tuple(slice(where[i][o], where[i][o + s]) for i, (o, s) in enumerate(zip(offsets, sizes)))
        if seen[sl].any():
            raise refuse(f"the chunk at {list(offsets)} of size {list(sizes)} overlaps another")
        seen[sl] = 1


def _check_files(root: Path, meta: DcpMetadata) -> list[FileInfo]:
    """Each data file present, each item inside it, and no two items sharing bytes."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for (key, _), item in meta.items.items():
        ranges.setdefault(item.file, []).append((item.offset, item.length, key))
    meta_path = root / METADATA
    files = [FileInfo(METADATA, meta_path.stat().st_size, "metadata")]
    for name in sorted(ranges):
        p = meta.files[name]
        if not p.is_file():
            raise IncompleteCheckpointError(
                f"{root}: .metadata names data file '{name}' but it is missing",
                hint="copy every __<rank>_<n>.distcp file that the save wrote (one or more per rank)",
                path=p,
            )
        size = p.stat().st_size
        spans = sorted(ranges[name])
        end, last_key = spans[-1][0] + spans[-1][1], spans[-1][2]
        if size < end:
            raise CorruptCheckpointError(
                f"{p}: the file is {size} bytes but .metadata places '{last_key}' up to byte {end}",
                hint="the data file is truncated; copy it again",
                path=p,
            )
        for (a, n, ka), (b, _, kb) in itertools.pairwise(spans):
            if a + n > b:
                raise CorruptCheckpointError(
                    f"{meta_path}: the items of '{ka}' and '{kb}' share bytes {b}..{a + n} of {name}",
                    hint="DCP stores each item once; the metadata is damaged or crafted. " + _RECOPY,
                    path=meta_path)
        m = _DATA_FILE.match(name)
        files.append(FileInfo(name, size, "data", int(m.group(1)) if m else None))
    return files


# ---------------------------------------------------------------- where the model and optimizer sit


@dataclass
class Roles:
    """What each key of the state is: a model tensor, optimizer state, a param
    group value, or other state (kept at its nesting)."""

    layout: StateLayout
    model_found: bool
    optim_found: bool
    names: dict[str, str] = field(default_factory=dict)  # tensor key -> logical name
    groups: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (group index or fqn, hyper-parameter)


def _flat_parts(entry: str, head: str, fqns: set[str]) -> tuple[str, str] | None:
    """``"state.<fqn>.<name>"`` -> (fqn, name): the longest known parameter name
    that fits (a state may nest: Shampoo), else the last dot
    (flatten_optimizer_state_dict's form)."""
    rest = entry[len(head) + 1:]
    pos = rest.rfind(".")
    while pos > 0:
        if rest[:pos] in fqns:
            return rest[:pos], rest[pos + 1:]
        pos = rest.rfind(".", 0, pos)
    fqn, dot, name = rest.rpartition(".")
    return (fqn, name) if dot and fqn and name else None


def classify(meta: DcpMetadata) -> Roles:
    """Where the model and the optimizer sit in a state's flattened keys (see the module's
    docstring), and each key's role; the torch_save reader hands a nested file's tree here too."""
    paths: dict[str, tuple[PathItem, ...]] = {k: t.path for k, t in meta.tensors.items()} | meta.objects
    # optimizer candidates: prefix -> [state tensors, param group leaves, flattened form]
    cands: dict[tuple[tuple[PathItem, ...], bool], list[int]] = {}
    for key, path in paths.items():
        for i, p in enumerate(path):
            if not isinstance(p, str):
                continue
            rest = len(path) - i
            if p == "state" and rest == 3 and key in meta.tensors:
                cands.setdefault((path[:i], False), [0, 0])[0] += 1
            elif p == "param_groups" and rest == 3:
                cands.setdefault((path[:i], False), [0, 0])[1] += 1
            elif rest == 1 and p.startswith("state.") and key in meta.tensors:
                cands.setdefault((path[:i], True), [0, 0])[0] += 1
            elif rest == 1 and p.startswith("param_groups."):
                cands.setdefault((path[:i], True), [0, 0])[1] += 1
    found = [c for c, (_, groups) in cands.items() if groups]
    optim: tuple[tuple[PathItem, ...], bool] | None = None
    if found:
        optim = max(found, key=lambda c: (cands[c][0], bool(c[0]) and c[0][-1] in _OPTIM_KEYS, -len(c[0])))
    roles = Roles(StateLayout(), False, optim is not None)
    optim_fqns: set[str] = set()
    if optim is not None:
        prefix, flat = optim
        n = len(prefix)
        group_fqns = {str(path[n])[len("param_groups."):].rpartition(".")[0] for path in paths.values()
                      if flat and len(path) == n + 1 and path[:n] == prefix and str(path[n]).startswith("param_groups.")}
        for key, path in paths.items():
            if len(path) < n + 1 or path[:n] != prefix:
                continue
            sub = path[n:]
            parts: tuple[str, str] | None = None
            kind = ""
            if not flat and len(sub) == 3 and sub[0] in ("state", "param_groups") and all(isinstance(s, (str, int)) for s in sub[1:]):
                parts = (str(sub[1]), str(sub[2]))
                kind = str(sub[0])
            elif flat and len(sub) == 1 and str(sub[0]).startswith(("state.", "param_groups.")):
                kind = "state" if str(sub[0]).startswith("state.") else "param_groups"
                parts = _flat_parts(str(sub[0]), kind, group_fqns)
            if parts is None:
                continue
            if kind == "state" and key in meta.tensors and "/" not in parts[1]:
                roles.names[key] = f"{OPTIM}{parts[1]}/{parts[0]}"
                optim_fqns.add(parts[0])
            elif kind == "param_groups":
                roles.groups[key] = parts
    # the model: the group of sibling tensors that the optimizer's names match best,
    # else the one under a model-like key, else the top level, else the only group
    siblings: dict[tuple[PathItem, ...], list[str]] = {}
    for key, t in meta.tensors.items():
        if key not in roles.names and key not in roles.groups and isinstance(t.path[-1], str):
            siblings.setdefault(t.path[:-1], []).append(key)
    model: tuple[PathItem, ...] | None = None
    if siblings:
        overlap = {p: len(optim_fqns & {str(meta.tensors[k].path[-1]) for k in ks}) for p, ks in siblings.items()}
        best = max(siblings, key=lambda p: (overlap[p], bool(p) and p[-1] in _MODEL_KEYS, -len(p)))
        if overlap[best] or (best and best[-1] in _MODEL_KEYS) or best == () or len(siblings) == 1:
            model = best
    if model is not None:
        roles.model_found = True
        for key in siblings[model]:
            roles.names[key] = MODEL + str(meta.tensors[key].path[-1])
    roles.layout = StateLayout(model if model is not None else ("model",), optim[0] if optim else ("optim",), bool(optim and optim[1]))
    for key, t in meta.tensors.items():
        roles.names.setdefault(key, OBJ + "/".join(map(str, t.path)))
    return roles


def _display_name(name: str) -> tuple[str, str]:
    """(name inspect shows, kind) of a logical name."""
    if name.startswith(MODEL):
        return name[len(MODEL):], "param"
    if name.startswith(OPTIM):
        state, fqn = name[len(OPTIM):].split("/", 1)
        return f"optim.{state}/{fqn}", "optim"
    return name[len(OBJ):], "other"


# ---------------------------------------------------------------- describe and read


@dataclass
class _Seen:
    """What the layout says beside the checkpoint's tensors: for :func:`describe`."""

    files: list[FileInfo]  # .metadata and every data file, checked present and large enough
    world_size: int | None  # from the data files' names (__<rank>_<n>.distcp); None without such names
    sharded: bool  # some tensor is stored in more than one chunk
    model_found: bool
    optim_found: bool


def describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    """What :func:`read` finds, as ``inspect`` shows it: ``.metadata`` read and
    checked once, and the data files' items left unopened but for the step's."""
    ckpt, seen = _read(path, shallow=True)
    info = CheckpointInfo("dcp", "sharded" if seen.sharded else "unsharded", str(ckpt.path), world_size=seen.world_size, step=ckpt.step,
                          reasons=list(reasons), files=seen.files)
    if seen.world_size is not None:
        info.reasons.append(f"world size {info.world_size} inferred from data file names (__<rank>_<n>.distcp)")
    for name, t in ckpt.tensors.items():
        shown, kind = _display_name(name)
        info.tensors.append(TensorInfo(shown, t.shape, t.dtype, kind))
    if seen.optim_found:
        # get_state_dict flattens param groups per parameter name, so the number
        # of groups is not visible without reading the items: left unknown.
        states = ckpt.optimizer_state_names()
        info.optimizer = OptimizerInfo("Adam" if {"exp_avg", "exp_avg_sq"} <= set(states) else "unknown", states, None)
    layout = layout_of(ckpt.source)
    if seen.model_found and layout != StateLayout():
        info.reasons.append(f"model state dict at '{dotted(layout.model)}'" + (f", optimizer at '{dotted(layout.optim)}'" if seen.optim_found else ""))
    info.notes = [*ckpt.notes, NO_PARAM_MARKS]
    info.extra["metadata_form"] = ckpt.source["metadata_form"]
    info.extra["state_layout"] = layout.describe()
    return info


def _open_item(meta: DcpMetadata, key: str, offsets: tuple[int, ...]) -> TorchArchive:
    item = meta.items[(key, offsets)]  # present: checked in read_metadata
    return open_archive(meta.files[item.file], item.offset, item.length)


def _read_step(meta: DcpMetadata, roles: Roles) -> int | None:
    """The optimizer's step, read from the first parameter's ``step`` item."""
    for key, t in meta.tensors.items():
        if roles.names[key].startswith(OPTIM + "step/") and t.shape in ((), (1,)):
            archive = _open_item(meta, key, tuple(0 for _ in t.shape))
            ref = archive.root
            if isinstance(ref, TensorRef) and ref.numel == 1 and ref.dtype in ("float32", "float64", "int64", "int32"):
                _tensor_in(archive, ref, t, key, tuple(0 for _ in t.shape), t.shape)
                return int(archive.read_scalar(ref))
            return None
    for key, nesting in meta.objects.items():
        if nesting[-1] in ("step", "global_step"):
            value = _open_item(meta, key, ()).root
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _tensor_in(archive: TorchArchive, ref: Any, t: DcpTensor, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Check that the item holds the chunk .metadata says, inside its storage."""
    where = f"{archive.path} (item at byte {archive.base})"
    hint = "the data file is damaged, or it and .metadata come from different saves; copy the checkpoint again"
    if not isinstance(ref, TensorRef) or ref.shape != sizes or ref.dtype != t.dtype:
        got = f"{ref.dtype} tensor of shape {list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__
        raise CorruptCheckpointError(f"{where}: the item for '{key}' at {list(offsets)} holds a {got}, .metadata says a {t.dtype} tensor "
                                     f"of shape {list(sizes)}", hint=hint, path=archive.path)
    if not ref.is_contiguous():
        raise CorruptCheckpointError(f"{where}: the item for '{key}' holds a non-contiguous tensor", hint=hint, path=archive.path)
    begin = archive.tensor_offset(ref)
    key_ = ref.storage.key
    if ref.storage_offset < 0 or begin + ref.nbytes > archive.storage_offsets[key_] + archive.storage_sizes[key_]:
        raise CorruptCheckpointError(f"{where}: the tensor of '{key}' reaches past the end of its storage", hint=hint, path=archive.path)
    return True


def _read(path: Path, *, shallow: bool = False) -> tuple[Checkpoint, _Seen]:
    """``.metadata`` read and checked, the data files checked present and large
    enough, the step read; then every item opened: each chunk located inside
    its item, the non-tensor items unpickled (restricted) and every tensor
    item's CRC-32 checked. ``shallow`` (for describe) stops before the items:
    the tensors are named, shaped and typed, without chunks or objects, so the
    result says what the checkpoint holds but is not for converting."""
    root = path.parent if path.is_file() else path
    meta = read_metadata(root)
    roles = classify(meta)
    files = _check_files(root, meta)
    ranks = {f.rank for f in files if f.rank is not None}
    world_size = max(ranks) + 1 if ranks else None
    seen = _Seen(files, world_size, any(len(t.chunks) > 1 for t in meta.tensors.values()), roles.model_found, roles.optim_found)
    ckpt = Checkpoint("dcp", root, world_size=world_size or 1, step=_read_step(meta, roles))
    ckpt.source["metadata_form"] = "torch>=2.15 (TensorProperties with strides)" if meta.has_strides else "torch<2.15"
    ckpt.source[SOURCE_KEY] = roles.layout.to_json()
    if not roles.model_found and meta.tensors:
        ckpt.notes.append(f"no model state dict recognised in the saved state: its {len(meta.tensors)} tensors are shown as other state")
    leaves: list[tuple[tuple[PathItem, ...], Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    archives: list[TorchArchive] = []
    for key, t in meta.tensors.items():
        name = roles.names[key]
        lt = ckpt.add(LogicalTensor(name, t.shape, t.dtype))
        if not shallow:
            for offsets, sizes in t.chunks:
                archive = _open_item(meta, key, offsets)
                ref = archive.root
                _tensor_in(archive, ref, t, key, offsets, sizes)
                lt.chunks.append(Chunk(Box(offsets, sizes), t.dtype, archive.path, archive.tensor_offset(ref)))
                archives.append(archive)
        if key in roles.groups:
            g, hyper = roles.groups[key]
            groups.setdefault(g, {})[hyper] = TensorLink(name)  # a tensor lr
        elif name.startswith(OBJ):
            leaves.append((t.path, TensorLink(name)))
    if shallow:
        return ckpt, seen
    for key, nesting in meta.objects.items():
        value = _open_item(meta, key, ()).root
        if key in roles.groups:
            g, hyper = roles.groups[key]
            groups.setdefault(g, {})[hyper] = value
        else:
            leaves.append((nesting, value))
    _check_crcs(archives)
    if leaves:
        ckpt.objects["extra"] = unflatten(leaves)
    if groups and all("params" in g for g in groups.values()):
        # the usual form: one entry per group index, with its parameter names
        ckpt.objects["optim.param_groups"] = [groups[k] for k in sorted(groups, key=lambda k: (0, int(k), "") if k.isdigit() else (1, 0, k))]
    elif groups:
        ckpt.objects["optim.param_groups"] = regroup(groups)
    return ckpt, seen


def read(path: Path) -> Checkpoint:
    """Describe a DCP checkpoint: every stored chunk located inside its ``.distcp``
    item; non-tensor items (param groups, user values) unpickled (restricted)
    and kept at their nesting."""
    return _read(path)[0]


def _check_crcs(archives: list[TorchArchive]) -> None:
    """Each tensor item's bytes against the CRC-32 its zip directory records
    (torch.save writes one per entry; the pickles were checked as they were read):
    one pass over the data, batched per file, before a byte is used (or, in a
    conversion, from the copy's own reads: ``verify_many``). A flipped bit is then
    a clear error, not a silently different checkpoint. RAVEX_NO_CRC=1 skips it."""
    verify_many([(a, k) for a in archives for k in a.storage_offsets])


