"""Hostile and damaged native stores (docs/format.md sections 8, 17 and 18): a DST
whose entries are symbolic links is refused, never written through; paths in the
metadata never leave the store; zstd frames and JSON are bounded; the metadata is
checksummed; every MUST of section 17 is enforced, one test each."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import run_ravex

from ravex_convert import _core, _engine
from ravex_convert._output import Options
from ravex_convert.errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, UnsafeCheckpointError
from ravex_convert.formats.native import reader as native
from ravex_convert.formats.native import store as native_store
from ravex_convert.formats.native import writer as native_write
from ravex_convert.formats.native.check import _flat_boxes, _tiling_problem
from ravex_convert.model import Box, Checkpoint, Chunk, Flat, LogicalTensor, TensorLink

CK = "checkpoints/00000000/checkpoint.json"


def tiny(step: int = 1, bump: float = 0.0) -> Checkpoint:
    """Two float32 tensors (one tied), an optimizer moment and small objects."""
    ckpt = Checkpoint("live", Path("mem"), step=step)

    def add(name: str, shape: tuple[int, ...], values: list[float]) -> None:
        ckpt.add(LogicalTensor(name, shape, "float32", [Chunk(Box(tuple(0 for _ in shape), shape), "float32",
                                                              data=struct.pack(f"<{len(values)}f", *values))]))

    add("model/embed.weight", (4, 3), [0.25 + bump] * 12)
    add("optim/exp_avg/embed.weight", (4, 3), [0.125] * 12)
    add("obj/rng/torch", (8,), [0.0] * 8)
    ckpt.aliases["model/lm_head.weight"] = "model/embed.weight"
    ckpt.objects = {"optim.param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": ["embed.weight"]}],
                    "rng": {"torch": TensorLink("obj/rng/torch")}}
    return ckpt


@pytest.fixture
def store(tmp_path: Path) -> Path:
    s = tmp_path / "store"
    native_write.write(tiny(), s, Options(world_size=2))
    return s


def rehash(store: Path, index: int = 0) -> None:
    """Record the current checkpoint.json's checksum in the manifest, as a crafted store would."""
    raw = (store / f"checkpoints/{index:08d}/checkpoint.json").read_bytes()
    m = json.loads((store / "manifest.json").read_text())
    for e in m["checkpoints"]:
        if e["index"] == index:
            e["metadata_checksum"] = f"xxh3-64:{_core.xxh3_64(raw):016x}"
    (store / "manifest.json").write_text(json.dumps(m))


def edit(store: Path, fn: Callable[[dict[str, Any]], Any], *, fix: bool = True) -> None:
    """Apply ``fn`` to checkpoint 0's checkpoint.json (a returned string replaces the file), then rehash."""
    path = store / CK
    doc = json.loads(path.read_text())
    out = fn(doc)
    path.write_text(out if isinstance(out, str) else json.dumps(doc))
    if fix:
        rehash(store)


