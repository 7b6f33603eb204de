"""``convert``, ``load_state_dict``: the conversion API the ``ravex`` command wraps.

Reading gives a :class:`~ravex_convert.model.Checkpoint` (where every byte is);
``select`` picks what goes out under which names; a format's ``write`` chooses
the target layout and the Rust executor moves the bytes once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
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
from .formats.options import WriteOptions, either
from .model import MODEL, OBJ, OPTIM, Box, Checkpoint, LogicalTensor, itemsize
from .storage import Location, as_path, resolve, walk
from .ties import apply_ties
from .ties import materialize as materialize_ties_in

__all__ = ["RESHARDABLE", "TARGETS", "ConvertOptions", "convert", "infer_target", "left_out", "load_state_dict", "materialize", "reshard"]

# From the registry (formats/registry.py), as registered when this module is imported.
TARGETS = registry.targets()
RESHARDABLE = registry.reshardable()


@dataclass(frozen=True)
class ConvertOptions:
    """What every conversion takes, whatever it writes (the target format's own
    options are its :class:`~ravex_convert.formats.options.WriteOptions`, the
    ``writer`` argument of :func:`convert`).

    Reading the source:
        tag: the DeepSpeed tag to read (None: the one ``latest`` names).
        index: the checkpoint of a Ravex store to read (-1: the newest complete one).
        param_names: the parameter names in optimizer order, for a source whose
            optimizer state is keyed by position (torch.save).
        ties: alias -> parameter name: ties the source never recorded (it stores
            the tensor once and leaves the tie to the model's code), read as that tensor.

    What goes out:
        weights_only: leave the optimizer state and other training state out.
        dtype: cast floating-point weights to it (``"bfloat16"``, ...; optimizer
            state is never cast).
        strip_prefix: prefixes removed from names (``"module."``, ``"_orig_mod."``).
        materialize_ties: write every tied name as a tensor of its own (a strict
            ``load_state_dict`` of the output then finds each name).
        world_size: the number of ranks of a sharded output (dcp, native, zero).
        hyperparameters: one dict per param group, merged into the source's
            groups where it lacks them (a DeepSpeed elastic save).

    How:
        force: replace DST if it exists.
        dry_run: return the plan and write nothing.
        sync: False (``--no-sync``): DST is renamed into place without waiting for
            it to reach the disk, as ``cp`` does: faster, but an OS crash or power
            cut soon after can leave a DST that looks complete and is not.
        distributed: every process of the job (torchrun) calls :func:`convert` and
            each writes its share of the output, rank 0 committing (the ``ravex``
            command sets it); otherwise this process writes all of it.
    """

    tag: str | None = None
    index: int = -1
    param_names: list[str] | None = None
    ties: Mapping[str, str] | None = None
    weights_only: bool = False
    dtype: str | None = None
    strip_prefix: Sequence[str] = ()
    materialize_ties: bool = False
    world_size: int = 1
    hyperparameters: Sequence[Mapping[str, Any]] | None = None
    force: bool = False
    dry_run: bool = False
    sync: bool = True
    distributed: bool = False


def infer_target(dst: str | Path) -> str:
    """The format a DST's name asks for, by its suffix (each format's
    ``suffixes`` in the registry: ``.safetensors`` -> safetensors; ``.pt``,
    ``.pth``, ``.bin`` -> torch_save). Anything else (a directory, a name without
    a known suffix) is refused: several formats write directories, and which one
    is meant cannot be told from a name."""
    p = Path(dst)
    fmt = registry.by_suffix(p.suffix)
    if fmt is None or p.is_dir():
        why = "is a directory" if p.is_dir() else (f"ends in '{p.suffix}'" if p.suffix else "has no suffix")
        by_name = [(f.name, f.suffixes) for f in sorted(registry.formats(), key=lambda f: f.listed) if f.writes and f.suffixes]
        said = [f"{name} for {'a name ending in ' if not i else ''}{either(sfx)}" for i, (name, sfx) in enumerate(by_name)]
        raise RavexError(f"{dst}: cannot tell which format to write: the name {why}",
                         hint=f"pass --to ({either(registry.targets())}); without it Ravex writes {' and '.join(said)}")
    return fmt


def _writer_options(fmt: registry.Format, writer: WriteOptions | Mapping[str, Any] | None) -> WriteOptions:
    """``fmt``'s own options from what the caller gave: its options object, or
    field name -> value (the CLI gives every format's flags; one ``fmt`` does not
    take is refused unless it is at its default)."""
    cls = fmt.write_options
    if writer is None:
        return cls()
    if isinstance(writer, WriteOptions):
        if not isinstance(writer, cls):
            raise RavexError(f"{type(writer).__name__} are not the options of a {fmt.name} output",
                             hint=f"pass {cls.__name__}(...), or a dict of its fields")
        return writer
    return cls.build(fmt, writer, [f for f in sorted(registry.formats(), key=lambda f: f.listed) if f.writes])


def convert(
    src: str | Path,
    dst: str | Path,
    to: str | None = None,
    options: ConvertOptions | None = None,
    *,
    writer: WriteOptions | Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    Args:
        src: the checkpoint, any format Ravex reads (detected).
        dst: where the output goes; an existing one is refused unless
            ``options.force`` (a native store gets a new checkpoint appended).
        to: a format Ravex writes (:data:`TARGETS`); None: taken from ``dst``'s
            name (see :func:`infer_target`), and said so in the notes.
        options: what every conversion takes (:class:`ConvertOptions`; None: its defaults).
        writer: the target format's own options: its
            :class:`~ravex_convert.formats.options.WriteOptions` subclass
            (``registry.get(to).write_options``: ``ZeroOptions(zero_stage=3)``,
            ``DcpOptions(layout="torchtitan")``, ...), or a dict of its fields
            (``{"zero_stage": 3}``); None: the format's defaults.
        progress: called with the number of bytes written after each batch of
            about 256 MiB; if it also has an ``add_total(n)`` method, that is
            called before each copy job with the bytes the job will write (a
            conversion runs one job, or a few), so a bar can show an ETA.

    Returns:
        A summary (tensors, bytes, files, seconds; with ``dry_run`` the plan
        instead, and nothing is written). Whatever of the source is not carried
        over is listed under ``left_out`` (files of a source directory no reader
        took, optimizer and training state a weights-only output drops) and named
        in ``notes``.

    Raises:
        RavexError: its subclasses say what is wrong with the source or the request.
    """
    o = options or ConvertOptions()
    chosen: list[str] = []
    if to is None:
        to = infer_target(dst)
        chosen.append(f"writing {to} (no --to given; chosen from the name {Path(dst).name})")
    if to not in registry.targets():
        raise RavexError(f"--to {to}: not a format Ravex writes yet", hint=f"use one of {', '.join(registry.targets())}")
    fmt = registry.get(to)
    own = _writer_options(fmt, writer)
    own.check()
    opts = Options(weights_only=o.weights_only or own.weights_only, dtype=o.dtype, strip_prefix=list(o.strip_prefix), force=o.force,
                   world_size=o.world_size)
    opts, keywords = own.writer_args(opts)
    if own.merges_hyperparameters:
        keywords["hyperparameters"] = o.hyperparameters
    t0 = time.perf_counter()
    # In one process the sources' CRC-32s are checked from the copy's own reads (the data is read
    # once, not twice); under torchrun each rank copies a share, and the readers check as they read.
    with contextlib.nullcontext() if o.distributed and current().size > 1 else deferred_crcs():
        ckpt = read_checkpoint(src, tag=o.tag, index=o.index, param_names=o.param_names)
        if not opts.weights_only and "optimizer_error" in ckpt.source:
            raise ckpt.source["optimizer_error"]
        if o.ties:
            apply_ties(ckpt, o.ties)
        out = select(ckpt, opts)
        if o.materialize_ties:
            made = materialize_ties_in(out)
            chosen.append(f"tied names written as tensors of their own: {', '.join(made)}" if made else "--materialize-ties: the checkpoint has no tied names")
        _bounded(ckpt, out, opts, src)
        _param_groups(out, fmt, opts, o.hyperparameters)
        if not o.dry_run:
            # checksums a format records and its reader does not check, checked before any byte is used
            # (a native store's: docs/format.md section 12)
            _verify_chunks(ckpt, [n for n in ckpt.tensors if not opts.weights_only or n.startswith(MODEL)])
        dropped = left_out(src, ckpt, opts, to)
        notes = chosen + list(ckpt.notes) + [_drop_note(d) for d in dropped]
        out_at = resolve(dst)  # once: the writer, plan.run and the executor's sinks take this
        if o.dry_run:
            try:
                summary = plan(out, opts)
            except _core.CorruptSourceError as exc:
                raise CorruptCheckpointError(f"{exc.path or src}: the file does not hold what the checkpoint's metadata says ({str(exc).split(chr(10))[0]})",
                                             hint="a file is truncated or damaged; copy the checkpoint again", path=exc.path or src) from None
            summary.update({"dry_run": True, "source_format": ckpt.format, "to": to, "dst": str(out_at), "notes": notes, "left_out": dropped})
            return summary
        # Only when asked (the CLI asks): a script under torchrun that converts on rank 0 alone
        # must not wait for ranks that never call convert.
        with durability(o.sync), spread(current() if o.distributed else Solo()):
            # A destination on a filesystem is handed over as the path it is (a writer registered from
            # outside Ravex may write it as a file, as before); elsewhere as the location resolved here.
            given: Path | Location = Path(out_at.key) if out_at.posix else out_at
            result: dict[str, Any] = fmt.write(out, given, opts, progress=progress, **keywords)
        result.update({"source_format": ckpt.format, "to": to, "dst": str(out_at), "notes": notes + list(result.get("notes", [])),
                       "left_out": dropped, "seconds": time.perf_counter() - t0, "synced": o.sync})
        return result


