"""DeepSpeed ZeRO stage 1, 2 and 3 (and DeepSpeed's separate BF16_Optimizer).

Layout (verified on DeepSpeed 0.19.8; fixtures/README.md has the details):
``<root>/latest`` names a tag; ``<root>/<tag>/`` holds
- ``mp_rank_00_model_states.pt`` (stage 1/2) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3): module
  buffers, ``param_shapes`` (one ordered dict per param group, in flat-buffer
  order), frozen and shared params, LR scheduler, ``global_steps``, ``ds_config``;
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: rank r's fp32 master
  partition and optimizer moments. The ``bf16_`` prefix means bf16 was on, not
  which optimizer ran: BF16_Optimizer is told apart by its state having no
  ``zero_stage`` key.

A top-level key of the model-states file that is not DeepSpeed's own is the caller's
``client_state``, read into ``objects["extra"]`` (client.py); Lightning's
DeepSpeed strategy keeps its whole state there (a ``<name>.ckpt/`` directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._paths import inside
from ..._torchfile.archive import TorchArchive, check_archive, gather_strided, open_archive, storages_at, verify_crcs
from ..._torchfile.unpickle import Record, TensorRef
from ...errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LayoutMismatchError,
    RavexError,
    UnknownFormatError,
    UnsafeCheckpointError,
)
from ...info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ...model import BUFFER, FROZEN, MODEL, OBJ, PARAMETER, Checkpoint, Chunk, Flat, LogicalTensor, TensorLink, numel
from ...storage import open_read
from .client import read_client, show_lightning
from .layout import Groups, RankFile, corrupt, read_flat_groups, read_stage3, stage3_partition, tensor_chunk

__all__ = ["LATEST", "ZeroLayout", "describe", "locate", "read", "sniff"]

LATEST = "latest"
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class ZeroLayout:
    """The files of one ZeRO tag directory, by rank."""

    root: Path  # the checkpoint root (holds `latest`), or the tag dir when there is none
    tag_dir: Path
    tag: str
    model_files: dict[int, Path] = field(default_factory=dict)  # dp rank -> file (stage 3); {0: ...} for stage 1/2
    optim_files: dict[int, Path] = field(default_factory=dict)
    prefix: str = ""  # "bf16_", "fp16_" or ""
    reasons: list[str] = field(default_factory=list)


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(_MODEL_FILE.match(p.name) or _OPTIM_FILE.match(p.name) for p in path.iterdir())


def sniff(path: Path) -> list[str] | None:
    if not path.is_dir():
        return None
    if (path / LATEST).is_file():
        return [f"found '{LATEST}' (a DeepSpeed checkpoint root)"]
    if _is_tag_dir(path):
        return ["found DeepSpeed *_model_states.pt / *_optim_states.pt files (a DeepSpeed tag directory)"]
    tags = [p.name for p in path.iterdir() if _is_tag_dir(p)]
    if tags:
        return [f"found DeepSpeed tag director{'y' if len(tags) == 1 else 'ies'} {', '.join(sorted(tags))} (no '{LATEST}' file)"]
    return None


def locate(path: Path, tag: str | None = None) -> ZeroLayout:
    """Find the tag directory and its per-rank files; refuse what is incomplete."""
    reasons: list[str] = []
    if _is_tag_dir(path) and tag is None:
        root, tag_dir = path, path
        reasons.append(f"{path.name} holds DeepSpeed model/optimizer state files")
    else:
        root = path
        if tag is None and (path / LATEST).is_file():
            tag = _read_latest(path)
            reasons.append(f"'{LATEST}' names tag '{tag}'")
            if not tag or not (path / tag).is_dir():
                raise IncompleteCheckpointError(
                    f"{path / LATEST}: names tag '{tag}', but there is no directory {path / tag}",
                    hint="the tag directory was not copied or was deleted; copy it, or pass --tag with one of the tags present",
                    path=path / LATEST,
                )
        elif tag is None:
            tags = sorted(p.name for p in path.iterdir() if _is_tag_dir(p))
            if len(tags) != 1:
                raise RavexError(
                    f"{path}: {len(tags)} DeepSpeed tags ({', '.join(tags)}) and no '{LATEST}' file to choose one",
                    hint="pass --tag NAME, or point at the tag directory itself",
                    path=path,
                )
            tag = tags[0]
            reasons.append(f"the only tag directory is '{tag}' (no '{LATEST}' file)")
        tag_dir = path / tag
        if not _is_tag_dir(tag_dir):
            raise IncompleteCheckpointError(f"{tag_dir}: holds no DeepSpeed model/optimizer state files", hint="check the tag name (--tag)", path=tag_dir)
    layout = ZeroLayout(root, tag_dir, tag if tag is not None else tag_dir.name, reasons=reasons)
    prefixes = set()
    for p in sorted(tag_dir.iterdir()):
        if _MODEL_FILE.match(p.name) or _OPTIM_FILE.match(p.name):
            inside(tag_dir, p.name, "rank file", tag_dir)  # a symbolic link out of the checkpoint is refused
        if m := _MODEL_FILE.match(p.name):
            if int(m.group(2)) != 0:
                raise RavexError(
                    f"{p}: a model-parallel rank {int(m.group(2))} file; tensor/pipeline parallel checkpoints are not supported yet",
                    hint="convert it with DeepSpeed's universal checkpoint (ds_to_universal) first",
                    path=p,
                )
            layout.model_files[int(m.group(1) or 0)] = p
        elif m := _OPTIM_FILE.match(p.name):
            if int(m.group(3)) != 0:
                raise RavexError(
                    f"{p}: a model-parallel rank {int(m.group(3))} file; tensor/pipeline parallel checkpoints are not supported yet",
                    hint="convert it with DeepSpeed's universal checkpoint (ds_to_universal) first",
                    path=p,
                )
            layout.optim_files[int(m.group(2))] = p
            prefixes.add(m.group(1) or "")
    if len(prefixes) > 1:
        raise CorruptCheckpointError(f"{tag_dir}: optimizer files from different runs are mixed (prefixes {sorted(prefixes)})", hint="keep only the files of one save in the tag directory", path=tag_dir)
    layout.prefix = prefixes.pop() if prefixes else ""
    if not layout.model_files:
        raise IncompleteCheckpointError(
            f"{tag_dir}: no model-states file (mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt)",
            hint="copy the *_model_states.pt file(s) the save wrote into the tag directory",
            path=tag_dir,
        )
    if not layout.optim_files:
        raise IncompleteCheckpointError(
            f"{tag_dir}: no optimizer-state files (*zero_pp_rank_<r>_mp_rank_00_optim_states.pt)",
            hint="copy the per-rank optimizer files the save wrote into the tag directory",
            path=tag_dir,
        )
    _check_ranks(tag_dir, layout.optim_files, f"{layout.prefix}zero_pp_rank_{{r}}_mp_rank_00_optim_states.pt")
    if len(layout.model_files) > 1 or 0 not in layout.model_files or not (tag_dir / "mp_rank_00_model_states.pt").is_file():
        per_rank = {r: p for r, p in layout.model_files.items() if p.name.startswith("zero_pp_rank_")}
        if per_rank:
            _check_ranks(tag_dir, per_rank, "zero_pp_rank_{r}_mp_rank_00_model_states.pt", expect=len(layout.optim_files))
    return layout


def _read_latest(root: Path) -> str:
    """The tag ``latest`` names: one directory directly inside the root (a
    crafted ``latest`` holding ``/etc`` or ``../x`` would point Ravex elsewhere)."""
    file = root / LATEST
    try:
        with open_read(file) as f:
            raw = f.read(4097)
    except OSError as exc:
        from ...errors import from_os_error

        raise from_os_error(exc, path=file) from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if tag is None or len(raw) > 4096 or any(ord(c) < 32 for c in tag):
        raise CorruptCheckpointError(
            f"{file}: does not hold a tag name (DeepSpeed writes one short line, e.g. 'global_step100')",
            hint="the file is damaged: write the tag directory's name into it, or pass --tag NAME",
            path=file,
        )
    if not tag:
        return tag
    inside(root, tag, f"the tag named by '{LATEST}'", file)
    if "/" in tag or "\\" in tag or tag in (".", ".."):
        raise UnsafeCheckpointError(
            f"{file}: names the tag {tag!r}, which is not a directory directly inside the checkpoint {root}",
            hint="DeepSpeed's 'latest' holds one directory name (e.g. 'global_step100'); fix the file or pass --tag NAME",
            path=file,
        )
    return tag


def _check_ranks(tag_dir: Path, files: dict[int, Path], pattern: str, expect: int | None = None) -> None:
    n = max(max(files) + 1, expect or 0)
    missing = [r for r in range(n) if r not in files]
    if missing:
        name = pattern.format(r=missing[0])
        raise IncompleteCheckpointError(
            f"{tag_dir}: rank {missing[0]}'s file {name} is missing (found ranks {sorted(files)} of {n})",
            hint="copy every rank's file from the save; a checkpoint with a rank missing cannot be consolidated",
            path=tag_dir / name,
        )


def rank_count_error(layout: ZeroLayout, who: str, said: int, present: int) -> IncompleteCheckpointError:
    """The files disagree with the rank count the optimizer state records."""
    hint = "an old save was overwritten in part, or some ranks' files were not copied; use a complete tag directory"
    if said > present:
        name = f"{layout.prefix}zero_pp_rank_{present}_mp_rank_00_optim_states.pt"
        return IncompleteCheckpointError(
            f"{layout.tag_dir}: rank {present}'s file {name} is missing ({who} says {said} ranks; {present} optimizer files are present)",
            hint=hint, path=layout.tag_dir / name)
    return IncompleteCheckpointError(
        f"{layout.tag_dir}: {who} says {said} ranks, but {present} optimizer files are present (files from different saves?)",
        hint=hint, path=layout.tag_dir)


def _stage_of(value: Any) -> int | None:
    if isinstance(value, Record) and value.args:
        value = value.args[0]
    return int(value) if isinstance(value, int) else None


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """``config[key]`` when it is a dict (a damaged ds_config may hold anything), else {}."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _names(value: Any, path: Path, key: str) -> list[str]:
    """A list of names (``buffer_names``); None counts as empty."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise corrupt(path, f"'{key}' is not a list of names")
    return list(value)


def _shapes_dict(value: Any, path: Path, key: str) -> dict[str, tuple[int, ...]] | None:
    """``frozen_param_shapes``: None, or name -> shape (checked)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise corrupt(path, f"{key} is not a dict (name -> shape)")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in value.items():
        if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise corrupt(path, f"{key}['{name}'] is not a shape")
        out[str(name)] = tuple(shape)
    return out


