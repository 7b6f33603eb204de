"""The DCP layout planned by the core (``_core.DcpLayout``, src/dcp.rs): the
items it places and the ``.metadata`` it writes are those of the per-item
Python form it replaced, kept here as the oracle (the same placement rule,
``model.dim0_shards``, and the same pickle, ``_torchwrite.dumps`` over
``PickleObject``\\ s), byte for byte; and a plan holds one entry per key, each
rank file's records being built only when that file is written."""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA

from ravex_convert import RavexError, read_checkpoint
from ravex_convert._core import DcpLayout
from ravex_convert._layout import PathItem
from ravex_convert._output import Options
from ravex_convert._torchfile import write as _torchwrite
from ravex_convert._torchfile.write import PickleDict, PickleGlobal, PickleObject, dumps
from ravex_convert.formats.dcp import writer as dcp_write
from ravex_convert.model import MODEL, OPTIM, Box, Checkpoint, Chunk, Flat, LogicalTensor, dim0_shards

_MD = "torch.distributed.checkpoint.metadata"


def _dataclass(name: str, state: dict[str, Any] | None, module: str = _MD) -> PickleObject:
    return PickleObject(module, name, (), state=state or None, newobj=True)


def _size(dims: tuple[int, ...]) -> PickleObject:
    return PickleObject("torch", "Size", (tuple(dims),))


def oracle_metadata(plan: Any, form: str, save_id: str) -> bytes:
    """``.metadata`` built as the writer built it before the core did: one Python object per item."""
    sd_meta: dict[str, Any] = {}
    planner: dict[str, tuple[PathItem, ...]] = {}
    storage: list[tuple[Any, Any]] = []
    by_key = plan.by_key()

    def info(it: Any) -> PickleObject:
        return _dataclass("_StorageInfo", {"relative_path": f"__{it.rank}_0.distcp", "offset": it.file_offset, "length": it.layout.total},
                          module="torch.distributed.checkpoint.filesystem")

    for key, path, value in plan.flat:
        planner[key] = path
        items = by_key[key]
        if isinstance(value, dcp_write._Leaf):
            props: tuple[Any, ...] = (PickleGlobal("torch", value.dtype), PickleGlobal("torch", "strided"), False,
                                      PickleObject(_MD, "_MEM_FORMAT_ENCODING", (0,)), False)
            if form == "current":
                props += (_torchwrite._strides(value.shape),)
            chunks = [_dataclass("ChunkStorageMetadata", {"offsets": _size(it.box.offsets), "sizes": _size(it.box.sizes)}) for it in items]
            properties = PickleObject(_MD, "TensorProperties", (), state=props, newobj=True)
            sd_meta[key] = _dataclass("TensorStorageMetadata", {"properties": properties, "size": _size(value.shape), "chunks": chunks})
            for it in items:
                index = {"fqn": key, "index": it.index, "offset": _size(it.box.offsets)}
                storage.append((_dataclass("MetadataIndex", index), info(it)))
        else:
            sd_meta[key] = _dataclass("BytesStorageMetadata", None)
            storage.append((_dataclass("MetadataIndex", {"fqn": key, "index": None}), info(items[0])))
    meta: dict[str, Any] = {"checkpoint_id": None, "save_id": save_id, "load_id": None, "modules": []}
    return dumps(_dataclass("Metadata", {"state_dict_metadata": sd_meta, "planner_data": planner, "storage_data": PickleDict(tuple(storage)),
                                         "storage_meta": _dataclass("StorageMeta", meta), "version": "1.0.0"}), memo=True)


def oracle_items(plan: Any) -> list[tuple[str, int, tuple[int, ...], tuple[int, ...], int, int]]:
    """(key, rank, offsets, sizes, file offset, size) of every item by the Python rule the writer used
    before: ``dim0_shards`` with equal boxes recorded once, whole items on the least loaded rank
    after every shard, each rank file in key order."""
    ws = plan.world_size
    load = [0] * ws
    rows: list[list[Any]] = []
    floating = []
    for leaf, (key, _, value) in enumerate(plan.flat):
        archives = plan.archives[leaf]
        if isinstance(value, dcp_write._Leaf) and len(archives) == 3:
            seen: set[int] = set()
            for r, box in dim0_shards(value.shape, ws):
                if box.offsets[0] in seen:
                    continue
                seen.add(box.offsets[0])
                a = archives[2 if box.sizes[0] == 0 else 0 if box.sizes[0] == plan.per[leaf] else 1]
                rows.append([key, r, box.offsets, box.sizes, 0, a.total])
                load[r] += a.total
        else:
            shape = value.shape if isinstance(value, dcp_write._Leaf) else ()
            rows.append([key, -1, tuple(0 for _ in shape), shape, 0, archives[0].total])
            floating.append(rows[-1])
    for row in floating:
        row[1] = min(range(ws), key=lambda r: load[r])
        load[row[1]] += row[5]
    at = [0] * ws
    for row in rows:
        row[4] = at[row[1]]
        at[row[1]] += row[5]
    return [tuple(r) for r in rows]  # type: ignore[misc]


