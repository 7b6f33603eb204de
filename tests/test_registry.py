"""The format registry (ravex_convert/formats/registry.py): every format once,
in detection order; detect, inspect, read, verify and the CLI find a format
through it alone (a fake one registered here is picked up with no other edit);
and each format's describe is built from its read, saying what it said before
the registry (pinned per fixture)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import DATA, fixture_dirs, run_ravex

import ravex_convert
from ravex.cli import main
from ravex_convert import ConvertOptions
from ravex_convert._torchfile.archive import open_archive
from ravex_convert.convert import RESHARDABLE, TARGETS
from ravex_convert.errors import CorruptCheckpointError, RavexError, UnknownFormatError
from ravex_convert.formats import registry, safetensors, torch_save
from ravex_convert.formats.dcp import writer as dcp_write
from ravex_convert.formats.native import writer as native_write
from ravex_convert.formats.zero import writer as zero_write
from ravex_convert.info import CheckpointInfo, FileInfo, TensorInfo
from ravex_convert.model import MODEL, Box, Checkpoint, Chunk, LogicalTensor

DETECTION_ORDER = ["native", "dcp", "hf_trainer", "zero", "accelerate", "safetensors", "torch_save"]


def _target(name: str) -> Path:
    """A fixture as a user points at it (a single-file fixture: the file)."""
    ckpt = DATA / name / "checkpoint"
    files = list(ckpt.iterdir())
    return files[0] if len(files) == 1 and files[0].is_file() else ckpt


# ---------------------------------------------------------------- what is registered


def test_every_format_registered_once_in_detection_order() -> None:
    found = [f.name for f in registry.formats()]
    assert found == DETECTION_ORDER
    assert sorted(registry.names()) == sorted(DETECTION_ORDER)
    for f in registry.formats():
        assert registry.get(f.name) is f
        assert callable(f.sniff) and callable(f.read) and callable(f.describe)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("dcp"))


def test_targets_and_reshardable_come_from_the_registry() -> None:
    # the order people read them in (--to's choices, docs/cli.md), not detection order
    assert registry.targets() == TARGETS == ("safetensors", "torch_save", "native", "dcp", "zero", "hf_trainer", "accelerate")
    assert set(registry.reshardable()) == set(RESHARDABLE) == {"zero", "dcp", "native", "hf_trainer", "accelerate"}
    to = next(p for p in main.commands["convert"].params if p.name == "to")
    assert list(to.type.choices) == list(registry.targets())  # type: ignore[attr-defined]
    # each target's write is the format's existing write function
    writes = {"safetensors": safetensors.write, "torch_save": torch_save.write, "dcp": dcp_write.write, "zero": zero_write.write,
              "native": native_write.write}
    for name, fn in writes.items():
        assert registry.get(name).writes and registry.get(name).write is fn, name


def test_a_format_is_checked_when_declared() -> None:
    with pytest.raises(ValueError, match="unknown options"):
        registry.Format("bad", _fake_sniff, _fake_read, _fake_describe, title="bad", options=frozenset({"colour"}))
    with pytest.raises(ValueError, match="no format 'nope' to register before"):
        registry.register(registry.Format("bad", _fake_sniff, _fake_read, _fake_describe, title="bad"), before="nope")
    assert "bad" not in registry.names()
    with pytest.raises(RavexError, match="reads fake checkpoints but does not write it"):
        _ = registry.Format("fake", _fake_sniff, _fake_read, _fake_describe, title="fake checkpoints").write


def test_nested_layouts_go_to_the_outer_format(tmp_path: Path) -> None:
    # a native store holds safetensors files, a ZeRO root .pt files: the outer layout is asked first
    store = tmp_path / "store"
    ravex_convert.convert(DATA / "zero2_ws2_fp32" / "checkpoint", store, "native", ConvertOptions(sync=False))
    assert list(store.rglob("*.safetensors"))
    assert ravex_convert.detect(store).format == "native"
    assert ravex_convert.detect(DATA / "zero2_ws2_fp32" / "checkpoint").format == "zero"
    assert ravex_convert.detect(DATA / "fsdp2_ws2" / "checkpoint").format == "dcp"


def test_param_names_refused_for_a_format_that_takes_none() -> None:
    with pytest.raises(RavexError, match="--param-names applies to .*torch.save files with position-keyed optimizer state only"):
        ravex_convert.read_checkpoint(DATA / "fsdp2_ws2" / "checkpoint", param_names=["a"])


def test_inspect_imports_neither_torch_nor_a_writer() -> None:
    code = (
        "import sys\n"
        "import ravex_convert\n"
        "from ravex_convert.formats import registry\n"
        f"for p in {[str(_target(n)) for n in fixture_dirs()]!r}:\n"
        "    ravex_convert.inspect(p).to_json(tensors=True)\n"
        "left = [m for m in ('ravex_convert.formats.dcp.writer', 'ravex_convert.formats.zero.writer', 'ravex_convert.formats.native.writer') if m in sys.modules]\n"
        "assert not left, left\n"
        "assert 'torch' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- a fake format: one registration, no other edit

FAKE_MARKER = "fake-checkpoint.json"


def _fake_sniff(path: Path) -> list[str] | None:
    return [f"found {FAKE_MARKER}"] if path.is_dir() and (path / FAKE_MARKER).is_file() else None


def _fake_read(path: Path, tag: str | None = None) -> Checkpoint:
    doc = json.loads((path / FAKE_MARKER).read_text())
    ckpt = Checkpoint("fake", path, world_size=1, step=doc["step"])
    for name, values in doc["tensors"].items():
        data = struct.pack(f"<{len(values)}f", *values)
        ckpt.add(LogicalTensor(MODEL + name, (len(values),), "float32", [Chunk(Box((0,), (len(values),)), "float32", data=data)]))
    ckpt.source["tag"] = tag
    return ckpt


def _fake_describe(path: Path, reasons: list[str], tag: str | None = None) -> CheckpointInfo:
    ckpt = _fake_read(path, tag)
    info = CheckpointInfo("fake", "v1", str(path), world_size=1, step=ckpt.step, tag=tag, reasons=reasons)
    info.tensors = [TensorInfo(n[len(MODEL):], t.shape, t.dtype) for n, t in ckpt.tensors.items()]
    info.files = [FileInfo(FAKE_MARKER, (path / FAKE_MARKER).stat().st_size, "metadata")]
    return info


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Path]:
    """A directory holding a fake checkpoint and a valid safetensors file (so,
    without the fake format, a safetensors checkpoint), with the fake format
    registered just before safetensors; taken out again afterwards."""
    d = tmp_path / "fake"
    d.mkdir()
    (d / FAKE_MARKER).write_text(json.dumps({"step": 7, "tensors": {"w": [1.0, 2.0, 3.0]}}))
    shutil.copy(DATA / "safetensors_single" / "checkpoint" / "model.safetensors", d / "model.safetensors")
    assert ravex_convert.detect(d).format == "safetensors"
    registry.register(registry.Format("fake", _fake_sniff, _fake_read, _fake_describe, title="fake checkpoints",
                                      options=frozenset({"tag"})), before="safetensors")
    try:
        yield d
    finally:
        registry.unregister("fake")


def test_a_registered_format_is_detected_inspected_read_and_verified(fake: Path) -> None:
    assert [f.name for f in registry.formats()] == ["native", "dcp", "hf_trainer", "zero", "accelerate", "fake", "safetensors", "torch_save"]
    d = ravex_convert.detect(fake)
    assert (d.format, d.reasons) == ("fake", [f"found {FAKE_MARKER}"])
    info = ravex_convert.inspect(fake, tag="t1", index=3)  # index: not a fake option, not passed
    assert (info.format, info.variant, info.step, info.tag) == ("fake", "v1", 7, "t1")
    assert [(t.name, t.shape) for t in info.tensors] == [("w", (3,))]
    assert ravex_convert.inspect(fake).tag is None  # an option at its "not given" value is not passed
    ckpt = ravex_convert.read_checkpoint(fake, tag="t2")
    assert (ckpt.format, ckpt.source["tag"], list(ckpt.tensors)) == ("fake", "t2", ["model/w"])
    result = ravex_convert.verify(fake, fake)
    assert result.identical and result.compared == 1
    # the command, in this process, through the same registry
    out = CliRunner().invoke(main, ["inspect", str(fake), "--json", "--tensors"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.stdout)
    assert (shown["format"], shown["variant"], shown["step"], shown["num_tensors"]) == ("fake", "v1", 7, 1)
    assert "fake" not in registry.targets() and "fake" not in registry.reshardable()


def test_an_unregistered_format_is_gone(fake: Path) -> None:
    registry.unregister("fake")
    try:
        assert ravex_convert.detect(fake).format == "safetensors"
        assert "fake" not in [f.name for f in registry.formats()]
        with pytest.raises(RavexError, match="'fake' is not a format Ravex knows"):
            registry.get("fake")
    finally:
        registry.register(registry.Format("fake", _fake_sniff, _fake_read, _fake_describe, title="fake checkpoints"))


def test_unknown_input_lists_the_registered_formats(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UnknownFormatError) as exc:
        ravex_convert.inspect(tmp_path)
    assert exc.value.hint is not None
    for f in registry.formats():
        assert f.title in exc.value.hint


# ---------------------------------------------------------------- describe is built from read, and says what it said before

# sha256 (first 16 hex digits) of `inspect(...).to_json(tensors=True)` without
# path, reasons, notes, optimizer and the byte counts (files as path, role,
# rank), captured from each format's own describe BEFORE the registry (which
# parsed the files a second time). The optimizer is pinned below.
BEFORE = {
    "bf16opt_ws2": "a654090798dde486",
    "fsdp2_ws2": "8ad0141ec4334a65",
    "fsdp2_ws3": "9783e83a1435720b",
    "safetensors_sharded": "291df7504141efa2",
    "safetensors_single": "7c3e8bd926069195",
    "torch_save": "65fdde1af6357d1e",
    "zero1_ws2_bf16": "15c88be18e3d95f7",
    "zero1_ws2_fp32": "3c688a8058fcb33c",
    "zero1_ws3_fp32": "ff09a432dad9248d",
    "zero1e_ws3_bf16": "36c473842cbf8536",
    "zero2_ws2_bf16": "a5048c84d311f74b",
    "zero2_ws2_fp32": "699e45bdc2368c1b",
    "zero2_ws3_fp32": "2d95a9a059b854a8",
    "zero2e_ws2_fp32": "699e45bdc2368c1b",
    "zero3_ws2_bf16": "e583d6bf119bf85c",
    "zero3_ws2_fp32": "64fa708126466dac",
    "zero3_ws3_bf16": "a7a5ca9ee65cf5c1",
    "zero3_ws3_fp32": "69fde2ab8e012470",
    "zero3sg_ws2_fp32": "64fa708126466dac",
    "zero3sg_ws3_bf16": "a7a5ca9ee65cf5c1",
}
ADAM = ("exp_avg", "exp_avg_sq", "step")
# (kind, param groups, master dtype, states): as before, but for the order of
# the states (read's order now) and the two elastic ZeRO saves, whose 2 param
# groups the old describe reported as unknown (it looked for hyper-parameters
# that elastic saves do not keep; read counts the groups).
OPTIMIZER: dict[str, tuple[str, int | None, str | None, tuple[str, ...]] | None] = {
    **{n: ("Adam", 2, "float32", ADAM) for n in BEFORE if n.startswith(("zero", "bf16opt"))},
    "fsdp2_ws2": ("Adam", None, None, ADAM),
    "fsdp2_ws3": ("Adam", None, None, ADAM),
    "torch_save": ("Adam", 2, None, ADAM),
    "safetensors_single": None,
    "safetensors_sharded": None,
}


def _view(info: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in info.items() if k not in ("path", "reasons", "notes", "optimizer", "bytes_on_disk")}
    out["files"] = [[f["path"], f["role"], f["rank"]] for f in info["files"]]
    return out


def test_pins_cover_every_fixture() -> None:
    assert sorted(BEFORE) == sorted(OPTIMIZER) == fixture_dirs()


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_describe_says_what_it_said_before(name: str) -> None:
    info = ravex_convert.inspect(_target(name)).to_json(tensors=True)
    assert hashlib.sha256(json.dumps(_view(info), sort_keys=True).encode()).hexdigest()[:16] == BEFORE[name]
    opt = info["optimizer"]
    assert (None if opt is None else (opt["kind"], opt["param_groups"], opt["master_dtype"], tuple(sorted(opt["states"])))) == OPTIMIZER[name]


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_describe_agrees_with_read(name: str) -> None:
    path = _target(name)
    info = ravex_convert.inspect(path)
    ckpt = ravex_convert.read_checkpoint(path)
    assert (info.format, info.step, info.world_size) == (ckpt.format, ckpt.step, ckpt.world_size)
    stored = {n[len(MODEL):]: t for n, t in ckpt.tensors.items() if n.startswith(MODEL)}
    assert info.aliases == {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items()}
    shown = {t.name: t for t in info.model_tensors if t.name not in info.aliases}  # torch_save lists tied names too
    assert sorted(shown) == sorted(stored)
    for n, t in shown.items():
        assert t.shape == stored[n].shape, n
        if info.format != "zero":  # ZeRO shows the module's working dtype, read holds the fp32 master
            assert t.dtype == stored[n].dtype, n
    if "optimizer_error" in ckpt.source:
        # position-keyed state read cannot name (the torch_save fixture): inspect shows it as the file keys it, and says so
        assert info.optimizer is not None and any(n.startswith("optimizer state left out") for n in info.notes)
    elif info.optimizer is not None:
        assert set(info.optimizer.states) == set(ckpt.optimizer_state_names())
    assert set(ckpt.notes) <= set(info.notes)


def test_describe_reads_no_tensor_bytes(tmp_path: Path) -> None:
    """A flipped bit in a rank's partition: convert and verify refuse it (the
    CRC-32), inspect says what it says of the undamaged checkpoint, without
    reading the data."""
    root = tmp_path / "ckpt"
    shutil.copytree(DATA / "zero3_ws2_bf16" / "checkpoint", root)
    rank1 = root / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    a = open_archive(rank1)
    key = max(a.storage_sizes, key=lambda k: a.storage_sizes[k])
    raw = bytearray(rank1.read_bytes())
    raw[a.storage_offsets[key] + 1] ^= 0x40
    rank1.write_bytes(bytes(raw))
    before = ravex_convert.inspect(DATA / "zero3_ws2_bf16" / "checkpoint").to_json(tensors=True)
    after = ravex_convert.inspect(root).to_json(tensors=True)
    assert {k: v for k, v in after.items() if k != "path"} == {k: v for k, v in before.items() if k != "path"}
    with pytest.raises(CorruptCheckpointError, match="fails its CRC-32 check"):
        ravex_convert.read_checkpoint(root)


def test_the_command_says_what_the_api_says() -> None:
    # `ravex inspect` in a fresh interpreter, where the registry is all there is to find a format by
    for name in ("zero3_ws3_bf16", "fsdp2_ws3", "torch_save", "safetensors_sharded"):
        res = run_ravex("inspect", _target(name), "--json", "--tensors")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == ravex_convert.inspect(_target(name)).to_json(tensors=True)
