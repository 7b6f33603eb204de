"""The requests a native store's writer and reader send a bucket, without a training run: one store
written by ``ravex convert --to native`` and read back by ``load_checkpoint``, for N tensors of
``--tensor-mib`` each (multipart uploads, ranged GETs). bench/s3_requests.py counts a training run's
own (its lease, a checkpoint, a resume).

    ~/.cache/ravex/venv/bin/python bench/s3_requests_store.py [--tensors 6 60] [--tensor-mib 4]

A SeaweedFS server on 127.0.0.1 (tests/_s3server.py) behind the counting proxy of the tests
(tests/_faultproxy.py, every byte passed through; it records each request's method and target).
For each N: a safetensors file of N fp32 tensors is written to ``s3://ckpt/nN/store`` as a native
store (``ravex convert SRC s3://… --to native``: the store's commit protocol, as a checkpoint of the
runtime writes it, without the run's lease), then read back by ``load_checkpoint`` (what a resume from
an empty disk calls). Requests are classed from the method and the query: LIST (``list-type``),
multipart (``uploads``/``uploadId``), HEAD, GET, PUT, DELETE. Prints a markdown table; nothing is kept.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import _s3server
from _faultproxy import FaultProxy

PY = sys.executable
RAVEX = str(Path(PY).with_name("ravex"))
LOAD = """\
import sys
from ravex_convert.storage import resolve
from ravex_runtime.loading import load_checkpoint
load_checkpoint(resolve(sys.argv[1]).path)
"""
MAKE = """\
import sys
import torch
from safetensors.torch import save_file
n, mib, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
save_file({f"layers.{i}.weight": torch.randn(mib << 18, generator=g) for i in range(n)}, out)
"""


def kind(method: str, target: str) -> str:
    query = target.partition("?")[2]
    if method == "GET" and "list-type" in query:
        return "LIST"
    if "uploads" in query or "uploadId" in query:
        return f"{method} (multipart)"
    return method


def count(p: FaultProxy, since: int) -> dict[str, int]:
    return dict(collections.Counter(kind(m, t) for m, t in p.requests[since:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[6, 60])
    ap.add_argument("--tensor-mib", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ravex-bench-s3req-") as work:
        server = _s3server.start(Path(work) / "s3", bucket="ckpt")
        try:
            c = _s3server.client(server.endpoint)
            deadline = time.monotonic() + 60
            while True:
                try:
                    c.head_bucket(Bucket="ckpt")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            with FaultProxy(server.port) as p:
                env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAVEX_S3_"))}
                env.update(AWS_ACCESS_KEY_ID=_s3server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=_s3server.SECRET_KEY,
                           AWS_ENDPOINT_URL=p.endpoint, AWS_REGION="us-east-1")
                rows = []
                for n in a.tensors:
                    src = os.path.join(work, f"n{n}.safetensors")
                    subprocess.run([PY, "-c", MAKE, str(n), str(a.tensor_mib), src], check=True)
                    url = f"s3://ckpt/n{n}/store"
                    mark = len(p.requests)
                    subprocess.run([RAVEX, "convert", src, url, "--to", "native"], env=env, check=True, capture_output=True)
                    wrote = count(p, mark)
                    mark = len(p.requests)
                    subprocess.run([PY, "-c", LOAD, url], env=env, check=True)
                    rows.append((n, wrote, count(p, mark)))
                    os.remove(src)
        finally:
            server.stop()
    kinds = sorted({k for _, w, r in rows for k in (*w, *r)})
    print(f"{a.tensor_mib} MiB fp32 tensors; requests by kind\n")
    print("| N tensors | what | total | " + " | ".join(kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for n, wrote, read in rows:
        for what, got in (("checkpoint written (convert --to native)", wrote), ("resume's read (load_checkpoint)", read)):
            print(f"| {n} | {what} | {sum(got.values())} | " + " | ".join(str(got.get(k, 0)) for k in kinds) + " |")


if __name__ == "__main__":
    main()
