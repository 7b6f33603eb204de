"""Hostile and damaged torch.save / DeepSpeed files (issue 11): crafted tensor
views, pickles that exhaust time or memory, bit rot under the zip CRC-32,
truncated rank files at inspect, a DeepSpeed ``latest`` pointing outside the
checkpoint, and truncations / flipped bytes that must give one clear error.

The hostile files are built here: a torch.save-shaped zip around a pickle
written byte by byte (the opcodes torch.save emits for a tensor)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, run_ravex

from ravex_convert._torchfile.archive import open_archive
from ravex_convert._torchfile.unpickle import StorageRef, restricted_loads
from ravex_convert.detect import inspect, read_checkpoint
from ravex_convert.errors import CorruptCheckpointError, RavexError, UnsafeCheckpointError

TORCH_SAVE = DATA / "torch_save" / "checkpoint" / "model.pt"
ZERO3 = DATA / "zero3_ws2_bf16" / "checkpoint"
ZERO3_WS3 = DATA / "zero3_ws3_fp32" / "checkpoint"

# ----------------------------------------------------------------------------
# A torch.save file written by hand.


def _int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v) if -(2**31) <= v < 2**31 else b"\x8a\x08" + struct.pack("<q", v)


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _tensor(offset: int, shape: tuple[int, ...], stride: tuple[int, ...], numel: int = 12, key: str = "0") -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())``."""
    storage = _tuple([_str("storage"), b"ctorch\nFloatStorage\n", _str(key), _str("cpu"), _int(numel)]) + b"Q"
    args = storage + _int(offset) + _tuple([_int(d) for d in shape]) + _tuple([_int(s) for s in stride])
    return b"ctorch._utils\n_rebuild_tensor_v2\n(" + args + b"\x89ccollections\nOrderedDict\n)RtR"


def _dict(items: list[tuple[str, bytes]]) -> bytes:
    return b"}(" + b"".join(_str(k) + v for k, v in items) + b"u"


def _write_pt(path: Path, pickle_body: bytes, data: bytes = np.arange(12, dtype=np.float32).tobytes()) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + pickle_body + b".")
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", data)
        z.writestr("archive/version", "3\n")
    return path


def _state_dict_pt(path: Path, **tensors: bytes) -> Path:
    return _write_pt(path, _dict(list(tensors.items())))


def _convert_refused(src: Path, tmp_path: Path, code: int, *fragments: str) -> str:
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir(exist_ok=True)
    res = run_ravex("convert", src, out, "--to", "safetensors")
    assert res.returncode == code, res.stderr
    for f in fragments:
        assert f in res.stderr, res.stderr
    assert "hint:" in res.stderr
    assert "Traceback" not in res.stderr
    assert list(out.parent.iterdir()) == []  # no output, no temporary left behind
    return res.stderr


# ----------------------------------------------------------------------------
# 1. Views reaching outside their storage (before: SIGSEGV, or process memory copied into the output).

