"""``convert``, ``load_state_dict``: the conversion API the ``ravex`` command wraps.

Reading gives a :class:`~ravex_convert.model.Checkpoint` (where every byte is);
``select`` picks what goes out under which names; a format's ``write`` chooses
the target layout and the Rust executor moves the bytes once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from inspect import signature
from pathlib import Path
from typing import Any

from . import _core
from ._dist import Solo, current, spread
from ._engine import SourceTable, chunk_bytes, read_many
from ._limits import MAX_EXPANSION_ENV, max_expansion
from ._output import Options, durability, out_dtype, select
from ._torchfile.archive import deferred_crcs
from .detect import detect, inspect, read_checkpoint
from .errors import CorruptCheckpointError, LayoutMismatchError, RavexError
from .formats import registry
from .formats.native import reader as native
from .model import MODEL, OBJ, OPTIM, Box, Checkpoint, LogicalTensor, itemsize
from .ties import apply_ties
from .ties import materialize as materialize_ties_in

__all__ = ["RESHARDABLE", "TARGETS", "convert", "infer_target", "left_out", "load_state_dict", "materialize", "parse_size", "reshard"]

# From the registry (formats/registry.py), as registered when this module is imported.
TARGETS = registry.targets()
RESHARDABLE = registry.reshardable()

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


# What a DST's name says about the format to write (`ravex convert SRC DST` without --to).
_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch_save", ".pth": "torch_save", ".bin": "torch_save"}


def infer_target(dst: str | Path) -> str:
    """The format a DST's name asks for: ``.safetensors`` -> safetensors;
    ``.pt``, ``.pth``, ``.bin`` -> torch_save. Anything else (a directory, a
    name without a known suffix) is refused: dcp, zero and native all write
    directories, and which one is meant cannot be told from a name."""
    p = Path(dst)
    fmt = _SUFFIXES.get(p.suffix.lower())
    if fmt is None or p.is_dir():
        why = "is a directory" if p.is_dir() else (f"ends in '{p.suffix}'" if p.suffix else "has no suffix")
        raise RavexError(f"{dst}: cannot tell which format to write: the name {why}",
                         hint="pass --to (safetensors, torch_save, dcp, zero or native); without it Ravex writes safetensors "
                         "for a name ending in .safetensors and torch_save for .pt, .pth or .bin")
    return fmt


def convert(
    src: str | Path,
    dst: str | Path,
    to: str | None = None,
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
    layout: str | None = None,
    zero_stage: int | None = None,
    precision: str | None = None,
    buffers: Sequence[str] | None = None,
    hyperparameters: Sequence[dict[str, Any]] | None = None,
    progress: Callable[[int], None] | None = None,
    sync: bool = True,
    distributed: bool = False,
    ties: Mapping[str, str] | None = None,
    materialize_ties: bool = False,
) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst`` (``to``
    None: taken from ``dst``'s name, see :func:`infer_target`, and said so in
    the notes).

    Returns a summary (tensors, bytes, files, seconds; with ``dry_run`` the plan
    instead, and nothing is written). Raises :class:`RavexError` subclasses.
    ``progress``, if given, is called with the number of bytes written after
    each batch of about 256 MiB; if it also has an ``add_total(n)`` method,
    that is called before each copy job with the bytes the job will write (a
    conversion runs one job, or a few), so a bar can show an ETA.
    With ``sync=False`` (``--no-sync``) the output is renamed into place without
    waiting for it to reach the disk, as ``cp`` does: faster, but an OS crash or
    power cut soon after can leave a DST that looks complete and is not.
    With ``distributed=True`` (the ``ravex`` command under torchrun sets it) every
    process of the job calls this and each writes its share of the output, rank 0
    committing; otherwise this process writes all of it, whatever else runs.
    Whatever of the source is not carried over is listed under ``left_out``
    (files of a source directory no reader took, optimizer and training state
    a weights-only output drops) and named in ``notes``.
    ``ties`` (alias -> parameter name): ties the source never recorded (it stores
    the tensor once and leaves the tie to the model's code), read as that tensor;
    ``materialize_ties`` writes every tied name as a tensor of its own (a strict
    ``load_state_dict`` of the output then finds each name).
    ``layout`` (torch_save): ``"source"`` (None: the model and optimizer where the
    source had them, else the portable ``{"model", "optim"}``), ``"portable"``, or
    ``"lightning"`` (a Lightning ``.ckpt`` that ``load_from_checkpoint`` loads);
    (dcp) ``"source"``, ``"portable"`` or ``"torchtitan"`` (``model`` and a
    flattened ``optimizer``).
    """
    chosen: list[str] = []
    if to is None:
        to = infer_target(dst)
        chosen.append(f"writing {to} (no --to given; chosen from the name {Path(dst).name})")
    if to not in TARGETS:
        raise RavexError(f"--to {to}: not a format Ravex writes yet", hint=f"use one of {', '.join(TARGETS)}")
    if layout is not None and "layout" not in signature(registry.get(to).write).parameters:
        raise RavexError(f"--layout {layout} applies to torch_save and dcp outputs, not {to}", hint="leave --layout out, or write --to torch_save or dcp")
    if to == "zero" and zero_stage not in (1, 2, 3):
        raise RavexError(f"--to zero needs --zero-stage 1, 2 or 3 (got {zero_stage})", hint="choose the stage the resumed run will use")
    if isinstance(max_shard_size, str):
        max_shard_size = parse_size(max_shard_size)
    if compression not in (None, "none", "zstd"):
        raise RavexError(f"--compression {compression}: unknown", hint="use none or zstd")
    opts = Options(weights_only=weights_only or to == "safetensors", dtype=dtype, strip_prefix=list(strip_prefix), force=force,
                   max_shard_size=max_shard_size, compression=None if compression in (None, "none") else compression, world_size=world_size)
    t0 = time.perf_counter()
    # In one process the sources' CRC-32s are checked from the copy's own reads (the data is read
    # once, not twice); under torchrun each rank copies a share, and the readers check as they read.
    with contextlib.nullcontext() if distributed and current().size > 1 else deferred_crcs():
        ckpt = read_checkpoint(src, tag=tag, index=index, param_names=param_names)
        if not opts.weights_only and "optimizer_error" in ckpt.source:
            raise ckpt.source["optimizer_error"]
        if ties:
            apply_ties(ckpt, ties)
        out = select(ckpt, opts)
        if materialize_ties:
            made = materialize_ties_in(out)
            chosen.append(f"tied names written as tensors of their own: {', '.join(made)}" if made else "--materialize-ties: the checkpoint has no tied names")
        _bounded(ckpt, out, opts, src)
        _param_groups(out, to, opts, hyperparameters)
        if ckpt.format == "native" and not dry_run:
            # the store's checksums are checked before any byte is used (docs/format.md section 12)
            native.verify_chunks(ckpt, [n for n in ckpt.tensors if not opts.weights_only or n.startswith(MODEL)])
        dropped = left_out(src, ckpt, opts, to)
        notes = chosen + list(ckpt.notes) + [_drop_note(d) for d in dropped]
        dst = Path(dst)
        if dry_run:
            try:
                summary = plan(out, opts)
            except _core.CorruptSourceError as exc:
                raise CorruptCheckpointError(f"{exc.path or src}: the file does not hold what the checkpoint's metadata says ({str(exc).split(chr(10))[0]})",
                                             hint="a file is truncated or damaged; copy the checkpoint again", path=exc.path or src) from None
            summary.update({"dry_run": True, "source_format": ckpt.format, "to": to, "dst": str(dst), "notes": notes, "left_out": dropped})
            return summary
        # Only when asked (the CLI asks): a script under torchrun that converts on rank 0 alone
        # must not wait for ranks that never call convert.
        with durability(sync), spread(current() if distributed else Solo()):
            result = _write(out, dst, to, opts, progress, zero_stage=zero_stage, precision=precision, buffers=buffers,
                            hyperparameters=hyperparameters, metadata_form=metadata_form, layout=layout)
        result.update({"source_format": ckpt.format, "to": to, "dst": str(dst), "notes": notes + list(result.get("notes", [])),
                       "left_out": dropped, "seconds": time.perf_counter() - t0, "synced": sync})
        return result


