"""Reading checkpoints back for a resume: the native store (checksums verified) and the
torch_save backend's files (``torch.load(weights_only=True)``). Nothing is unpickled freely."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import MODEL, OPTIM, Checkpoint

from .state import tensor_view

__all__ = ["TS_FILE", "load_checkpoint", "load_torch_save", "torch_save_files"]


def load_checkpoint(path: Path, index: int = -1) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """A checkpoint of a native store (checksums verified) and its tensors, each
    read by the Rust executor straight into a new CPU tensor (one job for all)."""
    from ravex_convert._engine import read_many
    from ravex_convert.formats import native

    ckpt = native.read(path, index)
    native.verify_chunks(ckpt)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in ckpt.tensors.items():
        tensors[name] = torch.empty(tuple(t.shape), dtype=getattr(torch, t.dtype))
    read_many([(t, tensor_view(tensors[name]), None) for name, t in ckpt.tensors.items() if t.numel])
    for alias, target in ckpt.aliases.items():
        tensors[alias] = tensors[target]
    return ckpt, tensors


TS_FILE = re.compile(r"\.?ckpt-\d{8}\.pt.*")


def torch_save_files(store: Path) -> dict[int, Path]:
    """index -> path of the torch_save backend's complete checkpoints, oldest first."""
    found = {int(p.name[5:13]): p for p in store.glob("ckpt-*.pt") if re.fullmatch(r"ckpt-\d{8}\.pt", p.name)}
    return dict(sorted(found.items()))


def load_torch_save(path: Path) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """A checkpoint of the torch_save backend, read with ``torch.load(weights_only=True)`` (no arbitrary objects)."""
    root = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(root, dict) or "model" not in root:
        raise RavexError(f"{path}: not a checkpoint the runtime wrote (no 'model')", hint="resume from a checkpoint Ravex wrote", path=path)
    tensors: dict[str, torch.Tensor] = {f"{MODEL}{k}": v for k, v in root["model"].items()}
    optim = root.get("optim") or {}
    for fqn, st in (optim.get("state") or {}).items():
        for k, v in st.items():
            tensors[f"{OPTIM}{k}/{fqn}"] = v
    ckpt = Checkpoint("torch_save", path, step=root.get("step"))
    ckpt.objects = {k: v for k, v in root.items() if k not in ("model", "optim")}
    if "param_groups" in optim:
        ckpt.objects["optim.param_groups"] = optim["param_groups"]
    return ckpt, tensors
