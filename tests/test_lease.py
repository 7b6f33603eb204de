"""The lease as a fencing token (issue 43), in one process, on SeaweedFS and on moto.

What crosses a process or a machine (a run SIGKILLed, a run frozen and thawed, each in a
hostname and PID namespace of its own) is in integration/test_lease_machines.py. Here: a taker
judges a lease by its holder's TTL and the server's clock, never by its own TTL or clock; a live
holder with a longer TTL is not taken over by a run with a shorter one; and a writer whose lease
was taken over commits nothing, even when its manifest put races the takeover.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
from conftest import DATA, S3Prefix

from ravex_convert import read_checkpoint
from ravex_convert._output import Options
from ravex_convert.errors import RavexError
from ravex_convert.formats.native import writer as native_write
from ravex_convert.formats.native.store import claim, where
from ravex_convert.storage import PreconditionFailed, StoreTakenOverError, resolve


def _note(**over: Any) -> bytes:
    """A lease note as another machine's Ravex writes it (another boot, another PID namespace)."""
    now = time.time()
    note = {"pid": 1, "host": "node-x", "run_id": "frozen", "since_unix": now, "renewed_unix": now, "boot_id": "another-boot",
            "pid_ns": 1, "ttl_s": 5, "generation": 3}
    return json.dumps({**note, **over}).encode()


def test_a_lease_is_judged_by_its_holders_ttl_and_the_servers_clock(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    storage, key = resolve(s3_each / "run-lock")
    # written just now by the server's clock, by a writer whose clock is ten minutes behind, with a TTL of 5 s
    storage.put(key, _note(since_unix=time.time() - 600, renewed_unix=time.time() - 600))
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "300")  # the taker's own TTL: not what the holder's lease is judged by
    caplog.set_level(logging.WARNING, "ravex")
    t0 = time.monotonic()
    with storage.lease(key, "run-b") as lease:
        took = time.monotonic() - t0
        note = json.loads(storage.get(key)[0])
    # not at once (the writer's clock says 600 s old: the server's says new), and long before the taker's 300 s
    assert 5 <= took < 30, took
    assert lease.generation == 4 and note["generation"] == 4 and note["ttl_s"] == 300 and note["run_id"] == "run-b"
    assert lease.taken_over
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1 and "held by run frozen on host node-x (pid 1)" in waits[0] and "its TTL is 5 s" in waits[0], waits
    assert storage.stat(key) is None  # released


def test_a_live_holder_with_a_longer_ttl_is_not_taken_over_by_a_shorter_one(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    storage, key = resolve(s3_each / "run-lock")
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "40")  # renewed every 10 s
    with storage.lease(key, "run-a") as held:
        time.sleep(6.5)  # older than the second run's TTL, well inside the holder's
        monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "5")
        t0 = time.monotonic()
        with pytest.raises(PreconditionFailed, match=r"run run-a.*a live run"), storage.lease(key, "run-b"):
            pass
        assert time.monotonic() - t0 < 8  # refused once it was seen renewed (within one renewal interval)
        assert held.lost is None and json.loads(storage.get(key)[0])["run_id"] == "run-a"


def _fenced_store(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """A store on the bucket written once by run-a under its lease (generation 1)."""
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "30")
    w = where(s3_each / "store")
    ckpt = read_checkpoint(DATA / "fsdp2_ws3" / "checkpoint")
    native_write.write(ckpt, w, Options())  # the store exists (no lease record yet)
    return w, ckpt, Options


