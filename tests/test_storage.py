"""The storage layer's two backends keep their promises.

``objdir`` must behave like an object store (no rename, no in-place update,
objects whole or absent, conditional puts, leases) and refuse any code that
treats its bucket as a POSIX directory; ``local`` must keep today's behaviour.
The writers' own tests run against both (the ``storage_backend`` fixture, conftest.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import DATA

from ravex_convert import ConvertOptions, convert, inspect, read_checkpoint
from ravex_convert.errors import RavexError
from ravex_convert.storage import ABSENT, LocalStorage, PreconditionFailed, resolve
from ravex_convert.storage.objdir import ObjectDirStorage, SemanticsViolation, in_use

pytestmark = pytest.mark.usefixtures("storage_backend")  # every test on every backend (conftest)


@pytest.fixture
def bucket(tmp_path: Path) -> ObjectDirStorage:
    root = tmp_path / "bucket"
    root.mkdir()
    return ObjectDirStorage(root)


def test_an_object_appears_whole_when_its_sink_closes_and_never_changes(bucket: ObjectDirStorage) -> None:
    out = bucket.output("ck", force=False, directory=True, token="t1")
    sink = out.sink("a.bin", 8)
    sink.pwrite(b"4567", 4)
    sink.pwrite(b"0123", 0)
    assert not bucket.exists("ck/a.bin")  # spooled: nothing visible yet
    sink.close()
    assert bucket.get("ck/a.bin")[0] == b"01234567"
    with pytest.raises(SemanticsViolation):
        sink.pwrite(b"x", 0)
    again = out.sink("a.bin", 1)
    with pytest.raises(PreconditionFailed, match="does not update objects in place"):
        again.close()
    out.publish([("commit", b"done")])
    assert bucket.list("ck") == ["ck/a.bin", "ck/commit"]
    assert bucket.audit() == []


def test_conditional_put_and_lease(bucket: ObjectDirStorage) -> None:
    g1 = bucket.put("m.json", b"1", if_generation=ABSENT)
    with pytest.raises(PreconditionFailed):
        bucket.put("m.json", b"x", if_generation=ABSENT)
    g2 = bucket.put("m.json", b"2", if_generation=g1)
    with pytest.raises(PreconditionFailed):
        bucket.put("m.json", b"3", if_generation=g1)  # a writer that read the old one loses
    assert bucket.get("m.json") == (b"2", g2)
    with bucket.lease("lock", "run a"), pytest.raises(PreconditionFailed, match="run a"), bucket.lease("lock", "run b"):
        pass
    with bucket.lease("lock", "run b"):
        pass


def test_posix_calls_inside_a_bucket_with_an_open_output_are_refused(bucket: ObjectDirStorage) -> None:
    root = Path(bucket.root)
    (root / "x").write_bytes(b"old")  # no output open: the bucket is just a directory
    out = bucket.output("ck", force=False, directory=True, token="t2")
    for attempt in (lambda: os.replace(root / "x", root / "y"), lambda: open(root / "x", "r+b"),  # noqa: SIM115 - it must not open at all
                    lambda: os.open(root / "ck-new", os.O_WRONLY | os.O_CREAT), lambda: os.remove(root / "x"), lambda: os.mkdir(root / "d")):
        with pytest.raises(SemanticsViolation, match="an object store has no such operation"):
            attempt()
    assert (root / "x").read_bytes() == b"old"  # reading is fine
    out.abort()
    os.replace(root / "x", root / "y")  # closed again: the hook watches open outputs only


def test_audit_finds_objects_changed_behind_the_backends_back(bucket: ObjectDirStorage) -> None:
    bucket.put("k", b"v")
    subprocess.run(["sh", "-c", f"printf w >> '{bucket.root}/k'; printf n > '{bucket.root}/new'"], check=True)  # audit hooks do not see this
    assert bucket.audit() == ["k", "new"]


def test_a_failed_output_leaves_no_object(tmp_path: Path, bucket: ObjectDirStorage) -> None:
    out = bucket.output("ck", force=False, directory=True, token="t3")
    s = out.sink("a", 4)
    s.close()
    out.put("b", b"b")
    out.abort()
    assert bucket.list("") == []
    assert not any(p.name.startswith("ravex-spool-t3") for p in Path(os.environ.get("TMPDIR", "/tmp")).iterdir())


def test_replacing_drops_the_old_commit_object_first(bucket: ObjectDirStorage) -> None:
    first = bucket.output("ck", force=False, directory=True, token="t4")
    first.put("__0_0.distcp", b"old")
    first.publish([(".metadata", b"m")])
    with pytest.raises(RavexError, match="already exists"):
        bucket.output("ck", force=False, directory=True, token="t5")
    second = bucket.output("ck", force=True, directory=True, token="t6")
    assert bucket.list("ck") == []  # the old output stopped being a checkpoint before anything new landed
    second.abort()


def test_a_refused_output_leaves_its_bucket_unwatched(bucket: ObjectDirStorage) -> None:
    """An output refused as it opens (its key exists) stops watching the bucket: a process that
    goes on (the runtime, an API caller) may use that directory again. Seen when the writers'
    tests first ran on both backends in one process."""
    first = bucket.output("ck", force=False, directory=True, token="t7")
    first.publish([(".metadata", b"m")])
    assert in_use() == []
    with pytest.raises(RavexError, match="already exists"):
        bucket.output("ck", force=False, directory=True, token="t8")
    assert in_use() == []


@pytest.mark.parametrize("to", ["safetensors", "torch_save", "dcp", "zero"])
def test_objdir_outputs_are_byte_identical_to_local_ones(tmp_path: Path, to: str) -> None:
    src = DATA / "zero3_ws2_fp32" / "checkpoint"
    (tmp_path / "bucket").mkdir()
    options = ConvertOptions(world_size=3 if to == "zero" else 2 if to in ("dcp", "native") else 1)
    writer = {"zero_stage": 3} if to == "zero" else {}
    local, remote = tmp_path / "local", f"objdir://{tmp_path}/bucket/out{'.pt' if to == 'torch_save' else ''}"
    convert(src, local, to, options, writer=writer)
    convert(src, remote, to, options, writer=writer)
    storage, key = resolve(remote)
    assert isinstance(storage, ObjectDirStorage) and storage.audit() == []
    a = {str(p.relative_to(local)): p.read_bytes() for p in sorted(local.rglob("*")) if p.is_file()} if local.is_dir() else {"": local.read_bytes()}
    b = {k[len(key) + 1:]: storage.get(k)[0] for k in storage.list(key)} if storage.list(key) else {"": storage.get(key)[0]}
    if to == "dcp":  # a fresh save_id per save, as torch writes it
        a.pop(".metadata"), b.pop(".metadata")
    assert a == b and a
    back = read_checkpoint(remote)  # read back through the bucket's objects, by the objdir: name
    assert sorted(back.tensors) == sorted(read_checkpoint(local).tensors)
    assert inspect(remote).format == inspect(local).format


def test_a_path_inside_a_bucket_in_use_is_a_key_of_that_bucket(bucket: ObjectDirStorage) -> None:
    """What lets a native store's checkpoint directories be objects of the store's bucket
    (tests/test_native_objdir.py has the store itself)."""
    inner = f"objdir://{bucket.root}/store/checkpoints/00000000"
    assert resolve(inner)[1] == "00000000"  # no lease or output open: the parent directory is the bucket
    with bucket.lease("store/lock", "run a"):
        storage, key = resolve(inner)
        assert (storage.root, key) == (bucket.root, "store/checkpoints/00000000")  # type: ignore[attr-defined]
    assert resolve(inner)[1] == "00000000"


def test_a_prefix_goes_with_its_last_object_and_a_lease_with_its_holder(bucket: ObjectDirStorage) -> None:
    bucket.put("s/c/0/a", b"a")
    bucket.put("s/c/0/b", b"b")
    bucket.delete("s/c/0/a")
    assert (Path(bucket.root) / "s" / "c" / "0").is_dir()
    bucket.delete("s/c/0/b")
    assert os.listdir(bucket.root) == []  # no empty "directories" on an object store
    with bucket.lease("lock", "run a"):
        with pytest.raises(PreconditionFailed, match=r"pid \d+ on host .*, run run a, since"), bucket.lease("lock", "run b"):
            pass
        assert bucket.exists("lock")
    assert not bucket.exists("lock")


def test_local_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAVEX_STORAGE", raising=False)
    assert isinstance(resolve(tmp_path / "x")[0], LocalStorage)
    monkeypatch.setenv("RAVEX_STORAGE", "objdir")
    assert isinstance(resolve(tmp_path / "x")[0], ObjectDirStorage)


def test_local_conditional_put_and_lease(tmp_path: Path) -> None:
    """The local backend keeps the same promises (on POSIX a lease is an flock; the
    generation check is as strong as the lease the caller holds)."""
    local = LocalStorage()
    key = str(tmp_path / "m.json")
    g1 = local.put(key, b"1", if_generation=ABSENT)
    with pytest.raises(PreconditionFailed):
        local.put(key, b"x", if_generation=ABSENT)
    local.put(key, b"2", if_generation=g1)
    assert local.get(key)[0] == b"2"
    lock = str(tmp_path / "lock")
    # a second open file description is a second holder, as another process would be
    with local.lease(lock, "run-a"), pytest.raises(PreconditionFailed, match=r"pid \d+ on host .*, run run-a, since"), local.lease(lock, "run-b"):
        pass
    with local.lease(lock, "run-b"):
        pass


def test_a_forked_child_never_releases_its_parent_s_lease(tmp_path: Path) -> None:
    # A DataLoader worker is a fork of the process holding a run's lease: when the child's copy of
    # the holder goes away, the lease object must stay the parent's.
    (tmp_path / "b").mkdir()
    st = ObjectDirStorage(tmp_path / "b")
    lease = st.lease("s/lock", "run")
    lease.__enter__()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            lease.__exit__(None, None, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert st.exists("s/lock")
    lease.__exit__(None, None, None)
    assert not st.exists("s/lock")


@pytest.mark.parametrize("backend", ["local", "objdir"])
def test_a_failing_after_step_leaves_the_published_output_alone(tmp_path: Path, backend: str) -> None:
    # `after` runs once the output is published (native: the manifest's commit); plan.run must not
    # abort it then: on object storage that would delete the objects of a committed output.
    from ravex_convert.plan import OutFile, WritePlan, run

    def after(sealed: dict[str, object]) -> None:
        raise OSError(5, "Input/output error")

    (tmp_path / "b").mkdir()
    dst = tmp_path / "b" / "out" if backend == "local" else f"objdir:{tmp_path}/b/out"
    plan = WritePlan(True, [OutFile("a.bin", 4, small=[(0, b"abcd")])], [("index.json", b"{}")], after=after)
    with pytest.raises(RavexError, match="Input/output error"):
        run(plan, dst, force=False)
    assert (tmp_path / "b" / "out" / "a.bin").read_bytes() == b"abcd"
    assert (tmp_path / "b" / "out" / "index.json").read_bytes() == b"{}"
