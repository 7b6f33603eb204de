"""``replicate_every`` on simulated machines: a job that loses a machine's disk resumes from the copy.

Each "machine" is a torchrun agent (``--nnodes M``, its own ``--node_rank``, rendezvous on
127.0.0.1) in a UTS namespace of its own (``unshare -u``: its own hostname), with a working
directory of its own that holds its ``storage.path`` (its local disk). The training script is
integration/dist_train.py; its logs go to a directory outside the machines, so that wiping one
keeps them. A whole job is killed by SIGKILL of every agent and every process each started
(torchrun starts its workers in sessions of their own), and the tests check that the first run
really stopped before its end. "Bit-identical" is test_dist_runtime.py's: every rank's logged
losses, batches and weight hashes equal those of the uninterrupted run of the same job on one
machine, and so do the final weights. Needs root (``unshare``), as CI has.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_dist_runtime import (
    MAX_STEPS,
    MODES,
    SCRIPT,
    SHUTDOWN_S,
    Done,
    Job,
    _job_env,
    assert_checkpoints_hold_their_steps,
    assert_epoch_covered_once,
    assert_like_reference,
    assert_written_by,
    by_step,
    checkpoints,
    finish,
    free_port,
    kill_all,
    ok,
    read_log,
    reference,  # noqa: F401 - the fixture, taken by name below
    seen,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="simulated machines need root and unshare")]

STORE = "ravex_checkpoints"  # storage.path, relative: on each machine's own disk
TIMEOUT = 120.0
ELASTIC_LAST_CALL_S = 10


def machines(tmp: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        d = tmp / f"machine-{chr(ord('a') + i)}"
        d.mkdir(exist_ok=True)
        out.append(d)
    return out


def launch_machines(tmp: Path, dirs: list[Path], mode: str, opts: dict[str, Any], env: dict[str, Any], *,
                    rendezvous: int | None = None, store: str = STORE) -> list[Job]:
    """One torchrun agent per machine, one rank each: machine i holds rank i. ``rendezvous``: an
    elastic job (``--nnodes 1:M``, up to 3 restarts) whose agents meet at the c10d store listening
    on that port, which no machine hosts (a machine lost must not take the rendezvous with it)."""
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    port = free_port()
    jobs = []
    for i, d in enumerate(dirs):
        o, full, what = _job_env(d, "run", 1, {**MODES[mode], **opts, "outdir": str(logs)}, env, d / STORE)
        full["RAVEX_STORAGE_PATH"] = store  # STORE, relative: each machine's own directory; absolute: one every machine sees
        if rendezvous is None:
            where = ["--nnodes", str(len(dirs)), "--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        else:
            # last_call: how long a restarted agent waits for machines beyond the minimum (also how late
            # the second machine may start); the dead one leaves the rendezvous after 3 missed heartbeats (15 s)
            where = ["--nnodes", f"1:{len(dirs)}", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous}",
                     "--rdzv-id", "shrink", "--rdzv-conf", f"is_host=false,last_call_timeout={ELASTIC_LAST_CALL_S}", "--local-addr", "127.0.0.1",
                     "--monitor-interval", "0.2"]
        torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", *where, "--nproc_per_node", "1", "--log-dir", str(d.parent / f"torchrun-{d.name}-{time.monotonic_ns()}"),
                    "--redirects", "3", "--shutdown-timeout", str(SHUTDOWN_S), str(SCRIPT), json.dumps({**o, "tag": "run"})]
        host = f"node-{chr(ord('a') + i)}"
        cmd = ["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *torchrun]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=d, start_new_session=True)
        jobs.append(Job(p, Path(torchrun[torchrun.index("--log-dir") + 1]), f"machine {host}: torchrun {what}"))
    return jobs


def complete(store: Path) -> list[dict[str, Any]]:
    try:
        return checkpoints(store)
    except (OSError, ValueError):
        return []


def wait_until(jobs: list[Job], what: str, cond: Any) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if cond():
            return
        if any(j.p.poll() is not None for j in jobs):
            break
        time.sleep(0.02)
    for j in jobs:
        kill_all(j)
    dones = [finish(j) for j in jobs]
    pytest.fail(f"never: {what}\n" + "\n".join(d.report() for d in dones))


def status_json(store: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    res = subprocess.run([sys.executable, "-P", "-m", "ravex", "status", str(store), "--json"], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def text_of(dones: list[Done]) -> str:
    return "\n".join(d.report() for d in dones)


# (mode, machines, replicate_every, the machine wiped)
# DDP on 3 ranks keeps one gradient-bucket layout with find_unused_parameters (docs/runtime.md).
CASES = {
    "ddp-2machines-wipe-a": ("ddp", 2, 2, 0),
    "ddp-3machines-wipe-a": ("ddp-fu", 3, 2, 0),
    # per_rank on separate disks: no store every rank sees, so rank 0 gathers the shards (said once) and its store is copied
    "fsdp2-per_rank-2machines-wipe-a": ("fsdp2-per_rank", 2, 2, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_machine_lost_and_replaced_resumes_from_its_replica(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Checkpoints every 3 steps, every ``replicate_every``-th copied to the next machine. The job is
    killed whole after the copy of step 6 committed, the wiped machine's disk is emptied (a
    replacement machine), and the same command runs again on every machine: the rank whose store is
    gone receives the newest replica before the restore, and every rank goes on bit-identically
    from it (not from step 0)."""
    mode, n, every, wiped = CASES[case]
    ref = request.getfixturevalue("reference")(n, mode)
    dirs = machines(tmp_path, n)
    logs = tmp_path / "logs"
    env = {"RAVEX_REPLICATE_EVERY": every}
    opts = {"sleep": 0.15}  # slow steps: the kill lands mid-run, after a copy committed (sleeping changes nothing logged)
    jobs = launch_machines(tmp_path, dirs, mode, opts, env)
    replica = dirs[1] / f"{STORE}.replicas" / "rank00000"  # rank 0's store, copied to machine b (rank 1)
    copies = dirs[0] / f"{STORE}.replicas" / "copies.json"  # machine a's note of where its copies are (after the holder's answer)
    wait_until(jobs, "a replica committed on machine b, and machine a told", lambda: bool(complete(replica)) and copies.is_file())
    kill_all_jobs(jobs)
    dones = [finish(j) for j in jobs]
    assert all(d.rc != 0 for d in dones), text_of(dones)
    reached = max(ln.step for ln in read_log(logs, "run", 0))
    assert reached < MAX_STEPS, f"the first run was not interrupted (it reached step {reached})\n{text_of(dones)}"
    held = complete(replica)
    assert [c["index"] % every for c in held] == [every - 1] * len(held), held  # every N-th checkpoint, no other
    copied = held[-1]
    own = complete(dirs[0] / STORE)
    assert own and own[-1]["index"] >= copied["index"], own
    # the copy is the original, byte for byte (unless keep_last pruned that by now), and holds the weights of its step
    if copied in own:
        for f in (dirs[0] / STORE / copied["dir"]).iterdir():
            assert (replica / copied["dir"] / f.name).read_bytes() == f.read_bytes(), f.name
    assert_checkpoints_hold_their_steps(replica, ref)
    st = status_json(dirs[0] / STORE)
    where = st["replicas"]["copies"]
    assert [(c["holder_rank"], c["holder_host"], c["index"]) for c in where] == [(1, "node-b", copied["index"])], st["replicas"]
    assert where[0]["path"] == str(replica.resolve()) and where[0]["age_s"] >= 0 and where[0]["bytes_sent"] > 0, where

    # the machine is replaced: its disk comes back empty
    shutil.rmtree(dirs[wiped])
    dirs[wiped].mkdir()
    before = seen(logs, "run", n)
    dones = [ok(finish(j)) for j in launch_machines(tmp_path, dirs, mode, opts, env)]
    rank0 = dones[0].ranks.get(0, "")
    step = int(copied["step"])
    assert f"checkpoint {copied['index']} (step {step}) received from rank 1" in rank0, text_of(dones)
    assert "resuming from checkpoint" in rank0, text_of(dones)
    for r in range(n):
        new = read_log(logs, "run", r)[before[r]:]
        assert new and new[0].step == step + 1, f"rank {r} resumed at step {new[0].step if new else None}, the replica is at step {step}"
    assert_like_reference(logs, "run", ref)
    # the store goes on from the copy's index; its next copies went to machine b again
    after = complete(dirs[0] / STORE)
    assert after[0]["index"] >= copied["index"] and int(after[-1]["step"]) == MAX_STEPS, after
    assert_checkpoints_hold_their_steps(dirs[0] / STORE, ref)
    assert complete(replica)[-1]["index"] > copied["index"], complete(replica)


