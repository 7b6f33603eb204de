"""Every reader and every writer on every storage backend, the S3 bucket included (issue 42).

The writers' own test files run on the backends that can stand in for a local path
(``STORAGE_BACKENDS`` in conftest: ``RAVEX_STORAGE=objdir`` routes every plain path through
the object-store backend). A bucket cannot stand in for a path a test opens itself, so here
each backend is given a location of its own spelling (a path, ``objdir:PATH``,
``s3://BUCKET/PREFIX`` on the SeaweedFS server CI starts) and the bytes are fetched back
with something that is not Ravex (a file read; boto3 for the bucket). A new backend is one more
name in ``BACKENDS`` and one more branch in ``Place``.

- each reader: a fixture put on the backend converts to the bytes it converts to from disk;
- each writer: what it writes on the backend is the bytes it writes to disk, and reads back
  (``verify``) as the same checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, STORAGE_BACKENDS

BACKENDS = [*STORAGE_BACKENDS, "s3"]

# one fixture per reader: ZeRO (stage 1 and 3), DCP (FSDP2), safetensors, torch.save,
# Accelerate, Lightning's DeepSpeed directory; the native store's and the HF Trainer's readers
# read back what their writers wrote (test_every_writer_on_every_backend)
READERS = ["zero1_ws2_bf16", "zero3_ws2_fp32", "fsdp2_ws2", "safetensors_sharded", "torch_save", "accelerate_fsdp2_ws2",
           "lightning_ds2_ws2"]
# (format, output name, ConvertOptions, writer options): every writer once
WRITERS = [
    ("safetensors", "o.safetensors", {}, {}),
    ("safetensors", "sharded", {}, {"max_shard_size": 20_000}),
    ("torch_save", "o.pt", {}, {}),
    ("dcp", "dcp", {"world_size": 3}, {}),
    ("zero", "zero3", {"world_size": 3}, {"zero_stage": 3}),
    ("native", "store", {}, {"compression": "zstd"}),
    ("hf_trainer", "checkpoint-3", {}, {}),
    ("accelerate", "acc", {}, {}),
]
# what records where or when it was written: compared by `verify` instead
_RECORDS_WHERE_OR_WHEN = {".metadata", "ravex-store.json", "manifest.json", "checkpoint.json"}


def _tree(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _source(name: str) -> Path:
    src = DATA / name / "checkpoint"
    entries = [p for p in src.iterdir() if not p.name.startswith(".")]
    # a single-file checkpoint is the file; a checkpoint saved into one directory (Accelerate's state/,
    # Lightning's last.ckpt/) is that directory
    return entries[0] if len(entries) == 1 else src


class Place:
    """Where a test's checkpoints lie on one backend: ``at(name)`` spells a location there,
    ``put`` copies a local checkpoint there, ``fetch`` copies one back (not through Ravex)."""

    def __init__(self, backend: str, tmp: Path, s3: Any = None):
        self.backend, self.tmp, self.s3 = backend, tmp, s3
        self.bucket = tmp / "bucket"
        self.bucket.mkdir()

    def at(self, name: str) -> str:
        if self.backend == "s3":
            return str(self.s3 / name)
        return f"objdir://{self.bucket}/{name}" if self.backend == "objdir" else str(self.bucket / name)

    def put(self, local: Path, name: str) -> str:
        if self.backend == "s3":
            return str(self.s3.upload(local, name))
        # no output is open in the bucket: copying into it is setting up, not writing through Ravex
        (shutil.copytree if local.is_dir() else shutil.copyfile)(local, self.bucket / name)
        return self.at(name)

    def fetch(self, name: str) -> Path:
        if self.backend == "s3":
            return Path(self.s3.download(name, self.tmp / "fetched" / name))
        return self.bucket / name


@pytest.fixture(params=BACKENDS)
def place(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Place:
    monkeypatch.delenv("RAVEX_STORAGE", raising=False)  # each location says its backend itself
    s3 = request.getfixturevalue("s3") if request.param == "s3" else None
    return Place(str(request.param), tmp_path, s3)


@pytest.mark.parametrize("name", READERS)
def test_every_reader_on_every_backend(name: str, place: Place, tmp_path: Path) -> None:
    from ravex_convert import convert, inspect

    src = _source(name)
    there = place.put(src, src.name)
    convert(src, tmp_path / "local.safetensors", "safetensors")
    convert(there, tmp_path / "there.safetensors", "safetensors")
    assert (tmp_path / "there.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    a, b = inspect(src), inspect(there)
    assert (a.format, sorted(f.path for f in a.files)) == (b.format, sorted(f.path for f in b.files))


@pytest.mark.parametrize(("to", "name", "opts", "writer"), WRITERS, ids=[w[1] for w in WRITERS])
def test_every_writer_on_every_backend(to: str, name: str, opts: dict[str, Any], writer: dict[str, Any], place: Place,
                                       tmp_path: Path) -> None:
    from ravex_convert import convert, verify
    from ravex_convert.convert import ConvertOptions

    src = _source("zero2_ws2_bf16")
    local = tmp_path / "local" / name
    local.parent.mkdir()
    convert(src, local, to, ConvertOptions(**opts), writer=writer)
    convert(src, place.at(name), to, ConvertOptions(**opts), writer=writer)
    got, want = _tree(place.fetch(name)), _tree(local)
    assert sorted(k for k in got if k != "lock") == sorted(k for k in want if k != "lock"), to  # (a local store's flock file)
    for rel in got:
        if rel != "lock" and rel.rsplit("/", 1)[-1] not in _RECORDS_WHERE_OR_WHEN:
            assert got[rel] == want[rel], (to, rel)
    # read back from the backend by the format's own reader
    # (an HF Trainer or Accelerate optimizer file keys parameters by position: its bytes were compared above)
    assert verify(place.at(name), local, weights_only=to in ("hf_trainer", "accelerate")).identical, to
    if place.s3 is not None:
        assert place.s3.unfinished() == []
