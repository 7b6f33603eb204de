"""The replica area (ravex_runtime/replica_area.py): a checkpoint copied into another store with
the store's own protocol, checked by its checksums before the manifest lists it. In-process, on
stores a real Session wrote; the copies between machines are integration/test_replicate.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ravex
from ravex_convert.errors import RavexError
from ravex_convert.formats.native.writer import prune
from ravex_runtime.loading import load_checkpoint
from ravex_runtime.replica_area import Ingest, adopt, area_of, checkpoint_files, newest, read_copies, record_copy, replica_of, status


def make_store(path: Path, steps: int, frozen: bool = False) -> list[dict[str, object]]:
    """A store a Session wrote, one checkpoint per step; with ``frozen``, half the model never
    changes, so later checkpoints point into the first one's files."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    if frozen:
        model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with ravex.Session(path=path, keep_last=None) as s:
        s.track(model=model, optimizer=opt)
        for step in range(1, steps + 1):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            s.commit(s.capture(step), wait=True)
    return [e for e in json.loads((path / "manifest.json").read_text())["checkpoints"]]


def copy(src: Path, dst: Path, entry: dict[str, object], run_id: str = "copy1", *, replace: bool = False,
         damage: str | None = None) -> list[str]:
    files = [(rel, (src / rel).stat().st_size) for rel in checkpoint_files(src, entry)]
    with Ingest(dst, entry, run_id, replace=replace) as ing:
        need = ing.need(files)
        for rel in need:
            data = bytearray((src / rel).read_bytes())
            if rel == damage:
                data[-1] ^= 1
            with ing.open(rel) as f:
                f.write(data)
        ing.commit()
    return need


def test_a_copy_is_the_original_byte_for_byte_and_loads(tmp_path: Path) -> None:
    entries = make_store(tmp_path / "a", 3)
    dst = replica_of(tmp_path / "b" / "store", 0)
    assert dst == tmp_path / "b" / "store.replicas" / "rank00000"
    copy(tmp_path / "a", dst, entries[1])
    listed = json.loads((dst / "manifest.json").read_text())
    assert listed["checkpoints"] == [entries[1]] and listed["next_index"] == 2
    for f in (tmp_path / "a" / "checkpoints" / "00000001").iterdir():
        assert (dst / "checkpoints" / "00000001" / f.name).read_bytes() == f.read_bytes()
    ckpt, tensors = load_checkpoint(dst, 1)
    want = load_checkpoint(tmp_path / "a", 1)[1]
    assert ckpt.step == 2 and all(torch.equal(tensors[k], want[k]) for k in want)
    assert newest(dst) == entries[1]
    # a later one goes on top; an earlier or the same index is refused (nothing half-done is left)
    copy(tmp_path / "a", dst, entries[2])
    with pytest.raises(RavexError, match="already used indices up to 2"):
        copy(tmp_path / "a", dst, entries[0])
    assert not list((dst / "checkpoints").glob("*.tmp-*"))
    prune(dst, 1)
    assert [e["index"] for e in json.loads((dst / "manifest.json").read_text())["checkpoints"]] == [2]


def test_a_damaged_copy_is_never_listed(tmp_path: Path) -> None:
    entries = make_store(tmp_path / "a", 2)
    dst = tmp_path / "r"
    data = [rel for rel in checkpoint_files(tmp_path / "a", entries[1]) if not rel.endswith("checkpoint.json")]
    with pytest.raises(RavexError, match="checksum mismatch"):
        copy(tmp_path / "a", dst, entries[1], damage=data[0])
    assert json.loads((dst / "manifest.json").read_text())["checkpoints"] == []
    assert not (dst / "checkpoints" / "00000001").exists() and not list((dst / "checkpoints").glob("*.tmp-*"))
    with pytest.raises(RavexError, match="checkpoint.json"):
        copy(tmp_path / "a", dst, entries[1], damage="checkpoints/00000001/checkpoint.json")
    assert json.loads((dst / "manifest.json").read_text())["checkpoints"] == []
    copy(tmp_path / "a", dst, entries[1])  # the same copy, undamaged, goes in
    assert newest(dst) == entries[1]


