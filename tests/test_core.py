"""The compiled core from Python: the planner's contract at the boundary."""

from __future__ import annotations

import array
from pathlib import Path

import pytest

from ravex_convert import _core


def test_plan_runs_flat_to_boxes() -> None:
    runs = _core.plan_runs([4, 3], [("flat", 0, 6), ("flat", 6, 6)], [("box", [0, 0], [1, 3]), ("box", [1, 0], [3, 3])])
    assert runs == [(0, 0, 0, 0, 3), (1, 0, 3, 0, 3), (1, 1, 0, 3, 6)]


def test_every_target_element_written_once() -> None:
    # ZeRO-style flat partitions of a 7x5 tensor at world size 3 (12 elements each,
    # the last one short) into FSDP-style dim-0 shards at world size 2 (4 + 3 rows).
    shape = [7, 5]
    sources = [("flat", 0, 12), ("flat", 12, 12), ("flat", 24, 11)]
    targets = [("box", [0, 0], [4, 5]), ("box", [4, 0], [3, 5])]
    runs = _core.plan_runs(shape, sources, targets)
    written = {0: [0] * 20, 1: [0] * 15}
    for t, s, src, dst, n in runs:
        for i in range(n):
            written[t][dst + i] += 1
            # the element's global index is the same on both sides
            assert sources[s][1] + src + i == targets[t][1][0] * 5 + dst + i
    assert all(c == 1 for counts in written.values() for c in counts)


def test_uncovered_target_is_an_error() -> None:
    with pytest.raises(ValueError, match="in no source chunk"):
        _core.plan_runs([10], [("flat", 0, 5)], [("flat", 0, 10)])


def test_execute_reads_byte_buffers_in_place(tmp_path: Path) -> None:
    # The runtime hands snapshot tensors over as memoryviews: the bytes land as they are,
    # cast where asked, and hash the same as the bytes object would.
    values = array.array("f", [1.5, -2.25, 3.0, 1e-3, 7.0, -0.0])
    raw = values.tobytes()
    view = memoryview(bytearray(raw))
    target = tmp_path / "out.bin"
    target.write_bytes(b"\0" * (len(raw) + 12))
    tensor = ([6], [(0, 0, ("flat", 0, 6), "float32")], [(0, 0, ("flat", 0, 6), "float32")])
    cast = ([6], [(1, 0, ("flat", 0, 6), "float32")], [(0, len(raw), ("flat", 0, 6), "bfloat16")])
    stats = _core.execute([view, raw], [str(target)], [tensor, cast], threads=1, sync=False)
    assert stats["bytes_written"] == len(raw) + 12
    out = target.read_bytes()
    assert out[:len(raw)] == raw
    # bfloat16 = the top half of each float32 here (these values need no rounding)
    assert out[len(raw):] == b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
    assert _core.xxh3_64(view) == _core.xxh3_64(raw)


def test_execute_refuses_buffers_it_cannot_read_in_place(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"\0" * 8)
    tensor = ([2], [(0, 0, ("flat", 0, 2), "float32")], [(0, 0, ("flat", 0, 2), "float32")])
    strided = memoryview(bytearray(16))[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        _core.execute([strided], [str(target)], [tensor])
    with pytest.raises(ValueError, match=r"sources\[0\] must be a path \(str\), bytes or a buffer"):
        _core.execute([3.5], [str(target)], [tensor])
    with pytest.raises(ValueError, match="must be bytes or a buffer"):
        _core.xxh3_64(7)  # type: ignore[arg-type]


def test_package_version_is_the_compiled_modules() -> None:
    import importlib.metadata

    import ravex_convert

    assert ravex_convert.__version__ == _core.__version__ == importlib.metadata.version("ravex")



@pytest.mark.parametrize(("bad", "message"), [
    ({"src": [(0, 0, ("flat", -5, 2), "float32")]}, "tensors[0] src_chunks[0] region start must be a non-negative int, got -5"),
    ({"src": [(0, 0, ("flat", 0, 1), "float32"), (0, 4, ("box", [1, "x"], [1]), "float32")]},
     "tensors[0] src_chunks[1] region offsets[1] must be a non-negative int, got 'x'"),
    ({"dst": [(0, 0, ("flat", 0, 2), 16)]}, "tensors[0] dst_chunks[0] dtype must be a dtype name (str), got 16"),
    ({"shape": [2, -1]}, "tensors[0] shape[1] must be a non-negative int, got -1"),
    ({"crc": [(0, 0, 4), (0, -1, 4)]}, "crc_ranges[1] offset must be a non-negative int, got -1"),
])
def test_a_malformed_argument_is_named_by_where_it_sits(tmp_path: Path, bad: dict[str, object], message: str) -> None:
    # The place of a bad value is spelled out in the error (it is built only when one is raised).
    target = tmp_path / "out.bin"
    target.write_bytes(b"\0" * 8)
    src = bad.get("src", [(0, 0, ("flat", 0, 2), "float32")])
    dst = bad.get("dst", [(0, 0, ("flat", 0, 2), "float32")])
    tensor = (bad.get("shape", [2]), src, dst)
    with pytest.raises(ValueError) as err:
        _core.execute([b"\0" * 8], [str(target)], [tensor], crc_ranges=bad.get("crc"))
    assert str(err.value) == message
