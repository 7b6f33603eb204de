"""A native store on object storage (``objdir://``, docs/format.md section 3): what it holds
reads back bit for bit and its data files are those of a local store; a second checkpoint
reuses the first's objects; the lock is a lease; a crash before the manifest's conditional
put leaves nothing listed and the next write sweeps it; and nothing in the bucket is ever
renamed or rewritten (the audit hook watches the bucket for the whole write)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, inspect_json, run_ravex

from ravex_convert import ConvertOptions, convert, read_checkpoint, verify
from ravex_convert._engine import chunk_bytes
from ravex_convert.errors import RavexError
from ravex_convert.formats.native import reader as native
from ravex_convert.formats.native import store as native_store
from ravex_convert.formats.native import writer as native_write
from ravex_convert.storage import ABSENT, resolve
from ravex_convert.storage.base import machine
from ravex_convert.storage.objdir import ObjectDirStorage, SemanticsViolation, in_use

ZERO = DATA / "zero3_ws2_fp32" / "checkpoint"
DCP = DATA / "fsdp2_ws3" / "checkpoint"


@pytest.fixture(autouse=True)
def _local_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAVEX_STORAGE", raising=False)  # plain paths here are local, objdir: names the bucket


@pytest.fixture
def remote(tmp_path: Path) -> str:
    (tmp_path / "bucket").mkdir()
    return f"objdir://{tmp_path}/bucket/store"


def bucket_of(url: str) -> tuple[ObjectDirStorage, str]:
    storage, key = resolve(url)
    assert isinstance(storage, ObjectDirStorage)
    return storage, key


def objects(url: str) -> dict[str, bytes]:
    storage, key = bucket_of(url)
    return {k[len(key) + 1:]: storage.get(k)[0] for k in storage.list(key)}


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def tensor_bytes(url: str | Path, index: int = -1) -> dict[str, list[bytes]]:
    ckpt = read_checkpoint(url, index=index)
    return {n: [chunk_bytes(c) for c in t.chunks] for n, t in ckpt.tensors.items()}


def data_files(d: dict[str, bytes]) -> dict[str, bytes]:
    """The data files of a store: what is neither its JSON nor its lock (those hold times, ids)."""
    return {k: v for k, v in d.items() if k.rsplit("/", 1)[-1].startswith("rank")}


def test_a_converted_store_reads_back_bit_exact_and_holds_a_local_stores_data_files(tmp_path: Path, remote: str) -> None:
    local = tmp_path / "local"
    convert(ZERO, local, "native", ConvertOptions(world_size=3))
    res = convert(ZERO, remote, "native", ConvertOptions(world_size=3))
    assert res["index"] == 0 and res["dir"] == f"{remote}/checkpoints/00000000"
    got = objects(remote)
    # the same objects as the local store's files, less the lock: a lease object exists only while held
    assert sorted(got) == sorted(k for k in files(local) if k != "lock")
    assert data_files(got) == data_files(files(local)) and data_files(got)
    manifest = json.loads(got["manifest.json"])
    assert [e["index"] for e in manifest["checkpoints"]] == [0] and manifest["next_index"] == 1
    # read back through the objdir: name, every chunk checked against its checksum, equal to the source
    back = read_checkpoint(remote)
    assert native.verify_chunks(back) == sum(len(t.chunks) for t in back.tensors.values())
    assert tensor_bytes(remote) == tensor_bytes(local)
    assert verify(ZERO, remote).identical
    storage, _ = bucket_of(remote)
    assert storage.audit() == [] and in_use() == []


def test_inspect_and_verify_commands_read_the_store(tmp_path: Path, remote: str) -> None:
    convert(DCP, remote, "native", ConvertOptions(world_size=2))
    info = inspect_json(remote)  # type: ignore[arg-type]
    assert (info["format"], info["variant"], info["index"]) == ("native", "store", 0)
    res = run_ravex("verify", remote, DCP)
    assert res.returncode == 0, res.stderr
    res = run_ravex("convert", remote, tmp_path / "back.safetensors")  # a store on object storage as a source
    assert res.returncode == 0, res.stderr


def test_a_second_checkpoint_reuses_the_first_and_nothing_is_rewritten(remote: str) -> None:
    first = convert(DCP, remote, "native", ConvertOptions(world_size=3))
    storage, key = bucket_of(remote)
    before = {k: storage.stat(k) for k in storage.list(key)}
    second = convert(DCP, remote, "native", ConvertOptions(world_size=3))
    assert (second["index"], second["bytes_written"], second["bytes_reused"]) == (1, 0, first["bytes"])
    after = {k: storage.stat(k) for k in storage.list(key)}
    # every object of checkpoint 0 is where it was, at the same generation; only the manifest was replaced
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert changed == [f"{key}/manifest.json"]
    assert sorted(set(after) - set(before)) == [f"{key}/checkpoints/00000001/checkpoint.json"]
    assert tensor_bytes(remote, 0) == tensor_bytes(remote, 1) and verify(DCP, remote).identical
    assert storage.audit() == []


def test_prune_and_the_sweep_delete_objects_only(tmp_path: Path, remote: str) -> None:
    """The same writes and prunes leave the same objects as a local store's files, by list and delete."""
    local = tmp_path / "local"
    for dst in (local, remote):
        convert(DCP, dst, "native", ConvertOptions(world_size=3))
        convert(DCP, dst, "native", ConvertOptions(world_size=3))  # 1: every chunk points into 0
        assert native_write.prune(dst, 1) == [0]
    assert sorted(k for k in objects(remote) if k.startswith("checkpoints/")) == [
        *(f"checkpoints/00000000/rank0000{r}.safetensors" for r in range(3)),  # retained for data: no checkpoint.json
        "checkpoints/00000001/checkpoint.json"]
    assert verify(DCP, remote).identical
    for dst in (local, remote):
        convert(ZERO, dst, "native")  # 2: shares little with 0
        assert native_write.prune(dst, 1) == [1]
    assert sorted(objects(remote)) == sorted(k for k in files(local) if k != "lock")
    assert "checkpoints/00000001/checkpoint.json" not in objects(remote)
    storage, key = bucket_of(remote)
    assert sorted(os.listdir(storage.local_path(f"{key}/checkpoints"))) == sorted(os.listdir(local / "checkpoints"))  # 1's prefix is gone
    assert verify(ZERO, remote).identical
    assert storage.audit() == []


