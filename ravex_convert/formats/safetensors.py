"""safetensors: one file, or shards with ``model.safetensors.index.json``.

The header is parsed here rather than through the ``safetensors`` package
because the engine needs each tensor's absolute byte offset, which the
package does not expose; the parsing is a length, a JSON object and bounds
checks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from .._engine import CopyJob, Target
from .._output import Options, out_dtype, staged
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError
from ..info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, TensorInfo
from ..model import MODEL, Box, Checkpoint, Chunk, LogicalTensor, itemsize

__all__ = ["DTYPES", "INDEX_NAME", "describe", "read_header", "sniff"]

INDEX_NAME = "model.safetensors.index.json"
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_MAX_HEADER = 100 * 1024 * 1024


def _looks_like_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= _MAX_HEADER and head[8:9] == b"{"


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the absolute offset where tensor data begins."""
    bad = CorruptCheckpointError(
        f"{path}: not a valid safetensors file (header unreadable, or data shorter than the header says)",
        hint="the file is truncated or damaged; copy it again",
        path=path,
    )
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise bad
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise bad from None
    if not isinstance(header, dict):
        raise bad
    start = 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES or not 0 <= begin <= end or start + end > size:
                raise bad
        except (KeyError, TypeError, ValueError):
            raise bad from None
    return header, start


def sniff(path: Path) -> list[str] | None:
    if path.is_file():
        if path.suffix == ".safetensors" or _looks_like_safetensors(path):
            return [f"{path.name} starts with a safetensors header"]
        return None
    if (path / INDEX_NAME).is_file():
        return [f"found {INDEX_NAME}"]
    files = sorted(path.glob("*.safetensors"))
    if files and all(_looks_like_safetensors(f) for f in files):
        return [f"found {len(files)} safetensors file(s) and no other checkpoint layout"]
    return None


def _tensors_of(path: Path, header: dict[str, Any]) -> list[TensorInfo]:
    return [
        TensorInfo(name, tuple(e["shape"]), DTYPES[e["dtype"]])
        for name, e in header.items()
        if name != "__metadata__"
    ]


def describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    if path.is_file():
        header, _ = read_header(path)
        info = CheckpointInfo("safetensors", "single", str(path), world_size=1, reasons=reasons)
        info.tensors = _tensors_of(path, header)
        info.files = [FileInfo(path.name, path.stat().st_size, "weights")]
        _aliases_from_metadata(info, header.get("__metadata__"))
        info.notes.append(NO_PARAM_MARKS)
        return info

    index_path = path / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map: dict[str, str] = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CorruptCheckpointError(
                f"{index_path}: not a valid safetensors index (needs a JSON object with a 'weight_map')",
                hint="regenerate the index, or point Ravex at the shard files",
                path=index_path,
            ) from None
        shard_names = sorted(set(weight_map.values()))
        missing = [n for n in shard_names if not (path / n).is_file()]
        if missing:
            raise IncompleteCheckpointError(
                f"{path}: the index names shard '{missing[0]}' but the file is missing"
                + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""),
                hint="copy every shard listed in model.safetensors.index.json into the directory",
                path=path / missing[0],
            )
        variant = "sharded"
        files = [FileInfo(INDEX_NAME, index_path.stat().st_size, "index")]
    else:
        shard_names = [f.name for f in sorted(path.glob("*.safetensors"))]
        weight_map = {}
        variant = "single" if len(shard_names) == 1 else "sharded"
        files = []
    info = CheckpointInfo("safetensors", variant, str(path), world_size=1, reasons=reasons)
    seen: set[str] = set()
    for name in shard_names:
        header, _ = read_header(path / name)
        files.append(FileInfo(name, (path / name).stat().st_size, "weights"))
        for t in _tensors_of(path / name, header):
            if weight_map and weight_map.get(t.name) != name:
                info.notes.append(f"{name} holds '{t.name}', which the index places elsewhere")
            if t.name not in seen:
                seen.add(t.name)
                info.tensors.append(t)
        _aliases_from_metadata(info, header.get("__metadata__"))
    absent = sorted(set(weight_map) - seen)
    if absent:
        raise IncompleteCheckpointError(
            f"{path}: the index lists tensor '{absent[0]}' but no shard holds it ({len(absent)} missing)",
            hint="the shards do not match the index; copy the shards and index from the same save",
            path=index_path,
        )
    info.files = files
    info.notes.append(NO_PARAM_MARKS)
    return info


