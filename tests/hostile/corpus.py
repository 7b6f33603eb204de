"""The corpus's core: what a case is, the bases it is made from, building one,
and the damage helpers every case module uses."""

import json
import random
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import picklekit as pk
from . import zipkit

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "fixtures" / "data"
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "fixtures" / "data"
PWNED = "PWNED"  # the file a foreign pickle's os.system would create in outside/

# Where each base checkpoint comes from: a fixture path (relative to DATA), or
# a builder (native stores, crafted files) run once per session.
FIXTURE_BASES = {
    "zero1": "zero1_ws2_bf16/checkpoint",
    "zero2": "zero2_ws2_bf16/checkpoint",
    "zero3": "zero3_ws2_bf16/checkpoint",
    "dcp": "fsdp2_ws2/checkpoint",
    "torch_save": "torch_save/checkpoint/model.pt",
    "st_single": "safetensors_single/checkpoint/model.safetensors",
    "st_sharded": "safetensors_sharded/checkpoint",
}
NATIVE_SOURCE = "zero3_ws2_bf16/checkpoint"


@dataclass(frozen=True)
class Case:
    name: str  # "<base>/<kind>-<detail>": the test id
    base: str | None  # the undamaged checkpoint it is made from (None: no baseline)
    kind: str  # truncate | flip-meta | flip-data | path | oversize | code | empty | semantic | not-a-checkpoint | bomb
    make: Callable[[Path, Path], Path]  # (base copy dir, work) -> SRC
    must_fail: bool = False  # no success is right (path tricks, code, impossible sizes)
    inspect_must_fail: bool = False  # `inspect` must notice too (truncations, path tricks)
    expect: str | None = None  # the RavexError subclass required, by name
    note: str = ""

    @property
    def format(self) -> str:
        return self.name.split("/", 1)[0]


def seed_of(name: str) -> random.Random:
    return random.Random(zlib.crc32(name.encode()))


# ---------------------------------------------------------------- bases


def build_native_stores(root: Path, ravex: str) -> dict[str, Path]:
    """The native stores the corpus damages, made by the `ravex` command."""
    out = {}
    for key, extra in (("native", []), ("native_zstd", ["--compression", "zstd"])):
        dst = root / key
        if not dst.exists():
            subprocess.run([ravex, "convert", str(DATA / NATIVE_SOURCE), str(dst), "--to", "native", "-q", *extra],
                           check=True, capture_output=True, timeout=120)
        out[key] = dst
    return out


def build_crafted(root: Path) -> dict[str, Path]:
    """A hand-written torch.save file (the pickle and zip written here, not by
    torch) whose cases vary one field of a tensor at a time."""
    dst = root / "crafted" / "model.pt"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        zipkit.write_archive(dst, "model", _crafted_pickle(), _crafted_storages())
    return {"crafted": dst}


def _crafted_storages() -> dict[str, bytes]:
    return {"0": struct.pack("<16f", *range(16)), "1": struct.pack("<4f", 1.5, -2.0, 3.25, 0.0)}


def _crafted_pickle(**w: object) -> bytes:
    """``{"w": 4x4 float32 over storage 0, "b": 4 float32 over storage 1}``; ``w`` overrides w's fields."""
    f = {"key": "0", "storage": "FloatStorage", "numel": 16, "offset": 0, "size": (4, 4), "stride": (4, 1)} | w
    t = pk.tensor(str(f["key"]), str(f["storage"]), int(f["numel"]), int(f["offset"]), tuple(f["size"]), tuple(f["stride"]))  # type: ignore[arg-type]
    return pk.dumps({"w": t, "b": pk.tensor("1", "FloatStorage", 4, 0, (4,), (1,))})


def base_paths(session_root: Path, ravex: str) -> dict[str, Path]:
    paths = {k: DATA / v for k, v in FIXTURE_BASES.items()}
    paths.update(build_native_stores(session_root, ravex))
    paths.update(build_crafted(session_root))
    return paths


def build(case: Case, work: Path, bases: dict[str, Path]) -> Path:
    """Make ``case`` under ``work`` (src/, outside/, out/); return SRC."""
    for d in ("outside", "out"):
        (work / d).mkdir(parents=True, exist_ok=True)
    (work / "outside" / "secret.txt").write_text("a file outside the checkpoint\n")
    src = work / "src"
    if case.base is not None:
        base = bases[case.base]
        if base.is_dir():
            shutil.copytree(base, src, symlinks=True)
        else:
            src.mkdir(parents=True)
            shutil.copy2(base, src / base.name)
    else:
        src.mkdir(parents=True)
    return case.make(src, work)


# ---------------------------------------------------------------- damage


def truncate(path: Path, n: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(max(0, n))


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def put_json(path: Path, doc: object) -> None:
    path.write_text(json.dumps(doc, indent=1))


def reseal(store: Path) -> None:
    """Record in the manifest the checksum of each checkpoint.json as it now is,
    as someone crafting a store would: the case then tests the check behind the
    checksum, not the checksum. (Stores whose entries record none are left so.)"""
    from ravex_convert import _core

    mpath = store / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError):
        return
    changed = False
    for e in manifest.get("checkpoints", []) if isinstance(manifest, dict) else []:
        meta = store / str(e.get("dir")) / "checkpoint.json" if isinstance(e, dict) else None
        if meta is not None and "metadata_checksum" in e and meta.is_file() and not meta.is_symlink():
            e["metadata_checksum"] = f"xxh3-64:{_core.xxh3_64(meta.read_bytes()):016x}"
            changed = True
    if changed:
        mpath.write_text(json.dumps(manifest, indent=1))


def symlink_out(src_file: Path, work: Path) -> None:
    """Replace ``src_file`` by a symlink to an identical copy outside the checkpoint."""
    target = work / "outside" / src_file.name
    if src_file.is_dir():
        shutil.copytree(src_file, target)
        shutil.rmtree(src_file)
    else:
        shutil.copy2(src_file, target)
        src_file.unlink()
    src_file.symlink_to(target)


def code_pickle(work: Path) -> bytes:
    return pk.dumps(pk.code_reduce(f"touch {work / 'outside' / PWNED}"))


CASES: list[Case] = []


def case(name: str, base: str | None, kind: str, **kw: object) -> Callable[[Callable[[Path, Path], Path]], Callable[[Path, Path], Path]]:
    def deco(fn: Callable[[Path, Path], Path]) -> Callable[[Path, Path], Path]:
        CASES.append(Case(name, base, kind, fn, **kw))  # type: ignore[arg-type]
        return fn
    return deco


def add(name: str, base: str | None, kind: str, fn: Callable[[Path, Path], Path], **kw: object) -> None:
    CASES.append(Case(name, base, kind, fn, **kw))  # type: ignore[arg-type]