def emb(doc: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = doc["tensors"]["model/embed.weight"]
    return t


def refused(store: Path, exc: type[RavexError], fragment: str) -> RavexError:
    with pytest.raises(exc) as err:
        native.read(store)
    assert fragment in err.value.message, err.value.message
    assert err.value.hint, "every error has a hint"
    assert str(store) in err.value.message, "every error names the file"
    return err.value


# ---------------------------------------------------------------- writes outside DST


@pytest.mark.parametrize("entry", ["lock", "manifest.json", "ravex-store.json"])
def test_a_store_file_that_is_a_link_is_refused_and_not_written_through(store: Path, tmp_path: Path, entry: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    real = store / entry
    real.unlink()
    real.symlink_to(victim)
    src = tmp_path / "src"
    native_write.write(tiny(), src, Options())
    res = run_ravex("convert", src, store, "--to", "native")
    assert res.returncode == 7, res.stderr
    assert "is a symbolic link" in res.stderr and entry in res.stderr and "hint:" in res.stderr
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        native_write.prune(store, 1)
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(store / "checkpoints")) == ["00000000"]


def test_a_lock_swapped_for_a_link_after_the_check_is_not_followed(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (store / "lock").unlink()
    (store / "lock").symlink_to(victim)
    monkeypatch.setattr(native_store, "refuse_links", lambda store: None)  # the race: the link appears after the check
    with pytest.raises(UnsafeCheckpointError, match="lock: is a symbolic link"):
        native_write.write(tiny(), store, Options())
    assert victim.read_text() == "precious"


def test_a_checkpoints_directory_that_is_a_link_is_refused(store: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (store / "checkpoints").rename(elsewhere)
    (store / "checkpoints").symlink_to(elsewhere)
    # what cleanup and the sweep would delete, were they to follow the link
    (elsewhere / "00000007.tmp-crash").mkdir()
    (elsewhere / "00000007.tmp-crash" / "keep.txt").write_text("x")
    (elsewhere / "00000003").mkdir()
    (elsewhere / "00000003" / "data.bin").write_text("y")
    before = sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*"))
    with pytest.raises(UnsafeCheckpointError, match="checkpoints: is a symbolic link") as err:
        native_write.write(tiny(), store, Options())
    assert err.value.exit_code == 7 and err.value.hint
    with pytest.raises(UnsafeCheckpointError):
        native_write.prune(store, 1)
    assert sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == before
    # reading follows no link out of the store either
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        native.read(store)


def test_a_checkpoint_directory_that_is_a_link_is_refused(store: Path, tmp_path: Path) -> None:
    native_write.write(tiny(2), store, Options())
    elsewhere = tmp_path / "elsewhere"
    (store / "checkpoints" / "00000000").rename(elsewhere)
    (store / "checkpoints" / "00000000").symlink_to(elsewhere)
    before = sorted(os.listdir(elsewhere))
    with pytest.raises(UnsafeCheckpointError, match="00000000: is a symbolic link"):
        native_write.prune(store, 1)
    with pytest.raises(UnsafeCheckpointError):
        native_write.write(tiny(3), store, Options())
    assert sorted(os.listdir(elsewhere)) == before


def test_cleanup_and_sweep_delete_links_never_their_targets(store: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f.txt").write_text("precious")
    (store / "manifest.json.tmp-deadbeef").symlink_to(victim / "f.txt")  # a crashed writer's leftover, as a link
    (store / "checkpoints" / "00000000" / "extra").symlink_to(victim)  # in a directory the sweep will empty
    native_write.write(tiny(2, bump=1.0), store, Options())
    native_write.write(tiny(3, bump=2.0), store, Options())
    assert native_write.prune(store, 1) == [0, 1]
    assert not (store / "manifest.json.tmp-deadbeef").is_symlink()
    assert not (store / "checkpoints" / "00000000" / "extra").is_symlink()  # 00000000 is retained for data, the link is gone
    assert (victim / "f.txt").read_text() == "precious"


def test_a_store_that_lost_its_marker_is_not_started_afresh(store: Path) -> None:
    native_write.write(tiny(2), store, Options())
    (store / "ravex-store.json").unlink()
    before = sorted(os.listdir(store / "checkpoints")), (store / "manifest.json").read_bytes()
    with pytest.raises(IncompleteCheckpointError, match="lost its marker") as err:
        native_write.write(tiny(3), store, Options())
    assert err.value.exit_code == 5 and "ravex-store.json" in (err.value.hint or "")
    assert (sorted(os.listdir(store / "checkpoints")), (store / "manifest.json").read_bytes()) == before
    # only the manifest, listing checkpoints, is enough to refuse
    (store / "checkpoints").rename(store.parent / "moved")
    src = store.parent / "src"
    native_write.write(tiny(), src, Options())
    res = run_ravex("convert", src, store, "--to", "native")
    assert res.returncode == 5 and "no ravex-store.json" in res.stderr and "hint:" in res.stderr


# ---------------------------------------------------------------- reads outside the checkpoint


def _point_at(store: Path, target: str, data: bytes) -> None:
    """Make embed.weight one chunk naming ``target``, with the matching checksum (a crafted store)."""
    def fn(doc: dict[str, Any]) -> None:
        t = emb(doc)
        t["shape"] = [len(data)]
        t["dtype"] = "uint8"
        t["chunks"] = [{"file": target, "offset": 0, "nbytes": len(data), "stored_nbytes": len(data), "compression": None,
                        "region": {"box": {"offsets": [0], "sizes": [len(data)]}}, "checksum": f"xxh3-64:{_core.xxh3_64(data):016x}"}]
    edit(store, fn)


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../../../../etc/passwd", "checkpoints/00000000/../../../../../../etc/passwd"])
def test_a_chunk_file_outside_the_store_is_refused(store: Path, tmp_path: Path, target: str) -> None:
    _point_at(store, target, Path("/etc/passwd").read_bytes())
    res = run_ravex("convert", store, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode == 7, res.stderr
    assert "etc/passwd" in res.stderr and "hint:" in res.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_data_file_that_links_outside_is_refused(store: Path, tmp_path: Path) -> None:
    data = Path("/etc/passwd").read_bytes()
    (store / "checkpoints" / "00000000" / "rank00007.safetensors").symlink_to("/etc/passwd")
    _point_at(store, "checkpoints/00000000/rank00007.safetensors", data)
    err = refused(store, UnsafeCheckpointError, "resolves to /etc/passwd")
    assert err.exit_code == 7


def test_a_checkpoint_json_that_links_outside_is_refused(store: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    (store / CK).rename(outside)
    (store / CK).symlink_to(outside)
    refused(store, UnsafeCheckpointError, "outside the checkpoint directory")


@pytest.mark.parametrize("dir_", ["../elsewhere", "/etc"])
def test_a_manifest_dir_outside_the_store_is_refused(store: Path, dir_: str) -> None:
    m = json.loads((store / "manifest.json").read_text())
    m["checkpoints"][0]["dir"] = dir_
    (store / "manifest.json").write_text(json.dumps(m))
    refused(store, UnsafeCheckpointError, repr(dir_))


# ---------------------------------------------------------------- bounds


def _zstd_store(tmp_path: Path, n: int) -> Path:
    """A store whose one tensor of ``n`` uint8 zeros is one zstd frame (an honest declaration)."""
    s = tmp_path / "z"
    ckpt = Checkpoint("live", Path("mem"), step=1)
    ckpt.add(LogicalTensor("model/w", (n,), "uint8", [Chunk(Box((0,), (n,)), "uint8", data=bytes(n))]))
    native_write.write(ckpt, s, Options(compression="zstd"))
    return s


def test_a_frame_declaring_another_size_is_refused_before_decoding(tmp_path: Path) -> None:
    s = _zstd_store(tmp_path, 1 << 20)
    frame = (s / "checkpoints/00000000/rank00000.zst").read_bytes()
    assert _core.decompress_frame_to(str(s / "checkpoints/00000000/rank00000.zst"), 0, len(frame), 1 << 20) == _core.xxh3_64(bytes(1 << 20))
    # The checkpoint says 1 KiB (consistent with its shape); the frame's header says 1 MiB.
    edit(s, lambda d: d["tensors"]["model/w"].update(shape=[1024], chunks=[{**d["tensors"]["model/w"]["chunks"][0], "nbytes": 1024,
                                                                            "region": {"box": {"offsets": [0], "sizes": [1024]}}}]))
    with pytest.raises(CorruptCheckpointError, match="declares 1048576 bytes, not the expected 1024") as err:
        native.verify_chunks(native.read(s))
    assert "model/w" in err.value.message and err.value.hint


# The peak RSS of this process (VmHWM: unlike ru_maxrss, not inherited from the parent across exec).
MEMORY = """
import re, sys
from pathlib import Path
from ravex_convert.formats.native import reader as native
ckpt = native.read(Path(sys.argv[1]))
assert native.verify_chunks(ckpt) == 1
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) // 1024)
"""


def test_verifying_a_huge_frame_keeps_memory_bounded(tmp_path: Path) -> None:
    n = 1 << 30  # 1 GiB of zeros in a frame of a few tens of KB, declared honestly
    s = tmp_path / "big"
    native_write.write(tiny(), s, Options())
    frame_path = s / "checkpoints" / "00000000" / "rank00000.zst"
    cctx = _frame_of_zeros(n)
    frame_path.write_bytes(cctx)
    h = _core.decompress_frame_to(str(frame_path), 0, len(cctx), n)

    def fn(doc: dict[str, Any]) -> None:
        doc["tensors"] = {"model/w": {"dtype": "uint8", "shape": [n], "chunks": [
            {"file": "checkpoints/00000000/rank00000.zst", "offset": 0, "nbytes": n, "stored_nbytes": len(cctx), "compression": "zstd",
             "region": {"box": {"offsets": [0], "sizes": [n]}}, "checksum": f"xxh3-64:{h:016x}"}]}}
        doc["aliases"], doc["objects"] = {}, {}
    edit(s, fn)
    res = subprocess.run([sys.executable, "-P", "-c", MEMORY, str(s)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) < 400, f"peak RSS {res.stdout.strip()} MiB while verifying a 1 GiB frame"


def _frame_of_zeros(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes, made without holding them: compressed from a sparse file."""
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.truncate(n)
        f.flush()
        return _core.compress_range(f.name, 0, n, 1)


def test_compressed_chunks_over_the_inline_size_go_through_a_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    native_write.write(tiny(), src, Options(world_size=2, compression="zstd"))
    made: list[str] = []
    real = _core.decompress_frame_to

    def spy(*args: Any) -> int:
        made.append(str(args[4]))
        return real(*args)

    monkeypatch.setattr(_engine, "INLINE_ZSTD_BYTES", 0)
    monkeypatch.setattr(_core, "decompress_frame_to", spy)
    res = native_write.write(native.read(src), tmp_path / "dst", Options())
    assert res["tensors"] == 3 and len(made) == 5
    assert not any(os.path.exists(p) for p in made), "decoded chunks are removed after their batch"
    a, b = native.read(src), native.read(tmp_path / "dst")
    from ravex_convert.convert import materialize

    for name in a.tensors:
        assert materialize(a.tensors[name]) == materialize(b.tensors[name]), name


def test_deeply_nested_json_is_refused_clearly(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = (store / CK).read_text()
    edit(store, lambda d: json.dumps(d)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(store, CorruptCheckpointError, "nested too deeply")
    (store / CK).write_text(good)
    edit(store, lambda d: d["objects"].__setitem__("extra", json.loads("[" * 100 + "]" * 100)))
    refused(store, CorruptCheckpointError, "nested more than 64 levels")
    monkeypatch.setenv("RAVEX_MAX_JSON_DEPTH", "200")
    assert native.read(store).objects["extra"]


def test_chunks_per_tensor_are_limited(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "1")
    err = refused(store, CorruptCheckpointError, "has 2 chunks, more than the limit of 1")
    assert "RAVEX_MAX_CHUNKS_PER_TENSOR" in (err.hint or "")
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "lots")
    with pytest.raises(RavexError, match="RAVEX_MAX_CHUNKS_PER_TENSOR='lots': not a positive integer"):
        native.read(store)
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "2")
    assert len(native.read(store).tensors["model/embed.weight"].chunks) == 2


# ---------------------------------------------------------------- the metadata checksum


def test_the_manifest_records_the_metadata_checksum(store: Path) -> None:
    entry = json.loads((store / "manifest.json").read_text())["checkpoints"][0]
    assert entry["metadata_checksum"] == f"xxh3-64:{_core.xxh3_64((store / CK).read_bytes()):016x}"


def test_a_flipped_digit_in_the_metadata_is_detected(store: Path, tmp_path: Path) -> None:
    path = store / CK
    path.write_text(path.read_text().replace('"lr": 0.001', '"lr": 0.002'))
    res = run_ravex("convert", store, tmp_path / "out.pt", "--to", "torch_save")
    assert res.returncode == 6, res.stderr
    assert "does not match the checksum its manifest entry records" in res.stderr and CK in res.stderr and "hint:" in res.stderr
    # A writer goes on with a new checkpoint but neither reuses nor sweeps anything of the damaged one.
    res2 = native_write.write(tiny(2), store, Options())
    assert res2["chunks_reused"] == 0 and any("checkpoint 0 is not loadable" in w and "checksum" in w for w in res2["warnings"])
    assert native.read(store, 1).step == 2


def test_a_store_written_before_the_metadata_checksum_is_read_with_a_note(store: Path) -> None:
    m = json.loads((store / "manifest.json").read_text())
    del m["checkpoints"][0]["metadata_checksum"]
    (store / "manifest.json").write_text(json.dumps(m))
    ckpt = native.read(store)
    assert any("records no metadata_checksum" in n for n in ckpt.notes)
    native.verify_chunks(ckpt)


def test_a_newest_checkpoint_without_metadata_is_not_silently_replaced(store: Path, tmp_path: Path) -> None:
    native_write.write(tiny(2, bump=1.0), store, Options())
    (store / "checkpoints" / "00000001" / "checkpoint.json").unlink()
    res = run_ravex("convert", store, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode == 5, res.stderr
    assert "checkpoint 1, the newest one listed in manifest.json, cannot be read" in res.stderr
    assert "--index 0" in res.stderr and not (tmp_path / "out.safetensors").exists()
    res = run_ravex("convert", store, tmp_path / "out.safetensors", "--to", "safetensors", "--index", "0")
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- every MUST of section 17, one test each

MUSTS: dict[str, tuple[Callable[[dict[str, Any]], Any], type[RavexError], str]] = {
    # 17.1: JSON rules, format, format_version
    "duplicate key": (lambda d: json.dumps(d)[:-1] + ', "step": 9}', CorruptCheckpointError, "has the key 'step' twice"),
    "duplicate tensor": (lambda d: json.dumps(d).replace('"tensors": {', '"tensors": {"model/embed.weight": {}, ', 1),
                         CorruptCheckpointError, "has the key 'model/embed.weight' twice"),
    "not utf-8": (lambda d: json.dumps(d).replace("live", "l\udcffve"), CorruptCheckpointError, "not valid UTF-8"),
    "wrong format": (lambda d: d.update(format="ravex-store"), CorruptCheckpointError, "is not a ravex-checkpoint document"),
    "missing format_version": (lambda d: d.pop("format_version"), CorruptCheckpointError, "format_version is missing or invalid (None); it must be"),
    "newer format_version": (lambda d: d.update(format_version=2), RavexError, "format version 2"),
    # 17.2: index and run_id agree with the directory and the entry
    "index mismatch": (lambda d: d.update(index=3), CorruptCheckpointError, "index is 3, but its directory and manifest entry say 0"),
    "run_id mismatch": (lambda d: d.update(run_id="other"), CorruptCheckpointError, "run_id is 'other', but its manifest entry says"),
    # 17.3: names and aliases
    "control character": (lambda d: d["tensors"].update({"model/a\x07b": d["tensors"].pop("optim/exp_avg/embed.weight")}),
                          CorruptCheckpointError, "contains a control character"),
    "@ in a name": (lambda d: d["tensors"].update({"model/a@0": d["tensors"].pop("optim/exp_avg/embed.weight")}), CorruptCheckpointError, "contains '@'"),
    "too long a name": (lambda d: d["tensors"].update({"model/" + "é" * 600: d["tensors"].pop("optim/exp_avg/embed.weight")}),
                        CorruptCheckpointError, "longer than 1024 UTF-8 bytes"),
    "alias is a tensor": (lambda d: d["aliases"].update({"model/embed.weight": "optim/exp_avg/embed.weight"}), CorruptCheckpointError,
                          "is both a tensor and an alias"),
    "alias to nothing": (lambda d: d["aliases"].update({"model/x": "model/nope"}), CorruptCheckpointError, "which is no stored tensor"),
    "alias to an alias": (lambda d: d["aliases"].update({"model/x": "model/lm_head.weight"}), CorruptCheckpointError, "which is another alias"),
    # 17.4: dtype, shape, tiling
    "unknown dtype": (lambda d: emb(d).update(dtype="float8_e4m3"), RavexError, "dtype 'float8_e4m3', which format version 1 does not have"),
    "negative dimension": (lambda d: emb(d).update(shape=[-4, 3]), CorruptCheckpointError, "a shape lists non-negative integers"),
    "overlapping chunks": (lambda d: emb(d)["chunks"][1]["region"]["box"].update(offsets=[1, 0]), CorruptCheckpointError,
                           "two chunks share rows 1 to 1 of dimension 0"),
    "chunks with a gap": (lambda d: emb(d)["chunks"].pop(), CorruptCheckpointError, "they hold 6 elements, the tensor 12"),
    "a chunk twice": (lambda d: emb(d)["chunks"].append(emb(d)["chunks"][0]), CorruptCheckpointError, "they hold 18 elements, the tensor 12"),
    # 17.5: chunk fields
    "missing chunk field": (lambda d: emb(d)["chunks"][0].pop("checksum") and None, CorruptCheckpointError, "chunk 0 lacks checksum"),
    "offset not an int": (lambda d: emb(d)["chunks"][0].update(offset="8"), CorruptCheckpointError, "has offset '8', not a non-negative integer"),
    "file in a later checkpoint": (lambda d: emb(d)["chunks"][0].update(file="checkpoints/00000004/rank00000.safetensors"),
                                   CorruptCheckpointError, "in checkpoint 4, after this checkpoint (0)"),
    "file with a backslash": (lambda d: emb(d)["chunks"][0].update(file="checkpoints\\00000000\\rank00000.safetensors"), CorruptCheckpointError,
                              "must be 'checkpoints/<8 digits>/<data file name>'"),
    "file named like a temporary": (lambda d: emb(d)["chunks"][0].update(file="checkpoints/00000000/rank00000.tmp"), CorruptCheckpointError,
                                    "must be 'checkpoints/<8 digits>/<data file name>'"),
    "unknown compression": (lambda d: emb(d)["chunks"][0].update(compression="lz4"), RavexError, "compression 'lz4', unknown to this Ravex"),
    "unknown region kind": (lambda d: emb(d)["chunks"][0].update(region={"strided": {}}), RavexError, "region kind 'strided', unknown"),
    "two region kinds": (lambda d: emb(d)["chunks"][0]["region"].update(flat={"start": 0, "length": 6}), CorruptCheckpointError,
                         "must be exactly one of"),
    "region outside the shape": (lambda d: emb(d)["chunks"][1]["region"]["box"].update(offsets=[3, 0]), CorruptCheckpointError,
                                 "reaches index 4 of dimension 0"),
    "nbytes not the region's": (lambda d: emb(d)["chunks"][0].update(nbytes=28, stored_nbytes=28), CorruptCheckpointError,
                                "has nbytes 28, but its region holds 6 float32 elements (24 bytes)"),
    "stored_nbytes differs uncompressed": (lambda d: emb(d)["chunks"][0].update(stored_nbytes=20), CorruptCheckpointError,
                                           "stored_nbytes 20 differs from nbytes 24"),
    "malformed checksum": (lambda d: emb(d)["chunks"][0].update(checksum="xxh3-64:ABC"), CorruptCheckpointError, "not 'xxh3-64:' and 16"),
    "unknown checksum algorithm": (lambda d: emb(d)["chunks"][0].update(checksum="blake3:00"), RavexError, "checksum algorithm 'blake3'"),
    # 17.7: objects
    "unknown tag": (lambda d: d["objects"].update(extra={"__ravex__": "complex", "value": "1j"}), RavexError, "tag 'complex', unknown"),
    "tag with an extra key": (lambda d: d["objects"].update(extra={"__ravex__": "int", "value": "1", "x": 0}), CorruptCheckpointError,
                              "has the keys ['value', 'x'], expected ['value']"),
    "int tag not decimal": (lambda d: d["objects"].update(extra={"__ravex__": "int", "value": "0x10"}), CorruptCheckpointError, "malformed 'int'"),
    "float tag not nan or inf": (lambda d: d["objects"].update(extra={"__ravex__": "float", "value": "1.5"}), CorruptCheckpointError,
                                 "malformed 'float'"),
    "bytes tag not base64": (lambda d: d["objects"].update(extra={"__ravex__": "bytes", "base64": "a*b"}), CorruptCheckpointError,
                             "malformed 'bytes'"),
    "tensor tag unresolved": (lambda d: d["objects"]["rng"].update(torch={"__ravex__": "tensor", "name": "obj/gone"}), CorruptCheckpointError,
                              "refers to tensor 'obj/gone'"),
}


@pytest.mark.parametrize("case", list(MUSTS))
def test_every_must_is_enforced(store: Path, case: str) -> None:
    fn, exc, fragment = MUSTS[case]
    if case == "not utf-8":
        doc = json.loads((store / CK).read_text())
        (store / CK).write_bytes(json.dumps(doc).replace("live", "l\xffve").encode("latin-1"))
        rehash(store)
    else:
        edit(store, fn)
    err = refused(store, exc, fragment)
    assert err.exit_code == (2 if exc is RavexError else exc.exit_code)


MANIFEST_MUSTS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "next_index negative": (lambda m: m.update(next_index=-1), "next_index is -1"),
    "index not below next_index": (lambda m: m.update(next_index=0), "below next_index 0"),
    "indices not increasing": (lambda m: m["checkpoints"].append(dict(m["checkpoints"][0])), "strictly increasing"),
    "dir not the index's": (lambda m: m["checkpoints"][0].update(dir="checkpoints/00000001"), "it must be 'checkpoints/00000000'"),
    "duplicate key": (lambda m: json.dumps(m)[:-1] + ', "next_index": 1}', "has the key 'next_index' twice"),
    "checkpoints not a list": (lambda m: m.update(checkpoints={}), "'checkpoints' is dict, not a list"),
}


@pytest.mark.parametrize("case", list(MANIFEST_MUSTS))
def test_every_manifest_must_is_enforced(store: Path, case: str) -> None:
    fn, fragment = MANIFEST_MUSTS[case]
    m = json.loads((store / "manifest.json").read_text())
    out = fn(m)
    (store / "manifest.json").write_text(out if isinstance(out, str) else json.dumps(m))
    err = refused(store, CorruptCheckpointError, fragment)
    assert "manifest.json" in err.message and err.exit_code == 6


def test_a_checkpoint_outside_the_manifest_must_be_listed(store: Path) -> None:
    native_write.write(tiny(2), store, Options())
    m = json.loads((store / "manifest.json").read_text())
    m["checkpoints"] = m["checkpoints"][:1]
    (store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IncompleteCheckpointError, match="not listed in"):
        native.read(store / "checkpoints" / "00000001")


# ---------------------------------------------------------------- the tiling check itself


def test_tiling_of_boxes_that_are_not_contiguous() -> None:
    shape = (4, 6)
    cols = [Box((0, 0), (4, 2)), Box((0, 2), (4, 4))]
    assert _tiling_problem(shape, cols) is None
    grid = [Box((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert _tiling_problem(shape, grid) is None
    # same element count, one box shifted onto its neighbour: an overlap and a hole
    shifted = [Box((0, 0), (2, 3)), Box((0, 2), (2, 3)), Box((2, 0), (2, 3)), Box((2, 3), (2, 3))]
    assert _tiling_problem(shape, shifted) == "two chunks overlap"
    # ZeRO-style flat ranges mixed with boxes
    assert _tiling_problem(shape, [Flat(0, 9), Box((1, 3), (1, 3)), Box((2, 0), (2, 6))]) is None
    assert _tiling_problem(shape, [Flat(0, 10), Box((1, 3), (1, 3)), Box((2, 0), (2, 6))]) is not None
    assert _tiling_problem((), [Box((), ())]) is None and _tiling_problem((0, 5), []) is None


@pytest.mark.parametrize(("start", "end"), [(0, 24), (1, 23), (5, 7), (6, 12), (7, 19), (0, 1), (23, 24)])
def test_a_flat_range_splits_into_few_boxes_that_cover_it(start: int, end: int) -> None:
    shape = (2, 3, 4)
    boxes = _flat_boxes(start, end, shape)
    assert len(boxes) <= 2 * len(shape) - 1
    covered = sorted(o[0] * 12 + o[1] * 4 + o[2] + (a * 12 + b * 4 + c)
                     for o, s in boxes for a in range(s[0]) for b in range(s[1]) for c in range(s[2]))
    assert covered == list(range(start, end))


def test_a_million_column_chunks_are_checked_quickly() -> None:
    import time

    n = 200_000
    t0 = time.perf_counter()
    assert _tiling_problem((3, n), [Box((0, j), (3, 1)) for j in range(n)]) is None
    assert time.perf_counter() - t0 < 10


# ---------------------------------------------------------------- a manifest naming a directory outside the store


def _outside_dir(store: Path, tmp_path: Path) -> Path:
    """A copy of checkpoint 0 outside the store."""
    out = tmp_path / "outside" / "00000000"
    out.parent.mkdir()
    shutil.copytree(store / "checkpoints" / "00000000", out)
    return out


def _dotdot(store: Path, tmp_path: Path) -> None:
    _outside_dir(store, tmp_path)
    _set_dir(store, "../outside/00000000")


def _absolute(store: Path, tmp_path: Path) -> None:
    _set_dir(store, str(_outside_dir(store, tmp_path)))


def _linked(store: Path, tmp_path: Path) -> None:
    out = _outside_dir(store, tmp_path)
    shutil.rmtree(store / "checkpoints" / "00000000")
    (store / "checkpoints" / "00000000").symlink_to(out)


def _set_dir(store: Path, value: str) -> None:
    m = json.loads((store / "manifest.json").read_text())
    m["checkpoints"][0]["dir"] = value
    (store / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("craft", [_dotdot, _absolute, _linked], ids=["dotdot", "absolute", "link-out"])
@pytest.mark.parametrize("command", ["status", "inspect", "verify", "convert"])
def test_every_command_refuses_a_manifest_that_names_a_directory_outside(store: Path, tmp_path: Path, craft: Any, command: str) -> None:
    """Issue 31, item 6: ``ravex status`` followed a manifest entry's ``dir`` out of the store
    and read the checkpoint.json there, while the readers refused it. Every command now
    refuses the store (exit 7, naming the store's file and the path) and reads nothing outside."""
    craft(store, tmp_path)
    args = {"status": [store], "inspect": [store], "verify": [store, store], "convert": [store, tmp_path / "out.safetensors"]}[command]
    res = run_ravex(command, *args)
    assert res.returncode == 7, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "00000000" in res.stderr and "hint:" in res.stderr, res.stderr
    assert res.stdout == ""
    assert not (tmp_path / "out.safetensors").exists()
