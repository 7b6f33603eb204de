"""The training script of integration/test_dist_runtime.py, run under torchrun (gloo, CPU).

One script for every case: its options come as JSON in argv[1], Ravex's own settings
from ``RAVEX_*``, the kill switches from the environment. Its files go to the working
directory (or to ``opts["outdir"]``: simulated machines, whose working directories are
their disks, write there):

- ``log-<tag>-rank<r>.txt``, one line per optimizer step, appended across restarts:
  ``<step> <loss as float.hex()> <the batch's sample indices> <the sampler's epoch>
  <sha256 of the full weights before the step, 16 hex digits>``. The epoch is where
  Ravex keeps the DistributedSampler (the script's own counter restarts with it);
  the weights before the step say what a resumed run started from.
- after the first step of a resumed run: ``resumed-<tag>-rank<r>.json``, ``ravex.status()``
  (with the bytes of the checkpoint this rank read);
- at the end (rank 0): ``out-<tag>.json`` (the full weights' sha256 and the step)
  and ``weights-<tag>.safetensors`` (the full weights under the plain model's names).

Kill switches: ``KILL_AT_STEP=k`` with ``KILL_RANK=r``: rank r, after logging step k,
waits for the checkpoints it collected and SIGKILLs itself (torchrun tears the others
down; ``KILL_RANK=all`` means the test kills the whole job itself). ``TERM_AT_STEP=k``
with ``TERM_RANK=r``: rank r sends itself SIGTERM after step k (a scheduler's preemption).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ravex

KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))
KILL_RANK = os.environ.get("KILL_RANK", "")
TERM_AT = int(os.environ.get("TERM_AT_STEP", "0"))
TERM_RANK = int(os.environ.get("TERM_RANK", "-1"))


def build_model() -> torch.nn.Sequential:
    """The plain model (the single-process load test builds it too)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))


class Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Fixed points plus noise drawn at every read, from torch and Python ``random``: the draws
    of a resumed run must be those of the uninterrupted one (in this process or in a worker)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + torch.randn(8) * 0.01 + random.random() * 0.01, self.y[i], i


def plain(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model under DDP's wrapper (FSDP2 shards the module in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank, under the plain model's names: an FSDP2 shard is gathered
    (a collective: every rank calls this at the same point)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in plain(model).state_dict().items():
        t = t.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().clone()
    return out


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].reshape(-1).view(torch.uint8).numpy().tobytes())  # the same bytes; a 0-d tensor too
    return h.hexdigest()


@ravex.train_loop(preemption_handler=True)
def train(opts: dict[str, Any]) -> None:
    tag = opts["tag"]
    # (a directory that outlives a wiped machine)
    out = Path(opts.get("outdir", "."))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a hang ends in a minute, not half an hour
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model: torch.nn.Module = build_model()
    if opts["wrap"] == "ddp":
        # find_unused_parameters: DDP keeps its first gradient-bucket layout instead of laying the
        # buckets out again after its first step (docs/runtime.md: what that changes at 3+ ranks)
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=bool(opts.get("find_unused")))
    elif opts["wrap"] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif opts["wrap"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise SystemExit(f"unknown wrap {opts['wrap']!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** (s // 5))
    # The same model on every rank above; from here each rank's streams are its own (dropout,
    # the dataset's noise), as in real runs: a resume must give each rank back its own.
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)

    ds = Noisy(int(opts.get("n", 62)))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=int(opts.get("workers", 0)))
    # With Ravex off (RAVEX_ENABLED=0) the script stops itself and counts its own steps.
    stop_at, steps = int(opts.get("stop_at", 0)), 0

    def epochs(log: Any) -> None:
        nonlocal steps
        for epoch in range(1000):
            sampler.set_epoch(epoch)
            for x, y, idx in loader:
                before = digest(full_weights(model))[:16]
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                steps += 1
                s = ravex.step() if ravex.is_active() else steps
                if steps == 1 and ravex.is_active() and ravex.status().get("resumed_bytes_read") is not None:
                    with open(out / f"resumed-{tag}-rank{rank}.json", "w") as f:  # what this rank read of the checkpoint it resumed from
                        json.dump(ravex.status(), f)
                log.write(f"{s} {loss.item().hex()} {','.join(str(i) for i in idx.tolist())} {sampler.epoch} {before}\n")
                log.flush()
                if KILL_AT and s == KILL_AT and KILL_RANK == str(rank):
                    ravex.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                if opts.get("sleep"):  # slow steps: the SIGTERM test's ranks see each other's signal within a step
                    time.sleep(opts["sleep"])
                if TERM_AT and s == TERM_AT and TERM_RANK == rank:
                    os.kill(os.getpid(), signal.SIGTERM)
                if stop_at and steps >= stop_at and not ravex.is_active():
                    return

    ended = False
    try:
        with open(out / f"log-{tag}-rank{rank}.txt", "a") as log:
            epochs(log)
        ended = True
    except SystemExit as exc:  # Ravex's exit after a SIGTERM's checkpoint
        ended = exc.code in (0, None)
        raise
    except BaseException as exc:  # Ravex's stop at max_steps is a BaseException too
        ended = type(exc).__name__ == "StopRun"
        raise
    finally:
        if ended:
            weights = full_weights(model)
            if rank == 0:
                from safetensors.torch import save_file

                save_file(weights, out / f"weights-{tag}.safetensors")
                with open(out / f"out-{tag}.json", "w") as f:
                    json.dump({"weights": digest(weights), "step": ravex.step() if ravex.is_active() else steps, "world_size": ws}, f)


def store_digests(store: str) -> dict[int, str]:
    """Step -> :func:`digest` of the weights in each complete checkpoint of a native store (the
    test compares them with the reference's weights after that step)."""
    from ravex_convert.storage import as_path
    from ravex_runtime.loading import load_checkpoint

    root = as_path(store)  # a directory, or a store in a bucket (s3://)
    manifest = json.loads((root / "manifest.json").read_text())
    out = {}
    for e in manifest["checkpoints"]:
        if e.get("status") == "complete":
            ckpt, tensors = load_checkpoint(root, int(e["index"]))
            out[int(ckpt.step or 0)] = digest({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})[:16]
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--digests":  # python dist_train.py --digests STORE: JSON on stdout
        print(json.dumps(store_digests(sys.argv[2])))
        sys.exit(0)
    train(json.loads(sys.argv[1]))
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another still works (rank 0 writes the outputs)
        dist.destroy_process_group()
    # Now and then a gloo rank aborts in its C++ teardown at interpreter exit ("terminate called
    # without an active exception"; seen in CI with Ravex off, torch 2.15): the run's
    # work is done and judged by its files, so end here with the exit code the script earned.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
