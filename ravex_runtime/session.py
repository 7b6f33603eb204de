"""A checkpointing session on this rank: track, capture, commit, restore.

This is the layer ``@ravex.train_loop`` sits on, and the one a framework
integration calls (a Hugging Face Trainer callback, a Lightning callback: not
built yet). It knows what is being trained, copies its state at an iteration
boundary (:meth:`Session.capture`), hands the copy to a background writer
(:meth:`Session.commit`), and puts a checkpoint back into the live objects, all
or nothing (:meth:`Session.restore`). It decides nothing about *when*: the
decorator counts optimizer steps and captures every ``checkpoint_every`` of
them; a hand-written loop or a callback captures where it likes.

A session holds its store from construction to :meth:`Session.close`: a lock on
the store directory (one writer per store), and a writer thread. It knows its
rank and world size (from ``torch.distributed`` when a process group is
initialized, else 0 and 1) but does nothing distributed yet: every rank that
opens a session captures and writes its own whole checkpoint to the store it is
given. Sharded capture and a commit agreed between ranks come next (dist.py).

Importing this module does not import torch (``import ravex`` stays light);
constructing a session does.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

from ravex_convert.errors import IncompleteCheckpointError, RavexError
from ravex_convert.formats.native_store import empty_manifest

from . import config as _config
from ._passthrough import Passthrough
from .config import Config, load_config

if TYPE_CHECKING:
    import torch

    from ravex_convert.model import Checkpoint

    from .dist import Coord
    from .sampler import LoaderState
    from .state import Snapshot, Tracked

__all__ = ["Session"]

log = logging.getLogger("ravex")
# The background writer copies with one thread and at a lower CPU priority (nice +10, Linux: per
# thread), so that training, which owns the other cores, is not slowed by its own checkpoints.
WRITER_THREADS = 1
WRITER_NICE = 10


# ---------------------------------------------------------------- fork safety

_open: list[Session] = []  # the open sessions of this process, for the fork hooks
_fork_hooks = False


def _before_fork() -> None:
    # DataLoader workers are forked: no write may be in flight, or the child would inherit the
    # writer's lock on the store (an flock lives as long as any copy of its descriptor).
    for s in _open:
        s._store_lock.acquire()


def _after_fork_parent() -> None:
    for s in _open:
        s._store_lock.release()


def _after_fork_child() -> None:
    # The child (a worker) never writes; nor may it keep the store's run lock after its parent is gone.
    for s in _open:
        s._store_lock.release()
        if s._lock_fd is not None:
            os.close(s._lock_fd)
            s._lock_fd = None
        s._lease = None  # the parent's: the child never releases it
    _open.clear()


def _register_fork_hooks() -> None:
    global _fork_hooks
    if not _fork_hooks:  # once, at the first session: nothing happens at import
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
        _fork_hooks = True


def _background_priority() -> None:
    """Lower the calling thread's priority (threads it starts inherit it); best effort."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS with a thread id would renice the process
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except OSError:
        pass


# ---------------------------------------------------------------- helpers


def _sharded(m: torch.nn.Module) -> bool:
    from .state import _is_dtensor

    return any(_is_dtensor(p) for p in m.parameters())


