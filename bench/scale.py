"""Planner benchmark on synthetic metadata: how long planning takes, and how much memory, for Llama-3-shaped
DeepSpeed ZeRO-3 checkpoints of 8B to 405B parameters, planned into DCP (FSDP2 dim-0 shards) and into safetensors shards.

    ~/.cache/ravex/venv/bin/python bench/scale.py [--runs 3] [--only 8b 405b] [--targets dcp safetensors dry-run] [--no-doc]

No tensor data exists at any point. For each shape the source :class:`~ravex_convert.model.Checkpoint` is built in
memory the way ``formats/zero.py`` (``read_stage3``) describes a ZeRO-3 save: ``stage3_pieces`` (the reader's own
geometry) cuts every parameter into ``ceil(numel / ws)``-element pieces, one per rank, inside each rank's sub-group
tensors (DeepSpeed's ``sub_group_size`` rule, 1e9 elements); each piece becomes a ``Flat`` chunk of the fp32 master and
of Adam's two moments at its byte offset in ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, plus a 0-d ``step`` per
parameter. The rank files are sparse files of the right size (``os.truncate``: no block is written), because the core's
planner checks every chunk's byte range against its file's size; a 4.9 TB checkpoint then takes no disk.

Then what the writers do before the first byte moves, and nothing else (no file is created, no byte copied):

- ``dcp``: ``select`` + ``dcp_write.plan_write`` (one entry per key: the ``torch.save`` archive layouts of its shard
  shapes; the core's ``DcpLayout`` places every item and sizes ``.metadata``) + rank 0's own file: its records and
  ``plan.copy_job`` over it (the job ``plan.run`` gives that rank) + ``_core.plan_summary`` over that job (the Rust
  planner and validation ``execute`` runs before copying). Outside the plan, timed on their own: ``.metadata`` made at
  the commit, and one process's job over every file (``ravex convert`` without torchrun);
- ``safetensors``: weights only, ``--dtype bfloat16 --max-shard-size 5GB``: ``select`` + ``safetensors.plan_write``
  (shards, headers, the index) + ``plan.copy_job`` + ``_core.plan_summary``;
- ``dry-run``: ``convert.plan`` (what ``ravex convert --dry-run`` prints: every tensor into one whole target).

These are the writers' own functions; ``--check`` runs the real writers on a tiny shape with ``CopyJob.run``
replaced by a capture and asserts that the job planned here is the one they run.

Every (shape, target) runs in a fresh interpreter. Time: the median of ``--runs`` plans, each on a fresh ``select``.
Memory, in the first run: the peak RSS above the RSS before planning (``VmHWM`` reset through ``/proc/self/clear_refs``
before the plan, read after it; it counts Python objects and the Rust core alike) and the same for the Rust call alone;
in a last run, tracemalloc's peak (Python allocations only; tracemalloc slows Python down, so that run is not timed).
Writes bench/out/scale-results.json and docs/benchmarks-scale.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plot
import run as R

from ravex_convert import _core
from ravex_convert._engine import CopyJob
from ravex_convert._output import Options, select
from ravex_convert.convert import plan as dry_run_plan
from ravex_convert.formats import safetensors
from ravex_convert.formats.dcp import writer as dcp_write
from ravex_convert.formats.zero.layout import stage3_partition, stage3_pieces
from ravex_convert.model import MODEL, OPTIM, Box, Checkpoint, Chunk, Flat, LogicalTensor
from ravex_convert.plan import copy_job

DOC = os.path.join(ROOT, "docs", "benchmarks-scale.md")
RESULTS = os.path.join(ROOT, "bench", "out", "scale-results.json")
TARGETS = ("dcp", "safetensors", "dry-run")
PLAN_SECONDS = 1.0  # the targets
PLAN_BYTES = 100 * 10**6
SUB_GROUP_SIZE = 10**9  # DeepSpeed's default zero_optimization.sub_group_size
SHARD_BYTES = 5 * 10**9
REPEAT_BUDGET_S = 30.0  # no further timed run once the runs so far took this long
TRACEMALLOC_MAX_S = 8.0  # no tracemalloc run for a plan slower than this


@dataclass(frozen=True)
class Shape:
    """A Llama-3 decoder: GQA attention, SwiGLU MLP, RMSNorm, untied embeddings."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int = 128256
    src_ws: int = 192  # ZeRO-3 world size of the save
    dst_ws: int = 256  # DCP world size of the output

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) in module order, as DeepSpeed's ``param_shapes`` lists them."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (self.inter, h)), (p + "mlp.up_proj.weight", (self.inter, h)),
                    (p + "mlp.down_proj.weight", (h, self.inter)),
                    (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


# World sizes grow with the model, as a run of that size would use; the last is the case.
SHAPES = {
    "8b": Shape("Llama-3 8B", 32, 4096, 32, 8, 14336, src_ws=16, dst_ws=32),
    "70b": Shape("Llama-3 70B", 80, 8192, 64, 8, 28672, src_ws=64, dst_ws=128),
    "180b": Shape("Llama-3-shaped 180B", 96, 12288, 96, 8, 40960, src_ws=128, dst_ws=192),
    "405b": Shape("Llama-3 405B", 126, 16384, 128, 8, 53248, src_ws=192, dst_ws=256),
}
TINY = Shape("tiny (for --check)", 2, 64, 4, 2, 96, vocab=100, src_ws=3, dst_ws=4)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sub_groups(partitions: list[int], size: int = SUB_GROUP_SIZE) -> list[int]:
    """Each rank's sub-group tensor lengths: DeepSpeed's ``_create_fp16_sub_groups`` closes a sub-group
    at the parameter that takes its partition elements to ``sub_group_size`` or past it."""
    out: list[int] = []
    acc = 0
    for i, p in enumerate(partitions):
        acc += p
        if acc >= size or i == len(partitions) - 1:
            out.append(acc)
            acc = 0
    return out


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


def synthetic_zero3(shape: Shape, root: Path) -> Checkpoint:
    """The :class:`Checkpoint` ``zero.read`` would give for a ZeRO-3 save of ``shape`` with torch AdamW (fp32 master,
    ``exp_avg``, ``exp_avg_sq``, a tensor ``step`` per sub-group), the rank files created sparse under ``root``."""
    ws = shape.src_ws
    params = shape.params()
    names = [n for n, _ in params]
    numels = [_numel(s) for _, s in params]
    subs = sub_groups([stage3_partition(n, ws) for n in numels])
    pieces, homes = stage3_pieces(numels, subs, ws)
    # A rank file as torch.save lays it out: the pickle first, then each storage 64-byte aligned
    # (per sub-group: the fp32 partition, exp_avg, exp_avg_sq, step), then the zip directory.
    keys = ("fp32", "exp_avg", "exp_avg_sq")
    base: dict[tuple[str, int], int] = {}
    at = 1 << 16
    for k, n in enumerate(subs):
        for key in keys:
            at = _align(at + 64)  # the storage's local zip header
            base[key, k] = at
            at += n * 4
        at = _align(at + 64)
        base["step", k] = at
        at += 4
    size = at + (1 << 16)
    tag = root / "global_step1000"
    tag.mkdir(parents=True, exist_ok=True)
    files = [tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ws)]  # one Path per file, as the reader holds
    for f in files:
        with open(f, "wb") as fh:
            fh.truncate(size)  # sparse: no data block is written
    (root / "latest").write_text("global_step1000")
    ckpt = Checkpoint("zero", root, world_size=ws, step=1000)
    ckpt.source = {"format": "zero", "variant": "zero3", "precision": "bf16", "tag": "global_step1000", "ds_version": "0.19.8"}
    for (name, pshape), per, home in zip(params, pieces, homes):
        master = ckpt.add(LogicalTensor(MODEL + name, pshape, "float32"))
        moments = [ckpt.add(LogicalTensor(f"{OPTIM}{key}/{name}", pshape, "float32")) for key in keys[1:]]
        for pc in per:
            region = Flat(pc.param_start, pc.length)
            f = files[pc.rank]
            master.chunks.append(Chunk(region, "float32", f, base["fp32", pc.tensor] + pc.tensor_start * 4))
            for key, lt in zip(keys[1:], moments):
                lt.chunks.append(Chunk(region, "float32", f, base[key, pc.tensor] + pc.tensor_start * 4))
        ckpt.add(LogicalTensor(f"{OPTIM}step/{name}", (), "float32", [Chunk(Box((), ()), "float32", files[0], base["step", home])]))
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "foreach": None, "maximize": False,
             "capturable": False, "differentiable": False, "fused": None}
    ckpt.objects["optim.param_groups"] = [{**hyper, "params": names}]
    ckpt.objects["lr_scheduler"] = {"last_epoch": 1000, "_step_count": 1001, "base_lrs": [3e-4], "_last_lr": [3e-4]}
    ckpt.objects["zero"] = {"variant": "zero3", "stage": 3, "world_size": ws, "precision": "bf16", "param_groups": 1,
                            "sub_groups": len(subs)}
    return ckpt


