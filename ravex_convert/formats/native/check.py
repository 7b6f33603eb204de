"""The native store's JSON files, read as docs/format.md specifies them.

Everything a reader takes from ``ravex-store.json``, ``manifest.json`` and
``checkpoint.json`` passes through here first: strict JSON (UTF-8, no
duplicate keys, no NaN), the documented limits (section 18), and every check of
section 17 that needs no data file. A failing check is one
:class:`CorruptCheckpointError` naming the file, the tensor and the chunk where
there is one, with a hint; values a newer Ravex may write (a dtype, a
compression, a region kind, a checksum algorithm) are refused with a hint to
upgrade. Hand-written because no library checks this format; ``json`` does the
parsing.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from ... import _core
from ..._dtypes import V1_DTYPES
from ..._engine import flat_range
from ..._limits import env_limit, max_chunks_per_tensor
from ..._paths import inside
from ..._strictjson import DuplicateKey, unique_pairs
from ..._tagged import TAG
from ...errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, from_os_error
from ...model import KINDS, MODEL, Box, Chunk, Flat, LogicalTensor, Region
from ...storage import open_read

__all__ = [
    "DTYPES", "FORMAT_VERSION", "MAX_DIMS", "Checked", "check_checkpoint", "check_manifest", "load_json", "max_chunks_per_tensor",
    "max_json_depth", "metadata_checksum",
]

FORMAT_VERSION = 1
# The v1 dtype table (section 11): name -> bytes per element.
DTYPES = V1_DTYPES
MAX_INDEX = 99_999_999
# Limits (section 18). Chunks per tensor: a tensor has at most one chunk per
# rank that wrote it (FSDP, ZeRO, DCP) or per tensor-parallel piece, so even a
# million-GPU job stays below a million; checking a million takes seconds,
# ten million took a minute. JSON nesting: the format's own structure is 8
# levels deep; only `objects` and `source` hold free-form values.
DEFAULT_MAX_DEPTH = 64
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
# Box comparisons the tiling check may make per tensor (section 11): grid
# layouts need about one per chunk; only crafted layouts come near this.
TILING_BUDGET = 10_000_000

_CHECKSUM = re.compile(r"xxh3-64:[0-9a-f]{16}")
_FILE = re.compile(r"checkpoints/(\d{8})/([A-Za-z0-9][A-Za-z0-9._-]*)")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_INT = re.compile(r"-?[0-9]+")
_METADATA_HINT = ("the checkpoint's metadata is damaged or was edited by hand; restore the store from a copy, "
                  "or read another checkpoint (--index)")
_UPGRADE = "a newer Ravex may have written it: upgrade Ravex (pip install -U ravex); otherwise the file is damaged"


def max_json_depth() -> int:
    """How deep ``objects`` and ``source`` may nest (``RAVEX_MAX_JSON_DEPTH``, default 64)."""
    return env_limit("RAVEX_MAX_JSON_DEPTH", DEFAULT_MAX_DEPTH)


def metadata_checksum(raw: bytes) -> str:
    """What a manifest entry records of its checkpoint.json's bytes (section 8)."""
    return f"xxh3-64:{_core.xxh3_64(raw):016x}"


