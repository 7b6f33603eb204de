"""A torch optimizer's ``state_dict()`` as torch.save wrote it.

The torch_save reader and the framework layouts that save one with torch.save
(an HF Trainer's ``optimizer.pt``, Accelerate's ``optimizer.bin``) check its
shape before walking it, show it in ``inspect``, read one parameter's state into
a checkpoint, and take the training step from it, all here.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from .._torchfile.archive import TorchArchive
from .._torchfile.unpickle import TensorRef
from ..errors import CorruptCheckpointError
from ..info import OptimizerInfo, TensorInfo
from ..model import OPTIM, Box, Checkpoint, Chunk, LogicalTensor
from .small_state import tensor_chunk

__all__ = ["STEP_KEYS", "add_param_state", "check_optimizer", "optimizer_info", "saved_step"]

# Where a training state's step is, at its top level (torch_save, Lightning, DeepSpeed).
STEP_KEYS = ("step", "global_step", "iteration", "global_steps")


def check_optimizer(optim: Any, key: str | None, file: Path) -> None:
    """The shape of a torch optimizer state dict, before anything walks it:
    ``state`` a dict of dicts, ``param_groups`` a list of dicts whose ``params``
    list parameter keys (ints or names)."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{file}: the optimizer state ('{key}') {what}; not a torch optimizer state_dict",
            hint="the file is damaged, or holds something else under that key; copy it again, or convert with --weights-only",
            path=file,
        )

    if not isinstance(optim, dict):
        raise bad("is not a dict")
    state = optim.get("state")
    if state is not None and (not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values())):
        raise bad("has a 'state' that is not a dict of per-parameter dicts")
    groups = optim.get("param_groups")
    if groups is None:
        return
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise bad("has 'param_groups' that are not a list of dicts")
    for g in groups:
        params = g.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, (int, str)) and not isinstance(p, bool) for p in params):
            raise bad("has a param group whose 'params' is not a list of parameter ids")


def optimizer_info(optim: dict[str, Any]) -> tuple[OptimizerInfo, list[TensorInfo]]:
    """The optimizer as ``inspect`` shows it, keyed as the file keys it (by
    position where torch's optimizer.state_dict() saved it)."""
    state = optim.get("state") or {}
    names: list[str] = []
    for per_param in state.values():
        if isinstance(per_param, dict):
            names.extend(n for n in per_param if n not in names)
    groups = optim.get("param_groups")
    kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(names) else ("SGD" if "momentum_buffer" in names else "unknown")
    tensors = [TensorInfo(f"optim.{sname}/{pname}", value.shape, value.dtype, "optim")
               for pname, per_param in state.items() if isinstance(per_param, dict)
               for sname, value in per_param.items() if isinstance(value, TensorRef)]
    return OptimizerInfo(kind, names, len(groups) if isinstance(groups, list) else None), tensors


def saved_step(archive: TorchArchive, root: Any, optim: dict[str, Any] | None) -> int | None:
    """The step a training state saved: an integer under one of :data:`STEP_KEYS` at the top
    of ``root``, else the first parameter's ``step`` in ``optim`` (read from ``archive``
    where it is a tensor); None where neither holds one."""
    if isinstance(root, dict):
        for k in STEP_KEYS:
            v = root.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    if optim and isinstance(optim.get("state"), dict):
        for per_param in optim["state"].values():
            s = per_param.get("step") if isinstance(per_param, dict) else None
            if isinstance(s, TensorRef) and s.numel == 1:
                s = archive.read_scalar(s)
            if isinstance(s, (int, float)) and not isinstance(s, bool):
                # a damaged step may be NaN or infinite: no step rather than a bare error
                return int(s) if math.isfinite(s) else None
    return None


def add_param_state(ckpt: Checkpoint, archive: TorchArchive, fqn: str, per: dict[str, Any], shallow: bool = False) -> None:
    """One parameter's optimizer state (``{state: tensor or number}``) as
    ``optim/<state>/<fqn>`` tensors located in ``archive``."""
    for sname, value in per.items():
        lname = f"{OPTIM}{sname}/{fqn}"
        if isinstance(value, TensorRef):
            ckpt.add(tensor_chunk(archive, value, lname, shallow))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            # old torch kept Adam's step as a Python number; keep it as the tensor newer torch saves
            ckpt.add(LogicalTensor(lname, (), "float32", [Chunk(Box((), ()), "float32", data=struct.pack("<f", float(value)))]))
