"""The executor writes into memory as it writes into files: a checkpoint's
tensors land straight in live tensors' bytes (what the runtime's restore
does), cast where asked, compressed chunks included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DATA

from ravex_convert import ConvertOptions, _core, convert, load_state_dict, read_checkpoint
from ravex_convert._engine import read_into
from ravex_convert.convert import materialize
from ravex_convert.errors import RavexError
from ravex_convert.model import Checkpoint


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("name", ["zero3_ws3_bf16", "fsdp2_ws3", "zero2_ws2_fp32", "native_zstd"])
def test_every_tensor_lands_in_a_live_tensor_bit_exact(name: str, tmp_path: Path) -> None:
    src = DATA / "zero3_ws2_fp32" / "checkpoint" if name == "native_zstd" else DATA / name / "checkpoint"
    if name == "native_zstd":
        convert(src, tmp_path / "store", "native", ConvertOptions(world_size=2), writer={"compression": "zstd"})
        src = tmp_path / "store"
    ck = read_checkpoint(src)
    checked = 0
    for logical, t in ck.tensors.items():
        if not logical.startswith(("model/", "optim/")):
            continue
        # the reference: the pure-Python assembly of the same chunks (numpy), independent of the executor
        raw = bytearray(materialize(t))
        want = torch.frombuffer(raw, dtype=getattr(torch, t.dtype)).reshape(t.shape) if raw else torch.empty(t.shape, dtype=getattr(torch, t.dtype))
        live = torch.full(t.shape, 7, dtype=getattr(torch, t.dtype))
        read_into(t, _bytes_of(live))
        assert torch.equal(live, want), logical
        if t.dtype == "float32":  # and cast on the way, as a bf16 run restores fp32 masters
            half = torch.empty(t.shape, dtype=torch.bfloat16)
            read_into(t, _bytes_of(half), "bfloat16")
            assert torch.equal(half, want.to(torch.bfloat16)), logical
        checked += 1
    assert checked > 100
    ref = load_state_dict(src, optimizer=True)  # which reads through the executor too
    assert all(torch.equal(v, ref["model"][k[len("model/"):]]) for k, v in _materialized(ck).items() if k.startswith("model/"))


def _materialized(ck: Checkpoint) -> dict[str, torch.Tensor]:
    out = {}
    for logical, t in ck.tensors.items():
        raw = bytearray(materialize(t))
        out[logical] = torch.frombuffer(raw, dtype=getattr(torch, t.dtype)).reshape(t.shape) if raw else torch.empty(t.shape, dtype=getattr(torch, t.dtype))
    return out


def test_a_wrong_sized_or_read_only_buffer_is_refused_before_anything_is_written() -> None:
    ck = read_checkpoint(DATA / "zero2_ws2_fp32" / "checkpoint")
    t = next(v for k, v in ck.tensors.items() if k.startswith("model/") and v.numel > 1)
    short = bytearray(b"\x01" * (t.numel * 4 - 4))
    with pytest.raises(RavexError, match="bytes to restore into"):
        read_into(t, short)
    assert short == bytearray(b"\x01" * len(short))
    with pytest.raises(ValueError, match="read-only"):
        _core.execute([bytes(4)], [memoryview(bytes(4))], [([4], [(0, 0, ("flat", 0, 4), "uint8")], [(0, 0, ("flat", 0, 4), "uint8")])])