def _precision(ds_config: dict[str, Any], prefix: str) -> str:
    bf16 = bool(_section(ds_config, "bf16").get("enabled")) or prefix == "bf16_"
    fp16 = bool(_section(ds_config, "fp16").get("enabled")) or prefix == "fp16_"
    return "bf16" if bf16 else ("fp16" if fp16 else "fp32")


def _model_states_file(layout: ZeroLayout) -> Path:
    plain = layout.tag_dir / "mp_rank_00_model_states.pt"
    return plain if plain.is_file() else layout.model_files[min(layout.model_files)]


def _open_model_states(layout: ZeroLayout) -> tuple[TorchArchive, dict[str, Any]]:
    """Rank 0's model-states file and its contents (refused if not DeepSpeed's)."""
    model = open_archive(_model_states_file(layout))
    ms = model.root
    if not isinstance(ms, dict) or "param_shapes" not in ms:
        raise UnknownFormatError(
            f"{model.path}: a torch.save file without DeepSpeed's 'param_shapes'; not a DeepSpeed ZeRO model-states file",
            hint="point Ravex at the DeepSpeed checkpoint root (the directory with 'latest')",
            path=model.path,
        )
    return model, ms


@dataclass
class _Parsed:
    """What :func:`_read` parsed beside the checkpoint it returns: the tag
    directory's files and rank 0's model states (for :func:`describe`)."""

    layout: ZeroLayout
    ms: dict[str, Any]  # rank 0's model-states file
    param_shapes: list[dict[str, tuple[int, ...]]]


