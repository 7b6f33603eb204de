#!/usr/bin/env python
"""Write a large, real training checkpoint for the conversion benchmark (bench/run.py).

    python bench/make_checkpoints.py zero3 OUT --gb 2.5     # DeepSpeed ZeRO-3, world size 2
    python bench/make_checkpoints.py dcp   OUT --gb 5       # FSDP2 on a CPU mesh + dcp.save, world size 2

Run it with the Python that has torch and deepspeed (~/.cache/ravex/venv). It launches
``torchrun --standalone --nproc_per_node 2`` on this same file; each rank builds the same model,
trains ONE optimizer step (AdamW, tiny batch: enough to create the Adam moments) and saves the
checkpoint exactly as the real program does:

- zero3: ``deepspeed.initialize`` (ZeRO stage 3, fp32, ``torch_adam``) then
  ``engine.save_checkpoint(OUT, tag="global_step1")`` (DeepSpeed also copies ``zero_to_fp32.py``
  into OUT);
- dcp: ``fully_shard`` on every layer and the root over ``init_device_mesh("cpu", (2,))`` (gloo),
  ``torch.optim.AdamW``, then ``get_state_dict(model, optimizer)`` and
  ``dcp.save({"model": msd, "optim": osd}, checkpoint_id=OUT)``.

The model is ``LAYERS`` square ``Linear(WIDTH, WIDTH)`` layers (with bias, GELU between): fp32
weights plus two fp32 Adam moments on disk make about 12 bytes per parameter, so ``--gb G`` picks
the number of layers that gives about G * 1e9 bytes (0.83 GB of weights for 2.5 GB). Every
layer has the same shape at every size, so two sizes differ only in how many tensors they hold.
A few big layers keep DeepSpeed's per-parameter set-up short on 2 cores.

Nothing else is written; the caller deletes OUT when done. Success is judged by the files written
(gloo ranks sometimes abort at interpreter exit after their work is done), and the launcher prints
one JSON line: {"kind", "out", "bytes", "files", "params", "layers", "width", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NoReturn

WIDTH = 7232  # multiple of 64; one Linear(WIDTH, WIDTH) is 52.3 M parameters
WORLD_SIZE = 2
BATCH_PER_RANK = 2
SEED = 1234
BYTES_PER_PARAM = 12  # fp32 weight + exp_avg + exp_avg_sq
TAG = "global_step1"


def layers_for(gb: float) -> int:
    per_layer = WIDTH * WIDTH + WIDTH
    return max(1, round(gb * 1e9 / (BYTES_PER_PARAM * per_layer)))


# ----------------------------------------------------------------------------------------------
# launcher (no torch import: it only starts torchrun and checks what was written)


def dir_bytes(path: str) -> tuple[int, int]:
    total = n = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
            n += 1
    return total, n


def launch(kind: str, out: str, gb: float, log: str | None) -> dict:
    if os.path.exists(out):
        sys.exit(f"make_checkpoints: {out} exists; remove it first")
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    env.setdefault("PYTHONHASHSEED", "0")
    # DeepSpeed JIT-builds a small CPU comm op with ninja: the venv's bin must be on PATH.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node", str(WORLD_SIZE), os.path.abspath(__file__),
           "--worker", kind, os.path.abspath(out), "--gb", str(gb)]
    t0 = time.monotonic()
    if log:
        with open(log, "ab") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    else:
        rc = subprocess.run(cmd, env=env, check=False).returncode
    seconds = time.monotonic() - t0
    if kind == "zero3":
        need = ["latest", "zero_to_fp32.py"] + [
            f"{TAG}/zero_pp_rank_{r}_mp_rank_00_{what}" for r in range(WORLD_SIZE) for what in ("model_states.pt", "optim_states.pt")
        ]
        # DeepSpeed names the ZeRO-3 optimizer files bf16_/plain depending on precision: accept both.
        missing = [p for p in need if not os.path.exists(os.path.join(out, p))
                   and not os.path.exists(os.path.join(out, os.path.dirname(p), "bf16_" + os.path.basename(p)))]
    else:
        need = [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD_SIZE)]
        missing = [p for p in need if not os.path.exists(os.path.join(out, p))]
    if missing:
        raise RuntimeError(f"make_checkpoints {kind}: torchrun exited {rc} and {out} lacks {missing}" + (f" (log: {log})" if log else ""))
    nbytes, nfiles = dir_bytes(out)
    layers = layers_for(gb)
    return {"kind": kind, "out": out, "bytes": nbytes, "files": nfiles, "params": layers * (WIDTH * WIDTH + WIDTH),
            "layers": layers, "width": WIDTH, "seconds": round(seconds, 2), "torchrun_exit": rc}


# ----------------------------------------------------------------------------------------------
# workers (run under torchrun)


_T0 = time.monotonic()


def phase(what: str) -> None:
    """One line per phase on rank 0, so the log shows where generation time goes."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[make_checkpoints] {time.monotonic() - _T0:7.1f} s  {what}", flush=True)


