"""A training script killed with SIGKILL and started again with the same command
resumes bit-identically: the same loss at every step and the same final weights
as the run that was never interrupted. Real processes throughout."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# The training script the tests run. Options come from argv; Ravex's own settings from RAVEX_*.
# It logs "<step> <loss as float.hex()>" after every optimizer step and, at the end, the final weights.
SCRIPT = r'''
import hashlib, json, os, random, signal, sys
import numpy as np
import torch
import ravex

opts = json.loads(sys.argv[1])
log_path, out_path = sys.argv[2], sys.argv[3]
kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
torch.set_num_threads(1)

class EMA:
    def __init__(self, model, decay=0.9):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
    def update(self, model):
        with torch.no_grad():
            for k, v in model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)
    def state_dict(self):
        return {"decay": self.decay, "shadow": dict(self.shadow)}
    def load_state_dict(self, sd):
        self.decay = sd["decay"]
        for k, v in sd["shadow"].items():
            self.shadow[k].copy_(v)

@ravex.train_loop(preemption_handler=True)
def train():
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    hidden = int(opts.get("hidden", 16))
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7) if opts.get("sched") else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) if opts.get("scaler") else None
    ema = EMA(model) if opts.get("ema") else None
    if ema is not None:
        ravex.track(ema, name="ema")
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(96, 8, generator=g)
    ys = (xs.sum(1, keepdim=True) > 0).float()
    accum = int(opts.get("accum", 1))
    log = open(log_path, "a")

    def one_batch(i, x, y):
        if opts.get("sleep_each"):
            import time; time.sleep(opts["sleep_each"])
        noise = torch.randn(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y) + noise
        if scaler is not None:
            scaler.scale(loss / accum).backward()
        else:
            (loss / accum).backward()
        if (i + 1) % accum == 0:
            before = ravex.step()
            if scaler is not None:
                scaler.step(opt); scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            if ema is not None:
                ema.update(model)
            s = ravex.step()
            if opts.get("sleep"):
                import time; time.sleep(opts["sleep"])
            if s != before:
                log.write(f"{s} {loss.item().hex()}\n"); log.flush()
                if kill_at and s == kill_at:
                    ravex.flush()
                    os.kill(os.getpid(), signal.SIGKILL)

    try:
        if opts.get("loader") == "none":
            while True:
                ravex.batch_boundary()
                i = ravex.step() * accum
                b = (i % 12) * 8
                for j in range(accum):
                    one_batch(j, xs[b:b + 8], ys[b:b + 8])
        else:
            workers = int(opts.get("workers", 0))
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8, shuffle=bool(opts.get("shuffle", True)),
                                                 num_workers=workers, generator=torch.Generator().manual_seed(7) if opts.get("loader_gen") else None)
            for epoch in range(int(opts.get("epochs", 1000))):
                for i, (x, y) in enumerate(loader):
                    one_batch(i, x, y)
    finally:
        sd = {k: v for k, v in model.state_dict().items()}
        if ema is not None:
            sd.update({"ema." + k: v for k, v in ema.shadow.items()})
        h = hashlib.sha256()
        for k in sorted(sd):
            h.update(k.encode()); h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
        with open(out_path, "w") as f:
            json.dump({"weights": h.hexdigest(), "step": ravex.step()}, f)

train()
'''


def start(tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> subprocess.Popen[str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), **opts.get("env", {}), **env_extra})
    return subprocess.Popen([sys.executable, "-P", str(script), json.dumps(opts), str(tmp / f"log-{tag}.txt"), str(tmp / f"out-{tag}.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)


def finish(p: subprocess.Popen[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the training script did not finish in {timeout} s\n{err}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run(tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return finish(start(tmp, opts, tag, env_extra), timeout)


def losses(tmp: Path, tag: str) -> dict[int, str]:
    """Step -> loss; a step logged twice (run again after a kill) must have logged the same loss both times."""
    out: dict[int, str] = {}
    for line in (tmp / f"log-{tag}.txt").read_text().splitlines():
        s, loss = line.split()
        assert out.setdefault(int(s), loss) == loss, f"step {s} logged {out[int(s)]} and then {loss}"
    return out


def reference(tmp: Path, opts: dict[str, Any], max_steps: int, every: int) -> tuple[dict[int, str], dict[str, Any]]:
    return check_reference(tmp, run(tmp, opts, "ref", {"RAVEX_MAX_STEPS": str(max_steps), "RAVEX_CHECKPOINT_EVERY": str(every)}))


def check_reference(tmp: Path, res: subprocess.CompletedProcess[str]) -> tuple[dict[int, str], dict[str, Any]]:
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    return losses(tmp, "ref"), json.loads((tmp / "out-ref.json").read_text())


def check_resumed(tmp: Path, opts: dict[str, Any], kills: list[int], max_steps: int = 14, every: int = 2) -> None:
    env = {"RAVEX_MAX_STEPS": str(max_steps), "RAVEX_CHECKPOINT_EVERY": str(every)}
    ref = start(tmp, opts, "ref", env)  # the uninterrupted run, alongside the first killed one
    for n, k in enumerate(kills):
        res = run(tmp, opts, "kill", {**env, "KILL_AT_STEP": str(k)})
        assert res.returncode == -signal.SIGKILL, res.stderr
        assert res.stdout == ""
        if n == 0:
            ref_losses, ref_out = check_reference(tmp, finish(ref))
    assert sorted(ref_losses) == list(range(1, max_steps + 1))
    res = run(tmp, opts, "kill", env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert "resuming from checkpoint" in res.stderr
    assert losses(tmp, "kill") == ref_losses
    assert json.loads((tmp / "out-kill.json").read_text()) == ref_out


MATRIX = {
    "plain": {"shuffle": False},
    "shuffle_workers2": {"shuffle": True, "workers": 2, "loader_gen": True},
    "lr_scheduler": {"shuffle": True, "sched": True},
    "grad_accumulation": {"shuffle": True, "accum": 3},
    "grad_scaler": {"shuffle": True, "scaler": True},
    "batch_boundary": {"loader": "none", "sched": True},
    "ema_zstd": {"shuffle": True, "ema": True, "env": {"RAVEX_COMPRESSION": "zstd"}},
    "torch_save_backend": {"shuffle": True, "sched": True, "env": {"RAVEX_BACKEND": "torch_save"}},
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_sigkill_then_resume_is_bit_identical(case: str, tmp_path: Path) -> None:
    # Killed at step 7 (one step past the checkpoint at 6, which it must redo), resumed to the end.
    check_resumed(tmp_path, MATRIX[case], kills=[7])


@pytest.mark.slow
def test_max_steps_across_three_restarts(tmp_path: Path) -> None:
    check_resumed(tmp_path, {"shuffle": True, "sched": True}, kills=[4, 9], max_steps=14, every=2)
    # Started again after the end: nothing more is trained.
    res = run(tmp_path, {"shuffle": True, "sched": True}, "kill", {"RAVEX_MAX_STEPS": "14", "RAVEX_CHECKPOINT_EVERY": "2"})
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "out-kill.json").read_text())["step"] == 14


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 3])
def test_sigterm_checkpoints_exits_cleanly_and_resumes(accum: int, tmp_path: Path) -> None:
    # With accumulation, SIGTERM is sent in the middle of one (a micro-batch and a half after a
    # step): the checkpoint must wait for the next step, or the partial gradients are lost.
    opts = {"shuffle": True, "sched": True, "accum": accum, **({"sleep_each": 0.2} if accum > 1 else {"sleep": 0.1})}
    env = {"RAVEX_MAX_STEPS": "30", "RAVEX_CHECKPOINT_EVERY": "1000"}  # no periodic checkpoint: only the one SIGTERM asks for
    # Only the run to be signalled is slowed down (so the signal lands where it should); the
    # sleeps change nothing else, and the reference and the resumed run go at full speed.
    fast = {k: v for k, v in opts.items() if k not in ("sleep", "sleep_each")}
    ref = start(tmp_path, fast, "ref", env)
    p = start(tmp_path, opts, "kill", env)
    log = tmp_path / "log-kill.txt"
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 5):
        time.sleep(0.05)
    if accum > 1:
        time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    res = finish(p)
    assert res.returncode == 0, res.stderr
    assert "SIGTERM" in res.stderr
    stopped = max(losses(tmp_path, "kill"))
    assert 5 <= stopped < 30
    ref_losses, ref_out = check_reference(tmp_path, finish(ref))
    res = run(tmp_path, fast, "kill", env)
    assert res.returncode == 0, res.stderr
    assert f"(step {stopped})" in res.stderr  # resumed exactly where SIGTERM stopped it
    assert losses(tmp_path, "kill") == ref_losses
    assert json.loads((tmp_path / "out-kill.json").read_text()) == ref_out


def test_a_changed_model_stops_the_resumed_script_before_its_first_step(tmp_path: Path) -> None:
    # The script is edited between runs (a narrower hidden layer): no checkpoint fits the new model,
    # so the process exits non-zero with one error, trains nothing and leaves the store as it was.
    env = {"RAVEX_MAX_STEPS": "6", "RAVEX_CHECKPOINT_EVERY": "2", "RAVEX_KEEP_LAST": "1"}
    res = run(tmp_path, {"shuffle": True}, "a", env)
    assert res.returncode == 0, res.stderr
    logged = losses(tmp_path, "a")
    assert sorted(logged) == list(range(1, 7))
    store = tmp_path / "store-a"
    files = {p: p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file() and p.name != "lock"}
    res = run(tmp_path, {"shuffle": True, "hidden": 12}, "a", {**env, "RAVEX_MAX_STEPS": "10"})
    assert res.returncode == 1, res.stderr
    assert res.stdout == ""
    assert "ravex_runtime.errors.ResumeError" in res.stderr and "no checkpoint of the store can be resumed from" in res.stderr, res.stderr
    assert "tensor 'model/0.bias' is [16] float32 in the checkpoint, [12] float32 in Sequential" in res.stderr
    assert "hint: fix what the error names" in res.stderr
    assert losses(tmp_path, "a") == logged  # not one step was trained
    assert {p: p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file() and p.name != "lock"} == files


@pytest.mark.slow
def test_seeded_soak_killed_at_random_instants(tmp_path: Path) -> None:
    """Killed again and again at random instants once training is under way (during steps,
    collections, writes and commits: a checkpoint after every step), then left to finish."""
    opts = {"shuffle": True, "sched": True, "accum": 2, "sleep": 0.02}
    env = {"RAVEX_MAX_STEPS": "80", "RAVEX_CHECKPOINT_EVERY": "1"}
    ref = start(tmp_path, opts, "ref", env)
    rng = random.Random(5)
    log = tmp_path / "log-kill.txt"
    resumed = kills = 0
    for _ in range(6):
        seen = len(log.read_text().splitlines()) if log.exists() else 0
        p = start(tmp_path, opts, "kill", env)
        deadline = time.time() + 60
        while p.poll() is None and time.time() < deadline and (len(log.read_text().splitlines()) if log.exists() else 0) <= seen:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        p.kill()
        _, err = p.communicate()
        resumed += "resuming from checkpoint" in err
        kills += p.returncode == -signal.SIGKILL
    res = run(tmp_path, opts, "kill", env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert kills >= 4 and resumed >= 3, (kills, resumed)
    ref_losses, ref_out = check_reference(tmp_path, finish(ref))
    assert losses(tmp_path, "kill") == ref_losses
    assert json.loads((tmp_path / "out-kill.json").read_text()) == ref_out
