"""Dataset position: which epoch a DataLoader is in and how many batches it has handed out.

At the start of every epoch (``iter(loader)``) the random state that decides
the epoch's order is snapshotted: the global torch generator (the base seed of
the workers and the seed of a RandomSampler without a generator) and the
explicit generators of the loader and its sampler. On resume the snapshot is
put back and the iterator is built again — the same permutation, the same
worker seeds — and then the consumed batches are passed over:

- loading in this process (``num_workers=0``): the index sampler is advanced
  past them without loading their data (what ``__getitem__`` drew came from the
  main process's generators, which the checkpoint restores);
- loading in workers: they are loaded again and dropped (a *replay*), so each
  worker's generators, and anything else it keeps, are where they were in the
  uninterrupted run; persistent workers also get back the streams they carried
  over from earlier epochs (workers.py);
- an IterableDataset with ``state_dict()`` read in this process continues from
  its saved state; any other IterableDataset is replayed.

Then the generators are set to their state at the checkpoint.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ravex_convert.model import TensorLink

from ._passthrough import Passthrough
from .workers import ResumeInit, StampCollate, Stamped, rng_objects

__all__ = ["LoaderState", "SnapshotLike", "generators_of", "host_rng", "set_host_rng", "snap_host_rng", "unrestorable_generators", "unstamped"]

log = logging.getLogger("ravex")


class SnapshotLike(Protocol):
    """What a loader's position is copied into: :class:`ravex_runtime.state.Snapshot`, named by the
    two methods used here, so that this module does not import the capture code (which imports it)."""

    def add(self, name: str, t: torch.Tensor) -> TensorLink: ...

    def flatten(self, value: Any, prefix: str) -> Any: ...


# A sampler's own attributes that lead to the data, not to how it draws.
_NOT_THE_SAMPLERS = ("data_source", "dataset")
# How deep in a sampler's attributes its generators are looked for.
_SAMPLER_DEPTH = 4


def host_rng() -> dict[str, Any]:
    """The Python, NumPy and torch CPU generator states now, as they are (not copied into a snapshot)."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state(legacy=True)
    except ImportError:
        pass
    return out


def snap_host_rng(snap: SnapshotLike, key: str, host: dict[str, Any]) -> dict[str, Any]:
    """What :func:`host_rng` took, copied into ``snap`` under ``obj/<key>/...``."""
    out: dict[str, Any] = {"python": host["python"], "torch": snap.add(f"obj/{key}/torch", host["torch"])}
    if "numpy" in host:
        out["numpy"] = snap.flatten(host["numpy"], f"{key}/numpy")
    return out


def set_host_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`host_rng` took (or a checkpoint's copy of it)."""
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))


def _samplers(loader: Any) -> list[tuple[str, Any]]:
    out = [("sampler", getattr(loader, "sampler", None)), ("batch_sampler", getattr(loader, "batch_sampler", None))]
    return [(k, s) for k, s in out if s is not None]


def generators_of(loader: Any) -> dict[str, torch.Generator]:
    """The explicit generators a loader draws from: its own and its samplers' — also a
    user-written sampler's, whatever attribute holds it."""
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
    known = {id(g) for g in out.values()}
    for where, s in _samplers(loader):
        for path, obj in rng_objects(s, _NOT_THE_SAMPLERS, _SAMPLER_DEPTH).items():
            if isinstance(obj, torch.Generator) and id(obj) not in known:
                known.add(id(obj))
                out[f"{where}.{path}"] = obj
    return out


def unrestorable_generators(loader: Any) -> list[str]:
    """Generators of other kinds a sampler holds (NumPy, Python ``random``): the order they
    draw cannot be put back at the start of the epoch."""
    return [f"{type(s).__name__}.{path} ({type(obj).__module__}.{type(obj).__name__})"
            for _, s in _samplers(loader) for path, obj in rng_objects(s, _NOT_THE_SAMPLERS, _SAMPLER_DEPTH).items() if not isinstance(obj, torch.Generator)]


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


