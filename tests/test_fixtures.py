"""Every bundled fixture (written by the real programs) is recognised with the
right format, stage, world size, precision and step, and what inspect reports
agrees with the state recorded at save time (reference/true_state.json)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, FIXTURES, FRAMEWORK_FIXTURES, inspect_json

from ravex_convert.formats.safetensors import read_header

# name -> (format, variant, zero_stage, world_size, step, precision)
EXPECTED: dict[str, tuple[str, str, int | None, int, int | None, str | None]] = {
    "zero1_ws2_fp32": ("zero", "zero1", 1, 2, 3, "fp32"),
    "zero2_ws2_fp32": ("zero", "zero2", 2, 2, 3, "fp32"),
    "zero3_ws2_fp32": ("zero", "zero3", 3, 2, 3, "fp32"),
    "zero1_ws3_fp32": ("zero", "zero1", 1, 3, 3, "fp32"),
    "zero2_ws3_fp32": ("zero", "zero2", 2, 3, 3, "fp32"),
    "zero3_ws3_fp32": ("zero", "zero3", 3, 3, 3, "fp32"),
    "zero1_ws2_bf16": ("zero", "zero1", 1, 2, 3, "bf16"),
    "zero2_ws2_bf16": ("zero", "zero2", 2, 2, 3, "bf16"),
    "zero3_ws2_bf16": ("zero", "zero3", 3, 2, 3, "bf16"),
    "zero3_ws3_bf16": ("zero", "zero3", 3, 3, 3, "bf16"),
    "bf16opt_ws2": ("zero", "bf16_optimizer", 1, 2, 3, "bf16"),
    "zero2e_ws2_fp32": ("zero", "zero2", 2, 2, 3, "fp32"),
    "zero1e_ws3_bf16": ("zero", "zero1", 1, 3, 3, "bf16"),
    "zero3sg_ws3_bf16": ("zero", "zero3", 3, 3, 3, "bf16"),
    "zero3sg_ws2_fp32": ("zero", "zero3", 3, 2, 3, "fp32"),
    "fsdp2_ws2": ("dcp", "sharded", None, 2, 3, None),
    "fsdp2_ws3": ("dcp", "sharded", None, 3, 3, None),
    "torch_save": ("torch_save", "training_state", None, 1, 3, None),
    "safetensors_single": ("safetensors", "single", None, 1, None, None),
    "safetensors_sharded": ("safetensors", "sharded", None, 1, None, None),
}


def test_every_fixture_is_present_and_expected() -> None:
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(EXPECTED.keys() | FRAMEWORK_FIXTURES)


def test_manifest_checksums() -> None:
    lines = (FIXTURES / "MANIFEST.sha256").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, name = line.split(maxsplit=1)
        listed[name.lstrip("*")] = digest
    on_disk = sorted(str(p.relative_to(FIXTURES)) for p in DATA.rglob("*") if p.is_file())
    assert sorted(listed) == on_disk
    for name, digest in listed.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


def _target(name: str) -> Path:
    ckpt = DATA / name / "checkpoint"
    files = list(ckpt.iterdir())
    # a single-file fixture is inspected as the file a user would point at
    return files[0] if len(files) == 1 and files[0].is_file() else ckpt


def _true(name: str) -> dict[str, Any]:
    return json.loads((DATA / name / "reference" / "true_state.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_detection(name: str) -> None:
    fmt, variant, stage, ws, step, precision = EXPECTED[name]
    info = inspect_json(_target(name), "--tensors")
    assert (info["format"], info["variant"], info["zero_stage"], info["world_size"], info["step"]) == (fmt, variant, stage, ws, step)
    if precision is not None:
        assert info["precision"] == precision
    true = _true(name)
    assert info["world_size"] == true["world_size"]
    if fmt == "zero":
        assert info["zero_stage"] == true["zero_stage"] and info["tag"] == true["tag"] == "global_step3"
        assert info["step"] == true["global_step"]
        assert (info["variant"] == "bf16_optimizer") == (true["optimizer_variant"] == "bf16_optimizer")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_tensors_match_true_state(name: str) -> None:
    info = inspect_json(_target(name), "--tensors")
    true = _true(name)
    shapes = {k: list(v) for k, v in true["shapes"].items()}
    model = {t["name"]: t for t in info["tensors"] if t["kind"] != "optim"}
    aliases = info["aliases"]
    reported = set(model) | set(aliases)
    tied_second_names = {pair[1] for pair in true["tied_aliases"]}
    if info["format"] == "safetensors":
        # safetensors refuses shared storage: the writer dropped the tied
        # duplicate (and recorded no alias); every other entry is there.
        assert set(shapes) - reported == tied_second_names
    else:
        assert sorted(reported) == sorted(shapes)
    for tname, t in model.items():
        assert t["shape"] == shapes[tname], tname
    for alias, target in aliases.items():
        assert sorted([alias, target]) in [sorted(pair) for pair in true["tied_aliases"]]
    if info["format"] == "zero":
        # DeepSpeed records which entries are parameters (param_shapes, frozen
        # shapes) and which are tied: the count is exact.
        assert info["num_params"] == true["n_param_elements"]
        assert set(info["frozen"]) == set(true["frozen_params"])
    else:
        # A plain state dict does not mark buffers or ties: every stored
        # floating-point tensor counts, and inspect says so.
        assert info["num_params"] == sum(_numel(t["shape"]) for t in model.values())
        assert any("not distinguished" in n for n in info["notes"])
    if info["format"] in ("zero", "dcp", "torch_save"):
        assert info["optimizer"]["kind"] == "Adam"
        assert {"exp_avg", "exp_avg_sq"} <= set(info["optimizer"]["states"])
    else:
        assert info["optimizer"] is None


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if EXPECTED[n][0] == "zero"))
def test_zero_dtypes_are_the_modules_working_dtypes(name: str) -> None:
    # inspect reports what the module held at save time (bf16 in a bf16 run),
    # checked against the working-precision copy recorded in the process.
    info = inspect_json(_target(name), "--tensors")
    header, _ = read_header(DATA / name / "reference" / "true_state.safetensors")
    recorded = {k[len("module/"):]: v["dtype"] for k, v in header.items() if k.startswith("module/")}
    dtype_names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    params = [t for t in info["tensors"] if t["kind"] == "param"]
    assert params
    for t in params:
        assert t["dtype"] == dtype_names[recorded[t["name"]]], t["name"]
    assert info["optimizer"]["master_dtype"] == "float32"