# ---------------------------------------------------------------- the plans (what the writers do before job.run)


def plan_dcp(ckpt: Checkpoint, ws: int, rust: Callable[[CopyJob], Any]) -> dict[str, Any]:
    """What every rank does before its first byte moves: the plan of the whole output (one entry per key; the
    core places the items), then its own file's records and job (rank 0's here: every rank's is alike)."""
    opts = Options(world_size=ws)
    out = select(ckpt, opts)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    plan = dcp_write.plan_write(out, Path("/nonexistent/dst"), opts)  # the core's DcpLayout, .metadata sized
    phases["plan_write"] = time.perf_counter() - t
    t = time.perf_counter()
    job, crc_ranges, _ = copy_job(plan.files[:1], [Path("/nonexistent/dst") / plan.files[0].rel])
    phases["rank 0: its records + copy job"] = time.perf_counter() - t
    return {"phases": phases, "job": job, "summary": rust(job), "items": plan.summary["items"], "files": ws + 1,
            "out_bytes": plan.summary["bytes"], "crc_ranges": len(crc_ranges), "plan": plan}


def after_dcp(plan: Any) -> dict[str, Any]:
    """Outside the plan: the coordinator's ``.metadata`` at the commit, and one process's job over every file."""
    gc.collect()
    before = _status()["VmRSS"]
    R.reset_peak()
    t = time.perf_counter()
    meta = plan.commit({})[0][1]
    res: dict[str, Any] = {"metadata_s": time.perf_counter() - t, "metadata_bytes": len(meta), "metadata_rss": _status()["VmHWM"] - before}
    del meta
    gc.collect()
    before = _status()["VmRSS"]
    R.reset_peak()
    t = time.perf_counter()
    job, _, _ = copy_job(plan.files, [Path("/nonexistent/dst") / f.rel for f in plan.files])
    _core.plan_summary(job.sources, job.targets, job.tensors)
    res.update(one_process_s=time.perf_counter() - t, one_process_rss=_status()["VmHWM"] - before,
               one_process_target_chunks=sum(len(x[2]) for x in job.tensors))
    return res


