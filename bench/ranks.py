"""One process against two: ``ravex convert`` alone and under ``torchrun --nproc_per_node 2``.

    ~/.cache/ravex/venv/bin/python bench/ranks.py [--gb 2.5] [--runs 3] [--work DIR]

Makes (once, kept in --work) an FSDP2 + DCP checkpoint of about --gb GB at world size 2 with
bench/make_checkpoints.py, then for each target (DCP at 4 ranks, a native store at 4 ranks,
safetensors in 500 MB shards, ZeRO-3 at 4 ranks) times, warm page cache, median of --runs:

- ``ravex convert SRC DST --to ...`` as one process;
- the same under ``torchrun --standalone --nproc_per_node 2 -m ravex`` (gloo), whose wall time
  includes torchrun's start-up and two interpreters importing torch for the group;
- ``torchrun`` of a conversion of a tiny fixture, the start-up cost alone;
- ``cp -r SRC DST && sync -f DST`` (the durable floor: every Ravex output is fsynced).

Each two-process output is compared with the one-process output file by file (DCP's
``.metadata`` differs by its save_id only; a native store by times and run ids) before it is
deleted. Prints a table and writes bench/out/ranks-results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_checkpoints as MC
import run as R

TARGETS = {
    "dcp ws4": ["--to", "dcp", "--world-size", "4"],
    "native ws4": ["--to", "native", "--world-size", "4"],
    "safetensors 500MB shards": ["--to", "safetensors", "--max-shard-size", "500MB"],
    "zero3 ws4": ["--to", "zero", "--zero-stage", "3", "--world-size", "4"],
}
TINY = os.path.join(R.FIXTURES, "fsdp2_ws2", "checkpoint")
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def torchrun(args: list[str]) -> list[str]:
    return [R.PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "ravex", *args]


def files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), root)
            data = open(os.path.join(d, f), "rb").read()  # noqa: SIM115 - small enough per file on this machine
            if rel == ".metadata":
                data = _UUID.sub(b"-" * 36, data)
            if rel.endswith(".json") or rel == "lock":
                continue  # native: times and run ids
            out[rel] = data
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ravex-bench-ranks"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    env = R.bench_env()
    src = os.path.join(a.work, f"dcp-{a.gb}")
    if not os.path.isdir(src):
        MC.launch("dcp", src, a.gb, os.path.join(a.work, "make.log"))
    logf = open(os.path.join(a.work, "log.txt"), "ab")  # noqa: SIM115 - kept open for every command
    res: dict = {"gb": a.gb, "src_bytes": R.path_bytes(src), "rows": {}}

    def timed(argv: list[str], dst: str, keep: bool = False) -> float:
        r = R.measure(argv, env, logf, cwd=a.work)
        if r.rc != 0:
            raise SystemExit(f"failed ({r.rc}): {' '.join(argv)}; see {a.work}/log.txt")
        if not keep:
            R.rm(dst)
            subprocess.run(["sync"], check=True)
        return r.wall

    floor = os.path.join(a.work, "cp")
    res["cp_sync"] = [timed(["sh", "-c", f"cp -r '{src}' '{floor}' && sync -f '{floor}'"], floor) for _ in range(a.runs)]
    tiny = os.path.join(a.work, "tiny")
    res["torchrun_tiny"] = [timed(torchrun(["convert", TINY, tiny, "--to", "dcp", "--quiet"]), tiny) for _ in range(a.runs)]
    for label, args in TARGETS.items():
        one, two = os.path.join(a.work, "one"), os.path.join(a.work, "two")
        row: dict = {"one": [], "two": []}
        R.rm(one)  # left by an interrupted run
        R.rm(two)
        timed([R.RAVEX, "convert", src, one, *args, "--quiet"], one)  # warm-up, untimed
        for i in range(a.runs):
            row["one"].append(timed([R.RAVEX, "convert", src, one, *args, "--quiet"], one, keep=i == 0))
            row["two"].append(timed(torchrun(["convert", src, two, *args, "--quiet"]), two, keep=i == 0))
            if i == 0:
                row["identical"] = files(one) == files(two)
                R.rm(one)
                R.rm(two)
        res["rows"][label] = row
        R.log(f"{label}: one {statistics.median(row['one']):.2f} s, two {statistics.median(row['two']):.2f} s, identical {row['identical']}")
    os.makedirs(os.path.join(R.HERE, "out"), exist_ok=True)
    with open(os.path.join(R.HERE, "out", "ranks-results.json"), "w") as f:
        json.dump({**res, "machine": R.machine()}, f, indent=1)
    cp = statistics.median(res["cp_sync"])
    start = statistics.median(res["torchrun_tiny"])
    print(f"input: DCP ws2, {res['src_bytes'] / 1e9:.2f} GB; cp -r && sync -f: {cp:.2f} s; torchrun start-up (tiny conversion): {start:.2f} s\n")
    print("| target | 1 process | 2 processes (torchrun) | 2 minus start-up | 1 ÷ (2 minus start-up) | identical |")
    print("|---|---|---|---|---|---|")
    for label, row in res["rows"].items():
        o, t = statistics.median(row["one"]), statistics.median(row["two"])
        print(f"| {label} | {o:.2f} s | {t:.2f} s | {t - start:.2f} s | {o / max(t - start, 1e-9):.2f}x | {row['identical']} |")


if __name__ == "__main__":
    main()
