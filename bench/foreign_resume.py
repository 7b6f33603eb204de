"""Foreign-resume benchmark: a plain FSDP2 script resumes from a DeepSpeed ZeRO-3 checkpoint
(``RAVEX_RESUME_FROM``), against DeepSpeed's own ``engine.load_checkpoint`` of the same checkpoint.

    ~/.cache/ravex/venv/bin/python bench/foreign_resume.py [--gb 1] [--repeats 3]
    ~/.cache/ravex/venv/bin/python bench/foreign_resume.py --gb 0.6 --repeats 1 --doc ''   # smoke run (1 layer)

The checkpoint is made on the spot by ``bench/make_checkpoints.py zero3 --gb G`` (DeepSpeed ZeRO-3,
world size 2, fp32, ``torch_adam`` AdamW, one optimizer step; ``G`` picks the number of
``Linear(7232, 7232)`` layers: 2 for 1 GB, 1.26 GB on disk) and deleted at the end. Every run is
``python -P -m torch.distributed.run --standalone --nproc_per_node 2`` of this file (``--child``),
gloo on CPU, one torch thread per rank (OMP_NUM_THREADS=1), each run in an empty directory of its
own (no ``ravex.yaml`` is picked up). Three kinds of run, ``--repeats`` times each, round-robin:

- ``deepspeed``: ``DS_ACCELERATOR=cpu``; the model built under ``deepspeed.zero.Init`` and
  ``deepspeed.initialize`` with the configuration make_checkpoints.py saved with (the same ZeRO-3
  buckets and sub-groups, the same AdamW), then ``engine.load_checkpoint(ROOT)`` alone is timed on
  every rank, after a barrier.
- ``ravex``: a plain PyTorch script decorated with ``@ravex.train_loop`` and no loading code: the
  same model built on the meta device, ``fully_shard`` on every Linear and on the root over
  ``init_device_mesh("cpu", (2,))``, ``to_empty`` (nothing is initialised: the restore overwrites
  every tensor, and the check below catches one it does not), ``torch.optim.AdamW`` with the saved
  run's hyper-parameters (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1; one parameter
  group; no LR scheduler: make_checkpoints.py configures none, so none is saved), a DataLoader of
  64 rows with a DistributedSampler (batch 2 per rank: the saved run's global batch of 4).
  ``RAVEX_RESUME_FROM=ROOT``, ``RAVEX_STORAGE_PATH`` a new empty store per run,
  ``RAVEX_CHECKPOINT_EVERY=1000000``: nothing is written (no step is taken, so no final checkpoint
  either). Ravex restores inside the first ``iter(loader)``: ``iter(loader)`` + the first
  ``next()`` is timed on every rank, after a barrier. Ravex's start (the decorator's entry: the
  checkpoint found and described, nothing loaded) is timed separately, from the end of the imports
  to the first line of the function.
- ``ravex_off``: the same script with ``RAVEX_ENABLED=0`` (the decorator passes through), the same
  two figures: what the script costs without Ravex, subtracted from the ``ravex`` run's.

Measured on every rank: the timed call's wall time (the table takes the slowest rank, then the
median over runs); resident memory (/proc/self/status): ``VmRSS`` and the process's high-water mark
``VmHWM`` just before the timed call, then the high-water mark is reset (``5 > /proc/self/clear_refs``)
so ``VmHWM`` after the call is the peak during the load alone; and the peak ``RssAnon`` summed over
the whole job (torchrun and its ranks), sampled every 20 ms from outside. In the ``ravex`` runs
Ravex's own phases are timed too (``Runtime.start``, ``Runtime.restore``, and inside it ``adapt``:
the reads into the live layout, ``plan``: the checks, ``apply_plan``: putting it in). For context,
``cp -r`` of the checkpoint directory to a new directory, ``--repeats`` times (page cache warm, like
every run here: the checkpoint was just written; nothing is dropped from the cache).

Correctness, on every run: after the load both sides hash (sha256, on rank 0) every parameter and
both Adam moments of every parameter, gathered whole (DeepSpeed:
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``; Ravex:
``DTensor.full_tensor()`` of the parameter and of ``optimizer.state[p]``), and record the Adam
step, the step count and the parameter group's hyper-parameters. Any difference from the DeepSpeed
runs, a tensor missing on either side, or a failed run, and the script prints what differs, exits
1 and writes no report (the raw JSON is kept for the diagnosis).

Needs (2 CPUs, 1 GB): about 4-6 minutes (the checkpoint made in ~25 s; each run pays ~5 s of torchrun
and imports, DeepSpeed's runs ~10 s of ``zero.Init`` and ``initialize``, and both sides ~5-10 s of
gathering and hashing 1.26 GB for the check); host memory about 3 GB for a job; about 2.6 GB free
under --dir (the script checks).

Prints a table and writes bench/out/foreign-resume-results.json (every run's raw numbers) and
docs/benchmarks-foreign-resume.md. Work goes to --dir (default: a new temporary directory), removed
at the end unless --keep.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_runtime as DR
import make_checkpoints as MC
import run as R
from dist_runtime import med

DOC = os.path.join(R.ROOT, "docs", "benchmarks-foreign-resume.md")
OUT = os.path.join(R.HERE, "out", "foreign-resume-results.json")
SIDES = ("deepspeed", "ravex", "ravex_off")
ROWS = 64  # the DataLoader's dataset: enough for the first batch after the skipped samples
NO_CHECKPOINT = 1_000_000  # RAVEX_CHECKPOINT_EVERY: nothing written while timing


# ----------------------------------------------------------------------------------------------
# the children: one rank of one run


def mem_kb() -> dict[str, int]:
    """VmRSS and VmHWM of this process, KiB."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1])
    return got


