"""Lightning's ``Trainer``: its fit loop's progress is saved and put back before the loop runs.

Lightning stops on its fit loop's counters (``global_step``, ``current_epoch``,
the batch progress of the epoch), kept in ``trainer.fit_loop``; a resumed run
whose loop starts at zero trains its whole budget again. So:

- ``Trainer.__init__`` (patched) adds a :class:`lightning.pytorch.Callback` of
  Ravex's and tracks the trainer's progress as the object ``lightning``: the fit
  loop's ``state_dict()`` and the ``state_dict()`` of every callback that has
  one (keyed by ``state_key``, as Lightning's own checkpoint keys them).
- ``Trainer.fit`` (patched): a trainer built before the decorated call started
  is noticed there, at its first use.
- ``on_fit_start`` (the callback): when the checkpoint Ravex resumes from holds
  that object, the fit loop and the callbacks load it, as Lightning's own
  ``fit(ckpt_path=...)`` does at that point of ``fit``: its restart logic then
  continues the epoch at the saved batch. The model, optimizers, schedulers and
  the DataLoader's position are Ravex's, restored at the first batch. A piece
  that does not load (a state saved by another Lightning version, a callback
  whose state changed shape) is a warning and starts fresh; nothing raises into
  ``fit``.

With a sized DataLoader the fit loop fetches each batch when it trains it, so
the boundary (the DataLoader's next batch) is where the user's step starts.
"""

from __future__ import annotations

import logging
import weakref
from types import ModuleType
from typing import Any

from ravex_convert.errors import RavexError

from . import Patch, warn_own_checkpoints

__all__ = ["NAME", "apply"]

log = logging.getLogger("ravex")

NAME = "lightning"


class Progress:
    """The trainer's progress, saved under ``tracked/lightning``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.fresh_loop = False  # the saved fit loop did not load: the loop started fresh, and that was said

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        callbacks = {str(cb.state_key): sd for cb in t.callbacks if (sd := cb.state_dict())}
        return {"fit_loop": t.fit_loop.state_dict(), "callbacks": callbacks, "global_step": int(t.global_step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("global_step") != self.trainer.global_step and not self.fresh_loop:
            raise RavexError(f"Lightning's fit loop is at global_step {self.trainer.global_step}, its saved progress at {sd.get('global_step')}: "
                             "the loop's progress was not put back from this checkpoint",
                             hint="start the script again: Ravex resumes from its newest checkpoint")


def _load(what: str, load: Any, state: Any, after: str) -> bool:
    """``load(state)``; a failure is a warning (``what`` did not load, ``after``: what happens instead)."""
    try:
        load(state)
    except Exception as exc:  # noqa: BLE001 - a restore never raises into the user's fit
        log.warning("ravex: %s saved in this checkpoint could not be loaded (%s: %s); %s", what, type(exc).__name__, exc, after)
        return False
    return True


def _not_restarting(loop: Any) -> None:
    """A loop (and the loops inside it) as a fresh ``fit`` has it: not restarting from a checkpoint
    (``load_state_dict`` marks it so even when the state it loaded is a fresh one)."""
    base = next(c for c in type(loop).__mro__ if c.__name__ == "_Loop")
    todo = [loop]
    while todo:
        lp = todo.pop()
        lp._loaded_from_state_dict = lp._resuming_from_checkpoint = False
        todo.extend(v for v in vars(lp).values() if isinstance(v, base))
    loop.restarting = False


def apply(rt: Any, patch: Patch, module: ModuleType) -> None:
    from ..patches import after

    class RavexProgress(module.Callback):  # type: ignore[misc,name-defined]
        """Puts the fit loop's saved progress back at the start of ``fit`` (frameworks/lightning.py)."""

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            rt._safe(restore, trainer)

    def restore(trainer: Any) -> None:
        saved = rt.session.saved_object(NAME)
        if not isinstance(saved, dict) or not isinstance(saved.get("fit_loop"), dict):
            return
        loop = trainer.fit_loop
        fresh = loop.state_dict()
        if _load("Lightning's fit loop state", loop.load_state_dict, saved["fit_loop"],
                 "the loop starts at step 0 from the restored weights: the whole max_steps budget is trained again (saved by "
                 "another Lightning version? resume with the version that saved it)"):
            rt.framework_epochs = True  # the restored loop passes its samplers the true epoch
        else:
            _load("Lightning's fresh fit loop state", loop.load_state_dict, fresh, "the loop is left as it is")
            _not_restarting(loop)
            progress = rt.session.tracked().named.get(NAME)
            if isinstance(progress, Progress):
                progress.fresh_loop = True
        states = saved.get("callbacks") or {}
        if not isinstance(states, dict):
            return
        for cb in trainer.callbacks:
            key = str(cb.state_key)
            if key in states:
                _load(f"the state of callback {key}", cb.load_state_dict, states[key], "that callback starts fresh")

    def notice(trainer: Any) -> None:
        trainer.callbacks.append(RavexProgress())
        # The sanity check's validation runs in isolate_rng(), which puts the random state back after
        # it: a restore at its loader's first batch would be undone. The training loader's restores.
        ref = weakref.ref(trainer)
        rt.restore_waits.append(lambda: bool(getattr(ref(), "sanity_checking", False)))
        rt.session.notice_stateful(NAME, Progress(trainer))
        if getattr(trainer, "checkpoint_callback", None) is not None:
            warn_own_checkpoints("Lightning", "pass Trainer(enable_checkpointing=False): Ravex already checkpoints this run")

    def first_use(trainer: Any) -> None:
        """A trainer built before the decorated call (or before Lightning was hooked) is noticed at ``fit``."""
        if not any(isinstance(cb, RavexProgress) for cb in trainer.callbacks):
            notice(trainer)

    def fit(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            rt._safe(first_use, self)
            return original(self, *args, **kwargs)
        return wrapper

    patch(module.Trainer, "__init__", after(rt, notice))
    patch(module.Trainer, "fit", fit)
