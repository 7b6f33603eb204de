"""zero.read() on every DeepSpeed fixture: each logical tensor, gathered from
the byte ranges its chunks name, is bit-identical to the state recorded inside
the training process at save time (reference/true_state.safetensors), every
element is covered exactly once, and the small state (Adam step, param groups,
frozen params, tied aliases) matches reference/true_state.json."""

from __future__ import annotations

import json
import shutil
import struct
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DATA, run_without_torch

from ravex_convert._engine import chunk_bytes
from ravex_convert._torchfile.archive import TorchArchive
from ravex_convert._torchfile.unpickle import Record
from ravex_convert.errors import CorruptCheckpointError
from ravex_convert.formats.zero import reader as zero
from ravex_convert.formats.zero.layout import GeometryError, Piece, RankFile, check_slice_mappings, flat_group_pieces, stage3_pieces
from ravex_convert.model import Box, Checkpoint, Flat, LogicalTensor, itemsize

ZERO_FIXTURES = [
    "zero1_ws2_fp32",
    "zero2_ws2_fp32",
    "zero3_ws2_fp32",
    "zero1_ws3_fp32",
    "zero2_ws3_fp32",
    "zero3_ws3_fp32",
    "zero1_ws2_bf16",
    "zero2_ws2_bf16",
    "zero3_ws2_bf16",
    "zero3_ws3_bf16",
    "bf16opt_ws2",
    "zero2e_ws2_fp32",  # elastic_checkpoint: lean per-group optimizer state
    "zero1e_ws3_bf16",
    "zero3sg_ws3_bf16",  # ZeRO-3 sub_group_size: several flat tensors per rank
    "zero3sg_ws2_fp32",
]
ELASTIC = {"zero2e_ws2_fp32", "zero1e_ws3_bf16"}

# safetensors dtype codes -> Ravex dtype names
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64", "I32": "int32", "BOOL": "bool", "U8": "uint8"}
_LANES: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """name -> (dtype, shape, elements as unsigned ints of the same width): bit
    patterns, so bf16 needs no numpy dtype and NaNs compare equal."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        data = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=_LANES[itemsize(dtype)])
        out[name] = (dtype, tuple(info["shape"]), data)
    return out


@cache
def _truth(name: str) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...], np.ndarray]]]:
    ref = DATA / name / "reference"
    return json.loads((ref / "true_state.json").read_text()), _read_safetensors(ref / "true_state.safetensors")


@cache
def _read(name: str) -> Checkpoint:
    return zero.read(DATA / name / "checkpoint")


def _gather(t: LogicalTensor) -> np.ndarray:
    """The test's own gather: bytes at each chunk's file offset, placed by region.
    Asserts every element is covered exactly once."""
    lanes = _LANES[itemsize(t.dtype)]
    out = np.zeros(t.numel, dtype=lanes)
    hits = np.zeros(t.numel, dtype=np.int64)
    for c in t.chunks:
        assert c.dtype == t.dtype, t.name
        raw = chunk_bytes(c)
        assert len(raw) == c.nbytes, (t.name, c)
        values = np.frombuffer(raw, dtype=lanes)
        if isinstance(c.region, Flat):
            assert 0 <= c.region.start and c.region.start + c.region.length <= t.numel, (t.name, c.region)
            where = np.arange(c.region.start, c.region.start + c.region.length)
        else:
            assert isinstance(c.region, Box)
            index = np.arange(t.numel).reshape(t.shape)
            where = index[tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))].ravel()
            assert where.size == c.region.numel, (t.name, c.region)
        out[where] = values
        hits[where] += 1
    assert (hits == 1).all(), f"{t.name}: elements covered {sorted(set(hits.tolist()))} times"
    return out


def _target(ckpt: Checkpoint, logical: str) -> str:
    """The stored name of ``<kind>/<fqn>`` with the fqn's tie (model alias) followed."""
    kind, fqn = logical.rsplit("/", 1) if logical.startswith("model/") else ("/".join(logical.split("/")[:2]), logical.split("/", 2)[2])
    target = ckpt.aliases.get(f"model/{fqn}", f"model/{fqn}")[len("model/") :]
    return f"{kind}/{target}"


