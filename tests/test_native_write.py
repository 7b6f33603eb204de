"""The native store writer (docs/format.md): what it writes reads back bit for
bit, unchanged chunks are reused, pruning keeps what is referenced, the lock and
the commit protocol hold, and damage is reported by the reader."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import DATA, REPO, inspect_json
from safetensors import safe_open

from ravex_convert._engine import chunk_bytes
from ravex_convert._output import Options
from ravex_convert._tagged import decode
from ravex_convert.errors import CorruptCheckpointError, RavexError
from ravex_convert.formats import torch_save
from ravex_convert.formats.dcp import reader as dcp
from ravex_convert.formats.native import reader as native
from ravex_convert.formats.native import writer as native_write
from ravex_convert.formats.zero import reader as zero
from ravex_convert.model import Box, Checkpoint, Chunk, Flat, LogicalTensor, TensorLink, itemsize
from ravex_convert.storage import ABSENT, resolve

pytestmark = pytest.mark.usefixtures("storage_backend")  # every test on every backend (conftest)

LANES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
def objdir() -> bool:
    """Every store goes through the object-store-semantics backend (conftest's storage_backend)."""
    return os.environ.get("RAVEX_STORAGE") == "objdir"


# ---------------------------------------------------------------- helpers


def gather(t: LogicalTensor, *, tiles: bool = False) -> bytes:
    """The whole tensor's bytes, placed chunk by chunk by region (zstd frames decoded).
    With ``tiles``, also check that the chunks cover every element exactly once."""
    lanes = LANES[itemsize(t.dtype)]
    n = math.prod(t.shape)
    out = np.zeros(n, dtype=lanes)
    seen = np.zeros(n, dtype=np.int64)
    full, cover = out.reshape(t.shape), seen.reshape(t.shape)
    for c in t.chunks:
        values = np.frombuffer(chunk_bytes(c), dtype=lanes, count=c.region.numel)
        if isinstance(c.region, Box):
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
            full[sl] = values.reshape(c.region.sizes)
            cover[sl] += 1
        else:
            out[c.region.start:c.region.start + c.region.length] = values
            seen[c.region.start:c.region.start + c.region.length] += 1
    if tiles:
        assert (seen == 1).all(), f"{t.name}: chunks do not tile the tensor"
    return out.tobytes()


def same(a: Any, b: Any) -> bool:
    """Deep equality where NaN equals NaN and tuples stay tuples."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_same_state(src: Checkpoint, out: Checkpoint, opts: Options) -> None:
    assert list(out.tensors) == list(src.tensors)
    assert out.aliases == src.aliases
    for name, t in src.tensors.items():
        o = out.tensors[name]
        assert (o.shape, o.dtype) == (t.shape, t.dtype), name
        assert gather(o, tiles=True) == gather(t), f"{name} differs"
        rows = t.shape[0] if t.shape else 1
        per = -(-rows // opts.world_size) if math.prod(t.shape) else 0
        if name.startswith("obj/") or not t.shape:  # state inside objects, and 0-d tensors: whole, on rank 0
            assert [(c.region, c.file.name if c.file else None) for c in o.chunks] == [
                (t.whole(), "rank00000.zst" if opts.compression else "rank00000.safetensors")], name
        elif math.prod(t.shape):
            # torch.chunk sizes on dim 0, one chunk per rank file, every chunk with its global region
            boxes = [c.region for c in o.chunks if isinstance(c.region, Box)]
            assert [b.sizes[0] for b in boxes] == [len(x) for x in torch.arange(rows).chunk(opts.world_size)], name
            assert [b.offsets[0] for b in boxes] == [k * per for k in range(len(o.chunks))]
            assert [c.file.name for c in o.chunks if c.file] == [f"rank{k:05d}.{'zst' if opts.compression else 'safetensors'}" for k in range(len(o.chunks))]
    assert same(out.objects, src.objects)


def make_pt(path: Path, bump: str | None = None) -> Path:
    """A torch.save training state: tied embedding, Adam moments, bf16/int/bool buffers,
    an RNG state and awkward small values; ``bump`` adds 1 to one parameter."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 6)
    lin = torch.nn.Linear(6, 6)
    params = [emb.weight, lin.weight, lin.bias]
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.95))
    (emb(torch.tensor([1, 2, 3])) @ lin.weight.T + lin.bias).square().mean().backward()
    opt.step()
    sd = {"embed.weight": emb.weight.data, "lin.weight": lin.weight.data, "lin.bias": lin.bias.data, "head.weight": emb.weight.data,
          "half": torch.arange(10, dtype=torch.bfloat16).reshape(5, 2), "count": torch.tensor(7, dtype=torch.int64),
          "mask": torch.tensor([True, False, True])}
    if bump is not None:
        sd[bump] = sd[bump] + 1
    torch.save({"model": sd, "optimizer": opt.state_dict(), "step": 7,
                "extra": {"rng": torch.get_rng_state(), "best": float("nan"), "seed": 2**70, "pair": (1, "a")}}, path)
    return path