def _aliases_from_metadata(info: CheckpointInfo, metadata: Any) -> None:
    # Ravex writes tied names as {"ravex.aliases": "{json}"}; others leave them out.
    if isinstance(metadata, dict) and "ravex.aliases" in metadata:
        try:
            info.aliases.update(json.loads(metadata["ravex.aliases"]))
        except (json.JSONDecodeError, TypeError):
            info.notes.append("__metadata__ has an unreadable 'ravex.aliases' entry")


def _shard_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index_path = path / INDEX_NAME
    if index_path.is_file():
        describe(path, [])  # validates the index and that every shard is present
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return [path / n for n in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def read(path: Path) -> Checkpoint:
    """Every tensor as ``model/<name>``, one whole-tensor chunk each, in place."""
    ckpt = Checkpoint("safetensors", path, world_size=1)
    for file in _shard_files(path):
        header, start = read_header(file)
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            begin = int(e["data_offsets"][0])
            t = LogicalTensor(MODEL + name, shape, dtype)
            t.chunks.append(Chunk(Box(tuple(0 for _ in shape), shape), dtype, file, start + begin))
            if int(e["data_offsets"][1]) - begin != t.nbytes:
                raise CorruptCheckpointError(f"{file}: tensor '{name}' has {int(e['data_offsets'][1]) - begin} bytes for shape {list(shape)} {dtype}", path=file)
            ckpt.add(t)
        meta = header.get("__metadata__")
        if isinstance(meta, dict) and "ravex.aliases" in meta:
            try:
                for alias, target in json.loads(meta["ravex.aliases"]).items():
                    ckpt.aliases[MODEL + alias] = MODEL + target
            except (json.JSONDecodeError, TypeError, AttributeError):
                ckpt.notes.append(f"{file.name}: unreadable 'ravex.aliases' metadata ignored")
    return ckpt


_CODES = {v: k for k, v in DTYPES.items()}


def _plan_shards(tensors: list[LogicalTensor], opts: Options, single: bool) -> list[list[LogicalTensor]]:
    limit = opts.max_shard_size
    if single or not limit:
        return [tensors]
    shards: list[list[LogicalTensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.numel * itemsize(out_dtype(t, opts))
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _header(tensors: list[LogicalTensor], opts: Options, metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    header: dict[str, Any] = {"__metadata__": metadata}
    offsets = []
    pos = 0
    for t in tensors:
        dtype = out_dtype(t, opts)
        n = t.numel * itemsize(dtype)
        header[t.name[len(MODEL):]] = {"dtype": _CODES[dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def write(ckpt: Checkpoint, dst: Path, opts: Options, progress: Any = None) -> dict[str, Any]:
    """Weights only: ``model/*`` tensors as safetensors. DST ending in
    ``.safetensors`` is one file; otherwise a directory with ``model.safetensors``
    or, with ``max_shard_size``, shards and ``model.safetensors.index.json``.
    Tied names are stored once and listed in ``__metadata__["ravex.aliases"]``."""
    tensors = [t for n, t in ckpt.tensors.items() if n.startswith(MODEL)]
    for t in tensors:
        if out_dtype(t, opts) not in _CODES:
            raise RavexError(f"tensor '{t.name[len(MODEL):]}' has dtype {t.dtype}, which safetensors cannot hold")
    aliases = {a[len(MODEL):]: b[len(MODEL):] for a, b in ckpt.aliases.items() if a.startswith(MODEL)}
    metadata = {"format": "pt"}
    if aliases:
        metadata["ravex.aliases"] = json.dumps(aliases, sort_keys=True)
    single = dst.suffix == ".safetensors"
    shards = _plan_shards(tensors, opts, single)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    job = CopyJob()
    total = 0
    with staged(dst, opts.force) as tmp:
        if not single:
            tmp.mkdir()
        weight_map: dict[str, str] = {}
        for fname, shard in zip(names, shards):
            path = tmp if single else tmp / fname
            head, offsets = _header(shard, opts, metadata)
            size = len(head) + sum(t.numel * itemsize(out_dtype(t, opts)) for t in shard)
            with open(path, "wb") as f:
                f.write(head)
                f.truncate(size)
            total += size
            ti = job.target(path)
            for t, off in zip(shard, offsets):
                job.add(t, [Target(ti, len(head) + off, t.whole(), out_dtype(t, opts))])
                weight_map[t.name[len(MODEL):]] = fname
        job.run(progress=progress)
        if n > 1:
            meta: dict[str, Any] = {"total_size": sum(t.numel * itemsize(out_dtype(t, opts)) for t in tensors)}
            if aliases:
                meta["ravex.aliases"] = metadata["ravex.aliases"]
            index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return {"files": names if not single else [dst.name], "tensors": len(tensors), "bytes": total, "aliases": aliases}
