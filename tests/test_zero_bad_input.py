"""DeepSpeed checkpoints with parts missing or damaged: one clear error each,
naming the file, with a hint and a non-zero exit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import DATA, inspect_json, run_ravex


@pytest.fixture
def zero2(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(DATA / "zero2_ws3_fp32" / "checkpoint", dst)
    return dst


@pytest.fixture
def zero3(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt3"
    shutil.copytree(DATA / "zero3_ws2_bf16" / "checkpoint", dst)
    return dst


def test_latest_names_a_missing_tag(zero2: Path) -> None:
    (zero2 / "latest").write_text("global_step999")
    res = run_ravex("inspect", zero2)
    assert res.returncode == 5
    assert "latest: names tag 'global_step999'" in res.stderr
    assert "hint:" in res.stderr and "--tag" in res.stderr


def test_tag_option_picks_another_tag(zero2: Path) -> None:
    shutil.copytree(zero2 / "global_step3", zero2 / "global_step2")
    assert inspect_json(zero2, "--tag", "global_step2")["tag"] == "global_step2"


def test_several_tags_and_no_latest(zero2: Path) -> None:
    shutil.copytree(zero2 / "global_step3", zero2 / "global_step2")
    (zero2 / "latest").unlink()
    res = run_ravex("inspect", zero2)
    assert res.returncode == 2
    assert "2 DeepSpeed tags (global_step2, global_step3)" in res.stderr and "--tag" in res.stderr


def test_tag_directory_directly(zero2: Path) -> None:
    info = inspect_json(zero2 / "global_step3")
    assert (info["format"], info["zero_stage"], info["world_size"]) == ("zero", 2, 3)


def test_missing_optimizer_rank_file(zero2: Path) -> None:
    (zero2 / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    res = run_ravex("inspect", zero2)
    assert res.returncode == 5
    assert "rank 1's file zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in res.stderr
    assert "hint:" in res.stderr


def test_missing_last_rank_is_caught_by_partition_count(zero2: Path) -> None:
    # ranks 0 and 1 look contiguous; the optimizer state says 3 ranks wrote it
    (zero2 / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    res = run_ravex("inspect", zero2)
    assert res.returncode == 5
    assert "rank 2's file zero_pp_rank_2_mp_rank_00_optim_states.pt is missing" in res.stderr and "says 3 ranks" in res.stderr


def test_missing_zero3_model_states_rank_file(zero3: Path) -> None:
    (zero3 / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    res = run_ravex("inspect", zero3)
    assert res.returncode == 5
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt is missing" in res.stderr


def test_truncated_optimizer_file(zero2: Path) -> None:
    f = zero2 / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    res = run_ravex("inspect", zero2)
    assert res.returncode == 6
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt: not a readable torch.save archive" in res.stderr


def test_model_states_missing(zero2: Path) -> None:
    (zero2 / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    res = run_ravex("inspect", zero2)
    assert res.returncode == 5
    assert "no model-states file" in res.stderr
