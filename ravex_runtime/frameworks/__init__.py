"""Frameworks that drive the training loop: Hugging Face ``Trainer``, Lightning, Accelerate.

The decorator sees what any loop builds (models, optimizers, schedulers,
DataLoaders). A framework adds two things the patches on PyTorch cannot see:

- its own progress (the HF Trainer's ``state``, Lightning's fit loop), which
  decides when the framework stops: saved as a tracked object, and put back
  before the framework reads it (hf.py, lightning.py);
- wrappers that read a DataLoader ahead (accelerate.py): the position and the
  boundary move to where the user takes the batch (patches.read_ahead).

Nothing here imports a framework. Each is hooked when the script first reaches
it: one imported already at the start of the decorated call is hooked then; one
imported later (``transformers.Trainer`` is loaded lazily, at first touch) is
hooked the moment its import completes, by a finder on ``sys.meta_path`` that
is there only while the call runs. Each hook patches the framework's classes
with ``patch`` (patches.apply's), so they are put back when the call ends. A
framework that cannot be hooked is said at ERROR, once, when it is met: before
the first step it drives.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Hooks", "warn_own_checkpoints"]

log = logging.getLogger("ravex")

Patch = Callable[[Any, str, Callable[[Any], Any]], None]

# module that marks the framework as imported -> the module of ours that hooks it
_FRAMEWORKS = (("accelerate.data_loader", "accelerate"), ("transformers.trainer", "hf"), ("lightning.pytorch", "lightning"),
               ("pytorch_lightning", "lightning"))


# a framework is hooked when its marker module and its top-level package have both finished importing
_WATCHED = frozenset(name for marker, _ in _FRAMEWORKS for name in (marker, marker.partition(".")[0]))


def _initializing(module: Any) -> bool:
    """The module is being imported still (importlib sets ``__spec__._initializing`` while it runs)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class Hooks:
    """The frameworks hooked in one decorated call. :meth:`close` takes its import finder away."""

    def __init__(self, rt: Any, patch: Patch):
        self.rt, self.patch = rt, patch
        self.done: set[str] = set()
        self.failed: dict[str, str] = {}  # framework -> why it could not be hooked
        self.seen_modules = 0
        self._finder = _Finder(self)
        sys.meta_path.insert(0, self._finder)

    def close(self) -> None:
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def check(self, force: bool = False) -> None:
        """Hook every framework imported since the last check (a cheap test when nothing was)."""
        if len(sys.modules) == self.seen_modules and not force:
            return
        self.seen_modules = len(sys.modules)
        for module, ours in _FRAMEWORKS:
            if module in self.done or module not in sys.modules:
                continue
            top = sys.modules.get(module.partition(".")[0])
            if _initializing(sys.modules[module]) or _initializing(top):
                continue  # hooked when the import is complete (the finder calls again)
            self.done.add(module)
            from importlib import import_module

            hook = import_module(f"{__name__}.{ours}")
            try:
                hook.apply(self.rt, self.patch, sys.modules[module])
            except Exception as exc:  # noqa: BLE001 - a framework version whose classes differ: the plain patches still work
                name = module.split(".")[0]
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                log.error("ravex: %s is imported but could not be hooked (%s: %s): if it drives this run's loop, its own progress "
                          "(step, epoch) is not saved, and a resumed run trains its whole budget again; the model, optimizer and "
                          "data position are still checkpointed", name, type(exc).__name__, exc)


class _Loader(importlib.abc.Loader):
    """A watched module's own loader, and the hooks checked once the module has run."""

    def __init__(self, inner: Any, hooks: Hooks):
        self._inner, self._hooks = inner, hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        out: types.ModuleType | None = self._inner.create_module(spec)
        return out

    def exec_module(self, module: types.ModuleType) -> None:
        # the module keeps its real loader (its source, its resources), not this wrapper
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        spec = module.__spec__
        if spec is not None:
            spec._initializing = False  # type: ignore[attr-defined]  # importlib clears it just after this returns
        try:
            self._hooks.rt._safe(self._hooks.check, True)
        finally:
            if spec is not None:
                spec._initializing = True  # type: ignore[attr-defined]  # as importlib left it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while a decorated call runs: a watched module is found by the finders
    after it, as always, and its loader wrapped so that the frameworks are checked when it has run."""

    def __init__(self, hooks: Hooks):
        self._hooks = hooks

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self._hooks)
                return spec
        return None


_warned: set[str] = set()


def warn_own_checkpoints(framework: str, how: str) -> None:
    """Once per framework and process: its own checkpointing is on too."""
    if framework in _warned:
        return
    _warned.add(framework)
    log.warning("ravex: %s writes checkpoints of its own as well, so the weights are written twice; %s", framework, how)
