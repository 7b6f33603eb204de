"""Fuzzing Ravex's Python readers with atheris (libFuzzer for Python).

One harness per reader of untrusted bytes; the oracle is that only a
``RavexError`` subclass may escape. Each distinct other exception is saved to
``fuzz/findings/<harness>/<type>@<file-line>`` and fuzzing goes on;
libFuzzer's ``-timeout`` catches hangs and ``-rss_limit_mb`` memory bombs
(those stop the run, leaving the input under ``-artifact_prefix``)::

    python fuzz/python/fuzz_readers.py HARNESS [libFuzzer options] [CORPUS_DIR ...]
    python fuzz/python/fuzz_readers.py unpickle -max_total_time=120 fuzz/corpus/unpickle

Harnesses: unpickle (``_unpickle.restricted_loads``), torchzip
(``_torchzip.open_archive`` on a file), safetensors (``read_header`` and
``read``), dcp (``read_metadata`` and ``describe`` on a directory holding the
input as ``.metadata``), native (``read_manifest`` and ``read`` on a store
whose ``checkpoint.json``, ``manifest.json`` or marker is the input). Without
atheris installed, ``--mutate SECONDS`` runs a plain mutation loop over the
seed corpus instead. ``--replay FILE...`` runs inputs once and prints what
escaped (for minimised crashes).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEED_STORE = REPO / "fuzz" / "corpus" / "native-store"  # a tiny valid store the native harness fills in

_TMP = Path(os.environ["RAVEX_FUZZ_TMP"]) if os.environ.get("RAVEX_FUZZ_TMP") else Path(tempfile.mkdtemp(prefix="ravex-pyfuzz-"))


def _import() -> None:
    global RavexError, restricted_loads, open_archive, st, dcp, native
    from ravex_convert._torchfile import archive as _torchzip
    from ravex_convert._torchfile import unpickle as _unpickle
    from ravex_convert.errors import RavexError
    from ravex_convert.formats import safetensors as st
    from ravex_convert.formats.dcp import reader as dcp
    from ravex_convert.formats.native import reader as native

    restricted_loads = _unpickle.restricted_loads
    open_archive = _torchzip.open_archive


def _storage(pid: object) -> object:
    from ravex_convert._torchfile.unpickle import StorageRef

    if not isinstance(pid, tuple) or len(pid) != 5:
        raise RavexError("fuzz: persistent id is not a 5-tuple", hint="-", path="fuzz")  # what open_archive does
    return StorageRef(str(pid[2]), "float32", 16, "cpu")


def h_unpickle(data: bytes) -> None:
    restricted_loads(data, "fuzz.pkl", _storage)


def h_torchzip(data: bytes) -> None:
    p = _TMP / "archive.pt"
    p.write_bytes(data)
    open_archive(p)


def h_safetensors(data: bytes) -> None:
    p = _TMP / "model.safetensors"
    p.write_bytes(data)
    st.read_header(p)
    st.read(p)


def h_dcp(data: bytes) -> None:
    d = _TMP / "dcp"
    d.mkdir(exist_ok=True)
    (d / ".metadata").write_bytes(data)
    dcp.read_metadata(d)
    dcp.describe(d, [])


_NATIVE_FILES = ("checkpoints/00000000/checkpoint.json", "manifest.json", "ravex-store.json")


def h_native(data: bytes) -> None:
    store = _TMP / "store"
    if not store.exists():
        shutil.copytree(SEED_STORE, store)
    which = _NATIVE_FILES[data[0] % 3] if data else _NATIVE_FILES[0]
    for rel in _NATIVE_FILES:  # the other two as seeded
        shutil.copy2(SEED_STORE / rel, store / rel)
    (store / which).write_bytes(data[1:])
    if which == _NATIVE_FILES[0]:
        # as a crafted store would: the manifest records the mutated file's checksum,
        # so the fuzzer gets past the checksum to the parsing behind it
        import json

        from ravex_convert import _core

        m = json.loads((SEED_STORE / "manifest.json").read_text())
        m["checkpoints"][0]["metadata_checksum"] = f"xxh3-64:{_core.xxh3_64(data[1:]):016x}"
        (store / "manifest.json").write_text(json.dumps(m))
    native.read_manifest(store)
    native.read(store)


HARNESSES: dict[str, Callable[[bytes], None]] = {
    "unpickle": h_unpickle, "torchzip": h_torchzip, "safetensors": h_safetensors, "dcp": h_dcp, "native": h_native,
}


def one(harness: Callable[[bytes], None], data: bytes) -> None:
    """The oracle: anything but a RavexError is a finding (re-raised for libFuzzer)."""
    try:
        harness(data)
    except RavexError:
        pass


def _key(exc: BaseException) -> str:
    """A finding's identity: its type and the innermost Ravex frame it came through."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ravex_convert" in f.filename] or traceback.extract_tb(exc.__traceback__)[-1:]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__name__}@{where}"


