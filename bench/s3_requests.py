"""How many requests a checkpoint and a resume make on an S3 bucket, by kind (each one is billed).

    ~/.cache/ravex/venv/bin/python bench/s3_requests.py [--tensors 10 100 1000]

A SeaweedFS server on 127.0.0.1 (tests/_s3server.py) behind the tests' counting proxy
(tests/_faultproxy.py, passing everything through), and a ``ravex.Session`` in this process with its
store at ``s3://ckpt/requests/<n>``: a model of ``n/2`` ``Linear(64, 64)`` layers (``n`` parameter
tensors) with AdamW, so a checkpoint holds ``3n`` tensors (weights, two moments) and a step count.
The phases, each counted on its own: opening the store and the first checkpoint (the lease taken,
the store made), a second checkpoint (the steady state: what every further checkpoint costs), the
close (the lease given back), then a resume in a new session (restore of the newest checkpoint) and
its close. Prints a markdown table, and on stderr each request of the first size; nothing is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import _s3server
from _faultproxy import FaultProxy

KINDS = ["GET", "HEAD", "LIST", "PUT", "PUT part", "POST", "DELETE"]


def kind(method: str, target: str) -> str:
    """A request as S3 bills it: GET, HEAD, LIST (a listing of keys or of uploads), PUT (a whole
    object, or a part of a multipart upload), POST (a multipart upload begun or completed), DELETE."""
    query = target.partition("?")[2]
    if method == "GET":
        return "LIST" if ("list-type" in query or "uploads" in query or target.count("/") <= 1) else "GET"
    if method == "PUT":
        return "PUT part" if "partNumber=" in query else "PUT"
    return method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ravex-s3-requests-") as tmp:
        server = _s3server.start(Path(tmp) / "server")
        try:
            with FaultProxy(server.port) as proxy:
                os.environ.update({"AWS_ACCESS_KEY_ID": _s3server.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": _s3server.SECRET_KEY,
                                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "AWS_REGION": "us-east-1"})
                rows = [(n, measure(n, server.bucket, proxy, i == 0)) for i, n in enumerate(a.tensors)]
        finally:
            server.stop()
    print("Requests by kind (LIST: a listing of keys or of multipart uploads; POST: a multipart upload begun or completed).\n")
    print("| parameter tensors | phase | " + " | ".join(KINDS) + " | all |")
    print("|---|---|" + "---|" * (len(KINDS) + 1))
    for n, phases in rows:
        for phase, counts in phases:
            print(f"| {n} | {phase} | " + " | ".join(str(counts.get(k, 0)) for k in KINDS) + f" | {sum(counts.values())} |")


def measure(n: int, bucket: str, proxy: FaultProxy, explain: bool) -> list[tuple[str, Counter[str]]]:
    import torch

    import ravex

    def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n // 2)])
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        m(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    out: list[tuple[str, Counter[str]]] = []
    seen = [0]

    def phase(name: str) -> None:
        new = proxy.requests[seen[0]:]
        seen[0] = len(proxy.requests)
        out.append((name, Counter(kind(m, t) for m, t in new)))
        if explain:
            prefix = f"/{bucket}/requests/{n}/"
            print(f"{name}: " + "; ".join(f"{kind(m, t)} {t.replace(prefix, '').split('&x-id')[0]}" for m, t in new), file=sys.stderr)

    url = f"s3://{bucket}/requests/{n}"
    m, opt = model()
    seen[0] = len(proxy.requests)
    with ravex.Session(path=url, keep_last=None) as s:
        s.track(model=m, optimizer=opt)
        step(m, opt)
        s.commit(s.capture(1), wait=True)
        phase("open + first checkpoint")
        step(m, opt)
        s.commit(s.capture(2), wait=True)
        phase("one more checkpoint")
    phase("close")
    m, opt = model()
    with ravex.Session(path=url, keep_last=None) as s:
        s.track(model=m, optimizer=opt)
        got = s.restore()
        assert got == 2, got
        phase("resume (restore)")
    phase("close after the resume")
    return out


if __name__ == "__main__":
    main()
