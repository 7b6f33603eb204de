"""ravex_convert._paths.inside: paths a checkpoint names stay inside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ravex_convert._paths import inside
from ravex_convert.errors import UnsafeCheckpointError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpt"
    (r / "sub").mkdir(parents=True)
    (r / "sub" / "a.bin").write_bytes(b"x")
    (tmp_path / "outside.bin").write_bytes(b"secret")
    return r


def test_plain_relative_paths_are_joined(root: Path) -> None:
    src = root / "index.json"
    assert inside(root, "sub/a.bin", "shard file", src) == root / "sub" / "a.bin"
    assert inside(root, "sub", "tag", src) == root / "sub"
    assert inside(root, "./sub/a.bin", "shard file", src) == root / "sub" / "a.bin"
    # need not exist (the caller reports a missing file its own way)
    assert inside(root, "missing.bin", "shard file", src) == root / "missing.bin"


@pytest.mark.parametrize(
    ("rel", "fragment"),
    [
        ("/etc/passwd", "is an absolute path"),
        ("\\\\server\\share\\x", "is an absolute path"),
        ("C:\\x.bin", "is an absolute path"),
        ("C:x.bin", "is an absolute path"),
        ("../outside.bin", "has a '..' component"),
        ("sub/../../outside.bin", "has a '..' component"),
        ("sub\\..\\..\\outside.bin", "has a '..' component"),
        ("sub/a.bin\x00.txt", "contains a NUL character"),
        ("", "is empty or not a path"),
    ],
)
def test_refused(root: Path, rel: str, fragment: str) -> None:
    src = root / "model.safetensors.index.json"
    with pytest.raises(UnsafeCheckpointError) as exc:
        inside(root, rel, "the shard file", src)
    assert fragment in exc.value.message
    assert str(src) in exc.value.message
    assert exc.value.hint and "outside the checkpoint" in exc.value.hint
    assert exc.value.exit_code == 7
    assert exc.value.path == str(src)


def test_symlink_leaving_the_root_is_refused(root: Path) -> None:
    os.symlink(root.parent / "outside.bin", root / "link.bin")
    os.symlink(root.parent, root / "up")
    src = root / "latest"
    for rel in ("link.bin", "up/outside.bin", "up"):
        with pytest.raises(UnsafeCheckpointError, match="through a symbolic link"):
            inside(root, rel, "the tag", src)


def test_symlink_staying_inside_is_allowed(root: Path) -> None:
    os.symlink(root / "sub", root / "alias")
    assert inside(root, "alias/a.bin", "shard file", root / "i.json") == root / "alias" / "a.bin"


def test_root_reached_through_a_symlink(tmp_path: Path, root: Path) -> None:
    # the root itself may be a symlink (a user's ~/ckpt -> /data/ckpt): resolve both sides
    os.symlink(root, tmp_path / "via")
    assert inside(tmp_path / "via", "sub/a.bin", "shard file", tmp_path / "via" / "i.json") == tmp_path / "via" / "sub" / "a.bin"


def test_symlink_loop_is_refused_or_stays_inside(root: Path) -> None:
    # Python < 3.13 raises on a loop (refused); 3.13 resolves it to a name inside
    # the root, which the caller's open then fails on (ELOOP): either way nothing outside is read.
    os.symlink(root / "loop2", root / "loop1")
    os.symlink(root / "loop1", root / "loop2")
    try:
        got = inside(root, "loop1", "chunk file", root / "c.json")
    except UnsafeCheckpointError as exc:
        assert "cannot be resolved" in exc.message
    else:
        assert got == root / "loop1"
        with pytest.raises(OSError):
            got.read_bytes()
