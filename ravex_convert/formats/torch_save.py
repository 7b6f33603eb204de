"""torch_save: one ``torch.save`` file holding a state dict or a training state.

Layouts people actually have (DESIGN.md, "conventions"):
- a bare state dict ``{name: tensor}``;
- ``{"model": sd, "optimizer": <torch optimizer state_dict, integer keyed>, ...}``;
- Ravex's portable layout ``{"model": sd, "optim": <keyed by parameter name>, ...}``;
- Lightning's ``{"state_dict": sd, "optimizer_states": [...], "global_step": n}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._torchzip import TorchArchive, is_torch_zip, open_archive
from .._unpickle import TensorRef
from ..errors import UnknownFormatError
from ..info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo

__all__ = ["sniff", "describe", "find_model_and_optimizer", "SUFFIXES"]

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
_OPTIM_KEYS = ("optim", "optimizer", "optimizer_state_dict")
_STEP_KEYS = ("step", "global_step", "iteration", "global_steps")


def _candidates(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def sniff(path: Path) -> list[str] | None:
    if path.is_file():
        if is_torch_zip(path):
            return [f"{path.name} is a torch.save zip archive"]
        if path.suffix in SUFFIXES:
            # Claim it so the user hears "corrupt" rather than "unknown format".
            return [f"{path.name} has a torch.save suffix (its contents are checked next)"]
        return None
    files = _candidates(path)
    if len(files) == 1 and is_torch_zip(files[0]):
        return [f"the directory holds one torch.save archive, {files[0].name}"]
    return None


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and all(
        isinstance(v, TensorRef) for v in obj.values()
    )


def find_model_and_optimizer(root: Any) -> tuple[str | None, dict[str, Any] | None, str | None, dict[str, Any] | None]:
    """(key of the model state dict or None for a bare one, the dict, key of the optimizer state, its dict)."""
    if _is_state_dict(root):
        return None, root, None, None
    if not isinstance(root, dict):
        return None, None, None, None
    model_key = next((k for k in _MODEL_KEYS if _is_state_dict(root.get(k))), None)
    optim_key = next((k for k in _OPTIM_KEYS if isinstance(root.get(k), dict) and "state" in root[k]), None)
    optim = root[optim_key] if optim_key else None
    if optim is None and isinstance(root.get("optimizer_states"), list) and root["optimizer_states"]:
        optim_key, optim = "optimizer_states[0]", root["optimizer_states"][0]
    return model_key, (root[model_key] if model_key else None), optim_key, optim


def _aliases(sd: dict[str, TensorRef]) -> dict[str, str]:
    first: dict[tuple[str, int, tuple[int, ...]], str] = {}
    out: dict[str, str] = {}
    for name, t in sd.items():
        key = (t.storage.key, t.storage_offset, t.shape)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _optimizer_info(archive: TorchArchive, optim: dict[str, Any], info: CheckpointInfo) -> OptimizerInfo:
    state = optim.get("state") or {}
    names: list[str] = []
    for per_param in state.values():
        if isinstance(per_param, dict):
            names.extend(n for n in per_param if n not in names)
    groups = optim.get("param_groups")
    kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(names) else ("SGD" if "momentum_buffer" in names else "unknown")
    keyed_by_index = any(isinstance(k, int) for k in state)
    if keyed_by_index:
        info.notes.append("optimizer state is keyed by parameter index (torch's optimizer.state_dict()); names come from parameter order")
    for pname, per_param in state.items():
        if not isinstance(per_param, dict):
            continue
        for sname, value in per_param.items():
            if isinstance(value, TensorRef):
                info.tensors.append(TensorInfo(f"optim.{sname}/{pname}", value.shape, value.dtype, "optim"))
    return OptimizerInfo(kind, names, len(groups) if isinstance(groups, list) else None)


def _step(archive: TorchArchive, root: Any, optim: dict[str, Any] | None) -> int | None:
    if isinstance(root, dict):
        for k in _STEP_KEYS:
            v = root.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    if optim and isinstance(optim.get("state"), dict):
        for per_param in optim["state"].values():
            s = per_param.get("step") if isinstance(per_param, dict) else None
            if isinstance(s, TensorRef) and s.numel == 1:
                return int(archive.read_scalar(s))
            if isinstance(s, (int, float)) and not isinstance(s, bool):
                return int(s)
    return None


def describe(path: Path, reasons: list[str]) -> CheckpointInfo:
    file = path if path.is_file() else _candidates(path)[0]
    archive = open_archive(file)
    root = archive.root
    model_key, sd, optim_key, optim = find_model_and_optimizer(root)
    if sd is None:
        keys = ", ".join(repr(k) for k in list(root)[:8]) if isinstance(root, dict) else type(root).__name__
        raise UnknownFormatError(
            f"{file}: a torch.save file, but no model state dict found in it (top level: {keys})",
            hint="Ravex reads a bare state dict or a dict with one of the keys " + ", ".join(_MODEL_KEYS),
            path=file,
        )
    variant = "state_dict" if model_key is None else ("training_state" if optim is not None else "model")
    info = CheckpointInfo("torch_save", variant, str(path), world_size=1, reasons=reasons)
    info.files = [FileInfo(file.name if path.is_dir() else file.name, file.stat().st_size, "state")]
    info.aliases = _aliases(sd)
    for name, t in sd.items():
        kind = "param" if t.is_parameter or t.requires_grad else "other"
        info.tensors.append(TensorInfo(name, t.shape, t.dtype, kind))
    if not any(t.kind == "param" for t in info.tensors):
        # state_dict() detaches parameters, so a plain save records no flag:
        # count floating-point entries as parameters, say so.
        for t in info.tensors:
            if t.dtype.startswith(("float", "bfloat")):
                t.kind = "param"
        info.notes.append("parameters and buffers are not distinguished in a plain state dict; floating-point tensors are counted as parameters")
    if optim is not None:
        info.optimizer = _optimizer_info(archive, optim, info)
    info.step = _step(archive, root, optim)
    if model_key is not None:
        info.extra["model_key"] = model_key
        info.extra["optimizer_key"] = optim_key
    return info