def describe(path: Path, reasons: list[str], tag: str | None = None) -> CheckpointInfo:
    """What :func:`read` finds, as ``inspect`` shows it: every rank's optimizer
    file parsed and checked against the others (no tensor byte read), each
    parameter with the dtype the module held it in (bf16 in a bf16 run; read's
    ``model/`` tensors are the fp32 masters)."""
    ckpt, parsed = _read(path, tag, shallow=True)
    layout = parsed.layout
    zero = ckpt.objects["zero"]
    bf16_optimizer = zero["variant"] == "bf16_optimizer"
    saved = None if bf16_optimizer else zero["stage"]
    configured = zero["stage_configured"]
    stage = configured if configured is not None else zero["stage"]
    info = CheckpointInfo("zero", "bf16_optimizer" if bf16_optimizer else f"zero{stage}", str(path), world_size=ckpt.world_size,
                          zero_stage=stage, step=ckpt.step, tag=layout.tag, reasons=reasons + layout.reasons)
    prefix_note = f" with the '{layout.prefix}' prefix ({layout.prefix[:-1]} was on)" if layout.prefix else ""
    info.reasons.append(f"{info.world_size} per-rank optimizer files{prefix_note}")
    if bf16_optimizer:
        info.reasons.append("the optimizer state has no 'zero_stage' key: DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation)")
    else:
        info.reasons.append(f"the optimizer state says zero_stage={saved}" + (f"; ds_config says stage {configured}" if configured is not None else ""))
    info.extra["precision"] = ckpt.source["precision"]
    info.extra["ds_version"] = ckpt.source["ds_version"]
    info.extra["zero_stage_saved"] = saved
    info.tensors = _tensor_infos(ckpt, parsed)
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items()}
    states = ckpt.optimizer_state_names()
    groups = ckpt.objects.get("optim.param_groups")
    trainable = [n for g in parsed.param_shapes for n in g]
    master = ckpt.tensors[MODEL + trainable[0]].dtype if trainable else None
    info.optimizer = OptimizerInfo("Adam" if {"exp_avg", "exp_avg_sq"} <= set(states) else ("unknown" if states else "none"), states,
                                   len(groups) if isinstance(groups, list) else None, master)
    info.notes = list(ckpt.notes)
    files: list[FileInfo] = []
    for r, p in sorted(layout.model_files.items()):
        files.append(FileInfo(str(p.relative_to(layout.root)), p.stat().st_size, "model_states", r if p.name.startswith("zero_pp") else None))
    for r, p in sorted(layout.optim_files.items()):
        files.append(FileInfo(str(p.relative_to(layout.root)), p.stat().st_size, "optim_states", r))
    info.files = files
    show_lightning(info, ckpt)
    return info


