"""Lightning's DeepSpeed strategy: the ``last.ckpt/`` directory Lightning itself wrote on CPU
(fixtures lightning_ds2_ws2 and lightning_ds3_ws2, fixtures/_lightning_ds.py: ZeRO-2 and ZeRO-3 at
2 ranks, Tiny(groups=2) with a StepLR scheduler and the Counter callback, 6 steps).

Checked against Lightning's own converter (``convert_zero_checkpoint_to_fp32_state_dict``,
``reference/lightning_fp32.ckpt``) and the live state recorded at save time
(``reference/true_state.*``): the directory reads as one checkpoint holding Lightning's state;
weights and optimizer state are bit-exact; ``--layout lightning`` gives a ``.ckpt`` that
``load_from_checkpoint`` loads strictly and ``Trainer.fit(ckpt_path=...)`` resumes, one step on,
bit-identical to resuming from Lightning's converter output with the true optimizer state added
(the converter drops the optimizer, so its own output cannot be resumed: measured below). The
3-rank resume of a resharded directory under the DeepSpeed strategy is in
integration/test_lightning_ds_strategy.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _lightning_model import Counter, Tiny, loader
from conftest import DATA, inspect_json, run_ravex
from safetensors.torch import load_file
from test_lightning import assert_same_tree, quiet, same  # one definition of 'the same tree, bit for bit'

import ravex_convert
from ravex_convert import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

STAGES = [2, 3]
LIGHTNING_KEYS = ["epoch", "global_step", "loops", "callbacks", "lr_schedulers", "hparams_name", "hyper_parameters"]


def fixture(stage: int) -> Path:
    return DATA / f"lightning_ds{stage}_ws2"


def src(stage: int) -> Path:
    return fixture(stage) / "checkpoint" / "last.ckpt"


def truth(stage: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ref = fixture(stage) / "reference"
    return load_file(str(ref / "true_state.safetensors")), json.loads((ref / "true_state.json").read_text())


def lightning_fp32(stage: int) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(fixture(stage) / "reference" / "lightning_fp32.ckpt", weights_only=True)
    return loaded


@pytest.mark.parametrize("stage", STAGES)
def test_inspect_names_every_part(stage: int) -> None:
    info = ravex_convert.inspect(src(stage))
    assert (info.format, info.variant, info.world_size, info.zero_stage, info.step, info.tag) == \
        ("zero", f"lightning deepspeed zero{stage}", 2, stage, 6, "checkpoint")
    assert info.extra["lightning"] == {"version": L.__version__, "strategy": "deepspeed", "state": LIGHTNING_KEYS, "epoch": 1,
                                       "global_step": 6, "callbacks": ["Counter"], "lr_schedulers": 1}
    assert any("PyTorch Lightning's client state" in r and "DeepSpeed strategy" in r for r in info.reasons)
    assert any(n.startswith("Lightning DeepSpeed strategy") and ", ".join(LIGHTNING_KEYS) in n for n in info.notes)
    assert {t.name for t in info.model_tensors} == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert info.optimizer is not None and (info.optimizer.kind, info.optimizer.param_groups) == ("Adam", 2)
    shown = inspect_json(src(stage))  # the command, pointed at last.ckpt (the directory)
    assert shown["variant"] == f"lightning deepspeed zero{stage}" and shown["lightning"]["state"] == LIGHTNING_KEYS


@pytest.mark.parametrize("stage", STAGES)
def test_reads_bit_exact_against_lightning_and_the_true_state(stage: int) -> None:
    true, meta = truth(stage)
    got = ravex_convert.load_state_dict(src(stage), optimizer=True)
    theirs = lightning_fp32(stage)["state_dict"]
    assert assert_same_tree(dict(theirs), got["model"]) == 4  # Lightning's converter is right about the weights
    assert assert_same_tree({k[len("model/"):]: v for k, v in true.items() if k.startswith("model/")}, got["model"]) == 4
    state = got["optim"]["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        for name in meta["state_dict_keys"]:
            assert same(true[f"optim/{key}/{name}"], state[name][key]), (key, name)
    assert {n: [float(s["step"])] for n, s in state.items()} == meta["adam_step"]
    groups = got["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in meta["param_groups"]]
    assert [(g["lr"], g["weight_decay"], g["initial_lr"]) for g in groups] == \
        [(g["lr"], g["weight_decay"], g["initial_lr"]) for g in meta["param_groups"]]
    extra = ravex_convert.read_checkpoint(src(stage)).objects["extra"]
    assert (extra["epoch"], extra["global_step"], extra["hyper_parameters"]) == (meta["epoch"], meta["global_step"], meta["hyper_parameters"])
    assert extra["lr_schedulers"] == [meta["lr_scheduler_state"]]
    assert extra["loops"] == lightning_fp32(stage)["loops"]


def true_ckpt(stage: int, path: Path) -> Path:
    """Lightning's converter output with the true optimizer state added (by position, as
    Trainer.save_checkpoint writes it): the checkpoint Lightning's converter should have written."""
    true, meta = truth(stage)
    ckpt = lightning_fp32(stage)
    names = [n for g in meta["param_groups"] for n in g["params"]]
    state = {i: {"step": torch.tensor(meta["adam_step"][n][0]), "exp_avg": true[f"optim/exp_avg/{n}"],
                 "exp_avg_sq": true[f"optim/exp_avg_sq/{n}"]} for i, n in enumerate(names)}
    groups, i = [], 0
    for g in meta["param_groups"]:
        hyper = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    ckpt["optimizer_states"] = [{"state": state, "param_groups": groups}]
    torch.save(ckpt, path)
    return path


