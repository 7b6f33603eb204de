"""One runtime per decorated call: what the patches call into.

It knows what is being trained (held by weak reference), counts optimizer
steps, collects a checkpoint at the top of an iteration when one is due,
hands it to a background writer, and restores the newest checkpoint at the
first iteration boundary of a resumed run.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import IncompleteCheckpointError, RavexError
from ravex_convert.model import MODEL, OBJ, OPTIM, Checkpoint

from .config import Config
from .loading import TS_FILE, load_checkpoint, load_torch_save, torch_save_files
from .restore import ResumeError, restore_into
from .sampler import LoaderState
from .state import Snapshot, capture_rng, to_checkpoint

__all__ = ["Runtime", "StopRun"]

log = logging.getLogger("ravex")
_Found = tuple[Checkpoint, dict[str, torch.Tensor]]
_live: list[Runtime] = []  # the runtime of this process, for the fork hooks


def _before_fork() -> None:
    # DataLoader workers are forked: no write may be in flight, or the child would inherit
    # the store's lock (an flock lives as long as any copy of its descriptor).
    for rt in _live:
        rt._store_lock.acquire()


def _after_fork_parent() -> None:
    for rt in _live:
        rt._store_lock.release()


def _after_fork_child() -> None:
    for rt in _live:
        rt._store_lock.release()
        if rt._lock_fd is not None:
            os.close(rt._lock_fd)
            rt._lock_fd = None
    _live.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
_WARN_AFTER_STEPS = 3
# After SIGTERM, how many iteration boundaries without an optimizer step to wait for one.
_PREEMPT_WAIT_BOUNDARIES = 64
_SAME_RUN_HINT = "resume with the model, optimizer and schedulers built as the checkpointed run built them"
# The background writer copies with one thread and at a lower CPU priority (nice +10, Linux: per
# thread), so that training, which owns the other cores, is not slowed by its own checkpoints.
WRITER_THREADS = 1
WRITER_NICE = 10


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


class StopRun(BaseException):
    """Raised at an iteration boundary once ``max_steps`` is reached; the decorator returns normally.
    A BaseException so that a user's ``except Exception`` does not swallow it."""


def _has_state(m: torch.nn.Module) -> bool:
    return next(iter(m.parameters()), None) is not None or next(iter(m.buffers()), None) is not None


