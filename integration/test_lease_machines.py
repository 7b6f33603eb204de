"""Many machines, one bucket (issue 43): each run has a hostname and a PID namespace of its own
(``unshare -u -p -f --kill-child --mount-proc``: the trainer is PID 1 of its own table, as in a
container), a working directory of its own, and the same bucket, on SeaweedFS and on moto.

- A machine is lost (SIGKILL of its ``unshare``: the whole namespace goes): a replacement started
  at once waits for the lost run's lease to lapse by that run's TTL, takes it over and resumes
  bit-identically.
- A machine is frozen (SIGSTOP of the trainer) past its TTL: a replacement takes the store over
  and trains to the end; thawed (SIGCONT), the old run commits nothing more, says so once at
  ERROR naming the run and host that took over, and stops with an error.

The one-process scenarios (a longer TTL is not taken over by a shorter one; a lease written with
a clock minutes off) are in tests/test_lease.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _s3server
from conftest import S3Prefix, s3_prefix
from test_runtime_resume import SCRIPT, losses

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                                   reason="separate machines need unshare and root")]

TTL = 6  # RAVEX_S3_LEASE_TTL of every run here: renewed every 1.5 s
EVERY = 2


@pytest.fixture(scope="module", params=["seaweedfs", "moto"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if request.param == "seaweedfs":
        s = _s3server.session_server(tmp_path_factory.mktemp("s3"))
    else:
        s = _s3server.start_moto(tmp_path_factory.mktemp("moto"))
    yield s
    s.stop()


@pytest.fixture
def s3(server: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> S3Prefix:
    return s3_prefix(server, monkeypatch, request)


def _yaml(store: str, max_steps: int) -> str:
    return f"storage:\n  path: {store}\ncheckpoint_every: {EVERY}\nmax_steps: {max_steps}\nkeep_last: 20\n"


def _machine(root: Path, name: str, yaml: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "ravex.yaml").write_text(yaml)
    (d / "train.py").write_text(SCRIPT)
    return d


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_S3_LEASE_TTL": str(TTL)})
    return env


def _start(cwd: Path, host: str, logs: Path, tag: str, opts: dict[str, Any]) -> subprocess.Popen[str]:
    """The training script on "machine" ``host``: its own hostname and PID namespace."""
    cmd = ["unshare", "-u", "-p", "-f", "--kill-child", "--mount-proc", "sh", "-c", f'hostname {host} && exec "$@"', "sh",
           sys.executable, "-P", str(cwd / "train.py"), json.dumps(opts), str(logs / f"log-{tag}.txt"), str(logs / f"out-{tag}.json")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd)


def _trainer(p: subprocess.Popen[str]) -> int:
    """The pid (in this namespace) of the trainer under ``unshare``: its child (PID 1 of the machine)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise AssertionError("unshare started no trainer")


def _manifest(s3: S3Prefix, tmp: Path) -> dict[str, Any]:
    got = s3.download("run/manifest.json", tmp / f"manifest-{time.monotonic_ns()}.json")
    return json.loads(got.read_text())