def kill_all_jobs(jobs: list[Job]) -> None:
    """Every machine at once: each agent and every process it started."""
    for j in jobs:
        kill_all(j)


def lose_machine_a(tmp: Path, dirs: list[Path], mode: str, env: dict[str, Any], store: str, what: str, ready: Any) -> tuple[Done, dict[int, int]]:
    """An elastic job on two machines (rendezvous on neither) until ``ready()``; then machine a is
    lost (its agent and every process it started), the kill is checked to have landed before the
    end, and machine b's agent, restarting its worker alone, runs to the end. Machine b's result,
    and how many lines each rank had logged at the kill."""
    import torch.distributed as dist

    logs = tmp / "logs"
    port = free_port()
    rdzv = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the rendezvous, on neither machine
    try:
        jobs = launch_machines(tmp, dirs, mode, {"sleep": 0.15}, env, rendezvous=port, store=store)
        wait_until(jobs, what, ready)
        kill_all(jobs[0])  # machine a is lost; machine b's agent lives on
        lost = finish(jobs[0])
        assert lost.rc != 0, lost.report()
        before = seen(logs, "run", 2)
        reached = max(ln.step for ln in read_log(logs, "run", 1))
        assert 0 < before[1] and reached < MAX_STEPS, f"the job was not interrupted (rank 1 reached step {reached})\n{lost.report()}"
        return ok(finish(jobs[1], timeout=TIMEOUT + 60)), before
    finally:
        del rdzv