@pytest.mark.parametrize("name", ZERO_FIXTURES)
def test_tensors_bit_identical_to_true_state(name: str) -> None:
    ckpt = _read(name)
    _, truth = _truth(name)
    compared = 0
    for key, (dtype, shape, expected) in truth.items():
        if not key.startswith(("model/", "optim/exp_avg/", "optim/exp_avg_sq/")):
            continue  # module/<fqn>: the working-precision copy, not part of the logical state
        stored = _target(ckpt, key)
        assert stored in ckpt.tensors, f"{key} is not in the checkpoint read"
        t = ckpt.tensors[stored]
        assert (t.dtype, t.shape) == (dtype, shape), key
        got = _gather(t)
        bad = np.flatnonzero(got != expected)
        assert bad.size == 0, f"{key}: {bad.size} of {t.numel} elements differ, first at {bad[0]}"
        compared += 1
    assert compared >= 42 + 37 * 2
    # nothing beyond the truth (aliases are not stored twice)
    for logical in ckpt.tensors:
        if logical.startswith(("model/", "optim/exp_avg/", "optim/exp_avg_sq/")):
            assert logical in truth, f"{logical} read but not in the true state"


@pytest.mark.parametrize("name", ZERO_FIXTURES)
def test_every_element_covered_once(name: str) -> None:
    ckpt = _read(name)
    for t in ckpt.tensors.values():
        _gather(t)


@pytest.mark.parametrize("name", ZERO_FIXTURES)
def test_small_state(name: str) -> None:
    ckpt = _read(name)
    true, _ = _truth(name)
    assert ckpt.format == "zero" and ckpt.world_size == true["world_size"] and ckpt.step == true["global_step"]
    variant = "bf16_optimizer" if true["optimizer_variant"] == "bf16_optimizer" else f"zero{true['zero_stage']}"
    assert ckpt.source["variant"] == variant
    assert (ckpt.source["precision"], ckpt.source["tag"], ckpt.source["ds_version"]) == (true["precision"], "global_step3", true["versions"]["deepspeed"])
    # Adam's step, one 0-d float32 per parameter (tied names included, through the alias)
    for fqn, step in true["adam_step"].items():
        t = ckpt.tensors[_target(ckpt, f"optim/step/{fqn}")]
        assert (t.shape, t.dtype) == ((), "float32")
        (value,) = struct.unpack("<f", _gather(t).tobytes())
        assert value == step, fqn
    # param groups: members in order and every hyper-parameter
    groups = ckpt.objects["optim.param_groups"]
    assert len(groups) == len(true["param_groups"])
    for got, want in zip(groups, true["param_groups"]):
        if name in ELASTIC:
            # an elastic save keeps no group hyper-parameters: members only, and said so
            assert got == {"params": want["params"]}
            assert any("elastic" in n for n in ckpt.notes)
            continue
        assert isinstance(got["betas"], tuple)
        assert {**got, "betas": list(got["betas"])} == want
    # ties, frozen params, buffers
    assert {(f"model/{b}", f"model/{a}") for a, b in true["tied_aliases"]} == set(ckpt.aliases.items())
    for fqn in true["frozen_params"] + true["persistent_buffers"]:
        assert f"model/{fqn}" in ckpt.tensors
    assert sorted(ckpt.model_names()) == sorted(true["state_dict_keys"])
    assert ckpt.objects["lr_scheduler"] == true["lr_scheduler_state"]
    provenance = ckpt.objects["zero"]
    assert (provenance["world_size"], provenance["precision"], provenance["global_steps"]) == (true["world_size"], true["precision"], 3)
    if variant != "bf16_optimizer":
        assert ckpt.objects["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}


@pytest.mark.parametrize("name", ["zero1_ws2_fp32", "zero1_ws3_fp32", "zero1_ws2_bf16"])
def test_zero1_frozen_param_that_zero_to_fp32_drops(name: str) -> None:
    assert "pos_embed" not in _read_safetensors(DATA / name / "reference" / "zero_to_fp32.safetensors")  # the reference tool drops it ...
    t = _read(name).tensors["model/pos_embed"]  # ... Ravex has it, bit-exact (test above)
    assert t.shape == (7, 13) and t.dtype == ("bfloat16" if "bf16" in name else "float32")


def test_truncated_optimizer_file_is_reported(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(DATA / "zero2_ws2_fp32" / "checkpoint", ckpt)
    victim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 700])
    with pytest.raises(CorruptCheckpointError) as err:
        zero.read(ckpt)
    assert str(victim) in str(err.value) and err.value.hint


