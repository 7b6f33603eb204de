"""Durable output is written around the page cache (the executor's ``direct``: O_DIRECT on the
whole pages of each piece, the partial pages at its ends through the cache). The bytes must be
the same as through the cache, for every output format, for a cast and at any offset; ``--no-sync``
and ``RAVEX_DIRECT_IO=0`` keep to the page cache, and so do files read back before they close
(compression's scratch files, object storage's spools). A native store's chunk checksums are
hashed by the copy as it writes, not read back. The runtime's configuration accepts the
converter's own variables (an error's hint may tell a user to set one)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA
from safetensors.torch import load_file

from ravex_convert import ConvertOptions, _core, convert, read_checkpoint, verify
from ravex_convert._engine import CopyJob
from ravex_convert.formats.native import reader as native
from ravex_runtime.config import load_config


def _direct_works(path: Path) -> bool:
    """Whether ``path``'s file system takes an aligned O_DIRECT write (ext4 does)."""
    import mmap

    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    """``(direct asked, bytes written direct)`` of every executor call."""
    seen: list[tuple[bool, int]] = []
    real = _core.execute

    def recorded(*a: Any, **k: Any) -> dict[str, Any]:
        out = real(*a, **k)
        seen.append((bool(k.get("direct", False)), int(out["direct_bytes"])))
        return out

    monkeypatch.setattr(_core, "execute", recorded)
    return seen


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.save checkpoint with tensors of awkward sizes: several MiB (many 1 MiB steps and
    pieces), a page and one element, a few elements; fp32 and bf16."""
    g = torch.Generator().manual_seed(7)
    model = {
        "big": torch.randn(1_300_001, generator=g),
        "page_and_one": torch.randn(1025, generator=g),
        "tiny": torch.randn(3, generator=g),
        "half": torch.randn(700_003, generator=g).to(torch.bfloat16),
        "grid": torch.randn(513, 1031, generator=g),
    }
    path = tmp_path_factory.mktemp("direct") / "model.pt"
    torch.save({"model": model}, path)
    return path


# (metadata_checksum: the manifest's hash of checkpoint.json, which holds a run id and a time)
_STAMPS = {"created_unix", "store_id", "run_id", "metadata_checksum"}


def _stamped(name: str, data: bytes) -> Any:
    """A file's bytes; a JSON file's document without the keys that differ from save to save."""
    if not name.endswith(".json"):
        return data

    def drop(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: drop(v) for k, v in x.items() if k not in _STAMPS}
        return [drop(v) for v in x] if isinstance(x, list) else x

    return drop(json.loads(data))


def _tree(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock"}


@pytest.mark.parametrize("to,extra", [("torch_save", {}), ("safetensors", {}), ("dcp", {"world_size": 3}),
                                      ("native", {"world_size": 2}), ("safetensors", {"dtype": "bfloat16"})])
def test_direct_writes_the_same_bytes_as_the_page_cache(source: Path, tmp_path: Path, calls: list[tuple[bool, int]],
                                                        monkeypatch: pytest.MonkeyPatch, to: str, extra: dict[str, Any]) -> None:
    name = "out.pt" if to == "torch_save" else "out"
    (tmp_path / "cached").mkdir()
    (tmp_path / "direct").mkdir()
    # both written at one path, then moved aside
    monkeypatch.setenv("RAVEX_DIRECT_IO", "0")
    convert(source, tmp_path / name, to, ConvertOptions(**extra))
    (tmp_path / name).rename(tmp_path / "cached" / name)
    assert calls and all(not asked and n == 0 for asked, n in calls), calls
    calls.clear()
    monkeypatch.delenv("RAVEX_DIRECT_IO")
    convert(source, tmp_path / name, to, ConvertOptions(**extra))
    (tmp_path / name).rename(tmp_path / "direct" / name)
    if os.environ.get("RAVEX_STORAGE") == "objdir":
        # read back before they close, so they stay in the cache: on object storage every spool
        # (uploaded on close)
        assert calls and all(not asked and n == 0 for asked, n in calls), calls
    else:
        assert calls and all(asked for asked, _ in calls), calls
        if _direct_works(tmp_path):
            assert sum(n for _, n in calls) > 4 << 20, calls
    cached, direct = _tree(tmp_path / "cached" / name), _tree(tmp_path / "direct" / name)
    assert cached.keys() == direct.keys()
    # every save has its own ids and times: DCP's .metadata a save id (a uuid, as torch writes),
    # a native store's JSON its store and run ids and creation times; the rest is byte for byte
    differ = [k for k in cached if k != ".metadata" and _stamped(k, cached[k]) != _stamped(k, direct[k])]
    assert not differ, differ
    if to == "native":
        # the chunk checksums the copy hashed are those of the bytes on disk
        for where in ("cached", "direct"):
            assert verify(source, tmp_path / where / name).identical
            native.verify_chunks(read_checkpoint(tmp_path / where / name))
    if to == "safetensors":
        got = load_file(str(tmp_path / "direct" / name / "model.safetensors"))
        want = torch.load(source, weights_only=True)["model"]
        for k, t in want.items():
            t = t.to(torch.bfloat16) if extra.get("dtype") and t.is_floating_point() else t
            assert torch.equal(got[k], t), k


def test_no_sync_and_the_switch_keep_to_the_page_cache(source: Path, tmp_path: Path, calls: list[tuple[bool, int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    convert(source, tmp_path / "a.pt", "torch_save", ConvertOptions(sync=False))
    assert calls and all(not asked and n == 0 for asked, n in calls), calls
    calls.clear()
    monkeypatch.setenv("RAVEX_DIRECT_IO", "off")
    convert(source, tmp_path / "b.pt", "torch_save")
    assert calls and all(not asked for asked, _ in calls), calls
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_the_runtime_accepts_the_converters_own_variables(tmp_path: Path) -> None:
    env = {"RAVEX_DIRECT_IO": "0", "RAVEX_NO_CRC": "1", "RAVEX_MAX_PICKLE_BYTES": str(1 << 30), "RAVEX_DEBUG": "1"}
    cfg = load_config(cwd=tmp_path, environ=env)
    assert cfg.checkpoint_every == 100  # loaded, the defaults untouched


def test_a_zip_entry_filled_over_several_batches_is_not_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ZeRO flat partition is one zip entry filled by many tensors; the copy runs in batches,
    and the entry's CRC-32 is joined from every batch's pieces. Read back instead, it came from
    the disk after a direct write (2.5 s of a 3.9 s conversion at 2.5 GB)."""
    src = DATA / "zero3_ws2_fp32" / "checkpoint"
    (tmp_path / "one").mkdir()
    convert(src, tmp_path / "out", "zero", writer={"zero_stage": 3})
    (tmp_path / "out").rename(tmp_path / "one" / "out")
    real_run = CopyJob.run
    monkeypatch.setattr(CopyJob, "run", lambda self, **k: real_run(self, **{**k, "batch_bytes": 1}))  # a batch per tensor
    reread: list[str] = []
    real = _core.checksum_ranges

    def counted(path: str, ranges: Any, algo: Any) -> list[int]:
        reread.append(path)
        return real(path, ranges, algo)

    monkeypatch.setattr(_core, "checksum_ranges", counted)
    convert(src, tmp_path / "out", "zero", writer={"zero_stage": 3})
    assert not [p for p in reread if Path(p).is_relative_to(tmp_path)], reread
    one, many = _tree(tmp_path / "one" / "out"), _tree(tmp_path / "out")
    assert one.keys() == many.keys()
    assert [k for k in one if one[k] != many[k]] == []


