"""Exact resume when the data pipeline itself is random: a dataset whose
``__getitem__`` draws from torch, NumPy (global and a ``default_rng`` made in
``worker_init_fn``) and Python ``random`` in DataLoader worker processes, and a
``collate_fn`` that masks at random. Killed with SIGKILL at several points of an
epoch and started again, every logged loss (``float.hex``) and the final weights
equal the uninterrupted run's. Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r'''
import hashlib, json, os, random, signal, sys
import numpy as np
import torch
import ravex

opts = json.loads(sys.argv[1])
log_path, out_path = sys.argv[2], sys.argv[3]
kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
torch.set_num_threads(1)


class Augmented(torch.utils.data.Dataset):
    """Every item is drawn anew: noise from torch, a flip from NumPy's global state, a scale from
    Python's random, a shift from a per-worker default_rng made in worker_init_fn."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()
        self.rng = None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.05 * torch.randn(6)
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
    keep = (torch.rand(x.shape) > 0.1).float()   # masking, drawn in the worker
    return x * keep, y


@ravex.train_loop(preemption_handler=True)
def train():
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    workers = int(opts.get("workers", 2))
    kw = {}
    if workers:
        kw = {"worker_init_fn": init_worker, "persistent_workers": bool(opts.get("persistent")),
              "prefetch_factor": int(opts.get("prefetch", 2))}
    loader = torch.utils.data.DataLoader(Augmented(int(opts.get("items", 50))), batch_size=4, shuffle=True, num_workers=workers,
                                         collate_fn=mask_collate, drop_last=bool(opts.get("drop_last")),
                                         pin_memory=bool(opts.get("pin_memory")), **kw)
    log = open(log_path, "a")
    for epoch in range(1000):
        for x, y in loader:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
            before = ravex.step()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s = ravex.step()
            if s != before:
                log.write(f"{s} {loss.item().hex()}\n"); log.flush()
                if kill_at and s == kill_at:
                    ravex.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode()); h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    with open(out_path, "w") as f:
        json.dump({"weights": h.hexdigest(), "step": ravex.step()}, f)


train()
'''


def _run(tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_") and k != "KILL_AT_STEP"}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), **env_extra})
    # In a session of its own: when the script SIGKILLs itself its DataLoader workers are orphans,
    # which are killed with the session (they would keep the pipes open, and this waiting).
    p = subprocess.Popen([sys.executable, "-P", str(script), json.dumps(opts), str(tmp / f"log-{tag}.txt"), str(tmp / f"out-{tag}.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp, start_new_session=True)
    try:
        p.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _losses(tmp: Path, tag: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in (tmp / f"log-{tag}.txt").read_text().splitlines():
        s, loss = line.split()
        assert out.setdefault(int(s), loss) == loss, f"step {s} logged {out[int(s)]} and then {loss}"
    return out


def _check(tmp: Path, opts: dict[str, Any], kills: list[int], max_steps: int, every: int = 3) -> None:
    env = {"RAVEX_MAX_STEPS": str(max_steps), "RAVEX_CHECKPOINT_EVERY": str(every)}
    ref = _run(tmp, opts, "ref", env)
    assert ref.returncode == 0, ref.stderr
    ref_losses = _losses(tmp, "ref")
    assert sorted(ref_losses) == list(range(1, max_steps + 1))
    for k in kills:
        res = _run(tmp, opts, "kill", {**env, "KILL_AT_STEP": str(k)})
        assert res.returncode == -signal.SIGKILL, res.stderr
    res = _run(tmp, opts, "kill", env)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint" in res.stderr
    got = _losses(tmp, "kill")
    first_bad = next((s for s in sorted(ref_losses) if got.get(s) != ref_losses[s]), None)
    assert first_bad is None, f"step {first_bad}: {got.get(first_bad)} after the resume, {ref_losses.get(first_bad)} uninterrupted"
    assert json.loads((tmp / "out-kill.json").read_text()) == json.loads((tmp / "out-ref.json").read_text())


# 50 items in batches of 4: 13 batches an epoch (the last one partial), 12 with drop_last.
# Checkpoints every 3 steps; kill steps chosen to land mid-epoch, on an epoch's first and last batch.
# The second kill of persistent2_two_kills (step 29, epoch 2) carries streams across epochs.
CASES = {
    "workers2_mid_epoch": ({"workers": 2}, [8], 16),
    "workers2_first_batch_of_epoch": ({"workers": 2}, [14], 18),        # checkpoint at 12, resumed into epoch 1 at batch 0..
    "workers2_last_batch": ({"workers": 2, "drop_last": True}, [13], 20),
    "workers4_prefetch3": ({"workers": 4, "prefetch": 3}, [11], 16),
    "workers0": ({"workers": 0}, [8], 14),
    "persistent2_two_kills": ({"workers": 2, "persistent": True, "drop_last": True}, [10, 29], 36),
    "persistent4_pin_memory": ({"workers": 4, "persistent": True, "pin_memory": True}, [17], 24),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_augmentation_in_workers_resumes_bit_identically(case: str, tmp_path: Path) -> None:
    opts, kills, max_steps = CASES[case]
    _check(tmp_path, opts, kills, max_steps)
