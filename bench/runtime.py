"""Runtime benchmark: what ``@ravex.train_loop`` costs a CPU training loop.

    ~/.cache/ravex/venv/bin/python bench/runtime.py [--width 4096 --layers 6 --steps 30 --repeats 2]

A model of ``--layers`` square ``Linear(width, width)`` layers (GELU between; default 6 x 4096 =
100.7 M parameters, fp32) trained with AdamW on fixed random batches, in a loop without a
DataLoader (``ravex.batch_boundary()`` at the top of each iteration). Every run is a subprocess of
this file (``--child``), with ``torch.set_num_threads(--threads)`` (default 1: the other core is
left to Ravex's writer thread and to whatever else runs on the machine) and its own store
(``RAVEX_STORAGE_PATH``, ``RAVEX_FRESH=true``), started in an empty work directory so no
``ravex.yaml`` is picked up. It measures:

(a) throughput: the same --steps with ``RAVEX_CHECKPOINT_EVERY=10`` and with ``RAVEX_ENABLED=0``,
    alternating, --repeats times each. The loop time is measured inside the child from the first
    step to the end of the last one (it includes the in-loop checkpoints: the collection on the
    training thread and the writer thread competing for the CPUs); the final checkpoint that
    ``train_loop`` writes when the function returns is reported separately (the process wall).
(b) blocked time per checkpoint: the child wraps ``ravex_runtime.runtime.Runtime.collect`` (the
    copy made on the training thread, including waiting for a free slot in the writer's queue) with
    a timer; in-loop collections only. The reference is a plain in-memory copy of the same state
    (``clone()`` of every tensor of ``model.state_dict()`` and of the optimizer state), timed 3 times
    in the RAVEX_ENABLED=0 runs at the end of the loop.
(c) incremental bytes: a model whose first half of the layers is frozen (``requires_grad=False``,
    not in the optimizer), ``checkpoint_every=1``, 2 steps: checkpoint 0 (after step 1) and
    checkpoint 1 (after step 2, the final one). Bytes per checkpoint from ``ravex status --json``
    (``bytes``: logical; ``bytes_on_disk``: files in that checkpoint's own directory), compared
    with the bytes of the tensors that changed (the trainable half: weights + two Adam moments).

Writes bench/out/runtime-results.json and docs/benchmarks-runtime.md; stores are deleted as it goes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plot
import run as R

DOC = os.path.join(R.ROOT, "docs", "benchmarks-runtime.md")
T_SLOWDOWN = 0.05
T_BLOCK_RATIO = 1.5


# ----------------------------------------------------------------------------------------------
# the child: one training run


def child(a) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(a.threads)
    import ravex

    enabled = os.environ.get("RAVEX_ENABLED", "1") not in ("0", "false", "no", "off")
    collect_s: list[float] = []
    if enabled:
        from ravex_runtime import runtime as rtmod

        orig = rtmod.Runtime.collect

        def timed_collect(self, final: bool = False):
            t = time.perf_counter()
            try:
                return orig(self, final)
            finally:
                collect_s.append((time.perf_counter() - t, final))

        rtmod.Runtime.collect = timed_collect

    out: dict = {"enabled": enabled}

    @ravex.train_loop
    def train() -> None:
        torch.manual_seed(0)
        mods: list = []
        for i in range(a.layers):
            mods.append(nn.Linear(a.width, a.width))
            if i + 1 < a.layers:
                mods.append(nn.GELU())
        model = nn.Sequential(*mods)
        linears = [m for m in model if isinstance(m, nn.Linear)]
        if a.frozen_half:
            for m in linears[: len(linears) // 2]:
                m.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["trainable"] = sum(p.numel() for p in params)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(a.batch, a.width, generator=g) for _ in range(4)]
        step_t: list[float] = []
        t0 = time.perf_counter()
        for i in range(a.steps):
            ravex.batch_boundary()
            ts = time.perf_counter()
            loss = model(batches[i % len(batches)]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_t.append(time.perf_counter() - ts)
        out["loop_s"] = time.perf_counter() - t0
        out["step_s"] = step_t
        if not enabled and a.clone_ref:
            clones = []
            for _ in range(3):
                tc = time.perf_counter()
                copy = {k: v.detach().clone() for k, v in model.state_dict().items()}
                copy.update({f"{pid}/{k}": v.clone() for pid, st in opt.state_dict()["state"].items()
                             for k, v in st.items() if isinstance(v, torch.Tensor)})
                clones.append(time.perf_counter() - tc)
                del copy
            out["clone_s"] = clones
        if enabled:
            out["status_before_return"] = {k: v for k, v in ravex.status().items() if isinstance(v, (int, str, bool, type(None)))}

    t_all = time.perf_counter()
    train()
    out["train_call_s"] = time.perf_counter() - t_all  # includes the final checkpoint (written and waited for)
    out["collect_s"] = [s for s, final in collect_s if not final]
    out["collect_final_s"] = [s for s, final in collect_s if final]
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------
# the launcher


def launch(a, work: str, name: str, env_extra: dict, extra_args: list[str], logf) -> dict:
    store = os.path.join(work, f"store-{name}")
    env = R.bench_env()
    env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), RAVEX_STORAGE_PATH=store, RAVEX_FRESH="true")
    env.update(env_extra)
    argv = [R.PY, os.path.abspath(__file__), "--child", "--threads", str(a.threads), "--width", str(a.width), "--layers", str(a.layers),
            "--steps", str(a.steps), "--batch", str(a.batch), *extra_args]
    outp = os.path.join(work, f"{name}.out")
    R.wait_idle(a.max_idle_wait)
    with open(outp, "wb") as f:
        r = R.measure(argv, env, f, cwd=work)
    with open(outp) as f:
        text = f.read()
    logf.write(f"\n$ {name}: {' '.join(f'{k}={v}' for k, v in env_extra.items())} {' '.join(argv)}\n{text}".encode())
    line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
    if r.rc != 0 or line is None:
        raise RuntimeError(f"run {name} failed (exit {r.rc}): {text[-1500:]}")
    res = json.loads(line[7:])
    res.update(wall=r.wall, peak_anon_kb=r.peak_anon_kb, cpu_s=r.cpu_s, other_cpu=r.other_cpu)
    if os.path.isdir(store) and res.get("enabled"):
        p = subprocess.run([R.RAVEX, "status", store, "--json"], capture_output=True, text=True, env=env, check=False)
        try:
            res["status"] = json.loads(p.stdout)
        except ValueError:
            res["status"] = {"error": (p.stdout + p.stderr)[-500:]}
        res["store_bytes"] = R.path_bytes(store)
    R.rm(store)
    R.log(f"  {name:14} loop {res['loop_s']:6.2f} s  wall {r.wall:6.2f} s  collect {[round(x, 3) for x in res.get('collect_s', [])]}  "
          f"clone {[round(x, 3) for x in res.get('clone_s', [])]}  other-load {r.other_cpu:.2f}")
    return res


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def render(res: dict) -> str:
    m, v, a = res["machine"], res["versions"], res["args"]
    on, off = res["on"], res["off"]
    loop_on, loop_off = [r["loop_s"] for r in on], [r["loop_s"] for r in off]
    slow = med(loop_on) / med(loop_off) - 1
    coll = [x for r in on for x in r["collect_s"]]
    clone = [x for r in off for x in r.get("clone_s", [])]
    bratio = med(coll) / med(clone)
    inc = res["incremental"]
    cks = inc["status"]["checkpoints"]
    c0, c1 = cks[0], cks[1]
    p, t = inc["params"], inc["trainable"]
    changed = 12 * t  # trainable weights + exp_avg + exp_avg_sq, fp32
    first_expected = 4 * p + 8 * t
    over = c1["bytes_on_disk"] - changed
    lines = [
        "# Runtime benchmark (`@ravex.train_loop` on a CPU training loop)",
        "",
        (f"Generated by `bench/runtime.py` on {res['started']} (whole run {res['total_s'] / 60:.1f} min). Raw numbers: "
        "`bench/out/runtime-results.json` (not checked in)."),
        "",
        "## Machine and versions",
        "",
        (f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs, which may be shared with other work (load average at start: "
        f"{' '.join(res['loadavg_start'])}; \"other load\" = CPUs kept busy by other processes during each run)"),
        f"- memory: `{m['free'].splitlines()[1]}`; disk: `{m['filesystem']}`",
        f"- Python {v.get('python')}, torch {v.get('torch')}, {v.get('ravex')}; git {v.get('git_head')}",
        "",
        "## Setup",
        "",
        (f"- model: {a['layers']} × `Linear({a['width']}, {a['width']})` + GELU, **{on[0]['params'] / 1e6:.1f} M parameters** fp32, "
        f"AdamW (state ≈ {12 * on[0]['params'] / 1e9:.2f} GB: weights + two moments); batch {a['batch']}; "
        f"`torch.set_num_threads({a['threads']})`, `OMP_NUM_THREADS={a['threads']}`"),
        ("- loop without a DataLoader, `ravex.batch_boundary()` at the top of each iteration; native store, no compression, "
        "`keep_last` 3; each run a fresh subprocess with its own store"),
        f"- (a)/(b): {a['steps']} steps, `RAVEX_CHECKPOINT_EVERY=10` vs `RAVEX_ENABLED=0`, {a['repeats']} runs each, alternating",
        "",
        "## Results",
        "",
    ]
    rows = []
    for name, rs in (("RAVEX_ENABLED=0", off), ("checkpoint_every=10", on)):
        rows.append([name, ", ".join(f"{r['loop_s']:.2f}" for r in rs), f"{med([r['loop_s'] for r in rs]):.2f} s",
                     f"{a['steps'] / med([r['loop_s'] for r in rs]):.2f}",
                     f"{med([x for r in rs for x in r['step_s']]):.3f} s",
                     ", ".join(f"{r['wall']:.1f}" for r in rs), f"{R.fmt_mib([r['peak_anon_kb'] for r in rs])}",
                     ", ".join(f"{r['other_cpu']:.2f}" for r in rs)])
    lines.append("### (a) throughput")
    lines.append("")
    lines.append(R.md_table(["run", "loop time per run (s)", "median", "steps/s", "median step (fwd+bwd+opt)", "process wall (s; incl. start-up, final ckpt)",
                             "peak RssAnon", "other load"], rows))
    fin = [x for r in on for x in r["collect_final_s"]]
    lines += ["", (f"Slowdown with checkpoints: **{100 * slow:+.1f}%** (target ≤ +5%: **{'met' if slow <= T_SLOWDOWN else 'not met'}**). "
              f"{len(on[0]['collect_s'])} checkpoints are collected inside the loop per run; the final one (collected in "
              f"{R.fmt_s(fin)}, then written while the process waits) is outside the loop time."), ""]
    lines += ["### (b) training thread blocked per checkpoint", "",
              R.md_table(["what", "samples (s)", "median"],
                         [["`Runtime.collect` (in-loop checkpoints)", ", ".join(f"{x:.3f}" for x in coll), f"{med(coll):.3f} s"],
                          ["plain in-memory copy of the same state (`clone()`)", ", ".join(f"{x:.3f}" for x in clone), f"{med(clone):.3f} s"]]),
              "", f"Ratio: **{bratio:.2f}x** (target ≤ 1.5x: **{'met' if bratio <= T_BLOCK_RATIO else 'not met'}**).", ""]
    lines += ["### (c) bytes written by the second checkpoint, half the model frozen", "",
              (f"{inc['params'] / 1e6:.1f} M parameters, {inc['trainable'] / 1e6:.1f} M trainable (the last "
              f"{a['layers'] - a['layers'] // 2} of {a['layers']} layers); `checkpoint_every=1`, 2 steps."), "",
              R.md_table(["checkpoint", "step", "logical bytes", "bytes in its directory", "expected"],
                         [[str(c0["index"]), str(c0["step"]), f"{c0['bytes']:,}", f"{c0['bytes_on_disk']:,}",
                           f"{first_expected:,} (all weights + moments of the trainable half)"],
                          [str(c1["index"]), str(c1["step"]), f"{c1['bytes']:,}", f"{c1['bytes_on_disk']:,}",
                           f"{changed:,} (trainable weights + moments) + metadata"]]),
              "", (f"Second checkpoint beyond the changed tensors: {over:+,} bytes ({100 * c1['bytes_on_disk'] / c0['bytes_on_disk']:.1f}% "
              f"of the first checkpoint's directory). Target (only the changed half plus metadata): "
              f"**{'met' if 0 <= over < 0.01 * changed else 'not met'}**."), ""]
    lines += ["## Observations", "", *[f"- {o}" for o in res.get("observations", [])], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-idle-wait", type=float, default=5)
    ap.add_argument("--workdir", default=os.path.join(R.HERE, "out", "runtime"))
    ap.add_argument("--render", help="only rewrite the report from a saved results JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--frozen-half", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--clone-ref", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        with open(DOC, "w") as f:
            f.write(render(res))
        plot.refresh_doc(DOC)
        return
    t0 = time.monotonic()
    work = os.path.abspath(a.workdir)
    R.rm(work)
    os.makedirs(work)
    res: dict = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(a), "loadavg_start": R.loadavg(),
                 "machine": R.machine(), "versions": R.versions(), "on": [], "off": []}
    with open(os.path.join(work, "runs.log"), "ab") as logf:
        for i in range(a.repeats):
            res["off"].append(launch(a, work, f"off-{i}", {"RAVEX_ENABLED": "0"}, ["--clone-ref"], logf))
            res["on"].append(launch(a, work, f"on-{i}", {"RAVEX_CHECKPOINT_EVERY": "10"}, [], logf))
        inc_args = argparse.Namespace(**{**vars(a), "steps": 2})
        res["incremental"] = launch(inc_args, work, "frozen-half", {"RAVEX_CHECKPOINT_EVERY": "1", "RAVEX_KEEP_LAST": "null"},
                                    ["--frozen-half"], logf)
        R.log(f"  incremental: {[(c['index'], c['step'], c['bytes'], c['bytes_on_disk']) for c in res['incremental']['status']['checkpoints']]}")
    res["total_s"] = time.monotonic() - t0
    out = os.path.join(R.HERE, "out", "runtime-results.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    with open(DOC, "w") as f:
        f.write(render(res))
    plot.refresh_doc(DOC)
    R.log(f"wrote {out} and {DOC}")


if __name__ == "__main__":
    main()
