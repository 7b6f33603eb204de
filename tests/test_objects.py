"""One schema for the small state, and a kind per model tensor.

The well-known ``objects`` keys are defined once (ravex_convert/objects.py)
and docs/format.md lists the same; readers refuse a key holding the wrong
thing; DeepSpeed's loss scaler and the AMP GradScaler are distinct keys; what
each model tensor is (parameter, frozen, buffer) travels with the checkpoint,
so a conversion to ZeRO-3 needs no --buffers where the source said.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import DATA, REPO

from ravex_convert import ConvertOptions, convert, read_checkpoint
from ravex_convert.errors import CorruptCheckpointError, LayoutMismatchError
from ravex_convert.formats.native import reader as native
from ravex_convert.model import BUFFER, FROZEN, MODEL, PARAMETER
from ravex_convert.objects import KEYS, check, key_of
from ravex_convert.storage.local import remove_tree


def test_format_md_lists_exactly_the_schema() -> None:
    text = (REPO / "docs" / "format.md").read_text()
    section = text[text.index("## 13. Objects"):text.index("## 14.")]
    listed = re.findall(r"^\| `([^`]+)` \|", section, re.MULTILINE)
    assert listed == [k.name for k in KEYS]


@pytest.mark.parametrize("name", ["zero3_ws2_bf16", "zero1_ws2_fp32", "fsdp2_ws2", "torch_save", "bf16opt_ws2"])
def test_every_reader_produces_state_the_schema_accepts(name: str) -> None:
    ckpt = read_checkpoint(DATA / name / "checkpoint")
    check(ckpt.objects, name)
    assert all(key_of(k) is not None for k in ckpt.objects), sorted(ckpt.objects)


def test_a_well_known_key_holding_the_wrong_thing_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "s"
    convert(DATA / "zero2_ws2_fp32" / "checkpoint", store, "native")
    doc_path = next(store.glob("checkpoints/*/checkpoint.json"))
    doc = json.loads(doc_path.read_text())
    doc["objects"]["optim.param_groups"] = "all of them"
    doc_path.write_text(json.dumps(doc))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["checkpoints"][0].pop("metadata_checksum")  # so that the schema, not the checksum, is what speaks
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"objects\['optim.param_groups'\] should be a list of dicts"):
        native.read(store)


def test_deepspeed_says_what_each_tensor_is_and_the_store_keeps_it(tmp_path: Path) -> None:
    src = DATA / "zero3_ws2_fp32" / "checkpoint"
    ckpt = read_checkpoint(src)
    kinds = {n[len(MODEL):]: t.kind for n, t in ckpt.tensors.items() if n.startswith(MODEL)}
    trained = {n.split("/", 2)[2] for n in ckpt.tensors if n.startswith("optim/")}
    assert {n for n, k in kinds.items() if k == PARAMETER} == trained
    assert {k for k in kinds.values()} == {PARAMETER, FROZEN, BUFFER}  # this fixture has all three
    convert(src, tmp_path / "s", "native", ConvertOptions(world_size=2))
    back = read_checkpoint(tmp_path / "s")
    assert {n[len(MODEL):]: t.kind for n, t in back.tensors.items() if n.startswith(MODEL)} == kinds


def test_a_store_becomes_zero3_without_buffers_being_listed(tmp_path: Path) -> None:
    """Before kinds were recorded, a store (or any non-DeepSpeed source) with frozen
    parameters and buffers needed --buffers for ZeRO-3; now the store says."""
    src = DATA / "zero3_ws2_fp32" / "checkpoint"
    convert(src, tmp_path / "s", "native", ConvertOptions(world_size=2))
    convert(tmp_path / "s", tmp_path / "via-store", "zero", ConvertOptions(world_size=3), writer={"zero_stage": 3})
    convert(src, tmp_path / "direct", "zero", ConvertOptions(world_size=3), writer={"zero_stage": 3})
    a, b = read_checkpoint(tmp_path / "via-store"), read_checkpoint(tmp_path / "direct")
    assert {n: t.kind for n, t in a.tensors.items()} == {n: t.kind for n, t in b.tensors.items()}
    # and a store that does not say (its kinds removed) still asks for them
    doc_path = next((tmp_path / "s").glob("checkpoints/*/checkpoint.json"))
    doc = json.loads(doc_path.read_text())
    doc.pop("kinds")
    doc_path.write_text(json.dumps(doc))
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["checkpoints"][0].pop("metadata_checksum")
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    remove_tree(tmp_path / "again")
    with pytest.raises(LayoutMismatchError, match="are buffers and which frozen parameters"):
        convert(tmp_path / "s", tmp_path / "again", "zero", ConvertOptions(world_size=3), writer={"zero_stage": 3})


def test_deepspeeds_loss_scaler_is_not_a_grad_scaler() -> None:
    ckpt = read_checkpoint(DATA / "zero2_ws2_fp32" / "checkpoint")
    assert "loss_scaler" in ckpt.objects and "cur_scale" in ckpt.objects["loss_scaler"]
    assert "grad_scaler" not in ckpt.objects
    from ravex_runtime.checking import _grad_scalers

    assert _grad_scalers(ckpt.objects) == {}
    legacy = {"loss_scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 3}}
    assert _grad_scalers(legacy) == {"grad_scaler": legacy["loss_scaler"]}  # a store Ravex 0.1 wrote
