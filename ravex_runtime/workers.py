"""The random state of DataLoader worker processes.

Random augmentation runs in the workers: ``__getitem__``, transforms and
``collate_fn`` draw from each worker's own torch, NumPy and Python generators
(seeded by the DataLoader from its base seed and the worker id), and from any
generator object the dataset holds (a ``numpy.random.default_rng`` made in
``worker_init_fn``, say). Two things here make those draws continue exactly
after a resume:

- a resumed epoch is *replayed* in the workers: the DataLoader is rebuilt from
  the random state at the start of the epoch (the same base seed, so the same
  worker seeds and the same index order) and the batches already trained on are
  loaded again and dropped, so every worker reaches the next batch with exactly
  the state it had in the uninterrupted run, whatever hidden state it keeps
  (sampler.py does this);
- persistent workers keep their streams from one epoch to the next, so replaying
  the current epoch is not enough: with ``persistent_workers=True`` each batch
  carries its worker's state out of the worker (:class:`StampCollate`), and a
  resumed worker is put back to the state it had at the start of the epoch
  (:class:`ResumeInit`) before the epoch is replayed.

Everything here is picklable, for the ``spawn`` and ``forkserver`` start methods.

It also ties each worker's life to the trainer that started it (:func:`tied_workers`):
torch's worker watches the parent it finds when its loop begins, so one forked just
before its trainer is killed watches pid 1 and lives on.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ResumeInit", "StampCollate", "Stamped", "TieInit", "apply_states", "check_states", "rng_objects", "tied_workers", "worker_states"]

# Generators held by the dataset (or by an object it holds: a transform) are found
# this deep; the state of a deeper or unnamed one (a closure's) is not carried
# across epochs by persistent workers (it is still exact within an epoch: replay).
_DEPTH = 2
_MAX_OBJECTS = 64


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return numpy


def rng_objects(root: Any, skip: tuple[str, ...] = (), depth: int = _DEPTH) -> dict[str, Any]:
    """Generator objects reachable from ``root`` through attributes, by attribute path
    (not through the attributes named in ``skip``)."""
    np = _numpy()
    kinds: tuple[type, ...] = (random.Random, torch.Generator)
    if np is not None:
        kinds = (*kinds, np.random.Generator, np.random.RandomState)
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, level: int) -> None:
        if id(obj) in seen or len(found) >= _MAX_OBJECTS:
            return
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found[path] = obj
            return
        if level >= depth:
            return
        try:
            attrs = vars(obj)
        except TypeError:
            return
        for name in sorted(attrs):
            if name in skip:
                continue
            value = attrs[name]
            if isinstance(value, (str, bytes, int, float, bool, type(None), torch.Tensor)):
                continue
            walk(value, f"{path}.{name}" if path else name, level + 1)

    walk(root, "", 0)
    return found


def _object_state(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return bytes(obj.get_state().numpy().tobytes())
    if isinstance(obj, random.Random):
        return obj.getstate()
    np = _numpy()
    if isinstance(obj, np.random.RandomState):
        name, keys, pos, has_gauss, cached = obj.get_state(legacy=True)
        return (name, bytes(keys.tobytes()), int(pos), int(has_gauss), float(cached))
    return obj.bit_generator.state  # numpy Generator: a dict of ints and strings


def _set_object_state(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return
    if isinstance(obj, random.Random):
        obj.setstate(_as_python_state(state))
        return
    np = _numpy()
    if isinstance(obj, np.random.RandomState):
        name, keys, pos, has_gauss, cached = state
        obj.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
        return
    obj.bit_generator.state = state


def _as_python_state(state: Any) -> Any:
    version, internal, gauss = state
    return (int(version), tuple(int(x) for x in internal), gauss)


def worker_states(dataset: Any) -> dict[str, Any]:
    """This process's generators, and those the dataset holds, as plain values."""
    out: dict[str, Any] = {"torch": bytes(torch.get_rng_state().numpy().tobytes()), "python": random.getstate()}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = (name, bytes(keys.tobytes()), int(pos), int(has_gauss), float(cached))
    objects = {path: _object_state(obj) for path, obj in rng_objects(dataset).items()}
    if objects:
        out["objects"] = objects
    return out