def trainer(steps: int) -> L.Trainer:
    return quiet(L.Trainer, max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                 enable_model_summary=False, callbacks=[Counter()])


def resumed(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], int]:
    """One more step from ``ckpt`` (global step 6) with Lightning's own resume, on CPU in this process."""
    module = Tiny(groups=2)
    t = trainer(7)
    quiet(t.fit, module, loader(), ckpt_path=ckpt)
    counter = next(c for c in t.callbacks if isinstance(c, Counter))  # type: ignore[attr-defined]
    return module.state_dict(), t.optimizers[0].state_dict(), counter.state_dict(), t.global_step


@pytest.mark.parametrize("stage", STAGES)
def test_as_a_lightning_ckpt_it_loads_and_resumes(stage: int, tmp_path: Path) -> None:
    true, meta = truth(stage)
    out = tmp_path / "out.ckpt"
    ravex_convert.convert(src(stage), out, "torch_save", writer={"layout": "lightning"})
    got = torch.load(out, weights_only=True)
    theirs = lightning_fp32(stage)
    # Lightning's state as Lightning's converter copied it (the callback's tensor bit for bit), the weights as it gave them
    # (a plain dict there, an OrderedDict here as Trainer.save_checkpoint writes it; both in DeepSpeed's param_shapes order, not the module's)
    assert assert_same_tree({k: theirs[k] for k in ["pytorch-lightning_version", *LIGHTNING_KEYS]},
                            {k: got[k] for k in ["pytorch-lightning_version", *LIGHTNING_KEYS]}) == 1
    assert list(got["state_dict"]) == list(theirs["state_dict"]) and assert_same_tree(theirs["state_dict"], dict(got["state_dict"])) == 4
    assert same(got["callbacks"]["Counter"]["total"], true["callbacks/Counter/total"])
    # the optimizer Lightning's converter drops, by position, against the true state
    optim = got["optimizer_states"][0]
    names = [n for g in meta["param_groups"] for n in g["params"]]
    assert [g["params"] for g in optim["param_groups"]] == [[0, 1], [2, 3]]
    for i, n in enumerate(names):
        assert same(optim["state"][i]["exp_avg"], true[f"optim/exp_avg/{n}"]) and same(optim["state"][i]["exp_avg_sq"], true[f"optim/exp_avg_sq/{n}"])
    module = quiet(Tiny.load_from_checkpoint, out)  # strict
    assert module.hparams["groups"] == 2
    assert assert_same_tree({k[len("model/"):]: v for k, v in true.items() if k.startswith("model/")}, dict(module.state_dict())) == 4
    ours, want = resumed(out), resumed(true_ckpt(stage, tmp_path / "true.ckpt"))
    assert ours[3] == want[3] == 7  # the loops were restored: one step on from 6
    assert assert_same_tree(want[0], ours[0]) == 4 and assert_same_tree(want[1], ours[1]) == 12 and assert_same_tree(want[2], ours[2]) == 1
    assert ours[2]["count"] == 7
    assert not any(same(theirs["state_dict"][k], v) for k, v in ours[0].items())  # and the step changed every weight


def test_lightnings_own_converter_output_cannot_resume() -> None:
    """The measured reason the comparison above adds the true optimizer state: the converter keeps no
    ``optimizer_states``, and Trainer.fit(ckpt_path=...) refuses its output."""
    assert "optimizer_states" not in lightning_fp32(2)
    with pytest.raises(KeyError, match="Trying to restore optimizer state but checkpoint contains only the model"):
        resumed(fixture(2) / "reference" / "lightning_fp32.ckpt")