def _mesh_of(t: Tracked) -> list[int] | None:
    from .state import _is_dtensor

    for m in t.models:
        for p in m.parameters():
            if _is_dtensor(p):
                return [int(s) for s in cast(Any, p).device_mesh.shape]
    return None


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (its state, without the ``module.`` prefix:
    the same names as the model's in one process, or under FSDP2), else the module itself."""
    from torch.nn.parallel import DistributedDataParallel

    return m.module if isinstance(m, DistributedDataParallel) else m


class _Unset:
    """A keyword not given (for keywords where None means something: keep_last=None keeps every checkpoint)."""


_UNSET = _Unset()


def _many(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
    return [x for r in refs if (x := r()) is not None]


def _has_state(m: torch.nn.Module) -> bool:
    return next(iter(m.parameters()), None) is not None or next(iter(m.buffers()), None) is not None


class _Counted(Passthrough):
    """A DataLoader iterator through :meth:`Session.iterate`: counts the batches handed out."""

    def __init__(self, inner: Any, st: LoaderState):
        super().__init__(inner)
        self._st = st

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._st.consumed += 1
        return batch


# ---------------------------------------------------------------- the session


class Session:
    """Checkpointing of one training run on this rank, driven by the caller.

    ``Session(config)`` takes a :class:`~ravex_runtime.config.Config`; ``Session()``
    reads the configuration the decorator would (defaults < ``ravex.yaml`` <
    ``RAVEX_*``), and keywords override it: ``path`` (the store, ``storage.path``),
    ``keep_last`` (None keeps all), ``backend`` (``native`` or ``torch_save``),
    ``compression``, ``resume_from``, ``fresh``. ``checkpoint_every`` and
    ``max_steps`` are the decorator's: a session captures when it is told to.
    ``on_error(why)`` is called on the writer thread when a background write fails.

    Construction takes the store (its run lock, its writer thread); :meth:`close`,
    or leaving a ``with`` block, gives it back. The surface::

        session.track(model=m, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader, ema=ema)
        step = session.restore()            # None: nothing to resume
        for batch in session.iterate(loader):   # continues a restored epoch; counts the position
            ...
            session.commit(session.capture(step))   # wait=True: written when it returns
        session.flush()                     # every committed checkpoint written (or raises)

    Messages go to the ``ravex`` logger. The decorator adds a handler for its run
    (stderr or ``log_file``); a session leaves logging to the program (without a
    handler, Python prints warnings and errors to stderr). Do not open a session
    inside a ``@ravex.train_loop`` function: the decorator already drives one.
    """

    def __init__(self, config: Config | None = None, *, path: str | os.PathLike[str] | None = None,
                 keep_last: int | None | _Unset = _UNSET, backend: str | None = None, compression: str | None = None,
                 resume_from: str | os.PathLike[str] | int | None | _Unset = _UNSET, fresh: bool | None = None,
                 run_id: str | None = None, on_error: Callable[[str], None] | None = None) -> None:
        given: dict[str, Any] = {}
        if path is not None:
            given["storage.path"] = os.fspath(path)
        if not isinstance(keep_last, _Unset):
            given["keep_last"] = keep_last
        if backend is not None:
            given["backend"] = backend
        if compression is not None:
            given["compression"] = compression
        if not isinstance(resume_from, _Unset):
            given["resume_from"] = os.fspath(resume_from) if isinstance(resume_from, os.PathLike) else resume_from
        if fresh is not None:
            given["fresh"] = fresh
        cfg = load_config() if config is None else config
        if given:
            cfg = dataclasses.replace(cfg)
            _config._apply(cfg, given, "ravex.Session()", Path.cwd(), env=False)
        self.config = cfg
        self.path = Path(cfg.storage_path)  # where the store's bytes are read (an objdir store's local view)
        self.dst: str | Path = cfg.store  # the store as the writers and the storage layer take it
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]
        from .dist import topology

        topo = topology()
        self.rank, self.world_size = topo.rank, topo.world_size
        self.coord: Coord | None = None  # the other ranks, once joined (join())
        self.shared = True  # whether every rank sees the store rank 0 writes (the probe at join())
        self.mode: str | None = None  # replicated, gather or per_rank: how the last checkpoint was captured
        self._checked_replicas = False
        self._ddp = False  # a DistributedDataParallel wrapper was seen (and looked through)
        self._ddp_relayout = False
        self._left = False  # the job's process group is gone (leave())
        self._warned_per_rank = False
        self._writers: Any = None  # per_rank: the store connection the ranks' writers agree through
        self.coord_prefix: str | None = None
        self.error: str | None = None  # why writing stopped: the first background write that failed
        self.last_index: int | None = None  # the index of the last checkpoint written
        self.writes = 0
        self._on_error = on_error
        # What is tracked. Weak references: the decorator notices every module, optimizer and loader
        # as it is built, and one built and dropped inside the loop must be let go. track() also
        # holds a strong reference, until close().
        self._modules: list[weakref.ref[torch.nn.Module]] = []
        self._module_set: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._roots_cache: tuple[tuple[int, int], list[weakref.ref[torch.nn.Module]]] | None = None
        self._optimizers: list[weakref.ref[Any]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._scalers: list[weakref.ref[Any]] = []
        self._loaders: list[tuple[weakref.ref[Any], LoaderState]] = []
        self._named: dict[str, Any] = {}
        self._held: list[Any] = []
        # The checkpoint restore() will use (loaded ahead by prepare_restore()), the older ones to
        # fall back on, and the ones skipped: the resumed one is pinned, and a skipped one of this
        # store stops keep_last from pruning.
        from .resume import Resume

        self._resume = Resume(self.path, cfg.backend, cfg.source)
        # every rank reads a foreign checkpoint: each checks the checksums of its share of it
        self._resume.share = (self.rank, self.world_size) if self.world_size > 1 else None
        self._resume.lazy = self.world_size > 1  # each rank reads its own part of a sharded model's checkpoint
        self._prepared = False
        self._warned_prune = False
        # The writer: one snapshot queued while one is written; buffers of the last snapshot written,
        # reused by the next capture (Snapshot.spare).
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._writer: threading.Thread | None = None
        self._lock_fd: int | None = None
        self._lease: Any = None  # object storage: the run's lease, held open (a context manager)
        self._store_lock = threading.Lock()
        self._spare: dict[str, torch.Tensor] = {}
        self._spare_lock = threading.Lock()
        self._closed = False
        _register_fork_hooks()
        if self.rank == 0:
            # One run per store: rank 0 holds it; the other ranks of the job write nothing there
            # (they may not even see it: the probe at join() says).
            self._take_lock()
        self._writer = threading.Thread(target=self._write_loop, name="ravex-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ the store

    def _take_lock(self) -> None:
        from ravex_convert.formats import native_store

        w = native_store.where(self.dst)
        if not w.posix:
            self._take_lease(w)
            return
        store = self.path
        if store.exists() and not store.is_dir():
            raise RavexError(f"storage.path {store} exists and is not a directory", hint=f"set storage.path in {self.config.source} to a directory")
        store.mkdir(parents=True, exist_ok=True)
        if not (store / "ravex-store.json").is_file():
            self._refuse_foreign(store, {p.name: p for p in store.iterdir()})
        # The run lock is a flock on the store directory itself; the writer's own lock (<store>/lock)
        # is taken per write, so the two never meet in one process.
        fd = os.open(store, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RavexError(f"{store}: another training run is using this checkpoint store",
                                 hint="only one run may write to a store at a time: stop the other run, or set storage.path (RAVEX_STORAGE_PATH) to another directory",
                                 path=store) from None
            raise
        self._lock_fd = fd
        _open.append(self)

    def _take_lease(self, w: Any) -> None:
        """The run lock on object storage (no directory to flock): the lease object ``<store>/run-lock``
        (docs/format.md section 3), held until :meth:`close`; the writer's own lease (``<store>/lock``)
        is taken per write, as the lock file is locally."""
        from ravex_convert.formats.native_store import RUN_LOCK
        from ravex_convert.storage import PreconditionFailed

        bucket = getattr(w.storage, "root", None)
        if isinstance(bucket, str) and not os.path.isdir(bucket):
            raise RavexError(f"storage.path {w.name}: its bucket {bucket} (the directory above the store) does not exist",
                             hint="create the bucket first (object storage has no directories to make)", path=Path(bucket))
        if w.storage.exists(w.key):
            raise RavexError(f"storage.path {w.name} is an object, not a store (a prefix of objects)",
                             hint=f"set storage.path in {self.config.source} to another key", path=w.path)
        rels = w.objects()
        if "ravex-store.json" not in rels:
            # a "directory" of object storage exists only while objects lie under it: checkpoints/ is never empty here
            self._refuse_foreign(w.path, {r.split("/", 1)[0]: None for r in rels}, shown=w.name)
        lease = w.storage.lease(w.key_of(RUN_LOCK), self.run_id)
        try:
            lease.__enter__()
        except PreconditionFailed as held:
            raise RavexError(f"{w.name}: another training run is using this checkpoint store ({held})",
                             hint="only one run may write to a store at a time: stop the other run, or set storage.path (RAVEX_STORAGE_PATH) "
                                  f"to another store; a run killed on another machine leaves its lease behind: once it is certainly gone, "
                                  f"delete the object {w.shown(RUN_LOCK)}", path=w.path) from None
        self._lease = lease
        _open.append(self)

    def _refuse_foreign(self, store: Path, names: dict[str, Path | None], *, shown: str | None = None) -> None:
        """A store without its marker: refuse what is not an empty directory or what an interrupted
        creation leaves. ``names``: the store's top-level entries (a local path each; None on object storage)."""
        from ravex_convert.formats.native_store import LOCK, RUN_LOCK

        from .dist import PROBE_PREFIX
        from .loading import TS_FILE

        shown = shown or str(store)
        self._refuse_unmarked(store, names, shown)
        other = [n for n in names if n not in (LOCK, RUN_LOCK, "manifest.json", "checkpoints") and ".tmp-" not in n
                 and not TS_FILE.fullmatch(n) and not n.startswith(PROBE_PREFIX)]
        if other:
            raise RavexError(f"storage.path {shown} is not a Ravex store and not empty (it holds {', '.join(sorted(other)[:5])})",
                             hint=f"point storage.path in {self.config.source} at a new or empty directory", path=store)

    def _refuse_unmarked(self, store: Path, names: dict[str, Path | None], shown: str) -> None:
        """A directory holding a store's manifest or checkpoints but no marker is a damaged store, not an
        empty directory: starting over there would discard its checkpoints."""
        held = [n for n in ("manifest.json", "checkpoints") if n in names]
        if "manifest.json" in held and empty_manifest(store / "manifest.json"):
            # a manifest that lists nothing is what creation writes before the marker: the
            # writer finishes such a store, as it would after a kill at that instant
            held.remove("manifest.json")
        ck = names.get("checkpoints")
        if held == ["checkpoints"] and ck is not None and ck.is_dir() and not ck.is_symlink() and not any(ck.iterdir()):
            held = []  # an empty checkpoints/ is what an interrupted creation leaves: nothing to lose
        if held:
            raise IncompleteCheckpointError(
                f"storage.path {shown} holds {' and '.join(held)} of a Ravex store but not its marker ravex-store.json; "
                "Ravex does not take it for an empty directory (that would start over and discard its checkpoints)",
                hint=f"if it is your store, put its ravex-store.json back (a copy, or see docs/format.md section 2); "
                     f"to start a new run, set storage.path in {self.config.source} to a new directory", path=store / "ravex-store.json")

    def join(self) -> bool:
        """Join the other ranks of the job (a collective: call it where every rank passes, as the
        decorator does at iteration boundaries). Does nothing alone, or before the script has
        initialized its process group; True once joined. Probes the store: whether every rank
        sees the directory rank 0 writes to."""
        if self.coord is not None:
            return True
        if self.world_size == 1 or self._closed or self._left:
            return False
        from .dist import Coord, initialized

        if not initialized():
            return False
        self.coord = Coord()
        self.coord_prefix = self.coord.prefix
        self.rank, self.world_size = self.coord.rank, self.coord.size
        self.run_id = self.coord.broadcast(self.run_id)  # one run: rank 0's id on every rank
        seen = self.coord.probe(self.dst)
        self.shared = all(seen)
        if self.rank == 0 and not self.shared:
            blind = [r for r, ok in enumerate(seen) if not ok]
            log.warning("ravex: storage: %s is not shared: rank(s) %s do not see the directory rank 0 writes to (local disks on several "
                        "machines). Rank 0 writes every checkpoint there; to resume, start rank 0 on this machine again, and the other ranks "
                        "receive the state from it over the network. A lost machine loses its checkpoints: put storage.path on storage every "
                        "rank sees (a shared filesystem) to resume anywhere", self.path, ", ".join(map(str, blind)))
        self.coord.watch()
        return True

    def leave(self) -> None:
        """The job's process group is going away: no more messages between the ranks (this rank
        writes nothing more that needs them)."""
        if self.coord is not None:
            self.coord.close()
            self.coord = None
            self._left = True

    @property
    def left(self) -> bool:
        """The job's process group went away (the ranks no longer exchange anything)."""
        return self._left

    def close(self) -> None:
        """Wait for the writes in flight, stop the writer and give the store back. Does not raise
        for a failed write (call :meth:`flush` first to know); closing twice is harmless."""
        if self._closed:
            return
        self._drain()
        self._closed = True
        if self.coord is not None:
            self.coord.close()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self._held = []
        with self._spare_lock:
            self._spare = {}
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.__exit__(None, None, None)
        if self in _open:
            _open.remove(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ what is tracked

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None, loader: Any = None,
              **named: Any) -> None:
        """Save and restore these objects. Each kind takes one object or a list; the order counts
        (the first optimizer is saved by parameter name, the others whole; loaders are matched by
        order). ``model``: ``torch.nn.Module`` s (the one owning the first optimizer's parameters
        is "the model", saved as ``model/<fqn>``); ``optimizer``: ``torch.optim`` optimizers (or
        anything with ``param_groups``, ``state_dict()`` and ``load_state_dict()``); ``scheduler``,
        ``scaler``: LR schedulers, GradScalers; ``loader``: DataLoaders, whose position is kept
        when they are iterated through :meth:`iterate`; any other keyword names an object with
        ``state_dict()``/``load_state_dict()`` (an EMA, a custom sampler, a framework's progress).

        Track everything before :meth:`restore`: what is not tracked then is not restored.
        The session keeps a reference to each object until :meth:`close`. Checked first: an
        object of the wrong kind raises with nothing tracked."""
        import torch

        def need(ok: bool, what: str, obj: Any, expect: str) -> None:
            if not ok:
                raise RavexError(f"Session.track({what}=...): {type(obj).__name__} is not {expect}",
                                 hint=f"pass {expect} as {what}=, or another stateful object under a name of its own (name=obj)")

        models, opts, scheds, scalers, loaders = _many(model), _many(optimizer), _many(scheduler), _many(scaler), _many(loader)
        for m in models:
            need(isinstance(m, torch.nn.Module), "model", m, "a torch.nn.Module")
        for o in opts:
            need(hasattr(o, "param_groups") and _stateful(o), "optimizer", o, "an optimizer (param_groups, state_dict, load_state_dict)")
        for s in scheds:
            need(_stateful(s), "scheduler", s, "an LR scheduler (state_dict, load_state_dict)")
        for s in scalers:
            need(_stateful(s), "scaler", s, "a GradScaler (state_dict, load_state_dict)")
        for ld in loaders:
            need(isinstance(ld, torch.utils.data.DataLoader), "loader", ld, "a torch.utils.data.DataLoader")
        for name, obj in named.items():
            if not _stateful(obj):
                raise RavexError(f"Session.track({name}=...): {type(obj).__name__} has no state_dict()/load_state_dict()",
                                 hint="track objects that can save and load their state")
        self._held.extend([*models, *opts, *scheds, *scalers, *loaders])
        for m in models:
            self.notice_module(m)
        for o in opts:
            self.notice_optimizer(o)
        for s in scheds:
            self.notice_scheduler(s)
        for s in scalers:
            self.notice_scaler(s)
        for ld in loaders:
            self.notice_loader(ld)
        for name, obj in named.items():
            self.notice_stateful(name, obj)

    # The notice_* methods are what the decorator's patches call as objects are built (weak
    # references, idempotent); track() checks its arguments and calls them.

    def notice_module(self, m: torch.nn.Module) -> None:
        if m in self._module_set:
            return
        self._module_set.add(m)
        self._modules.append(weakref.ref(m))
        if len(self._modules) > 2 * len(self._module_set) + 64:
            self._modules = [r for r in self._modules if r() is not None]  # modules built and dropped inside the loop

    def notice_optimizer(self, opt: Any) -> int | None:
        """Its position among the optimizers when it is new (0: the first), None when it was known."""
        if any(r() is opt for r in self._optimizers):
            return None
        self._optimizers.append(weakref.ref(opt))
        return len(self._optimizers) - 1

    def notice_scheduler(self, s: Any) -> None:
        if not any(r() is s for r in self._schedulers):
            self._schedulers.append(weakref.ref(s))

    def notice_scaler(self, s: Any) -> None:
        if not any(r() is s for r in self._scalers):
            self._scalers.append(weakref.ref(s))

    def notice_loader(self, loader: Any) -> LoaderState:
        """The loader's position (made when the loader is new)."""
        from .sampler import LoaderState

        for r, st in self._loaders:
            if r() is loader:
                return st
        st = LoaderState(loader, len(self._loaders))
        self._loaders.append((weakref.ref(loader), st))
        return st

    def notice_stateful(self, name: str, obj: Any) -> None:
        """An object saved whole by name, under ``tracked/<name>`` (held strongly)."""
        if not _stateful(obj):
            raise RavexError(f"cannot track {name!r} ({type(obj).__name__}): the object has no state_dict()/load_state_dict()",
                             hint="track objects that can save and load their state")
        self._named[name] = obj

    def tracked(self) -> Tracked:
        """The live objects a capture would save now, held strongly by the view."""
        from .state import Tracked

        return Tracked(models=self._roots(), optimizers=_alive(self._optimizers), schedulers=_alive(self._schedulers),
                       scalers=_alive(self._scalers), loaders=[(r(), st) for r, st in self._loaders], named=dict(self._named))

    def _roots(self) -> list[torch.nn.Module]:
        key = (len(self._modules), len(self._optimizers))
        if self._roots_cache is not None and self._roots_cache[0] == key and all(r() is not None for r in self._roots_cache[1]):
            return [m for r in self._roots_cache[1] if (m := r()) is not None]
        roots = self._find_roots()
        self._roots_cache = (key, [weakref.ref(m) for m in roots])
        return roots

    def _find_roots(self) -> list[torch.nn.Module]:
        mods = _alive(self._modules)
        children: set[int] = set()
        for m in mods:
            for c in m.modules():
                if c is not m:
                    children.add(id(c))
        # Roots that hold state, the one owning the first optimizer's parameters first: that one is "the model"
        # (model/<fqn>); a loss module built earlier holds no state and is left out.
        roots = [m for m in mods if id(m) not in children and _has_state(m)]
        inner = [_unwrap(m) for m in roots]
        self._ddp = self._ddp or any(a is not b for a, b in zip(inner, roots))
        # DDP lays its gradient buckets out again after its first step, unless it looks for unused
        # parameters: a restarted DDP's first step then sums in another order (at 3+ ranks it shows)
        self._ddp_relayout = self._ddp_relayout or any(a is not b and not getattr(b, "find_unused_parameters", True) for a, b in zip(inner, roots))
        roots = inner
        opt = next(iter(_alive(self._optimizers)), None)
        if opt is not None:
            first = {id(p) for g in opt.param_groups for p in g["params"]}
            roots.sort(key=lambda m: not any(id(p) in first for p in m.parameters()))
        return roots

    def iterate(self, loader: Any) -> Iterator[Any]:
        """``iter(loader)`` that keeps the loader's position: after :meth:`restore`, the first call
        continues the saved epoch (same order, same random draws, the batches already trained on
        passed over), later calls the epochs after it; batches handed out are counted, so a
        capture knows where the epoch stands. What the decorator does for every ``iter(loader)``.
        A loader not tracked yet is tracked (it has no saved position to continue)."""
        import torch

        st = self.notice_loader(loader)
        inner = st.make_iter(loader, type(loader).__iter__, torch.get_rng_state())
        return _Counted(inner, st)

    # ------------------------------------------------------------ capture and commit

    def capture(self, step: int) -> Snapshot:
        """Copy the state now, on this thread: what :meth:`commit` writes as the checkpoint of ``step``.

        Call it at an iteration boundary — after the optimizer and the schedulers stepped, before
        the next batch is drawn — so the copy is the state the next step starts from. It is a
        copy of every tensor into buffers the writer has finished with (about one ``memcpy`` of
        the state from the second capture on); once committed, the snapshot belongs to the writer.
        Saved: the models, optimizers, schedulers, scalers and named objects tracked, the Python,
        NumPy, torch and CUDA random states, and each loader's position."""
        from .state import capture

        if self._closed:
            raise RavexError(f"{self.path}: Session.capture() on a closed session", hint="capture before close()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RavexError(f"Session.capture(step={step!r}): the step must be a non-negative integer", hint="pass the optimizer step just finished")
        t = self.tracked()
        if not t.models:
            raise RavexError(f"Session.capture(step={step}): no model is tracked (or it is gone); nothing to checkpoint",
                             hint="session.track(model=model, optimizer=optimizer, ...) first")
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        if not self.join():
            return capture(t, step, spare, self._extra())
        return self._capture_ranks(t, step, spare)

    def _capture_ranks(self, t: Tracked, step: int, spare: dict[str, torch.Tensor]) -> Snapshot:
        """A capture on every rank of the job (each calls it at the same boundary): rank 0 copies the
        model, optimizers and schedulers (a sharded model's tensors gathered whole: collectives
        every rank joins); every rank's random streams and data positions are gathered to it."""
        from .state import capture, is_fsdp1, layout_of

        assert self.coord is not None
        fsdp1 = any(is_fsdp1(m) for m in t.models)
        sharded = fsdp1 or any(_sharded(m) for m in t.models)
        if fsdp1 and self.config.sharded_checkpoints == "per_rank" and not self._warned_per_rank:
            self._warned_per_rank = True
            if self.rank == 0:
                log.warning("ravex: sharded_checkpoints: per_rank falls back to gather: the model is wrapped in FSDP1 "
                            "(FullyShardedDataParallel), whose flat parameters name no tensor of the model; FSDP2 (fully_shard) writes per rank")
        per_rank = sharded and not fsdp1 and self._per_rank()
        self.mode = "per_rank" if per_rank else "gather" if sharded else "replicated"
        if not sharded and not self._checked_replicas:
            self._checked_replicas = True
            self._check_replicas(t)
            if self._ddp_relayout and self.world_size >= 3 and self.rank == 0:
                log.warning("ravex: DDP on %d ranks: after a resume, DDP's first step sums the ranks' gradients in another order than "
                            "the uninterrupted run's (DDP lays its gradient buckets out again after its first step; this happens without "
                            "Ravex too), so the weights can differ in the last bit from there on. For bit-identical resumes pass "
                            "find_unused_parameters=True to DistributedDataParallel: it keeps one bucket layout", self.world_size)
        try:
            snap = capture(t, step, spare, self._extra(), keep=self.rank == 0, rank_part=self.rank, local_shards=per_rank)
        except Exception as exc:  # this rank still takes part in the exchanges below, which refuse the step on every rank
            # (a failure inside one of the gathers above leaves the group broken: torch reports that itself)
            from .state import Snapshot

            log.exception("ravex: rank %d could not copy its state at step %d", self.rank, step)
            snap = Snapshot(step=step, rank=self.rank, local_shards=per_rank, failed=f"{type(exc).__name__}: {exc}")
            snap.objects["rank_part"] = {"rng": {}, "loaders": []}
        part = snap.objects.pop("rank_part")
        mine = f"obj/ranks/{self.rank}/"
        part_tensors = {n: snap.tensors.pop(n) for n in [n for n in snap.tensors if n.startswith(mine)]}
        parts = self.coord.gather((step, part, part_tensors, snap.failed))
        if parts is not None:
            failed = [(r, p[3]) for r, p in enumerate(parts) if p[3] is not None]
            steps = sorted({p[0] for p in parts})
            if len(steps) > 1:
                # (every rank learns it below, in the layout exchange or when rank 0 writes nothing)
                log.error("ravex: the ranks are at different steps (%s) at a checkpoint boundary; no checkpoint is written", steps)
            snap.objects["ranks"] = [p[1] for p in parts]
            for _, _, tensors, _ in parts:
                snap.tensors.update(tensors)
            files = {str(r): f"rank{r:05d}" + (" and checkpoint.json" if r == 0 else "") for r in range(self.world_size)} if per_rank else {"0": "all"}
            snap.objects["distributed"] = {"world_size": self.world_size, "mode": self.mode, "mesh": _mesh_of(t),
                                           "wrap": "fsdp1" if fsdp1 else "fsdp2" if sharded else ("ddp" if self._ddp else "none"),
                                           "written_by": files, "shared_storage": self.shared}
            if len(steps) > 1:
                snap.objects["distributed"]["refused"] = f"the ranks are at different steps: {steps}"
            if failed:
                snap.objects["distributed"]["refused"] = f"rank {failed[0][0]} could not copy its state: {failed[0][1]}"
                log.error("ravex: no checkpoint at step %d: rank %d could not copy its state (%s)", step, *failed[0])
        if per_rank:
            # Every rank's writer builds the same checkpoint: each rank's list of tensors and shards
            # (and every rank sees the steps: all write, or none).
            got = self.coord.all_gather((step, layout_of(snap), snap.failed))
            snap.layout = [layout for _, layout, _ in got]
            if len({s for s, _, _ in got}) > 1 or any(f is not None for _, _, f in got):
                snap.objects.setdefault("distributed", {})["refused"] = "the ranks are at different steps, or one could not copy its state"
        return snap

    def _per_rank(self) -> bool:
        """Whether per_rank checkpoints can be written here (asked for, every rank sees the store, and a
        store connection for the writers); else gather, said once."""
        if self.config.sharded_checkpoints != "per_rank":
            return False
        assert self.coord is not None
        why = None if self.shared else "not every rank sees the store (each rank's shard must reach the one checkpoint)"
        if why is None and self.config.backend != "native":
            why = f"backend: {self.config.backend} writes one file per checkpoint; per_rank writes into a native store"
        # The writers' connection (asked for on every rank: a collective) outlives the process group:
        # a final checkpoint is written after it is gone.
        store = self.coord.writer_store()
        if why is None and store is None:
            why = "some rank has no connection to the job's store at MASTER_ADDR:MASTER_PORT for the writers to agree through (start it with torchrun)"
        if why is None:
            self._writers = store
        if why is not None and not self._warned_per_rank:
            self._warned_per_rank = True
            if self.rank == 0:
                log.warning("ravex: sharded_checkpoints: per_rank falls back to gather: %s", why)
        return why is None

    def _check_replicas(self, t: Tracked) -> None:
        """A model not sharded is written once, by rank 0: every rank must hold the same weights. DDP
        sees to it (it broadcasts rank 0's weights when it wraps the model and averages the
        gradients every step); the first capture checks it with one checksum per rank."""
        import zlib

        import torch

        assert self.coord is not None
        crc = 0
        for m in t.models:
            # parameters only: buffers (BatchNorm's running statistics) differ between the ranks
            # until DDP broadcasts them again at the next forward
            for k, v in m.named_parameters():
                crc = zlib.crc32(k.encode(), crc)
                crc = zlib.crc32(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
        sums = self.coord.all_gather(crc)
        if len(set(sums)) > 1 and self.rank == 0:
            log.warning("ravex: the ranks hold different weights (checksums %s) and the model is not sharded: rank 0's are checkpointed. "
                        "Wrap the model in DistributedDataParallel (or FSDP2's fully_shard) so the ranks train one model",
                        ", ".join(f"{s:08x}" for s in sums))

    def commit(self, snapshot: Snapshot, wait: bool = False) -> None:
        """Hand ``snapshot`` to the background writer, which adds it to the store as a new checkpoint
        (committed atomically: a crash leaves the previous one loadable) and applies ``keep_last``.
        Returns at once, unless a write is queued already (then it waits for room: one is queued
        while one is written); ``wait=True`` returns when it is written, or raises. After a write
        failed (disk full, permissions) the session writes nothing more, and every commit raises."""
        if self._closed:
            raise RavexError(f"{self.path}: Session.commit() on a closed session", hint="commit before close()")
        if self.error is not None:
            raise RavexError(f"{self.path}: the checkpoint of step {snapshot.step} is not written: an earlier write failed ({self.error})",
                             hint="fix the cause (disk space, permissions) and open a new Session", path=self.path)
        if self.rank != 0 and snapshot.layout is None:
            return  # rank 0 writes the checkpoint of the job (per_rank: every rank writes its shards)
        if (snapshot.objects.get("distributed") or {}).get("refused"):
            return
        self._queue.put(snapshot)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until every committed snapshot is written; raises when a write failed."""
        self._drain()
        if self.error is not None:
            raise RavexError(f"{self.path}: a checkpoint could not be written: {self.error}",
                             hint="fix the cause (disk space, permissions) and open a new Session", path=self.path)

    def _drain(self) -> None:
        """Wait for the writer, never raising (the decorator's flush: failures never reach training)."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def _write_loop(self) -> None:
        _background_priority()
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                if self.error is None:
                    self._write(snap)
                elif snap.layout is not None:
                    self._writers_group(snap).abort(f"rank {self.rank} writes no more checkpoints: {self.error}")
            except Exception as exc:  # noqa: BLE001 - a failing write stops writing; training goes on
                log.error("ravex: writing the checkpoint of step %d to %s failed: %s", snap.step if snap else -1, self.path, exc)
                self.error = f"checkpoint write failed: {exc}"
                if self._on_error is not None:
                    try:
                        self._on_error(self.error)
                    except Exception:  # the owner's handler must not stop the writer
                        log.exception("ravex: the write-error handler failed")
            finally:
                if snap is not None and self.error is None and not self._closed:
                    with self._spare_lock:
                        self._spare = snap.tensors  # written: the next capture may overwrite them
                self._queue.task_done()

    def _write(self, snap: Snapshot) -> None:
        from ravex_convert import _dist
        from ravex_convert._output import Options
        from ravex_convert.formats import native_write

        from .state import to_checkpoint

        ckpt = to_checkpoint(snap, self.path)
        if self.config.backend == "torch_save":
            with self._store_lock:
                self._write_torch_save(ckpt)
            return
        opts = Options(compression=None if self.config.compression == "none" else self.config.compression, threads=WRITER_THREADS)
        group = self._writers_group(snap) if snap.layout is not None else None
        with self._store_lock:
            if group is not None:
                # per_rank: every rank writes its shards into the one checkpoint, rank 0 commits it
                opts.world_size, opts.keep_chunks = self.world_size, True
                try:
                    with _dist.spread(group):
                        result = native_write.write(ckpt, self.dst, opts, run_id=self.run_id.replace(".", "-"))
                except BaseException as exc:
                    group.abort(f"rank {self.rank}: {exc}")  # the others stop waiting for this rank's part
                    raise
                if self.rank != 0:
                    self.last_index = int(result["index"])
                    self.writes += 1
                    return
            else:
                result = native_write.write(ckpt, self.dst, opts, run_id=self.run_id.replace(".", "-"))
            for w in result.get("warnings", []):
                log.warning("ravex: %s", w)
            self.last_index = int(result["index"])
            self.writes += 1
            if self.config.keep_last is not None and self._may_prune():
                pinned = {self.resumed_index} if self.resumed_index is not None else set()
                native_write.prune(self.dst, self.config.keep_last, pinned=pinned)

    def _writers_group(self, snap: Snapshot) -> Any:
        """The messages of the ranks' writers for this per_rank checkpoint, named by its step: a rank
        that missed one checkpoint's messages does not shift every later one's."""
        from .dist import StoreGroup

        if self._writers is None or self.coord_prefix is None:
            raise RavexError("a per_rank checkpoint without the writers' store", hint="this is a bug in Ravex")
        return StoreGroup(self._writers, f"{self.coord_prefix}w/{snap.step}/", self.rank, self.world_size)

    def _write_torch_save(self, ckpt: Checkpoint) -> None:
        """One ``ckpt-<index>.pt`` per checkpoint, in the portable torch.save layout (written to a
        temporary name and renamed into place by the torch_save writer); keep_last by file."""
        from ravex_convert._output import Options
        from ravex_convert.formats import torch_save
        from ravex_convert.storage import resolve

        from .loading import torch_save_files

        files = torch_save_files(self.path)
        index = max(files, default=-1) + 1
        torch_save.write(ckpt, self._in_store(f"ckpt-{index:08d}.pt"), Options(threads=WRITER_THREADS))
        self.last_index = index
        self.writes += 1
        if self.config.keep_last is not None and self._may_prune():
            files = torch_save_files(self.path)
            for i in list(files)[:-self.config.keep_last]:
                if i != self.resumed_index:
                    storage, key = resolve(self._in_store(files[i].name))
                    storage.delete(key)

    def _in_store(self, name: str) -> Path:
        """``name`` in the store, spelled for the storage layer (``objdir:`` kept: a Path keeps it)."""
        return Path(self.dst) / name

    def _extra(self) -> dict[str, Any]:
        """What every checkpoint keeps under ``extra``: the run's id, and where the run began when that
        was another program's checkpoint (resume_from)."""
        from .foreign import ORIGIN_KEY

        extra: dict[str, Any] = {"ravex_run_id": self.run_id}
        if self._resume.origin is not None:
            extra[ORIGIN_KEY] = dict(self._resume.origin)
        return extra

    def _may_prune(self) -> bool:
        """keep_last is not applied in a run that skipped a checkpoint of its store it could not read or
        restore: the store is kept whole (the skipped ones for inspection, every good one) until a run
        resumes from its newest checkpoint."""
        if not self._resume.unrestorable:
            return True
        if not self._warned_prune:
            self._warned_prune = True
            log.warning("ravex: keep_last is not applied in this run: checkpoint(s) %s of %s could not be read or restored, so nothing is pruned; "
                        "inspect them with `ravex status`", ", ".join(str(i) for i in self._resume.unrestorable), self.path)
        return False

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
        there is nothing to resume (an empty store, or ``fresh``).

        ``index=None``: the configured ``resume_from``, else the newest complete checkpoint; one
        that is damaged (a checksum fails) or does not fit the live objects (another model, another
        optimizer: every name, shape, dtype, parameter group and random state is checked before
        anything is touched) is reported on the log and the one before it tried. An index: that
        checkpoint of the store only (``-1`` the newest). When none fits, :class:`ResumeError`
        lists each one tried, with the live objects untouched. A restore failing midway puts the
        objects back; should that fail too, :class:`ResumeError` says the objects hold part of a
        checkpoint and the run must stop.

        Restored: what :meth:`capture` saves; the loaders' positions are taken up by the next
        :meth:`iterate`. Track everything first."""
        if index is not None:
            self._resume.pending = self._resume.find(index)
        elif not self._prepared:
            self.prepare_restore()
        self._prepared = False
        if self.join():
            assert self.coord is not None
            return self._resume.restore_agreed(self.tracked(), self.coord, self.config.resume_from, shared=self.shared)
        if self.world_size > 1:
            return self._resume.restore(self.tracked(), rank=self.rank)
        return self._resume.restore(self.tracked())

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
        from .restoring import restore_into

        return restore_into(self.tracked(), ckpt, tensors, weights_only=weights_only, where=where)