@pytest.fixture(scope="module")
def pt_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pt")
    return {"a": make_pt(d / "a.pt"), "b": make_pt(d / "b.pt", bump="lin.bias")}


def read_source(kind: str, pt_files: dict[str, Path]) -> Checkpoint:
    if kind == "torch_save":
        return torch_save.read(pt_files["a"])
    if kind == "zero":
        return zero.read(DATA / "zero3_ws2_bf16" / "checkpoint")
    return dcp.read(DATA / "fsdp2_ws3" / "checkpoint")


def files_of(ckpt: Checkpoint) -> set[str]:
    return {c.file.parent.name for t in ckpt.tensors.values() for c in t.chunks if c.file is not None}


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("kind", ["torch_save", "zero", "dcp"])
def test_round_trip_bit_exact(tmp_path: Path, pt_files: dict[str, Path], kind: str, world_size: int, compression: str | None) -> None:
    src = read_source(kind, pt_files)
    opts = Options(world_size=world_size, compression=compression)
    res = native_write.write(src, tmp_path / "store", opts)
    assert (res["index"], res["step"], res["tensors"], res["bytes_reused"]) == (0, src.step, len(src.tensors), 0)
    out = native.read(tmp_path / "store")
    assert native.verify_chunks(out) == sum(len(t.chunks) for t in out.tensors.values())
    assert_same_state(src, out, opts)
    assert out.step == src.step and out.world_size == world_size
    doc = json.loads((tmp_path / "store" / "checkpoints" / "00000000" / "checkpoint.json").read_text())
    assert doc["source"]["format"] == kind and doc["source"]["world_size"] == src.world_size
    assert doc["source"]["versions"]["ravex"] and doc["source"]["path"] == str(src.path)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    entry = manifest["checkpoints"][0]
    assert entry["bytes"] == sum(t.nbytes for t in src.tensors.values()) == res["bytes"]
    assert (entry["tensors"], entry["world_size"], entry["status"], manifest["next_index"]) == (len(src.tensors), world_size, "complete", 1)
    if compression is None:
        # each data file is a valid safetensors file whose entries are the chunks, named <logical name>@<k>
        for t in out.tensors.values():
            for k, c in enumerate(t.chunks):
                assert c.file is not None
                with safe_open(str(c.file), framework="pt") as f:
                    got = f.get_tensor(f"{t.name}@{k}")
                assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == c.file.read_bytes()[c.offset:c.offset + c.nbytes]


