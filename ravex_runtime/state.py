"""Turning live training state into a checkpoint model and back.

Collection runs on the training thread and only copies (``capture``, of a
session's :class:`Tracked` objects, into a :class:`Snapshot`); turning
the copies into bytes and a :class:`~ravex_convert.model.Checkpoint` happens on
the writer thread (``to_checkpoint``). Names follow the checkpoint model:
``model/<fqn>`` for the model, ``optim/<state>/<fqn>`` for the first
optimizer (keyed by parameter name), ``obj/<key>/<path>`` for tensors inside
every other object (RNG states, other optimizers, tracked objects).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import BUFFER, FROZEN, MODEL, OBJ, OPTIM, PARAMETER, Box, Checkpoint, Chunk, LogicalTensor, TensorLink

from .sampler import LoaderState, host_rng, set_host_rng, snap_host_rng

__all__ = ["Snapshot", "Tracked", "capture", "capture_rng", "layout_of", "restore_rng", "tensor_view", "to_checkpoint", "unflatten"]


@dataclass
class Tracked:
    """The live objects of a session at one moment, held strongly for as long as this view lives:
    what a capture saves and what a restore is checked against and put into.

    ``models`` are the outermost modules that hold state, the one owning the first optimizer's
    parameters first ("the model", saved as ``model/<fqn>``; the others as ``obj/model.<i>/``).
    ``loaders`` keep their registration order, with None where a loader is gone: a checkpoint's
    positions are matched to loaders by that order. ``named``: objects saved whole by name.
    """

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    loaders: list[tuple[Any, LoaderState]] = field(default_factory=list)
    named: dict[str, Any] = field(default_factory=dict)

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> its name: ``<fqn>`` in the model, ``model<i>.<fqn>`` in the i-th other one."""
        names: dict[int, str] = {}
        for i, m in enumerate(self.models):
            for n, p in m.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n if i == 0 else f"model{i}.{n}")
        return names


