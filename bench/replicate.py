"""What ``replicate_every`` costs: DDP on two simulated machines, with and without copies.

    ~/.cache/ravex/venv/bin/python bench/replicate.py [--params 25e6] [--steps 30] [--every 5] [--repeats 2]

Two torchrun agents (``--nnodes 2``, one rank each, rendezvous on 127.0.0.1), each in a UTS
namespace of its own (``unshare -u``, needs root) with a working directory of its own (its disk),
gloo on CPU, ``torch.set_num_threads(1)`` per rank, a model of 4 square ``Linear(W, W)`` layers
(W for ``--params``), AdamW, synthetic data through a DistributedSampler; a checkpoint every
``--every`` steps. Runs alternate between ``RAVEX_REPLICATE_EVERY=1`` (every checkpoint copied to
the other machine) and no copies. Measured:

- the training thread's stall per copied checkpoint: rank 0 times every iteration; the copy of
  the checkpoint of step s runs while steps s+1.. train; the stall is the sum, over the ``--every``
  iterations after each in-loop checkpoint, of their excess over the median iteration of the run
  without copies (the same iterations of the run without copies give the baseline of that sum);
- bytes sent and time from the copy's start to the holder's commit, per copy (``copies.json``
  of the sending machine's replica area, which the sending rank writes after each copy).

Prints a table and the JSON of every run. Measured on a 2-CPU machine shared with other work:
both ranks, the copy's two threads and the writers share two cores, so a copy takes CPU from
training here, which a real cluster (a NIC, other cores) does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def child(opts: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import ravex

    @ravex.train_loop
    def train() -> None:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        w = opts["width"]
        model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(4)])
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ds = torch.utils.data.TensorDataset(torch.randn(256, w))
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
        times: list[float] = []
        t = time.perf_counter()
        for epoch in range(1000):
            sampler.set_epoch(epoch)
            for (x,) in loader:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                now = time.perf_counter()
                times.append(now - t)
                t = now
                if len(times) >= opts["steps"]:
                    break
            if len(times) >= opts["steps"]:
                break
        ravex.flush()
        if rank == 0:
            Path(opts["out"]).write_text(json.dumps({"times": times}))

    train()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(base: Path, tag: str, width: int, steps: int, every: int, replicate: bool) -> dict[str, Any]:
    run_dir = base / tag
    dirs = [run_dir / "machine-a", run_dir / "machine-b"]
    for d in dirs:
        d.mkdir(parents=True)
    out = run_dir / "times.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update({"OMP_NUM_THREADS": "1", "RAVEX_CHECKPOINT_EVERY": str(every), "RAVEX_STORAGE_PATH": "store", "RAVEX_KEEP_LAST": "2"})
    if replicate:
        env["RAVEX_REPLICATE_EVERY"] = "1"
    procs = []
    logs = [open(run_dir / f"{d.name}.log", "w") for d in dirs]  # noqa: SIM115 - closed below, after the runs
    for i, d in enumerate(dirs):
        cmd = ["unshare", "-u", "sh", "-c", f'hostname node-{"ab"[i]} && exec "$@"', "sh", sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", str(port), "--nproc_per_node", "1",
               __file__, "--child", json.dumps({"width": width, "steps": steps, "out": str(out)})]
        procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=logs[i]))
    t0 = time.monotonic()
    rcs = [p.wait(timeout=1800) for p in procs]
    for f in logs:
        f.close()
    if any(rcs):
        raise SystemExit(f"{tag}: exit codes {rcs}; see {run_dir}/*.log")
    copies = []
    if replicate:
        doc = json.loads((dirs[0] / "store.replicas" / "copies.json").read_text())
        copies = doc.get("history", [])
    return {"tag": tag, "replicate": replicate, "wall_s": time.monotonic() - t0, "times": json.loads(out.read_text())["times"],
            "copies": copies}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=25e6, help="parameters, e.g. 25e6")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    width = max(64, int((a.params / 4) ** 0.5) // 64 * 64)
    base = Path(tempfile.mkdtemp(prefix="ravex-bench-replicate-"))
    runs = []
    try:
        for k in range(a.repeats):
            for rep in (False, True):
                runs.append(one_run(base, f"{'rep' if rep else 'plain'}{k}", width, a.steps, a.every, rep))
                print(f"{runs[-1]['tag']}: {runs[-1]['wall_s']:.1f} s", file=sys.stderr)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    params = 4 * (width * width + width)
    # iterations after each in-loop checkpoint (steps every, 2*every, ... before the last): the copy runs then
    after = [s + j for s in range(a.every, a.steps - a.every + 1, a.every) for j in range(a.every)]
    plain = [r for r in runs if not r["replicate"]]
    median = statistics.median(t for r in plain for t in r["times"][1:])

    def excess(r: dict[str, Any]) -> float:
        n = len(range(a.every, a.steps - a.every + 1, a.every))
        return sum(max(0.0, r["times"][i] - median) for i in after if i < len(r["times"])) / max(1, n)

    stall_rep = statistics.median(excess(r) for r in runs if r["replicate"])
    stall_plain = statistics.median(excess(r) for r in plain)
    copies = [c for r in runs for c in r["copies"]]
    summary = {
        "params": params, "state_bytes": params * 4 * 3, "steps": a.steps, "checkpoint_every": a.every, "repeats": a.repeats,
        "median_iteration_s": round(median, 4),
        "excess_after_checkpoint_s": {"replicate_every_1": round(stall_rep, 4), "no_copies": round(stall_plain, 4)},
        "stall_per_copied_checkpoint_s": round(stall_rep - stall_plain, 4),
        "bytes_sent_median": statistics.median(c["bytes_sent"] for c in copies) if copies else None,
        "seconds_to_commit_median": statistics.median(c["seconds"] for c in copies) if copies else None,
        "copies": len(copies),
        "load_average": os.getloadavg(),
    }
    print(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
