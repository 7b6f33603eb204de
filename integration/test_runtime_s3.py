"""A training run whose store is in an S3 bucket (a real server on 127.0.0.1, tests/_s3server.py).

The machine is lost: the script is SIGKILLed, its working directory is gone, and the same
command with the same ``ravex.yaml`` is started in an empty directory. It resumes from the
bucket and trains what was left, with the losses and final weights of the run that was never
interrupted (whose store was on local disk). keep_last prunes in the bucket only after a newer
checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _s3server
from conftest import S3Prefix, s3_prefix
from test_runtime_resume import SCRIPT, losses

MAX_STEPS, EVERY = 14, 2


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = _s3server.session_server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> S3Prefix:
    return s3_prefix(s3_server, monkeypatch, request)


def _yaml(store: str, keep_last: int = 3) -> str:
    return f"storage:\n  path: {store}\ncheckpoint_every: {EVERY}\nmax_steps: {MAX_STEPS}\nkeep_last: {keep_last}\n"


def _run(cwd: Path, logs: Path, tag: str, opts: dict[str, Any], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The training script, started in ``cwd`` (which holds ``ravex.yaml`` and ``train.py``);
    its log and final weights go to ``logs`` (outside the working directory, which a lost
    machine takes with it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
    env.update({"OMP_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.run([sys.executable, "-P", str(cwd / "train.py"), json.dumps(opts), str(logs / f"log-{tag}.txt"),
                           str(logs / f"out-{tag}.json")], capture_output=True, text=True, env=env, cwd=cwd, timeout=180, check=False)


def _machine(root: Path, name: str, yaml: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "ravex.yaml").write_text(yaml)
    (d / "train.py").write_text(SCRIPT)
    return d


def test_a_lost_machine_resumes_from_the_bucket_bit_identically(s3: S3Prefix, tmp_path: Path) -> None:
    # shuffling in 2 DataLoader workers, an LR scheduler and an EMA tracked with ravex.track
    opts: dict[str, Any] = {"shuffle": True, "workers": 2, "loader_gen": True, "ema": True, "sched": True}
    logs = tmp_path / "logs"
    logs.mkdir()
    ref = _run(_machine(tmp_path, "ref", _yaml(str(tmp_path / "local-store"))), logs, "ref", opts)
    assert ref.returncode == 0, ref.stderr

    first = _machine(tmp_path, "first", _yaml(s3 / "run"))
    killed = _run(first, logs, "run", opts, {"KILL_AT_STEP": "7"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "upload" not in killed.stderr.lower() or "failed" not in killed.stderr.lower(), killed.stderr
    shutil.rmtree(first)  # the machine and its disk are gone

    again = _machine(tmp_path, "second", _yaml(s3 / "run"))
    done = _run(again, logs, "run", opts)
    assert done.returncode == 0, done.stderr
    assert "resuming from checkpoint" in done.stderr, done.stderr
    assert losses(logs, "run") == losses(logs, "ref")
    assert sorted(losses(logs, "ref")) == list(range(1, MAX_STEPS + 1))
    assert json.loads((logs / "out-run.json").read_text()) == json.loads((logs / "out-ref.json").read_text())
    assert not list(again.glob("ravex_checkpoints*")), "nothing was written to the new machine's disk"

    status = subprocess.run([str(Path(sys.executable).with_name("ravex")), "status", s3 / "run", "--json"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    steps = [c["step"] for c in st["checkpoints"]]
    # keep_last: 3, pruned in the bucket; the checkpoint the run resumed from is kept (as on disk)
    assert steps == [6, 10, 12, 14], steps
    assert st["unfinished_uploads"] == 0
    keys = s3.keys("run")
    assert "run-lock" not in keys and "lock" not in keys
    # a pruned checkpoint's metadata is gone (its data files stay where a kept checkpoint shares them)
    assert sorted(k.split("/")[1] for k in keys if k.endswith("/checkpoint.json")) == [f"{i:08d}" for i in (2, 4, 5, 6)], keys


def test_a_run_whose_bucket_goes_away_keeps_training_and_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      request: pytest.FixtureRequest) -> None:
    """The server dies after the first checkpoints went up: the run trains to the end with the same
    losses as the run that was never interrupted, and says once that checkpoints stopped."""
    server = _s3server.start(tmp_path / "own-server")  # this test's own: it is killed
    try:
        s3 = s3_prefix(server, monkeypatch, request)
        logs = tmp_path / "logs"
        logs.mkdir()
        opts = {"shuffle": True, "sleep": 0.15}
        ref = _run(_machine(tmp_path, "ref", _yaml(str(tmp_path / "local-store"))), logs, "ref", opts)
        assert ref.returncode == 0, ref.stderr
        d = _machine(tmp_path, "m", _yaml(s3 / "run"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
        env.update({"OMP_NUM_THREADS": "1", "RAVEX_S3_RETRIES": "1", "RAVEX_S3_RETRY_TIMEOUT_S": "3", "RAVEX_S3_TIMEOUT_S": "3",
                    "RAVEX_S3_CONNECT_TIMEOUT_S": "1"})
        p = subprocess.Popen([sys.executable, "-P", str(d / "train.py"), json.dumps(opts), str(logs / "log-run.txt"), str(logs / "out-run.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=d)
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            if "manifest.json" in s3.keys("run") and len([k for k in s3.keys("run") if k.endswith("checkpoint.json")]) >= 1:
                break
            time.sleep(0.05)
        server.proc.kill()  # the bucket is gone for good
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert out == ""
        assert losses(logs, "run") == losses(logs, "ref")
        assert err.count("disabled for the rest of this run") == 1, err
        assert "Traceback" not in err
        assert _s3server.SECRET_KEY not in err
    finally:
        server.stop()