class Runtime:
    def __init__(self, cfg: Config, preemption_handler: bool = False):
        self.cfg = cfg
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]
        self.store = Path(cfg.storage_path)
        self.active = True  # checkpointing; off after deactivate() or a failure
        self.counting = True  # step counting and max_steps; off only after deactivate()
        self.preemption_handler = preemption_handler
        self.preempted = False
        self.preempt_waits = 0
        self.step = 0
        self.start_step = 0
        self.due = False
        self.boundary_seen = False
        self.warned_boundary = False
        self.steps_since_boundary = 0
        self.modules: list[weakref.ref[torch.nn.Module]] = []
        self.optimizers: list[weakref.ref[Any]] = []
        self.schedulers: list[weakref.ref[Any]] = []
        self.scalers: list[weakref.ref[Any]] = []
        self.loaders: list[tuple[weakref.ref[Any], LoaderState]] = []
        self.tracked: dict[str, Any] = {}
        # Strong references to what was being trained at the last boundary: the final checkpoint
        # runs after the function returned, when its locals are gone.
        self.held: list[Any] = []
        self._module_set: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._roots_cache: tuple[tuple[int, int], list[weakref.ref[torch.nn.Module]]] | None = None
        self.hooks: list[Any] = []
        self.resume: _Found | None = None
        self.resumed_index: int | None = None
        self.resume_label = ""  # "checkpoint <index> (step <step>) of <store>", for messages
        # Older checkpoints to fall back on, newest first, loaded lazily; and the indices of this store's
        # checkpoints that were skipped (damaged, or not restorable into the live objects).
        self._candidates: Iterator[tuple[int | None, str, _Found]] = iter(())
        self.unrestorable: list[int] = []
        self.failures: list[str] = []  # why each skipped checkpoint was skipped
        self.fatal: ResumeError | None = None  # a restore failed for good: every later boundary raises it again
        self._warned_prune = False
        self.restored = False
        self.last_index: int | None = None
        self.last_step_written: int | None = None
        self.writes = 0
        self.error: str | None = None
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._writer: threading.Thread | None = None
        self._lock_fd: int | None = None
        self._store_lock = threading.Lock()
        # Buffers of the last snapshot written, reused by the next collection (Snapshot.spare).
        self._spare: dict[str, torch.Tensor] = {}
        self._spare_lock = threading.Lock()

    # ------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Take the store's run lock and find the checkpoint to resume from (errors raise: before training)."""
        self._take_lock()
        if not self.cfg.fresh:
            self.resume = self._find_resume()
        if self.resume is not None:
            ckpt, _ = self.resume
            self.step = self.start_step = int(ckpt.step or 0)
        self._writer = threading.Thread(target=self._write_loop, name="ravex-writer", daemon=True)
        self._writer.start()

    def _take_lock(self) -> None:
        store = self.store
        if store.exists() and not store.is_dir():
            raise RavexError(f"storage.path {store} exists and is not a directory", hint=f"set storage.path in {self.cfg.source} to a directory")
        store.mkdir(parents=True, exist_ok=True)
        if not (store / "ravex-store.json").is_file():
            self._refuse_unmarked(store)
            other = [p.name for p in store.iterdir()
                     if p.name not in ("lock", "manifest.json", "checkpoints") and ".tmp-" not in p.name and not TS_FILE.fullmatch(p.name)]
            if other:
                raise RavexError(f"storage.path {store} is not a Ravex store and not empty (it holds {', '.join(sorted(other)[:5])})",
                                 hint=f"point storage.path in {self.cfg.source} at a new or empty directory", path=store)
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
        _live.append(self)

    def _refuse_unmarked(self, store: Path) -> None:
        """A directory holding a store's manifest or checkpoints but no marker is a damaged store, not an
        empty directory: starting over there would discard its checkpoints."""
        held = [n for n in ("manifest.json", "checkpoints") if os.path.lexists(store / n)]
        if held == ["checkpoints"] and (store / "checkpoints").is_dir() and not (store / "checkpoints").is_symlink() \
                and not any((store / "checkpoints").iterdir()):
            held = []  # an empty checkpoints/ is what an interrupted creation leaves: nothing to lose
        if held:
            raise IncompleteCheckpointError(
                f"storage.path {store} holds {' and '.join(held)} of a Ravex store but not its marker ravex-store.json; "
                "Ravex does not take it for an empty directory (that would start over and discard its checkpoints)",
                hint=f"if it is your store, put its ravex-store.json back (a copy, or see docs/format.md section 2); "
                     f"to start a new run, set storage.path in {self.cfg.source} to a new directory", path=store / "ravex-store.json")

    def _find_resume(self) -> _Found | None:
        """The checkpoint to resume from; ``self._candidates`` keeps the older ones a failed restore falls back on."""
        src = self.cfg.resume_from
        if isinstance(src, str) and src.endswith(".pt"):
            return self._only(None, f"checkpoint {src}", load_torch_save(Path(src)))
        if isinstance(src, int) and self.cfg.backend == "torch_save":
            files = torch_save_files(self.store)
            found = files.get(src) if src >= 0 else (list(files.values())[src] if -src <= len(files) else None)
            if found is None:
                raise RavexError(f"resume_from {src}: {self.store} holds no such checkpoint (it has {len(files)})", hint="use -1 for the newest")
            return self._only(int(found.name[5:13]), f"checkpoint {found}", load_torch_save(found))
        if isinstance(src, str):
            p = Path(src)
            if (p / "ravex-store.json").is_file():
                self._candidates = self._native_candidates(p)
                return self.next_candidate(first=True)
            if (p / "checkpoint.json").is_file():
                return self._only(None, f"checkpoint {p}", load_checkpoint(p))
            raise RavexError(f"resume_from {src}: neither a Ravex store nor a checkpoint directory of one",
                             hint=f"set resume_from in {self.cfg.source} to a store, a checkpoints/<index> directory, or an index", path=p)
        if isinstance(src, int):
            ckpt, tensors = load_checkpoint(self.store, src)
            index = ckpt.source.get("index")
            return self._only(index, f"checkpoint {index} (step {ckpt.step}) of {self.store}", (ckpt, tensors))
        if self.cfg.backend == "torch_save":
            self._candidates = self._torch_save_candidates()
            return self.next_candidate(first=True)
        if not (self.store / "ravex-store.json").is_file():
            return None
        self._candidates = self._native_candidates(self.store)
        return self.next_candidate(first=True)

    def _only(self, index: int | None, label: str, found: _Found) -> _Found:
        """A checkpoint the configuration names: nothing to fall back on."""
        self.resumed_index, self.resume_label = index, label
        log.warning("ravex: resuming from %s", label)
        return found

    def next_candidate(self, first: bool = False) -> _Found | None:
        """The next checkpoint to try, newest first; None when there is none left."""
        for index, label, found in self._candidates:
            self.resumed_index, self.resume_label = index, label
            log.warning("ravex: %s %s", "resuming from" if first else "falling back to", label)
            return found
        self.resumed_index = None
        if self.failures:
            # Every checkpoint there is was tried: never start over on a store whose checkpoints are all damaged.
            more = f"\n  ... and {len(self.failures) - 5} older ones" if len(self.failures) > 5 else ""
            raise ResumeError(f"{self.store}: no checkpoint of the store can be resumed from:\n  - " + "\n  - ".join(self.failures[:5]) + more,
                              hint="fix what the error names (" + _SAME_RUN_HINT + "), restore the store from a copy, "
                                   "or set fresh: true (RAVEX_FRESH=1) to start over", path=self.store)
        return None

    def _skipped(self, store: Path, index: int | None, why: str) -> None:
        self.failures.append(why)
        if store == self.store and index is not None and index not in self.unrestorable:
            self.unrestorable.append(index)

    def _native_candidates(self, store: Path) -> Iterator[tuple[int | None, str, _Found]]:
        from ravex_convert.formats import native

        manifest = native.read_manifest(store)
        entries = [e for e in manifest["checkpoints"] if isinstance(e, dict) and e.get("status") == "complete"]
        for e in reversed(entries):
            index = int(e["index"])
            try:
                ckpt, tensors = load_checkpoint(store, index)
            except RavexError as exc:  # CorruptCheckpointError, IncompleteCheckpointError and the rest: skip it
                log.warning("ravex: checkpoint %s of %s is damaged and is skipped: %s", index, store, exc)
                self._skipped(store, index, exc.message)
                continue
            yield (index if store == self.store else None), f"checkpoint {index} (step {ckpt.step}) of {store}", (ckpt, tensors)

    def _torch_save_candidates(self) -> Iterator[tuple[int | None, str, _Found]]:
        for i, path in reversed(list(torch_save_files(self.store).items())):
            try:
                found = load_torch_save(path)
            except Exception as exc:  # noqa: BLE001 - torch.load reports damage in many exception types
                log.warning("ravex: checkpoint %s is damaged and is skipped: %s", path, exc)
                self._skipped(self.store, i, f"checkpoint {path}: {exc}")
                continue
            yield i, f"checkpoint {i} (step {found[0].step}) of {self.store}", found

    def stop(self, wrote_final: bool) -> None:
        self.flush()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.held = []
        with self._spare_lock:
            self._spare = {}
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self in _live:
            _live.remove(self)
        self.active = self.counting = False

    def disable(self, why: str) -> None:
        if self.active:
            log.error("ravex: disabled for the rest of this run: %s; training continues without checkpoints", why)
        self.error = why
        self.active = False

    # ------------------------------------------------------------ noticing

    def notice_module(self, m: torch.nn.Module) -> None:
        if m in self._module_set:
            return
        self._module_set.add(m)
        self.modules.append(weakref.ref(m))
        if len(self.modules) > 2 * len(self._module_set) + 64:
            self.modules = [r for r in self.modules if r() is not None]  # modules built and dropped inside the loop

    def notice_optimizer(self, opt: Any) -> None:
        if any(r() is opt for r in self.optimizers):
            return
        self.optimizers.append(weakref.ref(opt))
        first = len(self.optimizers) == 1
        if first:
            self.hooks.append(opt.register_step_post_hook(lambda o, a, k: self._safe(self.on_step, always=True)))

    def notice_scheduler(self, s: Any) -> None:
        if not any(r() is s for r in self.schedulers):
            self.schedulers.append(weakref.ref(s))

    def notice_scaler(self, s: Any) -> None:
        if not any(r() is s for r in self.scalers):
            self.scalers.append(weakref.ref(s))

    def notice_loader(self, loader: Any) -> LoaderState:
        for r, st in self.loaders:
            if r() is loader:
                return st
        st = LoaderState(loader, len(self.loaders))
        self.loaders.append((weakref.ref(loader), st))
        return st

    def loader_state(self, loader: Any) -> LoaderState:
        return self.notice_loader(loader)

    def track(self, obj: Any, name: str) -> None:
        if isinstance(obj, torch.nn.Module):
            self.notice_module(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.notice_optimizer(obj)
        elif isinstance(obj, torch.utils.data.DataLoader):
            self.notice_loader(obj)
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise RavexError(f"ravex.track({type(obj).__name__}): the object has no state_dict()/load_state_dict()",
                             hint="track objects that can save and load their state")
        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)):
            self.tracked[name] = obj

    def _safe(self, fn: Any, *args: Any, always: bool = False) -> Any:
        """Every hook goes through here: a failure in Ravex never reaches the training code.
        ``always``: runs while steps are counted even after checkpointing was switched off by a failure."""
        if self.fatal is not None and always:
            raise self.fatal  # the restore failed for good: no iteration, no step may go on
        if not (self.active or (always and self.counting)):
            return None
        try:
            return fn(*args)
        except (StopRun, SystemExit, ResumeError):
            raise
        except Exception as exc:  # a hook must never break training
            log.exception("ravex: internal error in %s", getattr(fn, "__name__", fn))
            self.disable(f"{type(exc).__name__}: {exc}")
            return None

    # ------------------------------------------------------------ events

    def on_step(self) -> None:
        self.step += 1
        self.steps_since_boundary += 1
        if self.step % self.cfg.checkpoint_every == 0:
            self.due = True
        if not self.boundary_seen and not self.warned_boundary and self.step - self.start_step >= _WARN_AFTER_STEPS:
            self.warned_boundary = True
            log.warning("ravex: %d optimizer steps and no iteration boundary seen: no DataLoader is iterated and ravex.batch_boundary() "
                        "is not called, so no checkpoint can be collected; call ravex.batch_boundary() at the top of each iteration",
                        self.step - self.start_step)

    def boundary(self) -> None:
        """The top of an iteration: restore (once), then checkpoint when due, stop at max_steps or on SIGTERM."""
        if not self.active:
            if self.counting and self.at_max_steps():
                raise StopRun()
            return
        self.boundary_seen = True
        stepped, self.steps_since_boundary = self.steps_since_boundary > 0, 0
        self.held = [*self._roots(), *(x for group in (self.optimizers, self.schedulers, self.scalers) for r in group if (x := r()) is not None),
                     *(x for r, _ in self.loaders if (x := r()) is not None)]
        if not self.restored:
            self.restore()
        if self.preempted and not stepped and self.preempt_waits < _PREEMPT_WAIT_BOUNDARIES:
            # Mid-way through gradient accumulation the gradients are part of the state and no
            # checkpoint holds them: wait for the boundary after the next optimizer step.
            self.preempt_waits += 1
        elif self.preempted:
            self.collect()
            self.flush()
            if self.error is None:
                log.warning("ravex: SIGTERM received; checkpoint at step %d written, exiting", self.step)
            else:
                log.error("ravex: SIGTERM received; the checkpoint at step %d could not be written (%s), exiting", self.step, self.error)
            raise SystemExit(0)
        if self.due:
            self.due = False
            self.collect()
        if self.cfg.max_steps is not None and self.step >= self.cfg.max_steps:
            raise StopRun()

    def boundary_restore_only(self) -> None:
        """``iter(loader)``: restore (once) before the iterator is built, so it can continue the saved position."""
        if not self.restored:
            self.restore()

    def at_max_steps(self) -> bool:
        return self.counting and self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    # ------------------------------------------------------------ collection

    def _roots(self) -> list[torch.nn.Module]:
        key = (len(self.modules), len(self.optimizers))
        if self._roots_cache is not None and self._roots_cache[0] == key and all(r() is not None for r in self._roots_cache[1]):
            return [m for r in self._roots_cache[1] if (m := r()) is not None]
        roots = self._find_roots()
        self._roots_cache = (key, [weakref.ref(m) for m in roots])
        return roots

    def _find_roots(self) -> list[torch.nn.Module]:
        mods = [m for r in self.modules if (m := r()) is not None]
        children: set[int] = set()
        for m in mods:
            for c in m.modules():
                if c is not m:
                    children.add(id(c))
        # Roots that hold state, the one owning the first optimizer's parameters first: that one is "the model"
        # (model/<fqn>); a loss module built earlier holds no state and is left out.
        roots = [m for m in mods if id(m) not in children and _has_state(m)]
        opt = next((o for r in self.optimizers if (o := r()) is not None), None)
        if opt is not None:
            first = {id(p) for g in opt.param_groups for p in g["params"]}
            roots.sort(key=lambda m: not any(id(p) in first for p in m.parameters()))
        return roots

    def _param_names(self, roots: list[torch.nn.Module]) -> dict[int, str]:
        names: dict[int, str] = {}
        for i, m in enumerate(roots):
            for n, p in m.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n if i == 0 else f"model{i}.{n}")
        return names

    def collect(self, final: bool = False) -> None:
        """Copy the state now (training thread) and queue it for the writer."""
        if not self.active:
            return
        if self.last_step_written == self.step and final:
            return
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        snap = Snapshot(step=self.step, spare=spare)
        roots = self._roots()
        for i, m in enumerate(roots):
            for k, v in m.state_dict().items():
                if isinstance(v, torch.Tensor):
                    snap.add(f"{MODEL}{k}" if i == 0 else f"{OBJ}model.{i}/{k}", v)
        if not roots:
            log.warning("ravex: no model is known at step %d (none was built inside the decorated function, or it is gone); "
                        "no checkpoint is written. Use ravex.track(model).", self.step)
            return
        names = self._param_names(roots)
        opts = [o for r in self.optimizers if (o := r()) is not None]
        for i, opt in enumerate(opts):
            if i == 0:
                snap.objects.update(self._capture_optimizer(snap, opt, names))
            else:
                snap.objects[f"optimizer.{i}"] = snap.flatten(opt.state_dict(), f"optimizer.{i}")
        for i, s in enumerate(x for r in self.schedulers if (x := r()) is not None):
            snap.objects["lr_scheduler" if i == 0 else f"lr_scheduler.{i}"] = snap.flatten(s.state_dict(), f"lr_scheduler.{i}")
        for i, s in enumerate(x for r in self.scalers if (x := r()) is not None):
            snap.objects["loss_scaler" if i == 0 else f"loss_scaler.{i}"] = snap.flatten(s.state_dict(), f"loss_scaler.{i}")
        snap.objects["tracked"] = {name: snap.flatten(obj.state_dict(), f"tracked/{name}") for name, obj in self.tracked.items()}
        snap.objects["rng"] = capture_rng(snap, "rng")
        snap.objects["loaders"] = [st.capture(snap, ld) if (ld := r()) is not None else None for r, st in self.loaders]
        snap.objects["step"] = self.step
        snap.objects["extra"] = {"ravex_run_id": self.run_id}
        self.last_step_written = self.step
        snap.spare = {}  # buffers of tensors that are gone: let them go
        self._queue.put(snap)

    def _capture_optimizer(self, snap: Snapshot, opt: Any, names: dict[int, str]) -> dict[str, Any]:
        sd = opt.state_dict()
        pnames: list[str] = []
        for g in opt.param_groups:
            for p in g["params"]:
                pnames.append(names.get(id(p), f"param.{len(pnames)}"))
        scalars: dict[str, dict[str, Any]] = {}
        for pid, st in sd["state"].items():
            fqn = pnames[pid]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    snap.add(f"{OPTIM}{k}/{fqn}", v)
                else:
                    scalars.setdefault(fqn, {})[k] = v
        groups = []
        for g in sd["param_groups"]:
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [pnames[i] for i in g["params"]]})
        return {"optim.param_groups": snap.flatten(groups, "optim.param_groups"), "optim.scalars": scalars}

    # ------------------------------------------------------------ writing

    def _write_loop(self) -> None:
        _background_priority()
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                if self.error is None:
                    self._write(snap)
            except Exception as exc:  # noqa: BLE001 - a failing write disables Ravex, training goes on
                log.error("ravex: writing the checkpoint of step %d to %s failed: %s", snap.step if snap else -1, self.store, exc)
                self.disable(f"checkpoint write failed: {exc}")
            finally:
                if snap is not None and self.active:
                    with self._spare_lock:
                        self._spare = snap.tensors  # written (or failed): the next collection may overwrite them
                self._queue.task_done()

    def _write(self, snap: Snapshot) -> None:
        from ravex_convert._output import Options
        from ravex_convert.formats import native_write

        ckpt = to_checkpoint(snap, self.store)
        if self.cfg.backend == "torch_save":
            with self._store_lock:
                self._write_torch_save(ckpt)
            return
        opts = Options(compression=None if self.cfg.compression == "none" else self.cfg.compression, threads=WRITER_THREADS)
        with self._store_lock:
            result = native_write.write(ckpt, self.store, opts, run_id=self.run_id.replace(".", "-"))
            for w in result.get("warnings", []):
                log.warning("ravex: %s", w)
            self.last_index = int(result["index"])
            self.writes += 1
            if self.cfg.keep_last is not None and self._may_prune():
                pinned = {self.resumed_index} if self.resumed_index is not None else set()
                native_write.prune(self.store, self.cfg.keep_last, pinned=pinned)

    def _write_torch_save(self, ckpt: Checkpoint) -> None:
        """One ``ckpt-<index>.pt`` per checkpoint, in the portable torch.save layout (written to a
        temporary name and renamed into place by the torch_save writer); keep_last by file."""
        from ravex_convert._output import Options
        from ravex_convert.formats import torch_save

        files = torch_save_files(self.store)
        index = max(files, default=-1) + 1
        torch_save.write(ckpt, self.store / f"ckpt-{index:08d}.pt", Options(threads=WRITER_THREADS))
        self.last_index = index
        self.writes += 1
        if self.cfg.keep_last is not None and self._may_prune():
            files = torch_save_files(self.store)
            for i in list(files)[:-self.cfg.keep_last]:
                if i != self.resumed_index:
                    files[i].unlink()

    def _may_prune(self) -> bool:
        """keep_last is not applied in a run that skipped a checkpoint of its store it could not read or
        restore: the store is kept whole (the skipped ones for inspection, every good one) until a run
        resumes from its newest checkpoint."""
        if not self.unrestorable:
            return True
        if not self._warned_prune:
            self._warned_prune = True
            log.warning("ravex: keep_last is not applied in this run: checkpoint(s) %s of %s could not be read or restored, so nothing is pruned; "
                        "inspect them with `ravex status`", ", ".join(str(i) for i in self.unrestorable), self.store)
        return False

    def flush(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    # ------------------------------------------------------------ restore

    def restore(self) -> None:
        """Put the resume checkpoint into the live objects (at the first iteration boundary), all or nothing.
        One that does not fit them is reported and the previous complete checkpoint tried; when none is
        left, :class:`ResumeError` stops the run before its first step."""
        self.restored = True
        try:
            while self.resume is not None:
                ckpt, tensors = self.resume
                try:
                    restore_into(self, ckpt, tensors, weights_only=False, where=self.resume_label)
                except ResumeError:
                    raise
                except Exception as exc:  # noqa: BLE001 - whatever the reason, nothing was restored: try the one before
                    why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
                    log.error("ravex: %s cannot be restored into this run: %s", self.resume_label, why)
                    self._skipped(self.store, self.resumed_index, why if why.startswith(self.resume_label) else f"{self.resume_label}: {why}")
                    self.resume = None
                    del ckpt, tensors
                    self.resume = self.next_candidate()
                    continue
                if not isinstance(ckpt.objects.get("step"), int):
                    self.step = int(ckpt.step or 0)
                self.start_step = self.step
                self.resume = None  # restored: its tensors are no longer needed
                if self.unrestorable:
                    log.warning("ravex: resumed from %s, not from the newest checkpoint: %s could not be used (see above)", self.resume_label,
                                ", ".join(str(i) for i in self.unrestorable))
                return
        except ResumeError as exc:
            self.fatal = exc
            self.error = exc.message
            self.active = self.counting = False
            log.error("ravex: the run stops before its first step: %s", exc.message.splitlines()[0])
            raise

    def apply(self, ckpt: Checkpoint, tensors: dict[str, torch.Tensor], weights_only: bool, where: str = "the checkpoint") -> None:
        """Restore ``ckpt`` into the live objects, all or nothing (``ravex.restore``); raises when it does not fit."""
        restore_into(self, ckpt, tensors, weights_only=weights_only, where=where)
