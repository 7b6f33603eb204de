"""torch_save: one ``torch.save`` file holding a state dict or a training state.

Layouts people actually have (DESIGN.md, "conventions"):
- a bare state dict ``{name: tensor}``;
- ``{"model": sd, "optimizer": <torch optimizer state_dict, integer keyed>, ...}``;
- Ravex's portable layout ``{"model": sd, "optim": <keyed by parameter name>, ...}``;
- Lightning's ``{"state_dict": sd, "optimizer_states": [...], "global_step": n}``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from .._torchzip import TorchArchive, is_torch_zip, open_archive
from .._unpickle import TensorRef
from ..errors import CorruptCheckpointError, LayoutMismatchError, UnknownFormatError
from ..info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ..model import MODEL, OBJ, OPTIM, Box, Checkpoint, Chunk, LogicalTensor, TensorLink, itemsize

__all__ = ["SUFFIXES", "describe", "find_model_and_optimizer", "sniff"]

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
    info.files = [FileInfo(file.name, file.stat().st_size, "state")]
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
        info.notes.append(NO_PARAM_MARKS)
    if optim is not None:
        info.optimizer = _optimizer_info(archive, optim, info)
    info.step = _step(archive, root, optim)
    if model_key is not None:
        info.extra["model_key"] = model_key
        info.extra["optimizer_key"] = optim_key
    return info


def _tensor_chunk(archive: TorchArchive, ref: TensorRef, name: str) -> LogicalTensor:
    t = LogicalTensor(name, ref.shape, ref.dtype)
    whole = Box(tuple(0 for _ in ref.shape), ref.shape)
    if ref.is_contiguous():
        end = archive.tensor_offset(ref) + ref.nbytes
        storage_end = archive.storage_offsets[ref.storage.key] + archive.storage_sizes[ref.storage.key]
        if end > storage_end:
            raise CorruptCheckpointError(f"{archive.path}: tensor '{name}' runs past the end of its storage", path=archive.path)
        t.chunks.append(Chunk(whole, ref.dtype, archive.path, archive.tensor_offset(ref)))
    else:
        # A strided view (a transpose saved as is): gather its elements once,
        # here, and carry them inline. Rare, and small in practice.
        t.chunks.append(Chunk(whole, ref.dtype, data=_gather_strided(archive, ref)))
    return t


def _gather_strided(archive: TorchArchive, ref: TensorRef) -> bytes:
    import numpy as np

    size = itemsize(ref.dtype)
    lanes = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    start = archive.storage_offsets[ref.storage.key]
    with open(archive.path, "rb") as f:
        f.seek(start)
        raw = f.read(archive.storage_sizes[ref.storage.key])
    storage = np.frombuffer(raw, dtype=lanes)
    view = np.lib.stride_tricks.as_strided(storage[ref.storage_offset:], shape=ref.shape, strides=tuple(s * size for s in ref.stride), writeable=False)
    return bytes(np.ascontiguousarray(view).tobytes())


def _param_names_by_order(sd: dict[str, TensorRef], aliases: dict[str, str], optim: dict[str, Any]) -> dict[Any, str]:
    """torch's optimizer.state_dict() keys parameters by position. Positions follow
    model.parameters(): state-dict order with buffers and tied duplicates left out.
    Buffers are not marked in a state dict, so a name is skipped when its shape
    cannot be the next parameter's (its exp_avg has another shape)."""
    ids = [pid for g in optim.get("param_groups") or [] for pid in g.get("params", [])]
    state = optim.get("state") or {}
    candidates = [n for n in sd if n not in aliases]
    out: dict[Any, str] = {}
    i = 0
    for pid in ids:
        want = None
        per = state.get(pid)
        if isinstance(per, dict):
            ref = next((v for k, v in per.items() if k != "step" and isinstance(v, TensorRef)), None)
            want = ref.shape if ref is not None else None
        while i < len(candidates) and want is not None and sd[candidates[i]].shape != want:
            i += 1
        if i >= len(candidates):
            raise LayoutMismatchError(
                "the optimizer state keys parameters by position, and its shapes do not match the model's parameters in order",
                hint="save the optimizer state keyed by name (torch.distributed.checkpoint.state_dict.get_state_dict) and convert that",
            )
        out[pid] = candidates[i]
        i += 1
    return out


def read(path: Path) -> Checkpoint:
    file = path if path.is_file() else _candidates(path)[0]
    info = describe(path, [])
    archive = open_archive(file)
    root = archive.root
    model_key, sd, optim_key, optim = find_model_and_optimizer(root)
    assert sd is not None  # describe() refused a file without one
    ckpt = Checkpoint("torch_save", file, world_size=1, step=info.step)
    ckpt.notes.extend(info.notes)
    aliases = _aliases(sd)
    for name, ref in sd.items():
        if name in aliases:
            ckpt.aliases[MODEL + name] = MODEL + aliases[name]
        else:
            ckpt.add(_tensor_chunk(archive, ref, MODEL + name))
    if optim is not None:
        state = optim.get("state") or {}
        by_index = any(isinstance(k, int) for k in state)
        names = _param_names_by_order(sd, aliases, optim) if by_index else {k: k for k in state}
        for key, per in state.items():
            fqn = names.get(key)
            if fqn is None or not isinstance(per, dict):
                continue
            for sname, value in per.items():
                lname = f"{OPTIM}{sname}/{fqn}"
                if isinstance(value, TensorRef):
                    ckpt.add(_tensor_chunk(archive, value, lname))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    # old torch kept Adam's step as a Python number; keep it as the tensor newer torch saves
                    ckpt.add(LogicalTensor(lname, (), "float32", [Chunk(Box((), ()), "float32", data=struct.pack("<f", float(value)))]))
        groups = []
        for g in optim.get("param_groups") or []:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [names.get(p, p) for p in g.get("params", [])]
            groups.append(g2)
        ckpt.objects["optim.param_groups"] = groups
    if isinstance(root, dict):
        for key, value in root.items():
            if key in (model_key, optim_key) or (optim_key == "optimizer_states[0]" and key == "optimizer_states"):
                continue
            ckpt.objects.setdefault("extra", {})[str(key)] = _objects(archive, value, ckpt, f"{OBJ}{key}")
    return ckpt


def _objects(archive: TorchArchive, value: Any, ckpt: Checkpoint, prefix: str) -> Any:
    """Small state, with any tensor inside moved out to an ``obj/`` logical tensor."""
    if isinstance(value, TensorRef):
        ckpt.add(_tensor_chunk(archive, value, prefix))
        return TensorLink(prefix)
    if isinstance(value, dict):
        return type(value)((k, _objects(archive, v, ckpt, f"{prefix}/{k}")) for k, v in value.items())
    if isinstance(value, list):
        return [_objects(archive, v, ckpt, f"{prefix}/{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_objects(archive, v, ckpt, f"{prefix}/{i}") for i, v in enumerate(value))
    return value
