"""``convert``, ``load_state_dict``: the conversion API the ``ravex`` command wraps.

Reading gives a :class:`~ravex_convert.model.Checkpoint` (where every byte is);
``select`` picks what goes out under which names; a format's ``write`` chooses
the target layout and the Rust executor moves the bytes once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import _core
from ._engine import SourceTable, chunk_bytes
from ._output import Options, durability, out_dtype, select
from .detect import detect, inspect, read_checkpoint
from .errors import RavexError
from .formats import native, safetensors, torch_save
from .model import MODEL, OPTIM, Box, Checkpoint, LogicalTensor, itemsize

__all__ = ["RESHARDABLE", "TARGETS", "convert", "load_state_dict", "materialize", "parse_size", "reshard"]

TARGETS = ("safetensors", "torch_save", "native", "dcp", "zero")
RESHARDABLE = ("zero", "dcp", "native")

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if value <= 0 or unit not in _UNITS:
        raise RavexError(f"'{text}' is not a size", hint="write it like 5GB, 500MiB or 1048576")
    return int(value * _UNITS[unit])


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    *,
    tag: str | None = None,
    index: int = -1,
    weights_only: bool = False,
    dtype: str | None = None,
    strip_prefix: Sequence[str] = (),
    force: bool = False,
    dry_run: bool = False,
    max_shard_size: int | str | None = None,
    compression: str | None = None,
    world_size: int = 1,
    param_names: list[str] | None = None,
    metadata_form: str = "current",
    zero_stage: int | None = None,
    precision: str | None = None,
    buffers: Sequence[str] | None = None,
    hyperparameters: Sequence[dict[str, Any]] | None = None,
    progress: Callable[[int], None] | None = None,
    sync: bool = True,
) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    Returns a summary (tensors, bytes, files, seconds; with ``dry_run`` the plan
    instead, and nothing is written). Raises :class:`RavexError` subclasses.
    ``progress``, if given, is called with the number of bytes written after
    each batch of about 256 MiB; if it also has an ``add_total(n)`` method,
    that is called before each copy job with the bytes the job will write (a
    conversion runs one job, or a few), so a bar can show an ETA.
    With ``sync=False`` (``--no-sync``) the output is renamed into place without
    waiting for it to reach the disk, as ``cp`` does: faster, but an OS crash or
    power cut soon after can leave a DST that looks complete and is not.
    """
    if to not in TARGETS:
        raise RavexError(f"--to {to}: not a format Ravex writes yet", hint=f"use one of {', '.join(TARGETS)}")
    if to == "zero" and zero_stage not in (1, 2, 3):
        raise RavexError(f"--to zero needs --zero-stage 1, 2 or 3 (got {zero_stage})", hint="choose the stage the resumed run will use")
    if isinstance(max_shard_size, str):
        max_shard_size = parse_size(max_shard_size)
    if compression not in (None, "none", "zstd"):
        raise RavexError(f"--compression {compression}: unknown", hint="use none or zstd")
    opts = Options(weights_only=weights_only or to == "safetensors", dtype=dtype, strip_prefix=list(strip_prefix), force=force,
                   max_shard_size=max_shard_size, compression=None if compression in (None, "none") else compression, world_size=world_size)
    t0 = time.perf_counter()
    ckpt = read_checkpoint(src, tag=tag, index=index, param_names=param_names)
    if not opts.weights_only and "optimizer_error" in ckpt.source:
        raise ckpt.source["optimizer_error"]
    out = select(ckpt, opts)
    if ckpt.format == "native" and not dry_run:
        # the store's checksums are checked before any byte is used (docs/format.md section 12)
        native.verify_chunks(ckpt, [n for n in ckpt.tensors if not opts.weights_only or n.startswith(MODEL)])
    notes = list(ckpt.notes)
    if to == "safetensors" and any(n.startswith(OPTIM) for n in ckpt.tensors):
        notes.append("safetensors holds weights only: the optimizer state was left out (use --to torch_save or native to keep it)")
    dst = Path(dst)
    if dry_run:
        summary = plan(out, opts)
        summary.update({"dry_run": True, "source_format": ckpt.format, "to": to, "dst": str(dst), "notes": notes})
        return summary
    with durability(sync):
        result = _write(out, dst, to, opts, progress, zero_stage=zero_stage, precision=precision, buffers=buffers,
                        hyperparameters=hyperparameters, metadata_form=metadata_form)
    result.update({"source_format": ckpt.format, "to": to, "dst": str(dst), "notes": notes + list(result.get("notes", [])),
                   "seconds": time.perf_counter() - t0, "synced": sync})
    return result


