"""The patches on PyTorch, on only while a decorated function runs.

``apply(rt)`` replaces a handful of methods with wrappers that call the
original first (so the user's call always behaves as before) and then tell the
runtime and its session (``rt.session.notice_*``: what is being trained), through
``rt._safe`` so a Ravex failure never reaches training code.
It returns the function that puts the originals back.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from . import frameworks
from ._passthrough import Passthrough
from .runtime import Runtime, StopRun
from .sampler import host_rng, set_host_rng, unstamped
from .workers import tied_workers

__all__ = ["after", "apply", "patched_targets", "read_ahead"]


def patched_targets() -> list[tuple[Any, str]]:
    """(class, attribute) of every method Ravex replaces while a run is active."""
    from torch.optim import lr_scheduler

    out: list[tuple[Any, str]] = [
        (torch.nn.Module, "__init__"), (torch.nn.Module, "train"), (torch.optim.Optimizer, "__init__"),
        (lr_scheduler.LRScheduler, "__init__"), (torch.amp.GradScaler, "__init__"), (DataLoader, "__init__"), (DataLoader, "__iter__"),
    ]
    # A DataLoader of its own kind (torchdata's StatefulDataLoader) that defines __iter__ itself.
    todo, seen = list(DataLoader.__subclasses__()), set()
    while todo:
        sub = todo.pop()
        if sub in seen:
            continue
        seen.add(sub)
        todo.extend(sub.__subclasses__())
        if "__iter__" in vars(sub):
            out.append((sub, "__iter__"))
    plateau = getattr(lr_scheduler, "ReduceLROnPlateau", None)
    if plateau is not None and not issubclass(plateau, lr_scheduler.LRScheduler):
        out.append((plateau, "__init__"))
    return out


class _Iter(Passthrough):
    """The DataLoader iterator, seen through Ravex: the top of every iteration is a boundary,
    unless a wrapper reads this loader ahead (``driven``): the wrapper's iterator (:class:`_Outer`)
    has the boundary then, where the user takes the batch."""

    def __init__(self, rt: Runtime, loader: Any, inner: Any, driven: bool = False):
        super().__init__(inner)
        self._rt, self._loader, self._driven = rt, loader, driven
        self._resumed: dict[str, Any] | None = None  # the host random state restored, while held batches are fetched again

    def __next__(self) -> Any:
        rt = self._rt
        if rt.fatal is not None:
            raise rt.fatal
        if self._driven:
            return self._ahead(rt)
        if rt.counting and not rt.active and rt.at_max_steps():
            raise StopIteration
        if rt.active:
            st = rt.loader_state(self._loader)
            length = st.length(self._loader)
            # At the end of an epoch the boundary waits for the next epoch's first batch, so that
            # per-epoch code after the inner loop is part of the checkpointed past.
            if length is None or st.consumed < length:
                try:
                    rt._safe(rt.boundary, st)
                except StopRun:
                    raise StopIteration from None
        batch = next(self._inner)
        if rt.active:
            rt.loader_state(self._loader).consumed += 1
        return batch

    def _ahead(self, rt: Runtime) -> Any:
        """A batch for a wrapper that reads ahead: the host random state before it is fetched is kept
        until the user takes it. On resume the batches the wrapper held at the checkpoint are
        fetched again, each under the state it was first fetched under, and then the checkpoint's
        state is put back: what the batch drew in this process (a collate_fn's masking) is drawn
        again, and the draws after the checkpoint start where they did."""
        if not rt.active:
            return next(self._inner)
        st = rt.loader_state(self._loader)
        if st.refetch:
            if self._resumed is None:
                self._resumed = host_rng()
            set_host_rng(st.refetch.pop(0))
        st.held.append(host_rng())
        try:
            return next(self._inner)
        except StopIteration:
            st.held.pop()
            raise
        finally:
            if self._resumed is not None and not st.refetch:
                set_host_rng(self._resumed)
                self._resumed = None


class _Outer(Passthrough):
    """The iterator of a wrapper that reads its DataLoader ahead (Accelerate's DataLoaderShard
    fetches batch k+1 before it yields batch k): the boundary is at the top of each of the user's
    iterations, before the wrapper's next fetch; the position counts the batches the user took."""

    def __init__(self, rt: Runtime, base: Any, inner: Any):
        super().__init__(inner)
        self._rt, self._base, self._given = rt, base, 0

    def __next__(self) -> Any:
        rt = self._rt
        if rt.fatal is not None:
            raise rt.fatal
        if rt.counting and not rt.active and rt.at_max_steps():
            raise StopIteration  # not one more batch: the wrapper would hand out the one it holds
        if rt.active:
            st = rt.loader_state(self._base)
            length = st.length(self._base)
            # as for a plain loader, the boundary of an epoch's end waits for the next epoch's first batch
            if (self._given == 0 and st.epoch >= 0) or length is None or st.consumed < length:
                try:
                    rt._safe(rt.boundary, st)
                except StopRun:
                    raise StopIteration from None
        batch = next(self._inner)
        self._given += 1
        if rt.active:
            st = rt.loader_state(self._base)
            st.consumed += 1
            if st.held:
                st.held.popleft()
        return batch


def _restored_at_max(rt: Runtime) -> bool:
    """Restore (once) before an iterator is built, so it can continue the saved position; True when
    the run is at ``max_steps`` (no batch is to be handed out)."""
    try:
        rt._safe(rt.boundary_restore_only)
    except StopRun:
        pass
    return rt.at_max_steps()


def after(rt: Runtime, notice: Callable[[Any], object]) -> Callable[[Any], Any]:
    """The patch of a method that calls the original, then tells Ravex (``notice(self)``, through ``rt._safe``)."""
    def make(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            rt._safe(notice, self)
            return out
        return wrapper
    return make


def read_ahead(rt: Runtime, base_of: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The patch of the ``__iter__`` of a wrapper that reads the DataLoader ``base_of(wrapper)``
    ahead (frameworks/): Ravex counts the batches its iterator hands out, not those the inner
    loader gives it. A wrapper's own epoch counter (``iteration``) is saved and put back."""
    def make(original: Any) -> Any:
        def wrapper(self: Any) -> Any:
            if rt.fatal is not None:
                raise rt.fatal
            base = base_of(self)
            if base is None:
                return original(self)
            if rt.at_max_steps() and rt.restored:
                return iter(())
            if not rt.active:
                return _Outer(rt, base, original(self)) if rt.counting and rt.cfg.max_steps is not None else original(self)
            st = rt._safe(rt.loader_state, base)
            if st is None:
                return original(self)
            st.driven, st.wrapper = True, weakref.ref(self)
            if _restored_at_max(rt):
                return iter(())
            saved = st.pending
            if saved is not None and isinstance(saved.get("wrapper_epoch"), int) and isinstance(getattr(self, "iteration", None), int):
                self.iteration = saved["wrapper_epoch"]
            return _Outer(rt, base, original(self))
        return wrapper
    return make


def apply(rt: Runtime) -> Callable[[], None]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(cls: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = cls.__dict__[name]
        saved.append((cls, name, original))
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(cls, name, wrapper)

    hooked = frameworks.Hooks(rt, patch)
    rt.session.recipes.recording = True  # modules are seen built: one without a recipe is worth a warning

    def module_seen(m: Any) -> None:
        # Only the outermost construction is a model; submodules are reached from it.
        rt.session.notice_module(m)
        hooked.check()  # a framework imported inside the decorated function, before its model is built

    def module_init(m: Any, caller: Any) -> None:
        rt.session.recipes.constructed(m, caller)  # its constructor's arguments, read from the frame that called super().__init__()
        module_seen(m)

    def init_seen(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            rt._safe(module_init, self, sys._getframe(1))
            return out
        return wrapper

    def loader_iter(original: Any) -> Any:
        def wrapper(self: Any) -> Any:
            # Every worker this call starts (the user's epoch, or Ravex's replay of one) ends with this process.
            with tied_workers(self):
                return start(self)

        def start(self: Any) -> Any:
            if rt.fatal is not None:
                raise rt.fatal  # the restore failed: no epoch may start on the state the objects are in
            if rt.at_max_steps() and rt.restored:
                return iter(())
            if not rt.active:
                # Checkpointing is off after a failure, but steps are still counted: the iterator still ends at max_steps.
                plain = unstamped(self, original(self))
                return _Iter(rt, self, plain) if rt.counting and rt.cfg.max_steps is not None else plain
            st = rt._safe(rt.loader_state, self)
            if st is None:
                return unstamped(self, original(self))
            if _restored_at_max(rt):
                return iter(())
            made = rt._safe(st.make_iter, self, original, torch.get_rng_state())
            inner = made if made is not None else unstamped(self, original(self))
            return _Iter(rt, self, inner, st.driven)
        return wrapper

    from torch.optim import lr_scheduler

    for cls, name in patched_targets():
        if name == "__iter__":
            patch(cls, name, loader_iter)
        elif cls is torch.nn.Module and name == "__init__":
            patch(cls, name, init_seen)
        elif cls is torch.nn.Module:
            patch(cls, name, after(rt, module_seen))
        elif cls is torch.optim.Optimizer:
            patch(cls, name, after(rt, rt.notice_optimizer))
        elif cls is DataLoader:
            patch(cls, name, after(rt, rt.session.notice_loader))
        elif cls is torch.amp.GradScaler:
            patch(cls, name, after(rt, rt.session.notice_scaler))
        elif issubclass(cls, lr_scheduler.LRScheduler) or cls.__name__ == "ReduceLROnPlateau":
            patch(cls, name, after(rt, rt.session.notice_scheduler))

    hooked.check()

    import torch.distributed as tdist

    if tdist.is_available():
        # The script ends its process group before it returns: on many ranks the last checkpoint
        # is written just before, while every rank is still there to take part.
        def destroy(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if (args[0] if args else kwargs.get("group")) is None:
                    rt._safe(rt.before_destroy)
                return original(*args, **kwargs)
            return wrapper

        patch(tdist, "destroy_process_group", destroy)
        patch(tdist.distributed_c10d, "destroy_process_group", destroy)

    def undo() -> None:
        hooked.close()
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)

    return undo