def plan_safetensors(ckpt: Checkpoint, ws: int, rust: Callable[[CopyJob], Any]) -> dict[str, Any]:
    opts = Options(weights_only=True, dtype="bfloat16", max_shard_size=SHARD_BYTES)
    out = select(ckpt, opts)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    plan = safetensors.plan_write(out, Path("/nonexistent/dst"), opts)  # shards, headers, index
    phases["plan_write"] = time.perf_counter() - t
    t = time.perf_counter()
    job, _, _ = copy_job(plan.files, [Path("/nonexistent/dst") / f.rel for f in plan.files])
    phases["copy job"] = time.perf_counter() - t
    index = plan.commit[0][1] if isinstance(plan.commit, list) and plan.commit else b""
    return {"phases": phases, "job": job, "summary": rust(job), "files": len(plan.files) + 1, "out_bytes": plan.summary["bytes"] + len(index)}


def plan_dry_run(ckpt: Checkpoint, ws: int, rust: Callable[[CopyJob], Any]) -> dict[str, Any]:
    opts = Options()
    out = select(ckpt, opts)
    t = time.perf_counter()
    summary = dry_run_plan(out, opts)  # its own plan_summary call: Python and Rust are not told apart here
    return {"phases": {"convert.plan (incl. Rust)": time.perf_counter() - t}, "job": None, "summary": summary, "files": 1,
            "out_bytes": summary["bytes_written"]}


