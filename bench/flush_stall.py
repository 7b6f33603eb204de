"""Does a cache flush stop other writes on this disk? A diagnostic for the durable path.

    python bench/flush_stall.py [--dir DIR] [--mib 3072] [--rounds 3]

A durable conversion ends in fsync, which on a disk with a volatile write cache
(``/sys/block/*/queue/write_cache`` = ``write back``) sends the device a flush.
Where the device keeps taking writes while it flushes, fsyncing early (every few
hundred MiB) lets the flush of the first part overlap the writing of the rest.
Where it does not, every flush adds its full length to the run, wherever it is
placed, and the durable time cannot drop below "write every byte, then flush
them" however the writes are ordered.

Each round writes ``--mib`` MiB in 1 MiB ``O_DIRECT`` requests (as Ravex's direct
path does) to one file, timing every request, in two ways:

- ``plain``: nothing else happens;
- ``flush``: a second file of 1 GiB, written direct just before and not yet
  flushed, is fdatasynced from another thread once a third of the requests are
  done. The report counts the requests that completed while that flush ran,
  and the longest one.

Needs about ``--mib`` + 1024 MiB free under ``--dir`` (default: this script's
folder); the files are deleted after each round. Uses only the standard
library (no torch, no Ravex). Linux only (``O_DIRECT``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time

STEP = 1 << 20


def open_direct(path: str, mib: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, mib * STEP)  # as Ravex does: direct writes into allocated blocks
    return fd


def write_cache(path: str) -> str:
    """The write-cache mode of the block device holding ``path`` ('?' where sysfs does not say)."""
    dev = os.stat(path).st_dev
    link = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for where in (link, os.path.join(link, "..")):
        try:
            with open(os.path.join(where, "queue", "write_cache")) as f:
                return f.read().strip()
        except OSError:
            continue
    return "?"


def one_round(folder: str, mib: int, with_flush: bool) -> dict[str, float]:
    buf = mmap.mmap(-1, STEP)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(STEP))
    main_path, other_path = os.path.join(folder, "flush_stall.a"), os.path.join(folder, "flush_stall.b")
    fd = open_direct(main_path, mib)
    other = open_direct(other_path, 1024)
    try:
        for i in range(1024):
            os.pwrite(other, buf, i * STEP)
        flush: list[float] = []

        def flusher() -> None:
            start = time.perf_counter()
            os.fdatasync(other)
            flush.extend((start, time.perf_counter()))

        thread = threading.Thread(target=flusher)
        requests: list[tuple[float, float]] = []  # (end time, latency)
        t0 = time.perf_counter()
        for i in range(mib):
            if with_flush and i == mib // 3:
                thread.start()
            start = time.perf_counter()
            os.pwrite(fd, buf, i * STEP)
            end = time.perf_counter()
            requests.append((end, end - start))
        if with_flush:
            thread.join()
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.close(other)
        os.unlink(main_path)
        os.unlink(other_path)
    latencies = [lat for _, lat in requests]
    result = {"wall_s": wall, "rate_gbs": mib * STEP / wall / 1e9,
              "median_ms": statistics.median(latencies) * 1e3, "max_ms": max(latencies) * 1e3}
    if with_flush:
        begin, finish = flush
        result["flush_s"] = finish - begin
        result["during_flush"] = sum(1 for end, _ in requests if begin < end < finish)
        # A request that was waiting all through the flush: its latency against the flush's.
        result["longest_over_flush"] = max(latencies) / (finish - begin)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--mib", type=int, default=3072, help="MiB written per round (default 3072)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.dir}: device write cache '{write_cache(args.dir)}'; {args.mib} MiB in 1 MiB direct requests per round")
    for r in range(1, args.rounds + 1):
        for with_flush in (False, True):
            os.sync()
            time.sleep(1)
            res = one_round(args.dir, args.mib, with_flush)
            line = (f"round {r} {'flush' if with_flush else 'plain'}: {res['wall_s']:.2f} s ({res['rate_gbs']:.2f} GB/s), "
                    f"request median {res['median_ms']:.2f} ms, longest {res['max_ms']:.0f} ms")
            if with_flush:
                line += (f"; flush {res['flush_s']:.2f} s, {res['during_flush']} requests completed during it, "
                         f"the longest request {res['longest_over_flush']:.0%} of the flush")
            print(line, flush=True)


if __name__ == "__main__":
    main()