@pytest.mark.parametrize("stage", STAGES)
def test_resharded_to_three_ranks_keeps_lightnings_state(stage: int, tmp_path: Path) -> None:
    """The DeepSpeed-strategy directory for 3 ranks: same tag layout, Lightning's client state in
    every model-states file, DeepSpeed's own scheduler slot None as Lightning saves it; read back,
    the state is the source's bit for bit (integration/test_lightning_ds_strategy.py resumes it)."""
    out = tmp_path / "last.ckpt"
    res = run_ravex("reshard", src(stage), out, "--world-size", "3")
    assert res.returncode == 0, res.stderr
    assert "lr_scheduler is None, as Lightning's DeepSpeed strategy saves it" in res.stderr
    assert (out / "latest").read_text() == "checkpoint"
    names = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)] if stage == 3 else ["mp_rank_00_model_states.pt"])
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == sorted(names + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)])
    source = torch.load(src(stage) / "checkpoint" / names[0].replace("_2_", "_0_").replace("_1_", "_0_"), weights_only=True)
    for name in names:
        ms = torch.load(out / "checkpoint" / name, weights_only=True)
        assert ms["lr_scheduler"] is None and ms["dp_world_size"] == 3
        assert assert_same_tree({k: source[k] for k in ["pytorch-lightning_version", *LIGHTNING_KEYS]},
                                {k: ms[k] for k in ["pytorch-lightning_version", *LIGHTNING_KEYS]}) == 1
    a, b = ravex_convert.load_state_dict(src(stage), optimizer=True), ravex_convert.load_state_dict(out, optimizer=True)
    assert assert_same_tree(a["model"], b["model"]) == 4 and assert_same_tree(a["optim"]["state"], b["optim"]["state"]) == 12
    assert ravex_convert.inspect(out).variant == f"lightning deepspeed zero{stage}"


@pytest.mark.parametrize("stage", STAGES)
def test_through_safetensors_and_a_ravex_store(stage: int, tmp_path: Path) -> None:
    """The weights as safetensors; through a Ravex store (at 3 ranks) and back to a .ckpt, Lightning's state and the optimizer kept."""
    true, _ = truth(stage)
    weights = {k[len("model/"):]: v for k, v in true.items() if k.startswith("model/")}
    assert run_ravex("convert", src(stage), tmp_path / "w.safetensors", "--to", "safetensors").returncode == 0
    assert assert_same_tree(weights, load_file(str(tmp_path / "w.safetensors"))) == 4
    ravex_convert.convert(src(stage), tmp_path / "store", "native", ravex_convert.ConvertOptions(world_size=3))
    ravex_convert.convert(tmp_path / "store", tmp_path / "out.ckpt", "torch_save", writer={"layout": "lightning"})
    direct = tmp_path / "direct.ckpt"
    ravex_convert.convert(src(stage), direct, "torch_save", writer={"layout": "lightning"})
    got, want = torch.load(tmp_path / "out.ckpt", weights_only=True), torch.load(direct, weights_only=True)
    keys = ["state_dict", "optimizer_states", "pytorch-lightning_version", *LIGHTNING_KEYS]
    assert assert_same_tree({k: want[k] for k in keys}, {k: got[k] for k in keys}) == 4 + 12 + 1


# ----------------------------------------------------------------------------
# bad input: one clear error, naming the file and the fix


def copy(tmp_path: Path, stage: int = 2) -> Path:
    return Path(shutil.copytree(src(stage), tmp_path / "last.ckpt"))


def assert_one_error(res: Any, code: int, *says: str) -> None:
    assert res.returncode == code, res.stderr
    assert res.stderr.count("error: ") == 1 and "hint: " in res.stderr and "Traceback" not in res.stderr, res.stderr
    for s in says:
        assert s in res.stderr, res.stderr


def test_latest_naming_a_missing_tag(tmp_path: Path) -> None:
    d = copy(tmp_path)
    (d / "latest").write_text("global_step9")
    with pytest.raises(IncompleteCheckpointError) as err:
        ravex_convert.read_checkpoint(d)
    assert err.value.message == f"{d / 'latest'}: names tag 'global_step9', but there is no directory {d / 'global_step9'}"
    assert_one_error(run_ravex("convert", d, tmp_path / "out.ckpt", "--to", "torch_save", "--layout", "lightning"), 5, str(d / "latest"), "--tag")
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("stage", STAGES)
def test_a_truncated_model_states_file(tmp_path: Path, stage: int) -> None:
    d = copy(tmp_path, stage)
    f = d / "checkpoint" / ("zero_pp_rank_1_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    f.write_bytes(f.read_bytes()[:3000])
    with pytest.raises(CorruptCheckpointError) as err:
        ravex_convert.read_checkpoint(d)
    assert err.value.path == str(f) and "truncated" in err.value.message
    assert_one_error(run_ravex("inspect", d), 6, str(f), "copy the file again")


def test_client_state_naming_a_class_outside_the_allow_list_is_refused(tmp_path: Path) -> None:
    """Lightning's client state goes through the restricted unpickler like the rest: a class it does
    not allow (Lightning's AttributeDict, which Lightning 2.6.6 turns into a plain dict before saving
    but an older save or a callback may hold) is refused, naming the file and the class, never imported."""
    from lightning.fabric.utilities.data import AttributeDict

    d = copy(tmp_path)
    f = d / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=False)  # the committed fixture, ours
    state["hyper_parameters"] = AttributeDict(state["hyper_parameters"])
    torch.save(state, f)
    with pytest.raises(UnsafeCheckpointError) as err:
        ravex_convert.read_checkpoint(d)
    assert err.value.message.startswith(f"{f}: the pickle names the global 'lightning.fabric.utilities.data.AttributeDict'")
    assert_one_error(run_ravex("convert", d, tmp_path / "out.ckpt", "--to", "torch_save"), 7, str(f), "torch.load(weights_only=False)")
    assert not (tmp_path / "out.ckpt").exists()
