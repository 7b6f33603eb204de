"""What a store in an S3 bucket costs the training thread, against a store on local disk.

    ~/.cache/ravex/venv/bin/python bench/s3_stall.py [--width 2048 --layers 6 --steps 40 --every 10 --repeats 3]

The training run of ``bench/runtime.py`` (its ``--child``: ``--layers`` square ``Linear`` layers,
AdamW, ``ravex.batch_boundary()`` each iteration, ``Runtime.collect`` timed), run with
``RAVEX_STORAGE_PATH`` a local directory and then ``s3://…`` on a SeaweedFS server this script
starts on 127.0.0.1 (tests/_s3server.py), alternating, ``--repeats`` times each. Reported: the
time the training thread is blocked per in-loop checkpoint (the copy on the training thread,
including any wait for the writer's queue), the loop time, and the process wall (which includes
the final checkpoint, written while the process waits). Prints a markdown table; nothing is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import _s3server


def one(a: argparse.Namespace, store: str, env_extra: dict[str, str], work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update(OMP_NUM_THREADS=str(a.threads), RAVEX_STORAGE_PATH=store, RAVEX_FRESH="true", RAVEX_CHECKPOINT_EVERY=str(a.every), **env_extra)
    argv = [sys.executable, str(HERE / "runtime.py"), "--child", "--threads", str(a.threads), "--width", str(a.width), "--layers", str(a.layers),
            "--steps", str(a.steps), "--batch", "16"]
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"run failed ({p.returncode}): {p.stderr[-2000:]}")
    res = json.loads(line[7:])
    res["wall"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ravex-s3-stall-") as tmp:
        work = Path(tmp)
        server = _s3server.start(work / "server")
        env = {"AWS_ACCESS_KEY_ID": _s3server.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": _s3server.SECRET_KEY, "AWS_ENDPOINT_URL": server.endpoint,
               "AWS_REGION": "us-east-1"}
        runs: dict[str, list[dict]] = {"local": [], "s3": []}
        try:
            for i in range(a.repeats):
                runs["local"].append(one(a, str(work / f"store-{i}"), {}, work))
                runs["s3"].append(one(a, f"s3://{server.bucket}/stall/run-{i}", env, work))
                print(f"repeat {i}: local collect {[round(x, 3) for x in runs['local'][-1]['collect_s']]}, "
                      f"s3 collect {[round(x, 3) for x in runs['s3'][-1]['collect_s']]}", file=sys.stderr)
        finally:
            server.stop()
    params = runs["local"][0]["params"]
    print(f"{a.layers} x Linear({a.width}), {params / 1e6:.1f} M parameters fp32 + AdamW ({12 * params / 1e9:.2f} GB of state); "
          f"{a.steps} steps, a checkpoint every {a.every}; {a.repeats} runs each; load average {os.getloadavg()[0]:.1f}\n")
    print("| store | blocked per in-loop checkpoint, median (s) | loop (s), median | process wall (s), median |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        coll = [x for r in rs for x in r["collect_s"]]
        print(f"| {name} | {statistics.median(coll):.3f} ({len(coll)} samples) | {statistics.median(r['loop_s'] for r in rs):.2f} | "
              f"{statistics.median(r['wall'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
