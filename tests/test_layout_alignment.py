"""Where tensor bytes land in the zip-based outputs: 64-byte aligned as torch.save
aligns them, and at their source's offset within a 4 KiB page where that keeps
the 64-byte alignment (so each write moves whole pages of both files)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from ravex_convert import convert
from ravex_convert._engine import PAGE, page_residue, vote_residue
from ravex_convert._torchfile.write import ZipLayout
from ravex_convert.model import Box, Chunk, Flat, LogicalTensor

pytestmark = pytest.mark.usefixtures("storage_backend")  # every test on every backend (conftest)


def test_records_take_the_residue_asked_when_it_keeps_64_byte_alignment() -> None:
    layout = ZipLayout("archive")
    layout.add("data.pkl", 100, b"x" * 100)
    aligned = layout.add("data/0", 5000, residue=3 * 64)
    odd = layout.add("data/1", 5000, residue=3 * 64 + 4)  # would break torch's 64-byte alignment: ignored
    assert aligned.data_offset % PAGE == 3 * 64
    assert odd.data_offset % 64 == 0
    inner = ZipLayout("archive", base=100)  # an archive 100 bytes into its file (a DCP item)
    rec = inner.add("data/0", 10, residue=(100 + 128) % PAGE)
    assert (100 + rec.data_offset) % PAGE == 228 and rec.data_offset % 64 == 0


def test_page_residue_follows_the_source_chunk_holding_most_bytes(tmp_path: Path) -> None:
    f1, f2 = tmp_path / "a", tmp_path / "b"
    t = LogicalTensor("model/w", (10, 100), "float32", [
        Chunk(Flat(0, 300), "float32", file=f1, offset=4096 + 40),  # rows 0-2
        Chunk(Flat(300, 700), "float32", file=f2, offset=8192 + 1000),  # rows 3-9
    ])
    # the whole tensor: most bytes come from f2, whose element 300 sits at 1000 within its page
    assert page_residue(t, Box((0, 0), (10, 100)), "float32") == ((1000 - 300 * 4) % PAGE, 700 * 4)
    assert page_residue(t, Box((1, 0), (1, 100)), "float32") == ((40 + 100 * 4) % PAGE, 400)
    assert page_residue(t, Box((0, 0), (10, 100)), "bfloat16") is None  # a cast: no file-to-file copy
    assert vote_residue([(64, 10), (128, 7), (128, 5)]) == 128
    assert vote_residue([]) is None


def test_torch_save_records_sit_at_their_source_page_offsets_and_load(tmp_path: Path) -> None:
    # A source whose tensors start at many page offsets: each output record starts at the same one.
    src = tmp_path / "src.pt"
    sd = {f"w{i}": torch.arange(1000 + 37 * i, dtype=torch.float32) + 10000 * i for i in range(6)}
    torch.save(sd, src)
    out = tmp_path / "out.pt"
    convert(src, out, to="torch_save")
    offsets = {}
    for path in (src, out):
        with zipfile.ZipFile(path) as z:
            raw = path.read_bytes()
            for info in z.infolist():
                if "/data/" in info.filename:
                    n, e = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
                        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
                    start = info.header_offset + 30 + n + e
                    offsets.setdefault(raw[start:start + 64], []).append(start % PAGE)
    pairs = [v for v in offsets.values() if len(v) == 2]
    assert len(pairs) == 6
    assert all(a == b for a, b in pairs), pairs
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in sd.items())