def digest(t) -> dict:
    """sha256 of a tensor's bytes (flattened, contiguous) with its element count and dtype."""
    t = t.detach().contiguous().reshape(-1)
    import torch

    return {"sha256": hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest(), "numel": int(t.numel()), "dtype": str(t.dtype)}


def hyper(group: dict) -> dict:
    return {k: (list(group[k]) if k == "betas" else float(group[k])) for k in ("lr", "betas", "eps", "weight_decay") if k in group}


def timed_call(out: dict, key: str, fn):
    """fn() after a barrier, timed, with memory before and during it."""
    import torch.distributed as dist

    dist.barrier()
    before = mem_kb()
    out["mem_before_kb"] = before  # VmHWM here: the process's peak so far (start-up, model build)
    out["hwm_reset"] = R.reset_peak()
    t = time.perf_counter()
    got = fn()
    out[key] = time.perf_counter() - t
    out["t_loaded"] = time.time()
    out["mem_after_kb"] = mem_kb()  # VmHWM here: the peak during fn() alone (when hwm_reset)
    return got


def child_deepspeed(a, out: dict) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out["t_imported"] = time.time()
    deepspeed.init_distributed()
    rank, ws = dist.get_rank(), dist.get_world_size()
    out.update(rank=rank, world_size=ws)
    cfg = MC.zero3_config(ws)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = MC.build_model(a.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    out["t_built"] = time.time()
    path, _ = timed_call(out, "load_s", lambda: engine.load_checkpoint(a.ckpt))
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({a.ckpt}) loaded nothing (returned None)")
    out["step"] = int(engine.global_steps)
    out["global_samples"] = int(engine.global_samples)
    out["hyper"] = [hyper(g) for g in engine.optimizer.param_groups]
    base = getattr(engine.optimizer, "optimizer", None)
    out["adam_steps"] = sorted({float(s["step"]) for s in base.state.values() if "step" in s}) if base is not None else []
    digests = {}
    for name, p in engine.module.named_parameters():
        for what in ("param", "exp_avg", "exp_avg_sq"):  # one whole tensor at a time (a collective: every rank gathers)
            full = safe_get_full_fp32_param(p) if what == "param" else safe_get_full_optimizer_state(p, what)
            if rank == 0:
                digests[f"{what}/{name}"] = digest(full) if full is not None else None
            del full
    out["digests"] = digests if rank == 0 else {}
    dist.barrier()


def child_ravex(a, out: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ravex

    enabled = os.environ.get("RAVEX_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off")
    phases: dict[str, float] = {}
    out["enabled"], out["phases"] = enabled, phases
    if enabled:
        # Ravex's own phases, timed from outside: the start (find and describe the checkpoint), the
        # restore at the first iter(loader), and in it the reads, the checks, the put-in.
        from ravex_runtime import foreign, resume
        from ravex_runtime import runtime as rtmod

        def timer(owner, attr: str, key: str) -> None:
            orig = getattr(owner, attr, None)
            if orig is None:
                return

            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return orig(*args, **kwargs)
                finally:
                    phases[key] = phases.get(key, 0.0) + time.perf_counter() - t

            setattr(owner, attr, timed)

        timer(rtmod.Runtime, "start", "start")
        timer(rtmod.Runtime, "restore", "restore")
        for fn in ("adapt", "plan", "apply_plan"):
            timer(resume, fn, fn)  # the names Resume calls
        timer(foreign._Reads, "run", "read")  # the bytes, once everything is checked

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randn(ROWS, MC.WIDTH, generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return ROWS

        def __getitem__(self, i: int):
            return self.x[i], i

    out["t_imported"] = time.time()

    @ravex.train_loop
    def train() -> None:
        out["t_enter"] = time.time()  # Ravex's start (the checkpoint found and described) is behind us
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, ws = dist.get_rank(), dist.get_world_size()
        out.update(rank=rank, world_size=ws)
        mesh = init_device_mesh("cpu", (ws,))
        with torch.device("meta"):
            model = MC.build_model(a.layers)
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ds = Rows()
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=MC.BATCH_PER_RANK, sampler=sampler)
        out["t_built"] = time.time()
        _, idx = timed_call(out, "first_batch_s", lambda: next(iter(loader)))
        out["first_batch"] = [int(i) for i in idx]
        out["t_first_batch"] = time.time()
        if not enabled:
            return
        out["step"] = int(ravex.step())
        out["status"] = {k: v for k, v in ravex.status().items() if k in ("active", "resumed_step", "error")}
        out["hyper"] = [hyper(g) for g in opt.param_groups]
        out["adam_steps"] = sorted({float(s["step"].full_tensor() if hasattr(s["step"], "full_tensor") else s["step"])
                                    for s in opt.state.values() if "step" in s})
        digests = {}
        for name, p in model.named_parameters():
            st = opt.state.get(p, {})
            for what, t in (("param", p), ("exp_avg", st.get("exp_avg")), ("exp_avg_sq", st.get("exp_avg_sq"))):
                full = (t.full_tensor() if hasattr(t, "full_tensor") else t) if t is not None else None
                if rank == 0:
                    digests[f"{what}/{name}"] = digest(full) if full is not None else None
                del full
        out["digests"] = digests if rank == 0 else {}
        dist.barrier()

    train()


def child(a) -> None:
    t_child = time.time()
    import torch

    torch.set_num_threads(1)
    out: dict = {"side": a.child, "t0": float(os.environ["BENCH_T0"]), "t_child": t_child}

    def body() -> None:
        try:
            (child_deepspeed if a.child == "deepspeed" else child_ravex)(a, out)
            out["done"] = True
        finally:
            rank = out.get("rank", int(os.environ.get("RANK", "0")))
            path = os.path.join(a.out, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(path + ".tmp", path)

    MC.run_then_exit(body)  # gloo may abort at interpreter exit after the work is done: judged by rank<r>.json


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


def launch(a, work: str, name: str, side: str) -> dict:
    """One torchrun job: its ranks' results, the launcher's measurements, each rank's Ravex messages."""
    rundir = os.path.join(work, name)
    os.makedirs(rundir)
    env = R.bench_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BENCH_THREADS="1")
    for k in [k for k in env if k.startswith("RAVEX_") and k != "RAVEX_VENV"]:
        del env[k]  # nothing of the caller's configuration
    if side != "deepspeed":
        env.update(RAVEX_RESUME_FROM=a.ckpt, RAVEX_STORAGE_PATH=os.path.join(work, f"store-{name}"), RAVEX_CHECKPOINT_EVERY=str(NO_CHECKPOINT))
    if side == "ravex_off":
        env["RAVEX_ENABLED"] = "0"
    argv = [R.PY, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(MC.WORLD_SIZE),
            "--log-dir", os.path.join(rundir, "logs"), "--redirects", "3", os.path.abspath(__file__),
            "--child", "ravex" if side == "ravex_off" else side, "--out", rundir, "--ckpt", a.ckpt, "--layers", str(a.layers)]
    R.wait_idle(a.max_idle_wait)
    with open(os.path.join(rundir, "torchrun.log"), "wb") as logf:
        env["BENCH_T0"] = repr(time.time())
        r = R.measure(argv, env, logf, cwd=rundir)
    ranks = {}
    for i in range(MC.WORLD_SIZE):
        p = os.path.join(rundir, f"rank{i}.json")
        if os.path.exists(p):
            with open(p) as f:
                ranks[i] = json.load(f)
    errs = rank_logs(os.path.join(rundir, "logs"))
    ok = len(ranks) == MC.WORLD_SIZE and all(x.get("done") for x in ranks.values())
    res = {"name": name, "side": side, "rc": r.rc, "wall": r.wall, "peak_anon_kb": r.peak_anon_kb, "cpu_s": r.cpu_s, "other_cpu": r.other_cpu,
           "ok": ok, "ranks": ranks, "ravex_log": {rk: [ln for ln in t.splitlines() if "ravex" in ln.lower()] for rk, t in errs.items()}}
    if not ok:
        with open(os.path.join(rundir, "torchrun.log"), errors="replace") as f:
            res["failure"] = {"torchrun": f.read()[-3000:], **{f"rank{rk}_stderr": t[-4000:] for rk, t in sorted(errs.items())}}
    key = "load_s" if side == "deepspeed" else "first_batch_s"
    timed = [x.get(key, math.nan) for x in ranks.values()]
    R.log(f"  {name:14} rc {r.rc:3}  wall {r.wall:6.1f} s  timed call (per rank) {', '.join(f'{t:.2f}' for t in timed)} s  "
          f"job peak RssAnon {r.peak_anon_kb / 1024:,.0f} MiB  other-load {r.other_cpu:.2f}{'' if ok else '  FAILED'}")
    if not ok:
        for k, v in res["failure"].items():
            R.log(f"    --- {k} (last lines)\n" + "\n".join(v.splitlines()[-30:]))
    R.rm(os.path.join(work, f"store-{name}"))
    return res


def time_cp(a, work: str) -> list[float]:
    """``cp -r`` of the checkpoint directory into a new one, each copy removed (and synced) outside the timing."""
    walls = []
    for i in range(a.repeats):
        dst = os.path.join(work, f"cp-{i}")
        R.wait_idle(a.max_idle_wait)
        with open(os.path.join(work, "cp.log"), "ab") as logf:
            r = R.measure(["cp", "-r", a.ckpt, dst], R.bench_env(), logf)
        if r.rc != 0:
            raise RuntimeError(f"cp -r {a.ckpt} {dst} exited {r.rc} (log: {work}/cp.log)")
        walls.append(r.wall)
        R.rm(dst)
        subprocess.run(["sync"], check=False)
    R.log(f"  cp -r: {', '.join(f'{w:.2f}' for w in walls)} s")
    return walls


# ----------------------------------------------------------------------------------------------
# checking and summarising


def verify(res: dict) -> list[str]:
    """What differs between the DeepSpeed and the Ravex runs (empty: every run agrees bit for bit)."""
    problems = [f"run {r['name']} failed (exit {r['rc']}): see its ranks' stderr in the JSON" for r in res["runs"] if not r["ok"]]
    ds = [r for r in res["runs"] if r["side"] == "deepspeed" and r["ok"]]
    rv = [r for r in res["runs"] if r["side"] == "ravex" and r["ok"]]
    if not ds or not rv:
        return problems + ["no successful DeepSpeed run and Ravex run to compare"]
    ref = ds[0]["ranks"][0]
    want = ref["digests"]
    if not want or any(v is None for v in want.values()):
        problems.append(f"{ds[0]['name']}: DeepSpeed returned no full tensor for {[k for k, v in want.items() if v is None][:5] or 'any tensor'}")
    for r in ds[1:] + rv:
        got = r["ranks"][0].get("digests", {})
        for k in sorted(set(want) | set(got)):
            if k not in got or got[k] is None:
                problems.append(f"{r['name']}: '{k}' is missing (DeepSpeed has it)")
            elif k not in want:
                problems.append(f"{r['name']}: '{k}' is not in DeepSpeed's")
            elif got[k] != want[k]:
                problems.append(f"{r['name']}: '{k}' differs from DeepSpeed's: {got[k]} against {want[k]}")
        for field in ("step", "adam_steps", "hyper"):
            for rk, x in r["ranks"].items():
                if x.get(field) != ref.get(field):
                    problems.append(f"{r['name']} rank {rk}: {field} is {x.get(field)!r}, DeepSpeed's {ref.get(field)!r}")
        if r["side"] == "ravex":
            for rk, x in r["ranks"].items():
                if x.get("status", {}).get("error"):
                    problems.append(f"{r['name']} rank {rk}: Ravex reports an error: {x['status']['error']}")
    return problems


def fmt(xs: list[float], unit: str = "s", nd: int = 2) -> str:
    return DR.fmt(xs, unit, nd)


def mib(kb: float) -> str:
    return f"{kb / 1024:,.0f} MiB"


def summarise(res: dict) -> dict:
    """Per side: the timed call (slowest rank, per run), Ravex's start, launch to resumed, memory per rank."""
    s: dict = {}
    for side in SIDES:
        runs = [r for r in res["runs"] if r["side"] == side and r["ok"]]
        if not runs:
            continue
        key = "load_s" if side == "deepspeed" else "first_batch_s"
        d: dict = {"n": len(runs), "timed": [max(x[key] for x in r["ranks"].values()) for r in runs],
                   "start": [max(x["t_enter"] - x["t_imported"] for x in r["ranks"].values()) for r in runs] if side != "deepspeed" else [],
                   "to_resumed": [max(x["t_loaded"] for x in r["ranks"].values()) - r["ranks"][0]["t0"] for r in runs],
                   "job_wall": [r["wall"] for r in runs], "job_anon_kb": max(r["peak_anon_kb"] for r in runs), "mem": {}}
        for rk in range(MC.WORLD_SIZE):
            d["mem"][rk] = {"rss_before": max(r["ranks"][rk]["mem_before_kb"]["VmRSS"] for r in runs),
                            "hwm_before": max(r["ranks"][rk]["mem_before_kb"]["VmHWM"] for r in runs),
                            "hwm_during": max(r["ranks"][rk]["mem_after_kb"]["VmHWM"] for r in runs),
                            "rss_after": max(r["ranks"][rk]["mem_after_kb"]["VmRSS"] for r in runs),
                            "reset": all(r["ranks"][rk].get("hwm_reset") for r in runs)}
        if side == "ravex":
            d["phases"] = {k: [max(x["phases"].get(k, math.nan) for x in r["ranks"].values()) for r in runs]
                           for k in ("start", "restore", "adapt", "read", "plan", "apply_plan")}
        s[side] = d
    if "ravex" in s and "ravex_off" in s:
        on, off = s["ravex"], s["ravex_off"]
        s["net"] = {"first_batch": med(on["timed"]) - med(off["timed"]), "start": med(on["start"]) - med(off["start"])}
        s["net"]["total"] = s["net"]["first_batch"] + s["net"]["start"]
    return s


def tables(res: dict, s: dict) -> list[str]:
    ds, on, off = s.get("deepspeed"), s.get("ravex"), s.get("ravex_off")
    cp = med(res.get("cp", []))
    dsl = med(ds["timed"]) if ds else math.nan
    n = res["args"]["repeats"]

    def ratio(x: float, y: float) -> str:
        return f"**{x / y:.2f}x**" if y and not math.isnan(x) and not math.isnan(y) else "—"

    out = [f"### 1. Resume time (slowest rank of each run; median [min–max] over {n} runs)", ""]
    rows = []
    if ds:
        rows.append(["DeepSpeed `engine.load_checkpoint(ROOT)`", fmt(ds["timed"]), "1.00x", f"{dsl / cp:.2f}x" if cp else "—"])
    if on and off:
        net = s["net"]
        rows += [
            ["Ravex: first `iter(loader)` + `next()` (the restore)", fmt(on["timed"]), ratio(med(on["timed"]), dsl), f"{med(on['timed']) / cp:.2f}x"],
            ["same, `RAVEX_ENABLED=0`", fmt(off["timed"], nd=3), "", ""],
            ["Ravex: decorator's start (checkpoint found and described)", fmt(on["start"]), "", ""],
            ["same, `RAVEX_ENABLED=0`", fmt(off["start"], nd=3), "", ""],
            ["**Ravex's cost: start + restore − the same with Ravex off**", f"**{net['total']:.2f} s**", ratio(net["total"], dsl),
             f"{net['total'] / cp:.2f}x"],
        ]
    if cp:
        rows.append(["`cp -r` of the checkpoint directory (context)", fmt(res["cp"]), f"{cp / dsl:.2f}x" if ds else "", "1.00x"])
    out.append(R.md_table(["what", "time", "÷ DeepSpeed's load", "÷ `cp -r`"], rows))
    out += ["", "Launch of torchrun to resumed (slowest rank; DeepSpeed: `zero.Init`, `initialize` and the load; Ravex: imports, its start, "
                "model, optimizer, loader and the first batch): "
            + "; ".join(f"{label} {fmt(d['to_resumed'])}" for label, d in (("DeepSpeed", ds), ("Ravex", on), ("Ravex off", off)) if d) + "."]
    if on:
        ph = on["phases"]
        out += ["", "Ravex's phases (slowest rank, median over runs): "
                + "; ".join(f"`{k}` {med(v):.2f} s" for k, v in ph.items() if v and not any(math.isnan(x) for x in v))
                + " (`restore` holds the others: `adapt` fits the checkpoint to the live objects and checks names, shapes and groups; "
                  "`plan` checks the rest; `read` reads this rank's rows with the Rust executor, the weights straight into the live "
                  "parameters; `apply_plan` puts the rest in (`load_state_dict`); what is left of `restore` is the ranks' agreement)."]
    out += ["", ("Every run, in the order run (the other work on the machine is the main source of spread: \"other load\" is the CPUs "
                 "that processes outside the job kept busy during it, of 2):"), ""]
    rows = []
    for r in res["runs"]:
        if not r["ok"]:
            rows.append([r["name"], "failed", "", "", "", f"{r['other_cpu']:.2f}"])
            continue
        key = "load_s" if r["side"] == "deepspeed" else "first_batch_s"
        rk = r["ranks"].values()
        start = ", ".join(f"{x['t_enter'] - x['t_imported']:.2f}" for x in rk) if r["side"] != "deepspeed" else ""
        rows.append([r["name"], ", ".join(f"{x[key]:.3f}" for x in rk), start, f"{max(x['t_loaded'] for x in rk) - r['ranks'][0]['t0']:.2f}",
                     f"{r['wall']:.1f}", f"{r['other_cpu']:.2f}"])
    out.append(R.md_table(["run", "timed call, per rank (s)", "Ravex's start, per rank (s)", "launch to resumed (s)", "job wall (s)",
                           "other load (CPUs)"], rows))
    out += ["", "### 2. Memory per rank (the largest over runs)", ""]
    rows = []
    for label, d in (("DeepSpeed", ds), ("Ravex", on), ("Ravex off", off)):
        if not d:
            continue
        for rk, m in d["mem"].items():
            rows.append([label, str(rk), mib(m["rss_before"]), mib(m["hwm_during"]) if m["reset"] else "— (no reset)",
                         f"{(m['hwm_during'] - m['rss_before']) / 1024:+,.0f} MiB" if m["reset"] else "—", mib(m["rss_after"]),
                         f"{(m['hwm_during'] - m['rss_after']) / 1024:,.0f} MiB" if m["reset"] else "—",
                         mib(max(m["hwm_before"], m["hwm_during"])), mib(d["job_anon_kb"]) if rk == 0 else ""])
    out.append(R.md_table(["run", "rank", "RSS before the load", "peak RSS during the load", "peak − before", "RSS after",
                           "transient (peak − after)", "process peak (VmHWM, whole run)", "job peak RssAnon (all processes)"], rows))
    if ds and on:
        out += [""] + [f"- rank {rk}: peak during the load, Ravex / DeepSpeed = {mib(on['mem'][rk]['hwm_during'])} / "
                       f"{mib(ds['mem'][rk]['hwm_during'])} = **{on['mem'][rk]['hwm_during'] / ds['mem'][rk]['hwm_during']:.2f}x**; "
                       f"growth over the RSS before it {(on['mem'][rk]['hwm_during'] - on['mem'][rk]['rss_before']) / 1024:+,.0f} MiB against "
                       f"{(ds['mem'][rk]['hwm_during'] - ds['mem'][rk]['rss_before']) / 1024:+,.0f} MiB" for rk in range(MC.WORLD_SIZE)]
    return out


def render(res: dict) -> str:
    a, m, v, g = res["args"], res["machine"], res["versions"], res["generated"]
    s = summarise(res)
    ds_runs = [r for r in res["runs"] if r["side"] == "deepspeed" and r["ok"]]
    rv_runs = [r for r in res["runs"] if r["side"] == "ravex" and r["ok"]]
    digests = ds_runs[0]["ranks"][0]["digests"] if ds_runs else {}
    ref = ds_runs[0]["ranks"][0] if ds_runs else {}
    lines = [
        "# Foreign-resume benchmark (a DeepSpeed ZeRO-3 checkpoint into FSDP2, 2 ranks, CPU)", "",
        (f"Generated by `bench/foreign_resume.py` on {res['started']} (whole run {res['total_s'] / 60:.1f} min). "
         "Raw numbers: `bench/out/foreign-resume-results.json` (not checked in)."), "",
        f"Command: `{res['command']}`", "",
        "## Machine and versions", "",
        (f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs, no GPU, shared with other work (load average at start: "
         f"{' '.join(res['loadavg_start'])}; \"other load\" per run in the JSON)"),
        f"- memory: `{m['free'].splitlines()[1]}`; disk: `{m['filesystem']}`",
        (f"- Python {v.get('python')}, torch {v.get('torch')}, DeepSpeed {v.get('deepspeed')}, {v.get('ravex')}; git {v.get('git_head')}"
         f"{' (+ uncommitted changes)' if v.get('git_dirty') else ''}"),
        "", "## What was measured", "",
        (f"- The checkpoint: `bench/make_checkpoints.py zero3 --gb {a['gb']}`: DeepSpeed ZeRO-3 at world size 2, {g['layers']} × "
         f"`Linear({g['width']}, {g['width']})` + GELU, **{g['params'] / 1e6:.1f} M parameters**, fp32, `torch_adam` AdamW after one step: "
         f"**{g['bytes'] / 1e9:.2f} GB** in {g['files']} files (each rank's `optim_states.pt` holds its partition of the fp32 weights and "
         "both moments)."),
        ("- Every run: `python -P -m torch.distributed.run --standalone --nproc_per_node 2`, gloo on CPU, one torch thread per rank, a fresh "
         f"pair of processes. {a['repeats']} runs of each side, round-robin; the page cache is warm (the checkpoint was just written; "
         "nothing is dropped)."),
        ("- **DeepSpeed**: `DS_ACCELERATOR=cpu`, the model under `deepspeed.zero.Init`, `deepspeed.initialize` with the configuration the "
         "checkpoint was saved with, then `engine.load_checkpoint(ROOT)` alone, timed on each rank after a barrier."),
        ("- **Ravex**: a plain PyTorch script with `@ravex.train_loop` and no loading code: the model on the meta device, `fully_shard` "
         "on each Linear and the root over `init_device_mesh(\"cpu\", (2,))`, `to_empty`, `torch.optim.AdamW` with the saved "
         "hyper-parameters, a DataLoader with a DistributedSampler; `RAVEX_RESUME_FROM=ROOT`, an empty store, "
         f"`RAVEX_CHECKPOINT_EVERY={NO_CHECKPOINT}` (nothing written). The restore happens in the first `iter(loader)`: "
         "`iter(loader)` + `next()` is timed on each rank after a barrier, and so is the decorator's start (where the checkpoint is "
         "found and described). Both again with `RAVEX_ENABLED=0`, subtracted."),
        ("- Memory: `VmRSS` just before the timed call, then `VmHWM` reset (`5 > /proc/self/clear_refs`) so the `VmHWM` after it is "
         "the peak during the load alone; the process's own peak over the whole run; the job's peak `RssAnon` (torchrun and both ranks, "
         "sampled every 20 ms)."),
        "", "## Results", "", *tables(res, s), "",
        "## Checks", "",
    ]
    if digests and rv_runs:
        nbytes = sum(d["numel"] * 4 for d in digests.values() if d)
        lines.append(f"- **Bit-for-bit equal to DeepSpeed's load, in every run**: {len(digests)} tensors gathered whole ({nbytes / 1e9:.2f} GB: every "
                     "parameter and both Adam moments of each), sha256 on rank 0 (DeepSpeed: `safe_get_full_fp32_param` / "
                     "`safe_get_full_optimizer_state`; Ravex: `full_tensor()` of the FSDP2 parameter and of its optimizer state).")
        lines.append(f"- Same step ({ref.get('step')}), Adam step {ref.get('adam_steps')}, hyper-parameters {ref.get('hyper')}, on every rank.")
        fb = {rk: x.get("first_batch") for rk, x in rv_runs[0]["ranks"].items()}
        lines.append(f"- First batch after the resume (sample indices per rank): {fb}; DeepSpeed's `global_samples` = {ref.get('global_samples')} "
                     f"(the saved run's samples are skipped).")
    msgs = sorted({ln.split(" ", 2)[-1] for r in rv_runs for t in r["ravex_log"].values() for ln in t})
    if msgs:
        lines.append("- Ravex said (stderr, any rank): " + "; ".join(f"`{x[:240]}`" for x in msgs[:10]))
    lines += ["", "## Caveats", "",
              ("- Two ranks on two CPUs that are shared with other work: no core is idle while the ranks read, and times vary by 10-20 % "
               "between runs of the same command; the spread is in the table."),
              ("- Warm page cache: every file was read from memory, so this times the loaders' own work (unpickling, copying, "
               "partitioning), not the disk; `cp -r` is as warm. A cold read adds about the same disk time to both sides."),
              ("- Not the same work. DeepSpeed loads its own layout at its own world size: each rank unpickles its own "
               "`optim_states.pt` (its flat fp32 partition) and copies it into its partitions. Ravex maps the same files into another "
               "program's layout (FSDP2 row shards, torch optimizer state by parameter name): each rank reads only its rows of each "
               "tensor, checks everything against the live objects first, and checks the CRC-32 of its share of the files' storages. "
               "The world size is the same here (2 → 2), which is DeepSpeed's only option; Ravex would read the same checkpoint at "
               "another world size."),
              ("- Both sides' set-up is outside the timed call: DeepSpeed's `zero.Init` and `initialize`, the script's model, "
               "`fully_shard` and optimizer. The launch-to-resumed line shows the whole."),
              "- fp32 only; no LR scheduler was saved (make_checkpoints.py configures none), so none was restored.",
              "", "## Observations", "", *[f"- {o}" for o in auto_observations(s, res)], *[f"- {o}" for o in res.get("observations", [])], ""]
    return "\n".join(lines)


def auto_observations(s: dict, res: dict) -> list[str]:
    """Plain statements computed from this run's numbers."""
    obs = []
    ds, on = s.get("deepspeed"), s.get("ravex")
    if ds and on and "net" in s:
        t_ds, net = med(ds["timed"]), s["net"]["total"]
        faster = "faster" if net < t_ds else "slower"
        obs.append(f"**Resume time: Ravex {net:.2f} s against DeepSpeed's {t_ds:.2f} s ({net / t_ds:.2f}x, {faster})**, counting Ravex's start "
                   f"({s['net']['start']:+.2f} s) and its restore in the first batch ({s['net']['first_batch']:+.2f} s) over the same script "
                   f"without Ravex. `cp -r` of the same bytes: {med(res['cp']):.2f} s.")
        peaks = [(on["mem"][rk]["hwm_during"], ds["mem"][rk]["hwm_during"]) for rk in range(MC.WORLD_SIZE)]
        obs.append("**Peak memory during the load**, per rank: Ravex " + ", ".join(mib(p) for p, _ in peaks) + " against DeepSpeed "
                   + ", ".join(mib(q) for _, q in peaks) + f" ({', '.join(f'{p / q:.2f}x' for p, q in peaks)}).")
        m0, d0 = on["mem"][0], ds["mem"][0]
        obs.append(f"Where the memory goes (rank 0): DeepSpeed holds {mib(d0['rss_before'])} before its load (after `initialize`), "
                   f"ends {(d0['rss_after'] - d0['rss_before']) / 1024:+,.0f} MiB from there and "
                   f"peaks {(d0['hwm_during'] - d0['rss_after']) / 1024:,.0f} MiB above where it ends. The FSDP2 script holds "
                   f"{mib(m0['rss_before'])} before (the `to_empty` shards are allocated but not yet touched, and AdamW has no state "
                   f"before its first step), grows by {(m0['rss_after'] - m0['rss_before']) / 1024:+,.0f} MiB (its shards written, "
                   f"both moments created) and peaks {(m0['hwm_during'] - m0['rss_after']) / 1024:,.0f} MiB above where it ends: the "
                   "weights are read straight into the parameters' own memory and the moments into buffers the optimizer keeps, and "
                   "no copy of the live state is kept (a foreign checkpoint has nothing to fall back on).")
        ph = {k: med(v) for k, v in on["phases"].items() if v}
        if all(k in ph and not math.isnan(ph[k]) for k in ("start", "restore", "adapt", "read", "apply_plan")):
            rest = ph["restore"] - ph["adapt"] - ph["read"] - ph["apply_plan"] - ph.get("plan", 0)
            obs.append(f"Ravex's time, by phase (slowest rank): its start {ph['start']:.2f} s (the checkpoint found and described, its "
                       f"CRC-32s checked, each rank its share, at the decorator's entry); at the first `iter(loader)`: fitting and "
                       f"checking (`adapt`, `plan`) {ph['adapt'] + ph.get('plan', 0):.2f} s, the reads {ph['read']:.2f} s, the put-in "
                       f"(`apply_plan`) {ph['apply_plan']:.2f} s, the ranks' agreement {rest:.2f} s.")
    return obs


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size for make_checkpoints.py, GB (default 1: 2 layers, 1.26 GB)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side (default 3)")
    ap.add_argument("--checkpoint", help="use this ZeRO-3 checkpoint (made by `make_checkpoints.py zero3 DIR --gb G` with the same --gb) "
                                         "instead of making one; it is not deleted")
    ap.add_argument("--max-idle-wait", type=float, default=20, help="before each run wait up to S s for idle CPUs")
    ap.add_argument("--dir", help="work directory (default: a new temporary directory); removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--doc", default=DOC, help="the markdown report to write ('' for none)")
    ap.add_argument("--render", help="only rewrite the report from a saved results JSON")
    ap.add_argument("--note", action="append", default=[], help="with --render: add an observation to the results and the report; repeatable")
    ap.add_argument("--child", choices=["deepspeed", "ravex"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        for run in res["runs"]:
            run["ranks"] = {int(k): v for k, v in run["ranks"].items()}  # JSON made the ranks strings
        problems = verify(res)
        if problems:
            sys.exit("foreign_resume: the saved runs do not agree with DeepSpeed's load; no report:\n  " + "\n  ".join(problems[:20]))
        if a.note:
            res.setdefault("observations", []).extend(a.note)
            with open(a.render, "w") as f:
                json.dump(res, f, indent=1)
        R.publish(render(res), a.doc)
        return
    t_start = time.monotonic()
    own_dir = a.dir is None
    work = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="ravex-bench-foreign-"))
    os.makedirs(work, exist_ok=True)
    if os.listdir(work):
        sys.exit(f"{work}: not empty; give --dir an empty or new directory")
    need = (0 if a.checkpoint else 1.3 * a.gb * 1e9) + 1.3 * a.gb * 1e9 + (1 << 30)  # the checkpoint, one cp -r copy, slack
    free = os.statvfs(work).f_bavail * os.statvfs(work).f_frsize
    if free < need:
        R.rm(work) if own_dir else None
        sys.exit(f"{work}: {free / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB\nhint: pass --dir on a larger disk, or a smaller --gb")
    res: dict = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(a), "loadavg_start": R.loadavg(),
                 "command": " ".join(["python bench/foreign_resume.py", *sys.argv[1:]]), "machine": R.machine(), "runs": [], "cp": []}
    problems: list[str] = []
    try:
        res["pinned"] = R.pin_ravex(work)  # a reinstall by other work mid-run must not mix builds
        res["versions"] = R.versions()
        a.layers = MC.layers_for(a.gb)
        if a.checkpoint:
            a.ckpt = os.path.abspath(a.checkpoint)
            nbytes, nfiles = MC.dir_bytes(a.ckpt)
            res["generated"] = {"out": a.ckpt, "bytes": nbytes, "files": nfiles, "layers": a.layers, "width": MC.WIDTH,
                                "params": a.layers * (MC.WIDTH * MC.WIDTH + MC.WIDTH), "given": True}
        else:
            a.ckpt = os.path.join(work, "zero3")
            R.log(f"making a ZeRO-3 checkpoint of about {a.gb} GB ({a.layers} x Linear({MC.WIDTH}, {MC.WIDTH})) in {a.ckpt}")
            res["generated"] = R.generate("zero3", a.gb, a.ckpt, os.path.join(work, "generate.log"))
            R.log(f"  {res['generated']['bytes'] / 1e9:.2f} GB in {res['generated']['seconds']:.1f} s")
        res["args"] = vars(a)
        for i in range(a.repeats):
            for side in SIDES:
                res["runs"].append(launch(a, work, f"{side}-{i}", side))
            if i == 0:
                problems = verify(res)
                if problems:
                    break  # the first round disagrees: no point timing more
        res["cp"] = [] if problems else time_cp(a, work)
    finally:
        res["total_s"] = time.monotonic() - t_start
        R.save_results(res, OUT, work, own_dir, a.keep)
    problems = verify(res)
    if problems:
        sys.exit("foreign_resume: Ravex's resume does not match DeepSpeed's load (or a run failed); no numbers, no report:\n  "
                 + "\n  ".join(problems[:20]) + f"\nraw results: {OUT}")
    R.publish(render(res), a.doc, OUT)


if __name__ == "__main__":
    main()