def went_on_alone(logs: Path, ref: Any, before: dict[int, int], b: Done) -> tuple[dict[int, Any], int]:
    """Machine b's restarted worker: rank 0 of a job of one, resumed (said), from a checkpoint's
    weights to the end; its lines after the restart and the step it resumed after."""
    assert "resuming from checkpoint" in "\n".join(b.ranks.values()), b.report()
    after = by_step(read_log(logs, "run", 0)[before[0]:], "machine b, restarted as rank 0")
    step = min(after) - 1
    assert sorted(after) == list(range(step + 1, MAX_STEPS + 1)), sorted(after)
    assert after[step + 1].before == ref.logs[0][step + 1].before, "the restart did not start from the checkpoint's weights"
    out = json.loads((logs / "out-run.json").read_text())
    assert out["world_size"] == 1 and out["step"] == MAX_STEPS, out
    return after, step


def epoch_parts(ref: Any, after: dict[int, Any], step: int) -> tuple[int, list[Any]]:
    """The epoch in progress at the restart, and its lines: two ranks' before the checkpoint, one's after."""
    epoch = after[step + 1].epoch
    return epoch, [ln for r in range(2) for s, ln in ref.logs[r].items() if s <= step] + list(after.values())


def test_an_elastic_job_that_loses_a_machine_goes_on_alone_from_the_replica(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``torchrun --nnodes 1:2 --max-restarts 3`` on two machines, DDP, gather, ``replicate_every: 2``.
    Machine a (rank 0, the store's writer) is lost after the copy of step 6 committed on machine b.
    b's agent restarts its worker alone, at world size 1, as rank 0: the newest checkpoint it can
    reach is the replica on its own disk, which goes into its store, and the run goes on from it to
    the end. Exact after the change (docs/runtime.md): the weights, optimizer and step the checkpoint
    holds, and the epoch in progress trained on once; the batches, and so the losses, differ."""
    mode = "ddp"
    ref = request.getfixturevalue("reference")(2, mode)
    dirs = machines(tmp_path, 2)
    replica = dirs[1] / f"{STORE}.replicas" / "rank00000"
    held: list[dict[str, Any]] = []  # the replica's checkpoints when machine a is lost

    def ready() -> bool:
        held[:] = complete(replica)
        return bool(held)

    b, before = lose_machine_a(tmp_path, dirs, mode, {"RAVEX_REPLICATE_EVERY": 2}, STORE, "a replica committed on machine b", ready)
    copied = held[-1]
    after, step = went_on_alone(tmp_path / "logs", ref, before, b)
    assert step == int(copied["step"]), (step, copied)
    text = "\n".join(b.ranks.values())
    assert f"checkpoint {copied['index']} (step {step}) taken from the replica on this machine" in text, b.report()
    epoch, parts = epoch_parts(ref, after, step)
    assert epoch + 1 in {ln.epoch for ln in parts}, "the epoch did not end within the run"
    assert_epoch_covered_once(epoch, parts, 1)
    # machine b's store holds the copy's checkpoint, and what the run went on to write
    own = complete(dirs[1] / STORE)
    assert own[0]["index"] >= copied["index"] and int(own[-1]["step"]) == MAX_STEPS, own


def test_an_elastic_per_rank_job_on_a_shared_store_reshards_at_the_restart(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """FSDP2 with ``per_rank`` on a store both machines see (a shared filesystem), elastic: machine a
    is lost after a checkpoint both ranks wrote their shards of; b's agent restarts its worker alone,
    and the checkpoint of two ranks' shards is read at world size 1 (resharded by the copy engine),
    not started over."""
    mode = "fsdp2-per_rank"
    ref = request.getfixturevalue("reference")(2, mode)
    store = tmp_path / "shared-store"

    def ready() -> bool:
        if not any(int(c["step"]) >= 6 for c in complete(store)):
            return False
        assert_written_by(store, mode, 2)  # each rank's shards, per_rank, by the job of two
        return True

    b, before = lose_machine_a(tmp_path, machines(tmp_path, 2), mode, {}, str(store), "a checkpoint at step 6 or later", ready)
    after, step = went_on_alone(tmp_path / "logs", ref, before, b)
    assert step >= 6 and step % 3 == 0, sorted(after)
    epoch, parts = epoch_parts(ref, after, step)
    if epoch + 1 in {ln.epoch for ln in parts}:  # a restart after step 9 ends within the epoch it began
        assert_epoch_covered_once(epoch, parts, 1)