def ours(plan: Any) -> list[tuple[str, int, tuple[int, ...], tuple[int, ...], int, int]]:
    return [(it.key, it.rank, it.box.offsets if it.box else (), it.box.sizes if it.box else (), it.file_offset, it.layout.total)
            for items in plan.by_key().values() for it in items]


def big_checkpoint(rows: list[int], dim: int) -> Checkpoint:
    """Tensors of ``rows`` x ``dim`` fp32 (no file behind them: planning reads none), each with
    Adam state and a 0-d step, and scheduler state: many keys, files past 4 GiB."""
    ckpt = Checkpoint("zero", Path("/nonexistent"), world_size=1, step=3)
    names = []
    for i, n in enumerate(rows):
        name = f"layers.{i}.weight"
        names.append(name)
        for full in (MODEL + name, f"{OPTIM}exp_avg/{name}", f"{OPTIM}exp_avg_sq/{name}"):
            ckpt.add(LogicalTensor(full, (n, dim), "float32", [Chunk(Flat(0, n * dim), "float32", Path("/nonexistent/x"), 0)]))
        ckpt.add(LogicalTensor(f"{OPTIM}step/{name}", (), "float32", [Chunk(Box((), ()), "float32", Path("/nonexistent/x"), 0)]))
    ckpt.objects["optim.param_groups"] = [{"lr": 1e-3, "betas": (0.9, 0.99), "params": names}]
    ckpt.objects["lr_scheduler"] = {"last_epoch": 3, "base_lrs": [1e-3]}
    return ckpt


CASES = [(name, ws) for name in ("zero3_ws3_bf16", "fsdp2_ws2", "zero2_ws2_fp32", "torch_save") for ws in (1, 2, 3, 7)]


@pytest.mark.parametrize(("name", "ws"), CASES)
@pytest.mark.parametrize("form", ["current", "compat"])
def test_core_layout_and_metadata_are_the_per_item_forms(name: str, ws: int, form: str) -> None:
    plan = dcp_write._plan(read_checkpoint(DATA / name / "checkpoint"), Options(world_size=ws))
    assert ours(plan) == oracle_items(plan)
    save_id = str(uuid.UUID(int=11))
    data = plan.layout.metadata(form == "current", save_id)
    assert data == oracle_metadata(plan, form, save_id)
    assert plan.layout.metadata_size(form == "current", save_id) == len(data)


def test_many_keys_large_offsets_and_odd_row_counts_match_the_oracle() -> None:
    # 300 tensors (the memo passes 256 entries: BINPUT gives way to LONG_BINPUT), rows below, at and
    # above the world size, some not divisible by it, and rank files past 2**31 bytes (LONG1 offsets)
    rows = [1, 2, 3, 5, 7, 8, 13, 64, 1000, 0] * 30
    rows[-1] = 3_000_000  # 3,000,000 x 1024 fp32: 12 GB per tensor
    ckpt = big_checkpoint(rows, 1024)
    plan = dcp_write._plan(ckpt, Options(world_size=7))
    assert max(plan.file_sizes) > 2**31
    assert ours(plan) == oracle_items(plan)
    data = plan.layout.metadata(True, "s")
    assert data == oracle_metadata(plan, "current", "s")
    assert len(plan.layout) == sum(len(v) for v in plan.by_key().values())


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 8, 13, 64, 256])
def test_the_cores_dim0_split_is_model_dim0_shards(ws: int) -> None:
    # the one dim-0 rule of the writers, implemented twice (Python per rank, the core per key): they must agree
    for rows in [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 64, 100, 255, 256, 257, 1000, 4097]:
        leaves = [("w", ("w",), 0, "float32", [rows, 3], (10, 5, 1))]
        got = [(rank, (row0, 0), (n, 3)) for _, _, rank, _, _, row0, n in DcpLayout(leaves, ws).items()]
        seen: set[int] = set()
        want = []
        for r, box in dim0_shards((rows, 3), ws):
            if box.offsets[0] not in seen:
                seen.add(box.offsets[0])
                want.append((r, box.offsets, box.sizes))
        assert got == want, (rows, ws)


