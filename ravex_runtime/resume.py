"""Which checkpoint a resume puts in: the one the configuration names, else the newest complete
one of the store, falling back to older ones.

:class:`Resume` finds the checkpoint (``resume_from``: an index of the store, a
store, a checkpoint directory, a ``.pt`` file, or another program's checkpoint,
foreign.py), loads it with its checksums verified, and restores it through
checking.py and restoring.py. A checkpoint that is damaged or does not fit the
live objects is reported and the one before it tried; when none is left,
:class:`~ravex_runtime.errors.ResumeError`. On many ranks the choice is agreed
(:meth:`Resume.restore_agreed`): rank 0 names it, every rank checks it, and it
is put in only where all can take it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import RavexError
from ravex_convert.formats.native import reader as native
from ravex_convert.model import Checkpoint
from ravex_convert.objects import INITIALISED_FROM
from ravex_convert.storage import resolve

from .checking import SAME_RUN, Plan, plan
from .dist import Coord
from .errors import ResumeError
from .foreign import ORIGIN_KEY, Adapted, Foreign, adapt, is_foreign, open_foreign, open_init
from .loading import is_lazy, load_checkpoint, load_torch_save, read_for, torch_save_files
from .restoring import apply_plan, for_rank, restore_into
from .state import Tracked

__all__ = ["Resume"]

log = logging.getLogger("ravex")


_Found = tuple[Checkpoint, dict[str, torch.Tensor]]
_SAME_RUN_HINT = "resume with the model, optimizer and schedulers built as the checkpointed run built them"


class Resume:
    """Which checkpoint of a store a resume puts in, and the older ones it falls back on.

    ``pending`` is the one loaded (checksums verified) and not yet restored; ``index`` and
    ``label`` name the one being tried (``index`` is None for a checkpoint that is not one of
    this store's); ``unrestorable`` lists this store's checkpoints that were skipped, damaged or
    not fitting the live objects (while any is, keep_last prunes nothing), and ``failures`` why
    each checkpoint tried was skipped, for the error when none is left.
    """

    def __init__(self, store: Path, backend: str, source: str):
        self.store, self.backend, self.source = store, backend, source  # source: the configuration's, for hints
        self.pending: _Found | None = None
        self.index: int | None = None
        self.label = ""
        self.unrestorable: list[int] = []
        self.failures: list[str] = []
        self._candidates: Iterator[tuple[int | None, str, _Found]] = iter(())
        # resume_from names a checkpoint another program wrote: read into the live layout at restore
        self.foreign: Foreign | None = None
        # where the run came from, when it began from a foreign checkpoint (kept in every checkpoint it writes)
        self.origin: dict[str, Any] | None = None
        # init_from: a new run's model starts from this checkpoint's weights (when the store holds none of its own);
        # ``init`` says the pending foreign checkpoint is that start, ``init_origin`` where the run's weights began
        self.init_from: str | None = None
        self.init = False
        self.init_origin: dict[str, Any] | None = None
        self.share: tuple[int, int] | None = None  # (rank, world size): the checksums this rank checks, of a foreign one
        # a rank of a job on many ranks: a native checkpoint's tensors are read when the live objects
        # exist, each rank its own rows of the sharded ones (loading.read_for), not whole at the start
        self.lazy = False
        self.bytes_read: int | None = None  # of the checkpoint restored, what this rank read (lazy and foreign ones)

    def restore(self, live: Tracked, rank: int | None = None) -> int | None:
        """Put ``pending`` into ``live``, all or nothing; one that does not fit is reported and the one
        before it tried. The step restored, or None when nothing is pending; :class:`ResumeError` when
        none is left to try, or a failed restore could not be undone. ``rank``: a rank of a job that
        has no process group (each rank restores alone, taking its own streams)."""
        while self.pending is not None:
            ckpt, tensors = self.pending
            try:
                if self.foreign is not None:
                    fitted = adapt(self.foreign, live, rank or 0, weights_only=self.init)
                    ckpt, tensors = fitted.ckpt, fitted.tensors
                    p = plan(live, ckpt, tensors, bool(ckpt.source.get("weights_only")), self.label)
                    fitted.fill()
                    self.bytes_read = fitted.bytes_read
                    step = apply_plan(p, self.label, undo=False)
                else:
                    if rank is not None:
                        ckpt = for_rank(ckpt, rank, None)
                    if is_lazy(ckpt, tensors):
                        tensors, self.bytes_read = read_for(ckpt, live)
                    step = restore_into(live, ckpt, tensors, weights_only=False, where=self.label)
            except ResumeError:
                raise
            except Exception as exc:  # whatever the reason, nothing was restored: try the one before (foreign: stop)
                why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
                if self.foreign is not None:
                    raise self._foreign_failed(why, exc) from exc
                log.error("ravex: %s cannot be restored into this run: %s", self.label, why)
                self.skipped(self.store, self.index, why if why.startswith(self.label) else f"{self.label}: {why}")
                self.pending = None
                del ckpt, tensors
                self.pending = self._next()
                continue
            self.pending = None  # restored: its tensors are no longer needed
            self._restored(ckpt)
            if self.unrestorable:
                log.warning("ravex: resumed from %s, not from the newest checkpoint: %s could not be used (see above)", self.label,
                            ", ".join(str(i) for i in self.unrestorable))
            return step if step is not None else int(ckpt.step or 0)
        return None

    def restore_agreed(self, live: Tracked, coord: Coord, src: str | int | None, shared: bool = True) -> int | None:
        """:meth:`restore` on every rank of a job, agreed: rank 0 names the checkpoint; a rank that
        does not see it (its store is not rank 0's) gets it from rank 0; each rank takes its own
        random streams and data position from it and checks it against its live objects; it is
        put in only when every rank can, else every rank goes on to the one rank 0 tries next."""
        while True:
            named = coord.broadcast((self.index, self.label, self.pending[0].step) if coord.rank == 0 and self.pending is not None else None)
            if named is None:
                if self.pending is not None:
                    log.warning("ravex: rank %d has %s, but rank 0 resumes from nothing: this rank starts fresh too", coord.rank, self.label)
                self.pending = None
                return None
            index, label, step = named
            if coord.rank != 0 and not shared and self.foreign is None:
                # A store of its own (another machine): a checkpoint there with the same index may be
                # another run's; the state comes from rank 0's.
                self.pending = None
            elif coord.rank != 0 and (self.pending is None or self.index != index or self.pending[0].step != step):
                self.pending = None
                try:
                    self.pending = (load_checkpoint(self.store, index, lazy=self.lazy) if index is not None else self.find(src))
                except Exception:  # noqa: BLE001 - whatever it is, this rank gets it from rank 0 below
                    self.pending = None
                if self.pending is not None and self.pending[0].step != step:
                    self.pending = None
            have = coord.all_gather(self.pending is not None)
            if not all(have) and self.foreign is not None:
                raise ResumeError(f"{label}: rank(s) {[r for r, h in enumerate(have) if not h]} cannot read it",
                                  hint="put the checkpoint resume_from names where every rank reads it (the same path on each machine)")
            if not all(have):
                # Storage that not every rank sees: rank 0 sends what it loaded.
                ours = self.pending if coord.rank == 0 else None
                if ours is not None and is_lazy(*ours):
                    ours = (ours[0], read_for(ours[0], Tracked())[0])  # whole: the other ranks cannot read it
                sent = coord.broadcast((ours[0].step, ours[0].objects, ours[0].source, ours[1]) if ours is not None else None)
                if self.pending is None:
                    ckpt = Checkpoint("native", self.store, step=sent[0], objects=sent[1], source=sent[2])
                    self.pending = (ckpt, sent[3])
            self.index, self.label = index, label
            assert self.pending is not None
            ckpt, tensors = self.pending
            mine = ckpt
            err: str | None = None
            p: Plan | None = None
            fitted: Adapted | None = None
            try:
                if self.foreign is not None:
                    fitted = adapt(self.foreign, live, coord.rank, weights_only=self.init)
                    mine, tensors = fitted.ckpt, fitted.tensors
                else:
                    mine = for_rank(ckpt, coord.rank, coord.size)
                    if is_lazy(mine, tensors):
                        tensors, self.bytes_read = read_for(mine, live)  # this rank's rows of the sharded tensors
                p = plan(live, mine, tensors, bool(mine.source.get("weights_only")), label)
            except Exception as exc:  # noqa: BLE001 - reported to every rank: nobody restores it
                err = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
            errs = coord.all_gather(err)
            bad = [(r, e) for r, e in enumerate(errs) if e is not None]
            if not bad:
                assert p is not None
                failure: str | None = None
                try:
                    if fitted is not None:
                        fitted.fill()
                        self.bytes_read = fitted.bytes_read
                    restored = apply_plan(p, label, undo=fitted is None)
                except Exception as exc:  # noqa: BLE001 - told to every rank below
                    failure = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
                failures = [(r, f) for r, f in enumerate(coord.all_gather(failure)) if f is not None]
                if failures:
                    # Some rank holds the checkpoint and another does not: no rank may train on.
                    raise ResumeError(f"{label}: restoring failed on rank {failures[0][0]} ({failures[0][1]}); the ranks no longer "
                                      "hold one state, so the run stops before its first step",
                                      hint="start the job again; if it fails the same way, " + SAME_RUN, path=self.store)
                self.pending = None
                self._restored(mine)
                return restored if restored is not None else int(mine.step or 0)
            why = "; ".join(f"rank {r}: {e}" for r, e in bad[:3])
            if self.foreign is not None:
                same = len({e for _, e in bad}) == 1
                raise self._foreign_failed(bad[0][1] if same else why, None)
            log.error("ravex: %s cannot be restored into this run: %s", label, why)
            self.skipped(self.store, index, f"{label}: {why}")
            del ckpt, tensors, mine, p
            self.pending = None
            stop: ResumeError | None = None
            if coord.rank == 0:
                try:
                    self.pending = self._next()
                except ResumeError as exc:
                    stop = exc
            verdict = coord.broadcast((stop.message, stop.hint) if stop is not None else None)
            if stop is not None:
                raise stop
            if verdict is not None:
                raise ResumeError(f"rank 0 found no checkpoint every rank can resume from: {verdict[0]}", hint=verdict[1], path=self.store)

    def find(self, src: str | int | None) -> _Found | None:
        """The checkpoint named by ``src`` (an index of the store, a store, a checkpoint directory, a ``.pt``
        file: what ``resume_from`` names), or with None the newest complete one; None when the store has
        none. Damaged ones are skipped (newest first); the older ones are kept to fall back on."""
        self._candidates, self.failures, self.foreign, self.init = iter(()), [], None, False
        source = self.source
        if isinstance(src, str) and is_foreign(src):
            return self._foreign_start(src)
        if isinstance(src, str) and src.endswith(".pt"):
            return self._only(None, f"checkpoint {src}", load_torch_save(resolve(src).path))
        if isinstance(src, int) and self.backend == "torch_save":
            files = torch_save_files(self.store)
            found = files.get(src) if src >= 0 else (list(files.values())[src] if -src <= len(files) else None)
            if found is None:
                raise RavexError(f"resume_from {src}: {self.store} holds no such checkpoint (it has {len(files)})", hint="use -1 for the newest")
            return self._only(int(found.name[5:13]), f"checkpoint {found}", load_torch_save(found))
        if isinstance(src, str):
            p = resolve(src).path
            if (p / "ravex-store.json").is_file():
                self._candidates = self._native_candidates(p)
                return self._next(first=True)
            if (p / "checkpoint.json").is_file():
                return self._only(None, f"checkpoint {p}", load_checkpoint(p))
            raise RavexError(f"resume_from {src}: neither a Ravex store nor a checkpoint directory of one",
                             hint=f"set resume_from in {source} to a store, a checkpoints/<index> directory, or an index", path=p)
        if isinstance(src, int):
            ckpt, tensors = load_checkpoint(self.store, src, lazy=self.lazy)
            index = ckpt.source.get("index")
            return self._only(index, f"checkpoint {index} (step {ckpt.step}) of {self.store}", (ckpt, tensors))
        if self.backend == "torch_save":
            self._candidates = self._torch_save_candidates()
            return self._next(first=True) or self._init_start()
        if not (self.store / "ravex-store.json").is_file():
            return self._init_start()
        self._candidates = self._native_candidates(self.store)
        return self._next(first=True) or self._init_start()

    def _init_start(self) -> _Found | None:
        """``init_from``, for a store that holds no checkpoint of its own (a restart resumes from
        its own): the weights of that checkpoint, nothing else of it. None without init_from."""
        if self.init_from is None or self.failures:  # a store whose checkpoints are all damaged never starts over
            return None
        f = open_init(self.init_from, self.share)
        self.foreign, self.init = f, True
        self.index, self.label = None, f"init_from {f.label}"
        log.warning("ravex: the run starts from the weights of %s (init_from): its optimizer, schedulers, step and data position start "
                    "fresh", f.label)
        return f.ckpt, {}

    def _foreign_start(self, src: str) -> _Found | None:
        """``resume_from`` names another program's checkpoint: it is the start, unless the store
        already holds checkpoints of the run that began from it (a restart after a kill), which
        then go on from the store's newest."""
        f = open_foreign(src, self.share)
        if self.backend == "torch_save":
            own = self._torch_save_candidates()
        elif (self.store / "ravex-store.json").is_file():
            own = self._native_candidates(self.store)
        else:
            own = iter(())
        first = next(own, None)
        if first is None and self.failures:
            self._next()  # the store's checkpoints are all damaged: raises, never starts over
        if first is not None:
            extra = first[2][0].objects.get("extra")
            origin = extra.get(ORIGIN_KEY) if isinstance(extra, dict) else None
            if not (isinstance(origin, dict) and origin.get("path") == str(f.path)):
                raise ResumeError(f"{self.store} already holds checkpoints of a run that did not begin from {f.label}, which "
                                  f"resume_from names (in {self.source})",
                                  hint="give this run its own storage.path (an empty directory), or remove resume_from to continue "
                                       "the store's own run", path=self.store)
            log.warning("ravex: the store already holds checkpoints of the run that began from %s: it goes on from the store's newest", f.label)
            self._candidates = itertools.chain([first], own)
            return self._next(first=True)
        self.foreign = f
        return self._only(None, f.label, (f.ckpt, {}))

    def _foreign_failed(self, why: str, exc: BaseException | None) -> ResumeError:
        hint = exc.hint if isinstance(exc, RavexError) and exc.hint else "resume with the model, optimizer and schedulers the saved run built"
        return ResumeError(f"{self.label} cannot be resumed into this run: {why.removeprefix(self.label + ': ')}", hint=hint,
                           path=self.foreign.path if self.foreign is not None else None)

    def _restored(self, ckpt: Checkpoint) -> None:
        """Remember where the run began: the foreign checkpoint, or what the restored one says."""
        if self.foreign is not None and self.init:
            self.init_origin = self.foreign.origin()
            return
        if self.foreign is not None:
            self.origin = self.foreign.origin()
            return
        extra = ckpt.objects.get("extra")
        origin = extra.get(ORIGIN_KEY) if isinstance(extra, dict) else None
        self.origin = origin if isinstance(origin, dict) else None
        began = extra.get(INITIALISED_FROM) if isinstance(extra, dict) else None
        self.init_origin = began if isinstance(began, dict) else None

    def _only(self, index: int | None, label: str, found: _Found) -> _Found:
        """A checkpoint the configuration (or the caller) names: nothing to fall back on."""
        self.index, self.label = index, label
        log.warning("ravex: resuming from %s", label)
        return found

    def _next(self, first: bool = False) -> _Found | None:
        """The next checkpoint to try, newest first; None when there is none left."""
        for index, label, found in self._candidates:
            self.index, self.label = index, label
            log.warning("ravex: %s %s", "resuming from" if first else "falling back to", label)
            return found
        self.index = None
        if self.failures:
            # Every checkpoint there is was tried: never start over on a store whose checkpoints are all damaged.
            more = f"\n  ... and {len(self.failures) - 5} older ones" if len(self.failures) > 5 else ""
            raise ResumeError(f"{self.store}: no checkpoint of the store can be resumed from:\n  - " + "\n  - ".join(self.failures[:5]) + more,
                              hint="fix what the error names (" + _SAME_RUN_HINT + "), restore the store from a copy, "
                                   "or set fresh: true (RAVEX_FRESH=1) to start over", path=self.store)
        return None

    def skipped(self, store: Path, index: int | None, why: str) -> None:
        self.failures.append(why)
        if store == self.store and index is not None and index not in self.unrestorable:
            self.unrestorable.append(index)

    def _native_candidates(self, store: Path) -> Iterator[tuple[int | None, str, _Found]]:
        manifest = native.read_manifest(store)
        entries = [e for e in manifest["checkpoints"] if isinstance(e, dict) and e.get("status") == "complete"]
        for e in reversed(entries):
            index = int(e["index"])
            try:
                ckpt, tensors = load_checkpoint(store, index, lazy=self.lazy)
            except RavexError as exc:  # CorruptCheckpointError, IncompleteCheckpointError and the rest: skip it
                log.warning("ravex: checkpoint %s of %s is damaged and is skipped: %s", index, store, exc)
                self.skipped(store, index, exc.message)
                continue
            yield (index if store == self.store else None), f"checkpoint {index} (step {ckpt.step}) of {store}", (ckpt, tensors)

    def _torch_save_candidates(self) -> Iterator[tuple[int | None, str, _Found]]:
        for i, path in reversed(list(torch_save_files(self.store).items())):
            try:
                found = load_torch_save(path)
            except Exception as exc:  # noqa: BLE001 - torch.load reports damage in many exception types
                log.warning("ravex: checkpoint %s is damaged and is skipped: %s", path, exc)
                self.skipped(self.store, i, f"checkpoint {path}: {exc}")
                continue
            yield i, f"checkpoint {i} (step {found[0].step}) of {self.store}", found