@pytest.mark.parametrize("threads", [1, 2])
def test_a_native_stores_checksums_come_from_the_copy(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """The seal reads back only chunks the copy could not hash: none with one copy thread; with
    two, at most the chunk where their stretches of a file meet (one per file here). Each checksum
    is that of the bytes on disk."""
    read_back: list[tuple[int, int]] = []
    real = _core.checksum_ranges

    def recorded(path: str, ranges: list[tuple[int, int]], algo: str) -> list[int]:
        read_back.extend(ranges)
        return real(path, ranges, algo)

    real_run = CopyJob.run
    monkeypatch.setattr(CopyJob, "run", lambda self, **k: real_run(self, **{**k, "threads": threads}))
    monkeypatch.setattr(_core, "checksum_ranges", recorded)
    convert(source, tmp_path / "store", "native", ConvertOptions(world_size=2))
    ckpt = read_checkpoint(tmp_path / "store")
    files = {c.file for t in ckpt.tensors.values() for c in t.chunks}
    assert len(read_back) <= (threads - 1) * len(files), read_back
    native.verify_chunks(ckpt)
    assert verify(source, tmp_path / "store").identical


def test_a_compressed_native_store_is_still_hashed_right(source: Path, tmp_path: Path, calls: list[tuple[bool, int]]) -> None:
    """zstd: the copy goes to a scratch file that the seal compresses (read back, so cached), and
    the checksums (of the uncompressed chunks) still come from the copy."""
    convert(source, tmp_path / "store", "native", writer={"compression": "zstd"})
    assert calls and all(not asked for asked, _ in calls), calls
    native.verify_chunks(read_checkpoint(tmp_path / "store"))
    assert verify(source, tmp_path / "store").identical