# ---------------------------------------------------------------- strict JSON


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def load_json(path: Path, expected_format: str, *, hint: str, missing_hint: str | None = None) -> tuple[dict[str, Any], bytes]:
    """One of the store's JSON files, parsed strictly, with its ``format`` and
    ``format_version`` checked (sections 7, 14); also its bytes, for the metadata checksum."""

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}", hint=hint, path=path)

    try:
        with open_read(path) as f:
            raw = f.read()
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing", hint=missing_hint or "the store is incomplete; copy the whole store directory",
                                        path=path) from None
    except OSError as exc:
        raise from_os_error(exc, path=path) from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise corrupt("starts with a byte-order mark; the format's JSON files are UTF-8 without one")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise corrupt(f"is not valid UTF-8 (byte {exc.start} of {len(raw)})") from None
    depth = max_json_depth()
    try:
        doc = json.loads(text, object_pairs_hook=unique_pairs, parse_constant=_constant)
    except DuplicateKey as exc:
        raise corrupt(f"has the key {exc.key!r} twice in one object; the format forbids duplicate keys") from None
    except RecursionError:
        raise corrupt(f"is nested too deeply to parse (the format allows {depth} levels in objects and source)") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer with thousands of digits
        raise corrupt(f"is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise corrupt(f"holds a JSON {type(doc).__name__}, not an object")
    if doc.get("format") != expected_format:
        raise corrupt(f"is not a {expected_format} document (its 'format' field is {doc.get('format')!r})")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise corrupt(f"format_version is missing or invalid ({version!r}); it must be an integer, 1 for this format")
    if version > FORMAT_VERSION:
        raise RavexError(
            f"{path}: written in Ravex store format version {version}; this Ravex reads up to version {FORMAT_VERSION}",
            hint="upgrade Ravex (pip install -U ravex) to read this store",
            path=path,
        )
    if any(_too_deep(v, depth - 1) for k, v in doc.items() if k != "tensors" and isinstance(v, (dict, list))):
        raise corrupt(f"is nested more than {depth} levels deep; set RAVEX_MAX_JSON_DEPTH higher if this is a real checkpoint")
    return doc, raw


def _int(v: Any) -> TypeGuard[int]:
    return type(v) is int  # not bool, and fast: this runs for every field of every chunk


# ---------------------------------------------------------------- manifest.json


def check_manifest(doc: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """Section 17.2 for the manifest: its entries, each checked."""

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}", hint="the manifest is damaged; restore it from a copy of the store", path=path)

    nxt = doc.get("next_index")
    if not _int(nxt) or nxt < 0:
        raise corrupt(f"next_index is {nxt!r}, not a non-negative integer")
    entries = doc.get("checkpoints")
    if not isinstance(entries, list):
        raise corrupt(f"'checkpoints' is {type(entries).__name__}, not a list")
    last = -1
    for k, e in enumerate(entries):
        if not isinstance(e, dict):
            raise corrupt(f"checkpoints[{k}] is not an object")
        i = e.get("index")
        if not _int(i) or not last < i < nxt or i > MAX_INDEX:
            raise corrupt(f"checkpoints[{k}] has index {i!r}; indices are integers, strictly increasing, below next_index {nxt}")
        if isinstance(e.get("dir"), str):
            inside(path.parent, e["dir"], f"checkpoint {i}: dir", path)  # an absolute path or '..' is refused as unsafe first
        if e.get("dir") != f"checkpoints/{i:08d}":
            raise corrupt(f"checkpoint {i} has dir {e.get('dir')!r}; it must be 'checkpoints/{i:08d}'")
        if not isinstance(e.get("status"), str) or not isinstance(e.get("run_id"), str):
            raise corrupt(f"checkpoint {i} has no string 'status' and 'run_id'")
        mc = e.get("metadata_checksum")
        if mc is not None and not (isinstance(mc, str) and _CHECKSUM.fullmatch(mc)):
            raise corrupt(f"checkpoint {i} has metadata_checksum {mc!r}, not 'xxh3-64:' and 16 lowercase hex digits")
        last = i
    return entries


# ---------------------------------------------------------------- checkpoint.json


@dataclass
class Checked:
    """A checkpoint.json that passed section 17 (1 to 5 and 7): its tensors with
    their chunks (files located), aliases, and objects still encoded."""

    tensors: dict[str, LogicalTensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # chunk file as written -> where it is


def _name_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not name:
        return "is empty or not a string"
    if len(name.encode("utf-8")) > 1024:
        return "is longer than 1024 UTF-8 bytes"
    if "@" in name:
        return "contains '@'"
    if _CONTROL.search(name):
        return "contains a control character"
    return None


def check_checkpoint(doc: dict[str, Any], path: Path, *, index: int | None, run_id: str | None,
                     locate: Callable[[str, int], Path]) -> Checked:
    """Section 17 for one checkpoint.json. ``index`` and ``run_id``: what its
    directory name and manifest entry say (None where unknown). ``locate(file,
    file_index)`` maps a chunk's ``file`` to a path (and refuses what may not be read)."""

    def corrupt(why: str, hint: str = _METADATA_HINT) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}", hint=hint, path=path)

    def newer(why: str) -> RavexError:
        return RavexError(f"{path}: {why}", hint=_UPGRADE, path=path)

    own = doc.get("index")
    if not _int(own) or not 0 <= own <= MAX_INDEX:
        raise corrupt(f"index is {own!r}, not an integer from 0 to {MAX_INDEX}")
    if index is not None and own != index:
        raise corrupt(f"index is {own}, but its directory and manifest entry say {index}")
    if run_id is not None and doc.get("run_id") != run_id:
        raise corrupt(f"run_id is {doc.get('run_id')!r}, but its manifest entry says {run_id!r}")
    if not isinstance(doc.get("run_id"), str):
        raise corrupt(f"run_id is {doc.get('run_id')!r}, not a string")
    step, ws = doc.get("step"), doc.get("world_size")
    if step is not None and (not _int(step) or step < 0):
        raise corrupt(f"step is {step!r}, not a non-negative integer or null")
    if not _int(ws) or ws < 1:
        raise corrupt(f"world_size is {ws!r}, not a positive integer")
    source = doc.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("format"), str) or not isinstance(source.get("versions"), dict):
        raise corrupt("'source' is not an object with a string 'format' and an object 'versions'")
    tensors: Any = doc.get("tensors")
    aliases: Any = doc.get("aliases", {})
    objects: Any = doc.get("objects", {})
    for key, value in (("tensors", tensors), ("aliases", aliases), ("objects", objects)):
        if not isinstance(value, dict):
            raise corrupt(f"'{key}' is {type(value).__name__}, not an object")
    out = Checked()
    for alias, target in aliases.items():
        why = _name_problem(alias)
        if why:
            raise corrupt(f"alias {alias!r} {why}; a logical name is 1 to 1024 UTF-8 bytes without '@' or control characters")
        if alias in tensors:
            raise corrupt(f"'{alias}' is both a tensor and an alias; a logical name is unique across both")
        if not isinstance(target, str) or target not in tensors:
            kind = "another alias" if isinstance(target, str) and target in aliases else "no stored tensor"
            raise corrupt(f"alias '{alias}' names {target!r}, which is {kind}; an alias must name a key of 'tensors'")
        out.aliases[alias] = target
    limit = max_chunks_per_tensor()
    cache: dict[str, Path] = {}
    for name, entry in tensors.items():
        why = _name_problem(name)
        if why:
            raise corrupt(f"tensor name {name!r} {why}; a logical name is 1 to 1024 UTF-8 bytes without '@' or control characters")
        out.tensors[name] = _tensor(path, name, entry, own, limit, cache, locate, corrupt, newer)
    out.files = cache
    kinds: Any = doc.get("kinds", {})  # added within version 1 (section 14): readers before 0.2 ignore it
    if not isinstance(kinds, dict):
        raise corrupt(f"'kinds' is {type(kinds).__name__}, not an object")
    for name, kind in kinds.items():
        if name not in out.tensors or not name.startswith(MODEL) or kind not in KINDS:
            raise corrupt(f"kinds[{name!r}] is {kind!r}: 'kinds' maps model/ tensors of 'tensors' to one of {', '.join(KINDS)}")
        out.tensors[name].kind = kind
    _check_objects(objects, f"{path}: objects", set(tensors) | set(aliases), corrupt, newer)
    out.objects = objects
    return out