def _bounded(ckpt: Checkpoint, out: Checkpoint, opts: Options, src: str | Path) -> None:
    """Refuse a conversion that would write far more than its source holds (a few KB
    of zstd declaring gigabytes): the user is asked, through the limit, to confirm."""
    files: set[Path] = set()
    inline = 0
    for t in ckpt.tensors.values():
        for c in t.chunks:
            if c.file is not None:
                files.add(c.file)
            elif c.data is not None:
                inline += len(c.data)
    held = inline + sum(f.stat().st_size for f in files if f.exists())
    writes = sum(t.numel * itemsize(out_dtype(t, opts)) for t in out.tensors.values())
    limit = max_expansion()
    if writes > max(held, 1 << 20) * limit:
        raise RavexError(
            f"{src}: converting it would write {writes:,} bytes from {held:,} bytes on disk, more than {limit}x "
            "(its tensors declare far more data than its files hold: compressed frames of gigabytes of zeros)",
            hint=f"if the checkpoint is genuine, allow it: {MAX_EXPANSION_ENV}={-(-writes // max(held, 1))}; otherwise it was crafted "
                 "to fill the disk — do not use it",
            path=src,
        )


# Hyper-parameters an optimizer steps with, which a loader must find in each param group.
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_HYPER_HINT = ("pass them with --hyperparameters FILE.json (hyperparameters=[...] in Python), one dict per param group, in order. "
               "Loading DCP into a live optimizer needs every key of its param groups, so write them from the optimizer the run resumes with: "
               "json.dump([{k: v for k, v in g.items() if k != 'params'} for g in optimizer.state_dict()['param_groups']], f). "
               "Or pass --weights-only to leave the optimizer state out")