_SHOWN_KIND = {PARAMETER: "param", FROZEN: "frozen", BUFFER: "buffer"}  # the kinds read gives, as inspect names them


def _tensor_infos(ckpt: Checkpoint, parsed: _Parsed) -> list[TensorInfo]:
    """The model's tensors with the kinds read gave them, as the module held
    them: trainable parameters in ``param_shapes`` order, then frozen ones,
    then buffers in module order; each in the module's dtype where it records one."""
    module: dict[str, Any] = parsed.ms["module"] if isinstance(parsed.ms.get("module"), dict) else {}
    frozen = parsed.ms.get("frozen_param_shapes")
    order = list(dict.fromkeys([*(n for g in parsed.param_shapes for n in g), *(map(str, frozen) if isinstance(frozen, dict) else ()),
                                *map(str, module), *(n[len(MODEL):] for n in ckpt.tensors if n.startswith(MODEL))]))
    out = []
    for name in order:
        t = ckpt.tensors.get(MODEL + name)
        if t is None:
            continue  # a tied name (an alias), or a module entry read did not take (its notes say so)
        ref = module.get(name)
        out.append(TensorInfo(name, t.shape, ref.dtype if isinstance(ref, TensorRef) else t.dtype, _SHOWN_KIND.get(t.kind or FROZEN, "frozen")))
    return out


# ----------------------------------------------------------------------------
# read(): every tensor located in the files, nothing loaded.


def read(path: Path, tag: str | None = None, *, crc_share: tuple[int, int] | None = None) -> Checkpoint:
    """Describe a DeepSpeed ZeRO checkpoint (stage 1, 2, 3, or BF16_Optimizer)
    without loading tensor data or importing torch.

    ``model/<fqn>``: the fp32 master of every trainable parameter (chunks of
    each rank's flat partition); frozen parameters and persistent buffers as
    the files hold them. ``optim/<state>/<fqn>``: Adam's moments (same
    geometry as the master) and ``step`` (a 0-d tensor per parameter, the
    bytes of its group's step). Tied parameters are ``aliases``.

    ``crc_share=(r, n)``: of the storages whose CRC-32 is checked, only every n-th from the r-th
    (the n ranks of a job that all read the checkpoint each check their share: every storage is
    checked once, by one of them).
    """
    return _read(path, tag, crc_share=crc_share)[0]