def build_model(layers: int):
    import torch
    from torch import nn

    torch.manual_seed(SEED)  # the same model on every rank
    mods: list = []
    for i in range(layers):
        mods.append(nn.Linear(WIDTH, WIDTH))
        if i + 1 < layers:
            mods.append(nn.GELU())
    return nn.Sequential(*mods)


def batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(SEED + 1 + rank)
    return torch.randn(BATCH_PER_RANK, WIDTH, generator=g)


def zero3_config(ws: int) -> dict:
    """The DeepSpeed configuration of the ZeRO-3 checkpoint (bench/foreign_resume.py loads it with the same)."""
    return {
        "train_batch_size": BATCH_PER_RANK * ws,
        "train_micro_batch_size_per_gpu": BATCH_PER_RANK,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True}},
        # Smaller buckets than the defaults (5e8 elements = 2 GB fp32 per reduce bucket, one
        # 1e9-element optimizer sub-group) keep each rank's peak near its steady state: two ranks
        # of the 5 GB model fit in 24 GiB. Several sub-groups per rank is what a real large
        # ZeRO-3 run writes anyway.
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                              "sub_group_size": 100_000_000},
        "bf16": {"enabled": False},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def worker_zero3(out: str, layers: int) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    ws = dist.get_world_size()
    assert ws == WORLD_SIZE, ws
    cfg = zero3_config(ws)
    # zero.Init partitions each parameter as soon as its layer is built: no rank ever holds
    # the whole model (it would cost 1.7 GB per rank at the 5 GB size).
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = build_model(layers)
    phase(f"model built under zero.Init ({layers} x Linear({WIDTH}, {WIDTH}))")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    phase("deepspeed.initialize done")
    x = batch(dist.get_rank())
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    phase("one training step done")
    engine.save_checkpoint(out, tag=TAG)
    dist.barrier()
    phase("checkpoint saved")


def worker_dcp(out: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    assert ws == WORLD_SIZE, ws
    mesh = init_device_mesh("cpu", (ws,))
    model = build_model(layers)
    phase(f"model built ({layers} x Linear({WIDTH}, {WIDTH}))")
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = batch(dist.get_rank())
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phase("one training step done")
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()
    phase("checkpoint saved")


def run_then_exit(body: Callable[[], object]) -> NoReturn:
    """Run a torchrun worker's body and leave with ``os._exit``: gloo sometimes aborts at
    interpreter exit after the work is done, so the caller judges the outputs, not the exit
    status. A failure prints its traceback and exits 1."""
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 -- print, then exit without gloo's exit-time teardown
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker(kind: str, out: str, gb: float) -> None:
    run_then_exit(lambda: (worker_zero3 if kind == "zero3" else worker_dcp)(out, layers_for(gb)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["zero3", "dcp"])
    ap.add_argument("out", help="checkpoint directory to create (must not exist)")
    ap.add_argument("--gb", type=float, default=2.5, help="approximate checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--log", help="append torchrun's output here instead of the terminal")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.kind, a.out, a.gb)
    else:
        print(json.dumps(launch(a.kind, a.out, a.gb, a.log)))


if __name__ == "__main__":
    main()