def _param_groups(out: Checkpoint, to: str, opts: Options, given: Sequence[Mapping[str, Any]] | None) -> None:
    """Param groups complete enough for the target's loaders, or a refusal.

    An elastic DeepSpeed checkpoint saves no hyper-parameters (a group is its
    parameter names only). torch's ``Optimizer.load_state_dict`` replaces each
    group by the saved one and DCP's loader wants every key of the live
    optimizer's state dict, so a DCP or torch_save output without them does not
    resume; ``given`` (``--hyperparameters``) fills them in. The ZeRO writer
    does the same itself."""
    groups = out.objects.get("optim.param_groups")
    if given is not None:
        if opts.weights_only:
            raise RavexError("--hyperparameters applies to outputs with optimizer state; this one is weights only "
                             f"({'safetensors holds weights only' if to == 'safetensors' else '--weights-only'})",
                             hint="leave --hyperparameters out, or write torch_save, dcp, zero or native")
        if not isinstance(given, Sequence) or not all(isinstance(g, Mapping) for g in given):
            raise RavexError("--hyperparameters must be a JSON list with one dict per param group",
                             hint='write e.g. [{"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.1}]')
        if not isinstance(groups, list) or not groups:
            raise LayoutMismatchError(f"{out.path}: the source has no optimizer param groups to give --hyperparameters to",
                                      hint="leave --hyperparameters out")
        if len(given) != len(groups):
            raise LayoutMismatchError(f"--hyperparameters has {len(given)} entries; {out.path} has {len(groups)} param groups",
                                      hint="pass one dict per param group, in order")
        if to == "zero":
            return  # the ZeRO writer merges them itself (and checks them against DeepSpeed's needs)
        merged = []
        for entry, extra in zip(groups, given):
            hyper = {str(k): v for k, v in extra.items() if k != "params"}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])  # as torch's Adam keeps them
            merged.append({**(entry if isinstance(entry, dict) else {}), **hyper})
        out.objects["optim.param_groups"] = merged
        groups = merged
    if to not in ("dcp", "torch_save") or not isinstance(groups, list) or not any(n.startswith(OPTIM) for n in out.tensors):
        return
    need = _ADAM_KEYS if {"exp_avg", "exp_avg_sq"} & set(out.optimizer_state_names()) else ("lr",)
    for g, entry in enumerate(groups):
        missing = [k for k in need if not isinstance(entry, dict) or k not in entry]
        if missing:
            elastic = isinstance(entry, dict) and not entry.keys() - {"params"}
            why = " (an elastic DeepSpeed checkpoint does not save them)" if elastic else ""
            fails = (f"dcp.load stops with 'Missing key in checkpoint state_dict: optim.param_groups.{g}.{missing[0]}'" if to == "dcp" else
                     "torch's optimizer.load_state_dict replaces each param group by the saved one, so the optimizer would step without them")
            raise LayoutMismatchError(f"{out.path}: param group {g} has no {', '.join(missing)}{why}; a {to} checkpoint without them "
                                      f"does not resume ({fails})", hint=_HYPER_HINT)


