"""The front of `convert` and `verify` (issue 11, points 10, 12, 13): verify is
never "identical" on nothing or on different names; a conversion names what it
leaves out; DST's name picks the format when --to is not given; an elastic
DeepSpeed checkpoint goes to DCP and torch_save only with its hyper-parameters,
and the DCP then loads with torch's own loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DATA, REPO, run_ravex

import ravex_convert

ST = DATA / "safetensors_single" / "checkpoint" / "model.safetensors"
ELASTIC = ("zero2e_ws2_fp32", "zero1e_ws3_bf16")


def _empty_safetensors(path: Path) -> Path:
    from safetensors.numpy import save_file

    save_file({}, str(path))
    return path


# --- point 12: verify ---------------------------------------------------------------------------


def test_verify_two_empty_checkpoints_is_not_identical(tmp_path: Path) -> None:
    a, b = _empty_safetensors(tmp_path / "a.safetensors"), _empty_safetensors(tmp_path / "b.safetensors")
    res = run_ravex("verify", a, b)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "identical" not in res.stdout
    assert res.stdout.startswith("nothing compared: neither") and "holds any tensors" in res.stdout
    assert "hint:" in res.stderr
    data = json.loads(run_ravex("verify", a, b, "--json").stdout)
    assert data["identical"] is False and data["compared"] == 0
    assert [d["kind"] for d in data["differences"]] == ["nothing_compared"]
    assert ravex_convert.verify(a, b).identical is False


def test_verify_empty_against_real_differs_by_every_name(tmp_path: Path) -> None:
    a = _empty_safetensors(tmp_path / "a.safetensors")
    n = len(ravex_convert.inspect(ST).tensors)
    for args, only in (((a, ST), "only in b"), ((ST, a), "only in a")):
        res = run_ravex("verify", *args)
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"different: {n} tensor(s) differ" in res.stdout
        assert (f"{n} {only}") in res.stdout
    data = json.loads(run_ravex("verify", a, ST, "--json").stdout)
    assert data["identical"] is False and data["tensors_a"] == 0 and data["tensors_b"] == n and data["only_in_b"] == n


def test_verify_names_on_one_side_only_are_differences(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    full = load_file(str(ST))
    fewer = dict(list(full.items())[1:])
    save_file(fewer, str(tmp_path / "fewer.safetensors"))
    res = run_ravex("verify", ST, tmp_path / "fewer.safetensors")
    assert res.returncode == 1
    assert "1 only in a, 0 only in b" in res.stdout
    assert run_ravex("verify", ST, ST).returncode == 0


def test_verify_refuses_negative_tolerance() -> None:
    res = run_ravex("verify", ST, ST, "--atol", "-1")
    assert res.returncode == 2 and "tolerances must be finite numbers >= 0" in res.stderr and "hint:" in res.stderr


# --- point 13: what a conversion leaves out -----------------------------------------------------


def test_accelerate_layout_with_a_damaged_optimizer_is_one_clear_error(tmp_path: Path) -> None:
    """An Accelerate directory is read whole (tests/test_accelerate_layout.py, written by Accelerate):
    a damaged optimizer.bin in it is named, and nothing is written."""
    src = tmp_path / "accelerate"
    src.mkdir()
    shutil.copy(ST, src / "model.safetensors")
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        (src / name).write_bytes(b"\0" * 64)
    res = run_ravex("convert", src, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode != 0 and "optimizer.bin: not a readable torch.save archive" in res.stderr
    assert "hint:" in res.stderr and not (tmp_path / "out.safetensors").exists()


def test_hf_trainer_layout_with_damaged_state_files_is_one_clear_error(tmp_path: Path) -> None:
    """A Trainer checkpoint is read whole (tests/test_hf_trainer.py, written by the Trainer; it also
    checks that a directory beside the files is named as left out)."""
    src = tmp_path / "checkpoint-500"
    src.mkdir()
    shutil.copy(ST, src / "model.safetensors")
    for name in ("scheduler.pt", "optimizer.pt", "rng_state.pth", "training_args.bin"):
        (src / name).write_bytes(b"\0" * 16)
    (src / "trainer_state.json").write_text('{"global_step": 500}')
    res = run_ravex("convert", src, tmp_path / "out.pt", "--to", "torch_save", "--json")
    assert res.returncode != 0 and "optimizer.pt: not a readable torch.save archive" in res.stderr
    assert not (tmp_path / "out.pt").exists()


def test_other_tag_in_a_zero_root_is_named(tmp_path: Path) -> None:
    src = tmp_path / "zero"
    shutil.copytree(DATA / "zero2_ws2_fp32" / "checkpoint", src)
    shutil.copytree(src / "global_step3", src / "global_step1")
    res = run_ravex("convert", src, tmp_path / "out.safetensors", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "note: left out: global_step1/ (" in res.stderr and "another checkpoint in the same directory" in res.stderr
    assert "global_step3" not in res.stderr and "latest" not in res.stderr


def test_fixtures_leave_nothing_out_but_what_weights_only_drops(tmp_path: Path) -> None:
    # the readers' own files are never reported as left out
    for name in ("zero3_ws2_fp32", "fsdp2_ws2", "safetensors_sharded", "bf16opt_ws2"):
        res = run_ravex("convert", DATA / name / "checkpoint", tmp_path / f"{name}.safetensors", "--json")
        assert res.returncode == 0, res.stderr
        left = json.loads(res.stdout)["left_out"]
        assert [d for d in left if d["kind"] in ("file", "directory")] == [], (name, left)


def test_safetensors_target_says_what_optimizer_state_it_drops(tmp_path: Path) -> None:
    src = DATA / "zero2_ws2_bf16" / "checkpoint"
    n = sum(1 for t in ravex_convert.read_checkpoint(src).tensors if t.startswith("optim/"))
    res = run_ravex("convert", src, tmp_path / "w.safetensors", "--to", "safetensors")
    assert res.returncode == 0, res.stderr
    assert f"note: optimizer state ({n} tensors) not written: safetensors holds weights only" in res.stderr
    assert "note: training state not written (" in res.stderr and "lr_scheduler" in res.stderr
    res = run_ravex("convert", src, tmp_path / "w.pt", "--to", "torch_save", "--weights-only", "--json")
    left = {d["what"]: d for d in json.loads(res.stdout)["left_out"]}
    assert left["optimizer state"]["count"] == n and "--weights-only" in left["optimizer state"]["reason"]


# --- point 3 of the brief: --to from DST's name --------------------------------------------------


@pytest.mark.parametrize(("name", "fmt"), [("m.safetensors", "safetensors"), ("m.pt", "torch_save"), ("m.bin", "torch_save"),
                                           ("m.PTH", "torch_save")])
def test_format_from_the_destination_name(tmp_path: Path, name: str, fmt: str) -> None:
    res = run_ravex("convert", DATA / "zero2_ws2_fp32" / "checkpoint", tmp_path / name)
    assert res.returncode == 0, res.stderr
    assert f"note: writing {fmt} (no --to given; chosen from the name {name})" in res.stderr
    assert f"({fmt})" in res.stdout
    assert ravex_convert.detect(tmp_path / name).format == fmt


@pytest.mark.parametrize("name", ["out", "out.ckpt", "existing_dir.pt"])
def test_format_cannot_be_told_from_the_name(tmp_path: Path, name: str) -> None:
    if name == "existing_dir.pt":
        (tmp_path / name).mkdir()
    res = run_ravex("convert", DATA / "torch_save" / "checkpoint", tmp_path / name)
    assert res.returncode == 2, res.stderr
    assert "cannot tell which format to write" in res.stderr and "hint: pass --to" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if name == "existing_dir.pt" else [])


# --- point 10: elastic DeepSpeed checkpoints ------------------------------------------------------


def _hyperparameters(name: str, tmp_path: Path) -> Path:
    """The run's own param groups (recorded at save time), without their parameters."""
    true = json.loads((DATA / name / "reference" / "true_state.json").read_text())
    path = tmp_path / "hp.json"
    path.write_text(json.dumps([{k: v for k, v in g.items() if k != "params"} for g in true["param_groups"]]))
    return path


