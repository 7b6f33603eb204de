"""Damaged and crafted DCP and safetensors checkpoints: each gets one clear error
(naming the file, with a hint, the right exit code), never a bare Python
exception, a read outside the checkpoint, or an output larger than its source.

Every input is made here from a copy of a fixture (fsdp2_ws2, safetensors_single,
safetensors_sharded); DCP metadata is rewritten with torch's own classes.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA, run_ravex
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

import ravex_convert
from ravex_convert import RavexError, read_checkpoint
from ravex_convert.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

DCP = DATA / "fsdp2_ws2" / "checkpoint"
SINGLE = DATA / "safetensors_single" / "checkpoint" / "model.safetensors"
SHARDED = DATA / "safetensors_sharded" / "checkpoint"


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def raises(kind: type[RavexError], fragment: str, fn: Callable[[], Any], where: Path) -> RavexError:
    """``fn()`` raises ``kind`` whose message holds ``fragment`` and names ``where``, with a hint."""
    with pytest.raises(kind) as info:
        fn()
    exc = info.value
    assert fragment in exc.message, exc.message
    assert str(where) in exc.message, exc.message
    assert exc.hint, exc.message
    return exc


def read_all(path: Path) -> None:
    ravex_convert.inspect(path)
    read_checkpoint(path)


# ---------------------------------------------------------------- safetensors


def st_parts() -> tuple[int, dict[str, Any], bytes]:
    raw = SINGLE.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def st_file(path: Path, header: dict[str, Any], data: bytes, n: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


def first_tensor(header: dict[str, Any]) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _st_cases() -> dict[str, tuple[Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes, int | None]], str]]:
    def entry(h: dict[str, Any], **kw: Any) -> dict[str, Any]:
        h[first_tensor(h)].update(kw)
        return h

    return {
        "header larger than 100 MB": (lambda h, d: (h, d, 200 * 1024 * 1024), "more than the 104857600 bytes"),
        "header larger than the file": (lambda h, d: (h, d, 10 ** 6), "but the file has only"),
        "unknown dtype": (lambda h, d: (entry(h, dtype="F9"), d, None), "dtype 'F9'"),
        "dtype not a string": (lambda h, d: (entry(h, dtype=4), d, None), "dtype 4"),
        "negative dimension": (lambda h, d: (entry(h, shape=[-1, 3]), d, None), "not a list of non-negative integers"),
        "shape of strings": (lambda h, d: (entry(h, shape=["a"]), d, None), "not a list of non-negative integers"),
        "offsets not a pair": (lambda h, d: (entry(h, data_offsets=[0]), d, None), "not [begin, end]"),
        "offsets reversed": (lambda h, d: (entry(h, data_offsets=[8, 4]), d, None), "not [begin, end]"),
        "offsets past the end": (lambda h, d: (entry(h, data_offsets=[0, len(d) + 64]), d, None), "past the end of the"),
        "shape x itemsize != bytes": (lambda h, d: (entry(h, shape=[1]), d, None), "expected)"),
        "entry not an object": (lambda h, d: ({**h, first_tensor(h): [1, 2]}, d, None), "not an object"),
        "header a list": (lambda h, d: ([h], d, None), "not an object"),  # type: ignore[list-item, return-value]
        "metadata not strings": (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d, None), "__metadata__"),
        "trailing bytes": (lambda h, d: (h, d + b"\0" * 8, None), "after the last tensor"),
    }


@pytest.mark.parametrize("case", list(_st_cases()))
def test_safetensors_header_damage_is_one_clear_error(tmp_path: Path, case: str) -> None:
    make, fragment = _st_cases()[case]
    _, header, data = st_parts()
    new_header, new_data, new_n = make(header, data)
    path = st_file(tmp_path / "model.safetensors", new_header, new_data, new_n)
    raises(CorruptCheckpointError, fragment, lambda: read_all(path), path)


def test_overlapping_entries_are_refused_not_multiplied(tmp_path: Path) -> None:
    """1,000 entries over the same 4 MiB: the format forbids overlaps; the file is refused
    at once instead of being written out as 4 GB."""
    data = bytes(4 << 20)
    header = {f"t{i}": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]} for i in range(1000)}
    path = st_file(tmp_path / "model.safetensors", header, data)
    t0 = time.perf_counter()
    res = run_ravex("convert", path, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode == 6, res.stderr
    assert "shares bytes 0..4194304 with another tensor (the format forbids overlaps)" in res.stderr and "hint:" in res.stderr
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "out.safetensors").exists()


def test_a_hole_in_the_data_is_refused(tmp_path: Path) -> None:
    _, header, data = st_parts()
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 4, end + 4]
    path = st_file(tmp_path / "model.safetensors", header, data + b"\0" * 4)
    raises(CorruptCheckpointError, "belong to no tensor (the format forbids holes)", lambda: read_all(path), path)


def test_deeply_nested_header_json(tmp_path: Path) -> None:
    raw = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    raises(CorruptCheckpointError, "the header is not JSON (RecursionError)", lambda: read_all(path), path)


def test_safetensors_truncated_at_every_boundary_and_flipped(tmp_path: Path) -> None:
    raw = SINGLE.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cuts = sorted({0, 1, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, len(raw) - 1})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(raw[:cut])
        raises(CorruptCheckpointError, "not a valid safetensors file", lambda p=path: read_all(p), path)  # type: ignore[misc]
    rng = random.Random(11)
    for i in range(40):  # flips in the header: an error or (a flip inside a name) a readable file, never a bare exception
        data = bytearray(raw)
        data[rng.randrange(0, 8 + n)] ^= 1 << rng.randrange(8)
        path = tmp_path / f"flip{i}.safetensors"
        path.write_bytes(bytes(data))
        try:
            read_all(path)
        except RavexError as exc:
            assert str(path) in exc.message and exc.hint, exc.message


def test_safetensors_cli_exit_code_and_hint(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(SINGLE.read_bytes()[:100])
    res = run_ravex("inspect", path)
    assert res.returncode == 6 and f"error: {path}: not a valid safetensors file" in res.stderr and "\nhint: " in res.stderr


@pytest.mark.parametrize("bad", ["../../x.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_is_refused(tmp_path: Path, bad: str) -> None:
    root = copy_dir(SHARDED, tmp_path / "ckpt")
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(SINGLE.read_bytes())
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = bad
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    raises(UnsafeCheckpointError, repr(bad), lambda: read_all(root), root / "model.safetensors.index.json")
    res = run_ravex("convert", root, tmp_path / "out", "--to", "safetensors")
    assert res.returncode == 7 and "hint:" in res.stderr and not (tmp_path / "out").exists()


def test_a_shard_symlinked_outside_is_refused(tmp_path: Path) -> None:
    root = copy_dir(SHARDED, tmp_path / "ckpt")
    shard = min(root.glob("*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    raises(UnsafeCheckpointError, "outside the checkpoint directory", lambda: read_all(root), root / "model.safetensors.index.json")


@pytest.mark.parametrize("text", ['{"weight_map": ["a"]}', '{"weight_map": {"a": 3}}', "[1]", '{"weight_map": {"a": "b"', "\xff\xfe", "[" * 100_000])
def test_index_of_the_wrong_json_types(tmp_path: Path, text: str) -> None:
    root = copy_dir(SHARDED, tmp_path / "ckpt")
    (root / "model.safetensors.index.json").write_bytes(text.encode("latin-1"))
    raises(CorruptCheckpointError, "not a valid safetensors index", lambda: read_all(root), root / "model.safetensors.index.json")


def test_two_shards_holding_one_tensor(tmp_path: Path) -> None:
    root = copy_dir(SHARDED, tmp_path / "ckpt")
    shards = sorted(root.glob("model-*.safetensors"))
    (root / "model.safetensors.index.json").unlink()
    (root / "copy.safetensors").write_bytes(shards[0].read_bytes())
    raises(CorruptCheckpointError, "holds too", lambda: read_all(root), root)


def test_safetensors_with_no_weights_is_not_written_as_an_empty_file(tmp_path: Path) -> None:
    from ravex_convert.model import Checkpoint

    src = Checkpoint("dcp", tmp_path)
    with pytest.raises(RavexError, match="holds no model weights"):
        ravex_convert.formats.safetensors.write(src, tmp_path / "o.safetensors", ravex_convert._output.Options())


# ---------------------------------------------------------------- DCP


def rewrite(root: Path, change: Callable[[Metadata], None]) -> None:
    md = pickle.loads((root / ".metadata").read_bytes())
    change(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def dcp_copy(tmp_path: Path, change: Callable[[Metadata], None] | None = None) -> Path:
    root = copy_dir(DCP, tmp_path / "ckpt")
    if change is not None:
        rewrite(root, change)
    return root


def _entry(md: Metadata, fqn: str, i: int = 0) -> Any:
    return [k for k in md.storage_data if k.fqn == fqn][i]


def _set_path(md: Metadata, fqn: str, rel: str) -> None:
    k = _entry(md, fqn)
    md.storage_data[k] = dataclasses.replace(md.storage_data[k], relative_path=rel)


@pytest.mark.parametrize("bad", ["../outside.distcp", "/etc/passwd", "a/../../outside.distcp"])
def test_dcp_data_file_outside_is_refused(tmp_path: Path, bad: str) -> None:
    (tmp_path / "outside.distcp").write_bytes((DCP / "__0_0.distcp").read_bytes())
    root = dcp_copy(tmp_path, lambda md: _set_path(md, "model.embed.weight", bad))
    raises(UnsafeCheckpointError, repr(bad), lambda: read_all(root), root / ".metadata")
    res = run_ravex("convert", root, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode == 7 and "hint:" in res.stderr


def test_dcp_data_file_symlinked_outside_is_refused(tmp_path: Path) -> None:
    root = dcp_copy(tmp_path)
    (tmp_path / "elsewhere.distcp").write_bytes((root / "__1_0.distcp").read_bytes())
    (root / "__1_0.distcp").unlink()
    (root / "__1_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    raises(UnsafeCheckpointError, "outside the checkpoint directory", lambda: read_all(root), root / ".metadata")


def _chunks(md: Metadata, key: str, chunks: list[tuple[list[int], list[int]]]) -> None:
    t = md.state_dict_metadata[key]
    assert isinstance(t, TensorStorageMetadata)
    t.chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]


def _dcp_cases() -> dict[str, tuple[Callable[[Metadata], None], str]]:
    # model.embed.weight is [37, 13], saved at world size 2 as rows 0..19 and 19..37
    def item(md: Metadata, fqn: str, **kw: Any) -> None:
        k = _entry(md, fqn)
        md.storage_data[k] = dataclasses.replace(md.storage_data[k], **kw)

    def planner(md: Metadata) -> None:
        md.planner_data["model.embed.weight"] = ("model", "other")

    def dtype(md: Metadata) -> None:
        md.state_dict_metadata["model.embed.weight"].properties.dtype = torch.complex32  # type: ignore[union-attr]

    def overlap(md: Metadata) -> None:
        a, b = _entry(md, "model.embed.weight", 0), _entry(md, "model.pos_embed", 0)
        md.storage_data[b] = dataclasses.replace(md.storage_data[b], relative_path=md.storage_data[a].relative_path,
                                                 offset=md.storage_data[a].offset)

    return {
        "chunk outside the tensor": (lambda md: _chunks(md, "model.embed.weight", [([0, 0], [19, 13]), ([19, 0], [19, 13])]),
                                     "reaches outside the tensor"),
        "chunks overlapping": (lambda md: _chunks(md, "model.embed.weight", [([0, 0], [19, 13]), ([18, 0], [18, 13])]), "both hold row 18"),
        "a chunk missing": (lambda md: _chunks(md, "model.embed.weight", [([0, 0], [19, 13])]), "its chunks hold 247 elements, the tensor has 481"),
        "wrong dimensions": (lambda md: _chunks(md, "model.embed.weight", [([0], [37])]), "wrong number of dimensions"),
        "storage past the file": (lambda md: item(md, "model.embed.weight", offset=10 ** 9), "but .metadata places 'model.embed.weight' up to byte"),
        "negative offset": (lambda md: item(md, "model.embed.weight", offset=-5), "not a non-negative integer"),
        "length of the wrong type": (lambda md: item(md, "model.embed.weight", length="12"), "not a non-negative integer"),
        "items sharing bytes": (overlap, "share bytes"),
        "transform descriptors": (lambda md: item(md, "model.embed.weight", transform_descriptors=["zstd"]), "stored through a transform"),
        "planner path mismatch": (planner, "planner_data places 'model.embed.weight'"),
        "unknown dtype": (dtype, "the global 'torch.complex32'"),  # refused by the restricted unpickler already
        "state_dict_metadata not a dict": (lambda md: setattr(md, "state_dict_metadata", [1]), "not a mapping"),
    }


@pytest.mark.parametrize("case", list(_dcp_cases()))
def test_dcp_metadata_damage_is_one_clear_error(tmp_path: Path, case: str) -> None:
    change, fragment = _dcp_cases()[case]
    root = dcp_copy(tmp_path, change)
    kind = {"transform descriptors": RavexError, "unknown dtype": UnsafeCheckpointError}.get(case, CorruptCheckpointError)
    exc = raises(kind, fragment, lambda: read_all(root), root)
    assert type(exc) is kind


def test_dcp_chunk_limit_and_its_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = dcp_copy(tmp_path, lambda md: _chunks(md, "model.embed.weight", [([i, 0], [1, 13]) for i in range(37)]))
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "36")
    raises(CorruptCheckpointError, "stored in 37 chunks, more than the limit of 36", lambda: read_all(root), root / ".metadata")
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "37")  # past the limit: the chunks are checked, and have no storage entries
    raises(CorruptCheckpointError, "no storage entry for tensor 'model.embed.weight' at offsets [1, 0]", lambda: read_all(root), root)
    monkeypatch.setenv("RAVEX_MAX_CHUNKS_PER_TENSOR", "many")
    with pytest.raises(RavexError, match="RAVEX_MAX_CHUNKS_PER_TENSOR='many': not a positive integer"):
        read_all(root)


def test_a_flipped_bit_in_tensor_bytes_fails_the_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = dcp_copy(tmp_path)
    chunk = read_checkpoint(root).tensors["model/embed.weight"].chunks[1]
    assert chunk.file is not None
    raw = bytearray(chunk.file.read_bytes())
    raw[chunk.offset + 5] ^= 0x10  # one bit of the tensor's bytes
    chunk.file.write_bytes(bytes(raw))
    ravex_convert.inspect(root)  # inspect reads metadata only
    raises(CorruptCheckpointError, "fails its CRC-32 check", lambda: read_checkpoint(root), chunk.file)
    res = run_ravex("convert", root, tmp_path / "out.safetensors", "--to", "safetensors")
    assert res.returncode == 6 and "CRC-32" in res.stderr and "hint:" in res.stderr
    monkeypatch.setenv("RAVEX_NO_CRC", "1")
    read_checkpoint(root)


def test_dcp_truncated_and_flipped_never_a_bare_exception(tmp_path: Path) -> None:
    """.metadata cut at several points and flipped, each .distcp cut at item boundaries:
    a RavexError naming a file, with a hint (or, for a harmless flip, a readable checkpoint)."""
    meta = (DCP / ".metadata").read_bytes()
    rng = random.Random(5)
    n = 0
    for cut in sorted({0, 1, 2, 100, len(meta) // 3, len(meta) // 2, len(meta) - 2, len(meta) - 1}):
        root = copy_dir(DCP, tmp_path / f"m{cut}")
        (root / ".metadata").write_bytes(meta[:cut])
        raises(CorruptCheckpointError, "", lambda r=root: read_all(r), root)  # type: ignore[misc]
        n += 1
    for i in range(30):
        root = copy_dir(DCP, tmp_path / f"f{i}")
        data = bytearray(meta)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (root / ".metadata").write_bytes(bytes(data))
        try:
            read_all(root)
        except RavexError as exc:
            assert str(root) in exc.message and exc.hint, exc.message
        n += 1
    md = pickle.loads(meta)
    for rank in (0, 1):
        name = f"__{rank}_0.distcp"
        spans = sorted((v.offset, v.length) for v in md.storage_data.values() if v.relative_path == name)
        raw = (DCP / name).read_bytes()
        for cut in (0, spans[1][0], spans[len(spans) // 2][0] + 10, len(raw) - 1):
            root = copy_dir(DCP, tmp_path / f"d{rank}_{cut}")
            (root / name).write_bytes(raw[:cut])
            raises(CorruptCheckpointError, "", lambda r=root: read_all(r), root)  # type: ignore[misc]
            n += 1
        for i in range(15):  # flips anywhere in a data file: caught by the zip structure, the pickle or the CRC-32
            root = copy_dir(DCP, tmp_path / f"g{rank}_{i}")
            data = bytearray(raw)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            (root / name).write_bytes(bytes(data))
            try:
                read_all(root)
            except RavexError as exc:
                assert str(root) in exc.message and exc.hint, exc.message
            n += 1
    assert n >= 60


def test_missing_data_file(tmp_path: Path) -> None:
    root = dcp_copy(tmp_path)
    (root / "__1_0.distcp").unlink()
    res = run_ravex("inspect", root)
    assert res.returncode == IncompleteCheckpointError.exit_code and "names data file '__1_0.distcp' but it is missing" in res.stderr
    assert "hint:" in res.stderr
