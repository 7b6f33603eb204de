"""A checkpointing session on this rank: track, capture, commit, restore.

This is the layer ``@ravex.train_loop`` sits on, and the one a hand-written
loop or a framework's callbacks call. It decides nothing about *when*: the
decorator counts optimizer steps and captures every ``checkpoint_every`` of
them; a loop or a callback captures where it likes.

:class:`Session` is a facade over modules with one job each:

- tracking.py: the live objects, held by weak references, and the view of them a capture saves;
- recipe.py: how to rebuild each tracked module (its class and constructor arguments, as data), saved with each capture;
- state.py: the capture, copies made on the training thread;
- ranks.py: joining the job's other ranks (over dist.py's group), and the capture on every rank;
- writer.py: the background writer (a new checkpoint per commit, ``keep_last``);
- lease.py: the run lock on the store, from construction to :meth:`Session.close`;
- resume.py: which checkpoint to resume from; checking.py and restoring.py: checking it against
  the live objects, then putting it in, all or nothing.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import Checkpoint
from ravex_convert.objects import INITIALISED_FROM
from ravex_convert.recipes import KEY as RECIPES
from ravex_convert.storage import StoreTakenOverError, resolve
from ravex_convert.storage.lease import TAKEN_HINT

from ._passthrough import Counted
from .config import Config, load_config, override
from .dist import Coord, initialized, topology
from .foreign import ORIGIN_KEY
from .lease import StoreLock
from .ranks import RankCapture
from .recipe import Recorder
from .replica import Replicator
from .replica import start as start_replica
from .replica_area import adopt, replica_of
from .restoring import restore_into
from .resume import Resume
from .state import Snapshot, Tracked, capture, links, unflatten
from .tracking import Registry
from .writer import Job, Writer

__all__ = ["Session"]

log = logging.getLogger("ravex")


class _Unset:
    """A keyword not given (for keywords where None means something: keep_last=None keeps every checkpoint)."""


_UNSET = _Unset()


class Session:
    """Checkpointing of one training run on this rank, driven by the caller.

    Construction takes the store (its run lock on rank 0, and a writer thread); :meth:`close`,
    or leaving a ``with`` block, gives it back. Keywords override the configuration;
    ``checkpoint_every`` and ``max_steps`` are the decorator's: a session captures when it is told to.

    Args:
        config (Config, optional): the configuration. Default: what the decorator would read
            (defaults < ``ravex.yaml`` < ``RAVEX_*`` environment variables).
        path (str or os.PathLike, optional): the store (``storage.path``); ``objdir:PATH`` is
            a store with object-store semantics.
        keep_last (int or None, optional): how many checkpoints the store keeps; None keeps all.
        backend (str, optional): ``"native"`` (a Ravex store) or ``"torch_save"`` (one ``.pt`` per checkpoint).
        compression (str, optional): ``"none"`` or ``"zstd"`` (native store).
        resume_from (str, os.PathLike, int or None, optional): what :meth:`restore` puts in: an
            index of the store (``-1``: the newest), a store, a checkpoint directory, a ``.pt``
            file, or a checkpoint another program wrote (ZeRO, DCP, torch_save). None: the
            store's newest complete checkpoint.
        fresh (bool, optional): start over: :meth:`restore` puts nothing in.
        run_id (str, optional): the run's id, kept in every checkpoint. Default: the time and a random suffix.
        on_error (Callable[[str], None], optional): called with the reason, on the writer
            thread, when a background write fails.

    Raises:
        RavexError: a configuration value is wrong, ``path`` is not a store, or another run holds it.

    Example::

        with ravex.Session(path="checkpoints", keep_last=3) as session:
            session.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
            step = session.restore() or 0       # None: nothing to resume
            for batch in session.iterate(loader):   # continues a restored epoch
                ...                                 # one training step
                step += 1
                session.commit(session.capture(step))   # written in the background
            session.flush()                     # every committed checkpoint written (or raises)

    Messages go to the ``ravex`` logger; a session leaves its handlers to the program. Do not open
    a session inside a ``@ravex.train_loop`` function: the decorator already drives one.
    """

    def __init__(self, config: Config | None = None, *, path: str | os.PathLike[str] | None = None,
                 keep_last: int | None | _Unset = _UNSET, backend: str | None = None, compression: str | None = None,
                 resume_from: str | os.PathLike[str] | int | None | _Unset = _UNSET, fresh: bool | None = None,
                 run_id: str | None = None, on_error: Callable[[str], None] | None = None) -> None:
        keywords = {"storage.path": path, "keep_last": keep_last, "backend": backend, "compression": compression,
                    "resume_from": resume_from, "fresh": fresh}
        given = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in keywords.items()
                 if not isinstance(v, _Unset) and (v is not None or k in ("keep_last", "resume_from"))}  # None is a value of these two
        self.config = cfg = override(load_config() if config is None else config, given, "ravex.Session()")
        # the store, resolved once: the writers, the lock and the ranks' probe take it; its bytes are read through its view
        self.dst = resolve(cfg.store)
        self.path = self.dst.path
        topo = topology()
        self._job = Job(run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8], topo.rank, topo.world_size)
        self._ranks: RankCapture | None = None  # the other ranks, once joined (join())
        self._replica: Replicator | None = None  # replicate_every: copies of the store on another machine (join())
        self._fetched = False  # the newest checkpoint anywhere was looked for (restore())
        self._left = False  # the job's process group is gone (leave())
        self._objects = o = Registry()
        # What the decorator's patches call as objects are built (weak references, idempotent): the
        # registry's; track() checks its arguments and calls them too.
        self.notice_module, self.notice_optimizer, self.notice_scheduler = o.notice_module, o.notice_optimizer, o.notice_scheduler
        self.notice_scaler, self.notice_loader, self.notice_stateful = o.notice_scaler, o.notice_loader, o.notice_stateful
        # How to rebuild the tracked modules (the decorator's patches tell it what they see built): in every checkpoint.
        self.recipes = Recorder()
        # The checkpoint restore() will use (loaded ahead by prepare_restore()), the older ones to
        # fall back on, and the ones skipped: the resumed one is pinned, and a skipped one of this
        # store stops keep_last from pruning.
        self._resume = Resume(self.path, cfg.backend, cfg.source)
        self._resume.init_from = cfg.init_from if cfg.resume_from is None else None  # load_config refuses both
        # every rank reads a foreign checkpoint: each checks the checksums of its share of it
        self._resume.share = (self.rank, self.world_size) if self.world_size > 1 else None
        self._resume.lazy = self.world_size > 1  # each rank reads its own part of a sharded model's checkpoint
        self._prepared = False
        self._closed = False
        self._lock = StoreLock(self.path, self.dst, self.run_id, cfg.source)
        if self.rank == 0:
            # One run per store: rank 0 holds it; the other ranks of the job write nothing there
            # (they may not even see it: the probe at join() says).
            self._lock.take()
            self._job.fence = self._lock.fence
        self._writer = Writer(cfg, self.path, self.dst, self._job, self._resume, self._lock.writing, on_error)

    # ------------------------------------------------------------ where this session stands

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 alone)."""
        return self._job.rank

    @property
    def world_size(self) -> int:
        """How many ranks the job has (1 alone)."""
        return self._job.world_size

    @property
    def run_id(self) -> str:
        """The run's id, kept in every checkpoint (rank 0's on every rank, once joined)."""
        return self._job.run_id

    @property
    def error(self) -> str | None:
        """Why writing stopped: the first background write that failed; None while none has."""
        return self._writer.error

    @property
    def taken_over(self) -> str | None:
        """Why this run writes nothing more: another run took the store's lease over (object
        storage), in words naming it; None while this run holds it (or the store is local)."""
        fence = self._job.fence
        return fence.lost if fence is not None else None

    @property
    def last_index(self) -> int | None:
        """The index of the last checkpoint written."""
        return self._writer.last_index

    @property
    def writes(self) -> int:
        """How many checkpoints this session has written."""
        return self._writer.writes

    @property
    def coord(self) -> Coord | None:
        """Ravex's own group of the job's ranks, once joined (:meth:`join`); None alone, or after :meth:`leave`."""
        return self._ranks.coord if self._ranks is not None else None

    @property
    def left(self) -> bool:
        """The job's process group went away (the ranks no longer exchange anything)."""
        return self._left

    # ------------------------------------------------------------ the other ranks, and the end

    def join(self) -> bool:
        """Join the other ranks of the job (a collective: call it where every rank passes, as the
        decorator does at iteration boundaries). Does nothing alone, or before the script has
        initialized its process group; True once joined. Probes the store: whether every rank
        sees the directory rank 0 writes to."""
        if self._ranks is None and self.world_size > 1 and not (self._closed or self._left) and initialized():
            self._ranks = RankCapture(Coord(), self.config, self._job)  # joined from here on, even should the probe fail
            self._ranks.join(self.dst, self.path)
            self._replica = start_replica(self._ranks.coord, self.config.replicate_every, self.config.keep_last, self.path, self.run_id,
                                          self._ranks.shared)
            if self._replica is not None:
                self._writer.after_write = self._replica.after_write
        return self._ranks is not None

    def _end_replica(self) -> None:
        """The copies end (before the process group): the writes in flight first, and their copies."""
        if self._replica is not None:
            self._writer.drain()
            self._replica.close()
            self._writer.after_write = None
            self._replica = None

    def leave(self) -> None:
        """The job's process group is going away: no more messages between the ranks (this rank
        writes nothing more that needs them)."""
        if self._ranks is not None:
            self._end_replica()
            self._ranks.coord.close()
            self._ranks = None
            self._left = True

    def close(self) -> None:
        """Wait for the writes in flight, stop the writer and give the store back. Does not raise
        for a failed write (call :meth:`flush` first to know); closing twice is harmless."""
        if self._closed:
            return
        self._writer.drain()
        self._closed = True
        self._end_replica()
        if self.coord is not None:
            self.coord.close()
        self._writer.close()
        self._objects.release()
        self._lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ what is tracked

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None, loader: Any = None,
              **named: Any) -> None:
        """Save and restore these objects. Each kind takes one object or a list, in an order that
        counts (the first optimizer is saved by parameter name, the others whole; loaders are
        matched by order). Held until :meth:`close`; track everything before :meth:`restore`.

        Args:
            model: ``torch.nn.Module`` s; the one owning the first optimizer's parameters is "the model" (``model/<fqn>``).
            optimizer: ``torch.optim`` optimizers, or anything with ``param_groups``, ``state_dict`` and ``load_state_dict``.
            scheduler, scaler: LR schedulers, GradScalers.
            loader: DataLoaders; their position is kept when they are iterated through :meth:`iterate`.
            **named: any other object with ``state_dict``/``load_state_dict`` (an EMA, a framework's progress), saved by name.

        Raises:
            RavexError: an object of the wrong kind (nothing is tracked then)."""
        self._objects.track(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, loader=loader, named=named)

    def tracked(self) -> Tracked:
        """The live objects a capture would save now, held strongly by the view."""
        return self._objects.tracked()

    def iterate(self, loader: Any) -> Iterator[Any]:
        """``iter(loader)`` that keeps the loader's position: after :meth:`restore`, the first call
        continues the saved epoch (same order, same random draws, the batches already trained on
        passed over), later calls the epochs after it; batches handed out are counted, so a
        capture knows where the epoch stands. What the decorator does for every ``iter(loader)``.
        A loader not tracked yet is tracked (it has no saved position to continue)."""
        st = self.notice_loader(loader)
        inner = st.make_iter(loader, type(loader).__iter__, torch.get_rng_state())
        return Counted(inner, st)

    # ------------------------------------------------------------ capture and commit

    def capture(self, step: int) -> Snapshot:
        """Copy the state now, on this thread: the checkpoint of ``step`` that :meth:`commit` writes.

        Call it at an iteration boundary (after the optimizer and the schedulers stepped, before the
        next batch is drawn). It copies every tensor into buffers the writer has finished with (about
        one ``memcpy`` of the state from the second capture on). Saved: the tracked objects, the
        Python, NumPy, torch and CUDA random states, and each loader's position. On many ranks every
        rank calls it at the same boundary (ranks.py).

        Args:
            step: the optimizer step just finished (an integer >= 0).

        Raises:
            RavexError: the session is closed, ``step`` is not an integer >= 0, or no model is tracked."""
        if self._closed:
            raise RavexError(f"{self.path}: Session.capture() on a closed session", hint="capture before close()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RavexError(f"Session.capture(step={step!r}): the step must be a non-negative integer", hint="pass the optimizer step just finished")
        t = self.tracked()
        if not t.models:
            raise RavexError(f"Session.capture(step={step}): no model is tracked (or it is gone); nothing to checkpoint",
                             hint="session.track(model=model, optimizer=optimizer, ...) first")
        spare = self._writer.take_spare()
        ranks = self._ranks if self.join() else None
        if self._replica is not None:
            self._replica.begin()
        # in every checkpoint: the run's id (rank 0's, once joined), and where the run began if another program wrote that
        extra: dict[str, Any] = {"ravex_run_id": self.run_id}
        if self._resume.origin is not None:
            extra[ORIGIN_KEY] = dict(self._resume.origin)
        if self._resume.init_origin is not None:
            extra[INITIALISED_FROM] = dict(self._resume.init_origin)
        if ranks is None:
            snap = capture(t, step, spare, extra)
        else:
            snap = ranks.capture(t, step, spare, extra, ddp=self._objects.ddp, ddp_relayout=self._objects.ddp_relayout)
        snap.objects[RECIPES] = self.recipes.recipes(t)
        return snap

    def commit(self, snapshot: Snapshot, wait: bool = False) -> None:
        """Hand ``snapshot`` to the background writer, which adds it to the store as a new checkpoint
        (committed atomically: a crash leaves the previous one loadable) and applies ``keep_last``.
        Returns at once, unless a write is queued already (one is queued while one is written).

        Args:
            snapshot: what :meth:`capture` returned; it belongs to the writer from here on.
            wait: return when it is written (or raise :class:`~ravex_convert.errors.RavexError`).

        After a write failed (disk full, permissions) the session writes nothing more, and every commit raises."""
        if self._closed:
            raise RavexError(f"{self.path}: Session.commit() on a closed session", hint="commit before close()")
        if self.taken_over is not None:
            raise StoreTakenOverError(self.taken_over, hint=TAKEN_HINT, path=self.path)
        if self.error is not None:
            raise RavexError(f"{self.path}: the checkpoint of step {snapshot.step} is not written: an earlier write failed ({self.error})",
                             hint="fix the cause (disk space, permissions) and open a new Session", path=self.path)
        if self.rank != 0 and snapshot.layout is None:
            return  # rank 0 writes the checkpoint of the job (per_rank: every rank writes its shards)
        if (snapshot.objects.get("distributed") or {}).get("refused"):
            return
        self._writer.put(snapshot)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until every committed snapshot is written; raises when a write failed."""
        self._writer.drain()
        if self.taken_over is not None:
            raise StoreTakenOverError(self.taken_over, hint=TAKEN_HINT, path=self.path)
        if self.error is not None:
            raise RavexError(f"{self.path}: a checkpoint could not be written: {self.error}",
                             hint="fix the cause (disk space, permissions) and open a new Session", path=self.path)

    def _drain(self) -> None:
        """Wait for the writer, never raising (the decorator's flush: failures never reach training)."""
        self._writer.drain()

    # ------------------------------------------------------------ restore

    def prepare_restore(self) -> int | None:
        """Load and verify now the checkpoint :meth:`restore` will put in (the configured
        ``resume_from``, else the newest complete one; nothing with ``fresh``); its step, or None
        when there is nothing to resume. Optional: for errors before the training loop is built
        (a store whose checkpoints are all damaged raises :class:`ResumeError` here)."""
        self._resume.pending = None if self.config.fresh else self._resume.find(self.config.resume_from)
        self._prepared = True
        return int(self._resume.pending[0].step or 0) if self._resume.pending is not None else None

    def restore(self, index: int | None = None) -> int | None:
        """Put a checkpoint into the tracked objects, all or nothing; returns its step, or None when
        there is nothing to resume (an empty store, or ``fresh``). Restored: what :meth:`capture`
        saves; the loaders' positions are taken up by the next :meth:`iterate`.

        Args:
            index: None: the configured ``resume_from``, else the newest complete checkpoint; one that
                is damaged (a checksum fails) or does not fit the live objects (every name, shape,
                dtype, parameter group and random state is checked before anything is touched) is
                reported and the one before it tried. An index: that checkpoint of the store only (-1: the newest).

        Raises:
            ResumeError: none fits (each one tried is listed; the objects are untouched), or a restore
                failed midway and the objects could not be put back (the run must stop)."""
        if index is not None:
            self._resume.pending = self._resume.find(index)
        elif not self._prepared:
            self.prepare_restore()
        self._prepared = False
        joined = self.join()
        if joined or self.world_size == 1:
            self._newest_anywhere(index)
        if joined:
            assert self._ranks is not None
            return self._resume.restore_agreed(self.tracked(), self._ranks.coord, self.config.resume_from, shared=self._ranks.shared)
        if self.world_size > 1:
            return self._resume.restore(self.tracked(), rank=self.rank)
        return self._resume.restore(self.tracked())

    def _newest_anywhere(self, index: int | None) -> None:
        """replicate_every, once, before the first restore: the newest checkpoint that survived anywhere
        reaches this store first. A replica this machine holds of the store this rank now writes (a job
        restarted with fewer machines: rank 0 runs where its old store's copy is) is added here; then,
        on several machines, the ranks agree on the newest one any of them holds (Replicator.fetch)."""
        if self._fetched or not self.config.replicate_every:
            return
        self._fetched = True
        wanted = index is None and not self.config.fresh and self.config.resume_from is None
        got = False
        if wanted and self.rank == 0:
            try:
                entry = adopt(self.path, 0, self.run_id)
            except Exception as exc:  # noqa: BLE001 - the resume goes on with what this store has
                log.error("ravex: replicate_every: the replica on this machine could not be added to %s: %s", self.path, exc)
                entry = None
            if entry is not None:
                got = True
                log.warning("ravex: replicate_every: checkpoint %d (step %s) taken from the replica on this machine (%s) into %s",
                            entry["index"], entry.get("step"), replica_of(self.path, 0), self.path)
        if self._replica is not None:
            got = (wanted and self._replica.fetch()) or got
            self._replica.begin()
        if got:
            self._resume.pending = self._resume.find(None)

    def saved_object(self, name: str) -> Any:
        """What the checkpoint :meth:`restore` will put in holds for the object tracked as ``name``
        (None: nothing is pending, or it did not save one). For a framework whose own progress must
        be set before the objects :meth:`restore` fills exist (frameworks/)."""
        if self._resume.pending is None:
            return None
        ckpt, tensors = self._resume.pending
        tracked = ckpt.objects.get("tracked")
        value = tracked.get(name) if isinstance(tracked, dict) else None
        if value is None:
            return None
        # its tensors too (a callback's state may hold some); a rank of a sharded run has read none yet
        missing = [n for n in links(value) if n not in tensors]
        if missing:
            from .loading import read_tensors

            tensors = {**tensors, **read_tensors(ckpt, names=set(missing), verify=True)}
        return unflatten(value, tensors)

    @property
    def resumed_index(self) -> int | None:
        """The index in this store of the checkpoint restored (or being tried); None when it is not one of this store's."""
        return self._resume.index

    @property
    def resume_bytes_read(self) -> int | None:
        """Of the checkpoint restored, the bytes this rank read (a rank of a sharded run reads its own rows); None when unknown."""
        return self._resume.bytes_read

    @property
    def resume_label(self) -> str:
        """``checkpoint <index> (step <step>) of <store>``: the checkpoint restored, for messages ('' before any)."""
        return self._resume.label

    def apply(self, ckpt: Checkpoint, tensors: dict[str, torch.Tensor], *, weights_only: bool = False, where: str = "the checkpoint") -> int | None:
        """Put this loaded checkpoint into the tracked objects, all or nothing (``ravex.restore``):
        one that does not fit raises (:class:`~ravex_convert.errors.LayoutMismatchError`,
        :class:`~ravex_convert.errors.CorruptCheckpointError`) with nothing touched. Returns the
        step it saved (None with ``weights_only``, which loads the models only)."""
        return restore_into(self.tracked(), ckpt, tensors, weights_only=weights_only, where=where)
