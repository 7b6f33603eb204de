"""Shared helpers: where the fixtures are, and running the `ravex` command."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
DATA = FIXTURES / "data"


def ravex_bin() -> str:
    exe = Path(sys.executable).with_name("ravex")
    found = str(exe) if exe.exists() else shutil.which("ravex")
    if not found:
        pytest.fail("the `ravex` command is not installed in this environment (run scripts/install.sh)")
    return found


def run_ravex(*args: str | os.PathLike[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    return subprocess.run([ravex_bin(), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=120, check=False)


def run_without_torch(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter, fail if it imported torch; its stdout."""
    code += "\nimport sys as _s\nassert 'torch' not in _s.modules, 'torch was imported'\n"
    # -P: keep the working directory (the source tree, without the compiled core) off sys.path
    res = subprocess.run([sys.executable, "-P", "-c", code, *args], capture_output=True, text=True, env=dict(os.environ), timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout


def inspect_json(path: Path, *extra: str) -> dict[str, Any]:
    res = run_ravex("inspect", path, "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(autouse=True)
def _registry_left_as_found() -> Iterator[None]:
    """A test that registers a format must take it out again (``registry.registered``):
    a format left behind would change detection, ``--to`` and the CLI's options for
    every later test. Put back, and the test fails."""
    from ravex_convert.formats import registry

    before = list(registry.formats())
    yield
    after = list(registry.formats())
    if after != before:
        for f in after:
            registry.unregister(f.name)
        for f in before:
            registry.register(f)
        pytest.fail(f"the test left the format registry changed: {[f.name for f in before]} -> {[f.name for f in after]}")


# Written by the frameworks' own code (fixtures/_lightning_ds.py, fixtures/_accelerate_fsdp.py): what a user points at is
# inside checkpoint/ (last.ckpt/, state/), and their own test files check them.
FRAMEWORK_FIXTURES = frozenset({"lightning_ds2_ws2", "lightning_ds3_ws2", "accelerate_fsdp2_ws2"})


def fixture_dirs() -> list[str]:
    """The fixtures whose checkpoint/ is the checkpoint a user points at."""
    return sorted(p.name for p in DATA.iterdir() if (p / "checkpoint").is_dir() and p.name not in FRAMEWORK_FIXTURES) if DATA.is_dir() else []


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A runtime test's world: no RAVEX_* from outside, the working directory and the
    store in tmp_path, a checkpoint every 2 steps, 10 kept. Returns the store's path."""
    for k in list(os.environ):
        if k.startswith("RAVEX_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    monkeypatch.setenv("RAVEX_STORAGE_PATH", str(store))
    monkeypatch.setenv("RAVEX_CHECKPOINT_EVERY", "2")
    monkeypatch.setenv("RAVEX_KEEP_LAST", "10")
    return store


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real S3 server (SeaweedFS, tests/_s3server.py) on 127.0.0.1 for the session;
    each test takes a prefix of its own in its bucket."""
    import _s3server

    server = _s3server.session_server(tmp_path_factory.mktemp("s3"))  # scripts/test.sh's, where it started one
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> S3Prefix:
    """A prefix of this test's own in the session's bucket, and the environment a user of an
    S3-compatible store sets (AWS_* credentials and AWS_ENDPOINT_URL; nothing else)."""
    return s3_prefix(s3_server, monkeypatch, request)


def s3_prefix(server: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> S3Prefix:
    """The body of the ``s3`` fixture (integration/ defines the fixture again over it)."""
    import re
    import uuid

    import _s3server

    for k in list(os.environ):
        if k.startswith(("AWS_", "RAVEX_S3_")):
            monkeypatch.delenv(k)
    env = {"AWS_ACCESS_KEY_ID": _s3server.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": _s3server.SECRET_KEY,
           "AWS_ENDPOINT_URL": server.endpoint, "AWS_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:48]
    return S3Prefix(server, f"s3://{server.bucket}/t/{name}-{uuid.uuid4().hex[:8]}", env)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A second S3 implementation (moto's server, tests/_s3server.py ``start_moto``) on
    127.0.0.1 for the session: the rules where S3 servers differ are tested on both."""
    import _s3server

    server = _s3server.start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        # killed: its objects are in its memory, nothing to keep, and on SIGTERM its threaded
        # server waits a few seconds for the test process's idle keep-alive connections
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)


S3_SERVERS = ["seaweedfs", "moto"]


@pytest.fixture(params=S3_SERVERS)
def s3_each(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Prefix]:
    """``s3``, once on each S3 implementation (SeaweedFS, moto). Moto does not check
    signatures: a test of refused credentials belongs on SeaweedFS only."""
    server = request.getfixturevalue("s3_server" if request.param == "seaweedfs" else "moto_server")
    yield s3_prefix(server, monkeypatch, request)


class S3Prefix:
    """``url``: this test's prefix (``s3://ckpt/t/<test>-<id>``); helpers over boto3 to put
    files there and fetch Ravex's objects back."""

    def __init__(self, server: Any, url: str, env: dict[str, str]):
        self.server, self.url, self.env = server, url, env

    def __truediv__(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def upload(self, local: Path, rel: str) -> str:
        import _s3server

        _s3server.upload_tree(self.server.endpoint, local, self / rel)
        return self / rel

    def download(self, rel: str, local: Path) -> Path:
        import _s3server

        _s3server.download_tree(self.server.endpoint, self / rel, local)
        return local

    def keys(self, rel: str) -> list[str]:
        import _s3server

        return _s3server.keys_under(self.server.endpoint, self / rel)

    def unfinished(self, rel: str = "") -> list[str]:
        import _s3server

        return _s3server.unfinished_uploads(self.server.endpoint, self / rel if rel else self.url)


# The storage backends a writer's test runs on: each test of a module that uses this fixture
# (pytestmark = pytest.mark.usefixtures("storage_backend")) runs once per backend, grouped by
# backend (module scope), with every plain output path routed through it. "objdir" keeps the
# object-store rules: no rename, no in-place update, no flock inside a bucket while an output is
# open there (ravex_convert/storage/objdir.py); a writer that assumes POSIX fails there.
STORAGE_BACKENDS = ["local", "objdir"]


@pytest.fixture(scope="module", params=STORAGE_BACKENDS)
def storage_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "local":
            mp.delenv("RAVEX_STORAGE", raising=False)
        else:
            mp.setenv("RAVEX_STORAGE", request.param)
        yield str(request.param)


@contextlib.contextmanager
def said(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Ravex's log lines into ``caplog`` (the ravex logger does not propagate while a run is on)."""
    logger = logging.getLogger("ravex")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="ravex"):
            yield
    finally:
        logger.removeHandler(caplog.handler)
