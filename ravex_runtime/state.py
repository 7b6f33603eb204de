"""Turning live training state into a checkpoint model and back.

Collection runs on the training thread and only copies (``snapshot``); turning
the copies into bytes and a :class:`~ravex_convert.model.Checkpoint` happens on
the writer thread (``to_checkpoint``). Names follow the checkpoint model:
``model/<fqn>`` for the model, ``optim/<state>/<fqn>`` for the first
optimizer (keyed by parameter name), ``obj/<key>/<path>`` for tensors inside
every other object (RNG states, other optimizers, tracked objects).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import OBJ, Box, Checkpoint, Chunk, LogicalTensor, TensorLink

__all__ = ["Snapshot", "capture_rng", "from_bytes", "restore_rng", "tensor_view", "to_checkpoint", "unflatten"]


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

    def add(self, name: str, t: torch.Tensor) -> TensorLink:
        # A real copy: the training thread goes on changing the original in place.
        t = t.detach()
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


def from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape).clone()


def to_checkpoint(snap: Snapshot, path: Any) -> Checkpoint:
    """A checkpoint model whose chunks carry the snapshot's bytes inline (writer thread)."""
    ckpt = Checkpoint("native", path, step=snap.step)
    for name, t in snap.tensors.items():
        shape = tuple(int(s) for s in t.shape)
        lt = LogicalTensor(name, shape, _dtype_name(t))
        if t.numel():
            lt.chunks.append(Chunk(Box(tuple(0 for _ in shape), shape), lt.dtype, data=tensor_view(t)))
        ckpt.add(lt)
    ckpt.objects = dict(snap.objects)
    return ckpt


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
    out: dict[str, Any] = {"python": random.getstate(), "torch": snap.add(f"{OBJ}{key}/torch", torch.get_rng_state())}
    try:
        import numpy as np

        out["numpy"] = snap.flatten(np.random.get_state(legacy=True), f"{key}/numpy")
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [snap.add(f"{OBJ}{key}/cuda/{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