def _read(path: Path, tag: str | None = None, *, shallow: bool = False, crc_share: tuple[int, int] | None = None) -> tuple[Checkpoint, _Parsed]:
    """The one parse of a tag directory. ``shallow`` (for describe): every
    optimizer file is still parsed and checked, but no tensor byte is read (no
    CRC pass, no strided view gathered) and ZeRO-3's per-rank model-states
    files are not parsed (their zip directories are checked), so the frozen
    parameters' chunks are rank 0's only: the result says what the checkpoint
    holds but is not for converting."""
    layout = locate(path, tag)
    ws = len(layout.optim_files)
    model, ms = _open_model_states(layout)
    first = _rank_file(0, layout.optim_files[0])
    # Every other rank file's zip directory (its last few hundred bytes) before
    # any of them is parsed: a truncated file is named as such.
    for p in sorted({*layout.model_files.values(), *layout.optim_files.values()} - {model.path, first.path}):
        check_archive(p)
    ranks = [first, *(_rank_file(r, layout.optim_files[r]) for r in range(1, ws))]
    bf16_optimizer, stage = _saved_variant(ranks)
    _check_partitions(layout, ranks, stage, ms, model.path)
    ds_config: dict[str, Any] = ms["ds_config"] if isinstance(ms.get("ds_config"), dict) else {}
    precision = _precision(ds_config, layout.prefix)
    variant = "bf16_optimizer" if bf16_optimizer else f"zero{stage}"
    step = ms.get("global_steps")
    ckpt = Checkpoint("zero", layout.root, world_size=ws, step=step if isinstance(step, int) and not isinstance(step, bool) else None)
    ds_version = ms.get("ds_version") or ranks[0].osd.get("ds_version")
    ckpt.source = {"format": "zero", "variant": variant, "precision": precision, "tag": layout.tag, "ds_version": ds_version}

    param_shapes = _param_shapes(ms, model.path)
    groups = read_stage3(ckpt, param_shapes, ranks) if stage == 3 else read_flat_groups(ckpt, param_shapes, ranks, bf16_optimizer)
    ckpt.notes.extend(groups.notes)
    trainable = {n for shapes in param_shapes for n in shapes}
    module: dict[str, Any] = ms["module"] if isinstance(ms.get("module"), dict) else {}
    shared = ms.get("shared_params") or {}
    if not isinstance(shared, dict):
        raise corrupt(model.path, "shared_params is not a dict (alias -> parameter)")
    buffers = _names(ms.get("buffer_names"), model.path, "buffer_names")
    for name in buffers:
        ref = module.get(name)
        if not isinstance(ref, TensorRef):
            raise corrupt(model.path, f"buffer '{name}' is listed in buffer_names but not saved in 'module'")
        ckpt.add(_whole(model, ref, MODEL + name, f"buffer '{name}'", shallow))
    opened = {model.path: model, **{rf.path: rf.archive for rf in ranks}}
    _read_frozen(ckpt, layout, model, ms, stage, trainable | set(buffers) | {str(a) for a in shared}, opened, shallow)
    for alias, target in shared.items():
        if MODEL + str(target) not in ckpt.tensors:
            raise corrupt(model.path, f"shared_params ties '{alias}' to '{target}', which is not a saved parameter")
        ckpt.aliases[MODEL + str(alias)] = MODEL + str(target)
    left = [n for n in module if MODEL + str(n) not in ckpt.tensors and MODEL + str(n) not in ckpt.aliases]
    if left:
        ckpt.notes.append(f"module entries not read (neither parameters, buffers nor frozen parameters): {', '.join(map(str, left))}")

    buffer_set = set(buffers)
    for name, t in ckpt.tensors.items():  # DeepSpeed says which is which: no writer reopens the files to find out
        if name.startswith(MODEL):
            fqn = name[len(MODEL):]
            t.kind = PARAMETER if fqn in trainable else BUFFER if fqn in buffer_set else FROZEN
    ckpt.objects["optim.param_groups"] = _param_groups(groups)
    if "lr_scheduler" in ms and ms["lr_scheduler"] is not None:
        ckpt.objects["lr_scheduler"] = _plain(ms["lr_scheduler"], ckpt, model, f"{OBJ}lr_scheduler", shallow)
    if ranks[0].osd.get("loss_scaler") is not None:
        ckpt.objects["loss_scaler"] = _plain(ranks[0].osd["loss_scaler"], ckpt, ranks[0].archive, f"{OBJ}loss_scaler", shallow)
    ckpt.objects["zero"] = _provenance(ms, ranks, stage, variant, precision, ds_config, groups)
    read_client(ckpt, model, ms, shallow)  # Lightning's DeepSpeed strategy keeps its whole state there
    _check_bytes(ckpt)
    if not shallow:
        _verify_crcs(ckpt, opened, crc_share)
    return ckpt, _Parsed(layout, ms, param_shapes)


