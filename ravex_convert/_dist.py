"""The few messages a conversion spread over processes needs, and one process's stand-in.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the ranks talk over
gloo: rank 0 names the output and checks the destination, every rank reports
how its part went, rank 0 commits and says whether it did. Nothing else
crosses: each rank reads the source metadata and builds the same plan itself.
torch is imported only here, and only when there is more than one process.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["Group", "Solo", "ambient", "current", "launched", "local_size", "rank", "spread"]


class Solo:
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class Group:
    """The default torch.distributed group (gloo on CPU), joined from torchrun's environment."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.owned = not dist.is_initialized()
        if self.owned:
            dist.init_process_group("gloo")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owned and self._dist.is_initialized():
            self._dist.destroy_process_group()


def launched() -> bool:
    """Whether this process is one of several that torchrun started."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


_joined: Group | None = None
# The group writers share their output with: this process alone unless a caller
# (``convert`` under torchrun) says otherwise for the duration of a call.
_spread: contextvars.ContextVar[Solo | Group | None] = contextvars.ContextVar("ravex_group", default=None)


@contextlib.contextmanager
def spread(group: Solo | Group) -> Iterator[None]:
    token = _spread.set(group)
    try:
        yield
    finally:
        _spread.reset(token)


def ambient() -> Solo | Group:
    """The group set by :func:`spread`, else this process alone: a writer called from
    the runtime's background thread never joins a collective."""
    return _spread.get() or Solo()


def current() -> Solo | Group:
    """The group a conversion runs in: an initialised torch.distributed group, or
    torchrun's environment (joined once per process), or this process alone."""
    global _joined
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _joined if _joined is not None and not _joined.owned else Group()
    if launched():
        if _joined is None:
            _joined = Group()
            # a gloo group left to the interpreter's teardown aborts the process ("terminate
            # called without an active exception"): end it first
            atexit.register(_joined.close)
        return _joined
    return Solo()


def local_size() -> int:
    """How many ranks share this machine (torchrun's LOCAL_WORLD_SIZE; 1 alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if launched() else 1
    except ValueError:
        return 1


def rank() -> int:
    """This process's rank for messages and progress bars (0 alone), without joining a group."""
    try:
        return int(os.environ.get("RANK", "0")) if launched() else 0
    except ValueError:
        return 0
