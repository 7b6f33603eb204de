"""Cases in Ravex native stores (plain and zstd), and inputs that are no checkpoint at all."""

from __future__ import annotations

import functools
import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from .corpus import add, code_pickle, flip, put_json, reseal, seed_of, symlink_out, truncate

# ---- native store ------------------------------------------------------------------

CKPT = "checkpoints/00000000"
CJSON = f"{CKPT}/checkpoint.json"


def _doc(src: Path) -> dict[str, object]:
    return json.loads((src / CJSON).read_text())  # type: ignore[no-any-return]


def _native_edit(edit: Callable[[dict[str, object], Path], object], file: str = CJSON, seal: bool = True) -> Callable[[Path, Path], Path]:
    """A crafted edit of one JSON file; ``seal``: then record checkpoint.json's new
    checksum in the manifest (a crafted store is consistent; bit rot is not)."""
    def make(src: Path, work: Path) -> Path:
        doc = json.loads((src / file).read_text())
        out = edit(doc, work)
        if isinstance(out, (bytes, str)):
            (src / file).write_text(out if isinstance(out, str) else out.decode())
        else:
            put_json(src / file, doc if out is None else out)
        if seal:
            reseal(src)
        return src
    return make


def _tensors(doc: dict[str, object]) -> dict[str, dict[str, object]]:
    return doc["tensors"]  # type: ignore[return-value]


def _first_chunk(doc: dict[str, object]) -> dict[str, object]:
    t = next(iter(_tensors(doc).values()))
    return t["chunks"][0]  # type: ignore[index,no-any-return]


def _data_file(src: Path) -> Path:
    return next(p for p in (src / CKPT).iterdir() if p.name != "checkpoint.json")