def _verify_crcs(ckpt: Checkpoint, opened: dict[Path, TorchArchive], share: tuple[int, int] | None = None) -> None:
    """The CRC-32 of every storage a chunk reads from (RAVEX_NO_CRC=1 skips):
    a flipped bit in a rank's partition is reported, not copied through.
    ``share=(r, n)``: the r-th of every n of them, in (file, storage) order."""
    offsets: dict[Path, list[int]] = {}
    for t in ckpt.tensors.values():
        for c in t.chunks:
            if c.file is not None:
                offsets.setdefault(c.file, []).append(c.offset)
    i = 0
    for file in sorted(offsets):
        archive = opened.get(file)
        if archive is not None:
            keys = sorted(storages_at(archive, offsets[file]))
            mine = keys if share is None else [k for j, k in enumerate(keys, start=i) if j % share[1] == share[0]]
            i += len(keys)
            verify_crcs(archive, mine)


def _rank_file(rank: int, path: Path) -> RankFile:
    archive = open_archive(path)
    osd = archive.root.get("optimizer_state_dict") if isinstance(archive.root, dict) else None
    if not isinstance(osd, dict):
        raise corrupt(path, "has no 'optimizer_state_dict'; not a DeepSpeed optimizer file", hint="copy this rank's *_optim_states.pt again from the save")
    return RankFile(rank, archive, osd)


def _saved_variant(ranks: list[RankFile]) -> tuple[bool, int]:
    """(BF16_Optimizer?, the stage whose layout the files have), the same in every rank's file."""
    seen: tuple[bool, int | None] | None = None
    for rf in ranks:
        bf16_optimizer = "zero_stage" not in rf.osd
        stage = 1 if bf16_optimizer else _stage_of(rf.osd["zero_stage"])
        if seen is not None and (bf16_optimizer, stage) != seen:
            raise corrupt(rf.path, f"says zero_stage={stage}{' (BF16_Optimizer)' if bf16_optimizer else ''}, rank 0's file says {seen[1]}")
        seen = (bf16_optimizer, stage)
    assert seen is not None  # locate() found at least one optimizer file
    bf16_optimizer, stage = seen
    if stage not in (1, 2, 3):
        raise LayoutMismatchError(
            f"{ranks[0].path}: zero_stage is {stage!r}; Ravex reads ZeRO stages 1, 2 and 3",
            hint="convert the checkpoint with DeepSpeed's own tools first (zero_to_fp32.py)",
            path=ranks[0].path,
        )
    return bf16_optimizer, stage


def _check_partitions(layout: ZeroLayout, ranks: list[RankFile], stage: int, ms: dict[str, Any], model_path: Path) -> None:
    ws = len(ranks)
    for rf in ranks:
        pc = rf.osd.get("partition_count")
        counts = pc if isinstance(pc, list) else [pc]
        if not counts or not all(isinstance(c, int) for c in counts):
            raise corrupt(rf.path, f"partition_count is {pc!r}")
        if max(counts) != ws:
            raise rank_count_error(layout, rf.path.name, max(counts), ws)
        if min(counts) != ws:
            raise LayoutMismatchError(
                f"{rf.path}: param groups are partitioned over different numbers of ranks ({counts}); "
                "expert-parallel (MoE) ZeRO checkpoints are not supported",
                hint="convert it with DeepSpeed's universal checkpoint (ds_to_universal) first",
                path=rf.path,
            )
        if rf.osd.get("ds_zero_partition_groups") is not None:
            raise LayoutMismatchError(
                f"{rf.path}: ZeRO-3 sub-groups partitioned over their own process groups (AutoEP); not supported",
                hint="convert it with DeepSpeed's universal checkpoint (ds_to_universal) first",
                path=rf.path,
            )
    dims = ms.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and any(isinstance(v, int) and v > 1 for v in dims.values()):
        raise LayoutMismatchError(
            f"{model_path}: a tensor/pipeline-parallel checkpoint ({dims}); Ravex reads data-parallel ZeRO checkpoints only",
            hint="convert it with DeepSpeed's universal checkpoint (ds_to_universal) first",
            path=model_path,
        )