PLANS = {"dcp": plan_dcp, "safetensors": plan_safetensors, "dry-run": plan_dry_run}


# ---------------------------------------------------------------- measuring, in a child interpreter


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", f.read(), re.MULTILINE)}


def _args_only(job: CopyJob) -> float:
    """Seconds ``plan_summary`` spends taking its arguments from Python (under the GIL): the same call with the
    first source renamed to a missing file, which fails at the first step after the arguments are converted
    (reading the sources' sizes), before any planning."""
    sources = list(job.sources)
    sources[0] = "/nonexistent/ravex-scale-probe"
    t = time.perf_counter()
    try:
        _core.plan_summary(sources, job.targets, job.tensors)
    except OSError:
        return time.perf_counter() - t
    raise SystemExit("the argument probe did not fail: plan_summary no longer checks source sizes first; drop the probe")


def measure(key: str, target: str, runs: int, workdir: Path) -> dict[str, Any]:
    shape = SHAPES[key]
    gc.collect()
    rss0 = _status()["VmRSS"]
    t = time.perf_counter()
    ckpt = synthetic_zero3(shape, workdir)
    build_s = time.perf_counter() - t
    gc.collect()
    chunks = sum(len(t.chunks) for t in ckpt.tensors.values())
    res: dict[str, Any] = {"key": key, "target": target, "shape": asdict(shape), "params": len(shape.params()),
                           "numel": sum(_numel(s) for _, s in shape.params()), "tensors": len(ckpt.tensors), "source_chunks": chunks,
                           "source_bytes": sum(t.nbytes for t in ckpt.tensors.values()), "build_s": build_s,
                           "source_model_rss": _status()["VmRSS"] - rss0}
    rust_peak: dict[str, int] = {}

    def rust(job: CopyJob) -> dict[str, Any]:
        before = _status()["VmRSS"]
        R.reset_peak()
        t0 = time.perf_counter()
        summary = dict(_core.plan_summary(job.sources, job.targets, job.tensors))
        rust_peak["s"] = int((time.perf_counter() - t0) * 1e9)
        rust_peak["rss"] = _status()["VmHWM"] - before
        return summary

    times: list[float] = []
    probes: list[float] = []
    phases_all = []
    for i in range(runs):
        if sum(times) > REPEAT_BUDGET_S:
            break  # a plan this slow is timed once: the 405B DCP plan takes minutes here
        gc.collect()
        before = _status()["VmRSS"]
        ok = R.reset_peak()
        t0 = time.perf_counter()
        out = PLANS[target](ckpt, shape.dst_ws, rust)
        times.append(time.perf_counter() - t0)
        peak = _status()["VmHWM"] - before
        phases = dict(out["phases"])
        if out["job"] is not None:
            phases["Rust plan_summary"] = rust_peak["s"] / 1e9
        # what is left: select, and freeing the plan's objects as the writer's function returns (seconds at 405B DCP)
        phases["select, freeing, rest"] = times[-1] - sum(phases.values())
        phases_all.append(phases)
        if i == 0 and "plan" in out:
            res.update(after_dcp(out.pop("plan")))
        out.pop("plan", None)
        if i == 0:
            s = out["summary"]
            job = out["job"]
            extra: dict[str, Any] = {k: out[k] for k in ("items", "metadata_bytes", "crc_ranges") if k in out}
            res.update({"plan_rss_peak": peak if ok else None, "rust_rss_peak": rust_peak.get("rss") if ok else None,
                        "target_chunks": sum(len(x[2]) for x in job.tensors) if job is not None else len(ckpt.tensors),
                        "job_source_chunks": sum(len(x[1]) for x in job.tensors) if job is not None else chunks,
                        "job_tensors": len(job.tensors) if job is not None else len(ckpt.tensors),
                        "runs": s["runs"], "pieces": s.get("pieces"), "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"],
                        "out_files": out["files"], "out_bytes": out["out_bytes"],
                        **extra})
        if out["job"] is not None:
            probes.append(_args_only(out["job"]))  # outside the timing
        del out
    res["rust_args_s"] = statistics.median(probes) if probes else None
    res["plan_s"] = statistics.median(times)
    res["timed_runs"] = len(times)
    res["plan_s_all"] = times
    res["phases"] = {k: statistics.median(p[k] for p in phases_all) for k in phases_all[0]}
    res["plan_py_peak"] = None
    if sum(times) / len(times) > TRACEMALLOC_MAX_S:
        return res  # tracemalloc makes pure-Python code ~7x slower: skipped where one plan is already slow
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = PLANS[target](ckpt, shape.dst_ws, rust)
    res["plan_py_peak"] = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del out
    return res