for _f, _cuts in ((CJSON, ("empty", "1", "half", "before-last-brace")), ("manifest.json", ("empty", "half", "before-last-brace")),
                  ("ravex-store.json", ("empty", "half"))):
    for _w in _cuts:
        def _cut_json(src: Path, work: Path, file: str = _f, where: str = _w) -> Path:
            p = src / file
            n = p.stat().st_size
            truncate(p, {"empty": 0, "1": 1, "half": n // 2, "before-last-brace": n - 2}[where])
            return src
        add(f"native/truncate-{Path(_f).stem}-{_w}", "native", "truncate", _cut_json, inspect_must_fail=True)
add("native/truncate-data-half", "native", "truncate", lambda s, w: (truncate(_data_file(s), _data_file(s).stat().st_size // 2), s)[1],
    inspect_must_fail=True)
add("native/truncate-data-last-byte", "native", "truncate", lambda s, w: (truncate(_data_file(s), _data_file(s).stat().st_size - 1), s)[1],
    inspect_must_fail=True)
for _i in range(3):
    def _nat_flip(src: Path, work: Path, name: str = f"native/flip-data-{_i}") -> Path:
        r = seed_of(name)
        f = _data_file(src)
        doc = _doc(src)
        # inside the bytes of some chunk (the safetensors header of the data file is not covered)
        c = r.choice([c for t in _tensors(doc).values() for c in t["chunks"] if c["nbytes"]])  # type: ignore[attr-defined]
        flip(f, c["offset"] + r.randrange(c["nbytes"]), r.randrange(8))
        return src
    add(f"native/flip-data-{_i}", "native", "flip-data", _nat_flip)


def _digit_flip(key: str) -> Callable[[Path, Path], Path]:
    """Change one digit of a top-level number or of the first chunk's field (a 'flipped digit' in the JSON)."""
    def make(src: Path, work: Path) -> Path:
        p = src / CJSON
        text = p.read_text()
        at = text.index(f'"{key}": ') + len(key) + 4
        while not text[at].isdigit():
            at += 1
        d = text[at]
        p.write_text(text[:at] + ("1" if d != "1" else "2") + text[at + 1:])
        return src
    return make


for _k in ("step", "shape", "offset", "nbytes", "lr"):
    add(f"native/flip-json-digit-{_k}", "native", "flip-meta", _digit_flip(_k))


def _flip_checksum(src: Path, work: Path) -> Path:
    p = src / CJSON
    text = p.read_text()
    at = text.index('"xxh3-64:') + 9
    p.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:])
    return src


add("native/flip-json-checksum", "native", "flip-meta", _flip_checksum, must_fail=True)


def _chunk_file(value: Callable[[Path], str], copy: bool = True) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        if copy:
            shutil.copy2(_data_file(src), work / "outside" / _data_file(src).name)
        def edit(doc: dict[str, object], w: Path) -> None:
            for t in _tensors(doc).values():
                for c in t["chunks"]:  # type: ignore[attr-defined]
                    c["file"] = value(w)
        return _native_edit(edit)(src, work)
    return make


add("native/path-chunk-dotdot", "native", "path", _chunk_file(lambda w: "../outside/" + "rank00000.safetensors"), must_fail=True, inspect_must_fail=True)
add("native/path-chunk-absolute", "native", "path", _chunk_file(lambda w: str(w / "outside" / "rank00000.safetensors")), must_fail=True,
    inspect_must_fail=True)
add("native/path-chunk-etc-passwd", "native", "path", _chunk_file(lambda w: "/etc/passwd", copy=False), must_fail=True, inspect_must_fail=True)


def _manifest_dir(value: Callable[[Path], str]) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        shutil.copytree(src / CKPT, work / "outside" / "00000000")
        def edit(doc: dict[str, object], w: Path) -> None:
            doc["checkpoints"][0]["dir"] = value(w)  # type: ignore[index]
        return _native_edit(edit, "manifest.json")(src, work)
    return make


add("native/path-manifest-dir-dotdot", "native", "path", _manifest_dir(lambda w: "../outside/00000000"), must_fail=True, inspect_must_fail=True)
add("native/path-manifest-dir-absolute", "native", "path", _manifest_dir(lambda w: str(w / "outside" / "00000000")), must_fail=True,
    inspect_must_fail=True)
add("native/path-symlink-checkpoints-dir", "native", "path", lambda s, w: (symlink_out(s / "checkpoints", w), s)[1], must_fail=True,
    inspect_must_fail=True)
add("native/path-symlink-data-file", "native", "path", lambda s, w: (symlink_out(_data_file(s), w), s)[1], must_fail=True, inspect_must_fail=True)
add("native/path-symlink-checkpoint-json", "native", "path", lambda s, w: (symlink_out(s / CJSON, w), s)[1], must_fail=True, inspect_must_fail=True)


def _chunk_set(field: str, value: object) -> Callable[[Path, Path], Path]:
    return _native_edit(lambda doc, w: _first_chunk(doc).__setitem__(field, value))


add("native/oversize-chunk-offset", "native", "oversize", _chunk_set("offset", 2**62), must_fail=True)
add("native/negative-chunk-offset", "native", "oversize", _chunk_set("offset", -4), must_fail=True)
add("native/oversize-chunk-nbytes", "native", "oversize", _chunk_set("nbytes", 2**62), must_fail=True)
add("native/oversize-stored-nbytes", "native", "oversize", _chunk_set("stored_nbytes", 2**62), must_fail=True)


def _shape_huge(doc: dict[str, object], w: Path) -> None:
    t = next(iter(_tensors(doc).values()))
    t["shape"] = [2**40, 2**40]
    t["chunks"][0]["region"] = {"box": {"offsets": [0, 0], "sizes": [2**40, 2**40]}}  # type: ignore[index]


add("native/oversize-shape", "native", "oversize", _native_edit(_shape_huge), must_fail=True, inspect_must_fail=True)
add("native/region-past-shape", "native", "oversize",
    _native_edit(lambda d, w: _first_chunk(d).__setitem__("region", {"box": {"offsets": [5, 0], "sizes": [37, 13]}})), must_fail=True)
add("native/region-garbage", "native", "semantic", _native_edit(lambda d, w: _first_chunk(d).__setitem__("region", {"box": "x"})), must_fail=True,
    inspect_must_fail=True)


def _dup_key(doc: dict[str, object], w: Path) -> str:
    text = json.dumps(doc)
    name = next(iter(_tensors(doc)))
    entry = json.dumps(_tensors(doc)[name])
    return text.replace('"tensors": {', '"tensors": {' + json.dumps(name) + ": " + entry + ", ", 1)


def _overlap(doc: dict[str, object], w: Path) -> None:
    t = _tensors(doc)["model/embed.weight"]
    c = dict(t["chunks"][0])  # type: ignore[index]
    c["region"] = {"box": {"offsets": [0, 0], "sizes": [37, 13]}}
    t["chunks"].append(c)  # type: ignore[attr-defined]


def _gap(doc: dict[str, object], w: Path) -> None:
    t = _tensors(doc)["model/embed.weight"]
    c = t["chunks"][0]  # type: ignore[index]
    c["region"] = {"box": {"offsets": [0, 0], "sizes": [36, 13]}}
    c["nbytes"] = c["stored_nbytes"] = 36 * 13 * 4


def _alias_chain(doc: dict[str, object], w: Path) -> None:
    doc["aliases"] = {"model/a": "model/b", "model/b": "model/embed.weight"}


def _control_name(doc: dict[str, object], w: Path) -> None:
    ts = _tensors(doc)
    ts["model/evil\x1b[2J\nname"] = ts.pop("model/pos_embed")  # not an alias's target


def _missing_newest(src: Path, work: Path) -> Path:
    shutil.copytree(src / CKPT, src / "checkpoints/00000001")
    (src / "checkpoints/00000001/checkpoint.json").unlink()
    m = json.loads((src / "manifest.json").read_text())
    e = dict(m["checkpoints"][0], index=1, dir="checkpoints/00000001", step=4)
    m["checkpoints"].append(e)
    m["next_index"] = 2
    put_json(src / "manifest.json", m)
    return src


add("native/duplicate-tensor-key", "native", "semantic", _native_edit(_dup_key), must_fail=True)
add("native/chunks-overlap", "native", "semantic", _native_edit(_overlap), must_fail=True)
add("native/chunks-leave-gap", "native", "semantic", _native_edit(_gap), must_fail=True)
add("native/alias-to-alias", "native", "semantic", _native_edit(_alias_chain), must_fail=True)
add("native/alias-to-nothing", "native", "semantic", _native_edit(lambda d, w: d.__setitem__("aliases", {"model/x": "model/missing"})), must_fail=True)
add("native/control-char-in-name", "native", "semantic", _native_edit(_control_name), must_fail=True, inspect_must_fail=True)
add("native/newest-checkpoint-json-missing", "native", "semantic", _missing_newest, must_fail=True, inspect_must_fail=True)
add("native/format-version-999", "native", "semantic", _native_edit(lambda d, w: d.__setitem__("format_version", 999)), must_fail=True,
    inspect_must_fail=True)
add("native/marker-missing", "native", "semantic", lambda s, w: ((s / "ravex-store.json").unlink(), s)[1], must_fail=True, inspect_must_fail=True)
add("native/json-deep-nesting", "native", "bomb", _native_edit(lambda d, w: '{"format": "ravex-checkpoint", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    must_fail=True, inspect_must_fail=True)
add("native/tensors-not-an-object", "native", "semantic", _native_edit(lambda d, w: d.__setitem__("tensors", [1, 2])), must_fail=True,
    inspect_must_fail=True)


def rle_zstd_frame(total: int, declare: bool = True, window: bool = False) -> bytes:
    """A zstd frame of ``total`` zero bytes made of RLE blocks (4 bytes per 128 KiB):
    a few KB that decode to gigabytes. ``declare``: record the content size;
    ``window``: with it, a 2 MiB window (a single-segment frame's window is its
    whole content, which decoders refuse past 128 MiB)."""
    block = 128 * 1024
    if declare and window:
        head = struct.pack("<I", 0xFD2FB528) + bytes([0xC0, 0x58]) + struct.pack("<Q", total)  # 8-byte content size, 2 MiB window
    elif declare:
        head = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", total)  # single segment, 8-byte content size
    else:
        head = struct.pack("<I", 0xFD2FB528) + bytes([0x00, 0x58])  # window descriptor: 2^(10+11) = 2 MiB window, no size
    out = [head]
    left = total
    while left > 0:
        n = min(block, left)
        left -= n
        hdr = (1 if left == 0 else 0) | (1 << 1) | (n << 3)
        out.append(hdr.to_bytes(3, "little") + b"\x00")
    return b"".join(out)


@functools.lru_cache(maxsize=4)
def _zeros_checksum(total: int, work: Path) -> str:
    """The xxh3-64 of ``total`` zero bytes, hashed from a sparse file (no memory, no disk)."""
    from ravex_convert import _core

    f = work / "outside" / ".zeros"
    with open(f, "wb") as fh:
        fh.truncate(total)
    try:
        (h,) = _core.checksum_ranges(str(f), [(0, total)], "xxh3-64")
    finally:
        f.unlink()
    return f"xxh3-64:{h:016x}"


def _zstd_bomb(total: int, declare: bool, honest: bool, window: bool = False) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        f = _data_file(src)
        frame = rle_zstd_frame(total, declare, window)
        offset = f.stat().st_size
        with open(f, "ab") as fh:
            fh.write(frame)
        def edit(doc: dict[str, object], w: Path) -> None:
            t = _tensors(doc)["model/embed.weight"]
            c = t["chunks"][0]  # type: ignore[index]
            c["offset"], c["stored_nbytes"] = offset, len(frame)
            if honest:
                c["checksum"] = _zeros_checksum(total, work)
                n = total // 4
                t["shape"] = [n]
                c["region"] = {"box": {"offsets": [0], "sizes": [n]}}
                c["nbytes"] = total
        return _native_edit(edit)(src, work)
    return make


add("native_zstd/bomb-honest-3GiB", "native_zstd", "bomb", _zstd_bomb(3 << 30, True, True), must_fail=True,
    note="a 100 KB frame that honestly decodes to 3 GiB: bound memory and output against what the source holds")
add("native_zstd/bomb-honest-3GiB-window-2MiB", "native_zstd", "bomb", _zstd_bomb(3 << 30, True, True, window=True), must_fail=True,
    note="the same with an ordinary window, which any decoder accepts")
add("native_zstd/bomb-lying-1GiB", "native_zstd", "bomb", _zstd_bomb(1 << 30, True, False), must_fail=True)
add("native_zstd/bomb-no-size-1GiB", "native_zstd", "bomb", _zstd_bomb(1 << 30, False, False), must_fail=True)
for _i in range(3):
    def _z_flip(src: Path, work: Path, name: str = f"native_zstd/flip-data-{_i}") -> Path:
        r = seed_of(name)
        f = _data_file(src)
        c = r.choice([c for t in _tensors(_doc(src)).values() for c in t["chunks"] if c["stored_nbytes"]])  # type: ignore[attr-defined]
        flip(f, c["offset"] + r.randrange(c["stored_nbytes"]), r.randrange(8))
        return src
    add(f"native_zstd/flip-data-{_i}", "native_zstd", "flip-data", _z_flip)
add("native_zstd/truncate-data-half", "native_zstd", "truncate", lambda s, w: (truncate(_data_file(s), _data_file(s).stat().st_size // 2), s)[1],
    inspect_must_fail=True)
add("native_zstd/compression-unknown", "native_zstd", "semantic", _chunk_set("compression", "lz4"), must_fail=True)

# ---- not a checkpoint ---------------------------------------------------------------


def _files(**files: bytes) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        for name, data in files.items():
            p = src / name.replace("__", "/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return src
    return make


_RANDOM = bytes(random.Random(7).randrange(256) for _ in range(4096))
add("other/empty-dir", None, "not-a-checkpoint", _files(), must_fail=True, inspect_must_fail=True, expect="UnknownFormatError")
add("other/text-files", None, "not-a-checkpoint", _files(**{"README.md": b"# hello\n", "notes.txt": b"x" * 100}), must_fail=True,
    inspect_must_fail=True, expect="UnknownFormatError")
add("other/random-pt", None, "not-a-checkpoint", lambda s, w: (_files(**{"model.pt": _RANDOM})(s, w), s / "model.pt")[1], must_fail=True,
    inspect_must_fail=True)
add("other/random-safetensors", None, "not-a-checkpoint", lambda s, w: (_files(**{"model.safetensors": _RANDOM})(s, w), s / "model.safetensors")[1],
    must_fail=True, inspect_must_fail=True)
add("other/empty-pt", None, "empty", lambda s, w: (_files(**{"model.pt": b""})(s, w), s / "model.pt")[1], must_fail=True, inspect_must_fail=True)
add("other/random-metadata", None, "not-a-checkpoint", _files(**{".metadata": _RANDOM, "__0_0.distcp": _RANDOM}), must_fail=True,
    inspect_must_fail=True)
add("other/latest-only", None, "not-a-checkpoint", _files(latest=b"global_step1"), must_fail=True, inspect_must_fail=True)
add("other/only-checkpoint-json", None, "not-a-checkpoint", _files(**{"checkpoint.json": b"{}"}), must_fail=True, inspect_must_fail=True)


def _zip_without_pickle(src: Path, work: Path) -> Path:
    import zipfile

    with zipfile.ZipFile(src / "model.pt", "w") as z:
        z.writestr("archive/data/0", b"\x00" * 16)
    return src / "model.pt"


add("other/zip-without-data-pkl", None, "not-a-checkpoint", _zip_without_pickle, must_fail=True, inspect_must_fail=True)
add("other/pickle-file-code", None, "code", lambda s, w: ((s / "model.pt").write_bytes(code_pickle(w)), s / "model.pt")[1], must_fail=True,
    inspect_must_fail=True)
