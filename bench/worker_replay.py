"""What a mid-epoch resume costs when the DataLoader has workers.

Ravex replays the consumed part of the epoch in the workers (ravex_runtime/workers.py):
the batches already trained on are loaded again and dropped, so each worker's random
streams continue exactly. This times that replay on an epoch of 10,000 augmented items
(a random crop and flip of a 3x32x32 image, drawn in the workers), resumed at its middle,
against starting the epoch fresh (the time to the first batch) and against loading the
whole epoch once. No training: only the data path is timed.

    ~/.cache/ravex/venv/bin/python bench/worker_replay.py [--items 10000] [--workers 2] [--batch 32]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ravex_runtime.sampler import LoaderState


class Crops(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int):
        self.images = torch.randn(n, 3, 40, 40, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        top, left = random.randrange(9), int(np.random.randint(9))
        img = self.images[i, :, top:top + 32, left:left + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(2)
        return img.contiguous(), i


def _first(it: Any) -> float:
    t = time.perf_counter()
    next(it)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loader = DataLoader(Crops(args.items), batch_size=args.batch, shuffle=True, num_workers=args.workers)
    original = DataLoader.__iter__
    n = len(loader)
    half = n // 2
    rows = []
    for _ in range(args.repeat):
        start = torch.get_rng_state()
        t0 = time.perf_counter()
        it = iter(loader)
        fresh_first = time.perf_counter() - t0 + _first(it)
        t0 = time.perf_counter()
        for _ in it:
            pass
        whole = time.perf_counter() - t0 + fresh_first
        st = LoaderState(loader, 0)
        st.pending = {"epoch": 0, "consumed": half, "length": n, "replayable": True, "epoch_start": {"torch": start}, "generators": {}}
        t0 = time.perf_counter()
        it = st.make_iter(loader, original, torch.get_rng_state())
        resumed_first = time.perf_counter() - t0 + _first(it)
        del it
        rows.append((fresh_first, resumed_first, whole))
    print(f"{args.items} items, batch {args.batch}, {args.workers} workers, resumed after {half} of {n} batches; best of {args.repeat}")
    fresh, resumed, whole = (min(r[i] for r in rows) for i in range(3))
    print(f"  fresh epoch, time to the first batch:   {fresh:7.3f} s")
    print(f"  resumed mid-epoch, to the next batch:   {resumed:7.3f} s  ({resumed / fresh:.1f}x a fresh start)")
    print(f"  loading the whole epoch once:           {whole:7.3f} s  (the replay is {resumed / whole:.2f} of it)")


if __name__ == "__main__":
    main()