def _tensor(path: Path, name: str, entry: Any, own: int, limit: int, cache: dict[str, Path], locate: Callable[[str, int], Path],
            corrupt: Callable[..., CorruptCheckpointError], newer: Callable[[str], RavexError]) -> LogicalTensor:
    if not isinstance(entry, dict):
        raise corrupt(f"tensor '{name}' is not an object")
    dtype, shape, chunks = entry.get("dtype"), entry.get("shape"), entry.get("chunks")
    if not isinstance(dtype, str):
        raise corrupt(f"tensor '{name}' has dtype {dtype!r}, not a string")
    if dtype not in DTYPES:
        raise newer(f"tensor '{name}' has dtype {dtype!r}, which format version 1 does not have ({', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
        raise corrupt(f"tensor '{name}' has shape {shape!r}; a shape lists non-negative integers")
    if len(shape) > MAX_DIMS:
        raise corrupt(f"tensor '{name}' has {len(shape)} dimensions; at most {MAX_DIMS} are allowed")
    if not isinstance(chunks, list):
        raise corrupt(f"tensor '{name}' has no 'chunks' list")
    if len(chunks) > limit:
        raise corrupt(f"tensor '{name}' has {len(chunks):,} chunks, more than the limit of {limit:,}",
                      hint="no real checkpoint needs that many; if this one does, set RAVEX_MAX_CHUNKS_PER_TENSOR higher")
    dims = tuple(shape)
    size = DTYPES[dtype]
    t = LogicalTensor(name, dims, dtype)
    for k, c in enumerate(chunks):
        at = f"tensor '{name}', chunk {k}"
        if not isinstance(c, dict):
            raise corrupt(f"{at} is not an object")
        missing = [f for f in ("file", "offset", "nbytes", "stored_nbytes", "compression", "region", "checksum") if f not in c]
        if missing:
            raise corrupt(f"{at} lacks {', '.join(missing)}")
        rel, offset, nbytes, stored, comp, checksum = c["file"], c["offset"], c["nbytes"], c["stored_nbytes"], c["compression"], c["checksum"]
        m = _FILE.fullmatch(rel) if isinstance(rel, str) else None
        if m is None and isinstance(rel, str):
            inside(path.parent, rel, f"{at}: file", path)  # an absolute path or '..' is refused as unsafe first
        if m is None or ".tmp" in m.group(2) or m.group(2) == "checkpoint.json":
            raise corrupt(f"{at} has file {rel!r}; it must be 'checkpoints/<8 digits>/<data file name>' "
                          "(letters, digits, '.', '_', '-'; no '..', no absolute path)")
        if int(m.group(1)) > own:
            raise corrupt(f"{at} has file {rel!r} in checkpoint {int(m.group(1))}, after this checkpoint ({own})")
        for fname, v in (("offset", offset), ("nbytes", nbytes), ("stored_nbytes", stored)):
            if not _int(v) or v < 0:
                raise corrupt(f"{at} has {fname} {v!r}, not a non-negative integer")
        if comp is not None and not isinstance(comp, str):
            raise corrupt(f"{at} has compression {comp!r}, not null or a string")
        if comp not in (None, "zstd"):
            raise newer(f"{at} uses compression {comp!r}, unknown to this Ravex (it knows null and 'zstd')")
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            if isinstance(checksum, str) and ":" in checksum and not checksum.startswith("xxh3-64:"):
                raise newer(f"{at} has checksum algorithm {checksum.split(':')[0]!r}, unknown to this Ravex (it knows xxh3-64)")
            raise corrupt(f"{at} has checksum {checksum!r}, not 'xxh3-64:' and 16 lowercase hex digits")
        region = _region(c["region"], dims, at, corrupt, newer)
        if nbytes != region.numel * size:
            raise corrupt(f"{at} has nbytes {nbytes}, but its region holds {region.numel} {dtype} elements ({region.numel * size} bytes)")
        if comp is None and stored != nbytes:
            raise corrupt(f"{at} is uncompressed but its stored_nbytes {stored} differs from nbytes {nbytes}")
        where = cache.get(rel)
        if where is None:
            where = cache[rel] = locate(rel, int(m.group(1)))
        t.chunks.append(Chunk(region, dtype, where, offset, compression=comp, stored_nbytes=stored, checksum=checksum))
    why = _tiling_problem(dims, [c.region for c in t.chunks])
    if why:
        raise corrupt(f"tensor '{name}': its chunks do not tile it: {why}; each element must be stored exactly once")
    return t


def _region(raw: Any, shape: tuple[int, ...], at: str, corrupt: Callable[..., CorruptCheckpointError],
            newer: Callable[[str], RavexError]) -> Region:
    if not isinstance(raw, dict) or len(raw) != 1:
        raise corrupt(f"{at} has region {raw!r}; it must be exactly one of {{\"box\": ...}} and {{\"flat\": ...}}")
    (kind, body), = raw.items()
    if kind == "box":
        offs: Any = body.get("offsets") if isinstance(body, dict) and set(body) == {"offsets", "sizes"} else None
        sizes: Any = body.get("sizes") if isinstance(body, dict) else None
        ok = (isinstance(offs, list) and isinstance(sizes, list) and len(offs) == len(sizes) == len(shape)
              and all(_int(o) and o >= 0 for o in offs) and all(_int(s) and s >= 1 for s in sizes))
        if not ok:
            raise corrupt(f"{at} has box {body!r}"[:200] + f"; it needs 'offsets' and 'sizes', one integer per dimension ({len(shape)}), sizes >= 1")
        for d, (o, s) in enumerate(zip(offs, sizes)):
            if o + s > shape[d]:
                raise corrupt(f"{at}: its box reaches index {o + s - 1} of dimension {d}, but the tensor's shape is {list(shape)}")
        return Box(tuple(offs), tuple(sizes))
    if kind == "flat":
        start, length = (body.get("start"), body.get("length")) if isinstance(body, dict) and set(body) == {"start", "length"} else (None, None)
        if not (_int(start) and _int(length)) or start < 0 or length < 1:
            raise corrupt(f"{at} has flat region {body!r}; it needs integer 'start' >= 0 and 'length' >= 1")
        n = 1
        for s in shape:
            n *= s
        if start + length > n:
            raise corrupt(f"{at}: its flat region ends at element {start + length}, but the tensor has {n}")
        return Flat(start, length)
    raise newer(f"{at} has region kind {kind!r}, unknown to this Ravex (it knows box and flat)")


# ---------------------------------------------------------------- tiling (section 11)


class _TooIrregular(Exception):
    pass


def _tiling_problem(shape: tuple[int, ...], regions: list[Region]) -> str | None:
    """None when the regions (each inside ``shape``) store every element exactly once.

    With every region inside the tensor, they tile it exactly when they hold as
    many elements as it has and no two overlap; overlaps are found by sorting
    (contiguous regions) or by a sweep over dimension 0 that compares only the
    boxes a slab crosses, recursively (grids cost about one step per chunk)."""
    n = 1
    for s in shape:
        n *= s
    total = sum(r.numel for r in regions)
    if total != n:
        return f"they hold {total} elements, the tensor {n}"
    if len(regions) < 2:
        return None
    rest, zeros = shape[1:], (0,) * (len(shape) - 1)
    if all(isinstance(r, Box) and r.offsets[1:] == zeros and r.sizes[1:] == rest for r in regions):
        # the common layout (dim-0 shards): intervals of dimension 0
        rows = sorted((r.offsets[0], r.sizes[0]) for r in regions if isinstance(r, Box))
        for (a, la), (b, _lb) in itertools.pairwise(rows):
            if a + la > b:
                return f"two chunks share rows {b} to {min(a + la, b + _lb) - 1} of dimension 0"
        return None
    runs = [flat_range(r, shape) for r in regions]
    if all(x is not None for x in runs):
        ordered = sorted(x for x in runs if x is not None)
        for (a, la), (b, lb) in itertools.pairwise(ordered):
            if a + la > b:
                return f"two chunks share elements {b} to {min(a + la, b + lb) - 1} of the flattened tensor"
        return None
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for r in regions:
        if isinstance(r, Flat):
            boxes.extend(_flat_boxes(r.start, r.start + r.length, shape))
        else:
            boxes.append((r.offsets, r.sizes))
    try:
        return "two chunks overlap" if _overlap(boxes, 0, len(shape), [TILING_BUDGET]) else None
    except _TooIrregular:
        return f"the layout is too irregular to check (over {TILING_BUDGET:,} box comparisons); no framework writes such a layout"


def _flat_boxes(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``start`` to ``end - 1`` of the row-major tensor as at most 2 x ndim - 1 boxes."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = 1
    for s in shape[1:]:
        inner *= s
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    rest = shape[1:]
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in _flat_boxes(c0, c1, rest)]
    out = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in _flat_boxes(c0, inner, rest)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0 for _ in rest)), (r1 - r0, *rest)))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in _flat_boxes(0, c1, rest)]
    return out


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], d: int, ndim: int, budget: list[int]) -> bool:
    """Whether two of ``boxes`` overlap in dimensions ``d`` and after."""
    if len(boxes) < 2:
        return False
    if d == ndim - 1:
        iv = sorted((o[d], o[d] + s[d]) for o, s in boxes)
        return any(a[1] > b[0] for a, b in itertools.pairwise(iv))
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, (o, s) in enumerate(boxes):
        starts.setdefault(o[d], []).append(i)
        ends.setdefault(o[d] + s[d], []).append(i)
    active: dict[int, None] = {}
    for x in sorted(starts.keys() | ends.keys()):
        for i in ends.get(x, ()):
            del active[i]
        added = starts.get(x)
        if not added:
            continue  # fewer boxes than the slab before: no new pair
        active.update(dict.fromkeys(added))
        if len(active) > 1:
            budget[0] -= len(active)
            if budget[0] < 0:
                raise _TooIrregular
            if _overlap([boxes[i] for i in active], d + 1, ndim, budget):
                return True
    return False


