"""Frameworks that drive the training loop: Hugging Face ``Trainer``, Lightning, Accelerate.

The decorator sees what any loop builds (models, optimizers, schedulers,
DataLoaders). A framework adds two things the patches on PyTorch cannot see:

- its own progress (the HF Trainer's ``state``, Lightning's fit loop), which
  decides when the framework stops: saved as a tracked object, and put back
  before the framework reads it (hf.py, lightning.py);
- wrappers that read a DataLoader ahead (accelerate.py): the position and the
  boundary move to where the user takes the batch (patches.read_ahead).

Nothing here imports a framework: each is hooked when its module is already
imported (``sys.modules``), at the start of the decorated call and again as
models are built inside it. Each hook patches the framework's classes with
``patch`` (patches.apply's), so they are put back when the call ends.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Hooks", "warn_own_checkpoints"]

log = logging.getLogger("ravex")

Patch = Callable[[Any, str, Callable[[Any], Any]], None]

# module that marks the framework as imported -> the module of ours that hooks it
_FRAMEWORKS = (("accelerate.data_loader", "accelerate"), ("transformers.trainer", "hf"), ("lightning.pytorch", "lightning"),
               ("pytorch_lightning", "lightning"))


class Hooks:
    """The frameworks hooked in one decorated call."""

    def __init__(self, rt: Any, patch: Patch):
        self.rt, self.patch = rt, patch
        self.done: set[str] = set()
        self.seen_modules = 0

    def check(self) -> None:
        """Hook every framework imported since the last check (a cheap test when nothing was)."""
        if len(sys.modules) == self.seen_modules:
            return
        self.seen_modules = len(sys.modules)
        for module, ours in _FRAMEWORKS:
            if module in sys.modules and module not in self.done:
                self.done.add(module)
                from importlib import import_module

                hook = import_module(f"{__name__}.{ours}")
                try:
                    hook.apply(self.rt, self.patch, sys.modules[module])
                except Exception as exc:  # noqa: BLE001 - a framework version whose classes differ: the plain patches still work
                    log.warning("ravex: %s is imported but could not be hooked (%s: %s); its own progress is not saved and "
                                "resuming it may train more than its budget", module.split(".")[0], type(exc).__name__, exc)


_warned: set[str] = set()


def warn_own_checkpoints(framework: str, how: str) -> None:
    """Once per framework and process: its own checkpointing is on too."""
    if framework in _warned:
        return
    _warned.add(framework)
    log.warning("ravex: %s writes checkpoints of its own as well, so the weights are written twice; %s", framework, how)
