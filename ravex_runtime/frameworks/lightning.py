"""Lightning's ``Trainer``: its fit loop's progress is saved and put back before the loop runs.

Lightning stops on its fit loop's counters (``global_step``, ``current_epoch``,
the batch progress of the epoch), kept in ``trainer.fit_loop``; a resumed run
whose loop starts at zero trains its whole budget again. So:

- ``Trainer.__init__`` (patched) adds a :class:`lightning.pytorch.Callback` of
  Ravex's and tracks the trainer's progress as the object ``lightning``: the fit
  loop's ``state_dict()`` and the ``state_dict()`` of every callback that has
  one (keyed by ``state_key``, as Lightning's own checkpoint keys them).
- ``on_fit_start`` (the callback): when the checkpoint Ravex resumes from holds
  that object, the fit loop and the callbacks load it, as Lightning's own
  ``fit(ckpt_path=...)`` does at that point of ``fit``: its restart logic then
  continues the epoch at the saved batch. The model, optimizers, schedulers and
  the DataLoader's position are Ravex's, restored at the first batch.

With a sized DataLoader the fit loop fetches each batch when it trains it, so
the boundary (the DataLoader's next batch) is where the user's step starts.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from ravex_convert.errors import RavexError

from . import Patch, warn_own_checkpoints

__all__ = ["NAME", "apply"]

NAME = "lightning"


class Progress:
    """The trainer's progress, saved under ``tracked/lightning``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        callbacks = {str(cb.state_key): sd for cb in t.callbacks if (sd := cb.state_dict())}
        return {"fit_loop": t.fit_loop.state_dict(), "callbacks": callbacks, "global_step": int(t.global_step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("global_step") != self.trainer.global_step:
            raise RavexError(f"Lightning's fit loop is at global_step {self.trainer.global_step}, its saved progress at {sd.get('global_step')}: "
                             "the loop's progress was not put back from this checkpoint",
                             hint="start the script again: Ravex resumes from its newest checkpoint")


def apply(rt: Any, patch: Patch, module: ModuleType) -> None:
    from ..patches import after

    class RavexProgress(module.Callback):  # type: ignore[misc,name-defined]
        """Puts the fit loop's saved progress back at the start of ``fit`` (frameworks/lightning.py)."""

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            saved = rt._safe(rt.session.saved_object, NAME) if rt.active else None
            if not isinstance(saved, dict) or not isinstance(saved.get("fit_loop"), dict):
                return
            trainer.fit_loop.load_state_dict(saved["fit_loop"])
            rt.framework_epochs = True  # the restored loop passes its samplers the true epoch
            states = saved.get("callbacks") or {}
            for cb in trainer.callbacks:
                if str(cb.state_key) in states:
                    cb.load_state_dict(states[str(cb.state_key)])

    def notice(trainer: Any) -> None:
        trainer.callbacks.append(RavexProgress())
        # The sanity check's validation runs in isolate_rng(), which puts the random state back after
        # it: a restore at its loader's first batch would be undone. The training loader's restores.
        ref = weakref.ref(trainer)
        rt.restore_waits.append(lambda: bool(getattr(ref(), "sanity_checking", False)))
        rt.session.notice_stateful(NAME, Progress(trainer))
        if getattr(trainer, "checkpoint_callback", None) is not None:
            warn_own_checkpoints("Lightning", "pass Trainer(enable_checkpointing=False): Ravex already checkpoints this run")

    patch(module.Trainer, "__init__", after(rt, notice))
