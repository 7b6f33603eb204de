"""The DCP writer: what it writes reads back bit for bit (Ravex's reader, and
torch's own ``dcp.load`` + ``set_state_dict`` in one process), is laid out the
way FSDP2 + ``dcp.save`` lay it out (compared with the fsdp2_ws3 fixture that a
real torchrun job wrote), and its two metadata forms load where they claim."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import math
import pickle
import struct
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from conftest import DATA, FIXTURES, run_without_torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import ravex_convert
from ravex_convert import RavexError, read_checkpoint
from ravex_convert._engine import CopyJob
from ravex_convert._output import Options
from ravex_convert._torchfile import write as _torchwrite
from ravex_convert.formats.dcp import reader as dcp_read
from ravex_convert.formats.dcp import writer as dcp_write
from ravex_convert.model import Box, Checkpoint, Chunk, LogicalTensor, TensorLink

pytestmark = pytest.mark.usefixtures("storage_backend")  # every test on every backend (conftest)


def _fixture_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ravex_fixture_model", FIXTURES / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


M = _fixture_model()
OPTIMIZER_SOURCES = ["zero2_ws2_fp32", "zero3_ws3_bf16", "fsdp2_ws3"]


def convert(name: str, dst: Path, world_size: int, **kw: Any) -> Path:
    form = kw.pop("metadata_form", "current")
    dcp_write.write(read_checkpoint(DATA / name / "checkpoint"), dst, Options(world_size=world_size, **kw), metadata_form=form)
    return dst


def metadata(path: Path) -> Metadata:
    return FileSystemReader(str(path)).read_metadata()


def true_state(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ref = DATA / name / "reference"
    return load_file(ref / "true_state.safetensors"), json.loads((ref / "true_state.json").read_text())


def torch_load(path: Path, *, with_scheduler: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """What a user does: a fresh model and optimizer, get_state_dict, dcp.load in
    this one process (no process group: torch warns), set_state_dict."""
    model = M.build_model(seed=M.SEED + 7)  # other weights: whatever is not loaded shows
    optimizer = M.make_optimizer(model)
    scheduler = M.make_scheduler(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        if with_scheduler:
            state["lr_scheduler"] = scheduler.state_dict()
        dcp_load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    return model, optimizer, state


def assert_matches_true_state(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    true, meta = true_state(name)
    checked = 0
    for key, want in true.items():
        kind, rest = key.split("/", 1)
        if kind == "model":
            got = model.state_dict()[rest]
        elif kind == "optim":
            state_name, fqn = rest.split("/", 1)
            got = optimizer.state[model.get_parameter(fqn)][state_name]
        else:
            continue  # module/: DeepSpeed's working-precision copy
        assert got.dtype == torch.float32 and torch.equal(got, want.to(got.dtype)), key
        checked += 1
    assert checked == sum(1 for k in true if not k.startswith("module/"))
    names = {id(p): n for n, p in model.named_parameters()}
    for group, ref in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        assert [names[id(p)] for p in group["params"]] == ref["params"]
        for k in ("lr", "weight_decay", "eps", "initial_lr", "amsgrad", "maximize", "decoupled_weight_decay"):
            assert group[k] == ref[k], k
        assert list(group["betas"]) == ref["betas"]
    steps = {names[id(p)]: float(s["step"]) for p, s in optimizer.state.items()}
    assert steps == {n: float(meta["adam_step"][n]) for n in steps} and len(steps) == sum(len(g["params"]) for g in meta["param_groups"])
    if "lr_scheduler" in state:
        assert state["lr_scheduler"] == meta["lr_scheduler_state"]


def chunk_oracle(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(offset, rows) of each rank's dim-0 shard from torch.chunk itself, ranks
    past the data empty at offset ``rows``; equal chunks once (DCP de-duplicates)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(world_size)]
    sizes += [0] * (world_size - len(sizes))
    out: list[tuple[int, int]] = []
    for r, n in enumerate(sizes):
        off = sum(sizes[:r])
        if (off, n) not in out:
            out.append((off, n))
    return out


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", ["zero2_ws2_fp32", "zero3_ws3_bf16", "zero1_ws2_bf16", "fsdp2_ws3", "safetensors_sharded"])
def test_read_back_is_bit_identical(tmp_path: Path, name: str, world_size: int) -> None:
    src = read_checkpoint(DATA / name / "checkpoint")
    dst = tmp_path / "out"
    summary = dcp_write.write(src, dst, Options(world_size=world_size))
    files = sorted(p.name for p in dst.iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]
    assert summary["world_size"] == world_size and summary["metadata_form"] == "current"
    assert summary["bytes"] == sum(p.stat().st_size for p in dst.iterdir())
    back = dcp_read.read(dst)
    assert back.world_size == world_size
    assert back.step == src.step
    result = ravex_convert.verify(DATA / name / "checkpoint", dst)
    assert result.identical, [d.to_json() for d in result.differences]
    assert result.compared == len([n for n in list(src.tensors) + list(src.aliases) if n.startswith(("model/", "optim/"))])
    assert not list(tmp_path.glob(".out.ravex-*")), "the staging directory was left behind"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", OPTIMIZER_SOURCES)
def test_torch_dcp_load_restores_the_true_state(tmp_path: Path, name: str, world_size: int) -> None:
    dst = convert(name, tmp_path / "out", world_size)
    _, meta = true_state(name)
    model, optimizer, state = torch_load(dst, with_scheduler=meta.get("lr_scheduler_saved", True))
    assert_matches_true_state(name, model, optimizer, state)


def test_dcp_to_dcp_keeps_every_key_and_value(tmp_path: Path) -> None:
    """DCP -> DCP (zero2 with scheduler and extra state -> 3 ranks -> 2 ranks): the
    same flat keys, nesting and non-tensor values come out again."""
    a = convert("zero2_ws2_fp32", tmp_path / "a", 3)
    b = tmp_path / "b"
    dcp_write.write(read_checkpoint(a), b, Options(world_size=2))
    ma, mb = metadata(a), metadata(b)
    assert list(ma.state_dict_metadata) == list(mb.state_dict_metadata)
    assert ma.planner_data == mb.planner_data
    assert ravex_convert.verify(a, b).identical
    for key, md in ma.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            assert item_value(a, ma, MetadataIndex(key)) == item_value(b, mb, MetadataIndex(key)), key


# ---------------------------------------------------------------- the layout FSDP2 + dcp.save writes


def item_bytes(root: Path, md: Metadata, index: MetadataIndex) -> bytes:
    info = md.storage_data[index]
    with open(root / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def item_value(root: Path, md: Metadata, index: MetadataIndex) -> Any:
    return torch.load(io.BytesIO(item_bytes(root, md, index)), weights_only=True)


@pytest.mark.parametrize("name", ["fsdp2_ws3", "zero2_ws2_fp32"])
def test_layout_matches_what_fsdp2_saved_at_world_size_3(tmp_path: Path, name: str) -> None:
    ref_root = DATA / "fsdp2_ws3" / "checkpoint"
    ref = metadata(ref_root)
    out = convert(name, tmp_path / "out", 3)
    mine = metadata(out)
    _, meta = true_state("fsdp2_ws3")
    # FSDP2 leaves buffers unsharded (one whole chunk); the checkpoint model does
    # not mark buffers, so Ravex cuts them like parameters: dcp.load reads both
    buffers = {f"model.{b}" for b in meta["persistent_buffers"]}
    assert set(ref.state_dict_metadata) <= set(mine.state_dict_metadata)
    if name == "fsdp2_ws3":
        assert set(ref.state_dict_metadata) == set(mine.state_dict_metadata)
    ref_index = {(i.fqn, i.offset): i.index for i in ref.storage_data}
    mine_index = {(i.fqn, i.offset): i.index for i in mine.storage_data}
    for key, want in ref.state_dict_metadata.items():
        got = mine.state_dict_metadata[key]
        assert type(got) is type(want), key
        assert mine.planner_data[key] == ref.planner_data[key], key
        if isinstance(want, TensorStorageMetadata):
            assert isinstance(got, TensorStorageMetadata)
            assert (got.size, got.properties.dtype, got.properties.strides) == (want.size, want.properties.dtype, want.properties.strides), key
            if key in buffers and len(want.size) > 0:
                assert [c.sizes[0] for c in got.chunks] == [n for _, n in chunk_oracle(want.size[0], 3)], key
                continue
            assert got.chunks == want.chunks, key
        mine_keys = {k: v for k, v in mine_index.items() if k[0] == key}
        assert mine_keys == {k: v for k, v in ref_index.items() if k[0] == key}, key
        if isinstance(want, BytesStorageMetadata) and name == "fsdp2_ws3":
            assert item_value(out, mine, MetadataIndex(key)) == item_value(ref_root, ref, MetadataIndex(key)), key


@pytest.mark.parametrize("world_size", [1, 3, 4, 8, 40])
def test_shards_are_torch_chunk_sizes_in_complete_archives_in_gap_free_files(tmp_path: Path, world_size: int) -> None:
    out = convert("zero3_ws3_bf16", tmp_path / "out", world_size)
    md = metadata(out)
    per_file: dict[str, list[tuple[int, int]]] = {}
    for index, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        value = item_value(out, md, index)
        sd = md.state_dict_metadata[index.fqn]
        if isinstance(sd, TensorStorageMetadata):
            chunk = sd.chunks[index.index]
            assert index.offset == chunk.offsets
            assert isinstance(value, torch.Tensor) and value.shape == chunk.sizes and value.dtype == sd.properties.dtype
        else:
            assert index.offset is None and index.index is None and not isinstance(value, torch.Tensor)
    for name, ranges in per_file.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges)), name
        assert ranges[-1][0] + ranges[-1][1] == (out / name).stat().st_size, name
    for key, sd in md.state_dict_metadata.items():
        if isinstance(sd, TensorStorageMetadata) and len(sd.size) and key.startswith(("model.", "optim.")):
            assert [(c.offsets[0], c.sizes[0]) for c in sd.chunks] == chunk_oracle(sd.size[0], world_size), key
            assert all(tuple(c.sizes[1:]) == tuple(sd.size[1:]) for c in sd.chunks)


def test_zero_dim_tensors_param_groups_and_tied_names(tmp_path: Path) -> None:
    out = convert("zero2_ws2_fp32", tmp_path / "out", 3)
    md = metadata(out)
    step = md.state_dict_metadata["optim.state.embed.weight.step"]
    assert isinstance(step, TensorStorageMetadata)
    assert step.size == torch.Size([]) and [(c.offsets, c.sizes) for c in step.chunks] == [(torch.Size([]), torch.Size([]))]
    assert step.properties.strides == ()
    assert MetadataIndex("optim.state.embed.weight.step", []) in md.storage_data
    assert item_value(out, md, MetadataIndex("optim.state.embed.weight.step", [])).item() == 3.0
    # Adam's param groups: one item per hyper-parameter, nested by group index
    assert md.planner_data["optim.param_groups.1.lr"] == ("optim", "param_groups", 1, "lr")
    assert item_value(out, md, MetadataIndex("optim.param_groups.1.lr")) == 0.005
    assert item_value(out, md, MetadataIndex("optim.param_groups.0.betas")) == (0.9, 0.95)
    assert item_value(out, md, MetadataIndex("optim.param_groups.0.params"))[:2] == ["embed.weight", "blocks.0.attn.q.weight"]
    # the tied name is its own key with the same chunks; the optimizer knows the first name only
    head, embed = md.state_dict_metadata["model.head.weight"], md.state_dict_metadata["model.embed.weight"]
    assert isinstance(head, TensorStorageMetadata) and isinstance(embed, TensorStorageMetadata) and head.chunks == embed.chunks
    assert "optim.state.embed.weight.exp_avg" in md.state_dict_metadata and "optim.state.head.weight.exp_avg" not in md.state_dict_metadata
    # replicated items (0-d tensors, non-tensor values) are spread over the ranks, as DCP's planner spreads them
    assert {md.storage_data[MetadataIndex(k)].relative_path for k, v in md.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)} == {f"__{r}_0.distcp" for r in range(3)}


def test_extra_state_is_flattened_as_dcp_flattens_it(tmp_path: Path) -> None:
    """Extra state with tensors in dicts and lists, a tuple, an empty dict: the same
    keys and nesting as torch's own flattening, and dcp.load puts every value back."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    w = np.arange(15, dtype=np.float32).reshape(5, 3)
    rng = np.arange(10, dtype=np.uint8)
    b = np.array([0.5, 1.5, 2.5], dtype=np.float32)
    ckpt = Checkpoint("test", tmp_path)
    for name, arr, dtype in (("model/w", w, "float32"), ("obj/rng", rng, "uint8"), ("obj/nest/1/b", b, "float32")):
        ckpt.add(LogicalTensor(name, arr.shape, dtype, [Chunk(Box((0,) * arr.ndim, arr.shape), dtype, data=arr.tobytes())]))
    ckpt.objects["extra"] = {"rng": TensorLink("obj/rng"), "lst": [1, 2], "nest": [{"a": 1}, {"b": TensorLink("obj/nest/1/b")}],
                             "tup": (1, 2.5), "empty": {}, "none": None}
    ckpt.objects["lr_scheduler"] = {"last_epoch": 3, "base_lrs": [0.1, 0.2]}
    out = tmp_path / "out"
    dcp_write.write(ckpt, out, Options(world_size=2))

    torch_state = {"model": {"w": torch.from_numpy(w)}, "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.1, 0.2]},
                   "rng": torch.from_numpy(rng), "lst": [1, 2], "nest": [{"a": 1}, {"b": torch.from_numpy(b)}], "tup": (1, 2.5),
                   "empty": {}, "none": None}
    _, mappings = flatten_state_dict(torch_state)
    md = metadata(out)
    assert md.planner_data == mappings
    rng_md = md.state_dict_metadata["rng"]
    assert isinstance(rng_md, TensorStorageMetadata) and len(rng_md.chunks) == 1  # a plain tensor: whole
    target: dict[str, Any] = {"model": {"w": torch.zeros(5, 3)}, "lr_scheduler": {"last_epoch": 0, "base_lrs": []}, "rng": torch.zeros(10, dtype=torch.uint8),
              "lst": [], "nest": [{"a": 0}, {"b": torch.zeros(3)}], "tup": (), "none": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(target, checkpoint_id=str(out))
    assert torch.equal(target["model"]["w"], torch.from_numpy(w)) and torch.equal(target["rng"], torch.from_numpy(rng))
    assert torch.equal(target["nest"][1]["b"], torch.from_numpy(b))
    assert (target["lst"], target["nest"][0], target["tup"], target["none"], target["lr_scheduler"]) == (
        [1, 2], {"a": 1}, (1, 2.5), None, {"last_epoch": 3, "base_lrs": [0.1, 0.2]})


# ---------------------------------------------------------------- metadata forms


def _old_setstate(self: TensorProperties, state: tuple[Any, ...]) -> None:
    """TensorProperties.__setstate__ as torch < 2.15 has it: exactly five fields."""
    self.dtype, self.layout, self.requires_grad, _encoding, self.pin_memory = state
    self.memory_format = torch.contiguous_format


def test_compat_form_is_what_torch_before_2_15_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    current = convert("zero2_ws2_fp32", tmp_path / "current", 2)
    compat = convert("zero2_ws2_fp32", tmp_path / "compat", 2, metadata_form="compat")
    mc, mo = metadata(current), metadata(compat)
    assert list(mc.state_dict_metadata) == list(mo.state_dict_metadata) and mc.planner_data == mo.planner_data
    assert set(mc.storage_data) == set(mo.storage_data)
    for key, md in mo.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            assert md.properties.strides is None
            other = mc.state_dict_metadata[key]
            assert isinstance(other, TensorStorageMetadata) and other.properties.strides == tuple(torch.empty(md.size).stride())
    assert read_checkpoint(compat).source["metadata_form"] == "torch<2.15"
    assert read_checkpoint(current).source["metadata_form"].startswith("torch>=2.15")
    # the data files are the same bytes: only .metadata differs
    for r in range(2):
        assert (current / f"__{r}_0.distcp").read_bytes() == (compat / f"__{r}_0.distcp").read_bytes()
    # torch 2.15 loads the compat form
    model, optimizer, state = torch_load(compat, with_scheduler=True)
    assert_matches_true_state("zero2_ws2_fp32", model, optimizer, state)
    # torch < 2.15 (five-field __setstate__) unpickles the compat form and not the current one
    monkeypatch.setattr(TensorProperties, "__setstate__", _old_setstate)
    old = pickle.loads((compat / ".metadata").read_bytes())
    assert len(old.state_dict_metadata) == len(mo.state_dict_metadata)
    with pytest.raises(ValueError, match="too many values to unpack"):
        pickle.loads((current / ".metadata").read_bytes())


# ---------------------------------------------------------------- options and failures


def test_dtype_casts_weights_not_optimizer_state(tmp_path: Path) -> None:
    out = convert("zero2_ws2_fp32", tmp_path / "out", 2, dtype="bfloat16")
    back = dcp_read.read(out)
    assert {t.dtype for n, t in back.tensors.items() if n.startswith("model/")} == {"bfloat16"}
    assert {t.dtype for n, t in back.tensors.items() if n.startswith("optim/")} == {"float32"}
    true, _ = true_state("zero2_ws2_fp32")
    sd = ravex_convert.load_state_dict(out)
    for key, want in true.items():
        if key.startswith("model/"):
            assert sd[key[len("model/"):]].dtype == torch.bfloat16 and torch.equal(sd[key[len("model/"):]], want.to(torch.bfloat16)), key


def test_refusals(tmp_path: Path) -> None:
    src = read_checkpoint(DATA / "zero2_ws2_fp32" / "checkpoint")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RavexError, match="already exists"):
        dcp_write.write(src, out, Options(world_size=2))
    with pytest.raises(RavexError, match="metadata form 'v3' is unknown"):
        dcp_write.write(src, tmp_path / "x", Options(world_size=2), metadata_form="v3")
    with pytest.raises(RavexError, match="needs at least one rank"):
        dcp_write.write(src, tmp_path / "x", Options(world_size=0))
    src.objects["extra"] = {"pair": (TensorLink("model/logit_gain"), 1)}
    with pytest.raises(RavexError, match="holds a tensor inside a tuple"):
        dcp_write.write(src, tmp_path / "x", Options(world_size=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # --force replaces
    dcp_write.write(read_checkpoint(DATA / "zero2_ws2_fp32" / "checkpoint"), out, Options(world_size=2, force=True))
    assert (out / ".metadata").is_file()


def test_a_failure_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: CopyJob, **kw: Any) -> dict[str, int]:
        raise RavexError("writing failed: disk full")

    monkeypatch.setattr(CopyJob, "run", boom)
    with pytest.raises(RavexError, match="disk full"):
        convert("zero2_ws2_fp32", tmp_path / "out", 2)
    assert list(tmp_path.iterdir()) == []


def test_items_hold_torch_save_records(tmp_path: Path) -> None:
    """Each item is a zip whose offsets count from the item's first byte, with the
    records torch.save writes; tensor data 64-byte aligned within the item."""
    import zipfile

    out = convert("fsdp2_ws3", tmp_path / "out", 2)
    md = metadata(out)
    seen = 0
    for index in list(md.storage_data)[:40]:
        raw = item_bytes(out, md, index)
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            names = z.namelist()
            assert names[0] == "archive/data.pkl" and "archive/version" in names and "archive/byteorder" in names
            assert z.testzip() is None  # every CRC-32 right
            if "archive/data/0" in names:
                info = z.getinfo("archive/data/0")
                name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
                assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
                seen += 1
    assert seen > 0


def test_true_state_files_are_what_the_tests_assume() -> None:
    # guards the comparisons above: tied names present under both names, fp32 masters
    with safe_open(str(DATA / "zero3_ws3_bf16" / "reference" / "true_state.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {"model/embed.weight", "model/head.weight"} <= keys
        assert f.get_tensor("model/embed.weight").dtype == torch.float32
    assert math.prod(M.build_model().logit_gain.shape) == 1


def _torch_metadata(plan: Any, form: str, save_id: str) -> Metadata:
    """The oracle: the same .metadata built from torch's own classes (what the writer did before it
    stopped importing torch), to compare with what it now writes by name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, StorageMeta

    sd: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    by_key = plan.by_key()
    for key, path, value in plan.flat:
        planner[key] = path
        items = by_key[key]
        if isinstance(value, dcp_write._Leaf):
            props = TensorProperties(dtype=getattr(torch, value.dtype))
            props.strides = _torchwrite._strides(value.shape) if form == "current" else None
            chunks = [ChunkStorageMetadata(offsets=torch.Size(it.box.offsets), sizes=torch.Size(it.box.sizes)) for it in items if it.box]
            sd[key] = TensorStorageMetadata(properties=props, size=torch.Size(value.shape), chunks=chunks)
            for it in items:
                storage[MetadataIndex(key, it.box.offsets if it.box else (), it.index)] = _StorageInfo(f"__{it.rank}_0.distcp", it.file_offset, it.layout.total)
        else:
            sd[key] = BytesStorageMetadata()
            it = items[0]
            storage[MetadataIndex(key)] = _StorageInfo(f"__{it.rank}_0.distcp", it.file_offset, it.layout.total)
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=save_id), version="1.0.0")


@pytest.mark.parametrize("form", ["current", "compat"])
@pytest.mark.parametrize("name", ["zero3_ws3_bf16", "fsdp2_ws2"])
def test_metadata_written_without_torch_is_what_torch_classes_pickle(name: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(dcp_write.uuid, "uuid4", lambda: fixed)
    plan = dcp_write._plan(read_checkpoint(DATA / name / "checkpoint"), Options(world_size=3))
    data = plan.layout.metadata(form == "current", str(fixed))
    mine = pickle.loads(data)
    # what torch's own pickling of those objects gives back (_StorageInfo drops its None fields)
    theirs = pickle.dumps(_torch_metadata(plan, form, str(fixed)), protocol=4)
    want = pickle.loads(theirs)
    assert mine == want
    # class names and strings are written once and then fetched from the memo, as pickle does
    # (measured: 0.95-0.97x torch's size on the fixtures; 3.2x without the memo)
    assert len(data) <= 1.1 * len(theirs), (len(data), len(theirs))
    # what == leaves out: MetadataIndex.index, and each instance dict's fields in order
    assert [list(vars(k).items()) for k in mine.storage_data] == [list(vars(k).items()) for k in want.storage_data]
    assert [list(vars(v).items()) for v in mine.storage_data.values()] == [list(vars(v).items()) for v in want.storage_data.values()]
    assert list(vars(mine).items()) == list(vars(want).items())


def test_writing_dcp_does_not_import_torch(tmp_path: Path) -> None:
    run_without_torch("import sys; from ravex_convert import ConvertOptions, convert; convert(sys.argv[1], sys.argv[2], 'dcp', ConvertOptions(world_size=3))",
                      str(DATA / "zero2_ws2_fp32" / "checkpoint"), str(tmp_path / "out"))
    assert (tmp_path / "out" / ".metadata").is_file()
