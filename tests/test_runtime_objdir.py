"""The runtime's store on object storage (``storage.path: objdir:BUCKET/store``; docs/format.md
section 3): the run lock is a lease object, the writes, keep_last and the torch_save backend go
through the storage layer, and a restore reads the objects back bit for bit. While a session is
open the audit hook watches the bucket for its whole life, so a rename, an in-place write or an
flock there by any code path of the runtime fails the test; at the end every object in the bucket
is one the backend put (``audit``). The cross-process exact-resume test on object storage is in
tests/test_runtime_session.py."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_session import build, everything, same

import ravex
from ravex_convert.errors import IncompleteCheckpointError, RavexError
from ravex_convert.formats.native.store import LOCK, RUN_LOCK
from ravex_convert.storage import ABSENT, StoreTakenOverError, resolve
from ravex_convert.storage.base import machine
from ravex_convert.storage.objdir import ObjectDirStorage, SemanticsViolation, in_use
from ravex_runtime.status import store_status


@pytest.fixture
def bucket(env: Path, tmp_path: Path) -> Path:
    b = tmp_path / "bucket"
    b.mkdir()
    return b


def storage_of(url: str) -> tuple[ObjectDirStorage, str]:
    storage, key = resolve(url)
    assert isinstance(storage, ObjectDirStorage)
    return storage, key


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("backend", ["native", "torch_save"])
def test_a_session_on_object_storage_commits_prunes_and_restores_bit_for_bit(bucket: Path, backend: str) -> None:
    url = f"objdir:{bucket}/store"
    torch.manual_seed(0)
    model, opt, sched = build()
    states: dict[int, dict[str, Any]] = {}
    with ravex.Session(path=url, keep_last=2, backend=backend) as session:
        storage, key = storage_of(url)
        assert storage.exists(f"{key}/{RUN_LOCK}")  # the run's lease, held from construction to close
        assert str(bucket) in in_use()
        with pytest.raises(SemanticsViolation):
            open(bucket / "stray.txt", "w").close()
        session.track(model=model, optimizer=opt, scheduler=sched)
        for step in range(1, 5):
            train(model, opt)
            sched.step()
            states[step] = everything(model, opt, sched)
            session.commit(session.capture(step), wait=True)
            assert not storage.exists(f"{key}/{LOCK}")  # the writer's own lease lives for one write
        assert session.writes == 4
    assert not storage.exists(f"{key}/{RUN_LOCK}") and str(bucket) not in in_use()
    assert storage.audit() == []  # nothing in the bucket was written behind the backend's back
    rels = sorted(k[len(key) + 1:] for k in storage.list(key))
    if backend == "native":
        assert [c["step"] for c in store_status(url)["checkpoints"]] == [3, 4]
        assert not any(".tmp-" in r for r in rels)  # object storage has no temporary names
    else:
        assert rels == ["ckpt-00000002.pt", "ckpt-00000003.pt"]  # keep_last deleted the two oldest objects

    torch.manual_seed(1)
    model2, opt2, sched2 = build()
    with ravex.Session(path=url, backend=backend) as session:
        session.track(model=model2, optimizer=opt2, scheduler=sched2)
        assert session.restore() == 4
        got = everything(model2, opt2, sched2)
    assert same({k: got[k] for k in ("model", "optim", "sched")}, {k: states[4][k] for k in ("model", "optim", "sched")})
    assert storage.audit() == []


def test_one_run_per_store_on_object_storage_and_a_dead_run_s_lease_is_taken_over(bucket: Path) -> None:
    url = f"objdir:{bucket}/store"
    with ravex.Session(path=url):
        with pytest.raises(RavexError, match=rf"another training run is using this checkpoint store \(pid {os.getpid()} on host") as info:
            ravex.Session(path=url)
        assert f"delete the object objdir://{bucket}/store/{RUN_LOCK}" in (info.value.hint or "")
    # A run killed outright leaves its lease behind; one of this host whose process is gone is taken over.
    storage, key = storage_of(url)
    # Of this machine means the same boot and PID namespace (issue 43): the hostname alone proves nothing
    # (containers share one), so a note naming this host from another PID namespace is not taken over.
    here = {"pid": 2 ** 22 + 12345, "host": socket.gethostname(), "run_id": "killed", "since_unix": 0}
    elsewhere = json.dumps({**here, **machine(), "pid_ns": 1}).encode()
    storage.put(f"{key}/{RUN_LOCK}", elsewhere, if_generation=ABSENT)
    with pytest.raises(RavexError, match="run killed"):
        ravex.Session(path=url)
    storage.delete(f"{key}/{RUN_LOCK}")
    dead = json.dumps({**here, **machine()}).encode()
    storage.put(f"{key}/{RUN_LOCK}", dead, if_generation=ABSENT)
    torch.manual_seed(0)
    model, opt, _ = build()
    with ravex.Session(path=url) as session:
        session.track(model=model, optimizer=opt)
        session.commit(session.capture(1), wait=True)
    assert not storage.exists(f"{key}/{RUN_LOCK}")
    # one of another host may still run: refused, with the way out
    other = json.dumps({"pid": 1, "host": "elsewhere", "run_id": "r", "since_unix": 0}).encode()
    storage.put(f"{key}/{RUN_LOCK}", other, if_generation=ABSENT)
    with pytest.raises(RavexError, match="pid 1 on host elsewhere, run r"):
        ravex.Session(path=url)


def test_what_is_not_a_store_on_object_storage_is_refused_and_a_half_created_one_finished(bucket: Path, tmp_path: Path) -> None:
    with pytest.raises(RavexError, match=r"its bucket \S*/nowhere \(the directory above the store\) does not exist") as info:
        ravex.Session(path=f"objdir:{tmp_path}/nowhere/store")
    assert "create the bucket first" in (info.value.hint or "")
    storage, _ = storage_of(f"objdir:{bucket}/x")
    storage.put("notes/a.txt", b"mine")
    with pytest.raises(RavexError, match=r"storage.path objdir://.*/notes is not a Ravex store and not empty \(it holds a.txt\)"):
        ravex.Session(path=f"objdir:{bucket}/notes")
    storage.put("obj", b"an object")
    with pytest.raises(RavexError, match="is an object, not a store"):
        ravex.Session(path=f"objdir:{bucket}/obj")
    # a kill between the empty manifest and the marker: finished by the next run
    storage.put("half/manifest.json", b'{"format_version": 1, "checkpoints": [], "next_index": 0}')
    torch.manual_seed(0)
    model, opt, _ = build()
    with ravex.Session(path=f"objdir:{bucket}/half") as session:
        session.track(model=model, optimizer=opt)
        assert session.restore() is None
        session.commit(session.capture(1), wait=True)
    assert [c["step"] for c in store_status(f"objdir:{bucket}/half")["checkpoints"]] == [1]
    # checkpoints without the marker: a damaged store, never started over
    storage.delete("half/ravex-store.json")
    with pytest.raises(IncompleteCheckpointError, match="holds manifest.json and checkpoints of a Ravex store but not its marker"):
        ravex.Session(path=f"objdir:{bucket}/half")
    assert storage.audit() == []


def test_a_decorated_loop_configured_for_object_storage_resumes(bucket: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ravex.yaml").write_text("checkpoint_every: 2\nstorage:\n  path: objdir:bucket/store\n")
    monkeypatch.delenv("RAVEX_STORAGE_PATH")  # the env fixture's local store would win over the file
    url = f"objdir:{bucket}/store"

    def run(steps: int) -> tuple[list[int], dict[str, torch.Tensor]]:
        seen: list[int] = []

        @ravex.train_loop
        def loop() -> None:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = torch.randn(16, 4)
            while ravex.step() < steps:
                ravex.batch_boundary()
                seen.append(ravex.step())
                i = ravex.step() % 4
                model(data[i * 4:(i + 1) * 4]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            weights.update({k: v.clone() for k, v in model.state_dict().items()})

        weights: dict[str, torch.Tensor] = {}
        loop()
        return seen, weights

    straight, ref = run(6)
    assert straight[0] == 0
    for k in list(Path(bucket).glob("*")):  # start again on an empty bucket, through the backend
        storage, _ = storage_of(f"objdir:{k}")
        for key in storage.list(k.name):
            storage.delete(key)
    first, _ = run(4)
    assert first[0] == 0  # a new store: nothing to resume
    assert [c["step"] for c in store_status(url)["checkpoints"]] == [2, 4]
    assert not (tmp_path / "ravex_checkpoints").exists()
    again, weights = run(6)
    assert again[0] == 4  # resumed from the object store
    assert all(torch.equal(weights[k], ref[k]) for k in ref)
    assert storage_of(url)[0].audit() == []


def test_a_session_whose_store_was_taken_over_commits_nothing_and_says_so_once(bucket: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 43: the manifest records the generation of the lease its writer held; once another run
    took the store over (its claim records a newer one), this run's writes commit nothing, it says
    so once at ERROR, and commit() and flush() raise StoreTakenOverError (the decorator stops the run)."""
    url = f"objdir:{bucket}/store"
    storage, key = storage_of(url)
    torch.manual_seed(0)
    model, opt, _ = build()
    caplog.set_level(logging.ERROR, "ravex")
    with ravex.Session(path=url) as session:
        session.track(model=model, optimizer=opt)
        train(model, opt)
        session.commit(session.capture(1), wait=True)
        raw, gen = storage.get(f"{key}/manifest.json")
        manifest = json.loads(raw)
        assert manifest["lease"]["run_id"] == session.run_id and session.taken_over is None
        # run-b on node-b took the store over: its claim records its generation
        manifest["lease"] = {"generation": manifest["lease"]["generation"] + 1, "run_id": "run-b", "host": "node-b"}
        storage.put(f"{key}/manifest.json", json.dumps(manifest).encode(), if_generation=gen)
        before = storage.get(f"{key}/manifest.json")[0]
        train(model, opt)
        session.commit(session.capture(2))
        with pytest.raises(StoreTakenOverError, match="run run-b on host node-b took it over") as err:
            session.flush()
        assert "stop it" in (err.value.hint or "")
        assert session.taken_over is not None
        with pytest.raises(StoreTakenOverError):
            session.commit(session.capture(3))
        assert storage.get(f"{key}/manifest.json")[0] == before
        assert not [k for k in storage.list(key) if "/checkpoints/00000001/" in k]
    said = [r.getMessage() for r in caplog.records if "took it over" in r.getMessage()]
    assert len(said) == 1 and "node-b" in said[0], said
    assert storage.audit() == []
