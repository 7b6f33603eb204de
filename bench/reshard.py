"""Reshard benchmark: ``ravex reshard`` (world size 2 -> 3) against ``cp -r`` and DCP's own reshard.

    ~/.cache/ravex/venv/bin/python bench/reshard.py [--size 2.5] [--runs 3]

For ONE size (GB on disk, 1e9 bytes) it generates a DeepSpeed ZeRO-3 checkpoint and an FSDP2 + DCP
checkpoint, both world size 2, with bench/make_checkpoints.py, then times on each (warm page cache:
every command runs once untimed, then --runs timed runs round-robin, median reported):

- ``ravex reshard SRC DST --world-size 3`` (same format out: ZeRO-3 ws3, or DCP ws3);
- ``cp -r SRC DST`` (the floor) and ``cp -r`` + ``sync -f`` (a durable copy: Ravex fsyncs);
- DCP input only, DCP's own reshard: ``torchrun --nproc_per_node 3`` of this file (gloo, CPU mesh,
  OMP_NUM_THREADS=1): every rank builds the same model, ``fully_shard`` on a 3-rank mesh, AdamW,
  ``get_state_dict`` -> ``dcp.load`` of the ws2 checkpoint -> ``set_state_dict``, then
  ``dcp.save`` of model + optimizer at ws3. The whole torchrun is timed. (DeepSpeed has no
  one-step ZeRO-3 reshard to compare with: its route is ds_to_universal + a training restart.)

Measuring (wall time, peak RssAnon summed over the process tree, CPU, other load) reuses
bench/run.py; every output is deleted and ``sync`` run after its run, outside the timing.
Once per input, ``ravex verify SRC DST`` checks the resharded output (exit 0 = identical).
Writes bench/out/reshard-results.json and docs/benchmarks-reshard.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_checkpoints as MC
import plot
import run as R

DOC = os.path.join(R.ROOT, "docs", "benchmarks-reshard.md")
WS_OUT = 3
T_CP_RATIO = 1.5


# ----------------------------------------------------------------------------------------------
# DCP's own reshard (runs under torchrun)


def dcp_worker(src: str, dst: str, gb: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def body() -> None:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = MC.build_model(MC.layers_for(gb))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        msd, osd = get_state_dict(model, opt)  # initialises the optimizer state to load into
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=src)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dst)
        dist.barrier()

    MC.run_then_exit(body)


# ----------------------------------------------------------------------------------------------
# the launcher


def cases(kind: str, src: str, work: str, gb: float) -> list[tuple[str, str, list[str], str, dict]]:
    o = lambda name: os.path.join(work, name)
    env = R.bench_env()
    cs = [
        ("ravex", f"ravex reshard --world-size {WS_OUT}", [R.RAVEX, "reshard", src, o("ravex"), "--world-size", str(WS_OUT), "-q"],
         o("ravex"), env),
        ("ravex_nosync", f"ravex reshard --world-size {WS_OUT} --no-sync",
         [R.RAVEX, "reshard", src, o("ravex_nosync"), "--world-size", str(WS_OUT), "--no-sync", "-q"], o("ravex_nosync"), env),
        ("cp", "cp -r", ["cp", "-r", src, o("cp")], o("cp"), env),
        ("cp_sync", "cp -r && sync -f", ["sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', src, o("cp_sync")], o("cp_sync"), env),
    ]
    if kind == "dcp":
        denv = dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        torchrun = os.path.join(R.BIN, "torchrun")
        cs.append(("dcp", f"DCP reshard (torchrun x{WS_OUT}: load ws2, save ws3)",
                   [torchrun, "--standalone", "--nproc_per_node", str(WS_OUT), os.path.abspath(__file__), "--dcp-worker",
                    src, o("dcp"), "--size", str(gb)], o("dcp"), denv))
    return cs


def ok_output(key: str, dst: str) -> bool:
    if not os.path.isdir(dst):
        return False
    if key in ("ravex", "dcp") and os.path.exists(os.path.join(dst, ".metadata")):
        return all(os.path.exists(os.path.join(dst, f"__{r}_0.distcp")) for r in range(WS_OUT))
    return R.path_bytes(dst) > 0


def bench_input(kind: str, src: str, work: str, gb: float, runs: int, logf, a, res: dict) -> None:
    cs = cases(kind, src, work, gb)
    entry: dict = {"cases": {k: {"label": lab, "wall": [], "peak_anon_kb": [], "maxrss_kb": [], "cpu_s": [], "other_cpu": []}
                             for k, lab, *_ in cs}}
    res["inputs"][kind] = entry
    os.sync()
    for rnd in range(runs + 1):
        for key, label, argv, dst, env in cs:
            if rnd > 0:
                R.wait_idle(a.max_idle_wait)
            r = R.measure(argv, env, logf)
            ok = r.rc == 0 and ok_output(key, dst)
            c = entry["cases"][key]
            if rnd == 0:
                c["warmup_wall"] = r.wall
                c["out_bytes"] = R.path_bytes(dst) if ok else 0
                if key == "ravex" and ok:  # check the resharded output once
                    t = time.perf_counter()
                    v = subprocess.run([R.RAVEX, "verify", src, dst], env=env, capture_output=True, text=True, check=False)
                    entry["verify"] = {"rc": v.returncode, "seconds": round(time.perf_counter() - t, 2),
                                       "output": (v.stdout + v.stderr).strip()[-600:]}
                    R.log(f"  {kind:5} ravex verify SRC DST: exit {v.returncode} ({entry['verify']['seconds']} s)")
                    if kind == "dcp":
                        files = sorted(os.listdir(dst))
                        entry["ravex_out_files"] = files
            else:
                for f in ("wall", "peak_anon_kb", "maxrss_kb", "cpu_s", "other_cpu"):
                    c[f].append(getattr(r, f))
            R.log(f"  {kind:5} {label:48} {'warm-up' if rnd == 0 else f'run {rnd}':7} {r.wall:7.2f} s  anon "
                  f"{r.peak_anon_kb / 1024:7.0f} MiB  other-load {r.other_cpu:4.2f}" + ("" if ok else f"  FAILED rc={r.rc}"))
            R.rm(dst)
            os.sync()
            if not ok:
                c["failed"] = f"exit {r.rc}"
                raise RuntimeError(f"{label} failed on {src}; see {logf.name}")
        if rnd >= 1 and time.monotonic() > a.deadline_mono:
            entry["runs_cut"] = f"stopped after {rnd} timed runs (time budget --budget-min)"
            R.log(f"  {kind}: time budget reached, stopping after {rnd} timed runs")
            break


# ----------------------------------------------------------------------------------------------
# report


def ratio(a: list[float], b: list[float]) -> float | None:
    return R.med(a) / R.med(b) if a and b else None


def render(res: dict) -> str:
    m, v = res["machine"], res["versions"]
    lines = [
        "# Reshard benchmark (`ravex reshard`, world size 2 → 3)",
        "",
        (f"Generated by `bench/reshard.py` on {res['started']} (whole run {res['total_s'] / 60:.1f} min). "
        "Raw numbers: `bench/out/reshard-results.json` (not checked in)."),
        "",
        "## Machine and versions",
        "",
        (f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs, which may be shared with other work (load average at start: "
        f"{res['loadavg_start']}; the other-load column is the CPUs other processes kept busy during each timed run)"),
        f"- memory: `{m['free'].splitlines()[1]}`",
        f"- disk: `{m['filesystem']}`; kernel {m['kernel']}",
        f"- Python {v.get('python')}, torch {v.get('torch')}, DeepSpeed {v.get('deepspeed')}, {v.get('ravex')}, {v.get('cp')}",
        f"- git {v.get('git_head')}{' (dirty tree)' if v.get('git_dirty') else ''}",
        "",
        "## Method",
        "",
        (f"One size only: **{res['size_gb']} GB** requested (`--size`); the checkpoints are "
        f"{MC.layers_for(res['size_gb'])} × `Linear({MC.WIDTH}, {MC.WIDTH})` fp32 + AdamW moments, made by "
        "`bench/make_checkpoints.py` (ZeRO-3 ws2 and FSDP2 + DCP ws2). Warm page cache; every command once untimed, then "
        f"{res['runs']} timed runs round-robin (median [min–max]); outputs deleted and `sync` run after each run, outside "
        "the timing. Memory: peak `RssAnon` summed over the command's process tree (sampled every 20 ms). "
        "`OMP_NUM_THREADS=2` for Ravex and cp; the DCP reshard job runs 3 ranks with `OMP_NUM_THREADS=1` (gloo, CPU mesh), "
        "each rank building the model, `fully_shard` on a 3-rank mesh, `dcp.load` + `set_state_dict`, `dcp.save` of model + "
        "optimizer; the whole torchrun is timed. DeepSpeed has no one-command ZeRO-3 reshard, so the ZeRO-3 input has no "
        "reference column."),
        "",
        "## Results",
        "",
    ]
    head = ["input", "command", "output", "wall: median [min–max]", "CPU", "peak RssAnon", "other load", "÷ cp -r", "÷ ravex"]
    rows = []
    checks = []
    for kind, e in res["inputs"].items():
        cs = e["cases"]
        rv = cs["ravex"]["wall"]
        for key, c in cs.items():
            if not c["wall"]:
                continue
            rows.append([
                f"{'ZeRO-3' if kind == 'zero3' else 'DCP'} ws2, {res['gen'][kind]['bytes'] / 1e9:.2f} GB", c["label"],
                f"{c.get('out_bytes', 0) / 1e9:.2f} GB", R.fmt_s(c["wall"]), f"{R.med(c['cpu_s']):.1f} s", R.fmt_mib(c["peak_anon_kb"]),
                f"{R.med(c['other_cpu']):.2f}",
                f"{ratio(c['wall'], cs['cp']['wall']):.2f}x", "—" if key == "ravex" else f"{ratio(c['wall'], rv):.2f}x",
            ])
        r_cp = ratio(rv, cs["cp"]["wall"])
        checks.append((kind, "ravex reshard ≤ 1.5x cp -r", f"{r_cp:.2f}x", r_cp <= T_CP_RATIO))
        if cs.get("ravex_nosync", {}).get("wall") and cs.get("cp_sync", {}).get("wall"):
            r_ns = ratio(cs["ravex_nosync"]["wall"], cs["cp"]["wall"])
            checks.append((kind, "(like for like) ravex reshard --no-sync ≤ 1.5x cp -r", f"{r_ns:.2f}x", r_ns <= T_CP_RATIO))
            r_d = ratio(rv, cs["cp_sync"]["wall"])
            checks.append((kind, "(like for like) ravex reshard ≤ 1.5x cp -r && sync -f", f"{r_d:.2f}x", r_d <= T_CP_RATIO))
        vr = e.get("verify", {})
        checks.append((kind, "`ravex verify SRC DST` exit 0", f"exit {vr.get('rc')}", vr.get("rc") == 0))
        if "dcp" in cs and cs["dcp"]["wall"]:
            checks.append((kind, "(info) DCP reshard / ravex", f"{ratio(cs['dcp']['wall'], rv):.2f}x", None))
    lines.append(R.md_table(head, rows))
    lines += ["", f"Timed runs per command: {res['runs']}" + "".join(f"; {k}: {e['runs_cut']}" for k, e in res["inputs"].items()
                                                                     if e.get("runs_cut")) + ".", ""]
    gen = "; ".join(f"{k}: {g['bytes'] / 1e9:.2f} GB in {g['files']} files, {g['seconds']:.0f} s, peak anon "
                    f"{g['peak_anon_kb'] / 1024 ** 2:.1f} GiB" for k, g in res["gen"].items())
    lines += [f"Generation: {gen}.", "", "## Targets", "", R.md_table(["input", "target", "measured", "met"],
              [[k, t, mv, "—" if ok is None else ("yes" if ok else "**no**")] for k, t, mv, ok in checks]), ""]
    other = res.get("other_size")
    if not other:
        lines += [("Peak anonymous memory flat across sizes: **not measured** — one size only in this run (the time available "
                  "allowed one); run `--size` twice to check it."), ""]
    else:
        lines += [(f"Peak anonymous memory across sizes (a second run, at {other['size_gb']} GB with {other['runs']} timed "
                  "runs per command, `--compare`):"), ""]
        rows = []
        for kind, e in res["inputs"].items():
            oe = other["inputs"].get(kind)
            if not oe:
                continue
            for key, c in e["cases"].items():
                oc = oe["cases"].get(key)
                if key == "cp_sync" or not oc or not oc["wall"]:
                    continue
                rows.append([kind, c["label"], (f"{other['gen'][kind]['bytes'] / 1e9:.2f} GB: {R.fmt_mib(oc['peak_anon_kb'])}, "
                             f"{R.fmt_s(oc['wall'])}"), (f"{res['gen'][kind]['bytes'] / 1e9:.2f} GB: {R.fmt_mib(c['peak_anon_kb'])}, "
                             f"{R.fmt_s(c['wall'])}"), f"{ratio(oe['cases']['ravex']['wall'], oe['cases']['cp']['wall']):.2f}x"
                             if key == "ravex" else ""])
        lines += [R.md_table(["input", "command", "other size: peak RssAnon, wall", "this size: peak RssAnon, wall",
                              "ravex ÷ cp -r (other size)"], rows), ""]
    lines += ["## Observations", "", *[f"- {o}" for o in res.get("observations", [])], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=2.5, help="checkpoint size in GB (default 2.5)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per command (default 3)")
    ap.add_argument("--budget-min", type=float, default=60, help="stop adding timed rounds after this many minutes")
    ap.add_argument("--max-idle-wait", type=float, default=5, help="wait up to S s for idle CPUs before each timed run")
    ap.add_argument("--workdir", default=os.path.join(R.HERE, "out", "reshard"))
    ap.add_argument("--kinds", nargs="+", default=["zero3", "dcp"], choices=["zero3", "dcp"])
    ap.add_argument("--render", help="only rewrite the report from a saved results JSON")
    ap.add_argument("--compare", help="with --render: a results JSON of another size, for the memory-across-sizes table")
    ap.add_argument("--results", default=os.path.join(R.HERE, "out", "reshard-results.json"), help="where the results JSON goes")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks-reshard.md")
    ap.add_argument("--dcp-worker", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.dcp_worker:
        dcp_worker(*a.dcp_worker, a.size)
        return
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        if a.compare:
            with open(a.compare) as f:
                res["other_size"] = json.load(f)
        with open(DOC, "w") as f:
            f.write(render(res))
        plot.refresh_doc(DOC)
        return
    t0 = time.monotonic()
    a.deadline_mono = t0 + a.budget_min * 60
    work = os.path.abspath(a.workdir)
    if os.path.exists(work):
        R.rm(work)
    os.makedirs(work)
    res: dict = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "size_gb": a.size, "runs": a.runs,
                 "loadavg_start": R.loadavg(), "machine": R.machine(), "versions": R.versions(),
                 "inputs": {}, "gen": {}}
    logpath = os.path.join(work, "commands.log")
    with open(logpath, "ab") as logf:
        for kind in a.kinds:
            src = os.path.join(work, f"{kind}_src")
            R.log(f"generating {kind} {a.size} GB")
            res["gen"][kind] = R.generate(kind, a.size, src, os.path.join(work, "generate.log"))
            R.log(f"  {res['gen'][kind]}")
            try:
                bench_input(kind, src, work, a.size, a.runs, logf, a, res)
            finally:
                R.rm(src)
                os.sync()
    res["total_s"] = time.monotonic() - t0
    out = a.results
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    if not a.no_doc:
        with open(DOC, "w") as f:
            f.write(render(res))
        plot.refresh_doc(DOC)
    R.log(f"wrote {out}" + ("" if a.no_doc else f" and {DOC}"))
    for kind, e in res["inputs"].items():
        for c in e["cases"].values():
            print(f"{kind:5} {c['label']:50} {R.fmt_s(c['wall']):28} anon {R.fmt_mib(c['peak_anon_kb'])}")


if __name__ == "__main__":
    main()