def apply_states(states: dict[str, Any], dataset: Any) -> None:
    """Put this process's generators, and the dataset's, back to ``states``."""
    torch.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
    random.setstate(_as_python_state(states["python"]))
    np = _numpy()
    if np is not None and "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    objects = rng_objects(dataset)
    for path, state in (states.get("objects") or {}).items():
        if path in objects:
            _set_object_state(objects[path], state)


def check_states(states: Any) -> None:
    """Raise ValueError unless ``states`` is what :func:`worker_states` makes and each
    generator accepts it: checked in the main process, before any worker starts."""
    if not isinstance(states, dict) or "torch" not in states or "python" not in states:
        raise ValueError("not a mapping with 'torch' and 'python' states")
    if not isinstance(states["torch"], bytes):
        raise TypeError("the torch state is not bytes")
    torch.Generator().set_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
    py = states["python"]
    if not isinstance(py, (list, tuple)) or len(py) != 3 or not isinstance(py[1], (list, tuple)):
        raise ValueError("the Python random state is not (version, internal state, gauss_next)")
    random.Random().setstate(_as_python_state(py))
    np = _numpy()
    if "numpy" in states and np is not None:
        st = states["numpy"]
        if not isinstance(st, (list, tuple)) or len(st) != 5 or not isinstance(st[1], bytes) or len(st[1]) != 624 * 4:
            raise ValueError("the NumPy state is not ('MT19937', 624 words, pos, has_gauss, cached_gaussian)")
        np.random.RandomState().set_state((st[0], np.frombuffer(st[1], dtype=np.uint32).copy(), st[2], st[3], st[4]))
    objects = states.get("objects") or {}
    if not isinstance(objects, dict) or not all(isinstance(k, str) for k in objects):
        raise ValueError("the dataset's generator states are not a mapping by attribute path")


class Stamped:
    """A batch, with the state its worker's generators were left in after making it."""

    __slots__ = ("batch", "states", "worker")

    def __init__(self, batch: Any, worker: int, states: dict[str, Any]):
        self.batch, self.worker, self.states = batch, worker, states

    def pin_memory(self, *args: Any) -> Stamped:
        # The pin-memory thread pins what it is handed; pin the batch inside, as it would the batch.
        from torch.utils.data._utils.pin_memory import pin_memory

        return Stamped(pin_memory(self.batch, *args), self.worker, self.states)  # type: ignore[no-untyped-call]


_WATCHING = False


def _exit_with_parent() -> None:
    """In a worker: end it when the training process is gone. torch's own worker notices a
    dead parent only between batches, and then waits for its queue's feeder thread, which
    blocks for ever on a full pipe whose reading end the worker itself inherited — after a
    SIGKILL of the trainer the worker lives on, holding its memory (and the trainer's
    stdout). Stamped batches are larger, so that pipe fills sooner: Ravex watches."""
    global _WATCHING
    if _WATCHING:
        return
    _WATCHING = True
    _watch_parent(os.getppid())


class StampCollate:
    """``collate_fn`` for persistent workers: the user's collate, then the worker's state."""

    def __init__(self, inner: Callable[[Any], Any]):
        self.inner = inner

    def __call__(self, batch: Any) -> Any:
        out = self.inner(batch)
        info = torch.utils.data.get_worker_info()
        if info is None:
            return out
        _exit_with_parent()
        return Stamped(out, info.id, worker_states(info.dataset))


class ResumeInit:
    """``worker_init_fn`` of resumed persistent workers: the user's own first (it may
    seed or create generators), then each worker's state at the start of the epoch."""

    def __init__(self, inner: Callable[[int], Any] | None, states: dict[int, dict[str, Any]]):
        self.inner, self.states = inner, states

    def __call__(self, worker_id: int) -> None:
        if self.inner is not None:
            self.inner(worker_id)
        states = self.states.get(worker_id)
        if states is not None:
            info = torch.utils.data.get_worker_info()
            apply_states(states, info.dataset if info is not None else None)


