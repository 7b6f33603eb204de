"""Hugging Face Trainer ``checkpoint-N`` directories, written by the real Trainer.

A tiny GPT-2 (tests/_hf_train.py, CPU, nothing downloaded) trains 6 steps and
saves checkpoint-2, -4 and -6, each with the live optimizer state by name beside
it. Ravex reads checkpoint-4 as one checkpoint (weights, optimizer.pt named from
config.json's architecture, scheduler.pt, trainer_state.json, the carried RNG and
argument files), every tensor checked bit for bit against the files and the live
state; its output, through a Ravex store and back, is resumed by the Trainer
itself, and the resumed run ends bit-identical to the Trainer's own resume of
checkpoint-4 (a control without rng_state.pth does not).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_ravex, run_without_torch
from safetensors.torch import load_file

import ravex_convert
from ravex_convert.errors import CorruptCheckpointError, LayoutMismatchError

SCRIPT = Path(__file__).with_name("_hf_train.py")


def train(out: Path, steps: int, resume: Path | None = None) -> dict[str, torch.Tensor]:
    args = [sys.executable, "-P", str(SCRIPT), str(out), str(steps)] + ([str(resume)] if resume else [])
    res = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(str(out / "final.safetensors"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "run"
    train(out, 6)
    return out


@pytest.fixture(scope="module")
def hf_resumed(run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The reference: the Trainer resuming its own checkpoint-4."""
    return train(tmp_path_factory.mktemp("hf_ref") / "run", 6, run / "checkpoint-4")


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_inspect_names_every_part(run: Path) -> None:
    info = ravex_convert.inspect(run / "checkpoint-4")
    assert (info.format, info.step) == ("hf_trainer", 4)
    roles = {f.path: f.role for f in info.files}
    assert roles["optimizer.pt"] == "optimizer" and roles["scheduler.pt"] == "scheduler"
    assert roles["trainer_state.json"] == "trainer_state" and roles["model.safetensors"] == "weights"
    assert {"rng_state.pth", "training_args.bin", "config.json"} <= set(info.extra["carried"])
    assert info.optimizer is not None and info.optimizer.param_groups == 2
    assert info.aliases == {"lm_head.weight": "transformer.wte.weight"}


def test_inspect_imports_no_torch(run: Path) -> None:
    out = run_without_torch("import sys, ravex_convert; print(ravex_convert.inspect(sys.argv[1]).format)", str(run / "checkpoint-4"))
    assert out.strip() == "hf_trainer"


def test_read_is_the_files_and_the_live_state(run: Path) -> None:
    ckpt = ravex_convert.read_checkpoint(run / "checkpoint-4")
    assert any("config.json's architecture (GPT2LMHeadModel)" in n for n in ckpt.notes)
    out = run.parent / "read.pt"
    ravex_convert.convert(run / "checkpoint-4", out, to="torch_save")
    got = torch.load(out, weights_only=True)
    weights = load_file(str(run / "checkpoint-4" / "model.safetensors"))
    assert equal({k: v for k, v in got["model"].items() if k != "lm_head.weight"}, weights)
    true = load_file(str(run / "true_state-4.safetensors"))  # the live optimizer state when the Trainer saved
    named = {f"{s}/{fqn}": v for fqn, per in got["optim"]["state"].items() for s, v in per.items() if v.dim() > 0}
    assert equal(named, true)
    assert got["lr_scheduler"] == torch.load(run / "checkpoint-4" / "scheduler.pt", weights_only=True)
    assert got["trainer_state"] == json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())