def _verify_chunks(ckpt: Checkpoint, names: list[str]) -> None:
    """The source format's own checksum check (the registry's ``verify_chunks``), where it has one."""
    check = registry.get(ckpt.format).verify_chunks
    if check is not None:
        check(ckpt, names)


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
_HYPER_HINT = ("pass them with --hyperparameters FILE.json (ConvertOptions(hyperparameters=[...]) in Python), one dict per param group, in order. "
               "Loading DCP into a live optimizer needs every key of its param groups, so write them from the optimizer the run resumes with: "
               "json.dump([{k: v for k, v in g.items() if k != 'params'} for g in optimizer.state_dict()['param_groups']], f). "
               "Or pass --weights-only to leave the optimizer state out")


def _param_groups(out: Checkpoint, fmt: registry.Format, opts: Options, given: Sequence[Mapping[str, Any]] | None) -> None:
    """Param groups complete enough for the target's loaders, or a refusal.

    An elastic DeepSpeed checkpoint saves no hyper-parameters (a group is its
    parameter names only). torch's ``Optimizer.load_state_dict`` replaces each
    group by the saved one and DCP's loader wants every key of the live
    optimizer's state dict, so a DCP or torch_save output without them does not
    resume (the formats whose options say ``needs_param_groups``); ``given``
    (``--hyperparameters``) fills them in. A writer that merges them itself
    (``merges_hyperparameters``: the ZeRO writer) gets them as they are."""
    to, own = fmt.name, fmt.write_options
    groups = out.objects.get("optim.param_groups")
    if given is not None:
        if opts.weights_only:
            raise RavexError("--hyperparameters applies to outputs with optimizer state; this one is weights only "
                             f"({f'{to} holds weights only' if own.weights_only else '--weights-only'})",
                             hint=f"leave --hyperparameters out, or write {either(_keeps_optimizer())}")
        if not isinstance(given, Sequence) or not all(isinstance(g, Mapping) for g in given):
            raise RavexError("--hyperparameters must be a JSON list with one dict per param group",
                             hint='write e.g. [{"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.1}]')
        if not isinstance(groups, list) or not groups:
            raise LayoutMismatchError(f"{out.path}: the source has no optimizer param groups to give --hyperparameters to",
                                      hint="leave --hyperparameters out")
        if len(given) != len(groups):
            raise LayoutMismatchError(f"--hyperparameters has {len(given)} entries; {out.path} has {len(groups)} param groups",
                                      hint="pass one dict per param group, in order")
        if own.merges_hyperparameters:
            return  # the writer merges them itself (and checks them against its loader's needs)
        merged = []
        for entry, extra in zip(groups, given):
            hyper = {str(k): v for k, v in extra.items() if k != "params"}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])  # as torch's Adam keeps them
            merged.append({**(entry if isinstance(entry, dict) else {}), **hyper})
        out.objects["optim.param_groups"] = merged
        groups = merged
    if own.needs_param_groups is None or not isinstance(groups, list) or not any(n.startswith(OPTIM) for n in out.tensors):
        return
    need = _ADAM_KEYS if {"exp_avg", "exp_avg_sq"} & set(out.optimizer_state_names()) else ("lr",)
    for g, entry in enumerate(groups):
        missing = [k for k in need if not isinstance(entry, dict) or k not in entry]
        if missing:
            elastic = isinstance(entry, dict) and not entry.keys() - {"params"}
            why = " (an elastic DeepSpeed checkpoint does not save them)" if elastic else ""
            fails = own.needs_param_groups.format(g=g, key=missing[0])
            raise LayoutMismatchError(f"{out.path}: param group {g} has no {', '.join(missing)}{why}; a {to} checkpoint without them "
                                      f"does not resume ({fails})", hint=_HYPER_HINT)