def test_truncated_stage3_model_states_is_reported(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(DATA / "zero3_ws3_bf16" / "checkpoint", ckpt)
    victim = ckpt / "global_step3" / "zero_pp_rank_2_mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:5000])
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_2_mp_rank_00_model_states.pt"):
        zero.read(ckpt)


def test_read_does_not_import_torch() -> None:
    out = run_without_torch("import sys; from pathlib import Path; from ravex_convert.formats.zero import reader as zero; "
                            "print(len(zero.read(Path(sys.argv[1])).tensors))", str(DATA / "zero3_ws3_bf16" / "checkpoint"))
    assert int(out) > 0


# ---------------------------------------------------------------------------- geometry


def test_flat_group_pieces_with_alignment_padding() -> None:
    # three params of 5, 3 and 4 elements, the first padded by 1: flat [0,5) pad [6,9) [9,13); 2 ranks of 7
    pieces, used = flat_group_pieces([5, 3, 4], [1, 0, 0], 7, 2, 0)
    assert used == 13
    assert pieces[0] == [Piece(0, 0, 0, 0, 5)]
    assert pieces[1] == [Piece(0, 0, 6, 0, 1), Piece(1, 0, 0, 1, 2)]
    assert pieces[2] == [Piece(1, 0, 2, 0, 4)]
    with pytest.raises(GeometryError):
        flat_group_pieces([5, 3, 4], None, 5, 2, 0)


def test_stage3_pieces_straddle_sub_groups() -> None:
    # ws 2: params of 5 (3 per rank) and 4 (2 per rank); sub-groups of 4 and 1 elements per rank
    pieces, homes = stage3_pieces([5, 4], [4, 1], 2)
    assert pieces[0] == [Piece(0, 0, 0, 0, 3), Piece(1, 0, 0, 3, 2)]
    assert pieces[1] == [Piece(0, 0, 3, 0, 1), Piece(0, 1, 0, 1, 1), Piece(1, 0, 3, 2, 1), Piece(1, 1, 0, 3, 1)]
    assert homes == [0, 0]
    with pytest.raises(GeometryError):
        stage3_pieces([5, 4], [4, 2], 2)


def _ranks_with_mappings(per_rank: list[dict[str, tuple[int, int]]]) -> list[RankFile]:
    def address(numel: int, start: int) -> Record:
        return Record("deepspeed.utils.tensor_fragment.fragment_address", (), {"numel": numel, "start": start})

    return [
        RankFile(r, TorchArchive(Path(f"rank{r}.pt"), 0, None, {}, {}), {"param_slice_mappings": [{k: address(*v) for k, v in m.items()}]})
        for r, m in enumerate(per_rank)
    ]


def test_slice_mappings_cross_check() -> None:
    shapes = {"a": (5,), "b": (3,), "c": (4,)}  # flat a[0,5) b[5,8) c[8,12), 2 ranks of 6
    pieces, _ = flat_group_pieces([5, 3, 4], None, 6, 2, 0)
    good = [{"a": (5, 0), "b": (1, 5)}, {"b": (2, 0), "c": (4, 2)}]
    assert check_slice_mappings(_ranks_with_mappings(good), 0, shapes, None, 6, pieces) == (["a", "b", "c"], None)
    # DeepSpeed's round_robin_gradients bug: mappings laid out in the unshuffled order c, a, b
    shuffled = [{"c": (4, 0), "a": (2, 4)}, {"a": (3, 0), "b": (3, 3)}]
    order, note = check_slice_mappings(_ranks_with_mappings(shuffled), 0, shapes, None, 6, pieces)
    assert order == ["c", "a", "b"] and note and "round_robin_gradients" in note
    wrong = [{"a": (5, 0), "b": (1, 5)}, {"b": (2, 0), "c": (4, 1)}]
    with pytest.raises(CorruptCheckpointError, match=r"rank1\.pt: param_slice_mappings of param group 0 places 'c'"):
        check_slice_mappings(_ranks_with_mappings(wrong), 0, shapes, None, 6, pieces)
