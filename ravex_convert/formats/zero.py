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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._torchzip import TorchArchive, open_archive
from .._unpickle import Record, TensorRef
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, RavexError, UnknownFormatError
from ..info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo

__all__ = ["LATEST", "ZeroLayout", "describe", "locate", "sniff"]

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
            tag = (path / LATEST).read_text().strip()
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
        if m := _MODEL_FILE.match(p.name):
            if int(m.group(2)) != 0:
                raise RavexError(f"{p}: a model-parallel rank {int(m.group(2))} file; tensor/pipeline parallel checkpoints are not supported yet", path=p)
            layout.model_files[int(m.group(1) or 0)] = p
        elif m := _OPTIM_FILE.match(p.name):
            if int(m.group(3)) != 0:
                raise RavexError(f"{p}: a model-parallel rank {int(m.group(3))} file; tensor/pipeline parallel checkpoints are not supported yet", path=p)
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


def _stage_of(value: Any) -> int | None:
    if isinstance(value, Record) and value.args:
        value = value.args[0]
    return int(value) if isinstance(value, int) else None


def _model_states_file(layout: ZeroLayout) -> Path:
    plain = layout.tag_dir / "mp_rank_00_model_states.pt"
    return plain if plain.is_file() else layout.model_files[min(layout.model_files)]


def _find_optimizer_state(osd: dict[str, Any]) -> dict[str, Any] | None:
    """The wrapped torch optimizer's state dict, wherever this stage keeps it."""
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        v = osd.get(key)
        if isinstance(v, dict) and "state" in v:
            return v
        if isinstance(v, list) and v and isinstance(v[0], dict):
            # elastic checkpoints: one lean state dict per param group
            return {"state": dict(enumerate(v)), "param_groups": osd.get("param_groups")}
    return None


def describe(path: Path, reasons: list[str], tag: str | None = None) -> CheckpointInfo:
    layout = locate(path, tag)
    model = open_archive(_model_states_file(layout))
    ms = model.root
    if not isinstance(ms, dict) or "param_shapes" not in ms:
        raise UnknownFormatError(
            f"{model.path}: a torch.save file without DeepSpeed's 'param_shapes'; not a DeepSpeed ZeRO model-states file",
            hint="point Ravex at the DeepSpeed checkpoint root (the directory with 'latest')",
            path=model.path,
        )
    optim0 = open_archive(layout.optim_files[0])
    osd = optim0.root.get("optimizer_state_dict") if isinstance(optim0.root, dict) else None
    if not isinstance(osd, dict):
        raise CorruptCheckpointError(f"{optim0.path}: has no 'optimizer_state_dict'; not a DeepSpeed optimizer file", path=optim0.path)

    ds_config: dict[str, Any] = ms["ds_config"] if isinstance(ms.get("ds_config"), dict) else {}
    configured = _stage_of((ds_config.get("zero_optimization") or {}).get("stage"))
    saved_stage = _stage_of(osd.get("zero_stage"))
    bf16_optimizer = "zero_stage" not in osd
    stage = configured if configured is not None else (saved_stage if saved_stage is not None else (1 if bf16_optimizer else None))
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled")) or layout.prefix == "bf16_"
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled")) or layout.prefix == "fp16_"
    precision = "bf16" if bf16 else ("fp16" if fp16 else "fp32")
    variant = "bf16_optimizer" if bf16_optimizer else f"zero{stage}"

    info = CheckpointInfo("zero", variant, str(path), zero_stage=stage, tag=layout.tag, reasons=reasons + layout.reasons)
    info.world_size = len(layout.optim_files)
    prefix_note = f" with the '{layout.prefix}' prefix ({layout.prefix[:-1]} was on)" if layout.prefix else ""
    info.reasons.append(f"{info.world_size} per-rank optimizer files{prefix_note}")
    if bf16_optimizer:
        info.reasons.append("the optimizer state has no 'zero_stage' key: DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation)")
    else:
        info.reasons.append(f"the optimizer state says zero_stage={saved_stage}" + (f"; ds_config says stage {configured}" if configured is not None else ""))
    partition_count = osd.get("partition_count")
    counts = partition_count if isinstance(partition_count, list) else [partition_count]
    if all(isinstance(c, int) for c in counts) and counts and max(counts) != info.world_size:
        raise IncompleteCheckpointError(
            f"{layout.tag_dir}: the optimizer state says {max(counts)} ranks, but {info.world_size} optimizer files are present",
            hint="an old save was overwritten in part, or some ranks' files were not copied; use a complete tag directory",
            path=layout.tag_dir,
        )
    info.extra["precision"] = precision
    info.extra["ds_version"] = ms.get("ds_version")
    info.extra["zero_stage_saved"] = saved_stage
    info.step = ms.get("global_steps") if isinstance(ms.get("global_steps"), int) else None
    _tensors(info, ms, model)
    _optimizer(info, osd, optim0)
    files: list[FileInfo] = []
    for r, p in sorted(layout.model_files.items()):
        files.append(FileInfo(str(p.relative_to(layout.root)), p.stat().st_size, "model_states", r if p.name.startswith("zero_pp") else None))
    for r, p in sorted(layout.optim_files.items()):
        files.append(FileInfo(str(p.relative_to(layout.root)), p.stat().st_size, "optim_states", r))
    info.files = files
    return info


