"""The public runtime API that ``ravex`` re-exports: the decorator and its helpers."""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ravex_convert.errors import RavexError

from .config import enabled, load_config

if TYPE_CHECKING:  # the runtime imports torch: loaded when a decorated function is called
    from .runtime import Runtime

__all__ = [
    "batch_boundary", "checkpoint", "deactivate", "flush", "is_active", "load_model", "load_weights", "restore", "status", "step", "track",
    "train_loop",
]

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("ravex")
_current: Runtime | None = None  # the Runtime of the decorated call in progress, if any


def _rt() -> Runtime | None:
    return _current if _current is not None and _current.active else None


class _RankZeroSays(logging.Filter):
    """On many ranks the job's messages are rank 0's to say: another rank logs its errors, and the
    warnings about itself alone (``extra={"every_rank": True}``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(getattr(record, "every_rank", False))


def _logging(log_file: Path | None) -> logging.Handler:
    from .dist import topology

    topo = topology()
    handler: logging.Handler = logging.FileHandler(log_file) if log_file is not None else logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    where = f"[rank {topo.rank}] " if topo.distributed else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {where}%(message)s"))
    if topo.rank != 0:
        handler.addFilter(_RankZeroSays())
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False
    return handler


def train_loop(fn: F | None = None, *, preemption_handler: bool = False) -> Any:
    """Checkpoint the run of the function that trains, and resume it when it is started again.

    While the decorated function runs, Ravex notices the models, optimizers, LR schedulers,
    GradScalers and DataLoaders it builds, counts ``optimizer.step()`` calls, and every
    ``checkpoint_every`` steps copies the state at the top of an iteration and writes it in the
    background to ``storage.path``. Started again on a store that holds checkpoints, it puts the
    newest complete one into the live objects at the first iteration boundary (weights, optimizer,
    schedulers, scaler, random states, data position), so the run goes on bit-identically. The
    configuration is read when the function is called: defaults < ``ravex.yaml`` < ``RAVEX_*``
    (docs/configuration.md); with ``RAVEX_ENABLED=0`` the function runs untouched. A failure of
    Ravex's own while training switches it off and is logged; training goes on.

    Args:
        fn (Callable, optional): the function. Both ``@ravex.train_loop`` and
            ``@ravex.train_loop(preemption_handler=True)`` work.
        preemption_handler (bool, optional): turn SIGTERM into a checkpoint at the next iteration
            boundary and a clean exit (status 0). Default: False.

    Returns:
        The decorated function. It returns what ``fn`` returns (None when ``max_steps`` stopped it).

    Raises:
        RavexError: when the decorated function is called, before any training: the configuration
            is wrong, the store is not one or another run holds it, or a decorated function is
            already running in this process.
        ResumeError: no checkpoint of the store can be put into the live objects (when the function
            is called, or at its first iteration boundary: before the first step).

    Example::

        @ravex.train_loop
        def train():
            model = Net()
            opt = torch.optim.AdamW(model.parameters())
            for x, y in DataLoader(data, batch_size=32, shuffle=True):
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    """

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return f(*args, **kwargs)
            return _run(f, preemption_handler, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


def _run(f: Callable[..., Any], preemption_handler: bool, args: Any, kwargs: Any) -> Any:
    global _current
    from . import patches
    from .runtime import Runtime, StopRun

    if _current is not None:
        raise RavexError("ravex.train_loop: a decorated function is already running in this process", hint="decorate only the outermost training function")
    cfg = load_config()  # errors here: before any training
    handler = _logging(cfg.log_file)
    try:
        rt = Runtime(cfg, preemption_handler)  # takes the store: errors here, before any training too
        rt.start()
    except BaseException:
        log.removeHandler(handler)
        handler.close()
        raise
    _current = rt
    undo = patches.apply(rt)
    old_term: Any = None
    if preemption_handler and threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: Any) -> None:
            if rt.active:
                rt.preempted = True
                return
            # Ravex switched itself off: nothing will checkpoint and exit, so SIGTERM does what it did before
            signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        old_term = signal.signal(signal.SIGTERM, on_term)
    ok = False
    try:
        try:
            out = f(*args, **kwargs)
        except StopRun:
            out = None
        ok = True
        return out
    except SystemExit as exc:
        ok = rt.preempted or exc.code in (0, None)
        raise
    finally:
        undo()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        try:
            if rt.active:
                # consistent: the function finished, or it failed at an iteration boundary, not in the middle of a step
                rt.final_checkpoint(consistent=ok or rt.steps_since_boundary == 0)
            rt.stop(wrote_final=True)
        except Exception as exc:  # noqa: BLE001 - Ravex failing at exit must not replace the user's outcome
            log.error("ravex: the final checkpoint failed: %s", exc)
        finally:
            _current = None
            log.removeHandler(handler)
            handler.close()


def track(*objs: Any, name: str | None = None) -> None:
    """Name objects Ravex should save and restore: anything with ``state_dict``/``load_state_dict``
    (an EMA, a custom sampler), or a model/optimizer/DataLoader built outside the decorated function."""
    rt = _rt()
    if rt is None:
        return
    for i, obj in enumerate(objs):
        # Unnamed: the type and how many objects were tracked by name before it, the same in a
        # resumed run that tracks the same objects in the same order.
        key = name if name is not None and len(objs) == 1 else (f"{name}.{i}" if name is not None else
                                                                 f"{type(obj).__name__}.{len(rt.session.tracked().named)}")
        rt.track(obj, key, named=name is not None)


def batch_boundary() -> None:
    """Mark the top of an iteration in a loop without a DataLoader: checkpoints are collected here.
    Raises an internal stop (the decorated function returns) once ``max_steps`` is reached."""
    rt = _current
    if rt is not None:
        rt._safe(rt.boundary, always=True)


def checkpoint() -> None:
    """Collect a checkpoint now (call it at the top of an iteration); written in the background."""
    rt = _rt()
    if rt is not None:
        if not rt.restored:
            rt._safe(rt.restore)
        rt._safe(rt.collect)


def flush() -> None:
    """Wait until every collected checkpoint is written."""
    rt = _rt()
    if rt is not None:
        rt.flush()


def step() -> int:
    """The global optimizer step, counted across restarts (0 outside a run)."""
    rt = _current
    return int(rt.step) if rt is not None else 0


def is_active() -> bool:
    """Whether a decorated function is running with Ravex on."""
    return _rt() is not None


def deactivate() -> None:
    """Stop checkpointing for the rest of this run (the patches stay inert until the function returns)."""
    rt = _rt()
    if rt is not None:
        rt.flush()
        rt.active = rt.counting = False


def status() -> dict[str, Any]:
    """Where this run stands: active, step, store, the checkpoint it resumed from (and the bytes of it this
    rank read: its own part of a sharded model's), the last one written."""
    rt = _current
    if rt is None:
        return {"active": False, "step": 0}
    return {"active": bool(rt.active), "step": rt.step, "store": str(rt.store), "run_id": rt.run_id, "resumed_from": rt.resumed_index,
            "resumed_step": rt.start_step if rt.resume_label else None, "resumed_bytes_read": rt.session.resume_bytes_read,
            "last_index": rt.last_index, "checkpoints_written": rt.writes, "error": rt.error}


def restore(path: str | Path | None = None, index: int = -1, *, weights_only: bool = False) -> int:
    """Load checkpoint ``index`` of the store at ``path`` (default: this run's store) into the live
    objects of the running function; returns the checkpoint's step. ``weights_only`` loads the model only
    (a fine-tuning start) and leaves the step counter, optimizer and RNG alone."""
    from .loading import load_checkpoint

    rt = _current
    if rt is None:
        raise RavexError("ravex.restore() is called outside a @ravex.train_loop function", hint="call it inside the decorated function")
    from ravex_convert.storage import resolve

    store = resolve(path).path if path is not None else rt.store
    ckpt, tensors = load_checkpoint(store, index)
    # All or nothing: a checkpoint that does not fit the live objects raises with none of them touched
    # (and the automatic resume, if still due, still happens at the first iteration boundary).
    if rt.session.world_size > 1:
        from .restoring import for_rank

        ckpt = for_rank(ckpt, rt.session.rank, rt.session.world_size)  # this rank's own streams and position
    rt.session.apply(ckpt, tensors, weights_only=weights_only, where=f"checkpoint {ckpt.source.get('index')} (step {ckpt.step}) of {store}")
    if not weights_only:
        rt.restored = True
        rt.step = int(ckpt.step or 0)
    return int(ckpt.step or 0)


def load_weights(module: Any, path: str | Path, index: int = -1, *, strict: bool = True) -> int:
    """Load only the model weights of a native store's checkpoint into ``module`` (fine-tuning); returns its step."""
    from ravex_convert.model import MODEL
    from ravex_convert.storage import resolve

    from .loading import load_checkpoint, load_state

    ckpt, tensors = load_checkpoint(resolve(path).path, index)
    sd = {n[len(MODEL):]: t for n, t in tensors.items() if n.startswith(MODEL)}
    load_state(module, sd, f"checkpoint {ckpt.source.get('index')} of {path}", prefix=MODEL, strict=strict, path=path)
    return int(ckpt.step or 0)


def load_model(path: str | Path, index: int = -1, *, name: str = "model", trust: Iterable[str] | str = (), map_location: Any = "cpu") -> Any:
    """Rebuild a module from a native store's checkpoint, without the script that trained it: the
    class or factory its recipe names is called with the recorded arguments, and the checkpoint's
    weights are loaded into what it returns (any world size, any storage: a directory, ``objdir:``,
    ``s3://``). Returns the ``torch.nn.Module``.

    A recipe names code, so nothing is imported unless its top-level package is in ``trust``; what
    it names must be a ``torch.nn.Module`` subclass or a function annotated to return one
    (docs/security.md). Arguments are only the recorded data.

    Args:
        path: the store.
        index: which checkpoint (-1: the newest complete one).
        name: which module: ``"model"``, or a module tracked by name (``ravex.track(ema, name="ema")``).
        trust: the top-level packages whose code the recipe may import (``["my_project"]``, ``["transformers"]``).
        map_location: where the model is built and its weights put (a recorded ``torch.device`` argument becomes it).

    Raises:
        UntrustedRecipeError: the recipe names a package not in ``trust`` (nothing was imported).
        RecipeError: no recipe, or it cannot be rebuilt (missing or changed class, not a module, arguments that do not fit).
        LayoutMismatchError: what was built does not match the checkpoint's weights (nothing loaded)."""
    from .rebuild import load_model as load

    return load(path, index, name=name, trust=trust, map_location=map_location)