def _keeps_optimizer() -> list[str]:
    """The formats Ravex writes that hold optimizer state, in the order people read them."""
    return [n for n in registry.targets() if not registry.get(n).write_options.weights_only]


def left_out(src: str | Path, ckpt: Checkpoint, opts: Options, to: str) -> list[dict[str, Any]]:
    """What of the source the output does not carry: for a source directory,
    every file no reader took (a whole directory of them as one entry, e.g.
    another tag); with weights only, the optimizer state and the training
    state. Each entry: ``what``, ``kind`` (file | directory | tensors | state;
    unchecked where the directory could not be listed against the checkpoint),
    ``reason``, and ``count`` where it counts things."""
    out: list[dict[str, Any]] = []
    root = as_path(src)
    if root.is_dir():
        out += _unread_files(root, ckpt)
    if opts.weights_only:
        why = (f"{to} holds weights only (--to {either(_keeps_optimizer())} keeps it)" if registry.get(to).write_options.weights_only
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
    fmt = registry.get(ckpt.format)
    index = ckpt.source.get("index")
    try:
        # the checkpoint read, where the format takes a choice of one (a Trainer's DeepSpeed root names one tag: not passed)
        info = inspect(root, **fmt.given(tag=ckpt.source.get("tag"), index=index if isinstance(index, int) else -1))
    except Exception as exc:  # noqa: BLE001 - the reader took the checkpoint; this listing must not fail the conversion
        why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
        return [{"what": f"{root}/", "kind": "unchecked", "reason": f"could not tell which of its files the checkpoint leaves aside ({why})"}]
    base = as_path(info.path)
    taken = {_key(base / f.path) for f in info.files}
    taken |= {_key(root / f.path) for f in info.files}
    taken |= {_key(c.file) for t in ckpt.tensors.values() for c in t.chunks if c.file is not None}
    taken |= {_key(root / n) for n in fmt.pointers}
    # directory -> (files under it, of which not taken), without following links out of the tree
    unread: dict[Path, list[Path]] = {}
    total: dict[Path, int] = {}
    for d, dirnames, filenames in _walk(root):
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


_walk = walk


def _key(p: Path) -> str:
    return str(p.resolve())  # a file's real path (an object in a bucket is its own)


def reshard(src: str | Path, dst: str | Path, world_size: int, options: ConvertOptions | None = None, *,
            writer: WriteOptions | Mapping[str, Any] | None = None, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Change the number of ranks of a sharded checkpoint, keeping its format
    (model and optimizer state).

    Args:
        src: the checkpoint, of a format with ranks (:data:`RESHARDABLE`).
        dst: where the resharded checkpoint goes.
        world_size: the number of ranks to reshard to (``options.world_size`` is ignored).
        options, writer, progress: as :func:`convert`'s; an option of the format's
            own left out keeps the source's value where the format says so (a ZeRO
            run's stage).
    """
    fmt = detect(src).format
    if fmt not in RESHARDABLE:
        raise RavexError(f"{src}: a {fmt} checkpoint has no ranks to reshard",
                         hint="`ravex convert` changes its format; reshard works on " + ", ".join(RESHARDABLE))
    o = replace(options or ConvertOptions(), world_size=world_size)
    own = _writer_options(registry.get(fmt), writer).for_reshard(inspect(src, tag=o.tag))
    return convert(src, dst, fmt, o, writer=own, progress=progress)


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
    _verify_chunks(ckpt, [n for n in ckpt.tensors if n.startswith(MODEL) or (optimizer and n.startswith(OPTIM))])
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
