"""What a session saves and restores: the live objects, held by weak references.

The decorator's patches notice every module, optimizer, LR scheduler, GradScaler
and DataLoader as it is built (the ``notice_*`` methods: idempotent, and a
failure there never reaches training, patches.py). One built and dropped inside
the loop must be let go, so they are held weakly. :meth:`Registry.track` (what
``Session.track`` calls) checks its arguments, notices them the same way and
holds a strong reference until :meth:`Registry.release`.

:meth:`Registry.tracked` is the view of one moment that a capture saves and a
restore is checked against (``state.Tracked``): the outermost modules that hold
state, the one owning the first optimizer's parameters first ("the model"),
looked through a DistributedDataParallel wrapper.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ravex_convert.errors import RavexError

from .sampler import LoaderState
from .state import Tracked

__all__ = ["Registry"]


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


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (its state, without the ``module.`` prefix:
    the same names as the model's in one process, or under FSDP2), else the module itself."""
    return m.module if isinstance(m, DistributedDataParallel) else m


class Registry:
    """The objects a session tracks. ``ddp``: a DistributedDataParallel wrapper was seen (and looked
    through); ``ddp_relayout``: one that lays its gradient buckets out again after its first step."""

    def __init__(self) -> None:
        # Modules by identity: a module's own __hash__/__eq__ may read attributes its __init__ has not
        # set yet when Module.__init__ tells Ravex of it (torchmetrics' Metric does), so no set or dict
        # of modules hashes one. id -> ref; an entry whose ref died is let go (the id may be reused).
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._roots_cache: tuple[tuple[int, int], list[weakref.ref[torch.nn.Module]]] | None = None
        self._optimizers: list[weakref.ref[Any]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._scalers: list[weakref.ref[Any]] = []
        self._loaders: list[tuple[weakref.ref[Any], LoaderState]] = []
        self._named: dict[str, Any] = {}
        self._held: list[Any] = []  # what track() was given: held strongly until release()
        self._seen_modules = 0  # modules noticed so far (the roots' cache key)
        self._live_modules = 0  # modules alive at the last sweep of dead entries
        self.ddp = False
        self.ddp_relayout = False

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None, loader: Any = None,
              named: dict[str, Any] | None = None) -> None:
        """``Session.track``: every argument checked first (an object of the wrong kind raises with
        nothing tracked), then noticed and held until :meth:`release`."""
        named = named or {}

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

    def release(self) -> None:
        """Drop the strong references :meth:`track` took (the session closes)."""
        self._held = []

    def notice_module(self, m: torch.nn.Module) -> None:
        known = self._modules.get(id(m))
        if known is not None and known() is m:
            return
        self._modules.pop(id(m), None)  # a dead module's id, reused: this one goes last, in construction order
        self._modules[id(m)] = weakref.ref(m)
        self._seen_modules += 1
        if len(self._modules) > self._live_modules * 2 + 64:
            # modules built and dropped inside the loop
            self._modules = {k: r for k, r in self._modules.items() if r() is not None}
            self._live_modules = len(self._modules)

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
        return Tracked(models=self._roots(), optimizers=_alive(self._optimizers), schedulers=_alive(self._schedulers),
                       scalers=_alive(self._scalers), loaders=[(r(), st) for r, st in self._loaders], named=dict(self._named))

    def _roots(self) -> list[torch.nn.Module]:
        key = (self._seen_modules, len(self._optimizers))
        if self._roots_cache is not None and self._roots_cache[0] == key and all(r() is not None for r in self._roots_cache[1]):
            return [m for r in self._roots_cache[1] if (m := r()) is not None]
        roots = self._find_roots()
        self._roots_cache = (key, [weakref.ref(m) for m in roots])
        return roots

    def _find_roots(self) -> list[torch.nn.Module]:
        mods = _alive(list(self._modules.values()))
        children: set[int] = set()
        for m in mods:
            for c in m.modules():
                if c is not m:
                    children.add(id(c))
        # Roots that hold state, the one owning the first optimizer's parameters first: that one is "the model"
        # (model/<fqn>); a loss module built earlier holds no state and is left out.
        roots = [m for m in mods if id(m) not in children and _has_state(m)]
        inner = [_unwrap(m) for m in roots]
        self.ddp = self.ddp or any(a is not b for a, b in zip(inner, roots))
        # DDP lays its gradient buckets out again after its first step, unless it looks for unused
        # parameters: a restarted DDP's first step then sums in another order (at 3+ ranks it shows)
        self.ddp_relayout = self.ddp_relayout or any(a is not b and not getattr(b, "find_unused_parameters", True) for a, b in zip(inner, roots))
        roots = inner
        opt = next(iter(_alive(self._optimizers)), None)
        if opt is not None:
            first = {id(p) for g in opt.param_groups for p in g["params"]}
            roots.sort(key=lambda m: not any(id(p) in first for p in m.parameters()))
        return roots
