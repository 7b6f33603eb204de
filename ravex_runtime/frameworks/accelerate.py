"""Accelerate: its DataLoader wrapper reads ahead, and ``save_state`` is a checkpoint of its own.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard``: not a DataLoader
subclass but a wrapper that builds an inner DataLoader (``base_dataloader``)
and fetches batch k+1 from it before it yields batch k, to know which batch is
the last. Counted at the inner loader, the position would be one batch ahead of
the user, and the random draws of fetching batch k+1 would belong to the
checkpoint of step k. So its ``__iter__`` is patched with
:func:`~ravex_runtime.patches.read_ahead`: the boundary and the count move to
where the user takes the batch, the batch held ahead is fetched again on
resume under the random state it was first fetched under, and the wrapper's
epoch counter (``iteration``, which seeds Accelerate's seedable sampler) is
saved with the position. The HF Trainer uses the same wrapper.

Not covered: ``DataLoaderDispatcher`` (an IterableDataset, or ``dispatch_batches``:
rank 0 fetches for every rank) and a wrapper that skips batches itself
(``skip_first_batches``); their position is counted at the inner loader.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from . import Patch, warn_own_checkpoints

__all__ = ["apply"]


def _base(wrapper: Any) -> Any:
    """The inner DataLoader of a wrapper Ravex can count for (None: leave the wrapper as it is)."""
    if getattr(wrapper, "skip_batches", 0):
        return None
    return getattr(wrapper, "base_dataloader", None)


def apply(rt: Any, patch: Patch, module: ModuleType) -> None:
    from ..patches import read_ahead

    patch(module.DataLoaderShard, "__iter__", read_ahead(rt, _base))

    accelerate = importlib.import_module("accelerate")

    def save_state(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            warn_own_checkpoints("Accelerate (accelerator.save_state)", "Ravex already checkpoints this run; drop the save_state calls")
            return original(self, *args, **kwargs)
        return wrapper

    patch(accelerate.Accelerator, "save_state", save_state)