# ---------------------------------------------------------------- objects (section 13)


def _check_objects(objects: dict[str, Any], where: str, names: set[str], corrupt: Callable[..., CorruptCheckpointError],
                   newer: Callable[[str], RavexError]) -> None:
    """Section 17.7: known tags with exactly their keys and well-formed values; tensor tags that resolve."""
    fields = {"int": {"value"}, "float": {"value"}, "dict": {"items"}, "tuple": {"items"}, "set": {"items"},
              "bytes": {"base64"}, "dtype": {"value"}, "tensor": {"name"}}
    stack: list[tuple[Any, str]] = [(v, f"objects.{k}") for k, v in objects.items()]
    while stack:
        v, at = stack.pop()
        if isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
            continue
        if not isinstance(v, dict):
            continue
        if TAG not in v:
            stack.extend((x, f"{at}.{k}") for k, x in v.items())
            continue
        tag = v[TAG]
        if not isinstance(tag, str) or tag not in fields:
            raise newer(f"{at} has the tag {tag!r}, unknown to this Ravex")
        if set(v) - {TAG} != fields[tag]:
            raise corrupt(f"{at}: a {tag!r} tag has the keys {sorted(set(v) - {TAG})}, expected {sorted(fields[tag])}")
        body = v[next(iter(fields[tag]))]
        bad = False
        if tag == "int":
            bad = not (isinstance(body, str) and _INT.fullmatch(body) and len(body) <= 4300)
        elif tag == "float":
            bad = body not in ("nan", "inf", "-inf")
        elif tag == "bytes":
            bad = not isinstance(body, str) or not _base64(body)
        elif tag in ("dtype",):
            bad = not isinstance(body, str)
        elif tag == "tensor":
            if not isinstance(body, str) or body not in names:
                raise corrupt(f"{at} refers to tensor {body!r}, which is neither in 'tensors' nor in 'aliases'")
        elif tag == "dict":
            bad = not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body)
            if not bad:
                stack.extend((x, f"{at}.items[{i}]") for i, p in enumerate(body) for x in p)
        else:  # tuple, set
            bad = not isinstance(body, list)
            if not bad:
                stack.extend((x, f"{at}.items[{i}]") for i, x in enumerate(body))
        if bad:
            raise corrupt(f"{at}: malformed {tag!r} value {body!r}"[:300])


def _base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
