"""DCP checkpoints whose state is nested, as real programs save them.

PyTorch's DCP recipe saves ``dcp.save({"app": AppState(model, optimizer)})``,
AppState.state_dict() returning ``{"model": ..., "optim": ...}`` (so every key
starts with ``app.``); torchtitan saves ``"model"`` and ``"optimizer"`` with the
optimizer flattened (``flatten_optimizer_state_dict=True``), newer versions with
the model's keys at the top level. Each is made here with real torch, in one
process, and Ravex's outputs are loaded back with torch's own loaders
(``dcp.load`` into the real objects, ``torch.load(weights_only=True)``) and
compared bit for bit with the live state at save time. The recipe's state as one
torch.save file (PyTorch's ``dcp_to_torch_save``, or Ravex's own ``--to torch_save
--layout source``) keeps the nesting, and is read as its DCP is.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_ravex, run_without_torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import ravex_convert
from ravex_convert import read_checkpoint
from ravex_convert.errors import UnknownFormatError

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.LayerNorm(3))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
    return model, optimizer


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = make(0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 5, generator=gen)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


class AppState(Stateful):
    """The DCP recipe's wrapper (https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any] | None = None):
        self.model, self.optimizer = model, optimizer
        self.progress = progress if progress is not None else {"epoch": 0, "seen": [0, 0]}

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd, "progress": self.progress}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        self.progress = state_dict["progress"]


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # one process, no process group: torch warns
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


Live = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]