def test_a_plan_holds_keys_and_each_file_is_built_when_written(tmp_path: Path) -> None:
    ckpt = read_checkpoint(DATA / "zero3_ws3_bf16" / "checkpoint")
    plan = dcp_write.plan_write(ckpt, tmp_path / "out", Options(world_size=4))
    assert all(f.build is not None and not f.small and not f.fills for f in plan.files)
    f = plan.files[2].records()
    assert f.build is None and f.small and f.fills and f.finish is not None
    items = dcp_write._plan(ckpt, Options(world_size=4)).items_of(2)
    assert len(f.crc_ranges) == sum(1 for it in items if it.box is not None)  # a tensor's bytes, each
    assert any(it.box is None for it in items)  # and non-tensor items, which have none
    # the summary's size counts .metadata, which is only made at the commit
    out = dcp_write.write(ckpt, tmp_path / "written", Options(world_size=4))
    assert out["bytes"] == sum(p.stat().st_size for p in (tmp_path / "written").iterdir())
    assert out["items"] == plan.summary["items"] == sum(len(dcp_write._plan(ckpt, Options(world_size=4)).items_of(r)) for r in range(4))


def test_a_layout_the_core_cannot_hold_is_one_clear_error() -> None:
    ckpt = Checkpoint("zero", Path("/nonexistent"), world_size=1)
    for i in range(5):  # 2**61 bytes each: one rank file of more than 2**63
        ckpt.add(LogicalTensor(f"{MODEL}w{i}", (2**59,), "float32", [Chunk(Flat(0, 1), "float32", Path("/nonexistent/x"), 0)]))
    with pytest.raises(RavexError, match=r"cannot be laid out: a rank file would pass 2\*\*63 bytes"):
        dcp_write._plan(ckpt, Options(world_size=1))
    with pytest.raises(ValueError, match=r"leaves\[0\] kind must be 0, 1 or 2"):
        DcpLayout([("w", ("w",), 9, "float32", [1], (1, 1, 1))], 2)
    with pytest.raises(ValueError, match="path items must be str or int"):
        DcpLayout([("w", (1.5,), 0, "float32", [1], (1, 1, 1))], 2)
    with pytest.raises(ValueError, match="world size 0"):
        DcpLayout([], 0)


@pytest.mark.parametrize("name", ["zero3_ws3_bf16", "fsdp2_ws2", "zero2_ws2_fp32"])
def test_a_dry_run_in_batches_is_the_dry_run_in_one_call(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # convert --dry-run hands the core a bounded number of source chunks per call; the answer is the same
    conv = importlib.import_module("ravex_convert.convert")  # the package's `convert` is the function

    ckpt = read_checkpoint(DATA / name / "checkpoint")
    whole = conv.plan(ckpt, Options())
    monkeypatch.setattr(conv, "PLAN_BATCH_CHUNKS", 3)
    assert conv.plan(ckpt, Options()) == whole
    assert whole["runs"] > 0 and whole["source_files"] > 0


def test_a_job_for_part_of_a_tensor_lists_only_the_chunks_that_reach_it(tmp_path: Path) -> None:
    # a rank writing rows 4..8 of a 12 x 3 tensor stored in three flat chunks of 12 elements
    # (rows 0-3, 4-7, 8-11) hands the core only the middle chunk, and writes the right bytes
    import numpy as np

    from ravex_convert._engine import CopyJob, Target

    values = np.arange(36, dtype=np.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(values.tobytes())
    t = LogicalTensor(MODEL + "w", (12, 3), "float32", [Chunk(Flat(12 * k, 12), "float32", src, 48 * k) for k in range(3)])
    out = tmp_path / "out.bin"
    out.write_bytes(bytes(48))
    job = CopyJob()
    job.add(t, [Target(job.target(out), 0, Box((4, 0), (4, 3)), "float32")])
    assert [c[1] for c in job.tensors[0][1]] == [48]  # the middle chunk's byte offset, alone
    job.run(sync=False)
    assert np.frombuffer(out.read_bytes(), dtype=np.float32).tolist() == values[12:24].tolist()
    # targets across the whole tensor keep every chunk, in order (the first listed wins where chunks overlap)
    whole = CopyJob()
    whole.add(t, [Target(whole.target(tmp_path / "o2"), 0, Box((0, 0), (12, 3)), "float32")])
    assert [c[1] for c in whole.tensors[0][1]] == [0, 48, 96]
    # a box not on whole rows: the chunks its first and last elements fall in, and any between
    part = CopyJob()
    part.add(t, [Target(part.target(tmp_path / "o3"), 0, Box((3, 2), (2, 1)), "float32")])  # elements 11 and 14
    assert [c[1] for c in part.tensors[0][1]] == [0, 48]