def _tensors(info: CheckpointInfo, ms: dict[str, Any], model: TorchArchive) -> None:
    module: dict[str, Any] = ms["module"] if isinstance(ms.get("module"), dict) else {}
    buffers = ms.get("buffer_names") or []
    frozen = ms.get("frozen_param_shapes") or {}
    shared = ms.get("shared_params") or {}
    groups = ms["param_shapes"] if isinstance(ms["param_shapes"], list) else [ms["param_shapes"]]
    for group in groups:
        for name, shape in group.items():
            ref = module.get(name)
            dtype = ref.dtype if isinstance(ref, TensorRef) else "float32"
            info.tensors.append(TensorInfo(name, tuple(shape), dtype, "param"))
    if isinstance(frozen, dict):
        for name, shape in frozen.items():
            ref = module.get(name)
            info.tensors.append(TensorInfo(name, tuple(shape), ref.dtype if isinstance(ref, TensorRef) else "float32", "frozen"))
    listed = {t.name for t in info.tensors}
    for name, ref in module.items():
        if name in listed or name in shared or not isinstance(ref, TensorRef):
            continue
        if name in buffers:
            info.tensors.append(TensorInfo(name, ref.shape, ref.dtype, "buffer"))
        elif not ms.get("frozen_param_shapes") and not ref.requires_grad and ref.numel > 0:
            # ZeRO-1 records no frozen_param_shapes: a frozen param lives only in `module`.
            info.tensors.append(TensorInfo(name, ref.shape, ref.dtype, "frozen"))
            info.notes.append(f"'{name}' is a frozen parameter kept only in the module state (ZeRO-1 records no frozen_param_shapes)")
    if isinstance(shared, dict):
        info.aliases = {str(k): str(v) for k, v in shared.items()}


def _optimizer(info: CheckpointInfo, osd: dict[str, Any], optim0: TorchArchive) -> None:
    inner = _find_optimizer_state(osd)
    names: list[str] = []
    if inner is not None:
        for per in (inner.get("state") or {}).values():
            if isinstance(per, dict):
                names.extend(k for k in per if k not in names)
    masters = osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups") or osd.get("fp32_groups") or []
    master_dtype = next((m.dtype for m in masters if isinstance(m, TensorRef)), None) if isinstance(masters, list) else None
    groups = inner.get("param_groups") if inner is not None else None
    kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(names) else ("unknown" if names else "none")
    info.optimizer = OptimizerInfo(kind, names, len(groups) if isinstance(groups, list) else None, master_dtype)