# ---------------------------------------------------------------- workers end with their trainer
#
# torch's worker learns its manager from os.getppid() when its loop starts, after the
# dataset's seeding and worker_init_fn: a worker whose trainer is SIGKILLed before that
# (a preemption at start-up, or during a resume's replay) records pid 1 as its manager,
# never sees it die, and lives on with its memory. Ravex ties the worker to the process
# it was started from instead, right after the fork: the kernel's parent-death signal
# (prctl PR_SET_PDEATHSIG, SIGKILL), then a check that this parent is still the one the
# trainer recorded before forking (it may have died before the signal was armed).

_PR_SET_PDEATHSIG = 1
_prctl: Any = None
_hooked = False
# While the patched DataLoader.__iter__ starts workers: (trainer pid, forking thread, whether
# that thread is the main thread). A fork from any other thread meanwhile is not a worker.
_starting: tuple[int, int, bool] | None = None


def _load_prctl() -> Any:
    global _prctl
    if _prctl is None and sys.platform == "linux":
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl or None


def _tie(parent: int | None, signal_ok: bool) -> None:
    """In a new worker: end it when its parent dies, and now if ``parent`` (the trainer's pid,
    None where the parent is not the trainer) is already gone."""
    prctl = _load_prctl()
    if signal_ok and prctl is not None:
        # The signal follows the parent *thread*: armed only when the main thread started the
        # worker (a loader iterated from a short-lived thread would otherwise lose its workers).
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    else:
        _watch_parent(os.getppid())
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def _watch_parent(parent: int) -> None:
    """A thread that ends this process once its parent is no longer ``parent``."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="ravex-parent-watch", daemon=True).start()


def _after_fork_child() -> None:
    global _starting
    starting, _starting = _starting, None
    if starting is not None and starting[1] == threading.get_ident():
        _tie(starting[0], starting[2])


@contextlib.contextmanager
def tied_workers(loader: Any) -> Iterator[None]:
    """Around ``iter(loader)``: the workers it starts end when this process dies. Forked
    workers are tied by a fork hook; ``spawn`` and ``forkserver`` workers by their
    ``worker_init_fn`` (:class:`TieInit`). Nothing else about the workers changes."""
    global _hooked, _starting
    if getattr(loader, "num_workers", 0) <= 0:
        yield
        return
    _load_prctl()
    if not _hooked:  # once per process; the hook does nothing outside this block
        os.register_at_fork(after_in_child=_after_fork_child)
        _hooked = True
    method = _start_method(loader)
    main = threading.current_thread() is threading.main_thread()
    init = loader.worker_init_fn
    if method != "fork":
        loader.worker_init_fn = TieInit(init, os.getpid() if method == "spawn" else None, main)
    previous = _starting
    _starting = (os.getpid(), threading.get_ident(), main)
    try:
        yield
    finally:
        _starting = previous
        if method != "fork":
            loader.worker_init_fn = init


def _start_method(loader: Any) -> str:
    ctx = getattr(loader, "multiprocessing_context", None)
    if ctx is not None:
        return str(ctx.get_start_method())
    # allow_none: asking must not fix the default (a later set_start_method would then fail);
    # unset, the default is the platform's first method.
    return str(multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0])


class TieInit:
    """``worker_init_fn`` of a worker that was not forked by the trainer itself: tie it to
    its parent before the user's own init runs. ``parent``: the trainer's pid (``spawn``),
    checked; None for a ``forkserver`` worker, whose parent is the fork server (it ends
    when the trainer does)."""

    def __init__(self, inner: Callable[[int], Any] | None, parent: int | None, signal_ok: bool):
        self.inner, self.parent, self.signal_ok = inner, parent, signal_ok

    def __call__(self, worker_id: int) -> None:
        _tie(self.parent, self.signal_ok)
        if self.inner is not None:
            self.inner(worker_id)