def live(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Live:
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    groups = [{k: (names[id(p)] for p in v) if k == "params" else v for k, v in g.items()} for g in optimizer.param_groups]
    return weights, state, [{k: list(v) if k == "params" else v for k, v in g.items()} for g in groups]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_live(model: torch.nn.Module, optimizer: torch.optim.Optimizer, want: Live) -> None:
    weights, state, groups = live(model, optimizer)
    assert weights.keys() == want[0].keys() and all(same(weights[k], want[0][k]) for k in weights)
    assert state.keys() == want[1].keys() and len(state) == 6
    for fqn, per in state.items():
        assert per.keys() == want[1][fqn].keys() == {"step", "exp_avg", "exp_avg_sq"}, fqn
        assert all(same(per[k], want[1][fqn][k]) for k in per), fqn
    assert groups == want[2] and [g["weight_decay"] for g in groups] == [0.1, 0.0]


@pytest.fixture
def recipe(tmp_path: Path) -> tuple[Path, Any]:
    model, optimizer = trained()
    path = tmp_path / "recipe"
    quiet(dcp.save, {"app": AppState(model, optimizer, {"epoch": 3, "seen": [12, 7]}), "epoch": 3}, checkpoint_id=str(path))
    return path, live(model, optimizer)


def load_recipe(path: Path) -> tuple[AppState, dict[str, Any]]:
    model, optimizer = make(99)  # other weights: whatever is not loaded shows
    app = AppState(model, optimizer)
    state: dict[str, Any] = {"app": app, "epoch": 0}
    quiet(dcp.load, state, checkpoint_id=str(path))
    return app, state


def test_the_recipe_checkpoint_is_what_these_tests_assume(recipe: tuple[Path, Any]) -> None:
    md = FileSystemReader(str(recipe[0])).read_metadata()
    assert md.planner_data["app.model.0.weight"] == ("app", "model", "0.weight")
    assert md.planner_data["app.optim.state.0.weight.exp_avg"] == ("app", "optim", "state", "0.weight", "exp_avg")
    assert md.planner_data["app.optim.param_groups.1.lr"] == ("app", "optim", "param_groups", 1, "lr")
    assert not any(k.startswith(("model.", "optim.")) for k in md.state_dict_metadata)


def test_inspect_finds_the_model_and_optimizer_under_app(recipe: tuple[Path, Any]) -> None:
    res = run_ravex("inspect", recipe[0], "--json", "--tensors")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["num_tensors"] == 6 and info["num_params"] == 5 * 7 + 7 + 7 * 3 + 3 + 3 + 3
    assert info["optimizer"]["kind"] == "Adam" and info["step"] == 3
    assert info["state_layout"] == {"model": "app.model", "optimizer": "app.optim", "optimizer_form": "nested"}
    assert {t["name"] for t in info["tensors"] if t["kind"] == "param"} == set(recipe[1][0])
    table = run_ravex("inspect", recipe[0])
    assert "6 (72 parameters)" in table.stdout and "model state dict at 'app.model', optimizer at 'app.optim'" in table.stderr


def test_to_safetensors_writes_every_weight(recipe: tuple[Path, Any], tmp_path: Path) -> None:
    res = run_ravex("convert", recipe[0], tmp_path / "w.safetensors", "--to", "safetensors")
    assert res.returncode == 0, res.stderr
    got = load_file(tmp_path / "w.safetensors")
    assert got.keys() == recipe[1][0].keys() and all(same(got[k], v) for k, v in recipe[1][0].items())


def test_to_torch_save_keeps_the_nesting(recipe: tuple[Path, Any], tmp_path: Path) -> None:
    res = run_ravex("convert", recipe[0], tmp_path / "out.pt", "--to", "torch_save")
    assert res.returncode == 0, res.stderr
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(sd) >= {"app", "epoch"} and sd["epoch"] == 3
    assert set(sd["app"]) == {"model", "optim", "progress"} and sd["app"]["progress"] == {"epoch": 3, "seen": [12, 7]}
    weights, state, _ = recipe[1]
    assert all(same(sd["app"]["model"][k], v) for k, v in weights.items()) and sd["app"]["model"].keys() == weights.keys()
    osd = sd["app"]["optim"]
    assert osd["state"].keys() == state.keys()
    assert all(same(osd["state"][f][k], v) for f, per in state.items() for k, v in per.items())
    assert [g["params"] for g in osd["param_groups"]] == [["0.weight", "2.weight", "3.weight"], ["0.bias", "2.bias", "3.bias"]]
    # what a user then does with it: the optimizer state goes back into fresh objects
    model, optimizer = make(99)
    set_state_dict(model, optimizer, model_state_dict=sd["app"]["model"], optim_state_dict=osd)
    assert_live(model, optimizer, recipe[1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reshard_loads_into_the_app_state(recipe: tuple[Path, Any], tmp_path: Path, world_size: int) -> None:
    out = tmp_path / "out"
    res = run_ravex("reshard", recipe[0], out, "--world-size", str(world_size))
    assert res.returncode == 0, res.stderr
    src, dst = FileSystemReader(str(recipe[0])).read_metadata(), FileSystemReader(str(out)).read_metadata()
    assert set(dst.state_dict_metadata) == set(src.state_dict_metadata)
    assert dst.planner_data == src.planner_data
    app, state = load_recipe(out)
    assert_live(app.model, app.optimizer, recipe[1])
    assert state["epoch"] == 3 and app.progress == {"epoch": 3, "seen": [12, 7]}
    assert ravex_convert.verify(recipe[0], out).identical


def test_a_chain_of_reshards_and_convert_to_dcp(recipe: tuple[Path, Any], tmp_path: Path) -> None:
    """1 -> 3 ranks -> 2 ranks (reading Ravex's own dim-0 shards of a nested state) -> convert --to dcp."""
    ravex_convert.reshard(recipe[0], tmp_path / "r3", 3)
    ravex_convert.reshard(tmp_path / "r3", tmp_path / "r2", 2)
    ravex_convert.convert(tmp_path / "r2", tmp_path / "c", "dcp")
    for path in ("r3", "r2", "c"):
        app, state = load_recipe(tmp_path / path)
        assert_live(app.model, app.optimizer, recipe[1])
        assert state["epoch"] == 3
    back = read_checkpoint(tmp_path / "r2")
    assert back.source["state_layout"] == {"model": ["app", "model"], "optim": ["app", "optim"], "optim_flat": False}


def test_any_depth(tmp_path: Path) -> None:
    model, optimizer = trained()
    msd, osd = get_state_dict(model, optimizer)
    quiet(dcp.save, {"runs": {"main": {"model": msd, "optim": osd}}, "seed": 7}, checkpoint_id=str(tmp_path / "src"))
    want = live(model, optimizer)
    ravex_convert.reshard(tmp_path / "src", tmp_path / "out", 2)
    fresh, opt = make(99)
    m2, o2 = get_state_dict(fresh, opt)
    target: dict[str, Any] = {"runs": {"main": {"model": m2, "optim": o2}}, "seed": 0}
    quiet(dcp.load, target, checkpoint_id=str(tmp_path / "out"))
    set_state_dict(fresh, opt, model_state_dict=m2, optim_state_dict=o2)
    assert_live(fresh, opt, want)
    assert target["seed"] == 7
    assert ravex_convert.inspect(tmp_path / "src").extra["state_layout"]["model"] == "runs.main.model"


@pytest.mark.parametrize("top_level_model", [False, True])
def test_torchtitan_layout_keeps_its_keys(tmp_path: Path, top_level_model: bool) -> None:
    """torchtitan: "model" (or, since 2025, the model's keys at the top level), a flattened
    "optimizer", "lr_scheduler" and "train_state"; a reshard gives back every key as it was
    (never "optim"), and torchtitan's way of loading works on it."""
    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    for _ in range(2):
        quiet(scheduler.step)  # after the optimizer's steps in trained(): torch's order warning does not apply
    msd, osd = get_state_dict(model, optimizer, options=FLAT)
    state: dict[str, Any] = {"optimizer": osd, "lr_scheduler": scheduler.state_dict(), "train_state": {"step": 3, "ntokens_seen": torch.tensor(96)}}
    state.update(msd if top_level_model else {"model": msd})
    quiet(dcp.save, state, checkpoint_id=str(tmp_path / "src"))
    want = live(model, optimizer)
    res = run_ravex("reshard", tmp_path / "src", tmp_path / "out", "--world-size", "2")
    assert res.returncode == 0, res.stderr
    src, dst = FileSystemReader(str(tmp_path / "src")).read_metadata(), FileSystemReader(str(tmp_path / "out")).read_metadata()
    assert set(dst.state_dict_metadata) == set(src.state_dict_metadata)
    assert dst.planner_data == src.planner_data
    assert "optimizer.state.0.weight.exp_avg" in dst.state_dict_metadata and not any(k.startswith("optim.") for k in dst.state_dict_metadata)
    fresh, opt = make(99)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    m2, o2 = get_state_dict(fresh, opt, options=FLAT)
    target: dict[str, Any] = {"optimizer": o2, "lr_scheduler": sched.state_dict(), "train_state": {"step": 0, "ntokens_seen": torch.tensor(0)}}
    target.update(m2 if top_level_model else {"model": m2})
    quiet(dcp.load, target, checkpoint_id=str(tmp_path / "out"))
    set_state_dict(fresh, opt, model_state_dict=m2, optim_state_dict=o2, options=FLAT)
    assert_live(fresh, opt, want)
    assert target["train_state"]["step"] == 3 and int(target["train_state"]["ntokens_seen"]) == 96
    assert target["lr_scheduler"]["last_epoch"] == scheduler.state_dict()["last_epoch"] == 2
    info = ravex_convert.inspect(tmp_path / "src")
    assert info.extra["state_layout"] == {"model": "(top level)" if top_level_model else "model", "optimizer": "optimizer", "optimizer_form": "flattened"}
    assert info.num_params == 72 and info.optimizer is not None and info.optimizer.kind == "Adam"


def test_layout_torchtitan_writes_torchtitans_keys_from_another_layout(tmp_path: Path) -> None:
    """A DCP in the recipe's portable keys ({"model", "optim"}) converted with --layout torchtitan:
    "model" and a flattened "optimizer", which torchtitan's way of loading takes."""
    model, optimizer = trained()
    msd, osd = get_state_dict(model, optimizer)
    quiet(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "src"))
    want = live(model, optimizer)
    res = run_ravex("convert", tmp_path / "src", tmp_path / "out", "--to", "dcp", "--layout", "torchtitan")
    assert res.returncode == 0, res.stderr
    keys = set(FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata)
    assert "optimizer.state.0.weight.exp_avg" in keys and not any(k.startswith("optim.") for k in keys)
    fresh, opt = make(99)
    m2, o2 = get_state_dict(fresh, opt, options=FLAT)
    quiet(dcp.load, {"model": m2, "optimizer": o2}, checkpoint_id=str(tmp_path / "out"))
    set_state_dict(fresh, opt, model_state_dict=m2, optim_state_dict=o2, options=FLAT)
    assert_live(fresh, opt, want)
    res = run_ravex("convert", tmp_path / "src", tmp_path / "bad", "--to", "dcp", "--layout", "lightning")
    assert res.returncode != 0 and "not a dcp layout" in res.stderr and not (tmp_path / "bad").exists()


def test_dcp_to_torch_save_keeps_scheduler_dicts(tmp_path: Path) -> None:
    """Non-tensor state comes back as the dicts it was (``scheduler.load_state_dict`` works), not as
    ``lr_scheduler/last_epoch`` keys at the top."""
    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    msd, osd = get_state_dict(model, optimizer)
    quiet(dcp.save, {"model": msd, "optim": osd, "lr_scheduler": scheduler.state_dict()}, checkpoint_id=str(tmp_path / "src"))
    ravex_convert.convert(tmp_path / "src", tmp_path / "out.pt", "torch_save")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sd["lr_scheduler"] == scheduler.state_dict()
    assert not any("/" in k for k in sd)


# ---------------------------------------------------------------- the recipe's state as one torch.save file


@pytest.fixture(params=["dcp_to_torch_save", "ravex"])
def nested_pt(request: pytest.FixtureRequest, recipe: tuple[Path, Any], tmp_path: Path) -> Path:
    """The recipe DCP as one torch.save file, written by PyTorch's format_utils or by
    Ravex (``--to torch_save --layout source``): ``{"app": {"model", "optim", "progress"}, "epoch"}``."""
    pt = tmp_path / "recipe.pt"
    if request.param == "dcp_to_torch_save":
        quiet(dcp_to_torch_save, recipe[0], pt)
    else:
        ravex_convert.convert(recipe[0], pt, "torch_save", writer={"layout": "source"})
    return pt


def test_nested_torch_save_inspect_finds_the_model_and_optimizer_under_app(recipe: tuple[Path, Any], nested_pt: Path) -> None:
    weights, state, _ = recipe[1]
    held = torch.load(nested_pt, weights_only=True)
    assert list(held) == ["app", "epoch"] and list(held["app"]) == ["model", "optim", "progress"]
    # the optimizer as get_state_dict gave it to dcp.save: keyed by parameter name, not position
    assert set(held["app"]["optim"]["state"]) == set(state)
    assert [g["params"] for g in held["app"]["optim"]["param_groups"]] == [["0.weight", "2.weight", "3.weight"], ["0.bias", "2.bias", "3.bias"]]
    doc = json.loads(run_without_torch("import sys, json, ravex_convert\n"
                                       "print(json.dumps(ravex_convert.inspect(sys.argv[1]).to_json(tensors=True)))", str(nested_pt)))
    assert doc["format"] == "torch_save" and doc["step"] == 3 and doc["num_params"] == 72
    assert doc["state_layout"] == {"model": "app.model", "optimizer": "app.optim", "optimizer_form": "nested"}
    assert doc["model_key"] == "app.model" and doc["optimizer_key"] == "app.optim" and doc["optimizer"]["kind"] == "Adam"
    assert "model state dict at 'app.model', optimizer at 'app.optim'" in doc["reasons"]
    assert {t["name"] for t in doc["tensors"] if t["kind"] == "param"} == set(weights)
    assert {t["name"] for t in doc["tensors"] if t["kind"] == "optim"} == {f"optim.{k}/{f}" for f, per in state.items() for k in per}


def test_nested_torch_save_to_safetensors_is_the_live_weights(recipe: tuple[Path, Any], nested_pt: Path, tmp_path: Path) -> None:
    ravex_convert.convert(nested_pt, tmp_path / "w.safetensors", "safetensors")
    got = load_file(tmp_path / "w.safetensors")
    assert got.keys() == recipe[1][0].keys() and all(same(got[k], v) for k, v in recipe[1][0].items())


def test_nested_torch_save_to_torch_save_and_dcp_keeps_the_nesting(recipe: tuple[Path, Any], nested_pt: Path, tmp_path: Path) -> None:
    ravex_convert.convert(nested_pt, tmp_path / "out.pt", "torch_save")  # --layout source, the default
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(sd) == ["app", "epoch"] and sd["epoch"] == 3 and list(sd["app"]) == ["model", "optim", "progress"]
    model, optimizer = make(99)
    app = AppState(model, optimizer)
    app.load_state_dict(sd["app"])  # the AppState's own loading
    assert_live(model, optimizer, recipe[1])
    assert app.progress == {"epoch": 3, "seen": [12, 7]}
    # and back to a DCP with the recipe's own keys, which dcp.load reads into the AppState
    ravex_convert.convert(nested_pt, tmp_path / "dcp", "dcp")
    assert FileSystemReader(str(tmp_path / "dcp")).read_metadata().planner_data == FileSystemReader(str(recipe[0])).read_metadata().planner_data
    app, state = load_recipe(tmp_path / "dcp")
    assert_live(app.model, app.optimizer, recipe[1])
    assert state["epoch"] == 3 and app.progress == {"epoch": 3, "seen": [12, 7]}


def test_verify_nested_torch_save_against_its_dcp_and_the_live_state(recipe: tuple[Path, Any], nested_pt: Path, tmp_path: Path) -> None:
    res = run_ravex("verify", recipe[0], nested_pt)
    assert res.returncode == 0 and "identical: 24 tensors, 222 elements bit-identical" in res.stdout, res.stdout + res.stderr
    # read as its DCP is read: the same tensors, the same other state at its nesting (once), the same layout
    from_dcp, from_pt = read_checkpoint(recipe[0]), read_checkpoint(nested_pt)
    assert from_pt.tensors.keys() == from_dcp.tensors.keys() and from_pt.step == from_dcp.step == 3
    assert from_pt.objects == from_dcp.objects and from_pt.objects["extra"] == {"app": {"progress": {"epoch": 3, "seen": [12, 7]}}, "epoch": 3}
    assert from_pt.source["state_layout"] == from_dcp.source["state_layout"]
    weights, state, groups = recipe[1]
    torch.save({"model": weights, "optim": {"state": state, "param_groups": groups}}, tmp_path / "live.pt")
    assert ravex_convert.verify(tmp_path / "live.pt", nested_pt).identical
    held = torch.load(nested_pt, weights_only=True)
    held["app"]["optim"]["state"]["2.weight"]["exp_avg"].view(torch.int32)[1, 4] ^= 1
    torch.save(held, tmp_path / "flipped.pt")
    diffs = ravex_convert.verify(recipe[0], tmp_path / "flipped.pt").differences
    assert [(d.name, d.kind, d.count, d.first_index) for d in diffs] == [("optim.exp_avg/2.weight", "values", 1, [1, 4])]


def test_nested_torch_save_at_depth_two(tmp_path: Path) -> None:
    model, optimizer = trained()
    msd, osd = get_state_dict(model, optimizer)
    quiet(dcp.save, {"runs": {"main": {"model": msd, "optim": osd}}, "seed": 7}, checkpoint_id=str(tmp_path / "src"))
    quiet(dcp_to_torch_save, tmp_path / "src", tmp_path / "src.pt")
    want = live(model, optimizer)
    info = ravex_convert.inspect(tmp_path / "src.pt")
    assert info.extra["state_layout"] == {"model": "runs.main.model", "optimizer": "runs.main.optim", "optimizer_form": "nested"}
    assert ravex_convert.verify(tmp_path / "src", tmp_path / "src.pt").identical
    ravex_convert.convert(tmp_path / "src.pt", tmp_path / "out.pt", "torch_save")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(sd) == ["runs", "seed"] and sd["seed"] == 7 and list(sd["runs"]) == ["main"] and list(sd["runs"]["main"]) == ["model", "optim"]
    fresh, opt = make(99)
    set_state_dict(fresh, opt, model_state_dict=sd["runs"]["main"]["model"], optim_state_dict=sd["runs"]["main"]["optim"])
    assert_live(fresh, opt, want)


def test_a_nested_torch_save_without_a_model_is_refused(recipe: tuple[Path, Any], tmp_path: Path) -> None:
    """Nested state with no model anywhere: the optimizer alone (its tensors are no model), or no tensor at all."""
    _, state, groups = recipe[1]
    for name, held in (("optim_only.pt", {"app": {"optim": {"state": state, "param_groups": groups}, "progress": {"epoch": 3}}, "epoch": 3}),
                       ("no_tensors.pt", {"app": {"progress": {"epoch": 3, "seen": [12, 7]}}, "epoch": 3})):
        torch.save(held, tmp_path / name)
        with pytest.raises(UnknownFormatError) as exc:
            ravex_convert.convert(tmp_path / name, tmp_path / "out.safetensors", "safetensors")
        assert exc.value.message == (f"{tmp_path / name}: a torch.save file, but no model state dict found in it, "
                                     "at the top level ('app', 'epoch') or nested below it")
        assert exc.value.hint is not None and "dcp_to_torch_save" in exc.value.hint and not (tmp_path / "out.safetensors").exists()
    res = run_ravex("inspect", tmp_path / "optim_only.pt")
    assert res.returncode == 4 and res.stderr.startswith(f"error: {tmp_path / 'optim_only.pt'}: a torch.save file, but no model state dict"), res.stderr