def test_the_hook_watches_the_bucket_while_the_store_is_written(remote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock, the manifest and the sweep run while the audit hook refuses any rename or
    in-place write in the bucket by code above the storage layer."""
    storage, _ = bucket_of(remote)
    seen: list[str] = []
    real = native_write.open_store

    def watched(w: native_store.Where, fence: Any = None) -> Any:
        seen.extend(in_use())
        with pytest.raises(SemanticsViolation):
            os.replace(w.path / "manifest.json", w.path / "manifest.json.old")
        with pytest.raises(SemanticsViolation):
            open(w.path / "manifest.json", "r+b")  # noqa: SIM115 - it must not open at all
        return real(w)

    monkeypatch.setattr(native_write, "open_store", watched)
    convert(DCP, remote, "native")
    assert seen == [storage.root] and in_use() == []
    assert storage.audit() == []


def test_a_writer_holding_the_lease_refuses_another(remote: str) -> None:
    convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    with storage.lease(f"{key}/lock", "other-run"):
        with pytest.raises(RavexError) as err:
            convert(DCP, remote, "native")
        assert "another process is writing to this store" in err.value.message and "run other-run" in err.value.message
        assert remote in err.value.message and "delete the object" in (err.value.hint or "")
        with pytest.raises(RavexError, match="run other-run"):
            native_write.prune(remote, 1)
        res = run_ravex("convert", DCP, remote, "--to", "native")
        assert res.returncode != 0 and "another process is writing" in res.stderr and "hint:" in res.stderr
    assert [e["index"] for e in native.read_manifest(storage.local_path(key))["checkpoints"]] == [0]
    assert convert(DCP, remote, "native")["index"] == 1  # released: the next writer goes ahead


def test_a_lease_left_by_a_dead_process_of_this_machine_is_taken_over(remote: str) -> None:
    convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    note = {"pid": gone.pid, "host": socket.gethostname(), "run_id": "killed", "since_unix": time.time(), **machine()}
    storage.put(f"{key}/lock", json.dumps(note).encode(), if_generation=ABSENT)
    assert convert(DCP, remote, "native")["index"] == 1
    assert not storage.exists(f"{key}/lock")


CRASH = """
import os, sys
from ravex_convert import ConvertOptions, convert
from ravex_convert.formats.native import writer as native_write
def die(*a, **k):
    os._exit(9)
native_write._write_manifest = die
convert(sys.argv[1], sys.argv[2], "native", ConvertOptions(world_size=2))
"""


def test_a_crash_before_the_manifest_put_leaves_nothing_listed_and_the_next_write_sweeps_it(remote: str) -> None:
    convert(DCP, remote, "native")
    before = objects(remote)
    res = subprocess.run([sys.executable, "-P", "-c", CRASH, str(ZERO), remote], capture_output=True, text=True, check=False,
                         env={k: v for k, v in os.environ.items() if k != "RAVEX_STORAGE"})
    assert res.returncode == 9, res.stderr
    after = objects(remote)
    assert after["manifest.json"] == before["manifest.json"]
    # checkpoint 1 lies under its final name, complete with checkpoint.json, and the killed writer's lease is left
    assert sorted(k for k in after if k not in before) == [
        "checkpoints/00000001/checkpoint.json", "checkpoints/00000001/rank00000.safetensors",
        "checkpoints/00000001/rank00001.safetensors", "lock"]
    assert read_checkpoint(remote).source["index"] == 0  # readers see what the manifest lists, nothing else
    with pytest.raises(RavexError, match="not listed"):
        read_checkpoint(f"{remote}/checkpoints/00000001")
    done = convert(ZERO, remote, "native")
    assert done["index"] == 2  # no index reused
    left = objects(remote)
    assert not [k for k in left if k.startswith("checkpoints/00000001/")] and "lock" not in left
    assert verify(ZERO, remote).identical
    assert bucket_of(remote)[0].audit() == []


CRASH_MID_UPLOAD = """
import os, shutil, sys
from ravex_convert import ConvertOptions, convert
def die(src, dst, length=0):
    dst.write(src.read(1000))
    dst.flush()
    os._exit(9)
shutil.copyfileobj = die
convert(sys.argv[1], sys.argv[2], "native", ConvertOptions(world_size=2))
"""


def test_a_writer_killed_mid_upload_leaves_no_object_and_blocks_no_later_checkpoint(remote: str) -> None:
    """A put cut short leaves its part in the bucket's directory (an object store keeps such an
    upload out of sight): the next writer takes the same index, and the dead part is aborted."""
    convert(DCP, remote, "native")
    before = objects(remote)
    res = subprocess.run([sys.executable, "-P", "-c", CRASH_MID_UPLOAD, str(ZERO), remote], capture_output=True, text=True, check=False,
                         env={k: v for k, v in os.environ.items() if k != "RAVEX_STORAGE"})
    assert res.returncode == 9, res.stderr
    storage, key = bucket_of(remote)
    parts = list(Path(storage.local_path(f"{key}/checkpoints/00000001")).glob(".*objdir-part-*"))
    assert len(parts) == 1 and parts[0].stat().st_size == 1000
    assert sorted(k for k in objects(remote) if k not in before) == ["lock"]  # no object of checkpoint 1 is visible
    done = convert(ZERO, remote, "native")
    assert done["index"] == 1  # nothing of index 1 ever appeared: it is free
    assert not parts[0].exists()
    assert verify(ZERO, remote).identical
    assert bucket_of(remote)[0].audit() == []


def test_a_put_killed_before_its_part_leaves_an_empty_prefix_the_sweep_clears(remote: str) -> None:
    """Killed between making its key's directory and opening its part, a put leaves an empty
    directory, which is no object (nor a folder) of the store: the next write sweeps it and takes
    that index."""
    convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    d = Path(storage.local_path(f"{key}/checkpoints/00000001"))
    (d / "deeper").mkdir(parents=True)
    assert convert(ZERO, remote, "native")["index"] == 1
    assert verify(ZERO, remote).identical
    assert storage.audit() == []


def test_a_live_upload_under_a_key_does_not_make_it_exist(remote: str) -> None:
    """A part of a put still in progress (this process's) is not an object either; it is left alone."""
    convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    d = Path(storage.local_path(f"{key}/checkpoints/00000001"))
    d.mkdir(parents=True)
    part = d / f".rank00000.safetensors.objdir-part-{os.getpid()}-1"
    part.write_bytes(b"x" * 10)
    assert storage.only_uploads(f"{key}/checkpoints/00000001")
    assert convert(ZERO, remote, "native")["index"] == 1
    assert part.exists()
    assert verify(ZERO, remote).identical


def test_a_lost_precondition_commits_nothing_and_says_so(remote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    real = native_write._write_manifest
    other = json.loads(storage.get(f"{key}/manifest.json")[0])
    other["note"] = "written by a writer that ignored the lock"

    def racing(w: native_store.Where, manifest: dict[str, Any], run_id: str, generation: int, fence: Any = None) -> None:
        storage.put(f"{key}/manifest.json", json.dumps(other).encode())  # lands between the read and the put
        real(w, manifest, run_id, generation, fence)

    monkeypatch.setattr(native_write, "_write_manifest", racing)
    with pytest.raises(RavexError) as err:
        convert(ZERO, remote, "native")
    assert remote in err.value.message and "manifest.json changed" in err.value.message and "nothing was committed" in err.value.message
    assert "only one process writes" in (err.value.hint or "")
    assert json.loads(storage.get(f"{key}/manifest.json")[0]) == other  # the other writer's manifest stands
    assert not [k for k in storage.list(key) if "/checkpoints/00000001/" in k]  # what this writer wrote is gone
    assert not storage.exists(f"{key}/lock")


@pytest.mark.parametrize("where", ["local", "objdir"])
def test_force_does_the_same_on_both_backends(tmp_path: Path, where: str) -> None:
    """A store is appended to, with or without --force, and a destination that is not a
    store is refused either way: --force never replaces a store's checkpoints."""
    (tmp_path / "bucket").mkdir()
    dst = str(tmp_path / "bucket" / "store") if where == "local" else f"objdir://{tmp_path}/bucket/store"
    for _ in range(2):
        res = run_ravex("convert", DCP, dst, "--to", "native", "--force")
        assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "bucket" / "store" / "manifest.json").read_text())
    assert [e["index"] for e in manifest["checkpoints"]] == [0, 1]
    other = tmp_path / "bucket" / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    dst = str(other) if where == "local" else f"objdir://{other}"
    res = run_ravex("convert", DCP, dst, "--to", "native", "--force")
    assert res.returncode != 0 and "not a Ravex store" in res.stderr
    assert sorted(os.listdir(other)) == ["notes.txt"]


def test_a_failed_first_checkpoint_leaves_no_object(remote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(native_write, "_write_manifest", boom)
    with pytest.raises(RavexError, match="No space left"):
        convert(DCP, remote, "native")
    storage, key = bucket_of(remote)
    assert storage.list("") == [] and not storage.local_path(key).exists()


def test_a_store_cannot_be_made_over_an_object_or_in_a_missing_bucket(tmp_path: Path, remote: str) -> None:
    storage, key = bucket_of(remote)
    storage.put(key, b"an object")
    with pytest.raises(RavexError, match="is an object, not a directory"):
        convert(DCP, remote, "native")
    with pytest.raises(RavexError, match="bucket .* does not exist"):
        convert(DCP, f"objdir://{tmp_path}/nowhere/store", "native")
