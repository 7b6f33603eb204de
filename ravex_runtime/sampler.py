"""Dataset position: which epoch a DataLoader is in and how many batches it has handed out.

At the start of every epoch (``iter(loader)``) the random state that decides
the epoch's order is snapshotted: the global torch generator (the base seed of
the workers and the seed of a RandomSampler without a generator) and the
explicit generators of the loader and its sampler. On resume the snapshot is
put back, the iterator is built again — the same permutation, the same worker
seeds — and the index sampler is advanced past the batches already consumed,
without loading their data. Then the generators are set to their state at the
checkpoint.

What cannot be replayed: an IterableDataset has no index sampler, so its
stream position is not restored (everything else is); random transforms that
run inside worker processes are reseeded with the same seeds but do not
continue mid-stream.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from .state import Snapshot

__all__ = ["LoaderState", "generators_of"]

log = logging.getLogger("ravex")


def generators_of(loader: Any) -> dict[str, torch.Generator]:
    """The explicit generators a loader draws from: its own and its samplers'."""
    out: dict[str, torch.Generator] = {}
    g = getattr(loader, "generator", None)
    if isinstance(g, torch.Generator):
        out["loader"] = g
    sampler = getattr(loader, "sampler", None)
    g = getattr(sampler, "generator", None)
    if isinstance(g, torch.Generator):
        out["sampler"] = g
    bs = getattr(loader, "batch_sampler", None)
    g = getattr(getattr(bs, "sampler", None), "generator", None)
    if isinstance(g, torch.Generator) and "sampler" not in out:
        out["batch_sampler"] = g
    return out


class _SkipFirst:
    """Wraps an index sampler: its first iteration skips ``skip`` items; later ones pass through."""

    def __init__(self, inner: Any, skip: int):
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[Any]:
        # Lazy like the sampler itself: the permutation is drawn at the first next(), as without Ravex.
        # The skip belongs to the first iterator that is advanced (the multi-process DataLoader
        # iterator calls iter() twice and uses the second).
        it = iter(self.inner)
        if self.skip:
            n, self.skip = self.skip, 0
            for _ in itertools.islice(it, n):
                pass
        yield from it

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class LoaderState:
    """One DataLoader's position, kept by the runtime."""

    def __init__(self, loader: Any, index: int):
        self.index = index
        self.epoch = -1
        self.consumed = 0
        self.epoch_start: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Any] | None = None  # saved position to apply at the next iter()
        # An IterableDataset has no index sampler to advance; one with its own state_dict() is
        # restored when tracked (ravex.track(dataset)), not by skipping.
        self.replayable = not isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        self.warned = False

    def length(self, loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def start_epoch(self, loader: Any) -> None:
        self.epoch += 1
        self.consumed = 0
        self.epoch_start = {"torch": torch.get_rng_state()}
        for k, g in generators_of(loader).items():
            self.epoch_start[k] = g.get_state()

    def capture(self, snap: Snapshot, loader: Any) -> dict[str, Any]:
        key = f"loaders/{self.index}"
        out: dict[str, Any] = {"epoch": self.epoch, "consumed": self.consumed, "length": self.length(loader), "replayable": self.replayable,
                               "epoch_start": {k: snap.add(f"obj/{key}/epoch_start/{k}", v) for k, v in self.epoch_start.items()},
                               "generators": {k: snap.add(f"obj/{key}/generators/{k}", g.get_state()) for k, g in generators_of(loader).items()}}
        return out

    def make_iter(self, loader: Any, original: Any, current_rng: torch.Tensor) -> Any:
        """``iter(loader)`` through ``original``, continuing a saved position when one is pending."""
        saved, self.pending = self.pending, None
        if saved is None:
            self.start_epoch(loader)
            return original(loader)
        length = saved.get("length")
        consumed = int(saved.get("consumed") or 0)
        gens = generators_of(loader)
        if not saved.get("replayable", True) or not self.replayable:
            log.warning("ravex: the DataLoader over %s has no index sampler (IterableDataset); its stream position cannot be replayed "
                        "and it starts from the beginning. Everything else was restored.", type(loader.dataset).__name__)
            self.epoch = int(saved.get("epoch", 0))
            self.start_epoch(loader)
            return original(loader)
        if length is not None and consumed >= length:
            # The epoch was finished: the next one starts from the current state.
            self.epoch = int(saved["epoch"])
            self.start_epoch(loader)
            return original(loader)
        self.epoch = int(saved["epoch"])
        self.consumed = consumed
        starts = saved.get("epoch_start") or {}
        self.epoch_start = {k: v.clone() for k, v in starts.items()}
        if "torch" in starts:
            torch.set_rng_state(starts["torch"])
        for k, g in gens.items():
            if k in starts:
                g.set_state(starts[k])
        attr = "batch_sampler" if getattr(loader, "_auto_collation", True) and getattr(loader, "batch_sampler", None) is not None else "sampler"
        inner = getattr(loader, attr)
        # DataLoader refuses to have its sampler set after construction; this is temporary and undone below.
        object.__setattr__(loader, attr, _SkipFirst(inner, consumed))
        try:
            it = original(loader)
            if loader.num_workers == 0 and consumed:
                # The single-process iterator draws the permutation lazily; draw it now, as the
                # first batch of the uninterrupted epoch did, before the checkpoint's state is put back.
                first = next(it._sampler_iter, None)
                if first is not None:
                    it._sampler_iter = itertools.chain([first], it._sampler_iter)
        finally:
            object.__setattr__(loader, attr, inner)
        torch.set_rng_state(current_rng)
        saved_gens = saved.get("generators") or {}
        for k, g in gens.items():
            if k in saved_gens:
                g.set_state(saved_gens[k])
        return it