def test_tied_weights_objects_and_obj_tensors(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    src = torch_save.read(pt_files["a"])
    assert src.aliases == {"model/head.weight": "model/embed.weight"}
    src.objects["extra"]["odd"] = {"inf": -math.inf, "big": -(2**64), "set": {3, 1}, "bytes": b"\x00\xff", "keys": {1: "x", (2, 3): None},
                                   "rng": TensorLink("obj/extra/rng"), "tied": TensorLink("model/head.weight")}
    native_write.write(src, tmp_path / "s", Options())
    doc = json.loads((tmp_path / "s" / "checkpoints" / "00000000" / "checkpoint.json").read_text())
    assert doc["aliases"] == {"model/head.weight": "model/embed.weight"} and "model/head.weight" not in doc["tensors"]
    extra = doc["objects"]["extra"]["extra"]  # the torch.save file's own "extra" key
    assert extra["seed"] == {"__ravex__": "int", "value": str(2**70)}
    assert extra["best"] == {"__ravex__": "float", "value": "nan"}
    assert extra["rng"] == {"__ravex__": "tensor", "name": "obj/extra/rng"}
    assert extra["pair"] == {"__ravex__": "tuple", "items": [1, "a"]}
    assert doc["tensors"]["obj/extra/rng"]["dtype"] == "uint8"
    groups = doc["objects"]["optim.param_groups"]
    assert groups[0]["params"] == ["embed.weight", "lin.weight", "lin.bias"]
    assert groups[0]["betas"] == {"__ravex__": "tuple", "items": [0.9, 0.95]}
    out = native.read(tmp_path / "s")
    assert same(out.objects, src.objects)
    assert same(decode(doc["objects"]), src.objects)


def test_cast_on_the_way_out(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    src = torch_save.read(pt_files["a"])
    native_write.write(src, tmp_path / "s", Options(dtype="bfloat16", world_size=2))
    out = native.read(tmp_path / "s")
    native.verify_chunks(out)
    assert out.tensors["model/lin.weight"].dtype == "bfloat16" and out.tensors["optim/exp_avg/lin.weight"].dtype == "float32"
    want = torch.load(pt_files["a"], weights_only=True)["model"]["lin.weight"].to(torch.bfloat16)
    assert gather(out.tensors["model/lin.weight"]) == want.view(torch.uint16).numpy().tobytes()


# ---------------------------------------------------------------- reuse, prune, the sweep


def test_second_write_of_the_same_source_reuses_everything(tmp_path: Path) -> None:
    src = dcp.read(DATA / "fsdp2_ws3" / "checkpoint")
    store = tmp_path / "s"
    first = native_write.write(src, store, Options(world_size=3))
    second = native_write.write(src, store, Options(world_size=3))
    assert first["bytes_written"] > first["bytes"] > 0 and first["bytes_reused"] == 0
    assert (second["index"], second["bytes_written"], second["bytes_reused"], second["chunks_written"]) == (1, 0, first["bytes"], 0)
    assert second["files"] == [] and sorted(os.listdir(store / "checkpoints" / "00000001")) == ["checkpoint.json"]
    docs = [json.loads((store / "checkpoints" / f"0000000{i}" / "checkpoint.json").read_text()) for i in (0, 1)]
    assert docs[1]["tensors"] == docs[0]["tensors"]  # every chunk entry copied unchanged, pointing into checkpoint 0
    out = native.read(store)
    assert out.source["index"] == 1 and files_of(out) == {"00000000"}
    native.verify_chunks(out)
    assert_same_state(src, out, Options(world_size=3))


def test_changed_tensor_is_the_only_one_rewritten(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    a, b = torch_save.read(pt_files["a"]), torch_save.read(pt_files["b"])
    first = native_write.write(a, store, Options())
    second = native_write.write(b, store, Options())
    bias_bytes = 6 * 4
    assert (second["chunks_written"], second["bytes_reused"]) == (1, first["bytes"] - bias_bytes)
    assert second["bytes_written"] < 200  # one 24-byte chunk and its safetensors header
    out = native.read(store)
    bias = out.tensors["model/lin.bias"].chunks[0]
    assert bias.file is not None and bias.file.parent.name == "00000001"
    assert {c.file.parent.name for n, t in out.tensors.items() if n != "model/lin.bias" for c in t.chunks if c.file} == {"00000000"}
    native.verify_chunks(out)
    assert_same_state(b, out, Options())
    with safe_open(str(bias.file), framework="pt") as f:
        assert list(f.keys()) == ["model/lin.bias@0"]


def test_prune_keeps_referenced_data(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    a, b = torch_save.read(pt_files["a"]), torch_save.read(pt_files["b"])
    native_write.write(a, store, Options())  # 0: every chunk
    native_write.write(a, store, Options())  # 1: all reused from 0
    native_write.write(b, store, Options())  # 2: lin.bias new, the rest from 0
    assert native_write.prune(store, 1) == [0, 1]
    ckdir = store / "checkpoints"
    assert sorted(os.listdir(ckdir)) == ["00000000", "00000002"]
    assert sorted(os.listdir(ckdir / "00000000")) == ["rank00000.safetensors"]  # retained for data, no checkpoint.json
    manifest = json.loads((store / "manifest.json").read_text())
    assert [e["index"] for e in manifest["checkpoints"]] == [2] and manifest["next_index"] == 3
    out = native.read(store)
    native.verify_chunks(out)
    assert_same_state(b, out, Options())
    assert native.describe(store, [], index=-1).step == 7
    with pytest.raises(RavexError, match="no complete checkpoint with index 0"):
        native.read(store, index=0)
    # a checkpoint that shares nothing: once 2 is pruned, nothing references 0 and both go
    native_write.write(dcp.read(DATA / "fsdp2_ws3" / "checkpoint"), store, Options())
    assert native_write.prune(store, 1, pinned={2}) == []
    assert native_write.prune(store, 1) == [2]
    assert sorted(os.listdir(ckdir)) == ["00000003"]
    native.verify_chunks(native.read(store))


def test_inspect_json_reports_the_store(tmp_path: Path) -> None:
    src = zero.read(DATA / "zero3_ws2_bf16" / "checkpoint")
    native_write.write(src, tmp_path / "s", Options(world_size=3, compression="zstd"))
    info = inspect_json(tmp_path / "s", "--tensors")
    assert (info["format"], info["variant"], info["step"], info["world_size"], info["index"]) == ("native", "store", src.step, 3, 0)
    assert info["aliases"] == {"head.weight": "embed.weight"}
    assert len(info["tensors"]) == len(src.tensors)


# ---------------------------------------------------------------- the lock, crashes, refusals


@contextlib.contextmanager
def held_by_another(store: Path, note: dict[str, Any]) -> Iterator[None]:
    """The store's lock held by another writer, as it holds it on this backend: an flock on
    ``<store>/lock`` with its note inside, or (RAVEX_STORAGE=objdir) the lease object."""
    if objdir():
        storage, key = resolve(store / "lock")
        storage.put(key, json.dumps(note).encode(), if_generation=ABSENT)
        try:
            yield
        finally:
            storage.delete(key)
        return
    fd = os.open(store / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(note).encode(), 0)
        yield
    finally:
        os.close(fd)


def test_lock_held_is_a_clear_error(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    src = torch_save.read(pt_files["a"])
    native_write.write(src, store, Options())
    with held_by_another(store, {"pid": 4242, "host": "node-7", "run_id": "other-run", "since_unix": 1718000000.75}):
        with pytest.raises(RavexError) as err:
            native_write.write(src, store, Options())
        assert "another process is writing" in err.value.message and "pid 4242 on host node-7, run other-run" in err.value.message
        assert err.value.exit_code >= 2 and err.value.hint
        with pytest.raises(RavexError, match="pid 4242"):
            native_write.prune(store, 1)
    assert native_write.write(src, store, Options())["index"] == 1  # released: the next writer goes ahead
    if objdir():
        assert not (store / "lock").exists()  # a lease object lives while it is held
    else:
        assert json.loads((store / "lock").read_text())["pid"] == os.getpid()


def test_failure_before_the_commit_leaves_the_store_as_it_was(tmp_path: Path, pt_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "s"
    a, b = torch_save.read(pt_files["a"]), torch_save.read(pt_files["b"])
    native_write.write(a, store, Options())
    before = (store / "manifest.json").read_bytes()

    def boom(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(native_write, "_write_manifest", boom)
    with pytest.raises(RavexError, match="No space left"):
        native_write.write(b, store, Options())
    with pytest.raises(RavexError, match="No space left"):
        native_write.write(b, tmp_path / "fresh" / "store", Options())
    assert not (tmp_path / "fresh" / "store").exists()  # a store this call made for a failed checkpoint is not left behind
    monkeypatch.undo()
    assert (store / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(store / "checkpoints")) == ["00000000"]  # neither the temporary nor the renamed directory is left
    assert native.resolve(store, -1)[0]["index"] == 0
    assert native_write.write(b, store, Options())["index"] == 1  # and the lock was released


CRASH = """
import os, sys
from pathlib import Path
from ravex_convert._output import Options
from ravex_convert.formats import torch_save
from ravex_convert.formats.native import writer as native_write
where = sys.argv[3]
from ravex_convert.storage import local, objdir
def dying(real):
    def publish(self, commit):
        # checkpoint.json is the commit object of the checkpoint directory, written as it is published
        if where == "metadata" and any(rel == "checkpoint.json" for rel, _ in commit):
            os._exit(9)
        return real(self, commit)
    return publish
def die_manifest(*a, **k):
    os._exit(9)
local._StagedOutput.publish = dying(local._StagedOutput.publish)  # whichever backend RAVEX_STORAGE picks
objdir._Output.publish = dying(objdir._Output.publish)
if where == "manifest":
    native_write._write_manifest = die_manifest
native_write.write(torch_save.read(Path(sys.argv[1])), Path(sys.argv[2]), Options(world_size=2))
"""


def test_hard_crash_leaves_the_previous_checkpoint_and_garbage_the_next_write_cleans(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    native_write.write(torch_save.read(pt_files["a"]), store, Options())
    before = (store / "manifest.json").read_bytes()
    left = []
    for where in ("manifest", "metadata"):
        res = subprocess.run([sys.executable, "-P", "-c", CRASH, str(pt_files["b"]), str(store), where], capture_output=True, text=True, check=False)
        assert res.returncode == 9, res.stderr
        assert (store / "manifest.json").read_bytes() == before
        assert native.read(store).source["index"] == 0
        left.append(sorted(os.listdir(store / "checkpoints")))
    # killed before the manifest: a numbered directory the manifest does not list; killed before
    # checkpoint.json: a temporary one (the second writer swept the first's leftovers)
    assert left[0] == ["00000000", "00000001"]
    # (a backend without rename, RAVEX_STORAGE=objdir, writes it under its final name: as unlisted, as swept)
    staged = r"00000002" if objdir() else r"00000002\.tmp-[0-9a-f]{12}"
    assert left[1][0] == "00000000" and re.fullmatch(staged, left[1][1]) and len(left[1]) == 2, left
    assert sorted(os.listdir(store / "checkpoints" / left[1][1])) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert native.resolve(store, -1)[0]["index"] == 0
    done = native_write.write(torch_save.read(pt_files["b"]), store, Options())
    assert done["index"] == 3  # no index reused, even one that never committed
    assert sorted(os.listdir(store / "checkpoints")) == ["00000000", "00000003"]
    native.verify_chunks(native.read(store))


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_byte_is_reported(tmp_path: Path, pt_files: dict[str, Path], compression: str | None) -> None:
    store = tmp_path / "s"
    native_write.write(torch_save.read(pt_files["a"]), store, Options(world_size=2, compression=compression))
    ckpt = native.read(store)
    c = ckpt.tensors["model/lin.weight"].chunks[1]
    assert c.file is not None and c.stored_nbytes is not None
    _flip(c.file, c.offset + c.stored_nbytes // 2)
    native.verify_chunks(ckpt, ["model/lin.bias", "model/head.weight"])  # chunks it does not use are not read
    with pytest.raises(CorruptCheckpointError) as err:
        native.verify_chunks(native.read(store))
    msg = err.value.message
    assert "chunk 1 of tensor 'model/lin.weight'" in msg and c.file.name in msg and "checkpoint 0" in msg and str(store) in msg
    assert err.value.exit_code >= 2 and err.value.hint


def test_truncated_and_missing_data_files(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    native_write.write(torch_save.read(pt_files["a"]), store, Options(world_size=2))
    ckpt = native.read(store)
    os.truncate(store / "checkpoints" / "00000000" / "rank00001.safetensors", 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        native.verify_chunks(ckpt)
    (store / "checkpoints" / "00000000" / "rank00001.safetensors").unlink()
    with pytest.raises(RavexError, match="missing"):
        native.verify_chunks(ckpt)


def test_newer_checkpoint_format_version_is_refused(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    store = tmp_path / "s"
    src = torch_save.read(pt_files["a"])
    native_write.write(src, store, Options())
    path = store / "checkpoints" / "00000000" / "checkpoint.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "format_version": 2}))
    with pytest.raises(RavexError, match="format version 2") as err:
        native.read(store)
    assert "upgrade Ravex" in str(err.value)
    with pytest.raises(RavexError, match="format version 2"):
        native_write.write(src, store, Options())
    assert sorted(os.listdir(store / "checkpoints")) == ["00000000"]


def test_refuses_a_directory_that_is_not_a_store(tmp_path: Path, pt_files: dict[str, Path]) -> None:
    src = torch_save.read(pt_files["a"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(RavexError, match="not a Ravex store") as err:
        native_write.write(src, tmp_path / "d", Options())
    assert err.value.hint and sorted(os.listdir(tmp_path / "d")) == ["notes.txt"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(RavexError, match="not a directory"):
        native_write.write(src, tmp_path / "f", Options())
    # an empty directory, or one an interrupted creation left, becomes a store
    (tmp_path / "e" / "checkpoints").mkdir(parents=True)
    (tmp_path / "e" / "manifest.json.tmp-abc").write_text("{")
    assert native_write.write(src, tmp_path / "e", Options())["index"] == 0
    # (the lock file stays; a lease object, RAVEX_STORAGE=objdir, is deleted on release)
    assert sorted(os.listdir(tmp_path / "e")) == ["checkpoints", *([] if objdir() else ["lock"]), "manifest.json", "ravex-store.json"]
    marker = json.loads((tmp_path / "e" / "ravex-store.json").read_text())
    assert marker["format"] == "ravex-store" and marker["format_version"] == 1 and re.fullmatch(r"[0-9a-f]{32}", marker["store_id"])


def _tiny(name: str = "model/w", dtype: str = "float32") -> Checkpoint:
    ckpt = Checkpoint("live", Path("mem"), step=1)
    ckpt.add(LogicalTensor(name, (2,), dtype, [Chunk(Box((0,), (2,)), dtype, data=b"\0" * 2 * itemsize(dtype))]))
    return ckpt


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with pytest.raises(RavexError, match="'model/z'.*complex64"):
        native_write.write(_tiny("model/z", "complex64"), store, Options())
    with pytest.raises(RavexError, match="'model/a@b'"):
        native_write.write(_tiny("model/a@b"), store, Options())
    linked = _tiny()
    linked.objects["rng"] = {"torch": TensorLink("obj/rng/torch")}
    with pytest.raises(RavexError, match=r"objects\.rng\.torch.*obj/rng/torch"):
        native_write.write(linked, store, Options())
    aliased = _tiny()
    aliased.aliases["model/v"] = "model/nope"
    with pytest.raises(RavexError, match="alias 'model/v'"):
        native_write.write(aliased, store, Options())
    odd = _tiny()
    odd.objects["extra"] = {"x": object()}
    with pytest.raises(RavexError, match=r"objects\.extra\.x"):
        native_write.write(odd, store, Options())
    with pytest.raises(RavexError, match="run id"):
        native_write.write(_tiny(), store, Options(), run_id="a/b")
    assert not store.exists()


def test_small_and_empty_tensors_at_world_size_4(tmp_path: Path) -> None:
    ckpt = Checkpoint("live", Path("mem"), step=None)
    shapes: dict[str, tuple[int, ...]] = {"model/scalar": (), "model/one": (1, 3), "model/two": (2,), "model/five": (5, 2), "model/empty": (0, 4)}
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        data = np.arange(i, i + n, dtype=np.float32).tobytes()
        ckpt.add(LogicalTensor(name, shape, "float32", [Chunk(Flat(0, n), "float32", data=data)] if n else []))
    native_write.write(ckpt, tmp_path / "s", Options(world_size=4))
    out = native.read(tmp_path / "s")
    native.verify_chunks(out)
    assert out.step is None
    regions = {n: [(c.region.offsets, c.region.sizes) for c in t.chunks if isinstance(c.region, Box)] for n, t in out.tensors.items()}
    assert regions == {"model/scalar": [((), ())], "model/one": [((0, 0), (1, 3))], "model/two": [((0,), (1,)), ((1,), (1,))],
                       "model/five": [((0, 0), (2, 2)), ((2, 0), (2, 2)), ((4, 0), (1, 2))], "model/empty": []}
    for name, t in ckpt.tensors.items():
        assert gather(out.tensors[name]) == gather(t)


# ---------------------------------------------------------------- the worked example of docs/format.md section 16


def _spec_example() -> dict[str, Any]:
    text = (REPO / "docs" / "format.md").read_text()
    block = text.split('`checkpoints/00000004/checkpoint.json` follows.')[1].split("```json\n")[1].split("\n```")[0]
    doc: dict[str, Any] = json.loads(block)
    return doc


def _example_state(step: int, objects: dict[str, Any]) -> Checkpoint:
    """The section 16 model at ``step``: the values it gives at step 500, others before."""
    f = step / 500
    ckpt = Checkpoint("live", Path("live"), step=step)

    def add(name: str, shape: tuple[int, ...], dtype: str, data: bytes) -> None:
        ckpt.add(LogicalTensor(name, shape, dtype, [Chunk(Box(tuple(0 for _ in shape), shape), dtype, data=data)]))

    add("model/embed.weight", (4, 3), "float32", struct.pack("<12f", *[0.25 * f] * 12))
    add("model/norm.weight", (3,), "float32", struct.pack("<3f", 1.0, 1.0, 1.0))
    add("optim/exp_avg/embed.weight", (4, 3), "float32", struct.pack("<12f", *[0.125 * f] * 12))
    add("optim/exp_avg_sq/embed.weight", (4, 3), "float32", struct.pack("<12f", *[0.0625 * f] * 12))
    add("optim/step/embed.weight", (), "float32", struct.pack("<f", float(step)))
    add("obj/rng/torch", (5056,), "uint8", bytes([0 if step == 500 else step // 100]) * 5056)
    ckpt.aliases["model/lm_head.weight"] = "model/embed.weight"
    ckpt.objects = objects
    return ckpt


def test_reproduces_the_worked_example(tmp_path: Path) -> None:
    """Checkpoints every 100 steps with keep_last 2, world size 2: the store of section 16,
    offsets and checksums included."""
    spec = _spec_example()
    objects = decode(spec["objects"])
    store = tmp_path / "store"
    for step in (100, 200, 300, 400, 500):
        native_write.write(_example_state(step, objects), store, Options(world_size=2), run_id="3f9c0a7d52e1")
        native_write.prune(store, 2)
    doc = json.loads((store / "checkpoints" / "00000004" / "checkpoint.json").read_text())
    assert doc["tensors"] == spec["tensors"]
    assert (doc["aliases"], doc["objects"]) == (spec["aliases"], spec["objects"])
    assert (doc["index"], doc["step"], doc["world_size"], doc["format_version"]) == (4, 500, 2, 1)
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["next_index"] == 5
    assert [{k: e[k] for k in ("index", "dir", "step", "status", "run_id", "world_size", "bytes", "tensors")} for e in manifest["checkpoints"]] == [
        {"index": i, "dir": f"checkpoints/0000000{i}", "step": 100 * (i + 1), "status": "complete", "run_id": "3f9c0a7d52e1",
         "world_size": 2, "bytes": 5216, "tensors": 6} for i in (3, 4)]
    ck = store / "checkpoints"
    assert sorted(os.listdir(ck)) == ["00000000", "00000003", "00000004"]
    assert sorted(os.listdir(ck / "00000000")) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert sorted(os.listdir(ck / "00000004")) == ["checkpoint.json", "rank00000.safetensors", "rank00001.safetensors"]
    native.verify_chunks(native.read(store))
