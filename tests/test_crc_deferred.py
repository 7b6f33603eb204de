"""A conversion checks its sources' CRC-32s from its own copy (``_torchzip.deferred_crcs``): the
executor hashes every stretch it copies unchanged, and only the bytes it did not copy are read
again, before anything is committed. Counted here through ``_core.checksum_ranges`` (the one
way Ravex reads bytes back to hash them): a DCP or torch.save source converted whole is read
once; what a weights-only output leaves out is still checked. A flipped bit in what is copied,
or in what is not, is refused as before, with no output left, dry run included."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA

from ravex_convert import ConvertOptions, _core, convert, read_checkpoint
from ravex_convert._torchfile import archive as _torchzip
from ravex_convert.errors import CorruptCheckpointError

DCP = DATA / "fsdp2_ws3" / "checkpoint"
ZERO = DATA / "zero3_ws2_fp32" / "checkpoint"
TORCH = DATA / "torch_save" / "checkpoint" / "model.pt"


@pytest.fixture
def reread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes hashed again for a CRC-32 check (not by the copy), call by call."""
    seen: list[int] = []
    real = _core.checksum_ranges

    def counted(path: str, ranges: Any, algo: Any) -> list[int]:
        if algo == "crc32":
            seen.append(sum(n for _, n in ranges))
        return real(path, ranges, algo)

    monkeypatch.setattr(_core, "checksum_ranges", counted)
    monkeypatch.delenv("RAVEX_NO_CRC", raising=False)
    return seen


@pytest.mark.parametrize(("src", "to", "kw"), [(DCP, "torch_save", {}), (DCP, "dcp", {"world_size": 2})], ids=["dcp-to-torch_save", "dcp-reshard"])
def test_a_whole_conversion_reads_its_source_once(src: Path, to: str, kw: dict[str, Any], tmp_path: Path, reread: list[int]) -> None:
    convert(src, tmp_path / "out", to, ConvertOptions(**kw))
    assert sum(reread) == 0  # every stored byte was copied unchanged: its CRC came from the copy
    read_checkpoint(src)  # outside a conversion the reader checks by reading, as before
    assert sum(reread) > 0


def test_a_zero_reshard_reads_again_only_what_it_does_not_copy(tmp_path: Path, reread: list[int]) -> None:
    read_checkpoint(ZERO)
    eager = sum(reread)
    reread.clear()
    convert(ZERO, tmp_path / "out", "zero", ConvertOptions(world_size=3), writer={"zero_stage": 3})
    # the partitions' alignment padding (never copied) is read to be checked; in this tiny
    # fixture it is a fifth of the bytes, in a real checkpoint a few bytes per parameter
    assert 0 < sum(reread) < eager / 2, (sum(reread), eager)


@pytest.mark.parametrize("src", [ZERO, TORCH], ids=["zero3", "torch_save"])
def test_what_a_weights_only_output_leaves_out_is_still_checked(src: Path, tmp_path: Path, reread: list[int]) -> None:
    read_checkpoint(src)
    eager = sum(reread)  # outside a conversion: every storage a chunk points into, read to be checked
    reread.clear()
    convert(src, tmp_path / "out.safetensors", "safetensors")
    deferred = sum(reread)
    # the optimizer's moments are still read to be checked; the fp32 weights the copy read are not read again
    weights = sum(t.nbytes for n, t in read_checkpoint(src).tensors.items() if n.startswith("model/"))
    assert eager - weights <= deferred < eager, (eager, weights, deferred)


def _flip_in(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


def _first_item(root: Path) -> tuple[Path, int]:
    """A DCP tensor item's file and a byte inside its data."""
    ckpt = read_checkpoint(root)
    c = next(t.chunks[0] for t in ckpt.tensors.values() if t.chunks and t.chunks[0].nbytes > 64)
    assert c.file is not None
    return c.file, c.offset + c.nbytes // 2


@pytest.mark.parametrize("dry_run", [False, True], ids=["convert", "dry-run"])
def test_a_flipped_bit_in_a_copied_dcp_item_is_refused_and_nothing_is_left(tmp_path: Path, dry_run: bool, reread: list[int]) -> None:
    src = tmp_path / "dcp"
    shutil.copytree(DCP, src)
    file, at = _first_item(src)
    _flip_in(file, at)
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    with pytest.raises(CorruptCheckpointError, match="fails its CRC-32 check") as info:
        convert(src, out, "torch_save", ConvertOptions(dry_run=dry_run))
    assert str(file) in info.value.message
    assert list(out.parent.iterdir()) == []


def test_segments_cover_a_range_with_the_pieces_and_the_gaps_between() -> None:
    seg = _torchzip._segments
    pieces = sorted([(10, 5, 1), (15, 5, 2), (12, 2, 9), (30, 10, 3), (25, 10, 4)], key=lambda p: (p[0], -p[1]))
    starts = [p[0] for p in pieces]
    # 10..20 from two pieces (12..14 overlaps what is covered), 20..25 a gap, 25..35 reaches past the range: a gap
    assert seg(pieces, starts, 10, 20) == [(10, 5, 1), (15, 5, 2), (20, 10, None)]
    assert seg(pieces, starts, 0, 10) == [(0, 10, None)]
    assert seg(pieces, starts, 25, 15) == [(25, 10, 4), (35, 5, None)]
    assert seg(pieces, starts, 5, 0) == []
