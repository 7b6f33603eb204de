"""The small state every reader, writer and the runtime agree on: one schema.

A checkpoint's ``objects`` maps these keys to plain values (tensors inside
them are :class:`~ravex_convert.model.TensorLink` s to ``obj/`` or ``optim/``
logical tensors). docs/format.md section 13 lists the same table; a test keeps
the two equal. Other keys may appear and are passed through untouched.

Two loss scalers are two keys: the AMP ``GradScaler`` a plain PyTorch run
steps through (``grad_scaler``) and DeepSpeed's fp16 ``LossScaler`` /
``DynamicLossScaler`` (``loss_scaler``) are different objects with different
state, and one is never restored into the other.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CorruptCheckpointError
from .model import TensorLink
from .recipes import valid as _recipes

__all__ = ["INITIALISED_FROM", "KEYS", "RESUMED_FROM", "Key", "check", "key_of"]

# A key of ``extra`` in every checkpoint the runtime writes for a run that began from another
# program's checkpoint (``resume_from``): ``{"format", "path", "step"}`` of that checkpoint.
RESUMED_FROM = "ravex_resumed_from"
# ... and for a run whose model began from another checkpoint's weights alone (``init_from``): the same fields.
INITIALISED_FROM = "ravex_initialised_from"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


def _groups(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(g, dict) and isinstance(g.get("params", []), list)
                                       and all(isinstance(p, (str, int)) for p in g.get("params", [])) for g in v)


def _rng(v: Any) -> bool:
    return isinstance(v, dict) and set(v) <= {"torch", "cuda", "python", "numpy", "mps"}


def _loaders(v: Any) -> bool:
    return isinstance(v, list) and all(x is None or isinstance(x, dict) for x in v)


def _any(v: Any) -> bool:
    return True


@dataclass(frozen=True)
class Key:
    name: str  # the key, or a pattern with <i> (a second optimizer's: optimizer.1)
    holds: str  # for docs/format.md
    valid: Callable[[Any], bool]
    expected: str  # what a valid value is, for the error


KEYS = (
    Key("step", "optimizer steps taken when the state was captured (the runtime's count)", _int, "a non-negative integer"),
    Key("optim.param_groups", "the first optimizer's param groups; `params` in each lists parameter fqns (as in `optim/<state>/<fqn>`), "
        "not integer ids (a torch.save source keyed by position keeps its ids)", _groups, "a list of dicts whose 'params' is a list"),
    Key("optim.state", "per-parameter optimizer state that is not a tensor, as `{fqn: {state: value}}`", _dict, "a dict"),
    Key("optimizer.<i>", "a second, third, ... optimizer's whole `state_dict()` (the runtime; <i> from 1)", _dict, "a dict"),
    Key("lr_scheduler", "the LR scheduler's `state_dict()` (a torch LRScheduler's, or the one DeepSpeed saves)", _dict, "a dict"),
    Key("lr_scheduler.<i>", "a further LR scheduler's `state_dict()` (the runtime; <i> from 1)", _dict, "a dict"),
    Key("grad_scaler", "the AMP GradScaler's `state_dict()` (torch.amp; the runtime)", _dict, "a dict"),
    Key("grad_scaler.<i>", "a further GradScaler's `state_dict()`", _dict, "a dict"),
    Key("loss_scaler", "DeepSpeed's fp16 loss scaler (`LossScaler` / `DynamicLossScaler`): `cur_scale`, `dynamic`, ...", _dict, "a dict"),
    Key("rng", "RNG states by stream: `torch`, `cuda`, `python`, `numpy`", _rng, "a dict keyed by torch, cuda, python, numpy"),
    Key("loaders", "per DataLoader, in the order the run built them, the position to continue its stream from (None: not tracked)",
        _loaders, "a list of dicts or nulls"),
    Key("ranks", "a run on many ranks: per rank, its own `rng` and `loaders` (as above); the top-level `rng` and `loaders` are rank 0's",
        lambda v: isinstance(v, list) and all(isinstance(x, dict) and _rng(x.get("rng", {})) and _loaders(x.get("loaders", [])) for x in v),
        "a list of dicts holding rng and loaders"),
    Key("distributed", "a run on many ranks: `world_size`, `mode` (replicated, gather or per_rank), `mesh`, `wrap`, `written_by` "
        "(rank -> files it wrote)", _dict, "a dict"),
    Key("tracked", "objects the user tracked (`ravex.track`): name -> `state_dict()`", _dict, "a dict"),
    Key("zero", "DeepSpeed provenance: stage, variant, precision, world size, ds_config, partition layout", _dict, "a dict"),
    Key("recipes", "how to rebuild the model and other modules tracked by name: `format_version`, `modules` (name -> class or factory "
        "and its keyword arguments as data, where its weights are); section 13.1", _recipes, "a recipe object (format_version, modules)"),
    Key("extra", "a source's other top-level entries as they were (torch.save keys, DCP non-tensor state, framework progress)",
        _any, "anything"),
)

_EXACT = {k.name: k for k in KEYS if "<i>" not in k.name}
_NUMBERED = [(re.compile(re.escape(k.name).replace("<i>", r"[1-9][0-9]*") + "$"), k) for k in KEYS if "<i>" in k.name]


def key_of(name: str) -> Key | None:
    """The schema entry for an objects key, or None for a key Ravex does not define."""
    if name in _EXACT:
        return _EXACT[name]
    return next((k for rx, k in _NUMBERED if rx.match(name)), None)


def check(objects: dict[str, Any], where: str) -> None:
    """Every well-known key holds what the schema says (tensor links count as
    values), else :class:`CorruptCheckpointError` naming the key and ``where``."""
    for name, value in objects.items():
        k = key_of(name)
        if k is None or isinstance(value, TensorLink):
            continue
        if not k.valid(value):
            raise CorruptCheckpointError(f"{where}: objects['{name}'] should be {k.expected}, not {type(value).__name__}",
                                         hint="the checkpoint's small state is damaged or not what Ravex wrote; restore it from a copy")