# Files a format's reader takes that ``inspect`` does not list as the checkpoint's own:
# pointers and store-level records.
_POINTERS = {"zero": ("latest",), "hf_trainer": ("latest",), "native": ("manifest.json", "ravex-store.json", "lock")}


def left_out(src: str | Path, ckpt: Checkpoint, opts: Options, to: str) -> list[dict[str, Any]]:
    """What of the source the output does not carry: for a source directory,
    every file no reader took (a whole directory of them as one entry, e.g.
    another tag); with weights only, the optimizer state and the training
    state. Each entry: ``what``, ``kind`` (file | directory | tensors | state;
    unchecked where the directory could not be listed against the checkpoint),
    ``reason``, and ``count`` where it counts things."""
    out: list[dict[str, Any]] = []
    root = Path(src)
    if root.is_dir():
        out += _unread_files(root, ckpt)
    if opts.weights_only:
        why = ("safetensors holds weights only (--to torch_save, dcp or native keeps it)" if to == "safetensors"
               else "--weights-only asked to leave it out")
        optim = [n for n in ckpt.tensors if n.startswith(OPTIM)]
        if optim or "optim.param_groups" in ckpt.objects:
            out.append({"what": "optimizer state", "kind": "tensors", "count": len(optim), "reason": why})
        state = sorted(k for k in ckpt.objects if not k.startswith("optim."))
        objs = [n for n in ckpt.tensors if n.startswith(OBJ)]
        if state or objs:
            out.append({"what": ", ".join(state) or "training state", "kind": "state", "count": len(state) + len(objs), "reason": why})
    return out


def _drop_note(d: dict[str, Any]) -> str:
    if d["kind"] == "unchecked":
        return f"{d['what']}: {d['reason']}"
    if d["kind"] == "tensors":
        return f"{d['what']} ({d['count']} tensors) not written: {d['reason']}"
    if d["kind"] == "state":
        return f"training state not written ({d['what']}): {d['reason']}"
    if d["kind"] == "directory":
        return f"left out: {d['what']} ({d['count']} file(s)): {d['reason']}"
    return f"left out: {d['what']}: {d['reason']}"