BAD_VIEWS = {
    "offset_past_end": (_tensor(10, (4,), (1,)), "reaches element 13 of its storage data/0, which holds 12 elements"),
    "stride_past_end": (_tensor(1, (3, 4), (1, 4)), "reaches element 15"),
    "huge_stride": (_tensor(0, (2, 2), (10**9, 1)), "reaches element 1000000001"),
    "huge_offset": (_tensor(2**40, (2, 3), (1, 2)), "reaches element"),
    "negative_offset": (_tensor(-1_000_000, (2, 3), (1, 2)), "before its storage"),
    "negative_stride": (_tensor(11, (4, 3), (-3, 1)), "has a negative stride"),
    "negative_dim": (_tensor(0, (-1, 4), (4, 1)), "has a negative dimension"),
    "fewer_strides": (_tensor(0, (3, 4), (1,)), "has 2 dimensions but 1 strides"),
    "contiguous_past_end": (_tensor(0, (13,), (1,)), "reaches element 12"),
    "storage_bigger_than_entry": (_tensor(0, (100,), (1,), numel=100), "declared as 100 float32 elements (400 bytes), but its zip entry holds 48 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_VIEWS))
def test_view_outside_its_storage_is_refused(case: str, tmp_path: Path) -> None:
    body, fragment = BAD_VIEWS[case]
    pt = _state_dict_pt(tmp_path / "model.pt", ok=_tensor(0, (12,), (1,)), w=body)
    err = _convert_refused(pt, tmp_path, CorruptCheckpointError.exit_code, str(pt), fragment)
    if case != "storage_bigger_than_entry":
        assert "tensor 'w'" in err


def test_bad_view_refused_by_inspect_too(tmp_path: Path) -> None:
    pt = _state_dict_pt(tmp_path / "model.pt", w=_tensor(0, (2, 2), (10**9, 1)))
    res = run_ravex("inspect", pt)
    assert res.returncode == 6 and "tensor 'w'" in res.stderr and res.stdout == ""


def test_bad_view_deep_inside_is_named(tmp_path: Path) -> None:
    inner = _dict([("state", b"}(K\x00" + _dict([("exp_avg", _tensor(5, (12,), (1,)))]) + b"u")])
    pt = _write_pt(tmp_path / "model.pt", _dict([("model", _dict([("w", _tensor(0, (12,), (1,)))])), ("optimizer", inner)]))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'optimizer/state/0/exp_avg' \(shape \[12\]"):
        open_archive(pt)


def test_honest_strided_views_are_gathered_like_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    pt = _state_dict_pt(
        tmp_path / "model.pt",
        t=_tensor(0, (4, 3), (1, 4)),  # a transpose saved as is
        s=_tensor(5, (2, 2), (4, 1)),  # a block inside the storage
        e=_tensor(2, (3, 2), (0, 1)),  # an expand (stride 0)
        z=_tensor(12, (0, 3), (3, 1)),  # empty, at the end of the storage
        c=_tensor(11, (1,), (1,)),  # contiguous, the last element
    )
    want = torch.load(pt, weights_only=True)  # the file is one torch itself reads
    out = tmp_path / "out.safetensors"
    res = run_ravex("convert", pt, out, "--to", "safetensors", "-q")
    assert res.returncode == 0, res.stderr
    got = load_file(str(out))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert np.array_equal(got[name], t.contiguous().numpy()), name


def test_view_repeating_its_storage_too_often_is_refused(tmp_path: Path) -> None:
    # every element inside the storage, but 4 TiB once gathered into memory
    pt = _state_dict_pt(tmp_path / "model.pt", w=_tensor(0, (2**20, 2**20), (0, 0)))
    _convert_refused(pt, tmp_path, 6, "tensor 'model/w'", "once gathered")


# ----------------------------------------------------------------------------
# 2. Pickles that exhaust time or memory.


def _laughs(levels: int = 9, width: int = 10, first_memo: int = 0) -> bytes:
    """A list of ``width`` references to a list of ``width`` references ... : 10**9 leaves in ~250 bytes."""
    m = first_memo
    out = b"]q" + bytes([m]) + b"(K\x01e0"  # 0: POP (each level stays in the memo only)
    for i in range(1, levels + 1):
        out += b"(" + (b"h" + bytes([m + i - 1])) * width + b"lq" + bytes([m + i]) + b"0"
    return out + b"h" + bytes([m + levels])


def test_billion_laughs_is_refused_fast(tmp_path: Path) -> None:
    body = _dict([("model", _dict([("w", _tensor(0, (12,), (1,)))])), ("junk", _laughs())])
    pt = _write_pt(tmp_path / "model.pt", body)
    assert pt.stat().st_size < 1000
    with zipfile.ZipFile(pt) as z:
        data = z.read("archive/data.pkl")
    t0 = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match="more than 4194304 objects once shared references are followed"):
        restricted_loads(data, "model.pt", lambda pid: StorageRef(pid[2], "float32", pid[4], pid[3]))
    assert time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    _convert_refused(pt, tmp_path, UnsafeCheckpointError.exit_code, str(pt), "objects once shared references", "RAVEX_MAX_PICKLE_OBJECTS")
    assert time.perf_counter() - t0 < 20  # the CLI start included; before: more than 60 s


def test_tuple_laughs_as_a_dict_key_is_refused_fast() -> None:
    # hashing a key hashes every element, shared ones again each time: 10**9 hashes
    body = b"K\x01\x85q\x000" + b"".join(b"(" + (b"h" + bytes([i - 1])) * 10 + b"tq" + bytes([i]) + b"0" for i in range(1, 10))
    data = b"\x80\x02}" + body + b"h\x09K\x01s."
    t0 = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match="a dict key or set member holds more than 10000 nested objects"):
        restricted_loads(data, "key.pkl")
    assert time.perf_counter() - t0 < 1.0


def test_copies_of_a_shared_string_are_bounded() -> None:
    # _codecs.encode(s) of one memoized 10 kB string, 20,000 times: 200 MB from 300 kB
    s = b"X" + struct.pack("<I", 10_000) + b"a" * 10_000 + b"q\x00c_codecs\nencode\nq\x01"
    data = b"\x80\x02" + s + b"(" + b"h\x01h\x00X\x06\x00\x00\x00latin1\x86R" * 20_000 + b"l."
    with pytest.raises(UnsafeCheckpointError, match="the pickle's calls build more than"):
        restricted_loads(data, "copies.pkl")


def test_deep_nesting_is_a_clear_error(tmp_path: Path) -> None:
    n = 100_000
    deep = b"]" * n + b"a" * (n - 1)
    pt = _write_pt(tmp_path / "model.pt", _dict([("model", _dict([("w", _tensor(0, (12,), (1,)))])), ("deep", deep)]))
    _convert_refused(pt, tmp_path, UnsafeCheckpointError.exit_code, "nested more than 100 levels deep")


def test_cyclic_structure_is_refused() -> None:
    data = b"\x80\x02]q\x00h\x00a."  # a list that contains itself
    with pytest.raises(UnsafeCheckpointError, match="cyclic"):
        restricted_loads(data, "cycle.pkl")


def test_memo_index_near_2_to_32_does_not_allocate() -> None:
    # the C unpickler grows its memo array to the index a pickle names
    assert restricted_loads(b"\x80\x02K\x07r\xff\xff\xff\xff.", "memo.pkl") == 7


def test_shared_references_honest_size_still_load() -> None:
    import pickle

    shared = {"lr": 0.1, "betas": (0.9, 0.999)}
    obj = {"groups": [shared] * 1000, "names": [f"layer.{i}.weight" for i in range(10_000)]}
    assert restricted_loads(pickle.dumps(obj, protocol=2), "ok.pkl") == obj


def test_pickle_size_limit_and_its_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ, RAVEX_MAX_PICKLE_BYTES="1000")
    import subprocess

    from conftest import ravex_bin

    res = subprocess.run([ravex_bin(), "inspect", str(TORCH_SAVE)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == UnsafeCheckpointError.exit_code, res.stderr
    assert "more than the 1000 bytes Ravex unpickles" in res.stderr and "data.pkl" in res.stderr
    assert "hint: " in res.stderr and "RAVEX_MAX_PICKLE_BYTES=" in res.stderr
    monkeypatch.setenv("RAVEX_MAX_PICKLE_BYTES", "100000000")
    assert open_archive(TORCH_SAVE).root
    monkeypatch.setenv("RAVEX_MAX_PICKLE_BYTES", "lots")
    with pytest.raises(RavexError, match="RAVEX_MAX_PICKLE_BYTES='lots' is not a positive whole number"):
        open_archive(TORCH_SAVE)


# ----------------------------------------------------------------------------
# 3. CRC-32: a flipped bit in the data is reported, not copied through.


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _largest_storage(path: Path) -> tuple[str, int]:
    """The entry name of the archive's largest storage, and where its bytes start."""
    a = open_archive(path)
    key = max(a.storage_sizes, key=lambda k: a.storage_sizes[k])
    return f"{a.entry_prefix}data/{key}", a.storage_offsets[key]


def test_flipped_bit_in_torch_save_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = tmp_path / "model.pt"
    shutil.copy(TORCH_SAVE, pt)
    key, start = _largest_storage(pt)
    _flip(pt, start + 17, 3)
    _convert_refused(pt, tmp_path, CorruptCheckpointError.exit_code, str(pt), f"the entry {key} fails its CRC-32 check")
    # inspect does not read the data (it stays fast); convert, verify and load do
    assert run_ravex("inspect", pt).returncode == 0
    monkeypatch.setenv("RAVEX_NO_CRC", "1")
    read_checkpoint(pt)  # the documented opt-out


def test_flipped_bit_in_a_zero_rank_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ZERO3, root)
    rank1 = root / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    key, start = _largest_storage(rank1)
    _flip(rank1, start + 1, 7)
    _convert_refused(root, tmp_path, 6, str(rank1), f"the entry {key} fails its CRC-32 check", "copy it again")


def test_flipped_bit_in_data_pkl(tmp_path: Path) -> None:
    pt = tmp_path / "model.pt"
    shutil.copy(TORCH_SAVE, pt)
    with zipfile.ZipFile(pt) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    # the entry's data: after its local header (30 bytes, the name, the extra field)
    with open(pt, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    _flip(pt, info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
    res = run_ravex("inspect", pt)
    assert res.returncode == 6, res.stderr
    assert "data.pkl' fails its CRC-32 check" in res.stderr and str(pt) in res.stderr


# ----------------------------------------------------------------------------
# 4. inspect checks every rank file's zip directory.


@pytest.mark.parametrize("victim", ["zero_pp_rank_2_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"])
def test_inspect_names_a_truncated_rank_file(victim: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ZERO3_WS3, root)
    (f,) = (root / "global_step3").glob(f"*{victim}")
    os.truncate(f, f.stat().st_size // 2)
    res = run_ravex("inspect", root)
    assert res.returncode == CorruptCheckpointError.exit_code, res.stdout + res.stderr
    assert f"{f}: the zip directory at the end of the file is missing or damaged" in res.stderr
    assert "hint:" in res.stderr and res.stdout == ""


# ----------------------------------------------------------------------------
# 5. DeepSpeed's `latest` must name a directory directly inside the root.


@pytest.fixture
def zero_copy(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(ZERO3, root)
    shutil.copytree(ZERO3 / "global_step3", tmp_path / "elsewhere")  # a valid tag directory outside the root
    return root


@pytest.mark.parametrize(
    ("latest", "fragment"),
    [
        ("ABSOLUTE", "is an absolute path"),
        ("../elsewhere", "has a '..' component"),
        ("global_step3/../../elsewhere", "has a '..' component"),
        ("LINK", "through a symbolic link"),
        ("global_step3/sub", "not a directory directly inside the checkpoint"),
    ],
)
def test_latest_pointing_outside_is_refused(zero_copy: Path, latest: str, fragment: str) -> None:
    if latest == "ABSOLUTE":
        latest = str(zero_copy.parent / "elsewhere")
    if latest == "LINK":
        os.symlink(zero_copy.parent / "elsewhere", zero_copy / "link")
        latest = "link"
    if latest.endswith("/sub"):
        shutil.copytree(ZERO3 / "global_step3", zero_copy / "global_step3" / "sub")
    (zero_copy / "latest").write_text(latest)
    for cmd in (["inspect", zero_copy], ["convert", zero_copy, zero_copy.parent / "o.safetensors", "--to", "safetensors"]):
        res = run_ravex(*cmd)
        assert res.returncode == UnsafeCheckpointError.exit_code, res.stderr
        assert f"{zero_copy / 'latest'}: " in res.stderr and fragment in res.stderr
        assert "hint:" in res.stderr
    assert not (zero_copy.parent / "o.safetensors").exists()


def test_latest_with_binary_junk(zero_copy: Path) -> None:
    (zero_copy / "latest").write_bytes(b"\xff\xfe\x00junk")
    res = run_ravex("inspect", zero_copy)
    assert res.returncode == 6 and "does not hold a tag name" in res.stderr


# ----------------------------------------------------------------------------
# 7. Truncations and flipped bytes: one clear error, never a bare exception.


def _entry_data(path: Path, suffix: str) -> tuple[int, int, zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.file_size, info


def _fix_crc(path: Path, suffix: str) -> None:
    """Write the CRC-32 of the entry's (changed) bytes into its local and central headers: a crafted file."""
    start, size, info = _entry_data(path, suffix)
    raw = bytearray(path.read_bytes())
    crc = struct.pack("<I", zlib.crc32(raw[start:start + size]))
    raw[info.header_offset + 14:info.header_offset + 18] = crc
    name = info.filename.encode()
    pos = 0
    while (pos := raw.find(b"PK\x01\x02", pos)) >= 0:
        n = struct.unpack("<H", raw[pos + 28:pos + 30])[0]
        if raw[pos + 46:pos + 46 + n] == name:
            raw[pos + 16:pos + 20] = crc
            break
        pos += 4
    path.write_bytes(bytes(raw))


def _outcome(path: Path) -> str:
    try:
        inspect(path)
        read_checkpoint(path)
    except RavexError as exc:
        assert exc.hint, f"{type(exc).__name__} without a hint: {exc.message}"
        assert str(path) in exc.message or (exc.path is not None and Path(exc.path).name == path.name), exc.message
        return type(exc).__name__
    return "ok"


def test_truncated_torch_save_at_every_boundary(tmp_path: Path) -> None:
    size = TORCH_SAVE.stat().st_size
    cuts = sorted({1, 3, 4, 29, 30, 100, 1000, size // 3, size // 2, size - 1000, size - 200, size - 100, size - 22, size - 1})
    with zipfile.ZipFile(TORCH_SAVE) as z:
        for info in z.infolist():
            cuts += [info.header_offset + 1, info.header_offset + 31, info.header_offset + 31 + len(info.filename) + info.file_size // 2]
    seen = {}
    for cut in sorted({c for c in cuts if 0 < c < size}):
        pt = tmp_path / f"cut{cut}.pt"
        pt.write_bytes(TORCH_SAVE.read_bytes()[:cut])
        seen[cut] = _outcome(pt)
        pt.unlink()
    assert set(seen.values()) <= {"CorruptCheckpointError", "UnknownFormatError"}, seen


def test_flipped_bytes_in_data_pkl_with_the_crc_fixed(tmp_path: Path) -> None:
    start, size, _ = _entry_data(TORCH_SAVE, "data.pkl")
    rng = random.Random(11)
    allowed = {"ok", "CorruptCheckpointError", "UnsafeCheckpointError", "UnknownFormatError"}
    outcomes: dict[str, int] = {}
    for i in range(150):
        pt = tmp_path / f"flip{i}.pt"
        raw = bytearray(TORCH_SAVE.read_bytes())
        for _ in range(rng.choice((1, 1, 3))):
            raw[start + rng.randrange(size)] = rng.randrange(256)
        pt.write_bytes(bytes(raw))
        _fix_crc(pt, "data.pkl")
        got = _outcome(pt)
        assert got in allowed, got
        outcomes[got] = outcomes.get(got, 0) + 1
        pt.unlink()
    assert outcomes.get("CorruptCheckpointError", 0) > 10, outcomes


def test_truncated_and_flipped_zero_rank_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ZERO3, root)
    victim = root / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    good = victim.read_bytes()
    start, size, _ = _entry_data(victim, "data.pkl")
    rng = random.Random(7)
    cases = [good[:c] for c in (10, 100, len(good) // 2, len(good) - 30)]
    for _ in range(60):
        raw = bytearray(good)
        raw[start + rng.randrange(size)] = rng.randrange(256)
        cases.append(bytes(raw))
    for i, data in enumerate(cases):
        victim.write_bytes(data)
        if i >= 4:
            _fix_crc(victim, "data.pkl")
        try:
            inspect(root)
            read_checkpoint(root)
        except RavexError as exc:
            assert exc.hint, exc.message
        victim.write_bytes(good)
