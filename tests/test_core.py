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


def test_allocate_reserves_or_extends_and_reports_a_file_size_limit(tmp_path: Path) -> None:
    import os
    import resource
    import subprocess
    import sys

    from ravex_convert._output import allocate

    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"head")
        allocate(fd, 1 << 20)  # keeps what is written, the rest reads as zeros
        assert path.stat().st_size == 1 << 20
        assert os.pread(fd, 8, 0) == b"head\0\0\0\0"
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="fd must be a file descriptor"):
        _core.preallocate(-1, 10)
    # Past a file-size limit (as on a full disk): an OSError before any byte is copied.
    code = ("import os, sys; from ravex_convert._output import allocate\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "try:\n    allocate(fd, 1 << 20)\nexcept OSError as e:\n    print('errno', e.errno, e.strerror)\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big")], capture_output=True, text=True,
                         preexec_fn=limit, timeout=60, check=False, cwd=tmp_path)  # cwd: not the source tree
    assert res.stdout.strip() == "errno 27 File too large", res.stdout + res.stderr  # EFBIG, as os.* says it


def test_allocate_falls_back_to_extending_where_blocks_cannot_be_reserved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ravex_convert import _output

    monkeypatch.setattr(_output._core, "preallocate", lambda fd, n: False)
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _output.allocate(fd, 12345)
    finally:
        os.close(fd)
    assert path.stat().st_size == 12345
