"""DCP: PyTorch Distributed Checkpoint (what FSDP2 and torchtitan write).

A directory with ``.metadata`` (a pickled ``Metadata``: per key the global
size, dtype and chunks; ``storage_data`` maps (key, chunk offset) to a byte
range of a ``__<rank>_<n>.distcp`` file) and the data files. Every tensor item
in a data file is a complete torch.save archive; we read ``.metadata`` with
the restricted unpickler, never torch's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._torchzip import open_archive
from .._unpickle import Record, TensorRef, restricted_loads
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ..model import MODEL, OPTIM, Box, Checkpoint, Chunk, LogicalTensor

__all__ = ["METADATA", "DcpItem", "DcpMetadata", "DcpTensor", "describe", "read_metadata", "sniff"]

METADATA = ".metadata"
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


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
    path: tuple[str, ...]  # the real nesting, e.g. ("optim", "state", "embed.weight", "exp_avg")
    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offsets, sizes)


@dataclass
class DcpMetadata:
    tensors: dict[str, DcpTensor]
    objects: dict[str, tuple[str, ...]]  # non-tensor keys and their nesting
    items: dict[tuple[str, tuple[int, ...]], DcpItem]
    has_strides: bool  # written by a torch whose TensorProperties carry strides (2.15+)


def sniff(path: Path) -> list[str] | None:
    if path.is_file() and path.name == METADATA:
        return [f"{path.name} is DCP's metadata file"]
    if path.is_dir() and (path / METADATA).is_file():
        n = sum(1 for p in path.iterdir() if _DATA_FILE.match(p.name))
        return [f"found {METADATA} and {n} .distcp data file(s)"]
    return None


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
    raise KeyError(name)


def read_metadata(root: Path) -> DcpMetadata:
    meta_path = root / METADATA
    try:
        data = meta_path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpointError(f"{meta_path}: cannot be read ({exc.strerror})", path=meta_path) from None
    meta = restricted_loads(data, meta_path)
    bad = CorruptCheckpointError(
        f"{meta_path}: not a DCP Metadata object (the file is damaged or was written by something else)",
        hint="copy .metadata again from where the run saved it; it is written last, so a partial copy lacks it",
        path=meta_path,
    )
    if not isinstance(meta, Record) or not meta.cls.endswith(".Metadata"):
        raise bad
    try:
        sd_meta = _field(meta, "state_dict_metadata", 0)
        planner = _field(meta, "planner_data", 1) if _has(meta, "planner_data") else None
        storage = _field(meta, "storage_data", 2)
    except KeyError:
        raise bad from None
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise bad
    planner = planner if isinstance(planner, dict) else {}
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[str, ...]] = {}
    has_strides = False
    try:
        for key, m in sd_meta.items():
            nesting = tuple(str(p) for p in planner.get(key, (key,)))
            if isinstance(m, Record) and m.cls.endswith("TensorStorageMetadata"):
                props = _field(m, "properties", 0)
                dtype = _field(props, "dtype", 0)
                if isinstance(props.state, tuple) and len(props.state) >= 6:
                    has_strides = True
                shape = tuple(int(s) for s in _field(m, "size", 1))
                chunks = [
                    (tuple(int(o) for o in _field(c, "offsets", 0)), tuple(int(s) for s in _field(c, "sizes", 1)))
                    for c in _field(m, "chunks", 2)
                ]
                tensors[key] = DcpTensor(key, nesting, shape, str(dtype), chunks)
            else:
                objects[key] = nesting
        items: dict[tuple[str, tuple[int, ...]], DcpItem] = {}
        for idx, sinfo in storage.items():
            fqn = str(_field(idx, "fqn", 0))
            offs = _field(idx, "offset", 1) if _has(idx, "offset") else None
            offsets = tuple(int(o) for o in offs) if offs is not None else ()
            items[(fqn, offsets)] = DcpItem(offsets, str(_field(sinfo, "relative_path", 0)), int(_field(sinfo, "offset", 1)), int(_field(sinfo, "length", 2)))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise bad from None
    return DcpMetadata(tensors, objects, items, has_strides)


def _has(rec: Record, name: str) -> bool:
    try:
        _field(rec, name)
        return True
    except KeyError:
        return False


def _check_files(root: Path, meta: DcpMetadata) -> list[FileInfo]:
    needed: dict[str, int] = {}
    for item in meta.items.values():
        needed[item.file] = max(needed.get(item.file, 0), item.offset + item.length)
    files = [FileInfo(METADATA, (root / METADATA).stat().st_size, "metadata")]
    for name in sorted(needed):
        p = root / name
        if not p.is_file():
            raise IncompleteCheckpointError(
                f"{root}: .metadata names data file '{name}' but it is missing",
                hint="copy every __<rank>_<n>.distcp file that the save wrote (one or more per rank)",
                path=p,
            )
        size = p.stat().st_size
        if size < needed[name]:
            raise CorruptCheckpointError(
                f"{p}: the file is {size} bytes but .metadata places data up to byte {needed[name]}",
                hint="the data file is truncated; copy it again",
                path=p,
            )
        m = _DATA_FILE.match(name)
        files.append(FileInfo(name, size, "data", int(m.group(1)) if m else None))
    return files


def _kind(t: DcpTensor) -> str:
    if t.path and t.path[0] in ("optim", "optimizer"):
        return "optim"
    return "param" if t.path and t.path[0] == "model" or len(t.path) == 1 else "other"


def _display_name(t: DcpTensor) -> str:
    p = t.path
    if p and p[0] in ("optim", "optimizer") and len(p) == 4 and p[1] == "state":
        return f"optim.{p[3]}/{p[2]}"
    if p and p[0] == "model" and len(p) == 2:
        return p[1]
    return "/".join(p)


def describe(path: Path, reasons: list[str], meta: DcpMetadata | None = None) -> CheckpointInfo:
    root = path.parent if path.is_file() else path
    if meta is None:
        meta = read_metadata(root)
    sharded = any(len(t.chunks) > 1 for t in meta.tensors.values())
    info = CheckpointInfo("dcp", "sharded" if sharded else "unsharded", str(root), reasons=reasons)
    info.files = _check_files(root, meta)
    ranks = {f.rank for f in info.files if f.rank is not None}
    info.world_size = max(ranks) + 1 if ranks else None
    if ranks:
        info.reasons.append(f"world size {info.world_size} inferred from data file names (__<rank>_<n>.distcp)")
    state_names: list[str] = []
    for t in meta.tensors.values():
        kind = _kind(t)
        info.tensors.append(TensorInfo(_display_name(t), t.shape, t.dtype, kind))
        if kind == "optim" and len(t.path) == 4 and t.path[3] not in state_names:
            state_names.append(t.path[3])
    has_optim = bool(state_names) or any(p and p[0] in ("optim", "optimizer") for p in meta.objects.values())
    if has_optim:
        # get_state_dict flattens param groups per parameter name, so the number
        # of groups is not visible without reading the items: left unknown.
        kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(state_names) else "unknown"
        info.optimizer = OptimizerInfo(kind, state_names, None)
    info.step = _read_step(root, meta)
    info.notes.append(NO_PARAM_MARKS)
    info.extra["metadata_form"] = "torch>=2.15 (TensorProperties with strides)" if meta.has_strides else "torch<2.15"
    return info


def _read_step(root: Path, meta: DcpMetadata) -> int | None:
    """The optimizer's step, read from the first parameter's ``step`` item."""
    for t in meta.tensors.values():
        if len(t.path) == 4 and t.path[0] in ("optim", "optimizer") and t.path[3] == "step" and t.shape in ((), (1,)):
            item = meta.items.get((t.key, tuple(0 for _ in t.shape)))
            if item is None:
                return None
            archive = open_archive(root / item.file, item.offset, item.length)
            if isinstance(archive.root, TensorRef):
                return int(archive.read_scalar(archive.root))
    for key, nesting in meta.objects.items():
        if nesting[-1] in ("step", "global_step"):
            item = meta.items.get((key, ()))
            if item is not None:
                value = open_archive(root / item.file, item.offset, item.length).root
                if isinstance(value, int):
                    return value
    return None


def _item_archive(root: Path, meta: DcpMetadata, key: str, offsets: tuple[int, ...]) -> tuple[Any, Any]:
    item = meta.items.get((key, offsets))
    if item is None:
        raise CorruptCheckpointError(f"{root / METADATA}: no storage entry for '{key}' at offsets {list(offsets)}", path=root / METADATA)
    archive = open_archive(root / item.file, item.offset, item.length)
    return archive, archive.root


def _logical_name(path: tuple[str, ...]) -> str:
    if len(path) == 2 and path[0] == "model":
        return MODEL + path[1]
    if len(path) == 4 and path[0] in ("optim", "optimizer") and path[1] == "state":
        return f"{OPTIM}{path[3]}/{path[2]}"
    return "obj/" + "/".join(path)


def read(path: Path) -> Checkpoint:
    """Describe a DCP checkpoint: every stored chunk located inside its ``.distcp``
    item; non-tensor items (param groups, user values) unpickled (restricted)."""
    root = path.parent if path.is_file() else path
    meta = read_metadata(root)
    info = describe(path, [], meta)  # .metadata unpickled once
    ckpt = Checkpoint("dcp", root, world_size=info.world_size or 1, step=info.step)
    ckpt.source["metadata_form"] = info.extra["metadata_form"]
    for t in meta.tensors.values():
        lt = ckpt.add(LogicalTensor(_logical_name(t.path), t.shape, t.dtype))
        for offsets, sizes in t.chunks:
            archive, ref = _item_archive(root, meta, t.key, offsets)
            if not isinstance(ref, TensorRef) or ref.shape != sizes or ref.dtype != t.dtype:
                raise CorruptCheckpointError(f"{root}: the item for '{t.key}' at {list(offsets)} does not hold a {t.dtype} tensor of shape {list(sizes)}", path=root)
            if not ref.is_contiguous():
                raise CorruptCheckpointError(f"{root}: the item for '{t.key}' holds a non-contiguous tensor", path=root)
            lt.chunks.append(Chunk(Box(offsets, sizes), t.dtype, archive.path, archive.tensor_offset(ref)))
    groups: dict[str, dict[str, Any]] = {}
    for key, nesting in meta.objects.items():
        _, value = _item_archive(root, meta, key, ())
        if len(nesting) == 4 and nesting[0] in ("optim", "optimizer") and nesting[1] == "param_groups":
            groups.setdefault(nesting[2], {})[nesting[3]] = value
        else:
            ckpt.objects.setdefault("extra", {})["/".join(nesting)] = value
    if groups and all("params" in g for g in groups.values()):
        # the usual form: one entry per group index, with its parameter names
        ckpt.objects["optim.param_groups"] = [groups[k] for k in sorted(groups, key=lambda k: int(k) if k.isdigit() else k)]
    elif groups:
        ckpt.objects["optim.param_groups"] = _regroup(groups)
    return ckpt


def _regroup(per_param: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """get_state_dict stores each parameter's group hyper-parameters under its
    name; parameters whose hyper-parameters (and listed ``params``) agree are one
    group, in order of first appearance."""
    groups: list[dict[str, Any]] = []
    for fqn, hyper in per_param.items():
        listed = hyper.get("params")
        h = {k: v for k, v in hyper.items() if k != "params"}
        for g in groups:
            same_members = listed is None or g.get("_listed") == listed
            if same_members and {k: v for k, v in g.items() if k not in ("params", "_listed")} == h:
                g["params"].append(fqn)
                break
        else:
            groups.append({**h, "params": [fqn], "_listed": listed})
    for g in groups:
        g.pop("_listed")
    return groups