def _wait_for_steps(s3: S3Prefix, tmp: Path, step: int, p: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()[1]
        if "manifest.json" in s3.keys("run"):
            steps = [e["step"] for e in _manifest(s3, tmp)["checkpoints"]]
            if steps and max(steps) >= step:
                return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of step {step} within {timeout} s")


def _ref(tmp: Path, logs: Path, opts: dict[str, Any], max_steps: int) -> None:
    d = _machine(tmp, "ref", _yaml(str(tmp / "local-store"), max_steps))
    ref = subprocess.run([sys.executable, "-P", str(d / "train.py"), json.dumps(opts), str(logs / "log-ref.txt"), str(logs / "out-ref.json")],
                         capture_output=True, text=True, env=_env(), cwd=d, timeout=180, check=False)
    assert ref.returncode == 0, ref.stderr


def test_a_replacement_node_resumes_after_the_machine_is_lost(s3: S3Prefix, tmp_path: Path) -> None:
    max_steps = 16
    opts: dict[str, Any] = {"shuffle": True, "sched": True, "sleep": 0.25}
    logs = tmp_path / "logs"
    logs.mkdir()
    _ref(tmp_path, logs, opts, max_steps)

    a = _start(_machine(tmp_path, "node-a", _yaml(s3 / "run", max_steps)), "node-a", logs, "run", opts)
    _wait_for_steps(s3, tmp_path, 4, a)
    a.send_signal(signal.SIGKILL)  # the machine is lost: --kill-child takes its namespace down
    a.communicate(timeout=30)
    assert a.returncode == -signal.SIGKILL
    done_by_a = max(losses(logs, "run"))
    assert done_by_a < max_steps and not (logs / "out-run.json").exists(), "the kill landed before the run finished"
    shutil.rmtree(tmp_path / "node-a")  # and its disk

    t0 = time.monotonic()
    b = _start(_machine(tmp_path, "node-b", _yaml(s3 / "run", max_steps)), "node-b", logs, "run", opts)
    out, err = b.communicate(timeout=180)
    took = time.monotonic() - t0
    assert b.returncode == 0, err
    assert out == ""
    # it waited for node-a's lease (another PID namespace: its pid proves nothing here), said so once, then took over
    waits = [ln for ln in err.splitlines() if "waiting up to" in ln and "/run-lock is held by" in ln]
    assert len(waits) == 1 and "on host node-a" in waits[0], err
    assert "took over the lease" in err and "resuming from checkpoint" in err, err
    assert took < TTL + 2 + (max_steps - 4) * 0.25 + 30, took
    assert losses(logs, "run") == losses(logs, "ref")
    assert sorted(losses(logs, "ref")) == list(range(1, max_steps + 1))
    assert json.loads((logs / "out-run.json").read_text()) == json.loads((logs / "out-ref.json").read_text())
    manifest = _manifest(s3, tmp_path)
    assert manifest["lease"]["host"] == "node-b" and manifest["lease"]["generation"] >= 2
    assert "run-lock" not in s3.keys("run")  # node-b released it at its end


def test_a_frozen_holder_commits_nothing_after_the_takeover(s3: S3Prefix, tmp_path: Path) -> None:
    opts: dict[str, Any] = {"shuffle": True, "sleep": 0.25}
    logs = tmp_path / "logs"
    logs.mkdir()
    a = _start(_machine(tmp_path, "node-a", _yaml(s3 / "run", 200)), "node-a", logs, "a", opts)
    _wait_for_steps(s3, tmp_path, 4, a)
    trainer = _trainer(a)
    os.kill(trainer, signal.SIGSTOP)  # frozen: its lease is no longer renewed
    try:
        frozen_at = _manifest(s3, tmp_path)
        b = _start(_machine(tmp_path, "node-b", _yaml(s3 / "run", 16)), "node-b", logs, "b", opts)
        _, b_err = b.communicate(timeout=180)
        assert b.returncode == 0, b_err
        assert "took over the lease" in b_err and "on host node-a" in b_err, b_err
    finally:
        os.kill(trainer, signal.SIGCONT)
    after_b = _manifest(s3, tmp_path)
    b_run = after_b["lease"]["run_id"]
    assert after_b["lease"]["host"] == "node-b" and after_b["lease"]["generation"] > frozen_at["lease"]["generation"]
    # thawed: node-a commits nothing more, says so once, and stops with an error
    a_out, a_err = a.communicate(timeout=120)
    assert a.returncode not in (0, -signal.SIGKILL), a_err
    assert a_err.count(f"run {b_run} on host node-b took it over") >= 1, a_err
    assert len([ln for ln in a_err.splitlines() if "ravex: " in ln and "took it over" in ln]) == 1, a_err
    assert "StoreTakenOverError" in a_err, a_err
    final = _manifest(s3, tmp_path)
    assert final == after_b, "nothing was committed after the takeover"
    entries = final["checkpoints"]
    runs = [e["run_id"] for e in entries]
    # one lineage: node-a's checkpoints up to the freeze, then node-b's only
    a_run = frozen_at["checkpoints"][-1]["run_id"]
    assert runs == [a_run] * runs.count(a_run) + [b_run] * (len(runs) - runs.count(a_run)), runs
    assert [e["index"] for e in entries if e["run_id"] == a_run] == [e["index"] for e in frozen_at["checkpoints"]]
    assert max(e["step"] for e in entries) == 16
    assert a_out == ""