def _unread_files(root: Path, ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Files under ``root`` that are not part of the checkpoint read from it."""
    try:
        info = inspect(root, tag=ckpt.source.get("tag") if ckpt.format == "zero" else None,  # (a Trainer's DeepSpeed root names one tag)
                       index=ckpt.source["index"] if ckpt.format == "native" and isinstance(ckpt.source.get("index"), int) else -1)
    except Exception as exc:  # noqa: BLE001 - the reader took the checkpoint; this listing must not fail the conversion
        why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
        return [{"what": f"{root}/", "kind": "unchecked", "reason": f"could not tell which of its files the checkpoint leaves aside ({why})"}]
    base = Path(info.path)
    taken = {_key(base / f.path) for f in info.files}
    taken |= {_key(root / f.path) for f in info.files}
    taken |= {_key(c.file) for t in ckpt.tensors.values() for c in t.chunks if c.file is not None}
    taken |= {_key(root / n) for n in _POINTERS.get(ckpt.format, ())}
    # directory -> (files under it, of which not taken), without following links out of the tree
    unread: dict[Path, list[Path]] = {}
    total: dict[Path, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames.sort()
        for name in sorted(filenames):
            f = d / name
            for parent in [d, *d.parents]:
                total[parent] = total.get(parent, 0) + 1
                if parent == root:
                    break
            if _key(f) not in taken:
                unread.setdefault(d, []).append(f)
    missing = {d: len(fs) for d, fs in unread.items()}
    below: dict[Path, int] = {}
    for d, n in missing.items():
        for parent in [d, *d.parents]:
            below[parent] = below.get(parent, 0) + n
            if parent == root:
                break
    entries: list[dict[str, Any]] = []
    reason = f"not part of the {ckpt.format} checkpoint Ravex read"
    other = "another checkpoint in the same directory (--tag or --index picks it)"

    def visit(d: Path) -> None:
        if d != root and below.get(d, 0) == total.get(d, 0) and below.get(d, 0):
            looks = any(p.name.endswith("model_states.pt") or p.name == "checkpoint.json" for p in d.rglob("*"))
            entries.append({"what": f"{d.relative_to(root)}/", "kind": "directory", "count": below[d], "reason": other if looks else reason})
            return
        for f in unread.get(d, []):
            looks = f.name == "checkpoint.json" or f.name.endswith("model_states.pt")
            entries.append({"what": str(f.relative_to(root)), "kind": "file", "reason": other if looks else reason})
        for sub in sorted(p for p in below if p.parent == d and p != d):
            visit(sub)

    if below:
        visit(root)
    return entries


def _key(p: Path) -> str:
    return os.path.realpath(p)


def _write(out: Checkpoint, dst: Path, to: str, opts: Options, progress: Callable[[int], None] | None, *, zero_stage: int | None,
           precision: str | None, buffers: Sequence[str] | None, hyperparameters: Sequence[dict[str, Any]] | None,
           metadata_form: str, layout: str | None = None) -> dict[str, Any]:
    """The target format's writer (from the registry), given the options it takes."""
    write = registry.get(to).write
    offered = {"progress": progress, "zero_stage": zero_stage, "precision": precision, "buffers": buffers,
               "hyperparameters": hyperparameters, "metadata_form": metadata_form, "layout": layout}
    takes = signature(write).parameters
    result: dict[str, Any] = write(out, dst, opts, **{k: v for k, v in offered.items() if k in takes})
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


# A dry run hands the core this many source chunks per call at most: its memory stays
# bounded (pyo3's copy of the chunks, decoded zstd chunks) whatever the checkpoint's size.
PLAN_BATCH_CHUNKS = 1 << 15


def plan(ckpt: Checkpoint, opts: Options) -> dict[str, Any]:
    """What a conversion would do: tensors, bytes in and out, copy runs (the core's
    planner and validation over every tensor, in batches of about
    :data:`PLAN_BATCH_CHUNKS` source chunks, each into one pretend target)."""
    totals = {"bytes_read": 0, "bytes_written": 0, "runs": 0}
    files: set[str] = set()
    offset = 0
    tensors = list(ckpt.tensors.values())
    at = 0
    while at < len(tensors):
        table = SourceTable()
        batch: list[Any] = []
        chunks = 0
        while at < len(tensors) and (not batch or chunks + len(tensors[at].chunks) <= PLAN_BATCH_CHUNKS):
            t = tensors[at]
            dt = out_dtype(t, opts)
            batch.append((list(t.shape), [table.chunk(c) for c in t.chunks], [(0, offset, t.whole().to_core(), dt)]))
            offset += t.numel * itemsize(dt)
            chunks += len(t.chunks)
            at += 1
        summary = _core.plan_summary(table.sources, ["<plan>"], batch)
        for k in totals:
            n = summary[k]
            assert isinstance(n, int)
            totals[k] += n
        files.update(table.paths)
    return {"tensors": len(ckpt.tensors), "aliases": len(ckpt.aliases), "source_files": len(files), **totals}


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
    wanted = [t for name, t in ckpt.tensors.items() if name.startswith(MODEL) or (optimizer and name.startswith(OPTIM))]
    for t in wanted:
        tensors[t.name] = torch.empty(tuple(t.shape), dtype=getattr(torch, t.dtype))
    # the executor writes each tensor's bytes straight into its storage, one job for all
    read_many([(t, memoryview(tensors[t.name].reshape(-1).view(torch.uint8).numpy()), None) for t in wanted if t.numel])
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
