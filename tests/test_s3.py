"""Checkpoints in an S3 bucket, against a real S3 server on 127.0.0.1 (SeaweedFS, tests/_s3server.py).

Every command takes ``s3://bucket/prefix`` on either side. What Ravex writes to a bucket is
fetched back with boto3 (a client that is not Ravex's) and compared byte for byte with the
same conversion written to local disk; what it reads from a bucket gives the same output
as the same files read locally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DATA, S3Prefix, ravex_bin, run_ravex

ZERO3 = DATA / "zero3_ws2_fp32" / "checkpoint"
FSDP2 = DATA / "fsdp2_ws2" / "checkpoint"

# source fixtures, each read from the bucket and from disk
SOURCES = ["zero1_ws2_bf16", "zero3_ws2_fp32", "fsdp2_ws2", "safetensors_sharded", "torch_save"]


def _tree(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _source(name: str) -> Path:
    src = DATA / name / "checkpoint"
    entries = [p for p in src.iterdir() if not p.name.startswith(".")]
    # a single-file checkpoint is the file, not its directory
    return entries[0] if len(entries) == 1 and entries[0].is_file() else src


@pytest.mark.parametrize("name", SOURCES)
def test_a_source_in_a_bucket_converts_as_it_does_from_disk(name: str, s3: S3Prefix, tmp_path: Path) -> None:
    src = _source(name)
    url = s3.upload(src, src.name)
    _ok(run_ravex("convert", src, tmp_path / "local.safetensors"))
    _ok(run_ravex("convert", url, tmp_path / "remote.safetensors"))
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    # the same description, but for where the checkpoint is
    local, remote = (json.loads(_ok(run_ravex("inspect", p, "--json")).stdout.replace(str(p), "SRC")) for p in (src, url))
    assert remote == local


# Through the command line, two writers (every writer, in process: test_every_writer_writes_to_a_bucket_what_it_writes_to_disk).
@pytest.mark.parametrize(("to", "name", "extra"), [
    ("dcp", "dcp", ["--world-size", "3"]),
    ("zero", "zero", ["--zero-stage", "2", "--world-size", "3"]),
])
def test_an_output_in_a_bucket_is_the_bytes_written_to_disk(to: str, name: str, extra: list[str], s3: S3Prefix, tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    _ok(run_ravex("convert", ZERO3, tmp_path / "local" / name, "--to", to, *extra))
    _ok(run_ravex("convert", ZERO3, s3 / name, "--to", to, *extra))
    got = s3.download(name, tmp_path / "remote" / name)
    # DCP's .metadata records where it was written (its checkpoint id): everything else is equal
    drop = {".metadata"} if to == "dcp" else set()
    assert {k: v for k, v in _tree(got).items() if k not in drop} == {k: v for k, v in _tree(tmp_path / "local" / name).items() if k not in drop}
    assert s3.unfinished() == []
    _ok(run_ravex("verify", s3 / name, tmp_path / "local" / name))


def test_bucket_to_bucket_and_a_native_store(s3: S3Prefix, tmp_path: Path) -> None:
    src = s3.upload(FSDP2, "src")
    _ok(run_ravex("convert", src, s3 / "store", "--to", "native"))
    assert {"ravex-store.json", "manifest.json"} <= set(s3.keys("store"))
    assert not [k for k in s3.keys("store") if k.endswith(("lock", "run-lock"))], "the lease is released"
    _ok(run_ravex("convert", s3 / "store", s3 / "again.safetensors"))
    _ok(run_ravex("convert", FSDP2, tmp_path / "ref.safetensors"))
    assert s3.download("again.safetensors", tmp_path / "again.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    res = _ok(run_ravex("verify", s3 / "store", src))
    assert "identical" in res.stdout
    # and the reference loader reads the file Ravex wrote to the bucket
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "again.safetensors")) == set(load_file(tmp_path / "ref.safetensors"))


def test_a_large_object_goes_up_in_equal_parts_and_reads_back(s3: S3Prefix, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}  # 24 MiB: 3 parts of 8 MiB (+ header)
    save_file(tensors, tmp_path / "big.safetensors")
    # the same chain twice: through the bucket, and on disk
    _ok(run_ravex("convert", tmp_path / "big.safetensors", s3 / "big.safetensors"))
    _ok(run_ravex("convert", s3 / "big.safetensors", s3 / "big.pt", "--to", "torch_save"))
    _ok(run_ravex("convert", s3 / "big.pt", tmp_path / "back.safetensors"))
    _ok(run_ravex("convert", tmp_path / "big.safetensors", tmp_path / "l1.safetensors"))
    _ok(run_ravex("convert", tmp_path / "l1.safetensors", tmp_path / "l2.pt", "--to", "torch_save"))
    _ok(run_ravex("convert", tmp_path / "l2.pt", tmp_path / "l3.safetensors"))
    assert s3.download("big.safetensors", tmp_path / "got.safetensors").read_bytes() == (tmp_path / "l1.safetensors").read_bytes()
    assert s3.download("big.pt", tmp_path / "got.pt").read_bytes() == (tmp_path / "l2.pt").read_bytes()
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "l3.safetensors").read_bytes()
    import _s3server

    c = _s3server.client(s3.server.endpoint)
    bucket, key = _s3server.split(s3 / "big.safetensors")
    head = c.head_object(Bucket=bucket, Key=key)
    assert head["ETag"].strip('"').endswith("-4"), head["ETag"]  # a multipart upload of 4 parts (8+8+8+header)
    sizes = [c.head_object(Bucket=bucket, Key=key, PartNumber=n)["ContentLength"] for n in (1, 2, 3, 4)]
    assert sizes[:3] == [8 << 20] * 3 and sum(sizes) == head["ContentLength"]


def test_an_existing_output_is_refused_and_replaced_with_force(s3: S3Prefix) -> None:
    _ok(run_ravex("convert", ZERO3, s3 / "dcp", "--to", "dcp"))
    res = run_ravex("convert", ZERO3, s3 / "dcp", "--to", "dcp")
    assert res.returncode != 0 and "already exists" in res.stderr and "--force" in res.stderr
    _ok(run_ravex("convert", ZERO3, s3 / "dcp", "--to", "dcp", "--world-size", "3", "--force"))
    assert sorted(k for k in s3.keys("dcp") if k.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def _big_source(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    src = tmp_path / "src.safetensors"
    save_file({f"t{i}": torch.randn(4 << 20, generator=g) for i in range(12)}, src)  # 192 MiB
    return src


def test_a_killed_upload_leaves_nothing_that_looks_complete(s3: S3Prefix, tmp_path: Path) -> None:
    src = _big_source(tmp_path)
    env = dict(os.environ, RAVEX_S3_IN_FLIGHT="1", RAVEX_S3_PART_MB="5")
    proc = subprocess.Popen([ravex_bin(), "convert", str(src), s3 / "dcp", "--to", "dcp", "--world-size", "2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not s3.unfinished("dcp") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the conversion ended before its upload could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ".metadata" not in s3.keys("dcp")
    for cmd in (["inspect", s3 / "dcp"], ["verify", s3 / "dcp", src], ["convert", s3 / "dcp", tmp_path / "x.safetensors"]):
        res = run_ravex(*cmd)
        assert res.returncode != 0, cmd
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "x.safetensors").exists()
    # the rerun (with --force, since something is there) clears what the killed writer left
    _ok(run_ravex("convert", src, s3 / "dcp", "--to", "dcp", "--world-size", "2", "--force"))
    assert s3.unfinished("dcp") == []
    _ok(run_ravex("verify", s3 / "dcp", src))


def _cli_fails(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    text = res.stdout + res.stderr
    assert res.returncode not in (0, 1), text  # 1 is an internal error
    assert "Traceback" not in text
    for n in needles:
        assert n in text, text
    return text


def test_errors_name_the_url_and_never_the_credentials(s3: S3Prefix, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import _s3server

    s3.upload(ZERO3, "src")
    missing = _cli_fails(run_ravex("inspect", s3 / "nothing-here"), s3 / "nothing-here")
    assert "no such" in missing
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret-key-value")
    monkeypatch.setenv("RAVEX_S3_RETRIES", "0")
    denied = _cli_fails(run_ravex("inspect", s3 / "src"), "s3://", "credentials")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", _s3server.SECRET_KEY)
    nob = _cli_fails(run_ravex("inspect", "s3://no-such-bucket/x"), "no-such-bucket", "does not exist")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    t0 = time.monotonic()
    unreachable = _cli_fails(run_ravex("convert", ZERO3, s3 / "out.safetensors"), "cannot reach", "AWS_ENDPOINT_URL")
    assert time.monotonic() - t0 < 30
    bad_json = run_ravex("inspect", s3 / "src", "--json")
    for text in (missing, denied, nob, unreachable, bad_json.stdout + bad_json.stderr):
        assert _s3server.SECRET_KEY not in text and "a-wrong-secret-key-value" not in text
        assert _s3server.ACCESS_KEY not in text.replace("ravex-test-", "")  # the key id only as part of a test prefix name


def test_nothing_stored_holds_a_credential(s3: S3Prefix, tmp_path: Path) -> None:
    import _s3server

    _ok(run_ravex("convert", FSDP2, s3 / "store", "--to", "native"))
    got = s3.download("store", tmp_path / "store")
    for rel, data in _tree(got).items():
        assert _s3server.SECRET_KEY.encode() not in data, rel
        assert _s3server.ACCESS_KEY.encode() + b'"' not in data, rel


def test_the_test_server_stays_on_loopback(s3: S3Prefix) -> None:
    listening = s3.server.listening()
    assert listening and all(addr in ("127.0.0.1", "::ffff:127.0.0.1") for addr, _ in listening), listening
    assert all(addr in ("127.0.0.1", "::ffff:127.0.0.1") for addr, _ in s3.server.connected())


def test_torchrun_ranks_stream_their_share_and_rank0_commits(s3: S3Prefix, tmp_path: Path) -> None:
    from _launch import launch

    _ok(run_ravex("convert", ZERO3, tmp_path / "one", "--to", "dcp", "--world-size", "4"))
    src = s3.upload(ZERO3, "src")  # bucket to bucket
    res = launch(2, ["-m", "ravex", "convert", src, s3 / "dcp", "--to", "dcp", "--world-size", "4"], cwd=tmp_path,
                 env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    both = {k: v for k, v in _tree(s3.download("dcp", tmp_path / "two")).items() if k != ".metadata"}
    assert both == {k: v for k, v in _tree(tmp_path / "one").items() if k != ".metadata"}
    _ok(run_ravex("verify", s3 / "dcp", tmp_path / "one"))


# Every writer, in process, from two kinds of source: the bucket's objects are the bytes the same
# conversion writes to disk (files whose bytes record the run or the place they were written are
# compared by `verify` instead: DCP's .metadata, a store's marker, manifest and checkpoint.json).
WRITERS = [
    ("safetensors", "o.safetensors", {}, {}),
    ("safetensors", "sharded", {}, {"max_shard_size": 20_000}),
    ("torch_save", "o.pt", {}, {}),
    ("torch_save", "src-layout.pt", {}, {"layout": "source"}),
    ("dcp", "dcp", {"world_size": 3}, {}),
    ("zero", "zero1", {"world_size": 2}, {"zero_stage": 1}),
    ("zero", "zero3", {"world_size": 3}, {"zero_stage": 3}),
    ("native", "store", {}, {}),
    ("native", "storez", {}, {"compression": "zstd"}),
    ("hf_trainer", "checkpoint-3", {}, {}),
    ("accelerate", "acc", {}, {}),
]
_RECORDS_WHERE_OR_WHEN = {".metadata", "ravex-store.json", "manifest.json", "checkpoint.json"}


@pytest.mark.parametrize("source", ["zero2_ws2_bf16", "torch_save"])
def test_every_writer_writes_to_a_bucket_what_it_writes_to_disk(source: str, s3: S3Prefix, tmp_path: Path) -> None:
    from ravex_convert import convert, verify
    from ravex_convert.convert import ConvertOptions

    src = _source(source)
    for to, name, opts, writer in WRITERS:
        if to == "torch_save" and writer.get("layout") == "source" and source != "torch_save":
            continue
        local = tmp_path / "local" / name
        local.parent.mkdir(exist_ok=True)
        try:
            convert(src, local, to, ConvertOptions(**opts), writer=writer)
        except Exception as exc:  # noqa: BLE001 - a pairing the writer refuses on disk is refused in the bucket too
            with pytest.raises(type(exc)):
                convert(src, s3 / name, to, ConvertOptions(**opts), writer=writer)
            continue
        convert(src, s3 / name, to, ConvertOptions(**opts), writer=writer)
        got = _tree(s3.download(name, tmp_path / "remote" / name))
        want = _tree(local)
        assert sorted(got) == sorted(k for k in want if k != "lock"), (to, name)  # (a local store's flock file)
        for rel in got:
            if rel.rsplit("/", 1)[-1] not in _RECORDS_WHERE_OR_WHEN:
                assert got[rel] == want[rel], (to, name, rel)
        # (an HF Trainer or Accelerate optimizer file keys parameters by position: its bytes were compared above)
        assert verify(s3 / name, local, weights_only=to in ("hf_trainer", "accelerate")).identical, (to, name)
    assert s3.unfinished() == []


@pytest.mark.parametrize("where", ["../outside/00000000", "/outside/00000000", "checkpoints/../../outside/00000000"])
def test_a_store_in_a_bucket_naming_keys_outside_its_prefix_is_refused(where: str, s3: S3Prefix, tmp_path: Path) -> None:
    """Item 6: a manifest entry's ``dir`` never reaches outside the store's prefix, on a bucket as
    on disk: every command refuses the store (exit 7) and reads nothing from the other prefix."""
    _ok(run_ravex("convert", ZERO3, tmp_path / "store", "--to", "native"))
    s3.upload(tmp_path / "store" / "checkpoints" / "00000000", "outside/00000000")
    m = json.loads((tmp_path / "store" / "manifest.json").read_text())
    m["checkpoints"][0]["dir"] = where
    (tmp_path / "store" / "manifest.json").write_text(json.dumps(m))
    url = s3.upload(tmp_path / "store", "store")
    for command, args in {"status": [url], "inspect": [url], "verify": [url, url], "convert": [url, tmp_path / "out.safetensors"]}.items():
        res = run_ravex(command, *args)
        assert res.returncode == 7, f"{command}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        assert "hint:" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_status_counts_uploads_a_killed_writer_left_and_the_next_write_aborts_them(s3: S3Prefix) -> None:
    import _s3server

    _ok(run_ravex("convert", ZERO3, s3 / "store", "--to", "native"))
    bucket, key = _s3server.split(s3 / "store/checkpoints/00000001/rank00000.safetensors")
    _s3server.client(s3.server.endpoint).create_multipart_upload(Bucket=bucket, Key=key)  # what a SIGKILL mid-upload leaves
    st = json.loads(_ok(run_ravex("status", s3 / "store", "--json")).stdout)
    assert st["unfinished_uploads"] == 1
    assert "1 unfinished multipart upload(s)" in _ok(run_ravex("status", s3 / "store")).stdout
    _ok(run_ravex("convert", FSDP2, s3 / "store", "--to", "native"))  # the next checkpoint of the store
    assert s3.unfinished("store") == []
    assert json.loads(_ok(run_ravex("status", s3 / "store", "--json")).stdout)["unfinished_uploads"] == 0


def test_reads_through_a_slow_link_with_parts_fetched_ahead_are_exact(s3: S3Prefix, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A source read through bench/_shaper.py (30 ms round trip, 32 MB/s a connection): the executor's
    reads and ``S3Path.open``'s, with fewer parts in flight than one piece spans, give the bytes a
    local read gives. No timing is asserted."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from _shaper import Shaper

    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    # 10 tensors of 4 MiB and odd small ones between them: 5+ parts of 8 MiB, reads across part edges
    tensors = {f"t{i}": torch.randn((1 << 20) + 3 * i, generator=g) for i in range(10)}
    tensors |= {f"s{i}": torch.randn(7 + i, generator=g) for i in range(20)}
    src = tmp_path / "src.safetensors"
    save_file(tensors, src)
    url = s3.upload(src, "src.safetensors")
    host, port = s3.server.endpoint.removeprefix("http://").rsplit(":", 1)
    _ok(run_ravex("convert", src, tmp_path / "local.safetensors"))
    _ok(run_ravex("convert", src, tmp_path / "local.pt", "--to", "torch_save"))
    with Shaper(host, int(port), rtt_s=0.030, rate=32e6) as sh:
        monkeypatch.setenv("AWS_ENDPOINT_URL", sh.endpoint)
        for in_flight in ("2", "16"):
            monkeypatch.setenv("RAVEX_S3_READ_AHEAD", in_flight)
            _ok(run_ravex("convert", url, tmp_path / f"remote-{in_flight}.safetensors", "--no-sync"))
            assert (tmp_path / f"remote-{in_flight}.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
        # a torch_save written to the bucket and read back: a zip, read where its entries are
        _ok(run_ravex("convert", url, s3 / "x.pt", "--to", "torch_save"))
        _ok(run_ravex("convert", s3 / "x.pt", tmp_path / "back.pt", "--to", "torch_save"))
        assert (tmp_path / "back.pt").read_bytes() == (tmp_path / "local.pt").read_bytes()
        assert sh.connections > 1 and sh.bytes["down"] >= 2 * src.stat().st_size
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.server.endpoint)
    # the Python-side reader (S3Path.open) in reads of odd sizes, and seeks
    from ravex_convert.storage.s3 import S3Path

    want = src.read_bytes()
    with S3Path.of(url).open("rb") as f:
        got = b"".join(iter(lambda: f.read(3_000_017), b""))
        f.seek(len(want) - 100)
        tail = f.read()
        f.seek(5)
        head = f.read(10)
    assert got == want and tail == want[-100:] and head == want[5:15]


def test_a_resume_from_a_bucket_reads_each_byte_once_and_still_finds_damage(s3: S3Prefix, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """load_checkpoint (what a resume from an empty disk calls) checks the checksums on the bytes it
    reads: one download of the checkpoint, not a hashing pass and then a reading pass."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import _s3server
    from _shaper import Shaper

    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from ravex_convert.errors import CorruptCheckpointError
    from ravex_convert.storage import resolve
    from ravex_runtime.loading import load_checkpoint

    g = torch.Generator().manual_seed(3)
    src = tmp_path / "src.safetensors"
    save_file({f"t{i}": torch.randn(1 << 20, generator=g) for i in range(6)} | {"small": torch.arange(5)}, src)
    _ok(run_ravex("convert", src, s3 / "store", "--to", "native"))
    size = src.stat().st_size
    host, port = s3.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with Shaper(host, int(port), rtt_s=0.002, rate=1e9) as sh:
        monkeypatch.setenv("AWS_ENDPOINT_URL", sh.endpoint)
        _, tensors = load_checkpoint(resolve(s3 / "store").path)
        assert sh.bytes["down"] < 1.2 * size, (sh.bytes["down"], size)
    want = load_file(src)
    assert sorted(tensors) == sorted(f"model/{k}" for k in want)
    assert all(torch.equal(tensors[f"model/{k}"], v) for k, v in want.items())
    # one byte of a data object flipped: the load refuses it
    c = _s3server.client(s3.server.endpoint)
    bucket, prefix = (s3 / "store").removeprefix("s3://").split("/", 1)
    data = max((o for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]), key=lambda o: o["Size"])
    body = bytearray(c.get_object(Bucket=bucket, Key=data["Key"])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket=bucket, Key=data["Key"], Body=bytes(body))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.server.endpoint)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(resolve(s3 / "store").path)
