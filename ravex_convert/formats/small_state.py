"""Small state in a torch.save file, read into a checkpoint and written back.

A scheduler's or scaler's state dict, a DeepSpeed or Lightning client state, the
keys of a torch.save file beside its model and optimizer: plain values, with any
tensor inside moved out to an ``obj/`` logical tensor and linked from where it
sat (:func:`read_objects`); a writer resolves those links to the tensors it
writes (:func:`to_pickle`). The torch_save reader and the framework layouts
(HF Trainer, Accelerate, a ZeRO client state) share this walk, so the same
state reads the same from any of them.
"""

from __future__ import annotations

from typing import Any

from .._torchfile.archive import TorchArchive, gather_strided
from .._torchfile.unpickle import TensorRef
from .._torchfile.write import TensorOut
from ..errors import CorruptCheckpointError, RavexError
from ..model import Box, Checkpoint, Chunk, LogicalTensor, TensorLink

__all__ = ["read_objects", "tensor_chunk", "to_pickle"]


def tensor_chunk(archive: TorchArchive, ref: TensorRef, name: str, shallow: bool = False) -> LogicalTensor:
    """``ref`` of ``archive`` as the logical tensor ``name``: one chunk located in the file, or
    (a strided view) its elements gathered inline; ``shallow`` leaves a strided view without
    its chunk."""
    t = LogicalTensor(name, ref.shape, ref.dtype)
    whole = Box(tuple(0 for _ in ref.shape), ref.shape)
    if ref.is_contiguous():
        end = archive.tensor_offset(ref) + ref.nbytes
        storage_end = archive.storage_offsets[ref.storage.key] + archive.storage_sizes[ref.storage.key]
        if end > storage_end:
            raise CorruptCheckpointError(
                f"{archive.path}: tensor '{name}' runs past the end of its storage", hint="the file is truncated or damaged; copy it again", path=archive.path
            )
        t.chunks.append(Chunk(whole, ref.dtype, archive.path, archive.tensor_offset(ref)))
    elif not shallow:
        # A strided view (a transpose saved as is): gather its elements once,
        # here, and carry them inline. Rare, and small in practice.
        # (open_archive checked the view against its storage.)
        t.chunks.append(Chunk(whole, ref.dtype, data=gather_strided(archive, ref, f"tensor '{name}'")))
    return t


def read_objects(archive: TorchArchive, value: Any, ckpt: Checkpoint, prefix: str, shallow: bool = False) -> Any:
    """Small state, with any tensor inside moved out to an ``obj/`` logical tensor."""
    if isinstance(value, TensorRef):
        ckpt.add(tensor_chunk(archive, value, prefix, shallow))
        return TensorLink(prefix)
    if isinstance(value, dict):
        return type(value)((k, read_objects(archive, v, ckpt, f"{prefix}/{k}", shallow)) for k, v in value.items())
    if isinstance(value, list):
        return [read_objects(archive, v, ckpt, f"{prefix}/{i}", shallow) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(read_objects(archive, v, ckpt, f"{prefix}/{i}", shallow) for i, v in enumerate(value))
    return value


def to_pickle(value: Any, tensors: dict[str, TensorOut]) -> Any:
    """``value`` with every tensor link replaced by the tensor ``tensors`` writes under its name."""
    if isinstance(value, TensorLink):
        if value.name not in tensors:
            raise RavexError(f"the state names tensor '{value.name}', which is not in the checkpoint")
        return tensors[value.name]
    if isinstance(value, dict):
        return type(value)((k, to_pickle(v, tensors)) for k, v in value.items())
    if isinstance(value, list):
        return [to_pickle(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(to_pickle(v, tensors) for v in value)
    return value