def _write(out: Checkpoint, dst: Path, to: str, opts: Options, progress: Callable[[int], None] | None, *, zero_stage: int | None,
           precision: str | None, buffers: Sequence[str] | None, hyperparameters: Sequence[dict[str, Any]] | None,
           metadata_form: str) -> dict[str, Any]:
    if to == "safetensors":
        result = safetensors.write(out, dst, opts, progress)
    elif to == "torch_save":
        result = torch_save.write(out, dst, opts, progress)
    elif to == "zero":
        from .formats import zero_write

        assert zero_stage is not None  # checked above
        result = zero_write.write(out, dst, opts, progress, zero_stage=zero_stage, precision=precision,
                                  buffers=buffers, hyperparameters=hyperparameters)
    elif to == "dcp":
        from .formats import dcp_write

        result = dcp_write.write(out, dst, opts, progress, metadata_form=metadata_form)
    else:
        from .formats import native_write

        result = native_write.write(out, dst, opts, progress=progress)
    return result


def reshard(src: str | Path, dst: str | Path, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """Change the number of ranks of a sharded checkpoint, keeping its format
    (model and optimizer state). Takes :func:`convert`'s keyword options."""
    fmt = detect(src).format
    if fmt not in RESHARDABLE:
        raise RavexError(f"{src}: a {fmt} checkpoint has no ranks to reshard",
                         hint="`ravex convert` changes its format; reshard works on " + ", ".join(RESHARDABLE))
    if fmt == "zero" and kwargs.get("zero_stage") is None:
        # keep the stage the run used (BF16_Optimizer runs ZeRO-1)
        kwargs["zero_stage"] = inspect(src, tag=kwargs.get("tag")).zero_stage
    return convert(src, dst, fmt, world_size=world_size, **kwargs)


def plan(ckpt: Checkpoint, opts: Options) -> dict[str, Any]:
    """What a conversion would do: tensors, bytes in and out, copy runs."""
    table = SourceTable()
    tensors: list[Any] = []
    offset = 0
    for t in ckpt.tensors.values():
        src = [table.chunk(c) for c in t.chunks]
        dt = out_dtype(t, opts)
        tensors.append((list(t.shape), src, [(0, offset, t.whole().to_core(), dt)]))
        offset += t.numel * itemsize(dt)
    summary = dict(_core.plan_summary(table.sources, ["<plan>"], tensors))
    return {
        "tensors": len(ckpt.tensors),
        "aliases": len(ckpt.aliases),
        "source_files": table.files,
        "bytes_read": summary["bytes_read"],
        "bytes_written": summary["bytes_written"],
        "runs": summary["runs"],
    }


def materialize(t: LogicalTensor) -> bytes:
    """The whole tensor's bytes, little-endian, row-major (for the Python API and
    small values; the converters never go through here)."""
    import numpy as np

    lanes = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize(t.dtype)]
    out = np.zeros(t.numel, dtype=lanes)
    full = out.reshape(t.shape) if t.shape else out.reshape(())
    for c in t.chunks:
        if c.dtype != t.dtype:
            raise RavexError(f"tensor '{t.name}' mixes dtypes across its chunks; convert it instead")
        values = np.frombuffer(chunk_bytes(c), dtype=lanes, count=c.region.numel)
        region = c.region
        if isinstance(region, Box):
            sl = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))
            full[sl] = values.reshape(region.sizes)
        else:
            out[region.start:region.start + region.length] = values
    return out.tobytes()


def load_state_dict(path: str | Path, *, tag: str | None = None, index: int = -1, optimizer: bool = False,
                    param_names: list[str] | None = None) -> dict[str, Any]:
    """For people who just want tensors: ``{name: torch.Tensor}`` of the model
    weights (the fp32 master copy where the source has one), tied names sharing
    one tensor. With ``optimizer=True``, ``{"model": ..., "optim": {"state": ...,
    "param_groups": ...}}`` instead."""
    import torch

    ckpt = read_checkpoint(path, tag=tag, index=index, param_names=param_names)
    if optimizer and "optimizer_error" in ckpt.source:
        raise ckpt.source["optimizer_error"]
    if ckpt.format == "native":
        native.verify_chunks(ckpt, [n for n in ckpt.tensors if n.startswith(MODEL) or (optimizer and n.startswith(OPTIM))])
    tensors: dict[str, Any] = {}
    for name, t in ckpt.tensors.items():
        if name.startswith(MODEL) or (optimizer and name.startswith(OPTIM)):
            data = bytearray(materialize(t))
            dtype = getattr(torch, t.dtype)
            tensors[name] = torch.frombuffer(data, dtype=dtype).reshape(t.shape) if data else torch.empty(t.shape, dtype=dtype)
    for alias, target in ckpt.aliases.items():
        if target in tensors:
            tensors[alias] = tensors[target]
    model = {n[len(MODEL):]: v for n, v in tensors.items() if n.startswith(MODEL)}
    if not optimizer:
        return model
    state: dict[str, dict[str, Any]] = {}
    for n, v in tensors.items():
        if n.startswith(OPTIM):
            _, s, fqn = n.split("/", 2)
            state.setdefault(fqn, {})[s] = v
    return {"model": model, "optim": {"state": state, "param_groups": ckpt.objects.get("optim.param_groups", [])}}
