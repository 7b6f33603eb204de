"""Detection and inspection of native stores laid out by hand per docs/format.md
(the writer comes with the engine issue; these pin what detection accepts)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import inspect_json, run_ravex

CHECKSUM = "xxh3-64:" + "0" * 16  # inspect does not verify data; loading (engine issue) will


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> dict[str, int]:
    """Write a safetensors file; return each tensor's absolute data offset."""
    header: dict[str, Any] = {}
    pos = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(d for _, _, d in tensors.values()))
    return {name: 8 + len(raw) + header[name]["data_offsets"][0] for name in tensors}


def _chunk(file: str, offset: int, nbytes: int, region: dict[str, Any]) -> dict[str, Any]:
    return {"file": file, "offset": offset, "nbytes": nbytes, "stored_nbytes": nbytes, "compression": None, "region": region, "checksum": CHECKSUM}


def make_store(root: Path, steps: list[int], version: int = 1) -> Path:
    root.mkdir(parents=True)
    (root / "ravex-store.json").write_text(json.dumps({"format": "ravex-store", "format_version": version, "created_unix": 1.0, "store_id": "ab" * 16}))
    entries = []
    for index, step in enumerate(steps):
        d = root / "checkpoints" / f"{index:08d}"
        d.mkdir(parents=True)
        f0 = f"checkpoints/{index:08d}/rank00000.safetensors"
        f1 = f"checkpoints/{index:08d}/rank00001.safetensors"
        o0 = _safetensors(root / f0, {"model/embed.weight@0": ("F32", [2, 3], b"\0" * 24), "optim/exp_avg/embed.weight@0": ("F32", [2, 3], b"\0" * 24), "optim/step/embed.weight@0": ("F32", [], struct.pack("<f", step))})
        o1 = _safetensors(root / f1, {"model/embed.weight@1": ("F32", [2, 3], b"\0" * 24), "optim/exp_avg/embed.weight@1": ("F32", [2, 3], b"\0" * 24)})
        box = lambda r: {"box": {"offsets": [2 * r, 0], "sizes": [2, 3]}}
        doc = {
            "format": "ravex-checkpoint", "format_version": 1, "index": index, "step": step, "run_id": "r1",
            "created_unix": 2.0 + index, "world_size": 2,
            "source": {"format": "live", "versions": {"ravex": "0.1.0"}},
            "tensors": {
                "model/embed.weight": {"dtype": "float32", "shape": [4, 3], "chunks": [_chunk(f0, o0["model/embed.weight@0"], 24, box(0)), _chunk(f1, o1["model/embed.weight@1"], 24, box(1))]},
                "optim/exp_avg/embed.weight": {"dtype": "float32", "shape": [4, 3], "chunks": [_chunk(f0, o0["optim/exp_avg/embed.weight@0"], 24, box(0)), _chunk(f1, o1["optim/exp_avg/embed.weight@1"], 24, box(1))]},
                "optim/step/embed.weight": {"dtype": "float32", "shape": [], "chunks": [_chunk(f0, o0["optim/step/embed.weight@0"], 4, {"box": {"offsets": [], "sizes": []}})]},
            },
            "aliases": {"model/lm_head.weight": "model/embed.weight"},
            "objects": {"optim.param_groups": [{"lr": 0.001, "params": ["embed.weight"]}]},
        }
        (d / "checkpoint.json").write_text(json.dumps(doc))
        entries.append({"index": index, "dir": f"checkpoints/{index:08d}", "step": step, "status": "complete", "created_unix": 2.0 + index, "run_id": "r1", "world_size": 2, "bytes": 100, "tensors": 3})
    (root / "manifest.json").write_text(json.dumps({"format": "ravex-store", "format_version": 1, "next_index": len(steps), "checkpoints": entries}))
    return root


def test_store_newest_complete(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", [100, 200])
    # A checkpoint being written, not in the manifest: ignored.
    (store / "checkpoints" / "00000002.tmp-r1").mkdir()
    info = inspect_json(store, "--tensors")
    assert (info["format"], info["variant"], info["world_size"], info["step"], info["index"]) == ("native", "store", 2, 200, 1)
    assert info["aliases"] == {"lm_head.weight": "embed.weight"}
    assert info["optimizer"]["states"] == ["exp_avg", "step"]
    assert [c["index"] for c in info["checkpoints"]] == [0, 1]
    assert inspect_json(store, "--index", "0")["step"] == 100


def test_one_checkpoint_directory(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", [100])
    info = inspect_json(store / "checkpoints" / "00000000")
    assert (info["format"], info["variant"], info["step"]) == ("native", "checkpoint", 100)
    # copied out of its store, it still reads: its files sit beside checkpoint.json
    shutil.copytree(store / "checkpoints" / "00000000", tmp_path / "copied")
    assert inspect_json(tmp_path / "copied")["step"] == 100


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", [1], version=2)
    res = run_ravex("inspect", store)
    assert res.returncode == 2
    assert "format version 2" in res.stderr and "upgrade Ravex" in res.stderr


def test_missing_chunk_file(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", [1])
    (store / "checkpoints" / "00000000" / "rank00001.safetensors").unlink()
    res = run_ravex("inspect", store)
    assert res.returncode == 5
    assert "rank00001.safetensors" in res.stderr and "missing" in res.stderr


def test_uncommitted_checkpoint_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path / "store", [1])
    tmp = store / "checkpoints" / "00000001.tmp-r2"
    shutil.copytree(store / "checkpoints" / "00000000", tmp)
    res = run_ravex("inspect", tmp)
    assert res.returncode == 5 and "never committed" in res.stderr


@pytest.mark.parametrize("damage", ["not json", '{"format": "something-else", "format_version": 1}'])
def test_damaged_manifest(tmp_path: Path, damage: str) -> None:
    store = make_store(tmp_path / "store", [1])
    (store / "manifest.json").write_text(damage)
    res = run_ravex("inspect", store)
    assert res.returncode == 6 and "manifest.json" in res.stderr
