"""safetensors: one file, or shards with ``model.safetensors.index.json``.

The header is parsed here rather than through the ``safetensors`` package
because the engine needs each tensor's absolute byte offset, which the
package does not expose; the parsing is a length, a JSON object and the
checks the format's specification asks of a reader (as the reference library
makes them): a header of at most 100 MB inside the file, known dtypes, each
entry's byte length equal to its shape times its element size, and the byte
buffer indexed entirely, without holes or overlaps. The last one also bounds
what a conversion writes: every output byte comes from one source byte (dtype
casts aside), so a crafted file cannot make entries share bytes and multiply them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .._dtypes import SAFETENSORS_CODES
from .._output import Options, out_dtype
from .._paths import inside
from .._strictjson import DuplicateKey, unique_pairs
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, from_os_error
from ..info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, TensorInfo
from ..model import MODEL, Box, Checkpoint, Chunk, LogicalTensor, itemsize, numel
from ..plan import OutFile, WritePlan, run
from ..storage import Location, open_read
from ..ties import config_ties
from .options import Flag, WriteOptions, option, parse_size

__all__ = ["DTYPES", "INDEX_NAME", "MAX_SHARD_SIZE", "SafetensorsOptions", "describe", "read", "read_header", "sniff"]

MAX_SHARD_SIZE = Flag("--max-shard-size", metavar="SIZE", parse=parse_size,
                      help="safetensors: split into shards of at most SIZE (e.g. 5GB) with an index.")


@dataclass(frozen=True)
class SafetensorsOptions(WriteOptions):
    """The options of a safetensors output: ``max_shard_size`` (bytes, or a size
    such as ``"5GB"``): shards of at most that size and an index; None: one file.
    safetensors holds weights only."""

    weights_only: ClassVar[bool] = True
    max_shard_size: int | None = option(None, MAX_SHARD_SIZE, on_options=True)

INDEX_NAME = "model.safetensors.index.json"
DTYPES = {code: name for name, code in SAFETENSORS_CODES.items()}  # code -> Ravex dtype name
_MAX_HEADER = 100 * 1024 * 1024  # the reference library's limit (safetensors' MAX_HEADER_SIZE)
_MAX_INDEX = 100 * 1024 * 1024
_AGAIN = "the file is truncated, damaged or was not written by a safetensors writer; copy it again from where it was saved"


def _looks_like_safetensors(path: Path) -> bool:
    try:
        with open_read(path) as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= _MAX_HEADER and head[8:9] == b"{"


def _bad(path: Path, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: not a valid safetensors file: {why}", hint=_AGAIN, path=path)


def _shape(path: Path, name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        raise _bad(path, f"tensor '{name}' has shape {v!r}, not a list of non-negative integers")
    return tuple(v)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed, checked header and the absolute offset where tensor data begins."""
    try:
        size = path.stat().st_size
        with open_read(path) as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"the file is {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise _bad(path, f"the header length says {n} bytes, more than the {_MAX_HEADER} bytes safetensors allows")
            if n > size - 8:
                raise _bad(path, f"the header length says {n} bytes, but the file has only {size - 8} after it")
            raw = f.read(n)
    except OSError as exc:
        raise from_os_error(exc, path=path) from None
    try:
        header = json.loads(raw, object_pairs_hook=unique_pairs)
    except DuplicateKey as exc:
        raise _bad(path, f"the header names {exc.key!r} twice (which entry is the tensor?)") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(path, f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the header is a JSON {type(header).__name__}, not an object")
    start = 8 + n
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _bad(path, "__metadata__ is not an object of strings")
            continue
        if not isinstance(entry, dict):
            raise _bad(path, f"the entry of tensor '{name}' is a JSON {type(entry).__name__}, not an object")
        dtype = entry.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _bad(path, f"tensor '{name}' has dtype {dtype!r}, which Ravex does not know (known: {', '.join(DTYPES)})")
        shape = _shape(path, name, entry.get("shape"))
        offs = entry.get("data_offsets")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise _bad(path, f"tensor '{name}' has data_offsets {offs!r}, not [begin, end] with 0 <= begin <= end")
        begin, end = offs
        if start + end > size:
            raise _bad(path, f"tensor '{name}' ends at byte {start + end}, past the end of the {size}-byte file")
        if end - begin != numel(shape) * itemsize(DTYPES[dtype]):
            raise _bad(path, f"tensor '{name}' has {end - begin} bytes for shape {list(shape)} {dtype} "
                             f"({numel(shape) * itemsize(DTYPES[dtype])} expected)")
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin < pos:
            raise _bad(path, f"tensor '{name}' shares bytes {begin}..{min(end, pos)} with another tensor (the format forbids overlaps)")
        if begin > pos:
            raise _bad(path, f"bytes {pos}..{begin} of the data belong to no tensor (the format forbids holes)")
        pos = end
    if start + pos != size:
        raise _bad(path, f"the file has {size - start - pos} bytes after the last tensor's data (the format forbids them)")
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


def _read_index(path: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """The index's weight_map, and each shard it names, checked to lie inside ``path``."""
    index_path = inside(path, INDEX_NAME, "index file", path)
    bad = CorruptCheckpointError(
        f"{index_path}: not a valid safetensors index (needs a JSON object whose 'weight_map' maps tensor names to shard file names)",
        hint="regenerate the index, or point Ravex at the shard files",
        path=index_path,
    )
    try:
        if index_path.stat().st_size > _MAX_INDEX:
            raise CorruptCheckpointError(f"{index_path}: {index_path.stat().st_size} bytes, more than the {_MAX_INDEX} bytes an index may have",
                                         hint="this is no real index (they are kilobytes); regenerate it", path=index_path)
        index = json.loads(index_path.read_bytes())
    except OSError as exc:
        raise from_os_error(exc, path=index_path) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise bad from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise bad
    shards = {name: inside(path, name, "shard file", index_path) for name in sorted(set(weight_map.values()))}
    return weight_map, shards


def _listed_files(path: Path) -> list[tuple[str, Path]]:
    """A directory without an index: its ``*.safetensors`` files (symlinks only to inside it)."""
    return [(f.name, inside(path, f.name, "safetensors file", path)) for f in sorted(path.glob("*.safetensors"))]


def _parse_aliases(metadata: Any) -> dict[str, str] | None:
    """Ravex writes tied names as ``{"ravex.aliases": "{json}"}``; others leave them out.
    None where the entry is there but unreadable."""
    if not isinstance(metadata, dict) or "ravex.aliases" not in metadata:
        return {}
    try:
        found = json.loads(metadata["ravex.aliases"])
    except (json.JSONDecodeError, TypeError, RecursionError):
        return None
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        return None
    return found


@dataclass
class _Listing:
    """How the checkpoint is laid out on disk, beside its tensors: what only
    ``describe`` shows (read's :class:`Checkpoint` has the rest)."""

    variant: str  # "single" | "sharded"
    files: list[FileInfo] = field(default_factory=list)
    misplaced: list[str] = field(default_factory=list)  # notes: entries a shard holds that the index places elsewhere


def _read(path: Path) -> tuple[Checkpoint, _Listing]:
    """One pass over the index and every shard's header: the checkpoint, and its listing."""
    weight_map: dict[str, str] = {}
    if path.is_file():
        listed, listing = [(path.name, path)], _Listing("single")
    elif (path / INDEX_NAME).is_file():
        weight_map, shards = _read_index(path)
        missing = [n for n, p in shards.items() if not p.is_file()]
        if missing:
            raise IncompleteCheckpointError(
                f"{path}: the index names shard '{missing[0]}' but the file is missing"
                + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""),
                hint="copy every shard listed in model.safetensors.index.json into the directory",
                path=path / missing[0],
            )
        listed = list(shards.items())
        listing = _Listing("sharded", [FileInfo(INDEX_NAME, (path / INDEX_NAME).stat().st_size, "index")])
    else:
        listed = _listed_files(path)
        listing = _Listing("single" if len(listed) == 1 else "sharded")
    ckpt = Checkpoint("safetensors", path, world_size=1)
    held: dict[str, str] = {}  # tensor name -> the shard holding it
    aliases: dict[str, tuple[str, Path]] = {}
    for shard, file in listed:
        header, start = read_header(file)
        listing.files.append(FileInfo(shard, file.stat().st_size, "weights"))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if name in held:
                raise CorruptCheckpointError(f"{file}: holds tensor '{name}', which {held[name]} holds too",
                                             hint="the shards come from different saves; copy the shards and index from one save", path=file)
            if weight_map and weight_map.get(name) != shard:
                listing.misplaced.append(f"{shard} holds '{name}', which the index places elsewhere")
            held[name] = shard
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            t = LogicalTensor(MODEL + name, shape, dtype)
            t.chunks.append(Chunk(Box(tuple(0 for _ in shape), shape), dtype, file, start + int(e["data_offsets"][0])))
            ckpt.add(t)
        found = _parse_aliases(header.get("__metadata__"))
        if found is None:
            ckpt.notes.append(f"{file.name}: unreadable 'ravex.aliases' metadata ignored")
        for alias, target in (found or {}).items():
            aliases[alias] = (target, file)
    absent = sorted(set(weight_map) - set(held))
    if absent:
        raise IncompleteCheckpointError(
            f"{path}: the index lists tensor '{absent[0]}' but no shard holds it ({len(absent)} missing)",
            hint="the shards do not match the index; copy the shards and index from the same save",
            path=path / INDEX_NAME,
        )
    for alias, (target, file) in aliases.items():
        if MODEL + target not in ckpt.tensors or MODEL + alias in ckpt.tensors:
            ckpt.notes.append(f"{file.name}: tied name '{alias}' -> '{target}' ignored (" +
                              ("a stored tensor has that name" if MODEL + alias in ckpt.tensors else f"no tensor '{target}'") + ")")
            continue
        ckpt.aliases[MODEL + alias] = MODEL + target
    config_ties(ckpt, path if path.is_dir() else path.parent)  # a Hugging Face save: the head its config ties and its files leave out
    return ckpt, listing


def read(path: Path) -> Checkpoint:
    """Every tensor as ``model/<name>``, one whole-tensor chunk each, in place;
    the index (where there is one) checked against the shards."""
    return _read(path)[0]


def describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    """What :func:`read` finds, as ``inspect`` shows it (the headers are read once)."""
    ckpt, listing = _read(path)
    info = CheckpointInfo("safetensors", listing.variant, str(path), world_size=1, reasons=reasons, files=listing.files)
    info.tensors = [TensorInfo(name[len(MODEL):], t.shape, t.dtype) for name, t in ckpt.tensors.items()]
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items()}
    info.notes = [*ckpt.notes, *listing.misplaced, NO_PARAM_MARKS]
    return info