def test_files_of_earlier_checkpoints_are_sent_once(tmp_path: Path) -> None:
    """A frozen layer is written once: later checkpoints point into the first one's directory. The
    copy of a later one carries those files, into that directory (retained for data), and the next
    copy does not send them again; pruning keeps them while they are referenced."""
    entries = make_store(tmp_path / "a", 3, frozen=True)
    rels = checkpoint_files(tmp_path / "a", entries[2])
    assert any(r.startswith("checkpoints/00000000/") for r in rels), rels
    dst = tmp_path / "r"
    first = copy(tmp_path / "a", dst, entries[1])
    assert any(r.startswith("checkpoints/00000000/") for r in first)
    second = copy(tmp_path / "a", dst, entries[2])
    assert not any(r.startswith("checkpoints/00000000/") for r in second), second
    prune(dst, 1)
    tensors = load_checkpoint(dst, 2)[1]
    want = load_checkpoint(tmp_path / "a", 2)[1]
    assert all(torch.equal(tensors[k], want[k]) for k in want)


def test_a_replica_of_an_older_lineage_is_replaced(tmp_path: Path) -> None:
    entries = make_store(tmp_path / "a", 3)
    dst = tmp_path / "r"
    copy(tmp_path / "a", dst, entries[2])
    copy(tmp_path / "a", dst, entries[0], replace=True)  # the store it protects started over
    assert [e["index"] for e in json.loads((dst / "manifest.json").read_text())["checkpoints"]] == [0]


def test_status_says_where_the_copies_are_and_how_old(tmp_path: Path) -> None:
    entries = make_store(tmp_path / "a", 3)
    store = tmp_path / "a"
    assert status(store) is None  # no area: nothing to say
    record_copy(store, {"holder_rank": 1, "holder_host": "node-b", "path": "/b/x", "index": 1, "step": 2, "committed_unix": 1000.0,
                        "bytes_sent": 10, "seconds": 0.5})
    record_copy(store, {"holder_rank": 1, "holder_host": "node-b", "path": "/b/x", "index": 2, "step": 3, "committed_unix": 1010.0,
                        "bytes_sent": 10, "seconds": 0.5})
    assert [c["index"] for c in read_copies(store)] == [2]  # one record per holder: the newest
    assert [c["index"] for c in read_copies(store, history=True)] == [1, 2]  # and the last copies, for the cost's measure
    copy(store, replica_of(store, 3), entries[0])  # a replica this machine holds for rank 3
    st = status(store, now=1070.0)
    assert st is not None and st["area"] == str(area_of(store))
    assert [(c["holder_host"], c["index"], c["age_s"], c["behind"]) for c in st["copies"]] == [("node-b", 2, 60.0, 0)]
    assert [(h["rank"], h["index"], h["step"]) for h in st["held"]] == [(3, 0, 1)]


def test_a_replica_held_here_goes_into_the_store_that_lacks_it(tmp_path: Path) -> None:
    """An elastic restart with fewer machines: rank 0 now runs where its old store's copy is."""
    entries = make_store(tmp_path / "a", 4)
    store = tmp_path / "b" / "store"
    held = replica_of(store, 0)
    copy(tmp_path / "a", held, entries[1])
    assert adopt(store, 0, "run2") == entries[1]  # no store at all yet: made, and the copy listed
    assert [e["index"] for e in json.loads((store / "manifest.json").read_text())["checkpoints"]] == [1]
    ckpt, tensors = load_checkpoint(store, 1)
    want, want_tensors = load_checkpoint(tmp_path / "a", 1)
    assert ckpt.step == want.step and all(torch.equal(tensors[k], want_tensors[k]) for k in want_tensors)
    assert adopt(store, 0, "run3") is None  # the store has it now
    assert adopt(store, 1, "run3") is None  # no replica of rank 1 here
    copy(tmp_path / "a", held, entries[3])
    assert adopt(store, 0, "run4") == entries[3]
    assert [e["index"] for e in json.loads((store / "manifest.json").read_text())["checkpoints"]] == [1, 3]


def test_a_damaged_replica_is_not_adopted(tmp_path: Path) -> None:
    entries = make_store(tmp_path / "a", 2)
    store = tmp_path / "b" / "store"
    held = replica_of(store, 0)
    copy(tmp_path / "a", held, entries[1])
    data = next(f for f in (held / "checkpoints" / "00000001").iterdir() if f.name != "checkpoint.json")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(RavexError):
        adopt(store, 0, "run2")
    assert newest(store) is None  # nothing listed