@dataclass
class Snapshot:
    """Copies of the state, made on the training thread.

    ``spare`` holds the buffers of an earlier snapshot the writer has finished
    with, by name: a tensor of the same shape and dtype is copied into its old
    buffer instead of a fresh allocation (several times faster: no new pages
    to fault in), so a checkpoint blocks training for about one memcpy.
    """

    step: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    spare: dict[str, torch.Tensor] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # model/ tensor -> parameter, frozen or buffer
    # per_rank checkpoints (a sharded model whose ranks write their own shards): a DTensor is copied as
    # this rank's shard, and ``shards`` says where it lies (name -> global shape, offset); a shard
    # another rank also holds (a replicated mesh dimension) is left to that rank (``skipped``).
    # ``rank`` owns every chunk of this snapshot; ``layout`` (set before the write) is every
    # rank's list of (name, dtype, global shape, offset, local shape, kind), the same on all ranks.
    local_shards: bool = False
    rank: int = 0
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    layout: list[list[tuple[Any, ...]]] | None = None
    # On many ranks a copy that fails (out of memory) must not make this rank leave the collectives
    # the others are in: the capture goes on (gathering, copying nothing) and says why here; the
    # ranks then write nothing for this step, all of them.
    failed: str | None = None
    tolerant: bool = False  # many ranks: a failed copy is recorded in ``failed``, not raised

    def add(self, name: str, t: torch.Tensor) -> TensorLink:
        if self.failed is not None:
            return TensorLink(name)
        try:
            return self._add(name, t)
        except (RuntimeError, RavexError, MemoryError) as exc:
            if not self.tolerant:
                raise
            self.failed = f"{name}: {exc}"
            return TensorLink(name)

    def _add(self, name: str, t: torch.Tensor) -> TensorLink:
        # A real copy: the training thread goes on changing the original in place.
        t = t.detach()
        if self.local_shards and _is_dtensor(t):
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            dt: Any = t
            if any(type(pl).__name__ == "_StridedShard" for pl in dt.placements):
                raise RavexError(f"'{name}' is sharded with a strided placement, whose local piece is not one box of the tensor",
                                 hint="set sharded_checkpoints: gather for this model")
            local = dt.to_local()
            shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
            if tuple(local.shape) != tuple(shape):
                raise RavexError(f"'{name}': the local shard is {list(local.shape)}, its layout says {list(shape)}",
                                 hint="set sharded_checkpoints: gather for this model")
            coord = dt.device_mesh.get_coordinate() or []
            if any(isinstance(pl, Replicate) and c != 0 for pl, c in zip(dt.placements, coord)):
                return TensorLink(name)  # the first replica along that mesh dimension writes it
            self.shards[name] = (tuple(int(s) for s in t.shape), tuple(int(o) for o in offset))
            t = local
        buf = self.spare.pop(name, None)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buf.copy_(t)
        self.tensors[name] = buf
        return TensorLink(name)

    def flatten(self, value: Any, prefix: str) -> Any:
        """``value`` with every tensor replaced by a link to a copy named ``obj/<prefix>/<path>``."""
        if isinstance(value, torch.Tensor):
            return self.add(f"{OBJ}{prefix}", value)
        if isinstance(value, dict):
            return {k: self.flatten(v, f"{prefix}/{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self.flatten(v, f"{prefix}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self.flatten(v, f"{prefix}/{i}") for i, v in enumerate(value))
        if type(value).__module__ == "numpy":
            return _numpy_plain(value)
        return value


def _full(t: torch.Tensor, local: bool = False) -> torch.Tensor:
    """A sharded tensor (a DTensor: FSDP2) as the whole tensor, on every rank (a collective); any
    other tensor, or with ``local`` (per_rank: each rank copies its own shard), as it is."""
    return cast(Any, t).full_tensor() if _is_dtensor(t) and not local else t


def _is_dtensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def capture(live: Tracked, step: int, spare: dict[str, torch.Tensor], extra: dict[str, Any], *, keep: bool = True,
            rank_part: int | None = None, local_shards: bool = False) -> Snapshot:
    """Copy the state of ``live`` (training thread) into a snapshot of ``step``, reusing ``spare`` buffers.

    On many ranks: the tensors of a sharded model (DTensors) are gathered whole on every rank, in
    the same order everywhere (each gather is a collective); with ``keep=False`` (not rank 0) they
    are let go at once and nothing but the random streams and data positions is copied. Those are
    this rank's own: with ``rank_part`` they are named ``ranks/<rank>/...`` (rank 0 gathers
    every rank's part into the checkpoint), and also, on rank 0, at the top level, where a
    one-process resume looks for them."""
    snap = Snapshot(step=step, spare=spare, local_shards=local_shards, rank=rank_part or 0, tolerant=rank_part is not None)
    for i, m in enumerate(live.models):
        for k, v in (_fsdp1_state(m) if is_fsdp1(m) else m.state_dict()).items():
            if isinstance(v, torch.Tensor):
                v = _full(v, local_shards)
                if keep or (local_shards and _is_dtensor(v)):
                    snap.add(f"{MODEL}{k}" if i == 0 else f"{OBJ}model.{i}/{k}", v)
    if live.models and not is_fsdp1(live.models[0]):
        # what each of the model's tensors is: a converter to ZeRO-3 needs it, and no file could tell it
        m = live.models[0]
        snap.kinds = {f"{MODEL}{n}": BUFFER for n, _ in m.named_buffers(remove_duplicate=False)}
        snap.kinds.update({f"{MODEL}{n}": PARAMETER if p.requires_grad else FROZEN for n, p in m.named_parameters(remove_duplicate=False)})
    names = live.param_names()
    for i, opt in enumerate(live.optimizers):
        if i == 0 and live.models and is_fsdp1(live.models[0]):
            state = _capture_fsdp1_optimizer(snap, live.models[0], opt, keep)
            if keep:
                snap.objects.update(state)
        elif i == 0:
            state = _capture_optimizer(snap, opt, names, keep, local_shards)
            if keep:
                snap.objects.update(state)
        elif keep:
            snap.objects[f"optimizer.{i}"] = snap.flatten(opt.state_dict(), f"optimizer.{i}")
    if keep:
        for i, s in enumerate(live.schedulers):
            snap.objects["lr_scheduler" if i == 0 else f"lr_scheduler.{i}"] = snap.flatten(s.state_dict(), f"lr_scheduler.{i}")
        for i, s in enumerate(live.scalers):
            snap.objects["grad_scaler" if i == 0 else f"grad_scaler.{i}"] = snap.flatten(s.state_dict(), f"grad_scaler.{i}")
        snap.objects["tracked"] = {name: snap.flatten(obj.state_dict(), f"tracked/{name}") for name, obj in live.named.items()}
    if rank_part is None or keep:
        snap.objects["rng"] = capture_rng(snap, "rng")
        snap.objects["loaders"] = [st.capture(snap, ld) if ld is not None else None for ld, st in live.loaders]
    if rank_part is not None:
        snap.objects["rank_part"] = {"rng": capture_rng(snap, f"ranks/{rank_part}/rng"),
                                     "loaders": [st.capture(snap, ld, f"ranks/{rank_part}/loaders/{st.index}") if ld is not None else None
                                                 for ld, st in live.loaders]}
    snap.objects["step"] = step
    snap.objects["extra"] = extra
    snap.spare = {}  # buffers of tensors that are gone: let them go
    return snap


def _capture_optimizer(snap: Snapshot, opt: Any, names: dict[int, str], keep: bool = True, local_shards: bool = False) -> dict[str, Any]:
    """The first optimizer, keyed by parameter name: tensors as ``optim/<state>/<fqn>``, the rest as objects.
    Sharded state (FSDP2's moments are DTensors) is gathered whole; ``keep=False``: gathered and let go.
    ``local_shards``: each rank copies its own shards of it (and rank 0, with ``keep``, the rest)."""
    sd = opt.state_dict()
    if local_shards and not keep:
        fqns = [names.get(id(p), f"param.{j}") for j, p in enumerate(p for g in opt.param_groups for p in g["params"])]
        for pid, st in sd["state"].items():
            for k, v in st.items():
                if _is_dtensor(v):
                    snap.add(f"{OPTIM}{k}/{fqns[pid]}", v)
        return {}
    if not keep:
        # the same gathers as rank 0's, in the same order (the state's own, the same on every rank)
        for st in sd["state"].values():
            for v in st.values():
                if _is_dtensor(v):
                    _full(v)
        return {}
    pnames: list[str] = []
    for g in opt.param_groups:
        for p in g["params"]:
            pnames.append(names.get(id(p), f"param.{len(pnames)}"))
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        fqn = pnames[pid]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                snap.add(f"{OPTIM}{k}/{fqn}", _full(v, local_shards))
            else:
                scalars.setdefault(fqn, {})[k] = v
    groups = []
    for g in sd["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [pnames[i] for i in g["params"]]})
    return {"optim.param_groups": snap.flatten(groups, "optim.param_groups"), "optim.scalars": scalars}


def is_fsdp1(m: Any) -> bool:
    """An FSDP1 (``FullyShardedDataParallel``) module: flat parameters that name no tensor of the model."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(x, FullyShardedDataParallel) for x in m.modules())


def _fsdp1_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fsdp1_state(m: Any) -> dict[str, Any]:
    """An FSDP1 model's state by its tensors' own names, whole on rank 0 (empty elsewhere): torch's own
    state-dict API, a collective every rank joins. FSDP1 is checkpointed as ``gather``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(m, options=_fsdp1_options()))


def _capture_fsdp1_optimizer(snap: Snapshot, m: Any, opt: Any, keep: bool) -> dict[str, Any]:
    """The optimizer of an FSDP1 model, keyed by parameter name (torch's state-dict API unflattens it;
    a collective), in the same layout as :func:`_capture_optimizer`'s."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd: Any = get_optimizer_state_dict(m, opt, options=_fsdp1_options())
    if not keep:
        return {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in sd.get("state", {}).items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                snap.add(f"{OPTIM}{k}/{fqn}", v)
            else:
                scalars.setdefault(str(fqn), {})[k] = v
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": list(g["params"])} for g in sd.get("param_groups", [])]
    return {"optim.param_groups": snap.flatten(groups, "optim.param_groups"), "optim.scalars": scalars}


def _numpy_plain(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.dtype.str, "shape": list(value.shape), "data": value.tobytes()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _numpy_back(value: Any) -> Any:
    """A NumPy array saved by :func:`_numpy_plain`. Only plain numeric dtypes: an object (or
    structured) dtype would make NumPy build Python objects from the checkpoint's bytes."""
    import numpy as np

    if not (isinstance(value, dict) and "__ndarray__" in value):
        return value
    code, shape, data = value.get("__ndarray__"), value.get("shape"), value.get("data")
    try:
        dt = np.dtype(code) if isinstance(code, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise RavexError(f"the checkpoint holds a NumPy array of dtype {code!r}; only plain numeric dtypes are restored",
                         hint="the checkpoint is damaged or was not written by Ravex; use an older one")
    if (not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            or not isinstance(data, (bytes, bytearray)) or len(data) != math.prod(shape) * dt.itemsize):
        raise RavexError(f"the checkpoint holds a NumPy array of dtype {code!r} whose shape {shape!r} does not match its bytes",
                         hint="the checkpoint is damaged; use an older one")
    return np.frombuffer(bytes(data), dtype=dt).reshape(shape).copy()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place (no copy): the writer reads
    the snapshot's own memory, which nothing changes until it is handed back."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def layout_of(snap: Snapshot) -> list[tuple[Any, ...]]:
    """This rank's part of a per_rank checkpoint's layout: (name, dtype, global shape, offset, local shape, kind) per tensor."""
    out = []
    for name, t in snap.tensors.items():
        local = tuple(int(s) for s in t.shape)
        shape, offset = snap.shards.get(name, (local, tuple(0 for _ in local)))
        out.append((name, _dtype_name(t), shape, offset, local, snap.kinds.get(name)))
    return out


def to_checkpoint(snap: Snapshot, path: Any) -> Checkpoint:
    """A checkpoint model whose chunks carry the snapshot's bytes inline (writer thread). With a
    ``layout`` (per_rank), every rank's chunks, in the same order on every rank: this rank's with
    their bytes, the others' with their place (each rank writes its own)."""
    ckpt = Checkpoint("native", path, step=snap.step)
    if snap.layout is None:
        for name, t in snap.tensors.items():
            shape = tuple(int(s) for s in t.shape)
            lt = LogicalTensor(name, shape, _dtype_name(t), kind=snap.kinds.get(name))
            if t.numel():
                lt.chunks.append(Chunk(Box(tuple(0 for _ in shape), shape), lt.dtype, data=tensor_view(t)))
            ckpt.add(lt)
    else:
        for rank, part in enumerate(snap.layout):
            for name, dtype, shape, offset, local, kind in part:
                lt = ckpt.tensors.get(name) or ckpt.add(LogicalTensor(name, tuple(shape), dtype, kind=kind))
                if tuple(lt.shape) != tuple(shape) or lt.dtype != dtype:
                    raise RavexError(f"'{name}' is {list(shape)} {dtype} on rank {rank}, {list(lt.shape)} {lt.dtype} on another",
                                     hint="every rank must train the same model")
                if not math.prod(local):
                    continue
                data = tensor_view(snap.tensors[name]) if rank == snap.rank else None
                lt.chunks.append(Chunk(Box(tuple(offset), tuple(local)), dtype, data=data, owner=rank))
    ckpt.objects = dict(snap.objects)
    return ckpt


def links(value: Any) -> list[str]:
    """The names of the tensors :func:`unflatten` would put into ``value``."""
    if isinstance(value, TensorLink):
        return [value.name]
    if isinstance(value, dict):
        return [n for v in value.values() for n in links(v)]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in links(v)]
    return []


def unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :meth:`Snapshot.flatten`: links replaced by loaded tensors."""
    if isinstance(value, TensorLink):
        if value.name not in tensors:
            raise RavexError(f"the checkpoint refers to tensor '{value.name}' but does not hold it", hint="the checkpoint is damaged; use an older one")
        return tensors[value.name]
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return _numpy_back(value)
        return {k: unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [unflatten(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(unflatten(v, tensors) for v in value)
    return value


# ---------------------------------------------------------------- RNG


def capture_rng(snap: Snapshot, key: str) -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states."""
    out = snap_host_rng(snap, key, host_rng())
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [snap.add(f"{OBJ}{key}/cuda/{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    set_host_rng(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