def test_round_trip_through_a_store_gives_the_trainers_files_back(run: Path) -> None:
    src = run / "checkpoint-4"
    store, back = run.parent / "store", run.parent / "checkpoint-4-back"
    ravex_convert.convert(src, store, to="native")
    ravex_convert.convert(store, back, to="hf_trainer")
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in ("rng_state.pth", "training_args.bin", "config.json", "generation_config.json"):
        assert (back / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((back / "trainer_state.json").read_text()) == json.loads((src / "trainer_state.json").read_text())
    assert equal(load_file(str(back / "model.safetensors")), load_file(str(src / "model.safetensors")))
    a, b = torch.load(src / "optimizer.pt", weights_only=True), torch.load(back / "optimizer.pt", weights_only=True)
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        assert a["state"][pid].keys() == b["state"][pid].keys()
        assert all(torch.equal(a["state"][pid][k], b["state"][pid][k]) for k in a["state"][pid])
    assert torch.load(src / "scheduler.pt", weights_only=True) == torch.load(back / "scheduler.pt", weights_only=True)
    from transformers import GPT2LMHeadModel  # the framework's own loader of the weights and config

    loaded = GPT2LMHeadModel.from_pretrained(back)
    want = load_file(str(src / "model.safetensors"))
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again, as the config says


def test_the_trainer_resumes_ravex_output_exactly(run: Path, hf_resumed: dict[str, torch.Tensor], tmp_path: Path) -> None:
    store, back = tmp_path / "store", tmp_path / "checkpoint-4"
    assert run_ravex("convert", run / "checkpoint-4", store, "--to", "native").returncode == 0
    res = run_ravex("convert", store, back, "--to", "hf_trainer")
    assert res.returncode == 0, res.stderr
    assert equal(train(tmp_path / "resumed", 6, back), hf_resumed)


def test_the_comparison_sees_a_lost_rng_state(run: Path, hf_resumed: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Control: without rng_state.pth the Trainer's resume differs, so the test above checks the carried RNG."""
    ravex_convert.convert(run / "checkpoint-4", tmp_path / "checkpoint-4", to="hf_trainer")
    (tmp_path / "checkpoint-4" / "rng_state.pth").unlink()
    assert not equal(train(tmp_path / "resumed", 6, tmp_path / "checkpoint-4"), hf_resumed)


def test_param_names_are_checked_against_the_shapes(run: Path, tmp_path: Path) -> None:
    ckpt = ravex_convert.read_checkpoint(run / "checkpoint-4")
    order = [p for g in ckpt.objects["optim.param_groups"] for p in g["params"]]
    same = ravex_convert.read_checkpoint(run / "checkpoint-4", param_names=order)
    assert {n for n in same.tensors if n.startswith("optim/")} == {n for n in ckpt.tensors if n.startswith("optim/")}
    swapped = [order[-1], *order[1:-1], order[0]]  # a (16,) LayerNorm bias for the (64, 16) embedding
    bad = ravex_convert.read_checkpoint(run / "checkpoint-4", param_names=swapped)
    assert isinstance(bad.source.get("optimizer_error"), LayoutMismatchError)
    assert "shape" in bad.source["optimizer_error"].message


def test_a_config_without_an_architecture_needs_param_names(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-4"
    ravex_convert.convert(run / "checkpoint-4", src, to="hf_trainer")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("architectures")
    (src / "config.json").write_text(json.dumps(cfg))
    res = run_ravex("convert", src, tmp_path / "out.pt", "--to", "torch_save")
    assert res.returncode != 0 and "one architecture" in res.stderr and "--param-names" in res.stderr
    assert not (tmp_path / "out.pt").exists()
    assert run_ravex("convert", src, tmp_path / "w.pt", "--to", "torch_save", "--weights-only").returncode == 0


def test_damaged_trainer_state_is_one_clear_error(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-4"
    ravex_convert.convert(run / "checkpoint-4", src, to="hf_trainer")
    (src / "trainer_state.json").write_text('{"global_step": 4, "global_step": 5}')
    with pytest.raises(CorruptCheckpointError, match="trainer_state.json"):
        ravex_convert.read_checkpoint(src)
    res = run_ravex("convert", src, tmp_path / "out", "--to", "native")
    assert res.returncode != 0 and "trainer_state.json" in res.stderr and not (tmp_path / "out").exists()


def test_a_directory_beside_the_files_is_named_as_left_out(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-4"
    shutil.copytree(run / "checkpoint-4", src)
    (src / "runs").mkdir()
    for i in range(3):
        (src / "runs" / f"events.{i}").write_text("x")
    res = run_ravex("convert", src, tmp_path / "out", "--to", "native", "--json")
    assert res.returncode == 0, res.stderr
    left = json.loads(res.stdout)["left_out"]
    assert [(d["what"], d["kind"], d["count"]) for d in left] == [("runs/", "directory", 3)]  # every file of the checkpoint itself is carried
