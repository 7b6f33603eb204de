"""Cases in DCP checkpoints: .metadata and .distcp files, paths, sizes."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from . import picklekit as pk
from . import zipkit
from .corpus import add, code_pickle, flip, seed_of, symlink_out, truncate

# ---- DCP --------------------------------------------------------------------------


def _dcp_items(root: Path) -> list[tuple[str, int, int]]:
    # the installed Ravex: the source tree has no compiled core (CI tests the wheel)
    from ravex_convert.formats.dcp import reader as dcp

    meta = dcp.read_metadata(root)
    return sorted({(i.file, i.offset, i.length) for i in meta.items.values()})


def _dcp_cut(where: str) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        meta = src / ".metadata"
        n = meta.stat().st_size
        if where.startswith("metadata-"):
            truncate(meta, {"metadata-2": 2, "metadata-quarter": n // 4, "metadata-half": n // 2, "metadata-before-stop": n - 1}[where])
            return src
        items = [i for i in _dcp_items(src) if i[0] == "__1_0.distcp"]
        f = src / "__1_0.distcp"
        mid = items[len(items) // 2]
        truncate(f, {"distcp-item-start": mid[1], "distcp-item-start+1": mid[1] + 1, "distcp-item-mid": mid[1] + mid[2] // 2,
                     "distcp-last-byte": f.stat().st_size - 1}[where])
        return src
    return make


for _w in ("metadata-2", "metadata-quarter", "metadata-half", "metadata-before-stop",
           "distcp-item-start", "distcp-item-start+1", "distcp-item-mid", "distcp-last-byte"):
    add(f"dcp/truncate-{_w}", "dcp", "truncate", _dcp_cut(_w), inspect_must_fail=True)
add("dcp/empty-metadata", "dcp", "empty", lambda s, w: (truncate(s / ".metadata", 0), s)[1], inspect_must_fail=True)
add("dcp/empty-distcp", "dcp", "empty", lambda s, w: (truncate(s / "__0_0.distcp", 0), s)[1], inspect_must_fail=True)

for _i in range(5):
    def _dcp_flip_meta(src: Path, work: Path, name: str = f"dcp/flip-metadata-{_i}") -> Path:
        r = seed_of(name)
        meta = src / ".metadata"
        flip(meta, r.randrange(meta.stat().st_size), r.randrange(8))
        return src
    add(f"dcp/flip-metadata-{_i}", "dcp", "flip-meta", _dcp_flip_meta)

for _i in range(4):
    def _dcp_flip_data(src: Path, work: Path, name: str = f"dcp/flip-data-{_i}") -> Path:
        r = seed_of(name)
        items = _dcp_items(src)
        while True:
            file, off, length = r.choice(items)
            lay = zipkit.layout(src / file, off, length)
            if lay.data_entries():
                break
        e = max(lay.data_entries(), key=lambda e: e.size)
        flip(src / file, off + e.data + r.randrange(e.size), r.randrange(8))
        return src
    add(f"dcp/flip-data-{_i}", "dcp", "flip-data", _dcp_flip_data)


def _dcp_path(new: Callable[[Path], str], copy: bool = True) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        if copy:
            shutil.copy2(src / "__0_0.distcp", work / "outside" / "__0_0.distcp")
        meta = src / ".metadata"
        meta.write_bytes(pk.replace_strings(meta.read_bytes(), {"__0_0.distcp": new(work)}))
        return src
    return make


add("dcp/path-relative-dotdot", "dcp", "path", _dcp_path(lambda w: "../outside/__0_0.distcp"), must_fail=True, inspect_must_fail=True)
add("dcp/path-absolute", "dcp", "path", _dcp_path(lambda w: str(w / "outside" / "__0_0.distcp")), must_fail=True, inspect_must_fail=True)
add("dcp/path-etc-passwd", "dcp", "path", _dcp_path(lambda w: "/etc/passwd", copy=False), must_fail=True, inspect_must_fail=True)
add("dcp/path-symlink-distcp", "dcp", "path", lambda s, w: (symlink_out(s / "__0_0.distcp", w), s)[1], must_fail=True, inspect_must_fail=True)
add("dcp/path-symlink-metadata", "dcp", "path", lambda s, w: (symlink_out(s / ".metadata", w), s)[1], must_fail=True, inspect_must_fail=True)


def _dcp_int(key: str, value: int) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        meta = src / ".metadata"
        meta.write_bytes(pk.replace_int_after(meta.read_bytes(), key, value, nth=0))
        return src
    return make


add("dcp/oversize-item-length", "dcp", "oversize", _dcp_int("length", 10**12), must_fail=True, inspect_must_fail=True)
add("dcp/oversize-item-offset", "dcp", "oversize", _dcp_int("offset", 10**12), must_fail=True, inspect_must_fail=True)
add("dcp/negative-item-offset", "dcp", "oversize", _dcp_int("offset", -5), must_fail=True, inspect_must_fail=True)
add("dcp/code-os-system-metadata", "dcp", "code", lambda s, w: ((s / ".metadata").write_bytes(code_pickle(w)), s)[1], must_fail=True,
    expect="UnsafeCheckpointError", inspect_must_fail=True)
add("dcp/billion-laughs-metadata", "dcp", "bomb", lambda s, w: ((s / ".metadata").write_bytes(pk.billion_laughs(9, 10)), s)[1], must_fail=True,
    inspect_must_fail=True)
