"""The Hugging Face ``Trainer``: its progress is saved, and put back through its own resume path.

The Trainer stops on ``state.global_step`` and derives from it, before its
first callback runs, the epoch to start at and the batches of that epoch
already trained (loop variables no callback can reach). A resumed run whose
state was not put back trains its whole budget again. So:

- ``Trainer.__init__`` (patched): the trainer's progress is tracked as the
  object ``hf_trainer``: ``TrainerState`` as the Trainer writes it to
  ``trainer_state.json`` (with its stateful callbacks), and the loss summed
  since the last log with the counters that divide it (so the first logged loss
  after a resume is the uninterrupted run's).
- ``Trainer.train`` (patched): a trainer built before the decorated call started
  (or before ``transformers.trainer`` was imported) is noticed there. When the checkpoint Ravex resumes from holds that
  object, ``train`` is called with ``resume_from_checkpoint`` set to a directory
  holding only that ``trainer_state.json``, so the Trainer's own resume
  computes its epoch, its skip, ``state.epoch`` and its gradient-accumulation
  windows. What the Trainer would load from the directory besides (weights,
  optimizer, scheduler, scaler, RNG, and skipping batches with a new
  DataLoader) is switched off for that call: Ravex restores those itself, at the
  first batch, from the same checkpoint, and continues the DataLoader's epoch
  in place (same order, the same worker streams), which the Trainer's own
  resume does not (it restores the RNG after the first resumed window is
  fetched, and its skip builds a new loader whose workers start afresh).

The DataLoader the Trainer iterates is Accelerate's wrapper (accelerate.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ravex_convert.errors import RavexError

from . import Patch, warn_own_checkpoints

__all__ = ["NAME", "apply"]

log = logging.getLogger("ravex")

NAME = "hf_trainer"
# The Trainer's own loading from a checkpoint directory, switched off while Ravex resumes it.
_LOADS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
_COUNTERS = ("_total_loss_scalar", "_globalstep_last_logged", "current_flos", "_initial_global_step", "_initial_num_input_tokens_seen")


class Progress:
    """The Trainer's progress, saved under ``tracked/hf_trainer``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.fresh = False  # the saved progress did not load: the Trainer started at step 0, and that was said

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        from transformers.trainer_callback import ExportableState

        state = dataclasses.asdict(t.state)
        # as the Trainer saves them in trainer_state.json: by class name, a list where a class has several
        callbacks: dict[str, list[Any]] = {}
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        state["stateful_callbacks"] = {name: states[0] if len(states) == 1 else states for name, states in callbacks.items()}
        out: dict[str, Any] = {"state": json.dumps(state, sort_keys=True), "world_size": _world_size(t)}
        loss = getattr(t, "_tr_loss", None)
        if isinstance(loss, torch.Tensor):
            out["tr_loss"] = loss.detach()
        for k in _COUNTERS:
            v = getattr(t, k, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        step = json.loads(sd["state"]).get("global_step")
        if step != t.state.global_step and not self.fresh:
            raise RavexError(f"the HF Trainer is at global_step {t.state.global_step}, its saved progress at {step}: the Trainer's "
                             "progress was not put back from this checkpoint", hint="start the script again: Ravex resumes from its newest checkpoint")
        loss = sd.get("tr_loss")
        if isinstance(loss, torch.Tensor) and isinstance(getattr(t, "_tr_loss", None), torch.Tensor):
            t._tr_loss = loss.to(device=t._tr_loss.device, dtype=t._tr_loss.dtype).clone()
        for k in _COUNTERS:
            if k in sd:
                setattr(t, k, sd[k])


def _world_size(trainer: Any) -> int:
    ws = getattr(trainer.args, "world_size", 1)
    return ws if isinstance(ws, int) else 1


@contextlib.contextmanager
def _own_loads_off(trainer: Any, module: ModuleType, skip: bool) -> Iterator[None]:
    """The Trainer's loading from its checkpoint directory, off (instance attributes over its methods);
    its skipping of the batches already trained too, unless ``skip``."""
    for name in _LOADS:
        setattr(trainer, name, lambda *a, **k: None)
    # module-level functions the Trainer calls: skipping batches with a new loader, DeepSpeed's own load
    saved = {name: getattr(module, name) for name in ("skip_first_batches", "deepspeed_load_checkpoint") if hasattr(module, name)}
    if not skip:
        setattr(module, "skip_first_batches", lambda loader, num_batches=0: loader)  # noqa: B010 - a module's global, put back below
    if "deepspeed_load_checkpoint" in saved:
        setattr(module, "deepspeed_load_checkpoint", lambda *a, **k: None)  # noqa: B010
    try:
        yield
    finally:
        for name in _LOADS:
            trainer.__dict__.pop(name, None)
        for name, fn in saved.items():
            setattr(module, name, fn)


def apply(rt: Any, patch: Patch, module: ModuleType) -> None:
    from ..patches import after

    missing = [n for n in _LOADS if not hasattr(module.Trainer, n)] + [n for n in ("skip_first_batches",) if not hasattr(module, n)]
    if missing:
        raise RavexError(f"this transformers version has no {', '.join(missing)}")

    def notice(trainer: Any) -> None:
        rt.session.notice_stateful(NAME, Progress(trainer))
        strategy = getattr(trainer.args, "save_strategy", "no")
        if str(getattr(strategy, "value", strategy)) != "no":
            warn_own_checkpoints("the HF Trainer", 'set TrainingArguments(save_strategy="no"): Ravex already checkpoints this run')

    def first_use(trainer: Any) -> None:
        held = rt.session.tracked().named.get(NAME)
        if not (isinstance(held, Progress) and held.trainer is trainer):
            notice(trainer)

    def loads(trainer: Any, state: str) -> bool:
        """The Trainer's own loader takes the saved ``trainer_state.json`` (one saved by another
        transformers version may not fit); when not, a warning, and the Trainer starts fresh."""
        try:
            module.TrainerState(**json.loads(state))
        except Exception as exc:  # noqa: BLE001 - a restore never raises into the user's train()
            log.warning("ravex: the HF Trainer's progress saved in this checkpoint could not be loaded (%s: %s); the Trainer starts "
                        "at step 0 from the restored weights and trains its whole max_steps again (saved by another transformers "
                        "version? resume with the version that saved it)", type(exc).__name__, exc)
            held = rt.session.tracked().named.get(NAME)
            if isinstance(held, Progress) and held.trainer is trainer:
                held.fresh = True
            return False
        return True

    def train(original: Any) -> Any:
        def wrapper(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            rt._safe(first_use, self)
            saved = rt._safe(rt.session.saved_object, NAME) if rt.active else None
            if not (isinstance(saved, dict) and isinstance(saved.get("state"), str)) or not rt._safe(loads, self, saved["state"]):
                return original(self, resume_from_checkpoint, *args, **kwargs)
            if resume_from_checkpoint not in (None, False):
                log.warning("ravex: Trainer.train(resume_from_checkpoint=%r) is ignored: the run resumes from %s",
                            resume_from_checkpoint, rt.resume_label or "Ravex's checkpoint")
            was, now = saved.get("world_size", _world_size(self)), _world_size(self)
            if was != now:
                # The saved data position counts batches of the old sharding; the Trainer's own count of
                # the epoch's batches (from global_step, at this world size) is the one that fits it now.
                log.warning("ravex: the HF Trainer's run was saved at world size %s and resumes at %d: the Trainer skips the "
                            "batches of its epoch itself, counted at this world size; the data order is not the saved run's", was, now)
                rt.loader_positions = False
            with tempfile.TemporaryDirectory(prefix="ravex-hf-") as tmp:
                Path(tmp, "trainer_state.json").write_text(saved["state"])
                with _own_loads_off(self, module, skip=was != now):
                    return original(self, tmp, *args, **kwargs)
        return wrapper

    patch(module.Trainer, "__init__", after(rt, notice))
    patch(module.Trainer, "train", train)