def test_a_writer_whose_lease_was_taken_over_commits_nothing(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    w, ckpt, options = _fenced_store(s3_each, monkeypatch)
    storage = w.storage
    caplog.set_level(logging.ERROR, "ravex")
    with storage.lease(w.key_of("run-lock"), "run-a") as fence:
        claim(w, fence)
        manifest = json.loads(storage.get(w.key_of("manifest.json"))[0])
        assert manifest["lease"]["generation"] == fence.generation and manifest["lease"]["run_id"] == "run-a"
        assert native_write.write(ckpt, w, options(), run_id="run-a", fence=fence)["index"] == 1
        # run-b on node-b took the store over (as a run that took the lease over claims it: store.claim)
        manifest = json.loads(storage.get(w.key_of("manifest.json"))[0])
        taken = {**manifest, "lease": {"generation": fence.generation + 1, "run_id": "run-b", "host": "node-b"}}
        storage.put(w.key_of("manifest.json"), json.dumps(taken).encode())
        before = storage.get(w.key_of("manifest.json"))[0]
        for _ in range(2):
            with pytest.raises(StoreTakenOverError, match=r"run run-b on host node-b took it over") as err:
                native_write.write(ckpt, w, options(), run_id="run-a", fence=fence)
            assert "commits nothing more" in err.value.message and "stop it" in (err.value.hint or "")
        assert storage.get(w.key_of("manifest.json"))[0] == before
        assert not [k for k in storage.list(w.key) if "/checkpoints/00000002/" in k]
        with pytest.raises(StoreTakenOverError):
            native_write.prune(w, 1, fence=fence)
    said = [r for r in caplog.records if r.levelno == logging.ERROR and "took it over" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # said once, however often it is met


def test_a_takeover_between_the_manifest_read_and_its_put_commits_nothing(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: the writer read the manifest before the takeover (its check
    passes, its renewal has not noticed), the new holder claims the store, then the writer puts:
    the put is conditional on the manifest it read, so it loses."""
    w, ckpt, options = _fenced_store(s3_each, monkeypatch)
    storage = w.storage
    real = native_write._write_manifest
    with storage.lease(w.key_of("run-lock"), "run-a") as fence:
        claim(w, fence)

        def late(*args: Any, **kwargs: Any) -> None:
            manifest = json.loads(storage.get(w.key_of("manifest.json"))[0])
            manifest["lease"] = {"generation": fence.generation + 1, "run_id": "run-b", "host": "node-b"}
            storage.put(w.key_of("manifest.json"), json.dumps(manifest).encode())  # run-b's claim lands now
            real(*args, **kwargs)

        monkeypatch.setattr(native_write, "_write_manifest", late)
        with pytest.raises(StoreTakenOverError, match="run run-b on host node-b"):
            native_write.write(ckpt, w, options(), run_id="run-a", fence=fence)
    manifest = json.loads(storage.get(w.key_of("manifest.json"))[0])
    assert [e["index"] for e in manifest["checkpoints"]] == [0] and manifest["lease"]["run_id"] == "run-b"
    assert not [k for k in storage.list(w.key) if "/checkpoints/00000001/" in k]


def test_a_renewal_that_finds_the_lease_taken_says_so_once(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    storage, key = resolve(s3_each / "run-lock")
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "5")
    caplog.set_level(logging.ERROR, "ravex")
    with storage.lease(key, "run-a") as fence:
        _, etag = storage.get(key)
        storage.put(key, _note(run_id="run-b", host="node-b", generation=fence.generation + 1), if_generation=etag)
        deadline = time.monotonic() + 5
        while fence.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fence.lost is not None and "run run-b on host node-b took it over" in fence.lost
        with pytest.raises(StoreTakenOverError):
            fence.check()
        time.sleep(1.5)  # another renewal interval: nothing more is put, nothing more said
        assert json.loads(storage.get(key)[0])["run_id"] == "run-b"
    assert json.loads(storage.get(key)[0])["run_id"] == "run-b"  # a lost lease is not released: it is not ours
    said = [r.getMessage() for r in caplog.records if "took it over" in r.getMessage()]
    assert len(said) == 1, said
    assert not [t for t in threading.enumerate() if t.name == "ravex-lease"]


def test_a_ttl_below_the_floor_is_refused(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    storage, key = resolve(s3_each / "run-lock")
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "4.9")
    with pytest.raises(RavexError, match=r"below 5 s"), storage.lease(key, "run-a"):
        pass
    assert storage.stat(key) is None


def test_a_lease_created_again_moves_past_the_generation_the_store_carries(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease released (deleted) and created again starts at generation 1; the store's manifest may
    carry a higher one from its history. The claim moves the lease past it, or the new run's own
    commits would be refused as older than the store."""
    w, ckpt, options = _fenced_store(s3_each, monkeypatch)
    storage = w.storage
    manifest, etag = storage.get(w.key_of("manifest.json"))
    old = {**json.loads(manifest), "lease": {"generation": 5, "run_id": "run-old", "host": "node-old"}}
    storage.put(w.key_of("manifest.json"), json.dumps(old).encode(), if_generation=etag)
    with storage.lease(w.key_of("run-lock"), "run-c") as fence:
        assert fence.generation == 1 and not fence.taken_over
        claim(w, fence)
        assert fence.generation == 6 and json.loads(storage.get(w.key_of("run-lock"))[0])["generation"] == 6
        assert native_write.write(ckpt, w, options(), run_id="run-c", fence=fence)["index"] == 1
    manifest = json.loads(storage.get(w.key_of("manifest.json"))[0])
    assert manifest["lease"] == {"generation": 6, "run_id": "run-c", "host": manifest["lease"]["host"]}
    assert manifest["next_index"] == 2  # no index skipped: nobody may still be writing


def test_a_ttl_a_note_or_a_setting_gives_above_the_ceiling_is_not_waited_out(s3_each: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease note is read from the bucket: a TTL of a year in it refuses at once, naming the fix."""
    storage, key = resolve(s3_each / "run-lock")
    storage.put(key, _note(ttl_s=365 * 86400))
    t0 = time.monotonic()
    with pytest.raises(PreconditionFailed, match=r"a TTL of 31536000 s, over the 3600 s Ravex waits out: delete the lease object"), \
            storage.lease(key, "run-b"):
        pass
    assert time.monotonic() - t0 < 5
    monkeypatch.setenv("RAVEX_S3_LEASE_TTL", "7200")
    with pytest.raises(RavexError, match=r"RAVEX_S3_LEASE_TTL='7200' is above 3600 s") as exc, storage.lease(key + "-2", "run-c"):
        pass
    assert "between 5 and 3600" in (exc.value.hint or "")