def recording(name: str, harness: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """The oracle for a long run: each distinct non-RavexError exception is saved
    once (fuzz/findings/<harness>/) and printed, and fuzzing goes on, so one run
    reports every bug it meets rather than the first."""
    out = REPO / "fuzz" / "findings" / name
    seen: set[str] = {p.name for p in out.iterdir()} if out.is_dir() else set()

    def run(data: bytes) -> None:
        try:
            one(harness, data)
        except Exception as exc:  # noqa: BLE001 -- the finding
            key = re.sub(r"[^A-Za-z0-9_.@:-]", "_", _key(exc)).replace(":", "-")
            if key not in seen:
                seen.add(key)
                out.mkdir(parents=True, exist_ok=True)
                (out / key).write_bytes(data)
                print(f"FINDING {name}: {key}: {type(exc).__name__}: {str(exc)[:200]} ({len(data)} bytes)", file=sys.stderr, flush=True)

    return run


def _mutate(data: bytes, r: random.Random) -> bytes:
    b = bytearray(data or b"\x00")
    for _ in range(r.randint(1, 4)):
        op = r.randrange(6)
        i = r.randrange(len(b) or 1)
        if op == 0:
            b[i % len(b)] ^= 1 << r.randrange(8)
        elif op == 1:
            b[i % len(b)] = r.choice((0, 0xFF, 0x7F, 0x80, r.randrange(256)))
        elif op == 2:
            del b[i:i + r.randint(1, 16)]
        elif op == 3:
            b[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 16)))
        elif op == 4:
            j = r.randrange(len(b) or 1)
            b[i:i] = b[j:j + r.randint(1, 64)]
        else:
            del b[i:]
    return bytes(b)


def mutation_loop(name: str, seconds: float, corpus: list[Path]) -> int:
    """The fallback fuzzer: random mutations of the seeds for ``seconds``."""
    harness = HARNESSES[name]
    seeds = [p.read_bytes() for d in corpus for p in sorted(d.iterdir()) if p.is_file()] or [b""]
    r = random.Random(0)
    found: dict[str, bytes] = {}
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = _mutate(r.choice(seeds), r)
        n += 1
        try:
            one(harness, data)
        except Exception as exc:  # noqa: BLE001 -- the finding
            key = f"{type(exc).__name__}: {str(exc)[:80]}"
            if key not in found:
                found[key] = data
                print(f"finding: {key} ({len(data)} bytes)", file=sys.stderr)
    print(f"{name}: {n} execs in {seconds:.0f} s, {len(found)} distinct non-RavexError exceptions", file=sys.stderr)
    out = REPO / "fuzz" / "findings" / name
    for i, data in enumerate(found.values()):
        out.mkdir(parents=True, exist_ok=True)
        (out / f"finding-{i}").write_bytes(data)
    return 1 if found else 0


def replay(name: str, files: list[str]) -> int:
    harness = HARNESSES[name]
    bad = 0
    for f in files:
        try:
            one(harness, Path(f).read_bytes())
            print(f"{f}: ok")
        except Exception:  # noqa: BLE001
            bad += 1
            print(f"{f}:\n{traceback.format_exc()}")
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in HARNESSES:
        print(__doc__)
        return 2
    name, rest = sys.argv[1], sys.argv[2:]
    if rest[:1] == ["--replay"]:
        _import()
        return replay(name, rest[1:])
    if rest[:1] == ["--mutate"]:
        _import()
        return mutation_loop(name, float(rest[1]), [Path(p) for p in rest[2:]])
    import atheris

    with atheris.instrument_imports(include=["ravex_convert"]):
        _import()
    harness = recording(name, HARNESSES[name])
    atheris.Setup([sys.argv[0], *rest], harness)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    sys.exit(main())
