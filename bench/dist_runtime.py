"""Distributed runtime benchmark: what ``@ravex.train_loop`` costs a training loop on 2 ranks.

    ~/.cache/ravex/venv/bin/python bench/dist_runtime.py [--params 100M] [--steps 40] [--repeats 2]
    ~/.cache/ravex/venv/bin/python bench/dist_runtime.py --params 5M --steps 12 --repeats 1   # smoke run

Every run is ``torchrun --standalone --nproc_per_node N`` of this file (``--child``): gloo on CPU,
``torch.set_num_threads(--threads)`` per rank (default 1: two ranks on two cores), a model of
``--layers`` square ``Linear(W, W)`` layers with GELU between (W chosen for ``--params``, a multiple
of 64; fp32), AdamW, a DataLoader over a synthetic dataset with a ``DistributedSampler``
(``num_workers=0``), so Ravex's checkpoint boundary is the DataLoader's ``__next__``. Three
wrappings: DDP (rank 0 writes), FSDP2 (``fully_shard`` on every Linear and the root, CPU mesh) with
``RAVEX_SHARDED_CHECKPOINTS=gather`` (the full state gathered to rank 0, rank 0 writes) and with
``per_rank`` (every rank writes its shards; rank 0 commits); and each wrapping with
``RAVEX_ENABLED=0``. Each run has its own store (``RAVEX_STORAGE_PATH``) and starts in an empty
directory, so no ``ravex.yaml`` is picked up. Measured:

1. blocked per checkpoint, every rank: the child wraps ``ravex_runtime.runtime.Runtime.collect``
   (the capture on the training thread, with the collectives of a gather, plus the wait for room
   in the writer's queue) with a timer; in-loop checkpoints only. Cross-check from outside Ravex:
   every iteration is timed with ``perf_counter`` (the batch fetch, where the capture happens, and
   the step); the capture of the checkpoint of step s is paid by the fetch of the iteration of
   step s+1, and that iteration's excess over the median plain iteration is reported too.
2. peak host memory of every rank: ``VmHWM`` of /proc/self/status (= ``ru_maxrss``) just before
   the first capture and at the end of the run (after the final checkpoint is written); and the
   peak ``RssAnon`` summed over the whole job (torchrun and its ranks), sampled every 20 ms.
3. loop slowdown: ``--steps`` steps with ``RAVEX_CHECKPOINT_EVERY=--every`` against
   ``RAVEX_ENABLED=0``, ``--repeats`` times, alternating; loop time = end of step 1 to end of the
   last step on rank 0 (start-up, the first step's lazy set-up and the final checkpoint at
   ``destroy_process_group()`` are outside it; the in-loop checkpoints and their background
   writes are inside).
4. time to resume: a fresh 2-rank run with ``RAVEX_CHECKPOINT_EVERY=--resume-every`` is killed
   (SIGKILL, every rank, after ``ravex.flush()`` and a barrier) after step ``--kill-at``; the
   store is copied, and the same command resumes it on 2 ranks and on ``--other-ws`` ranks. Time
   from the launch of torchrun to the end of the first (resumed) step, against a fresh start at
   the same world size (the killed run itself at 2; a fresh run at the other), with where it
   goes: to the child's interpreter, imports and Ravex's start (the checkpoint loaded and
   verified), model and loader built, first batch (join, restore), first step.

Needs (estimated for the default 100M, 2 ranks, 1 thread each, on 2 CPUs): about 20-30 minutes (10
timed runs of 40 steps at roughly 1.5-2 s a step, 12 short runs for the resumes, each paying 5-10 s of
torchrun and imports); host memory up to about 6 GB for the whole job (DDP: each rank holds weights,
gradients, two moments and DDP's buckets, about 2 GB, and rank 0 a snapshot of 1.2 GB more); about
8.5 GB free under --dir (the script checks). ``--params 5M --steps 12 --repeats 1``: about 4 minutes.

Prints a table and writes bench/out/dist-runtime-results.json (every run's raw numbers) and
docs/benchmarks-runtime-dist.md. Stores and logs go to --dir (default: a new temporary
directory), removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as R

DOC = os.path.join(R.ROOT, "docs", "benchmarks-runtime-dist.md")
OUT = os.path.join(R.HERE, "out", "dist-runtime-results.json")
T_SLOWDOWN = 0.05
MODES = ("ddp", "gather", "per_rank")
WRAP = {"ddp": "ddp", "gather": "fsdp2", "per_rank": "fsdp2"}
POOL = 256  # distinct input rows of the synthetic dataset


def parse_count(s: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMbBgG]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r}: a parameter count like 100M, 5M, 1.5B or 250000")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[m.group(2).lower()])


def width_for(params: int, layers: int) -> int:
    """The width W (a multiple of 64, so FSDP2's shards are even at 1, 2 and 4 ranks) whose
    ``layers`` x Linear(W, W) comes closest to ``params``."""
    w = (-1 + math.sqrt(1 + 4 * params / layers)) / 2
    return max(64, round(w / 64) * 64)


def hwm_kb() -> int:
    """This process's resident-memory high-water mark (VmHWM, the same as ru_maxrss), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# ----------------------------------------------------------------------------------------------
# the child: one rank of one training run


def child(a) -> None:
    t_child = time.time()
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(a.threads)
    import ravex

    enabled = os.environ.get("RAVEX_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off")
    collects: list[tuple[int, float, bool]] = []  # (step, seconds, final)
    if enabled:
        from ravex_runtime import runtime as rtmod

        orig = rtmod.Runtime.collect

        def timed_collect(self, final: bool = False):
            t = time.perf_counter()
            try:
                return orig(self, final)
            finally:
                collects.append((int(self.step), time.perf_counter() - t, final))

        rtmod.Runtime.collect = timed_collect

    out: dict = {"enabled": enabled, "t0": float(os.environ["BENCH_T0"]), "t_child": t_child, "t_imported": time.time()}

    def dump() -> None:
        out["collects"] = collects
        path = os.path.join(a.out, f"rank{out['rank']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)

    class Synthetic(torch.utils.data.Dataset):
        def __init__(self, width: int, n: int):
            g = torch.Generator().manual_seed(1)
            self.pool = torch.randn(POOL, width, generator=g)
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.pool[i % POOL]

    @ravex.train_loop
    def train() -> None:
        out["t_enter"] = time.time()  # Ravex's start (the resume checkpoint loaded and verified) is behind us
        dist.init_process_group("gloo")
        rank, ws = dist.get_rank(), dist.get_world_size()
        out.update(rank=rank, world_size=ws)
        torch.manual_seed(0)
        mods: list = []
        for i in range(a.layers):
            mods.append(nn.Linear(a.width, a.width))
            if i + 1 < a.layers:
                mods.append(nn.GELU())
        model = nn.Sequential(*mods)
        out["params"] = sum(p.numel() for p in model.parameters())
        if a.wrap == "ddp":
            m = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (ws,))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            m = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        ds = Synthetic(a.width, 4096)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, sampler=sampler)
        out["t_built"] = time.time()
        iters: list[tuple[int, float, float]] = []  # (global step after it, fetch s, step s)
        out["iters"] = iters
        n = 0
        t_prev = time.perf_counter()
        for epoch in range(1 << 20):
            sampler.set_epoch(epoch)
            for x in loader:
                t_got = time.perf_counter()
                if n == 0:
                    out["t_first_batch"] = time.time()
                    out["resumed_step"] = ravex.status().get("resumed_step") if enabled else None
                loss = m(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t_end = time.perf_counter()
                n += 1
                s = ravex.step() if enabled else n
                iters.append((s, t_got - t_prev, t_end - t_got))
                t_prev = t_end
                if n == 1:
                    out["t_first_step"] = time.time()
                    loop0 = t_end
                if s == a.every:
                    out["hwm_before_ckpt_kb"] = hwm_kb()  # its capture is at the next fetch
                if a.kill_at and s == a.kill_at:
                    ravex.flush()
                    dist.barrier()  # every rank's writes done (per_rank: rank 0 has committed)
                    out["killed_at"] = s
                    out["hwm_end_kb"] = hwm_kb()
                    dump()
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                if s >= a.stop_at:
                    break
            else:
                continue
            break
        out["loop_s"] = t_end - loop0
        out["loop_steps"] = n - 1
        out["hwm_loop_kb"] = hwm_kb()
        if enabled:
            from ravex_runtime import api

            rt = api._current
            out["mode"] = getattr(rt.session, "mode", None) if rt is not None else None
            out["ravex_error"] = rt.error if rt is not None else None
        t = time.perf_counter()
        dist.destroy_process_group()  # Ravex collects the final checkpoint here (every rank is known to be here)
        out["destroy_s"] = time.perf_counter() - t
        out["t_destroyed"] = time.perf_counter()

    train()
    if "t_destroyed" in out:
        out["exit_s"] = time.perf_counter() - out.pop("t_destroyed")  # Ravex's stop: waiting for the final checkpoint's write
    out["hwm_end_kb"] = hwm_kb()
    dump()


# ----------------------------------------------------------------------------------------------
# the launcher


def rank_logs(logdir: str) -> dict[int, str]:
    """Each rank's stderr (torchrun --redirects 3 --log-dir): rank -> text."""
    got: dict[int, str] = {}
    for d, _, fs in os.walk(logdir):
        if "stderr.log" in fs and os.path.basename(d).isdigit():
            with open(os.path.join(d, "stderr.log"), errors="replace") as f:
                got[int(os.path.basename(d))] = f.read()
    return got


def launch(a, work: str, name: str, mode: str, nproc: int, env_extra: dict, store: str | None = None, *, stop_at: int, every: int,
           kill_at: int = 0, expect_kill: bool = False) -> dict:
    """One torchrun job; its ranks' results, the launcher's measurements and each rank's Ravex messages."""
    rundir = os.path.join(work, name)
    os.makedirs(rundir)
    store = store or os.path.join(work, f"store-{name}")
    env = R.bench_env()
    env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), BENCH_THREADS=str(a.threads), RAVEX_STORAGE_PATH=store,
               RAVEX_CHECKPOINT_EVERY=str(every))
    if mode == "per_rank":
        env["RAVEX_SHARDED_CHECKPOINTS"] = "per_rank"
    env.update(env_extra)
    argv = [R.PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "--log-dir", os.path.join(rundir, "logs"),
            "--redirects", "3", os.path.abspath(__file__), "--child", "--out", rundir, "--wrap", WRAP[mode], "--threads", str(a.threads),
            "--width", str(a.width), "--layers", str(a.layers), "--batch", str(a.batch), "--every", str(every), "--stop-at", str(stop_at),
            "--kill-at", str(kill_at)]
    R.wait_idle(a.max_idle_wait)
    with open(os.path.join(rundir, "torchrun.log"), "wb") as logf:
        env["BENCH_T0"] = repr(time.time())
        r = R.measure(argv, env, logf, cwd=rundir)
    ranks = {}
    for i in range(nproc):
        p = os.path.join(rundir, f"rank{i}.json")
        if os.path.exists(p):
            with open(p) as f:
                ranks[i] = json.load(f)
    errs = rank_logs(os.path.join(rundir, "logs"))
    ok = len(ranks) == nproc and (r.rc == 0 or (expect_kill and all(x.get("killed_at") for x in ranks.values())))
    res = {"name": name, "mode": mode, "nproc": nproc, "env": env_extra, "rc": r.rc, "wall": r.wall, "peak_anon_kb": r.peak_anon_kb,
           "cpu_s": r.cpu_s, "other_cpu": r.other_cpu, "ok": ok, "ranks": ranks,
           "ravex_log": {rk: [ln for ln in t.splitlines() if "ravex" in ln] for rk, t in errs.items()}}
    if not ok:
        with open(os.path.join(rundir, "torchrun.log"), errors="replace") as f:
            res["failure"] = {"torchrun": f.read()[-3000:], **{f"rank{rk}_stderr": t[-3000:] for rk, t in sorted(errs.items())}}
    if env_extra.get("RAVEX_ENABLED") != "0" and os.path.isdir(store):
        import subprocess

        p = subprocess.run([R.RAVEX, "status", store, "--json"], capture_output=True, text=True, env=env, check=False)
        try:
            res["status"] = [{k: c.get(k) for k in ("index", "step", "complete", "bytes", "ranks")} for c in json.loads(p.stdout)["checkpoints"]]
        except (ValueError, KeyError):
            res["status"] = {"error": (p.stdout + p.stderr)[-500:]}
    r0 = ranks.get(0, {})
    coll = [round(s, 3) for _, s, final in r0.get("collects", []) if not final]
    R.log(f"  {name:22} rc {r.rc:3}  wall {r.wall:6.1f} s  loop {r0.get('loop_s', float('nan')):7.2f} s  first step "
          f"{r0.get('t_first_step', math.nan) - r0.get('t0', math.nan):5.1f} s  collect r0 {coll}  mode {r0.get('mode')}  "
          f"other-load {r.other_cpu:.2f}{'' if ok else '  FAILED'}")
    if not ok:
        for k, v in res["failure"].items():
            R.log(f"    --- {k} (last lines)\n" + "\n".join(v.splitlines()[-25:]))
    return res


