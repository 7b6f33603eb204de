"""A SIGKILLed trainer leaves no DataLoader worker behind (issue 35).

torch's worker learns which process to watch from ``os.getppid()`` after the
dataset's seeding and ``worker_init_fn``; a trainer killed before then leaves
workers that watch pid 1 and live on. Each case here kills a decorated trainer
(started in a session of its own) at one instant around worker start-up, and
then checks that no process of that session is left after a short grace
period. The deterministic cases have a worker kill its own trainer: from
``worker_init_fn`` (the race itself: without Ravex's tie the worker outlives it
for good), from ``__getitem__`` during a resume's replay, and the trainer
itself before its first ``iter()`` and after its first batch; the random cases
kill from outside at random instants over start-up, restore and training.
Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GRACE_S = 3.0

SCRIPT = r'''
import json, os, random, signal, sys, time
import numpy as np
import torch
import ravex

opts = json.loads(os.environ["ORPHAN_OPTS"])
torch.set_num_threads(1)
trainer = int(os.environ.setdefault("ORPHAN_TRAINER", str(os.getpid())))


def kill_trainer():
    os.kill(trainer, signal.SIGKILL)
    time.sleep(0.5)   # on past the instant torch's worker would record its manager


class Augmented(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(3))
        self.fetched = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.fetched += 1
        time.sleep(opts.get("item_s", 0))
        if opts.get("kill") == "getitem" and self.fetched == 2:
            kill_trainer()
        return self.x[i] * (1 + 0.1 * random.random()) + 0.05 * torch.randn(6)


def init_worker(worker_id):
    if opts.get("kill") == "init" and worker_id == 0:
        kill_trainer()


@ravex.train_loop(preemption_handler=True)
def train():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Augmented(48), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=init_worker,
                                         persistent_workers=bool(opts.get("persistent")),
                                         multiprocessing_context=opts.get("context"))
    for epoch in range(100):
        if opts.get("kill") == "before_iter":
            os.kill(trainer, signal.SIGKILL)
        for x in loader:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if opts.get("kill") == "first_batch":
                os.kill(trainer, signal.SIGKILL)
            if opts.get("stop_at") and ravex.step() == opts["stop_at"]:
                ravex.flush()
                os.kill(trainer, signal.SIGKILL)


if __name__ == "__main__":   # spawn workers import this file again
    train()
'''


def _session_processes(sid: int) -> list[str]:
    """The live processes (pid and command) whose session is ``sid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
            out.append(f"{entry.name} ({fields[0]}): {cmd[:120]}")
    return out


def _start(tmp: Path, opts: dict[str, object], max_steps: int = 60) -> subprocess.Popen[bytes]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_STORAGE_PATH": str(tmp / "store"), "RAVEX_CHECKPOINT_EVERY": "3",
                "RAVEX_MAX_STEPS": str(max_steps)})
    env["ORPHAN_OPTS"] = json.dumps(opts)
    return subprocess.Popen([sys.executable, "-P", str(script)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=tmp, start_new_session=True)


def _left_behind(p: subprocess.Popen[bytes]) -> list[str]:
    """Wait for the trainer, then up to GRACE_S for the rest of its session; what is left
    (killed afterwards, so a failure leaks nothing either)."""
    p.wait(timeout=120)
    deadline = time.monotonic() + GRACE_S
    left = _session_processes(p.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _session_processes(p.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    return left


def _killed(tmp: Path, opts: dict[str, object]) -> None:
    p = _start(tmp, opts)
    left = _left_behind(p)
    assert p.returncode == -signal.SIGKILL, f"{opts}: the trainer exited with {p.returncode}, not killed"
    assert not left, f"{opts}: {len(left)} process(es) of the killed run still alive after {GRACE_S} s:\n" + "\n".join(left)


# Each case several times: the worker's kill lands at a slightly different point of the
# trainer's own start-up every time.
@pytest.mark.parametrize("opts", [
    {"kill": "init"},
    {"kill": "init", "persistent": True},
    {"kill": "init", "context": "spawn"},
    {"kill": "before_iter"},
    {"kill": "first_batch"},
], ids=["init", "init-persistent", "init-spawn", "before-iter", "first-batch"])
def test_a_trainer_killed_around_worker_start_up_leaves_no_worker(opts: dict[str, object], tmp_path: Path) -> None:
    for _ in range(1 if opts.get("context") == "spawn" or opts.get("kill") == "before_iter" else 2):
        _killed(tmp_path, opts)


def test_a_trainer_killed_during_a_resumes_replay_leaves_no_worker(tmp_path: Path) -> None:
    # 12 batches an epoch, a checkpoint every 3 steps: stopped at step 8, the resumed run
    # replays 6 batches of epoch 0 in its workers, and a worker kills it on its second item.
    _killed(tmp_path, {"stop_at": 8})
    for persistent in (False, True, False):
        _killed(tmp_path, {"kill": "getitem", "persistent": persistent})


def test_a_trainer_killed_at_random_instants_leaves_no_worker(tmp_path: Path) -> None:
    rng = random.Random(35)
    for i in range(4):
        # One store across the kills: later runs restore (and replay) before they are killed.
        p = _start(tmp_path, {"persistent": i % 2 == 1, "item_s": 0.002}, max_steps=100_000)
        time.sleep(rng.uniform(1.0, 8.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        left = _left_behind(p)
        assert not left, f"kill {i}: {len(left)} process(es) of the killed run still alive after {GRACE_S} s:\n" + "\n".join(left)