_CODES = SAFETENSORS_CODES


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


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options) -> WritePlan:
    """Weights only: ``model/*`` tensors as safetensors. DST ending in
    ``.safetensors`` is one file; otherwise a directory with ``model.safetensors``
    or, with ``max_shard_size``, shards and ``model.safetensors.index.json``.
    Tied names are stored once and listed in ``__metadata__["ravex.aliases"]``."""
    tensors = [t for n, t in ckpt.tensors.items() if n.startswith(MODEL)]
    if not tensors:
        raise RavexError(f"{ckpt.path}: the checkpoint holds no model weights, so a safetensors file would hold nothing",
                         hint="run `ravex inspect` on it to see what it holds; safetensors takes model weights only (--to torch_save keeps everything)",
                         path=ckpt.path)
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
    files: list[OutFile] = []
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards):
        head, offsets = _header(shard, opts, metadata)
        f = OutFile("" if single else fname, len(head) + sum(t.numel * itemsize(out_dtype(t, opts)) for t in shard), small=[(0, head)])
        for t, off in zip(shard, offsets):
            f.fills.append((t, len(head) + off, t.whole(), out_dtype(t, opts)))
            weight_map[t.name[len(MODEL):]] = fname
        files.append(f)
    commit: list[tuple[str, bytes]] = []
    if n > 1:
        meta: dict[str, Any] = {"total_size": sum(t.numel * itemsize(out_dtype(t, opts)) for t in tensors)}
        if aliases:
            meta["ravex.aliases"] = metadata["ravex.aliases"]
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        commit.append((INDEX_NAME, json.dumps(index, indent=2).encode()))  # the index names every shard: it goes last
    summary = {"files": names if not single else [dst.name], "tensors": len(tensors), "bytes": sum(f.size for f in files), "aliases": aliases}
    return WritePlan(not single, files, commit, summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Any = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    return run(plan_write(ckpt, dst, opts), dst, force=opts.force, progress=progress)