@pytest.mark.parametrize("name", ELASTIC)
@pytest.mark.parametrize("to", ["dcp", "torch_save"])
def test_elastic_checkpoint_is_refused_without_hyperparameters(tmp_path: Path, name: str, to: str) -> None:
    dst = tmp_path / ("out.pt" if to == "torch_save" else "out")
    res = run_ravex("convert", DATA / name / "checkpoint", dst, "--to", to)
    assert res.returncode == 8, res.stderr
    assert "param group 0 has no lr, betas, eps, weight_decay (an elastic DeepSpeed checkpoint does not save them)" in res.stderr
    assert "hint: pass them with --hyperparameters FILE.json" in res.stderr
    assert not dst.exists()


def test_hyperparameters_must_match_the_groups(tmp_path: Path) -> None:
    hp = tmp_path / "one.json"
    hp.write_text('[{"lr": 0.1}]')
    res = run_ravex("convert", DATA / "zero2e_ws2_fp32" / "checkpoint", tmp_path / "out", "--to", "dcp", "--hyperparameters", hp)
    assert res.returncode == 8 and "--hyperparameters has 1 entries" in res.stderr and "2 param groups" in res.stderr
    res = run_ravex("convert", DATA / "zero2e_ws2_fp32" / "checkpoint", tmp_path / "w.safetensors", "--hyperparameters", hp)
    assert res.returncode == 2 and "--hyperparameters applies to outputs with optimizer state" in res.stderr


