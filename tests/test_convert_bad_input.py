"""Conversions that cannot succeed: one clear error naming the file and the fix,
exit >= 2, and nothing at DST (not even a half-written file under its name)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import DATA, ravex_bin, run_ravex

pytestmark = pytest.mark.usefixtures("storage_backend")  # every test on every backend (conftest)


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def zero(tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(DATA / "zero2_ws2_bf16" / "checkpoint", dst)
    return dst


def test_missing_rank_file(zero: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (zero / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    res = run_ravex("convert", zero, out / "m.safetensors", "--to", "safetensors")
    assert res.returncode == 5
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in res.stderr and "hint:" in res.stderr
    assert _leftovers(out) == []


def test_rank_file_from_another_run(zero: Path, tmp_path: Path) -> None:
    # rank 1's file replaced by rank 1's file of a ZeRO-2 run at world size 3
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(DATA / "zero2_ws3_fp32" / "checkpoint" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                zero / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    res = run_ravex("convert", zero, out / "m.pt", "--to", "torch_save")
    assert res.returncode >= 2
    assert "zero_pp_rank_1" in res.stderr or "ranks" in res.stderr
    assert "hint:" in res.stderr
    assert _leftovers(out) == []


def test_truncated_data_in_a_dcp_file(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    shutil.copytree(DATA / "fsdp2_ws2" / "checkpoint", src)
    f = src / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:-4096])
    out = tmp_path / "out"
    out.mkdir()
    res = run_ravex("convert", src, out / "m.pt", "--to", "torch_save")
    assert res.returncode == 6
    assert "__1_0.distcp" in res.stderr and "hint:" in res.stderr
    assert _leftovers(out) == []


def test_existing_destination_needs_force(tmp_path: Path) -> None:
    dst = tmp_path / "m.safetensors"
    dst.write_text("precious")
    res = run_ravex("convert", DATA / "safetensors_single" / "checkpoint", dst, "--to", "safetensors")
    assert res.returncode == 2 and "already exists" in res.stderr and "--force" in res.stderr
    assert dst.read_text() == "precious"
    assert run_ravex("convert", DATA / "safetensors_single" / "checkpoint", dst, "--to", "safetensors", "--force").returncode == 0
    assert dst.read_bytes()[8:9] == b"{"


def test_full_disk_leaves_nothing(tmp_path: Path) -> None:
    # The file-size limit makes writes fail with EFBIG part-way, like a full disk.
    out = tmp_path / "out"
    out.mkdir()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    env = dict(os.environ, NO_COLOR="1")
    res = subprocess.run([ravex_bin(), "convert", str(DATA / "fsdp2_ws3" / "checkpoint"), str(out / "m.pt"), "--to", "torch_save"],
                         capture_output=True, text=True, preexec_fn=limit, env=env, timeout=120, check=False)
    assert res.returncode >= 2, res.stderr
    assert "m.pt" in res.stderr or "writing failed" in res.stderr
    assert "hint:" in res.stderr and "space" in res.stderr
    assert _leftovers(out) == []


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    res = run_ravex("convert", DATA / "zero3_ws3_fp32" / "checkpoint", tmp_path / "x.safetensors", "--to", "safetensors", "--dry-run")
    assert res.returncode == 0
    assert "nothing written" in res.stdout and "copy runs" in res.stdout
    assert _leftovers(tmp_path) == []


def test_unknown_destination_directory(tmp_path: Path) -> None:
    res = run_ravex("convert", DATA / "torch_save" / "checkpoint", tmp_path / "no" / "such" / "m.pt", "--to", "torch_save", "--weights-only")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_checksum_mismatch_in_a_native_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert run_ravex("convert", DATA / "fsdp2_ws2" / "checkpoint", store, "--to", "native", "-q").returncode == 0
    data = store / "checkpoints" / "00000000" / "rank00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x01  # one bit of the last tensor's bytes
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    out.mkdir()
    for cmd in (["convert", store, out / "m.pt", "--to", "torch_save"], ["verify", store, DATA / "fsdp2_ws2" / "checkpoint"]):
        res = run_ravex(*cmd)
        assert res.returncode == 6, res.stderr
        assert "checksum" in res.stderr and "rank00000.safetensors" in res.stderr and "hint:" in res.stderr
    assert _leftovers(out) == []