# ---------------------------------------------------------------- the drift check


def check() -> None:
    """The jobs planned here are the ones the writers run: both writers on a tiny shape (sparse sources, so nothing
    is copied: ``CopyJob.run`` is replaced by a capture), compared with ``copy_job`` over their own plans."""
    captured: list[CopyJob] = []
    real_run = CopyJob.run

    def capture(self: CopyJob, **_: Any) -> dict[str, int]:
        captured.append(self)
        self.crcs = [0] * len(_.get("crc_ranges") or [])
        return {}

    with tempfile.TemporaryDirectory(prefix="ravex-scale-check-") as d:
        ckpt = synthetic_zero3(TINY, Path(d) / "src")
        CopyJob.run = capture  # type: ignore[method-assign]
        try:
            opts = Options(world_size=TINY.dst_ws)
            out = select(ckpt, opts)
            dcp_write.write(out, Path(d) / "dcp", opts)
            plan = dcp_write.plan_write(out, Path(d) / "dcp", opts)
            mine = copy_job(plan.files, [Path(d) / f.rel for f in plan.files])[0]
            sopts = Options(weights_only=True, dtype="bfloat16", max_shard_size=20_000)
            sout = select(ckpt, sopts)
            safetensors.write(sout, Path(d) / "st", sopts)
            splan = safetensors.plan_write(sout, Path(d) / "st", sopts)
            mine_st = copy_job(splan.files, [Path(d) / f.rel for f in splan.files])[0]
        finally:
            CopyJob.run = real_run  # type: ignore[method-assign]
        for name, theirs, ours in (("dcp", captured[0], mine), ("safetensors", captured[1], mine_st)):
            same = (theirs.tensors == ours.tensors and theirs.sources == ours.sources and
                    [Path(p).name for p in theirs.targets] == [Path(p).name for p in ours.targets])
            if not same:
                raise SystemExit(f"--check: the {name} job built here differs from the one {name} writer builds; update bench/scale.py")
            print(f"check: {name}: the planned CopyJob equals the writer's ({len(ours.tensors)} tensors, {len(ours.targets)} targets)")


# ---------------------------------------------------------------- the parent: run, table, doc


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:,.0f} MB"


def _machine() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"], check=False, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory": mem, "kernel": platform.release(), "python": platform.python_version(),
            "core": _core.__version__, "git": git + (" (dirty tree)" if dirty else "")}


def row_of(r: dict[str, Any]) -> str:
    sh = r["shape"]
    ok_t = "yes" if r["plan_s"] <= PLAN_SECONDS else "**no**"
    ok_m = "—" if r["plan_rss_peak"] is None else ("yes" if r["plan_rss_peak"] <= PLAN_BYTES else "**no**")
    chunks = r["job_source_chunks"] + r["target_chunks"]
    out = {"dcp": f"{sh['dst_ws']} ranks", "dry-run": "1 target"}.get(r["target"], f"{r['out_files'] - 1} shards")
    times = r["plan_s_all"]
    spread = f" [{min(times):.2f}–{max(times):.2f}]" if len(times) > 1 else " (1 run)"
    return (f"| {sh['name']} | {sh['src_ws']} ranks → {out} "
            f"| {r['target']} | {r['params']:,} | {r['tensors']:,} | {_fmt_bytes(r['source_bytes'])} | {r['job_source_chunks']:,} "
            f"| {r['target_chunks']:,} | {r['runs']:,} | {r['plan_s']:.2f} s{spread} | {r['plan_s'] / chunks * 1e6:.1f} µs "
            f"| {_mb(r['plan_rss_peak'])} | {_mb(r['rust_rss_peak'])} "
            f"| {_mb(r['plan_py_peak'])} | {ok_t} / {ok_m} |")


