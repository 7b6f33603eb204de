"""Reading checkpoints back for a resume: the native store (checksums verified) and the
torch_save backend's files (``torch.load(weights_only=True)``). Nothing is unpickled freely."""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import LayoutMismatchError, RavexError
from ravex_convert.model import MODEL, OPTIM, Box, Checkpoint, Chunk, Flat

from .state import _is_dtensor, tensor_view

__all__ = [
    "TS_FILE", "as_shard", "is_lazy", "load_checkpoint", "load_state", "load_torch_save", "read_for", "read_regions", "read_tensors", "shard_box",
    "torch_save_files",
]


def load_checkpoint(path: Path, index: int = -1, *, lazy: bool = False) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """A checkpoint of a native store (checksums verified) and its tensors, each
    read by the Rust executor straight into a new CPU tensor (one job for all).
    ``lazy``: no tensor is read (the dict is empty): a rank of a sharded run reads its
    own part when the live objects exist (:func:`read_for`)."""
    from ravex_convert.formats.native import reader as native

    ckpt = native.read(path, index)
    if lazy:
        native.verify_chunks(ckpt)
        return ckpt, {}
    # The checksums of uncompressed chunks are checked on the bytes as read, not in a read of their
    # own first: from a bucket that was a second download of the checkpoint (a resume of 384 MiB
    # fetched 768 MiB; docs/benchmarks-s3.md). The tensors are new: nothing uses them before this returns.
    deferred = native.check_chunks(ckpt)
    tensors = read_tensors(ckpt)
    native.verify_read(ckpt, deferred, lambda name, c: _chunk_bytes(tensors[name], c) if c.dtype == ckpt.tensors[name].dtype else None)
    return ckpt, tensors


def _chunk_bytes(t: torch.Tensor, c: Chunk) -> memoryview:
    """The bytes of chunk ``c``'s region of tensor ``t`` (row-major within the region)."""
    r = c.region
    if isinstance(r, Flat):
        part = t.reshape(-1)[r.start:r.start + r.length]
    else:
        part = t[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.sizes, strict=True))]
    return part.contiguous().reshape(-1).view(torch.uint8).numpy().data


def read_tensors(ckpt: Checkpoint, prefix: str | None = None, *, verify: bool = False,
                 names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint :func:`ravex_convert.formats.native.reader.read` opened, whole,
    on the CPU (aliases share their target's tensor); with ``prefix`` only the names under it (and
    the targets of aliases under it), with ``names`` only those (and their aliases' targets).
    ``verify``: their checksums are checked first."""
    from ravex_convert._engine import read_many
    from ravex_convert.formats.native import reader as native

    def picked(n: str) -> bool:
        return (prefix is None or n.startswith(prefix)) and (names is None or n in names)

    aliases = {a: t for a, t in ckpt.aliases.items() if picked(a)}
    wanted = [n for n in ckpt.tensors if picked(n) or n in aliases.values()]
    if verify:
        native.verify_chunks(ckpt, wanted)
    tensors: dict[str, torch.Tensor] = {}
    for name in wanted:
        t = ckpt.tensors[name]
        tensors[name] = torch.empty(tuple(t.shape), dtype=getattr(torch, t.dtype))
    read_many([(ckpt.tensors[name], tensor_view(tensors[name]), None) for name in wanted if ckpt.tensors[name].numel])
    for alias, target in aliases.items():
        tensors[alias] = tensors[target]
    return tensors


def load_state(module: torch.nn.Module, sd: dict[str, torch.Tensor], where: str, *, prefix: str = "", strict: bool = True,
               path: Any = None) -> None:
    """Load ``sd`` into ``module``, every name and shape checked first: torch's ``load_state_dict``
    copies what fits before it raises for what does not (:class:`LayoutMismatchError`, nothing loaded).
    ``prefix``: what the checkpoint's names have before the module's (``model/``), for messages."""
    live = {k: v for k, v in module.state_dict().items() if hasattr(v, "shape")}
    hint = "load into the model the checkpoint was written from, or pass strict=False to skip names that differ"
    for k in sorted(sd.keys() & live.keys()):
        if tuple(sd[k].shape) != tuple(live[k].shape):
            raise LayoutMismatchError(f"{where}: tensor '{prefix}{k}' is {list(sd[k].shape)} in the checkpoint, {list(live[k].shape)} in "
                                      f"{type(module).__name__}; nothing was loaded", hint=hint, path=path)
    missing, unexpected = sorted(live.keys() - sd.keys()), sorted(sd.keys() - live.keys())
    if strict and (missing or unexpected):
        raise LayoutMismatchError(f"{where}: {type(module).__name__} does not match the checkpoint: missing in the checkpoint {missing[:5]}, "
                                  f"in the checkpoint but not in the model {unexpected[:5]}; nothing was loaded", hint=hint, path=path)
    module.load_state_dict(sd, strict=strict)


def is_lazy(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> bool:
    """``tensors`` are still to be read (:func:`load_checkpoint` with ``lazy``)."""
    return bool(ckpt.tensors) and not tensors


def shard_box(like: Any) -> Any:
    """The box of the global tensor this rank holds of ``like``, an FSDP2 shard (a DTensor on the
    CPU whose placements are Shard or Replicate: the local shard is one box); None for anything
    else (read whole, then cut)."""
    if like is None or not _is_dtensor(like) or like.device.type != "cpu":
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in like.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def as_shard(local: torch.Tensor, like: Any) -> torch.Tensor:
    """``local`` (this rank's box of the tensor, as :func:`shard_box` gives it) as a DTensor laid out like ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def read_regions(items: list[tuple[Any, Any, Any, str | None]]) -> None:
    """:func:`ravex_convert._engine.read_parts` with this rank's share of the machine's CPUs (the
    ranks of a node read at once)."""
    from ravex_convert._dist import local_size
    from ravex_convert._engine import read_parts

    read_parts(items, threads=max(1, (os.cpu_count() or 1) // local_size()))


def read_for(ckpt: Checkpoint, live: Any) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a (lazily loaded) checkpoint as this rank restores them: where the live
    counterpart is an FSDP2 shard, only its box (:func:`shard_box`), as a DTensor laid out like it;
    everything else whole. The model's tensors are matched by name, the first optimizer's state by
    parameter name and shape. Also the bytes of model and optimizer tensors read (the part that is
    sharded; the small state is read whole by every rank)."""
    model = live.models[0] if live.models else None
    sd = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)} if model is not None else {}
    params: dict[str, torch.Tensor] = {}
    for i, m in enumerate(live.models):
        for n, p in m.named_parameters(remove_duplicate=False):
            params.setdefault(n if i == 0 else f"model{i}.{n}", p)
    items: list[tuple[Any, Any, Any, str | None]] = []
    out: dict[str, torch.Tensor] = {}
    for name, t in ckpt.tensors.items():
        like: Any = None
        if name.startswith(MODEL):
            like = sd.get(name[len(MODEL):])
        elif name.startswith(OPTIM) and name.count("/") >= 2:
            like = params.get(name.split("/", 2)[2])
        box = shard_box(like) if like is not None and tuple(like.shape) == tuple(t.shape) else None
        buf = torch.empty(tuple(box.sizes if box is not None else t.shape), dtype=getattr(torch, t.dtype))
        if buf.numel():
            items.append((t, box if box is not None else t.whole(), tensor_view(buf), None))
        out[name] = as_shard(buf, like) if box is not None else buf
    read_regions(items)
    for alias, target in ckpt.aliases.items():
        out[alias] = out[target]
    return out, sum(len(view) for t, _, view, _ in items if t.name.startswith((MODEL, OPTIM)))


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
