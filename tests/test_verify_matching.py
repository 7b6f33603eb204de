"""``ravex verify`` matches the two sides' names by meaning, and says how: a wrapper's prefix on
one side only (DDP's ``module.``), an optimizer kept under ``optimizer`` and flattened (torchtitan)
against Ravex's ``optim``, and a torch.save optimizer keyed by position named by ``--param-names``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from conftest import DATA, run_ravex
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ravex_convert
from ravex_convert import ConvertOptions


def test_a_wrapper_prefix_on_one_side_is_matched_and_said(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(DATA / "safetensors_single" / "checkpoint" / "model.safetensors")
    torch.save({"module." + k: v for k, v in sd.items()}, tmp_path / "ddp.pt")
    res = ravex_convert.verify(DATA / "safetensors_single" / "checkpoint" / "model.safetensors", tmp_path / "ddp.pt")
    assert res.identical and res.compared == len(sd)
    assert res.matched == ["b's parameter names start with 'module.', a's have none: matched without the prefix"]
    shown = run_ravex("verify", DATA / "safetensors_single" / "checkpoint" / "model.safetensors", tmp_path / "ddp.pt")
    assert shown.returncode == 0 and "matched: b's parameter names start with 'module.'" in shown.stdout, shown.stdout + shown.stderr
    # a prefix and one tensor more: not matched, the difference is reported name by name
    torch.save({**{"module." + k: v for k, v in sd.items()}, "module.extra": torch.zeros(2)}, tmp_path / "more.pt")
    res = ravex_convert.verify(DATA / "safetensors_single" / "checkpoint" / "model.safetensors", tmp_path / "more.pt")
    assert not res.identical and res.only_in_b == len(sd) + 1 and not res.matched


def test_a_torchtitan_optimizer_against_ravex_optim(tmp_path: Path) -> None:
    """A flattened ``optimizer`` (torchtitan) against its torch_save conversion (``optim``): every
    tensor compared by parameter name, identical, and the layout said."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).pow(2).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "titan"))
    ravex_convert.convert(tmp_path / "titan", tmp_path / "state.pt", to="torch_save")
    res = ravex_convert.verify(tmp_path / "titan", tmp_path / "state.pt")
    assert res.identical and res.compared == 4 + 3 * 4, res.to_json()
    assert "a's optimizer state is under 'optimizer' (flattened): compared by parameter name" in res.matched
    # a second hop keeps it: the torch.save file's flattened optimizer is read back, and written flattened again
    ravex_convert.convert(tmp_path / "state.pt", tmp_path / "again.pt", to="torch_save")
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert set(again) >= {"model", "optimizer"} and "state.0.weight.exp_avg" in again["optimizer"]
    assert ravex_convert.verify(tmp_path / "titan", tmp_path / "again.pt").identical


def test_param_names_name_a_position_keyed_optimizer(tmp_path: Path) -> None:
    src = DATA / "torch_save" / "checkpoint" / "model.pt"
    groups = json.loads((DATA / "torch_save" / "reference" / "true_state.json").read_text())["param_groups"]
    (tmp_path / "names.txt").write_text("\n".join(n for g in groups for n in g["params"]) + "\n")
    ravex_convert.convert(src, tmp_path / "named.pt", to="torch_save", options=ConvertOptions(param_names=[n for g in groups for n in g["params"]]))
    refused = run_ravex("verify", src, tmp_path / "named.pt")
    assert refused.returncode == 8 and "--param-names" in refused.stderr, refused.stderr
    res = run_ravex("verify", src, tmp_path / "named.pt", "--param-names", tmp_path / "names.txt", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["identical"] and doc["compared"] == 42 + 3 * 37  # the 42 weights (the tied name among them), each parameter's 3 states