METHOD = (
    "No tensor data: each source is the `Checkpoint` that `zero.read` would build for a Llama-3-shaped DeepSpeed ZeRO-3 "
    "save (fp32 master + AdamW `exp_avg`, `exp_avg_sq` and a 0-d `step` per parameter; `stage3_pieces` places every "
    "parameter's `ceil(numel/ws)`-element pieces in each rank's sub-group tensors, `sub_group_size` 1e9), pointing into "
    "sparse rank files of the right size. Each (shape, target) runs in a fresh interpreter; **plan** is everything the "
    "writer does before its first byte moves: `select`, the writer's layout, the `CopyJob` it hands the core, and "
    "`_core.plan_summary` on that job (the Rust planner + validation `execute` runs first). DCP: `plan_write` (one entry per "
    "key: the `torch.save` archive layouts of its few shard shapes; the core's `DcpLayout` places every item and sizes "
    "`.metadata`), then what each rank does for its own file (rank 0's: its items' records, and its job, whose source chunks "
    "are those that reach its rows); the `.metadata` itself is made at the commit, and one process writing every file "
    "builds every file's records: both are in their own table below. Safetensors: shards, headers, index, and one job. The `dry-run` rows "
    "are `convert.plan` (`ravex convert --dry-run`). Time: median of {runs} runs (a single run where the runs so far took "
    "over {repeat:.0f} s). **plan RSS**: peak RSS above the RSS before planning (`VmHWM` reset via "
    "`/proc/self/clear_refs`), Python objects and Rust alike; **Rust RSS**: the same around the `plan_summary` call alone; "
    "**Python peak**: tracemalloc's peak in one more (untimed) run, skipped where one plan takes over {trace:.0f} s "
    "(tracemalloc slows pure-Python code about 7x). **argument probe**: the same `plan_summary` call with its first source "
    "renamed to a missing file, which fails right after pyo3 has taken the arguments from Python, before any planning: the "
    "share of the Rust call that is argument conversion. The source model's own memory is not in these: it is listed "
    "separately below. DCP targets: FSDP2 dim-0 shards at the output world size; safetensors: weights only, "
    "`--dtype bfloat16 --max-shard-size 5GB`. **source chunks** / **target chunks**: the chunks the job hands the core "
    "(DCP: rank 0's job; safetensors: the weights' only); **copy runs**: the planner's runs. Targets (issue 13): plan ≤ 1 s and ≤ 100 MB "
    "(checked on plan RSS)."
)
MARK = "<!-- observations -->"  # what follows it in the doc is kept when the doc is rewritten
HEADER = ("| model | source → output | target | params | tensors | source | source chunks | target chunks | copy runs "
          "| plan time: median [min–max] | per chunk | plan RSS | Rust RSS | Python peak | ≤ 1 s / ≤ 100 MB |")