# ----------------------------------------------------------------------------------------------
# summarising


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def fmt(xs: list[float], unit: str = "s", nd: int = 3) -> str:
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.{nd}f} {unit}"
    return f"{med(xs):.{nd}f} {unit} [{min(xs):.{nd}f}–{max(xs):.{nd}f}]"


def blocked(run: dict, rank: int, every: int) -> dict:
    """One rank's in-loop checkpoints: the collect timer's samples, and each checkpoint iteration's
    excess (fetch + step) over the median plain iteration (the first iteration excluded)."""
    r = run["ranks"][rank]
    coll = [s for _, s, final in r["collects"] if not final]
    its = r["iters"]
    ck = [i for i in range(1, len(its)) if (its[i][0] - 1) % every == 0 and its[i][0] - 1 > 0]
    plain = [its[i][1] + its[i][2] for i in range(1, len(its)) if i not in ck]
    base = med(plain)
    return {"collect": coll, "first": coll[:1], "later": coll[1:], "iter_excess": [its[i][1] + its[i][2] - base for i in ck],
            "fetch_excess": [its[i][1] - med([its[j][1] for j in range(1, len(its)) if j not in ck]) for i in ck], "plain_iter": base}


def first_step(run: dict) -> dict:
    """Launch of torchrun to the end of the first step, the slowest rank; and its parts on that rank."""
    rs = run["ranks"].values()
    r = max(rs, key=lambda x: x["t_first_step"])
    t0 = r["t0"]
    return {"total": r["t_first_step"] - t0, "to_python": r["t_child"] - t0, "imports": r["t_imported"] - r["t_child"],
            "ravex_start": r["t_enter"] - r["t_imported"], "build": r["t_built"] - r["t_enter"], "first_batch": r["t_first_batch"] - r["t_built"],
            "step": r["t_first_step"] - r["t_first_batch"], "resumed_step": r.get("resumed_step")}