def _sampler_of(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    bs = getattr(loader, "batch_sampler", None)
    inner = getattr(bs, "sampler", None)
    # a batch_sampler= of the user's wraps the sampler that draws; DataLoader's own wraps loader.sampler
    return inner if inner is not None and inner is not sampler and hasattr(inner, "set_epoch") else sampler


def _epoch_of(sampler: Any) -> int | None:
    """The epoch of a sampler that is told it (DistributedSampler.set_epoch), else None."""
    e = getattr(sampler, "epoch", None)
    return e if hasattr(sampler, "set_epoch") and isinstance(e, int) and not isinstance(e, bool) else None


def _shifted_set_epoch(set_epoch: Any, shift: int, epoch: int) -> None:
    set_epoch(epoch + shift)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _distributed_sampler(sampler: Any) -> bool:
    """A DistributedSampler that deals its order out as DistributedSampler does (a subclass with its own
    ``__iter__``, e.g. one that groups by length, does not: its position is carried per rank)."""
    ds = torch.utils.data.distributed.DistributedSampler
    return isinstance(sampler, ds) and type(sampler).__iter__ is ds.__iter__


def _epoch_order(sampler: Any, n: int) -> list[int]:
    """The order a DistributedSampler deals out this epoch, before padding (as its ``__iter__`` draws it)."""
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        return torch.randperm(n, generator=g).tolist()
    return list(range(n))


class _Fixed:
    """A sampler over a fixed list of indices."""

    def __init__(self, indices: list[int]):
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _FirstOnly:
    """Wraps an index sampler: its first iteration is ``part``'s; later ones the sampler's own."""

    def __init__(self, inner: Any, part: Any):
        self.inner, self.part = inner, part

    def __iter__(self) -> Iterator[Any]:
        # Lazy, as _SkipFirst: the part belongs to the first iterator that is advanced.
        part, self.part = self.part, None
        if part is None:
            yield from self.inner
            return
        yield from part

    def __len__(self) -> int:
        return len(self.part if self.part is not None else self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _StartAt:
    """Wraps an index sampler: its first iteration starts from ``states`` (the random
    state at the start of the epoch); later ones pass through. For a resumed
    persistent iterator, whose base seed is drawn first from another state."""

    def __init__(self, inner: Any, loader: Any, states: dict[str, torch.Tensor]):
        self.inner, self.loader, self.states = inner, loader, states

    def __iter__(self) -> Iterator[Any]:
        states, self.states = self.states, {}
        if states:
            _set_rng(self.loader, states)
        yield from self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _set_rng(loader: Any, states: dict[str, torch.Tensor]) -> None:
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    for k, g in generators_of(loader).items():
        if k in states:
            g.set_state(states[k])


class _Unstamp(Passthrough):
    """The iterator of a loader with persistent workers: hands out each batch
    without the worker state it carries, and keeps that state."""

    def __init__(self, inner: Any, last: dict[int, dict[str, Any]]):
        super().__init__(inner)
        self._last = last  # worker id -> its states after its latest batch

    def __next__(self) -> Any:
        batch = next(self._inner)
        if isinstance(batch, Stamped):
            self._last[batch.worker] = batch.states
            return batch.batch
        return batch


def unstamped(loader: Any, it: Any) -> Any:
    """``it`` without worker states, for a loader whose persistent workers stamp batches
    (used where Ravex has switched itself off: the batches must still be the user's)."""
    return _Unstamp(it, {}) if getattr(loader, "_ravex_stamps", False) else it


def identity(loader: Any) -> str:
    """What tells a DataLoader from the others of a run, the same in the run that resumes it: its
    dataset's class and length, batch size, sampler class and ``drop_last``. A resumed run may
    build its loaders in another order (Lightning under DDP builds its own validation loader for
    the sanity check, which a restored fit loop skips): a saved position goes to the loader of the
    same identity, not to the one built at the same place in the order."""
    ds = getattr(loader, "dataset", None)
    try:
        n: int | None = len(ds)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a dataset without a length (an IterableDataset), or one whose __len__ fails
        n = None
    sampler = _sampler_of(loader)
    return (f"{type(ds).__module__}.{type(ds).__qualname__}|{n}|{getattr(loader, 'batch_size', None)}|"
            f"{type(sampler).__module__}.{type(sampler).__qualname__}|{getattr(loader, 'drop_last', None)}")


class LoaderState:
    """One DataLoader's position, kept by the runtime."""

    def __init__(self, loader: Any, index: int):
        self.index = index
        self.identity = identity(loader)  # made before any sampler of Ravex's can wrap the loader's
        self.epoch = -1
        self.consumed = 0
        self.epoch_start: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Any] | None = None  # saved position to apply at the next iter()
        # An IterableDataset has no index sampler to advance: one with its own state_dict() read in
        # this process is saved with the position; any other is replayed from the epoch's start.
        self.replayable = not isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        odd = unrestorable_generators(loader)
        if odd:
            log.warning("ravex: the DataLoader's sampler draws from %s; Ravex restores torch.Generator objects only, so after a resume "
                        "this sampler's order will differ from the uninterrupted run. Hold a torch.Generator instead, or track the "
                        "sampler (ravex.track(sampler), with state_dict/load_state_dict)", ", ".join(odd))
        # Persistent workers: the random state their iterator's base seed was drawn from, and each
        # worker's generator states after its latest batch and at the start of this epoch.
        self.persistent = bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "num_workers", 0) > 0
        self.base_start: dict[str, torch.Tensor] | None = None
        self.base_epoch = -1
        self.worker_last: dict[int, dict[str, Any]] = {}
        self.worker_start: dict[int, dict[str, Any]] = {}
        # A DistributedSampler's epoch resumed at another world size: the samples of the epoch
        # consumed before this process's part of it began (all ranks together); 0 otherwise.
        self.offset = 0
        # Read ahead by a framework's wrapper (Accelerate's DataLoaderShard fetches batch k+1 before
        # it hands out batch k): the wrapper counts what the user consumed (frameworks/), and this
        # keeps the host random state from before each batch fetched and not handed out yet, so a
        # resume fetches those batches again under the same states (patches.py).
        self.driven = False
        self.held: deque[dict[str, Any]] = deque()
        self.refetch: list[dict[str, Any]] = []
        self.wrapper: Any = None  # a weak reference to the wrapper, whose epoch counter is saved too
        self.framework_epochs = False  # set_epoch() is called with the true epoch (runtime.Runtime.framework_epochs)
        # Under the decorator (``watched``): whether an optimizer step has followed one of its batches
        # (runtime.Runtime.boundary); a loader iterated through Session.iterate is a training one.
        self.watched = False
        self.trains = False

    def length(self, loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def start_epoch(self, loader: Any) -> None:
        self.epoch += 1
        self.consumed = 0
        self.offset = 0
        self.held.clear()
        self.epoch_start = {"torch": torch.get_rng_state()}
        for k, g in generators_of(loader).items():
            self.epoch_start[k] = g.get_state()
        if self.persistent:
            self.worker_start = dict(self.worker_last)

    def capture(self, snap: SnapshotLike, loader: Any, key: str | None = None) -> dict[str, Any]:
        key = key or f"loaders/{self.index}"
        out: dict[str, Any] = {"identity": self.identity, "epoch": self.epoch, "consumed": self.consumed, "length": self.length(loader),
                               "replayable": self.replayable,
                               **({"trains": self.trains} if self.watched else {}),
                               "epoch_start": {k: snap.add(f"obj/{key}/epoch_start/{k}", v) for k, v in self.epoch_start.items()},
                               "generators": {k: snap.add(f"obj/{key}/generators/{k}", g.get_state()) for k, g in generators_of(loader).items()}}
        ds = getattr(loader, "dataset", None)
        if ds is not None and not self.replayable and loader.num_workers == 0 and _stateful(ds):
            out["dataset_state"] = snap.flatten(ds.state_dict(), f"{key}/dataset")
        sampler = _sampler_of(loader)
        epoch = _epoch_of(sampler)
        if epoch is not None:
            out["sampler_epoch"] = epoch
        if _distributed_sampler(sampler) and isinstance(getattr(loader, "batch_size", None), int):
            # What a resume at another world size needs to keep the epoch's global sample count.
            out["distributed_sampler"] = {"num_replicas": int(sampler.num_replicas), "rank": int(sampler.rank),
                                          "batch_size": int(loader.batch_size), "offset": self.offset, "dataset_len": len(sampler.dataset)}
        if self.driven:
            out["held"] = [snap_host_rng(snap, f"{key}/held/{i}", h) for i, h in enumerate(self.held)]
            epoch = getattr(self.wrapper() if self.wrapper is not None else None, "iteration", None)
            if isinstance(epoch, int):
                out["wrapper_epoch"] = epoch
        if self.persistent and self.base_start is not None:
            out["persistent"] = {
                "base_epoch": self.base_epoch,
                "base_start": {k: snap.add(f"obj/{key}/base_start/{k}", v) for k, v in self.base_start.items()},
                "start": {str(w): s for w, s in self.worker_start.items()},
                "last": {str(w): s for w, s in self.worker_last.items()},
            }
        return out

    def _shift_epoch(self, loader: Any, saved: dict[str, Any] | None) -> None:
        """Keep a DistributedSampler on the true epoch: the script's own epoch loop starts
        from 0 again after a resume, and so does what it passes to set_epoch()."""
        sampler = _sampler_of(loader)
        now = _epoch_of(sampler)
        if now is None or saved is None or not isinstance(saved.get("sampler_epoch"), int):
            return
        true_epoch = int(saved["sampler_epoch"])
        sampler.set_epoch(true_epoch)
        if true_epoch != now and not self.framework_epochs:
            # every later set_epoch(n) of the script's loop means n plus the epochs it did not run again
            sampler.set_epoch = functools.partial(_shifted_set_epoch, type(sampler).set_epoch.__get__(sampler), true_epoch - now)

    def _build(self, loader: Any, original: Any, init: dict[int, dict[str, Any]] | None = None) -> Any:
        """``original(loader)``; for persistent workers made here, with their batches stamped."""
        if not self.persistent:
            return original(loader)
        if getattr(loader, "_iterator", None) is None:
            if self.base_start is None:
                self.base_start, self.base_epoch = dict(self.epoch_start), self.epoch
            collate, worker_init = loader.collate_fn, loader.worker_init_fn
            loader.collate_fn = StampCollate(collate)
            if init:
                loader.worker_init_fn = ResumeInit(worker_init, init)
            try:
                it = original(loader)
            finally:
                loader.collate_fn, loader.worker_init_fn = collate, worker_init
            object.__setattr__(loader, "_ravex_stamps", True)
        else:
            it = original(loader)
        return _Unstamp(it, self.worker_last)

    def make_iter(self, loader: Any, original: Any, current_rng: torch.Tensor) -> Any:
        """``iter(loader)`` through ``original``, continuing a saved position when one is pending."""
        saved, self.pending = self.pending, None
        if not (self.driven and saved is not None and "wrapper_epoch" in saved):
            self._shift_epoch(loader, saved)  # a wrapper that counts epochs itself has had its count put back
        if saved is None:
            self.start_epoch(loader)
            return self._build(loader, original)
        length = saved.get("length")
        consumed = int(saved.get("consumed") or 0)
        gens = generators_of(loader)
        if not self.replayable and loader.num_workers == 0 and _stateful(loader.dataset) and "dataset_state" in saved:
            # An IterableDataset with its own state_dict(), read in this process: it continues from it.
            loader.dataset.load_state_dict(saved["dataset_state"])
            self.epoch, self.consumed = int(saved["epoch"]), consumed
            self.epoch_start = {k: v.clone() for k, v in (saved.get("epoch_start") or {}).items()}
            return original(loader)
        persistent = saved.get("persistent") if self.persistent else None
        if persistent is not None:
            self.worker_last = {int(w): s for w, s in (persistent.get("last") or {}).items()}
        # An evaluation's loader (no optimizer step followed its batches) is iterated afresh each time
        # it is used, however far its last iteration went: its next epoch starts now, as in the run saved.
        finished = (length is not None and consumed >= length) or saved.get("trains") is False
        if finished:
            # The epoch was finished: the next one starts from the current state.
            self.epoch = int(saved["epoch"])
            self.start_epoch(loader)
            if persistent is None:
                return self._build(loader, original)
            starts, consumed = self.epoch_start, 0
        else:
            self.epoch = int(saved["epoch"])
            self.consumed = consumed
            if self.driven:
                self.refetch = list(saved.get("held") or [])
            starts = {k: v.clone() for k, v in (saved.get("epoch_start") or {}).items()}
            self.epoch_start = starts
            if persistent is not None:
                self.worker_start = {int(w): s for w, s in (persistent.get("start") or {}).items()}
        if not self.replayable and consumed:
            why = "read in worker processes, whose copies' state the main process never sees" if _stateful(loader.dataset) else "without state_dict()"
            log.warning("ravex: the DataLoader over %s (an IterableDataset %s) has no index sampler to advance; "
                        "the %d batches of this epoch already trained on are read again and dropped, so the stream continues where "
                        "it was if it yields the same items each time it is iterated", type(loader.dataset).__name__, why, consumed)
        dsamp = saved.get("distributed_sampler")
        sampler = _sampler_of(loader)
        if isinstance(dsamp, dict) and _distributed_sampler(sampler) and (dsamp.get("offset") or dsamp.get("num_replicas") != sampler.num_replicas):
            # Another world size (or the rest of an epoch that was resumed at one): deal the epoch's
            # remaining samples out again (no sample twice, none skipped).
            it = self._regroup(loader, original, sampler, dsamp, consumed)
        elif loader.num_workers == 0 and self.replayable:
            it = self._skip(loader, original, starts, consumed)
        else:
            it = self._replay(loader, original, starts, consumed, persistent)
        torch.set_rng_state(current_rng)
        saved_gens = saved.get("generators") or {}
        for k, g in gens.items():
            if k in saved_gens:
                g.set_state(saved_gens[k])
        return it

    def _regroup(self, loader: Any, original: Any, sampler: Any, saved: dict[str, Any], consumed: int) -> Any:
        """The rest of a DistributedSampler's epoch at this world size: the samples the old ranks
        consumed together are the first ``offset + consumed x batch x old world size`` of the
        epoch's order (a DistributedSampler deals the order out round-robin); the rest is dealt
        round-robin to the ranks now, padded as DistributedSampler pads (with the epoch's first
        samples), so no sample of the epoch is seen twice or skipped, and a later resume of this
        part at the same world size continues it exactly."""
        n = len(sampler.dataset)
        done = int(saved.get("offset") or 0) + consumed * int(saved.get("batch_size") or 0) * int(saved.get("num_replicas") or 0)
        if n != saved.get("dataset_len"):
            log.warning("ravex: the dataset has %d samples, the checkpoint's had %s; the epoch's position cannot be carried to the new "
                        "world size exactly", n, saved.get("dataset_len"))
        order = _epoch_order(sampler, n)
        rest = order[min(done, n):]
        m, r = int(sampler.num_replicas), int(sampler.rank)
        if sampler.drop_last:
            rest = rest[:len(rest) - len(rest) % m]
        elif len(rest) % m:
            pad = m - len(rest) % m
            rest = rest + (order * (1 + pad // max(1, n)))[:pad]
        mine = rest[r::m]
        self.offset, self.consumed = min(done, n), 0
        log.warning("ravex: DataLoader #%d resumes its epoch at world size %d (saved at %s): %d samples of the epoch were trained on, "
                    "the other %d are dealt out to the %d ranks (this rank: %d)", self.index, m, saved.get("num_replicas"),
                    self.offset, n - self.offset, m, len(mine))
        attr = "batch_sampler" if getattr(loader, "_auto_collation", True) and getattr(loader, "batch_sampler", None) is not None else "sampler"
        inner = getattr(loader, attr)
        part: Any = _Fixed(mine)
        if attr == "batch_sampler":
            part = torch.utils.data.BatchSampler(part, loader.batch_size, loader.drop_last)
        object.__setattr__(loader, attr, _FirstOnly(inner, part))
        try:
            return self._build(loader, original)
        finally:
            object.__setattr__(loader, attr, inner)

    def _skip(self, loader: Any, original: Any, starts: dict[str, torch.Tensor], consumed: int) -> Any:
        """In-process loading draws from the main process's generators, which the checkpoint
        restores: the index sampler is advanced past the consumed batches without loading them."""
        _set_rng(loader, starts)
        attr = "batch_sampler" if getattr(loader, "_auto_collation", True) and getattr(loader, "batch_sampler", None) is not None else "sampler"
        inner = getattr(loader, attr)
        # DataLoader refuses to have its sampler set after construction; this is temporary and undone below.
        object.__setattr__(loader, attr, _SkipFirst(inner, consumed))
        try:
            it = original(loader)
            if consumed:
                # The single-process iterator draws the permutation lazily; draw it now, as the
                # first batch of the uninterrupted epoch did, before the checkpoint's state is put back.
                first = next(it._sampler_iter, None)
                if first is not None:
                    it._sampler_iter = itertools.chain([first], it._sampler_iter)
        finally:
            object.__setattr__(loader, attr, inner)
        return it

    def _replay(self, loader: Any, original: Any, starts: dict[str, torch.Tensor], consumed: int, persistent: dict[str, Any] | None) -> Any:
        """Workers draw from their own generators, seeded from the iterator's base seed and
        changed by every item they load: the epoch is rebuilt from its starting state (same
        base seed, same order) and the consumed batches are loaded again and dropped, so each
        worker is where it was in the uninterrupted run (workers.py)."""
        if persistent is not None and getattr(loader, "_iterator", None) is None:
            # The base seed was drawn when the persistent iterator was first made, perhaps epochs ago.
            base = persistent.get("base_start") or starts
            self.base_start, self.base_epoch = dict(base), int(persistent.get("base_epoch", self.epoch))
            _set_rng(loader, base)
            if self.base_epoch != self.epoch:
                attr = "batch_sampler" if getattr(loader, "_auto_collation", True) and getattr(loader, "batch_sampler", None) is not None else "sampler"
                inner = getattr(loader, attr)
                object.__setattr__(loader, attr, _StartAt(inner, loader, starts))
                try:
                    it = self._build(loader, original, self.worker_start)
                finally:
                    object.__setattr__(loader, attr, inner)
            else:
                it = self._build(loader, original, self.worker_start)
        else:
            _set_rng(loader, starts)
            it = self._build(loader, original)
        for done in range(consumed):
            try:
                next(it)
            except StopIteration:
                log.warning("ravex: the DataLoader ran out after %d of the %d batches its checkpoint had consumed; "
                            "the dataset is not the one the run was saved with", done, consumed)
                break
        return it