def _param_shapes(ms: dict[str, Any], path: Path) -> list[dict[str, tuple[int, ...]]]:
    raw = ms["param_shapes"]
    groups = raw if isinstance(raw, list) else [raw]
    out: list[dict[str, tuple[int, ...]]] = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise corrupt(path, f"param_shapes[{g}] is not a dict (name -> shape)")
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in group.items():
            if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise corrupt(path, f"param_shapes[{g}]['{name}'] is {shape!r}, not a shape")
            shapes[str(name)] = tuple(shape)
        out.append(shapes)
    return out


def _whole(archive: TorchArchive, ref: TensorRef, name: str, what: str, shallow: bool = False) -> LogicalTensor:
    """A whole tensor saved as itself (buffers, frozen parameters in ``module``);
    a strided view is gathered, except ``shallow`` (it is then left without its chunk)."""
    t = LogicalTensor(name, ref.shape, ref.dtype)
    if ref.is_contiguous():
        t.chunks.append(tensor_chunk(archive, ref, 0, ref.numel, t.whole(), what))
    elif not shallow:
        t.chunks.append(Chunk(t.whole(), ref.dtype, data=gather_strided(archive, ref, what)))
    return t


def _read_frozen(
    ckpt: Checkpoint, layout: ZeroLayout, model: TorchArchive, ms: dict[str, Any], stage: int, known: set[str], opened: dict[Path, TorchArchive],
    shallow: bool = False,
) -> None:
    """Frozen (requires_grad=False) parameters: no fp32 master exists, the files
    hold them in the working dtype. Stage 2: whole, in ``frozen_param_fragments``;
    stage 3: one flat ``ceil(numel/ws)`` piece per rank's model-states file
    (``shallow``: rank 0's piece only, the other files left unparsed);
    ZeRO-1 and BF16_Optimizer record none (``frozen_param_shapes`` is None): the
    value is only in ``module``."""
    shapes = _shapes_dict(ms.get("frozen_param_shapes"), model.path, "frozen_param_shapes")
    module: dict[str, Any] = ms["module"] if isinstance(ms.get("module"), dict) else {}
    if shapes is None:
        for name, ref in module.items():
            if str(name) in known or not isinstance(ref, TensorRef):
                continue
            if ref.numel == 0 and stage == 3:
                raise corrupt(model.path, f"'{name}' is an empty placeholder in 'module' and no frozen_param_shapes say where it is")
            ckpt.add(_whole(model, ref, MODEL + str(name), f"frozen parameter '{name}'", shallow))
            ckpt.notes.append(f"'{name}' is a frozen parameter kept only in the module state (zero{stage} records no frozen_param_shapes)")
        return
    if stage != 3:
        fragments = ms.get("frozen_param_fragments")
        for name, shape in shapes.items():
            ref = fragments.get(name) if isinstance(fragments, dict) else None
            shape = tuple(shape)
            if not isinstance(ref, TensorRef) or ref.numel != numel(shape):
                raise corrupt(model.path, f"frozen_param_fragments has no {numel(shape)}-element tensor for frozen parameter '{name}' {list(shape)}")
            whole = LogicalTensor(MODEL + str(name), shape, ref.dtype)
            whole.chunks.append(tensor_chunk(model, ref, 0, ref.numel, whole.whole(), f"frozen parameter '{name}'"))
            ckpt.add(whole)
        return
    ws = len(layout.optim_files)
    archives = [model if layout.model_files[r] == model.path else open_archive(layout.model_files[r]) for r in range(1 if shallow else ws)]
    opened.update((a.path, a) for a in archives)
    for name, shape in shapes.items():
        shape = tuple(shape)
        n = numel(shape)
        p = stage3_partition(n, ws)
        lt: LogicalTensor | None = None
        for r, archive in enumerate(archives):
            fragments = archive.root.get("frozen_param_fragments") if isinstance(archive.root, dict) else None
            ref = fragments.get(name) if isinstance(fragments, dict) else None
            if not isinstance(ref, TensorRef):
                raise corrupt(archive.path, f"frozen_param_fragments has no piece of frozen parameter '{name}'")
            if lt is None:
                lt = ckpt.add(LogicalTensor(MODEL + str(name), shape, ref.dtype))
            length = max(0, min(p, n - r * p))
            if length:
                lt.chunks.append(tensor_chunk(archive, ref, 0, length, Flat(r * p, length), f"rank {r}'s piece of frozen parameter '{name}'"))


