"""Accelerate ``save_state`` directories, written by the real Accelerate.

tests/_accelerate_train.py trains a small model with dropout and a LayerNorm
(so two biases share a shape and positions cannot be named by shape) on CPU,
saves its state after step 4 with ``accelerator.save_state`` and, beside it, the
live optimizer state by name and the parameter names in optimizer order. Ravex
reads the directory as one checkpoint; its output, through a Ravex store and
back, is loaded by ``accelerator.load_state`` and the run ends bit-identical to
Accelerate resuming its own directory (a control without random_states_0.pkl
does not).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_ravex
from safetensors.torch import load_file, save_file

import ravex_convert
from ravex_convert import ConvertOptions
from ravex_convert.errors import IncompleteCheckpointError, LayoutMismatchError

SCRIPT = Path(__file__).with_name("_accelerate_train.py")


def train(out: Path, resume: Path | None = None) -> dict[str, torch.Tensor]:
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-P", str(SCRIPT), str(out), "8", "4"] + ([str(resume)] if resume else [])
    res = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(str(out / "final.safetensors"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("acc") / "run"
    train(out)
    return out


@pytest.fixture(scope="module")
def acc_resumed(run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The reference: Accelerate loading its own save_state directory."""
    return train(tmp_path_factory.mktemp("acc_ref") / "run", run / "state")


def names(run: Path) -> list[str]:
    return (run / "param_names.txt").read_text().split()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_inspect_names_every_part(run: Path) -> None:
    info = ravex_convert.inspect(run / "state")
    assert (info.format, info.step) == ("accelerate", 4)  # saved after step 4: the optimizer's own count
    roles = {f.path: f.role for f in info.files}
    assert roles == {"model.safetensors": "weights", "optimizer.bin": "optimizer", "scheduler.bin": "scheduler",
                     "random_states_0.pkl": "carried"}
    assert info.optimizer is not None and info.optimizer.param_groups == 2


def test_shapes_that_do_not_decide_are_refused_not_guessed(run: Path, tmp_path: Path) -> None:
    ckpt = ravex_convert.read_checkpoint(run / "state")
    err = ckpt.source.get("optimizer_error")
    assert isinstance(err, LayoutMismatchError) and "shapes cannot name the positions" in err.message
    assert not any(n.startswith("optim/") for n in ckpt.tensors)
    res = run_ravex("convert", run / "state", tmp_path / "out", "--to", "native")
    assert res.returncode != 0 and "--param-names" in res.stderr and not (tmp_path / "out").exists()


def test_named_state_is_the_live_state(run: Path, tmp_path: Path) -> None:
    pn = tmp_path / "names.txt"
    pn.write_text((run / "param_names.txt").read_text())
    res = run_ravex("convert", run / "state", tmp_path / "out.pt", "--to", "torch_save", "--param-names", pn)
    assert res.returncode == 0, res.stderr
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    true = load_file(str(run / "true_state.safetensors"))
    assert equal({f"{s}/{fqn}": v for fqn, per in got["optim"]["state"].items() for s, v in per.items() if v.dim() > 0}, true)
    assert equal(got["model"], load_file(str(run / "state" / "model.safetensors")))
    assert got["lr_scheduler"] == torch.load(run / "state" / "scheduler.bin", weights_only=True)


def test_load_state_resumes_ravex_output_exactly(run: Path, acc_resumed: dict[str, torch.Tensor], tmp_path: Path) -> None:
    store, back = tmp_path / "store", tmp_path / "state"
    ravex_convert.convert(run / "state", store, to="native", options=ConvertOptions(param_names=names(run)))
    res = run_ravex("convert", store, back, "--to", "accelerate")
    assert res.returncode == 0, res.stderr
    assert (back / "random_states_0.pkl").read_bytes() == (run / "state" / "random_states_0.pkl").read_bytes()
    a, b = torch.load(run / "state" / "optimizer.bin", weights_only=True), torch.load(back / "optimizer.bin", weights_only=True)
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    assert equal(train(tmp_path / "resumed", back), acc_resumed)


def test_the_comparison_sees_a_lost_rng_state(run: Path, acc_resumed: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Control: without random_states_0.pkl the resume differs, so the test above checks the carried RNG."""
    ravex_convert.convert(run / "state", tmp_path / "state", to="accelerate", options=ConvertOptions(param_names=names(run)))
    (tmp_path / "state" / "random_states_0.pkl").unlink()
    assert not equal(train(tmp_path / "resumed", tmp_path / "state"), acc_resumed)


def test_unique_shapes_name_the_positions(tmp_path: Path) -> None:
    """Where every position's shape is one model tensor's, the names follow from the shapes alone."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 7))
    opt = torch.optim.Adam(reversed(list(model.parameters())))  # an order the sorted safetensors names do not give
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    d = tmp_path / "state"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save(opt.state_dict(), d / "optimizer.bin")
    ckpt = ravex_convert.read_checkpoint(d)
    by_name = dict(model.named_parameters())
    for (name, p) in by_name.items():
        assert ckpt.tensors[f"optim/exp_avg/{name}"].shape == p.shape
    ravex_convert.convert(d, tmp_path / "out.pt", to="torch_save")
    got = torch.load(tmp_path / "out.pt", weights_only=True)["optim"]["state"]
    for name, p in by_name.items():
        assert torch.equal(got[name]["exp_avg"], opt.state[p]["exp_avg"])


def test_fsdp_directory_without_its_metadata_is_named(tmp_path: Path) -> None:
    """An FSDP save_state directory is read as one checkpoint (tests/test_accelerate_fsdp.py); one
    whose model DCP lacks .metadata (a save that did not finish, a partial copy) is refused, naming it."""
    d = tmp_path / "state"
    (d / "pytorch_model_fsdp_0").mkdir(parents=True)
    (d / "random_states_0.pkl").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match=r"pytorch_model_fsdp_0/\.metadata: missing") as exc:
        ravex_convert.read_checkpoint(d)
    assert "copy pytorch_model_fsdp_0/ again" in (exc.value.hint or "")


def test_world_size_writes_the_fsdp_layout(run: Path, tmp_path: Path) -> None:
    """A plain save_state has no ranks: --world-size N writes the FSDP layout for N ranks, the
    same state, keyed by name (the positions named by --param-names)."""
    out = tmp_path / "state"
    ravex_convert.convert(run / "state", out, to="accelerate", options=ConvertOptions(param_names=names(run), world_size=2))
    assert sorted(p.name for p in out.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "scheduler.bin"]
    assert (out / "random_states_0.pkl").read_bytes() == (run / "state" / "random_states_0.pkl").read_bytes()
    assert ravex_convert.inspect(out).world_size == 2
    a = ravex_convert.load_state_dict(run / "state", optimizer=True, param_names=names(run))
    b = ravex_convert.load_state_dict(out, optimizer=True)
    assert equal(a["model"], b["model"])
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    assert all(equal(a["optim"]["state"][n], b["optim"]["state"][n]) for n in a["optim"]["state"])
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