@pytest.mark.parametrize("name", ELASTIC)
def test_elastic_to_torch_save_with_hyperparameters_loads_into_adamw(tmp_path: Path, name: str) -> None:
    import torch

    dst = tmp_path / "out.pt"
    res = run_ravex("convert", DATA / name / "checkpoint", dst, "--hyperparameters", _hyperparameters(name, tmp_path))
    assert res.returncode == 0, res.stderr
    sd = torch.load(dst, weights_only=True)
    true = json.loads((DATA / name / "reference" / "true_state.json").read_text())
    for got, ref in zip(sd["optim"]["param_groups"], true["param_groups"], strict=True):
        for k in ("lr", "weight_decay", "eps", "params"):
            assert got[k] == ref[k], k
        assert list(got["betas"]) == ref["betas"]


DCP_LOAD = r'''
import json, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

ckpt, true_path, fixtures, out = sys.argv[1:5]
sys.path.insert(0, fixtures)
import model as M

warnings.simplefilter("ignore")
model = M.build_model(seed=M.SEED + 7)  # other weights than the checkpoint's
optimizer = M.make_optimizer(model)
scheduler = M.make_scheduler(optimizer)
msd, osd = get_state_dict(model, optimizer)
state = {"model": msd, "optim": osd}
dcp.load(state, checkpoint_id=ckpt)  # one process: no process group
set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
true = load_file(true_path)
mismatched, checked = [], 0
for key in sorted(true):
    kind, rest = key.split("/", 1)
    if kind == "model":
        try:
            got = model.get_parameter(rest)
        except AttributeError:
            got = model.get_buffer(rest)
    elif kind == "optim":
        state_name, fqn = rest.split("/", 1)
        got = optimizer.state[model.get_parameter(fqn)][state_name]
    else:
        continue
    checked += 1
    if not torch.equal(got.detach().float(), true[key].float()):
        mismatched.append(key)
groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
x, y = M.batch(3, 0, 1)
loss = M.loss_fn(model(x), y)
loss.backward()
optimizer.step()  # steps with the restored hyper-parameters
json.dump({"checked": checked, "mismatched": mismatched, "groups": groups, "loss": loss.item()}, open(out, "w"))
'''


def test_elastic_to_dcp_with_hyperparameters_loads_with_torch_dcp(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    name = "zero2e_ws2_fp32"
    dst = tmp_path / "dcp"
    res = run_ravex("convert", DATA / name / "checkpoint", dst, "--to", "dcp", "--hyperparameters", _hyperparameters(name, tmp_path))
    assert res.returncode == 0, res.stderr
    worker = tmp_path / "load.py"
    worker.write_text(DCP_LOAD)
    out = tmp_path / "result.json"
    true_path = DATA / name / "reference" / "true_state.safetensors"
    run = subprocess.run([sys.executable, str(worker), str(dst), str(true_path), str(REPO / "fixtures"), str(out)], capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["checked"] > 0 and got["mismatched"] == []
    true = json.loads((DATA / name / "reference" / "true_state.json").read_text())
    for mine, ref in zip(got["groups"], true["param_groups"], strict=True):
        for k in ("lr", "weight_decay", "betas", "eps", "initial_lr"):
            assert mine[k] == ref[k], k


# --- output bounded against the source (RAVEX_MAX_EXPANSION) -------------------------------------


def test_a_conversion_writing_far_more_than_its_source_holds_is_refused_then_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.save({"w": torch.zeros(20 * 2**20)}, tmp_path / "zeros.pt")  # 80 MiB of zeros
    store = tmp_path / "store"
    assert run_ravex("convert", tmp_path / "zeros.pt", store, "--to", "native", "--compression", "zstd").returncode == 0
    held = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert held < 2**20  # zstd: a few KB stand for 80 MiB
    res = run_ravex("convert", store, tmp_path / "out.safetensors")
    assert res.returncode == 2, res.stderr
    assert "more than 64x" in res.stderr and "hint: if the checkpoint is genuine, allow it: RAVEX_MAX_EXPANSION=" in res.stderr
    assert not (tmp_path / "out.safetensors").exists()
    monkeypatch.setenv("RAVEX_MAX_EXPANSION", "100000")
    res = run_ravex("convert", store, tmp_path / "out.safetensors")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out.safetensors").stat().st_size > 80 * 2**20