def summarise(res: dict) -> dict:
    a = res["args"]

    def early(run: dict) -> float:
        """Rank 0's median iteration of steps 2..every, before any checkpoint: the same work on and off,
        so a difference here is the machine, not Ravex."""
        return med([f + c for _, f, c in run["ranks"][0]["iters"][1:a["every"]]])

    ws = a["nproc"]
    s: dict = {"blocked": {}, "memory": {}, "slowdown": {}, "resume": {}}
    for mode in MODES:
        runs = [x for x in res["on"] if x["mode"] == mode and x["ok"]]
        if runs:
            s["blocked"][mode] = {rk: {k: [v for x in runs for v in blocked(x, rk, a["every"])[k]] for k in ("collect", "first", "later", "iter_excess", "fetch_excess")}
                                  for rk in range(ws)}
    for key, runs in [(m, [x for x in res["on"] if x["mode"] == m and x["ok"]]) for m in MODES] + \
                     [(f"{w} off", [x for x in res["off"] if WRAP[x["mode"]] == w and x["ok"]]) for w in ("ddp", "fsdp2")]:
        if runs:
            s["memory"][key] = {"before": {rk: max(x["ranks"][rk].get("hwm_before_ckpt_kb", 0) for x in runs) for rk in range(ws)},
                                "end": {rk: max(x["ranks"][rk]["hwm_end_kb"] for x in runs) for rk in range(ws)},
                                "job_anon": max(x["peak_anon_kb"] for x in runs)}
    for mode in MODES:
        on = [x["ranks"][0]["loop_s"] for x in res["on"] if x["mode"] == mode and x["ok"]]
        off = [x["ranks"][0]["loop_s"] for x in res["off"] if WRAP[x["mode"]] == WRAP[mode] and x["ok"]]
        if on and off:
            s["slowdown"][mode] = {"on": on, "off": off, "slow": med(on) / med(off) - 1,
                                   "early_on": [early(x) for x in res["on"] if x["mode"] == mode and x["ok"]],
                                   "early_off": [early(x) for x in res["off"] if WRAP[x["mode"]] == WRAP[mode] and x["ok"]],
                                   "load_on": [x["other_cpu"] for x in res["on"] if x["mode"] == mode and x["ok"]],
                                   "load_off": [x["other_cpu"] for x in res["off"] if WRAP[x["mode"]] == WRAP[mode] and x["ok"]],
                                   "min_to_min": min(on) / min(off) - 1, "off_spread": max(off) / min(off) - 1}
    for mode, rr in res["resume"].items():
        s["resume"][mode] = {k: (first_step(v) if v and v["ok"] else None) for k, v in rr.items()}
    return s


