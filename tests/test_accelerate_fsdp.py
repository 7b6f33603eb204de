"""An Accelerate ``save_state`` directory written under FSDP2, read and written as one checkpoint.

On the committed fixture fixtures/data/accelerate_fsdp2_ws2 (written at 2 ranks by
Accelerate itself: fixtures/_accelerate_fsdp.py): ``pytorch_model_fsdp_0/`` and
``optimizer_0/`` (two DCP checkpoints), ``scheduler.bin``, ``random_states_{0,1}.pkl``.
Judged against the live state recorded at the save (``reference/true_state.*``) and
against Accelerate's own merge tool (``reference/merged/model.safetensors``). That
Accelerate's ``load_state`` takes Ravex's 3-rank output is
integration/test_accelerate_fsdp_load.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA, run_ravex
from safetensors.torch import load_file

import ravex_convert
from ravex_convert import ConvertOptions
from ravex_convert._layout import SOURCE_KEY, StateLayout
from ravex_convert._output import Options
from ravex_convert.errors import CorruptCheckpointError, IncompleteCheckpointError, LayoutMismatchError
from ravex_convert.formats.dcp import writer as dcp_writer
from ravex_convert.model import MODEL, Checkpoint

FIXTURE = DATA / "accelerate_fsdp2_ws2"
STATE = FIXTURE / "checkpoint" / "state"
MERGED = FIXTURE / "reference" / "merged" / "model.safetensors"
TRUE = FIXTURE / "reference" / "true_state.safetensors"
TRUE_JSON = json.loads((FIXTURE / "reference" / "true_state.json").read_text())
FILES = sorted(TRUE_JSON["save_state_files"])


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def ws3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("acc_fsdp") / "state"
    return out, ravex_convert.convert(STATE, out, "accelerate", ConvertOptions(world_size=3))


def copy_state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    shutil.copytree(STATE, d)
    return d


# ---------------------------------------------------------------- reading


def test_inspect_names_every_part() -> None:
    info = ravex_convert.inspect(STATE)
    assert (info.format, info.variant, info.world_size, info.step) == ("accelerate", "FSDP save_state", 2, 3)
    assert sorted(f.path for f in info.files) == FILES  # every file save_state wrote, each with its role
    roles = {f.path: f.role for f in info.files}
    assert roles["pytorch_model_fsdp_0/__1_0.distcp"] == "weights (data)" and roles["optimizer_0/.metadata"] == "optimizer (metadata)"
    assert (roles["scheduler.bin"], roles["random_states_0.pkl"], roles["random_states_1.pkl"]) == ("scheduler", "carried", "carried")
    assert {t.name: t.shape for t in info.tensors if t.kind != "optim"} == {"gain": (1,), "scale": (7,), "proj.weight": (7, 5), "proj.bias": (7,)}
    assert sum(t.kind == "optim" for t in info.tensors) == 9
    assert info.optimizer is not None and info.optimizer.states == ["step", "exp_avg", "exp_avg_sq"]
    assert info.extra["carried"] == ["random_states_0.pkl", "random_states_1.pkl"]
    res = run_ravex("inspect", STATE)
    assert res.returncode == 0, res.stderr
    for part in FILES:
        assert part in res.stdout
    assert "accelerate (FSDP save_state)" in res.stdout


def test_read_is_the_live_state_and_what_merge_weights_writes() -> None:
    got = ravex_convert.load_state_dict(STATE, optimizer=True)
    true = load_file(str(TRUE))
    assert sorted(got["model"]) == sorted(TRUE_JSON["state_dict_keys"])
    assert bits_equal(got["model"], load_file(str(MERGED)))  # Accelerate's merge-weights
    flat = {f"model/{k}": v for k, v in got["model"].items()}
    flat |= {f"optim/{s}/{fqn}": v for fqn, per in got["optim"]["state"].items() for s, v in per.items()}
    assert bits_equal(flat, true)  # the weights, the buffer and every Adam state, as live at the save
    groups = got["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in TRUE_JSON["param_groups"]]
    assert [(g["lr"], g["weight_decay"], g["initial_lr"]) for g in groups] == [(g["lr"], g["weight_decay"], g["initial_lr"]) for g in TRUE_JSON["param_groups"]]
    ckpt = ravex_convert.read_checkpoint(STATE)
    assert ckpt.objects["lr_scheduler"] == TRUE_JSON["lr_scheduler_state"] | {"lr_lambdas": [None, None]}
    assert ckpt.step == 3 and ckpt.world_size == 2


def test_safetensors_output_is_merge_weights_bit_for_bit(tmp_path: Path) -> None:
    res = run_ravex("convert", STATE, tmp_path / "model.safetensors")
    assert res.returncode == 0, res.stderr
    assert bits_equal(load_file(str(tmp_path / "model.safetensors")), load_file(str(MERGED)))


# ---------------------------------------------------------------- writing


def test_three_rank_output_is_fsdp2_dcp_at_three_ranks(ws3: tuple[Path, dict[str, Any]]) -> None:
    import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata names)

    out, summary = ws3
    assert summary["left_out"] == [] and summary["world_size"] == 3
    assert any("rank(s) 2" in n and "Could not load random states" in n for n in summary["notes"])
    # the carried files back byte for byte; no RNG file for rank 2 (there is none to give it)
    for name in ("random_states_0.pkl", "random_states_1.pkl"):
        assert (out / name).read_bytes() == (STATE / name).read_bytes()
    assert not (out / "random_states_2.pkl").exists()
    for d in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (out / d).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    with open(out / "pytorch_model_fsdp_0" / ".metadata", "rb") as f:
        model_meta = pickle.load(f)  # Ravex's own output, unpickled by the test with torch's classes
    chunks = {k: [(list(c.offsets), list(c.sizes)) for c in m.chunks] for k, m in model_meta.state_dict_metadata.items()}
    assert chunks == {
        "model.gain": [([0], [1]), ([1], [0])],  # ranks 1 and 2 hold the same empty shard: recorded once, as DCP does
        # a buffer, which FSDP2 saves whole: a DCP does not say which tensors are buffers, so Ravex cuts it
        # as a parameter (DCP's loader reads any cut)
        "model.scale": [([0], [3]), ([3], [3]), ([6], [1])],
        "model.proj.weight": [([0, 0], [3, 5]), ([3, 0], [3, 5]), ([6, 0], [1, 5])],
        "model.proj.bias": [([0], [3]), ([3], [3]), ([6], [1])],
    }
    with open(out / "optimizer_0" / ".metadata", "rb") as f:
        optim_meta = pickle.load(f)
    keys = set(optim_meta.state_dict_metadata)
    assert {"optimizer.state.proj.weight.exp_avg", "optimizer.state.gain.step", "optimizer.param_groups.1.params"} <= keys
    assert all(k.startswith("optimizer.") for k in keys)
    assert [list(c.sizes) for c in optim_meta.state_dict_metadata["optimizer.state.proj.weight.exp_avg_sq"].chunks] == [[3, 5], [3, 5], [1, 5]]


def test_torch_reads_the_output_back_to_the_live_state(ws3: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, _ = ws3
    dcp_to_torch_save(out / "pytorch_model_fsdp_0", tmp_path / "m.pt")
    dcp_to_torch_save(out / "optimizer_0", tmp_path / "o.pt")
    model = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    optim = torch.load(tmp_path / "o.pt", weights_only=True)["optimizer"]
    flat = {f"model/{k}": v for k, v in model.items()} | {f"optim/{s}/{fqn}": v for fqn, per in optim["state"].items() for s, v in per.items()}
    assert bits_equal(flat, load_file(str(TRUE)))
    assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in TRUE_JSON["param_groups"]]
    assert [g["lr"] for g in optim["param_groups"]] == [g["lr"] for g in TRUE_JSON["param_groups"]]


def test_three_ranks_and_back_to_two_is_the_source(ws3: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, _ = ws3
    assert ravex_convert.read_checkpoint(out).world_size == 3
    back = tmp_path / "ws2"
    ravex_convert.convert(out, back, "accelerate", ConvertOptions(world_size=2))
    assert ravex_convert.verify(STATE, back).identical
    assert ravex_convert.load_state_dict(back, optimizer=True)["optim"]["param_groups"] == ravex_convert.load_state_dict(STATE, optimizer=True)["optim"]["param_groups"]
    sched = ravex_convert.read_checkpoint(back).objects["lr_scheduler"]
    assert sched == ravex_convert.read_checkpoint(STATE).objects["lr_scheduler"]


# ---------------------------------------------------------------- bad input


def test_missing_optimizer_metadata_is_named(tmp_path: Path) -> None:
    d = copy_state(tmp_path)
    (d / "optimizer_0" / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"optimizer_0/\.metadata: missing") as exc:
        ravex_convert.read_checkpoint(d)
    assert "copy optimizer_0/ again" in (exc.value.hint or "")
    res = run_ravex("inspect", d)
    assert res.returncode != 0 and "optimizer_0/.metadata: missing" in res.stderr and "hint:" in res.stderr


def test_truncated_data_file_is_named(tmp_path: Path) -> None:
    d = copy_state(tmp_path)
    f = d / "optimizer_0" / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"optimizer_0/__1_0\.distcp: the file is \d+ bytes") as exc:
        ravex_convert.read_checkpoint(d)
    assert "truncated" in (exc.value.hint or "")
    res = run_ravex("convert", d, tmp_path / "out.safetensors")
    assert res.returncode != 0 and "__1_0.distcp" in res.stderr and not (tmp_path / "out.safetensors").exists()


def test_missing_model_directory_is_named(tmp_path: Path) -> None:
    d = copy_state(tmp_path)
    shutil.rmtree(d / "pytorch_model_fsdp_0")
    with pytest.raises(IncompleteCheckpointError, match="optimizer_0/ without pytorch_model_fsdp_0/"):
        ravex_convert.read_checkpoint(d)


def test_optimizer_of_another_model_is_refused(tmp_path: Path) -> None:
    d = copy_state(tmp_path)
    src = ravex_convert.read_checkpoint(STATE)
    part = Checkpoint("dcp", STATE, source={SOURCE_KEY: StateLayout(("model",)).to_json()})
    part.tensors = {n: t for n, t in src.tensors.items() if n.startswith(MODEL) and n != MODEL + "proj.bias"}
    shutil.rmtree(d / "pytorch_model_fsdp_0")
    dcp_writer.write(part, d / "pytorch_model_fsdp_0", Options(world_size=2))
    with pytest.raises(LayoutMismatchError, match="the optimizer holds state for 'proj.bias', which pytorch_model_fsdp_0/ does not hold"):
        ravex_convert.read_checkpoint(d)


def test_a_dcp_of_other_state_is_refused(tmp_path: Path) -> None:
    d = copy_state(tmp_path)
    shutil.rmtree(d / "optimizer_0")
    shutil.copytree(d / "pytorch_model_fsdp_0", d / "optimizer_0")  # a model where the optimizer should be
    with pytest.raises(LayoutMismatchError, match="optimizer_0: holds 'model/gain', which Accelerate's save_fsdp_optimizer does not write"):
        ravex_convert.read_checkpoint(d)