def write_doc(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
    m = meta["machine"]
    lines = [
        "# Planner benchmark at scale (synthetic metadata)",
        "",
        (f"Generated by `bench/scale.py` on {meta['date']} (whole run {meta['wall_s'] / 60:.1f} min). Raw numbers: "
         "`bench/out/scale-results.json` (not checked in). The observations after the tables are written by hand; "
         "rerunning the script rewrites everything above them."),
        "",
        "## Machine",
        "",
        (f"- CPU: {m['cpu']}, {m['cpus']} logical CPUs, shared with other work (a CI run and other helpers): load average "
         f"{meta['load_before']} at start, {meta['load_after']} at the end"),
        f"- memory: {m['memory'] / 2**30:.0f} GiB; kernel {m['kernel']}; Python {m['python']}; ravex core {m['core']}; git {m['git']}",
        "",
        "## Method",
        "",
        METHOD.format(runs=meta["runs"], repeat=REPEAT_BUDGET_S, trace=TRACEMALLOC_MAX_S),
        "",
        "## Results",
        "",
        HEADER,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row_of(r) for r in results]
    lines += ["", "Where the plan time goes (median seconds per phase):", "", "| model | target | phases |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['shape']['name']} ({r['shape']['src_ws']} → {r['shape']['dst_ws']}) | {r['target']} | "
                     + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
                     + (f" (argument probe: {r['rust_args_s']:.3f})" if r.get("rust_args_s") else "") + " |")
    lines += ["", "The source model (built once per interpreter, not part of the plan):", "",
              "| model | ranks | source chunks | build time | its RSS |", "|---|---|---|---|---|"]
    seen = set()
    for r in results:
        if r["key"] in seen:
            continue
        seen.add(r["key"])
        sh = r["shape"]
        lines.append(f"| {sh['name']} | {sh['src_ws']} | {r['source_chunks']:,} | {r['build_s']:.2f} s | {_mb(r['source_model_rss'])} |")
    extra = [r for r in results if r["target"] == "dcp"]
    if extra:
        lines += ["", ("DCP outputs, and what happens outside the plan: the coordinator's `.metadata` at the commit (made by the core "
                       "from the plan), and one process writing every rank file (every file's records and one job over them: "
                       "`ravex convert` without torchrun):"), "",
                  "| model | items | files | .metadata | its time / RSS at the commit | one process, every file: job time / RSS | target chunks |",
                  "|---|---|---|---|---|---|---|"]
        for r in extra:
            lines.append(f"| {r['shape']['name']} | {r.get('items', 0):,} | {r['out_files']} | {_mb(r.get('metadata_bytes'))} "
                         f"| {r.get('metadata_s', 0):.2f} s / {_mb(r.get('metadata_rss'))} "
                         f"| {r.get('one_process_s', 0):.2f} s / {_mb(r.get('one_process_rss'))} | {r.get('one_process_target_chunks', 0):,} |")
    lines.append("")
    old = Path(path).read_text() if os.path.exists(path) else ""
    notes = old.split(MARK, 1)[1] if MARK in old else ""
    lines += [MARK + (notes if notes else "\n")]
    Path(path).write_text("\n".join(lines))
    plot.refresh_doc(path)  # the lead: a summary table and docs/img/scale.png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="timed plans per case (median reported)")
    ap.add_argument("--only", nargs="+", choices=list(SHAPES), help="shapes to run (default: all four)")
    ap.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    ap.add_argument("--doc", default=DOC)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--check", action="store_true", help="only check that the mirrored jobs equal the writers' (tiny shape)")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only rewrite the doc from saved results")
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "TARGET", "WORKDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        key, target, workdir = args.child
        print(json.dumps(measure(key, target, args.runs, Path(workdir))))
        return
    if args.check:
        check()
        return
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        write_doc(saved["results"], saved["meta"], args.doc)
        return
    check()
    keys = args.only or list(SHAPES)
    meta: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "runs": args.runs, "machine": _machine(),
                            "load_before": [f"{x:.2f}" for x in os.getloadavg()]}
    t0 = time.perf_counter()
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in keys:
        for target in args.targets:
            work = tempfile.mkdtemp(prefix="ravex-scale-")
            try:
                p = subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--child", key, target, work],
                                   check=False, capture_output=True, text=True, env=env)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if p.returncode != 0:
                raise SystemExit(f"{key} {target}: the measurement failed:\n{p.stderr}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{key:>9} {target:<11} tensors {r['tensors']:>6,} chunks {r['source_chunks']:>9,} + {r['target_chunks']:>9,}  "
                  f"plan {r['plan_s']:7.3f} s  RSS +{_mb(r['plan_rss_peak']):>9}  Rust +{_mb(r['rust_rss_peak']):>7}  "
                  f"py peak {_mb(r['plan_py_peak']):>9}  (source built in {r['build_s']:.1f} s, {_mb(r['source_model_rss'])})", flush=True)
    meta["wall_s"] = time.perf_counter() - t0
    meta["load_after"] = [f"{x:.2f}" for x in os.getloadavg()]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    Path(RESULTS).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if not args.no_doc:
        write_doc(results, meta, args.doc)
        print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