def tables(res: dict, s: dict) -> list[str]:
    a = res["args"]
    ws = a["nproc"]
    out = ["### 1. Training thread blocked per checkpoint (in-loop checkpoints; median [min–max] over runs)", ""]
    rows = []
    for mode, per in s["blocked"].items():
        for rk, d in per.items():
            rows.append([mode, str(rk), fmt(d["collect"]), fmt(d["first"]), fmt(d["later"]), fmt(d["fetch_excess"]), fmt(d["iter_excess"]),
                         str(len(d["collect"]))])
    out.append(R.md_table(["mode", "rank", "`Runtime.collect`, all in-loop", "first of a run", "later ones", "checkpoint fetch − median fetch",
                           "checkpoint iteration − median iteration", "checkpoints"], rows))
    if "gather" in s["blocked"] and "per_rank" in s["blocked"]:
        out.append("")
        for rk in range(ws):
            g, p = med(s["blocked"]["gather"][rk]["collect"]), med(s["blocked"]["per_rank"][rk]["collect"])
            out.append(f"- rank {rk}: gather / per_rank (medians of `Runtime.collect`) = {g:.3f} s / {p:.3f} s = **{g / p:.1f}x**")
    out += ["", "### 2. Peak host memory per rank (VmHWM = ru_maxrss; the largest over runs)", ""]
    rows = []
    for key, d in s["memory"].items():
        rows.append([key, *[f"{d['before'][rk] / 1024:,.0f} / {d['end'][rk] / 1024:,.0f} MiB" for rk in range(ws)], f"{d['job_anon'] / 1024:,.0f} MiB"])
    out.append(R.md_table(["run", *[f"rank {rk}: before 1st checkpoint / end" for rk in range(ws)], "job peak RssAnon (all processes)"], rows))
    out += ["", (f"### 3. Loop time, {a['steps']} steps (end of step 1 to end of step {a['steps']}, rank 0), "
                 f"`RAVEX_CHECKPOINT_EVERY={a['every']}` vs `RAVEX_ENABLED=0`"), ""]
    rows = []
    for mode, d in s["slowdown"].items():
        rows.append([mode, ", ".join(f"{x:.2f}" for x in d["on"]), ", ".join(f"{x:.2f}" for x in d["off"]), f"**{100 * d['slow']:+.1f}%**",
                     f"{100 * d['min_to_min']:+.1f}%", f"{100 * d['off_spread']:.1f}%",
                     "met" if d["slow"] <= T_SLOWDOWN else "not met",
                     " / ".join(", ".join(f"{x:.3f}" for x in xs) for xs in (d["early_on"], d["early_off"])),
                     " / ".join(", ".join(f"{x:.2f}" for x in xs) for xs in (d["load_on"], d["load_off"]))])
    out.append(R.md_table(["mode", "on (s)", "off (s, same wrapping)", "slowdown (medians)", "min to min", "spread of off runs",
                           f"≤ {100 * T_SLOWDOWN:.0f}%", f"median iteration of steps 2–{a['every']}, before any checkpoint (s, on / off)",
                           "other load, CPUs (on / off)"], rows))
    out += ["", (f"### 4. Time to the first step: launch of torchrun to the end of the first step (slowest rank); killed after step "
                 f"{a['kill_at']}, resumed from the checkpoint of step {a['kill_at'] // a['resume_every'] * a['resume_every']}"), ""]
    rows = []
    for mode, d in s["resume"].items():
        for key, label in (("fresh", f"fresh, {ws} ranks"), ("resume", f"resume, {ws} → {ws}"), ("fresh_other", f"fresh, {a['other_ws']} rank(s)"),
                           ("resume_other", f"resume, {ws} → {a['other_ws']}")):
            v = d.get(key)
            if v is None:
                rows.append([mode, label, "failed", *[""] * 9])
                continue
            base = d.get("fresh" if key in ("fresh", "resume") else "fresh_other")
            part = v["ravex_start"] + v["first_batch"] + v["step"]
            extra = f"{v['total'] - base['total']:+.2f} s" if key.startswith("resume") and base else ""
            extra2 = f"{part - (base['ravex_start'] + base['first_batch'] + base['step']):+.2f} s" if key.startswith("resume") and base else ""
            rows.append([mode, label, f"{v['total']:.2f} s", extra, extra2, *[f"{v[k]:.2f}" for k in ("to_python", "imports", "ravex_start", "build", "first_batch", "step")],
                         str(v["resumed_step"]) if key.startswith("resume") else ""])
    out.append(R.md_table(["mode", "run", "to first step", "resume − fresh", "… in Ravex start + first batch + first step", "to python (s)", "imports", "Ravex start (load + verify)",
                           "process group, model, loader", "first batch (join, restore)", "first step", "resumed at step"], rows))
    offs = {w: [first_step(x)["total"] for x in res["off"] if WRAP[x["mode"]] == w and x["ok"]] for w in ("ddp", "fsdp2")}
    if any(offs.values()):
        out += ["", "Fresh start with `RAVEX_ENABLED=0`, to the first step: " + "; ".join(f"{w} {fmt(v, nd=2)}" for w, v in offs.items() if v)
                + f" ({ws} ranks, from the timed runs)."]
    return out