def _param_groups(groups: Groups) -> list[dict[str, Any]]:
    out = []
    for g, names in enumerate(groups.members):
        entry = dict(groups.hyper[g]) if groups.hyper is not None and g < len(groups.hyper) else {}
        entry["params"] = list(names)
        out.append(entry)
    return out


def _plain(value: Any, ckpt: Checkpoint, archive: TorchArchive, prefix: str, shallow: bool = False) -> Any:
    """Small state as plain data: a DeepSpeed record becomes a dict of its state
    (an enum its value), a tensor an ``obj/`` logical tensor and a link."""
    if isinstance(value, Record):
        if isinstance(value.state, dict):
            return {str(k): _plain(v, ckpt, archive, f"{prefix}/{k}", shallow) for k, v in value.state.items()}
        if len(value.args) == 1 and value.state is None:
            return _plain(value.args[0], ckpt, archive, prefix, shallow)
        return {"class": value.cls, "args": [_plain(a, ckpt, archive, f"{prefix}/{i}", shallow) for i, a in enumerate(value.args)]}
    if isinstance(value, TensorRef):
        ckpt.add(_whole(archive, value, prefix, prefix[len(OBJ):], shallow))
        return TensorLink(prefix)
    if isinstance(value, dict):
        return {k: _plain(v, ckpt, archive, f"{prefix}/{k}", shallow) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, ckpt, archive, f"{prefix}/{i}", shallow) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, ckpt, archive, f"{prefix}/{i}", shallow) for i, v in enumerate(value))
    return value


def _provenance(
    ms: dict[str, Any], ranks: list[RankFile], stage: int, variant: str, precision: str, ds_config: dict[str, Any], groups: Groups
) -> dict[str, Any]:
    first = ranks[0].osd
    zero_cfg = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
    out: dict[str, Any] = {
        "variant": variant,
        "stage": stage,
        "stage_configured": _stage_of((zero_cfg or {}).get("stage")),
        "world_size": len(ranks),
        "precision": precision,
        "ds_version": ms.get("ds_version") or first.get("ds_version"),
        "partition_count": first.get("partition_count"),
        "elastic_checkpoint": stage != 3 and isinstance(first.get("base_optimizer_state"), list),
        "param_groups": len(groups.members),
    }
    if stage == 3:
        out["sub_groups"] = len(first.get("fp32_flat_groups") or [])
    else:
        out["group_paddings"] = [list(rf.osd.get("group_paddings") or []) for rf in ranks]
        if first.get("param_alignment_paddings") is not None:
            out["param_alignment_paddings"] = [list(p) for p in first["param_alignment_paddings"]]
    for key in ("dynamic_loss_scale", "overflow", "clip_grad"):
        if key in first:
            out[key] = first[key]
    for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size"):
        if isinstance(ms.get(key), int):
            out[key] = ms[key]
    out["ds_config"] = ds_config
    return out


def _check_bytes(ckpt: Checkpoint) -> None:
    """Every chunk's bytes lie inside its file (a truncated file is reported, not read past)."""
    sizes: dict[Path, int] = {}
    for t in ckpt.tensors.values():
        for c in t.chunks:
            if c.dtype != t.dtype:
                where = c.file if c.file is not None else ckpt.path
                raise corrupt(where, f"'{t.name}' is {t.dtype} in one rank's file and {c.dtype} in this one")
            if c.file is None:
                continue
            if c.file not in sizes:
                sizes[c.file] = c.file.stat().st_size
            end = c.offset + c.nbytes
            if end > sizes[c.file]:
                raise CorruptCheckpointError(
                    f"{c.file}: the file is {sizes[c.file]} bytes, but '{t.name}' needs bytes up to {end}",
                    hint="the file is truncated; copy it again from where the run saved it",
                    path=c.file,
                )
