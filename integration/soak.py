"""Kill-anywhere soak: one realistic training script SIGKILLed again and again at
seeded random instants — during steps, during checkpoint writes and commits, during
start-up and the resume itself — and started again each time with the same command,
until it reaches ``max_steps``. Every segment must continue bit-identically from the
last committed checkpoint: every step logged by any segment has the loss
(``float.hex``) the uninterrupted run logged for it, and the final weights are the
uninterrupted run's.

The script: a shuffled DataLoader with 2 workers doing random augmentation (torch,
NumPy, Python ``random``, a per-worker ``default_rng``), random masking in
``collate_fn``, dropout, AdamW, a warmup ``LambdaLR``, gradient accumulation of 2 by
the ``enumerate`` index over an epoch of an odd number of batches, CPU autocast
bf16, a frozen layer and an EMA kept through ``ravex.track``.

    ~/.cache/ravex/venv/bin/python integration/soak.py --kills 200 [--seed 0] [--workdir DIR]

integration/test_soak.py runs a short version (20 kills) in CI; docs/runtime.md
records the figures of a full run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = r'''
import hashlib, json, os, random, sys, time
import numpy as np
import torch
import ravex

log_path, out_path = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)


class Augmented(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :8].sum(1, keepdim=True) > 0).float()
        self.rng = None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.05 * torch.randn(16)
        if np.random.rand() < 0.5:
            x = x.flip(0)
        x = x * (1 + 0.1 * random.random())
        if self.rng is not None:
            x = x + float(self.rng.normal()) * 0.01
        return x, self.y[i]


def init_worker(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


def mask_collate(items):
    x, y = torch.utils.data.default_collate(items)
    return x * (torch.rand(x.shape) > 0.1).float(), y


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
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)                              # a frozen layer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ema = EMA(model)
    ravex.track(ema, name="ema")
    loader = torch.utils.data.DataLoader(Augmented(84), batch_size=4, shuffle=True, num_workers=2, collate_fn=mask_collate,
                                         worker_init_fn=init_worker)   # 21 batches an epoch: odd, so accumulation spans epochs
    accum = 2
    log = open(log_path, "a")
    for epoch in range(1000):
        for i, (x, y) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)
            (loss / accum).backward()
            if (i + 1) % accum == 0:
                opt.step(); opt.zero_grad(); sched.step(); ema.update(model)
                log.write(f"{ravex.step()} {loss.item().hex()}\n"); log.flush()
                time.sleep(0.03)  # a step longer than a checkpoint's write, as in training (5 ms steps here: kills never saw a commit)
    h = hashlib.sha256()
    sd = dict(model.state_dict()); sd.update({"ema." + k: v for k, v in ema.shadow.items()})
    for k in sorted(sd):
        h.update(k.encode()); h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
    with open(out_path, "w") as f:
        json.dump({"weights": h.hexdigest(), "step": ravex.step()}, f)


train()
'''


@dataclass
class Result:
    kills: int = 0
    segments: int = 0
    steps: int = 0
    redone: list[int] = field(default_factory=list)  # steps trained again after each kill
    resumed: int = 0  # segments that said they resumed from a checkpoint
    eligible: int = 0  # segments that trained a step with a checkpoint committed before they started
    seconds: float = 0.0
    reference_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def _env(workdir: Path, tag: str, max_steps: int, every: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_STORAGE_PATH": str(workdir / f"store-{tag}"), "RAVEX_MAX_STEPS": str(max_steps),
                "RAVEX_CHECKPOINT_EVERY": str(every), "RAVEX_KEEP_LAST": "2"})
    return env


def _start(workdir: Path, tag: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-P", str(workdir / "train.py"), str(workdir / f"log-{tag}.txt"), str(workdir / f"out-{tag}.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=workdir, start_new_session=True)


def _logged(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:  # a line cut by the kill is not a logged step
            out.append((int(parts[0]), parts[1]))
    return out


def soak(workdir: Path, kills: int, seed: int = 0, max_steps: int | None = None, every: int = 2) -> Result:
    """Run the reference, then the killed run; return what was seen (``problems`` empty when it held)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "train.py").write_text(SCRIPT)
    max_steps = max_steps or kills * (2 * every + 2) + 10  # more than the kills can use up: every kill lands
    res = Result()
    # Start-up (interpreter, torch, workers, the resume) and one step, timed on their own, so
    # that kills land in start-up and in the resume, and in steps, writes and commits alike.
    t0 = time.perf_counter()
    probe = _start(workdir, "probe", _env(workdir, "probe", 1, every))
    probe.communicate(timeout=3600)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = _start(workdir, "ref", _env(workdir, "ref", max_steps, every))
    _, err = ref.communicate(timeout=3600)
    res.reference_seconds = time.perf_counter() - t0
    if ref.returncode != 0:
        res.problems.append(f"the uninterrupted run failed ({ref.returncode}): {err[-2000:]}")
        return res
    truth = dict(_logged(workdir / "log-ref.txt"))
    per_step = max(1e-3, (res.reference_seconds - startup) / max_steps)

    def kill_point() -> tuple[int, float]:
        """(new steps to wait for, then seconds more): a quarter of the kills land in start-up
        or the resume, the rest after 0 to 2*every+1 new steps, at a random point of the next."""
        if rng.random() < 0.25:
            return 0, rng.uniform(0.05, startup)
        return rng.randint(1, 2 * every + 1), rng.uniform(0, per_step)

    rng = random.Random(seed)
    env = _env(workdir, "kill", max_steps, every)
    log = workdir / "log-kill.txt"
    t0 = time.perf_counter()
    manifest = workdir / "store-kill" / "manifest.json"
    while True:
        before = len(_logged(log))
        try:
            committed = bool(json.loads(manifest.read_text()).get("checkpoints"))
        except (OSError, ValueError):
            committed = False
        p = _start(workdir, "kill", env)
        killed = False
        if res.kills < kills:
            wait_steps, then = kill_point()
            deadline = time.perf_counter() + 600
            while p.poll() is None and len(_logged(log)) - before < wait_steps and time.perf_counter() < deadline:
                time.sleep(0.005)
            # then a random point of the next step: until its line appears, or `then` seconds
            # (so a kill never lets a segment run more than wait_steps + 1 steps, however fast they are)
            until = time.perf_counter() + then
            while p.poll() is None and len(_logged(log)) - before <= wait_steps and time.perf_counter() < until:
                time.sleep(0.002)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
        _, err = p.communicate(timeout=3600)
        res.segments += 1
        said = "resuming from checkpoint" in err
        res.resumed += said
        lines = _logged(log)[before:]
        if committed and lines:
            # it got past start-up with a checkpoint there to take: it must have taken it
            res.eligible += 1
            if not said:
                res.problems.append(f"segment {res.segments} trained steps from scratch although the store held a checkpoint")
        if killed:
            res.kills += 1
        elif p.returncode != 0:
            res.problems.append(f"segment {res.segments} exited {p.returncode}: {err[-2000:]}")
            break
        if lines and before:
            prev = max(s for s, _ in _logged(log)[:before]) if before else 0
            res.redone.append(max(0, prev - lines[0][0] + 1))
        for s, loss in lines:
            if truth.get(s) != loss:
                res.problems.append(f"segment {res.segments}: step {s} logged {loss}, the uninterrupted run {truth.get(s)}")
        if not killed:
            break
        if len(res.problems) > 5:
            break
    res.seconds = time.perf_counter() - t0
    res.steps = max((s for s, _ in _logged(log)), default=0)
    if not res.problems:
        if res.kills < kills:
            res.problems.append(f"the run reached max_steps after {res.kills} of {kills} kills: raise --max-steps")
        elif max(res.redone, default=0) > 2 * every + 2:
            # a kill loses at most the steps since the last committed checkpoint, plus the one in flight
            res.problems.append(f"a kill cost {max(res.redone)} steps trained again; at most {2 * every + 2} are expected: a resume lost checkpoints")
        elif res.steps != max_steps:
            res.problems.append(f"the run ended at step {res.steps}, not at max_steps {max_steps}")
        elif json.loads((workdir / "out-kill.json").read_text()) != json.loads((workdir / "out-ref.json").read_text()):
            res.problems.append("the final weights differ from the uninterrupted run's")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ravex-soak-"))
    res = soak(workdir, args.kills, args.seed, args.max_steps)
    redone = sorted(res.redone)
    print(f"kills {res.kills}, segments {res.segments} ({res.resumed} resumed from a checkpoint), steps {res.steps}, "
          f"steps trained again per kill: median {redone[len(redone) // 2] if redone else 0}, max {max(redone, default=0)}; "
          f"killed run {res.seconds:.0f} s, uninterrupted run {res.reference_seconds:.1f} s")
    for p in res.problems:
        print("PROBLEM:", p)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(1 if res.problems else 0)


if __name__ == "__main__":
    main()
