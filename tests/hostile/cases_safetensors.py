"""Cases in safetensors files, single and sharded."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from .corpus import add, flip, put_json, seed_of, symlink_out, truncate

# ---- safetensors ------------------------------------------------------------------


def _st_header(f: Path) -> tuple[int, dict[str, object]]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _st_cut(where: str) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        f = src / "model.safetensors"
        n, _ = _st_header(f)
        size = f.stat().st_size
        truncate(f, {"4": 4, "length": 8, "header-mid": 8 + n // 2, "header-end-1": 8 + n - 1, "header-end": 8 + n,
                     "data-mid": (8 + n + size) // 2, "last-byte": size - 1}[where])
        return f
    return make


for _w in ("4", "length", "header-mid", "header-end-1", "header-end", "data-mid", "last-byte"):
    add(f"st_single/truncate-{_w}", "st_single", "truncate", _st_cut(_w), inspect_must_fail=True)
add("st_single/empty-file", "st_single", "empty", lambda s, w: (truncate(s / "model.safetensors", 0), s / "model.safetensors")[1],
    inspect_must_fail=True)


def _st_length(value: int) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        f = src / "model.safetensors"
        raw = bytearray(f.read_bytes())
        raw[:8] = struct.pack("<Q", value)
        f.write_bytes(bytes(raw))
        return f
    return make


add("st_single/oversize-length-2^63", "st_single", "oversize", _st_length(2**63), must_fail=True, inspect_must_fail=True)
add("st_single/oversize-length-past-end", "st_single", "oversize", _st_length(10**6), must_fail=True, inspect_must_fail=True)
add("st_single/length-1", "st_single", "oversize", _st_length(1), must_fail=True, inspect_must_fail=True)
add("st_single/length-0", "st_single", "oversize", _st_length(0), must_fail=True, inspect_must_fail=True)


def _st_edit(edit: Callable[[dict[str, object]], object], raw_header: Callable[[dict[str, object]], bytes] | None = None) -> Callable[[Path, Path], Path]:
    """Rewrite the header (padded to keep the data where it was when it fits)."""
    def make(src: Path, work: Path) -> Path:
        f = src / "model.safetensors"
        n, header = _st_header(f)
        data = f.read_bytes()[8 + n:]
        if raw_header is not None:
            new = raw_header(header)
        else:
            out = edit(header)
            new = json.dumps(header if out is None else out).encode()
        if len(new) <= n:
            new += b" " * (n - len(new))  # keep the data where it was
        f.write_bytes(struct.pack("<Q", len(new)) + new + data)
        return f
    return make


def _first(h: dict[str, object]) -> dict[str, object]:
    return next(v for k, v in h.items() if k != "__metadata__")  # type: ignore[return-value]


def _set(field: str, value: object) -> Callable[[dict[str, object]], None]:
    def edit(h: dict[str, object]) -> None:
        _first(h)[field] = value
    return edit


add("st_single/oversize-shape-overflow", "st_single", "oversize", _st_edit(_set("shape", [2**40, 2**40])), must_fail=True, inspect_must_fail=True)
add("st_single/oversize-shape", "st_single", "oversize", _st_edit(_set("shape", [1000, 1000])), must_fail=True, inspect_must_fail=True)
add("st_single/negative-shape", "st_single", "oversize", _st_edit(_set("shape", [-1, 4])), must_fail=True, inspect_must_fail=True)
add("st_single/oversize-data-offsets", "st_single", "oversize", _st_edit(_set("data_offsets", [0, 2**62])), must_fail=True, inspect_must_fail=True)
add("st_single/negative-data-offsets", "st_single", "oversize", _st_edit(_set("data_offsets", [-8, 0])), must_fail=True, inspect_must_fail=True)
add("st_single/data-offsets-reversed", "st_single", "oversize", _st_edit(_set("data_offsets", [8, 0])), must_fail=True, inspect_must_fail=True)
add("st_single/data-offsets-strings", "st_single", "semantic", _st_edit(_set("data_offsets", ["0", "8"])), must_fail=True, inspect_must_fail=True)
add("st_single/dtype-unknown", "st_single", "semantic", _st_edit(_set("dtype", "F128")), must_fail=True, inspect_must_fail=True)
add("st_single/shape-not-a-list", "st_single", "semantic", _st_edit(_set("shape", "big")), must_fail=True, inspect_must_fail=True)
add("st_single/header-is-a-list", "st_single", "semantic", _st_edit(lambda h: list(h)), must_fail=True, inspect_must_fail=True)
add("st_single/header-deep-nesting", "st_single", "bomb", _st_edit(lambda h: None, raw_header=lambda h: b"[" * 100_000 + b"]" * 100_000),
    must_fail=True, inspect_must_fail=True)
add("st_single/header-not-utf8", "st_single", "semantic", _st_edit(lambda h: None, raw_header=lambda h: json.dumps(h).encode().replace(b'"', b'\xff"', 1)),
    must_fail=True, inspect_must_fail=True)


def _st_overlap(h: dict[str, object]) -> None:
    names = [k for k in h if k != "__metadata__"]
    a, b = (h[names[0]], h[names[1]])
    b["data_offsets"] = a["data_offsets"]  # type: ignore[index]
    b["shape"], b["dtype"] = a["shape"], a["dtype"]  # type: ignore[index]


add("st_single/overlapping-tensors", "st_single", "semantic", _st_edit(_st_overlap), must_fail=True)


def _st_dup(h: dict[str, object]) -> bytes:
    body = json.dumps(h)
    k = next(k for k in h if k != "__metadata__")
    return (body[:-1] + ", " + json.dumps(k) + ": " + json.dumps(h[k]) + "}").encode()


add("st_single/duplicate-key", "st_single", "semantic", _st_edit(lambda h: None, raw_header=_st_dup), must_fail=True)

for _i in range(4):
    def _st_flip_header(src: Path, work: Path, name: str = f"st_single/flip-header-{_i}") -> Path:
        r = seed_of(name)
        f = src / "model.safetensors"
        n, _ = _st_header(f)
        flip(f, 8 + r.randrange(n), r.randrange(8))
        return f
    add(f"st_single/flip-header-{_i}", "st_single", "flip-meta", _st_flip_header)
for _i in range(3):
    def _st_flip_data(src: Path, work: Path, name: str = f"st_single/flip-data-{_i}") -> Path:
        r = seed_of(name)
        f = src / "model.safetensors"
        n, _ = _st_header(f)
        flip(f, 8 + n + r.randrange(f.stat().st_size - 8 - n), r.randrange(8))
        return f
    add(f"st_single/flip-data-{_i}", "st_single", "flip-data", _st_flip_data)

SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"
INDEX = "model.safetensors.index.json"


def _index_map(new: Callable[[Path], str], copy: bool = True) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        if copy:
            shutil.copy2(src / SHARD1, work / "outside" / SHARD1)
        idx = json.loads((src / INDEX).read_text())
        idx["weight_map"] = {k: (new(work) if v == SHARD1 else v) for k, v in idx["weight_map"].items()}
        put_json(src / INDEX, idx)
        return src
    return make


add("st_sharded/path-index-dotdot", "st_sharded", "path", _index_map(lambda w: f"../outside/{SHARD1}"), must_fail=True, inspect_must_fail=True)
add("st_sharded/path-index-absolute", "st_sharded", "path", _index_map(lambda w: str(w / "outside" / SHARD1)), must_fail=True, inspect_must_fail=True)
add("st_sharded/path-index-etc-passwd", "st_sharded", "path", _index_map(lambda w: "/etc/passwd", copy=False), must_fail=True, inspect_must_fail=True)
add("st_sharded/path-symlink-shard", "st_sharded", "path", lambda s, w: (symlink_out(s / SHARD2, w), s)[1], must_fail=True, inspect_must_fail=True)
add("st_sharded/path-symlink-index", "st_sharded", "path", lambda s, w: (symlink_out(s / INDEX, w), s)[1], must_fail=True, inspect_must_fail=True)
add("st_sharded/index-names-missing-shard", "st_sharded", "semantic", _index_map(lambda w: "model-00009-of-00003.safetensors", copy=False),
    must_fail=True, inspect_must_fail=True)
add("st_sharded/missing-shard", "st_sharded", "semantic", lambda s, w: ((s / SHARD2).unlink(), s)[1], must_fail=True, inspect_must_fail=True)
for _w, _frac in (("empty", 0), ("half", 2), ("last-byte", -1)):
    def _cut_index(src: Path, work: Path, frac: int = _frac) -> Path:
        f = src / INDEX
        n = f.stat().st_size
        truncate(f, 0 if frac == 0 else (n // 2 if frac == 2 else n - 2))
        return src
    add(f"st_sharded/truncate-index-{_w}", "st_sharded", "truncate", _cut_index, inspect_must_fail=True)
add("st_sharded/index-deep-nesting", "st_sharded", "bomb", lambda s, w: ((s / INDEX).write_text("[" * 100_000 + "]" * 100_000), s)[1],
    must_fail=True, inspect_must_fail=True)
add("st_sharded/truncate-shard-header-end", "st_sharded", "truncate",
    lambda s, w: (truncate(s / SHARD2, 8 + _st_header(s / SHARD2)[0]), s)[1], inspect_must_fail=True)
add("st_sharded/truncate-shard-data-mid", "st_sharded", "truncate",
    lambda s, w: (truncate(s / SHARD2, (8 + _st_header(s / SHARD2)[0] + (s / SHARD2).stat().st_size) // 2), s)[1], inspect_must_fail=True)
add("st_sharded/empty-shard", "st_sharded", "empty", lambda s, w: (truncate(s / SHARD2, 0), s)[1], inspect_must_fail=True)
for _i in range(2):
    def _sh_flip(src: Path, work: Path, name: str = f"st_sharded/flip-data-{_i}") -> Path:
        r = seed_of(name)
        f = src / SHARD2
        n, _ = _st_header(f)
        flip(f, 8 + n + r.randrange(f.stat().st_size - 8 - n), r.randrange(8))
        return src
    add(f"st_sharded/flip-data-{_i}", "st_sharded", "flip-data", _sh_flip)
