"""`torchrun -m ravex convert|reshard` shares the output's files between the
processes and commits once: the bytes are those of a one-process run.

Each case converts a bundled fixture twice, once as one process and once as
two torchrun ranks (gloo on CPU), and compares every file of the two outputs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _launch import launch
from conftest import DATA, ravex_bin

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CASES = {
    "zero3-to-dcp-ws3": ("zero3_ws2_fp32", ["convert", "--to", "dcp", "--world-size", "3"]),
    "zero2-to-zero3-ws3": ("zero2_ws2_fp32", ["convert", "--to", "zero", "--zero-stage", "3", "--world-size", "3"]),
    "zero2-to-sharded-safetensors": ("zero2_ws2_fp32", ["convert", "--to", "safetensors", "--max-shard-size", "20KB"]),
    "fsdp2-to-torch-save": ("fsdp2_ws2", ["convert", "--to", "torch_save"]),
    "zero3-reshard-3-to-2": ("zero3_ws3_fp32", ["reshard", "--world-size", "2"]),
    "fsdp2-to-native-ws3": ("fsdp2_ws2", ["convert", "--to", "native", "--world-size", "3"]),
    "zero3-to-native-zstd": ("zero3_ws2_bf16", ["convert", "--to", "native", "--world-size", "2", "--compression", "zstd"]),
}


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def _torchrun(nproc: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return launch(nproc, ["-m", "ravex", *args], cwd=cwd, env=_env())


def _cmd(verb: str, rest: list[str], src: Path, dst: Path) -> list[str]:
    return [verb, str(src), str(dst), *rest, "--quiet"]


def _files(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _comparable(files: dict[str, bytes]) -> dict[str, bytes]:
    """What differs between ANY two runs is left out: DCP's ``save_id`` (a fresh
    uuid per save, as torch writes it) and the times and run ids a native store records."""
    out = {}
    for k, v in files.items():
        if k == ".metadata":
            assert len(_UUID.findall(v)) == 1
            v = _UUID.sub(b"-" * 36, v)
        if k.endswith((".json",)) and (k.endswith("checkpoint.json") or k in ("manifest.json", "ravex-store.json")):
            doc = json.loads(v)
            for entry in [doc, *doc.get("checkpoints", [])]:
                for field in ("created_unix", "run_id", "store_id", "metadata_checksum"):
                    entry.pop(field, None)
            v = json.dumps(doc, sort_keys=True).encode()
        if k != "lock":
            out[k] = v
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_write_the_bytes_one_process_writes(case: str, tmp_path: Path) -> None:
    name, args = CASES[case]
    src = DATA / name / "checkpoint"
    verb, rest = args[0], args[1:]
    one, two = tmp_path / "one", tmp_path / "two"
    res = subprocess.run([ravex_bin(), *_cmd(verb, rest, src, one)], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    res = _torchrun(2, _cmd(verb, rest, src, two), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = _comparable(_files(one)), _comparable(_files(two))
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k] != b[k]]
    assert not different, different
    assert not [p for p in tmp_path.iterdir() if ".ravex-tmp-" in p.name]


def test_a_second_checkpoint_into_a_store_reuses_the_same_chunks_on_two_ranks(tmp_path: Path) -> None:
    """Rank 0 decides what is reused (the newest checkpoint's unchanged chunks) for every rank."""
    outs = {}
    for label, ranks in (("one", None), ("two", 2)):
        store = tmp_path / label
        for name in ("zero3_ws2_fp32", "zero3_ws2_fp32"):
            args = _cmd("convert", ["--to", "native", "--world-size", "2"], DATA / name / "checkpoint", store)
            res = (subprocess.run([ravex_bin(), *args], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600, check=False)
                   if ranks is None else _torchrun(ranks, args, tmp_path))
            assert res.returncode == 0, res.stdout + res.stderr
        outs[label] = _comparable(_files(store))
        second = json.loads((store / "checkpoints" / "00000001" / "checkpoint.json").read_text())
        files = {c["file"] for t in second["tensors"].values() for c in t["chunks"]}
        assert any(f.startswith("checkpoints/00000000/") for f in files)  # chunks reused from the first
    assert outs["one"] == outs["two"]  # the same chunks reused, the same written


def test_two_ranks_write_a_store_on_object_storage_as_one_process_writes_a_local_one(tmp_path: Path) -> None:
    """Rank 0 holds the lease and puts the manifest; rank 1 uploads its data objects into the
    checkpoint's prefix; nothing is renamed (docs/format.md section 3, on object storage)."""
    (tmp_path / "bucket").mkdir()
    local, remote = tmp_path / "local", f"objdir://{tmp_path}/bucket/store"
    for _ in range(2):  # the second checkpoint reuses the first's chunks
        for dst, ranks in ((local, None), (remote, 2)):
            args = ["convert", str(DATA / "zero3_ws2_fp32" / "checkpoint"), str(dst), "--to", "native", "--world-size", "2", "--quiet"]
            res = (subprocess.run([ravex_bin(), *args], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600, check=False)
                   if ranks is None else _torchrun(ranks, args, tmp_path))
            assert res.returncode == 0, res.stdout + res.stderr
    assert _comparable(_files(tmp_path / "bucket" / "store")) == _comparable(_files(local))
    assert not (tmp_path / "bucket" / "store" / "lock").exists()  # the lease went with its holder
    res = subprocess.run([ravex_bin(), "verify", remote, str(local)], capture_output=True, text=True, env=_env(), timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_refusal_on_rank_0_stops_every_rank(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("mine")
    res = _torchrun(2, _cmd("convert", ["--to", "dcp"], DATA / "fsdp2_ws2" / "checkpoint", dst), tmp_path)
    assert res.returncode != 0
    assert "already exists" in res.stderr and "--force" in res.stderr
    assert "rank 0 could not begin the output" in res.stderr  # what rank 1 says
    assert _files(dst) == {"keep": b"mine"}
    assert not [p for p in tmp_path.iterdir() if ".ravex-tmp-" in p.name]


RANK0_ONLY = """
import os, sys
from ravex_convert import ConvertOptions, convert
if os.environ["RANK"] == "0":
    convert(sys.argv[1], sys.argv[2], "dcp", ConvertOptions(world_size=2))
"""


def test_the_api_on_rank_0_alone_does_not_wait_for_the_other_ranks(tmp_path: Path) -> None:
    """A training script under torchrun that converts on rank 0 only: the Python API
    spreads over the job only when asked (the CLI asks), so it neither hangs nor
    waits for ranks that never call it."""
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_ONLY)
    src, one, two = DATA / "fsdp2_ws2" / "checkpoint", tmp_path / "one", tmp_path / "two"
    res = subprocess.run([ravex_bin(), "convert", str(src), str(one), "--to", "dcp", "--world-size", "2", "--quiet"],
                         capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    res = launch(2, [str(script), str(src), str(two)], cwd=tmp_path, env=_env(), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _comparable(_files(one)) == _comparable(_files(two))