def render(res: dict) -> str:
    a, m, v = res["args"], res["machine"], res["versions"]
    s = summarise(res)
    p = next((r["ranks"][0]["params"] for r in res["on"] + res["off"] if r["ok"]), 0)
    failed = [r for r in res["on"] + res["off"] + [x for d in res["resume"].values() for x in d.values() if x] if not r["ok"]]
    lines = [
        "# Distributed runtime benchmark (`@ravex.train_loop` under torchrun, 2 ranks, CPU)", "",
        (f"Generated by `bench/dist_runtime.py` on {res['started']} (whole run {res['total_s'] / 60:.1f} min). "
         f"Raw numbers: `bench/out/dist-runtime-results.json` (not checked in)."), "",
        f"Command: `{res['command']}`", "",
        "## Machine and versions", "",
        (f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs, shared with other work (load average at start: "
         f"{' '.join(res['loadavg_start'])}; \"other load\" per run in the JSON)"),
        f"- memory: `{m['free'].splitlines()[1]}`",
        f"- Python {v.get('python')}, torch {v.get('torch')}, {v.get('ravex')}; git {v.get('git_head')}{' (+ uncommitted changes)' if v.get('git_dirty') else ''}",
        "", "## Setup", "",
        (f"- {a['nproc']} ranks (`torchrun --standalone`), gloo, CPU; `torch.set_num_threads({a['threads']})` per rank; model "
         f"{a['layers']} × `Linear({a['width']}, {a['width']})` + GELU, **{p / 1e6:.1f} M parameters** fp32, AdamW (state ≈ "
         f"{12 * p / 1e9:.2f} GB: weights + two moments); batch {a['batch']} per rank; DataLoader + DistributedSampler, num_workers=0"),
        ("- modes: `ddp` (DistributedDataParallel; rank 0 writes), `gather` (FSDP2, `RAVEX_SHARDED_CHECKPOINTS=gather`: full state "
         "gathered to rank 0), `per_rank` (FSDP2, every rank writes its shards, rank 0 commits); native store, no compression"),
        f"- {a['steps']} steps, `RAVEX_CHECKPOINT_EVERY={a['every']}` vs `RAVEX_ENABLED=0`, {a['repeats']} run(s) each, alternating", "",
        "## Results", "", *tables(res, s), "",
    ]
    modes_seen = {r["name"]: [c.get("ranks", {}).get("mode") for c in r["status"]] for r in res["on"] if isinstance(r.get("status"), list)}
    lines += ["## Checks", "",
              "- mode recorded in each on-run's checkpoints (`ravex status --json`): "
              + "; ".join(f"{k}: {sorted({x for x in v if x})}" for k, v in modes_seen.items())]
    msgs = sorted({ln.split(" ", 2)[-1] for r in res["on"] for t in r["ravex_log"].values() for ln in t})
    if msgs:
        lines.append("- Ravex said (stderr, any rank): " + "; ".join(f"`{x[:200]}`" for x in msgs[:8]))
    if failed:
        lines.append("- **failed runs**: " + ", ".join(f"{r['name']} (rc {r['rc']})" for r in failed) + " — each rank's stderr is in the JSON")
    lines += ["", "## Observations", "", *[f"- {o}" for o in res.get("observations", [])], ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"), help="model size (default 100M)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40, help="steps of each timed run (default 40)")
    ap.add_argument("--every", type=int, default=10, help="RAVEX_CHECKPOINT_EVERY of the timed runs (default 10)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (default 2)")
    ap.add_argument("--batch", type=int, default=16, help="batch per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--resume-every", type=int, default=5, help="RAVEX_CHECKPOINT_EVERY of the killed run (default 5)")
    ap.add_argument("--kill-at", type=int, default=7, help="the killed run stops (SIGKILL) after this step (default 7)")
    ap.add_argument("--other-ws", type=int, default=1, help="the other world size to resume at (default 1)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--max-idle-wait", type=float, default=5, help="before each run wait up to S s for idle CPUs")
    ap.add_argument("--dir", help="work directory (default: a new temporary directory); removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--doc", default=DOC, help="the markdown report to write ('' for none)")
    ap.add_argument("--render", help="only rewrite the report from a saved results JSON")
    ap.add_argument("--note", action="append", default=[], help="with --render: add an observation to the results and the report; repeatable")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--wrap", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        for run in [*res["on"], *res["off"], *[x for d in res["resume"].values() for x in d.values() if x]]:
            run["ranks"] = {int(k): v for k, v in run["ranks"].items()}  # JSON made the ranks strings
        if a.note:
            res.setdefault("observations", []).extend(a.note)
            with open(a.render, "w") as f:
                json.dump(res, f, indent=1)
        R.publish(render(res), a.doc)
        return
    a.width = width_for(a.params, a.layers)
    if a.kill_at < a.resume_every:
        sys.exit(f"--kill-at {a.kill_at} is before the first checkpoint (--resume-every {a.resume_every}): nothing to resume from")
    t_start = time.monotonic()
    own_dir = a.dir is None
    work = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="ravex-bench-dist-"))
    os.makedirs(work, exist_ok=True)
    if os.listdir(work):
        sys.exit(f"{work}: not empty; give --dir an empty or new directory")
    # a timed run's store holds up to keep_last (3) + 1 checkpoints of 12 bytes a parameter; a killed
    # run's store is copied twice for the resumes
    need = 7 * 12 * a.layers * a.width * (a.width + 1) + (1 << 30)
    st = os.statvfs(work)
    if st.f_bavail * st.f_frsize < need:
        R.rm(work) if own_dir else None
        sys.exit(f"{work}: {st.f_bavail * st.f_frsize / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB\n"
                 "hint: pass --dir on a larger disk, or a smaller --params")
    res: dict = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(a), "loadavg_start": R.loadavg(),
                 "command": " ".join(["python bench/dist_runtime.py", *sys.argv[1:]]), "machine": R.machine(), "versions": R.versions(),
                 "on": [], "off": [], "resume": {}}
    R.log(f"model: {a.layers} x Linear({a.width}, {a.width}) = {a.layers * (a.width ** 2 + a.width) / 1e6:.1f} M parameters; work dir {work}")
    res["pinned"] = R.pin_ravex(work)  # a reinstall by other work mid-run must not mix builds
    try:
        # one round: each mode on, each wrapping off right after its first mode (alternating on and off)
        schedule: list[tuple[str, bool]] = []
        for mode in a.modes:
            schedule.append((mode, True))
            if not any(WRAP[m] == WRAP[mode] for m, _ in schedule[:-1]):
                schedule.append((mode, False))
        for i in range(a.repeats):
            for mode, on in schedule:
                if on:
                    res["on"].append(launch(a, work, f"{mode}-on-{i}", mode, a.nproc, {}, stop_at=a.steps, every=a.every))
                    R.rm(os.path.join(work, f"store-{mode}-on-{i}"))
                else:
                    res["off"].append(launch(a, work, f"{WRAP[mode]}-off-{i}", mode, a.nproc, {"RAVEX_ENABLED": "0"}, stop_at=a.steps, every=a.every))
        if not a.skip_resume:
            for mode in a.modes:
                rr: dict = {}
                res["resume"][mode] = rr
                killed = os.path.join(work, f"store-{mode}-killed")
                rr["fresh"] = launch(a, work, f"{mode}-fresh-killed", mode, a.nproc, {}, killed, stop_at=a.kill_at + 100, every=a.resume_every,
                                     kill_at=a.kill_at, expect_kill=True)
                for key, n in (("resume", a.nproc), ("resume_other", a.other_ws)):
                    if not rr["fresh"]["ok"]:
                        rr[key] = None  # nothing to resume from
                        continue
                    copy = os.path.join(work, f"store-{mode}-{key}")
                    shutil.copytree(killed, copy)  # as the kill left it (its lock file too)
                    rr[key] = launch(a, work, f"{mode}-{key}", mode, n, {}, copy, stop_at=a.kill_at + 1, every=a.resume_every)
                    R.rm(copy)
                R.rm(killed)
                rr["fresh_other"] = launch(a, work, f"{mode}-fresh-other", mode, a.other_ws, {}, stop_at=2, every=a.resume_every)
                R.rm(os.path.join(work, f"store-{mode}-fresh-other"))
    finally:
        res["total_s"] = time.monotonic() - t_start
        R.save_results(res, OUT, work, own_dir, a.keep)
    R.publish(render(res), a.doc, OUT)


if __name__ == "__main__":
    main()
