"""hf_trainer: a Hugging Face ``Trainer`` checkpoint directory (``checkpoint-N/``).

What ``Trainer._save_checkpoint`` writes, read as one checkpoint:

- ``model.safetensors`` (or shards with ``model.safetensors.index.json``): the
  weights, through the safetensors reader (``config.json``'s
  ``tie_word_embeddings`` ties the head it leaves out);
- ``optimizer.pt``: ``optimizer.state_dict()``, keyed by position. The Trainer
  builds two groups, the parameters it decays then the others, each in
  ``named_parameters()`` order; Ravex rebuilds that order from the
  architecture ``config.json`` names (the class from the installed
  transformers, built on the meta device: no weight, nothing downloaded, no
  code from the checkpoint; a config naming remote code is refused), or takes
  it from ``--param-names``;
- ``scheduler.pt``: the LR scheduler's state dict (``objects["lr_scheduler"]``);
- ``trainer_state.json``: the Trainer's progress (``objects["extra"]["trainer_state"]``;
  its ``global_step`` is the step);
- everything else (``rng_state*.pth``, ``training_args.bin``, ``scaler.pt``,
  ``config.json``, tokenizer files) carried as bytes (``_framework.carry``).

A ``checkpoint-N`` of a Trainer run under DeepSpeed holds ``global_stepN/`` and
``latest`` instead of ``optimizer.pt``: the model and optimizer state are then
the ZeRO checkpoint's (the ZeRO reader: fp32 master weights, named state,
DeepSpeed's scheduler), ``model.safetensors`` is carried, and the directory can
be resharded (``ravex reshard --world-size N``), which DeepSpeed itself refuses.

The writer makes a directory the Trainer resumes from
(``trainer.train(resume_from_checkpoint=...)``): the plain layout, or, from a
DeepSpeed source or with ``--zero-stage``, the DeepSpeed one for
``--world-size`` ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._output import Options
from .._strictjson import DuplicateKey, unique_pairs
from .._torchfile.archive import open_archive
from ..errors import CorruptCheckpointError, RavexError, UnknownFormatError
from ..info import CheckpointInfo, FileInfo, TensorInfo
from ..model import MODEL, Checkpoint
from ..plan import OutFile, WritePlan, run
from ..storage import Location
from . import safetensors
from ._framework import FILES, carried_files, carry_rest, read_optimizer, read_small, training_files
from .options import WriteOptions, option
from .torch_optimizer import optimizer_info
from .zero import reader as zero
from .zero.options import PRECISION, ZERO_STAGE

__all__ = ["HfTrainerOptions", "describe", "read", "sniff", "write"]


@dataclass(frozen=True)
class HfTrainerOptions(WriteOptions):
    """The options of a Trainer ``checkpoint-N`` output: ``max_shard_size`` (the
    weights' safetensors shards), and for the checkpoint of a Trainer run under
    DeepSpeed ``zero_stage`` and ``precision`` (the ZeRO writer's)."""

    max_shard_size: int | None = option(None, safetensors.MAX_SHARD_SIZE, on_options=True)
    zero_stage: int | None = option(None, ZERO_STAGE)
    precision: str | None = option(None, PRECISION)

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
_WEIGHTS = ("model.safetensors", safetensors.INDEX_NAME)
_MAX_JSON = 256 * 2**20


def sniff(path: Path) -> list[str] | None:
    if not path.is_dir() or not (path / STATE).is_file():
        return None
    if _deepspeed(path):
        return [f"{STATE} beside DeepSpeed's 'latest': a Hugging Face Trainer checkpoint of a DeepSpeed run"]
    if not any((path / w).is_file() for w in _WEIGHTS):
        return None
    return [f"{STATE} beside the weights: a Hugging Face Trainer checkpoint"]


def _deepspeed(path: Path) -> bool:
    return (path / zero.LATEST).is_file()


def _json(file: Path) -> Any:
    try:
        if file.stat().st_size > _MAX_JSON:
            raise CorruptCheckpointError(f"{file}: {file.stat().st_size} bytes, more than a Trainer's JSON file holds",
                                         hint="the file is damaged or not the Trainer's; copy the checkpoint again", path=file)
        return json.loads(file.read_bytes(), object_pairs_hook=unique_pairs)
    except (ValueError, DuplicateKey, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{file}: not valid JSON ({exc})", hint="the file is damaged; copy the checkpoint again", path=file) from None


def architecture_order(path: Path, groups: list[int]) -> tuple[list[str] | None, str]:
    """The parameter names in the order the Trainer's optimizer holds them
    (``groups``: how many positions each param group has), rebuilt from the
    architecture in ``config.json``; or None and why not."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None, "the directory has no config.json to rebuild the model's parameter order from"
    doc = _json(cfg_file)
    if not isinstance(doc, dict):
        return None, "config.json is not a JSON object"
    if "auto_map" in doc:
        return None, "config.json names remote code (auto_map), which Ravex does not run"
    archs = doc.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) and archs[0].isidentifier()):
        return None, "config.json does not name one architecture"
    try:
        import torch
        import transformers
        from transformers.trainer import Trainer
    except ImportError:
        return None, f"transformers is not installed here, so the order of {archs[0]}'s parameters cannot be rebuilt"
    cls = getattr(transformers, archs[0], None)
    config_class = getattr(cls, "config_class", None)
    if cls is None or config_class is None:
        return None, f"the installed transformers has no architecture {archs[0]}"
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # the config's own warnings (token ids) are the training run's business
    try:
        config = config_class.from_dict({k: v for k, v in doc.items() if k != "transformers_version"})
        with torch.device("meta"):
            model = cls(config)
    finally:
        transformers.logging.set_verbosity(verbosity)
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # self is not used
    order = [n for n in named if n in decay] + [n for n in named if n not in decay] if len(groups) == 2 else named
    sizes = [sum(1 for n in named if n in decay), sum(1 for n in named if n not in decay)] if len(groups) == 2 else [len(named)]
    if sizes != groups:
        return None, (f"its param groups hold {groups} parameters, but {archs[0]} grouped as the Trainer groups it "
                      f"(decayed, then not) holds {sizes}: the run built its own optimizer")
    return order, f"names from config.json's architecture ({archs[0]}), grouped as the Trainer groups them"


def _read(path: Path, param_names: list[str] | None = None, *, shallow: bool = False) -> tuple[Checkpoint, dict[str, Any] | None]:
    if not sniff(path):
        raise UnknownFormatError(f"{path}: not a Hugging Face Trainer checkpoint (no {STATE} beside model.safetensors)",
                                 hint="point Ravex at the checkpoint-N directory the Trainer saved", path=path)
    if _deepspeed(path):
        ckpt = zero.read(path)
        ckpt.format = "hf_trainer"
    else:
        weights = safetensors.read(path)
        ckpt = Checkpoint("hf_trainer", path, world_size=1, tensors=weights.tensors, aliases=weights.aliases, notes=weights.notes)
    state = _json(path / STATE)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path / STATE}: not a JSON object", hint="the file is damaged; copy the checkpoint again", path=path / STATE)
    ckpt.objects.setdefault("extra", {})["trainer_state"] = state
    step = state.get("global_step")
    ckpt.step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
    optim: dict[str, Any] | None = None
    if (path / OPTIMIZER).is_file():
        archive = open_archive(path / OPTIMIZER)
        if shallow and param_names is None:
            optim = archive.root  # shown by position: no architecture rebuilt (no torch) for inspect
        else:
            names, how = param_names, "names from --param-names"
            if names is None:
                root = archive.root
                groups = [len(g.get("params", [])) for g in root.get("param_groups") or [] if isinstance(g, dict)] if isinstance(root, dict) else []
                names, how = architecture_order(path, groups)
            optim = read_optimizer(ckpt, archive, names, how, shallow=shallow)
            if names is not None:
                ckpt.notes.append(f"optimizer positions: {how}")
    if (path / SCHEDULER).is_file():
        ckpt.objects["lr_scheduler"] = read_small(path / SCHEDULER, ckpt, "obj/lr_scheduler", shallow=shallow)
    carry_rest(ckpt, path, _parsed(path), {str(ckpt.source.get("tag"))})
    return ckpt, optim


def _parsed(path: Path) -> set[str]:
    """The files of the directory that Ravex parses (the rest are carried)."""
    return {STATE, OPTIMIZER, SCHEDULER, zero.LATEST} | (set() if _deepspeed(path) else set(_weight_files(path)))


def _weight_files(path: Path) -> list[str]:
    if (path / safetensors.INDEX_NAME).is_file():
        return [safetensors.INDEX_NAME, *sorted({str(v) for v in _json(path / safetensors.INDEX_NAME).get("weight_map", {}).values()})]
    return ["model.safetensors"]


def read(path: Path, param_names: list[str] | None = None) -> Checkpoint:
    """The directory as one checkpoint (see the module's docstring)."""
    return _read(path, param_names)[0]


def describe(path: Path, reasons: list[str], param_names: list[str] | None = None) -> CheckpointInfo:
    """What :func:`read` finds, without rebuilding the architecture (so no
    torch): an optimizer keyed by position is shown by position."""
    if _deepspeed(path):
        # ZeRO's own describe for the ZeRO part (metadata only), the Trainer's files by name
        info = zero.describe(path, reasons)
        info.format, info.variant = "hf_trainer", f"deepspeed {info.variant}"
        parsed = _parsed(path)
        carried = sorted(p.name for p in path.iterdir() if p.is_file() and p.name not in parsed)
        info.files = [FileInfo(p.name, p.stat().st_size, "trainer_state" if p.name == STATE else "carried")
                      for p in sorted(path.iterdir()) if p.is_file() and p.name != zero.LATEST] + info.files
        info.notes = [n for n in info.notes if not n.startswith("left out: ")]  # the ZeRO reader's view: these are carried here
        if carried:
            info.notes.append(f"carried as bytes, not parsed: {', '.join(carried)}")
        info.extra["carried"] = carried
        return info
    ckpt, optim = _read(path, param_names, shallow=True)
    info = CheckpointInfo("hf_trainer", "checkpoint", str(path), world_size=1, step=ckpt.step, reasons=reasons)
    roles = {STATE: "trainer_state", OPTIMIZER: "optimizer", SCHEDULER: "scheduler", **dict.fromkeys(_weight_files(path), "weights")}
    info.files = [FileInfo(p.name, p.stat().st_size, roles.get(p.name, "carried")) for p in sorted(path.iterdir()) if p.is_file()]
    info.tensors = [TensorInfo(n[len(MODEL):], t.shape, t.dtype) for n, t in ckpt.tensors.items() if n.startswith(MODEL)]
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items() if a.startswith(MODEL)}
    if optim is not None:
        info.optimizer, shown = optimizer_info(optim)
        info.tensors += shown
        ckpt.notes.append("optimizer state is keyed by position; a conversion names it from config.json's architecture (or --param-names)")
    elif any(n.startswith("optim/") for n in ckpt.tensors):
        info.tensors += [TensorInfo(n, t.shape, t.dtype, "optim") for n, t in ckpt.tensors.items() if n.startswith("optim/")]
    info.notes = list(ckpt.notes)
    sched = ckpt.objects.get("lr_scheduler")
    info.extra["lr_scheduler"] = f"last_epoch {sched.get('last_epoch')}" if isinstance(sched, dict) else "none"
    info.extra["carried"] = sorted((ckpt.objects.get("extra") or {}).get(FILES, {}))
    return info


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options, *, zero_stage: int | None = None, precision: str | None = None) -> WritePlan:
    """A ``checkpoint-N`` directory the Trainer resumes from. Plain: the
    weights as ``model.safetensors`` (shards and index with
    ``max_shard_size``), the optimizer as ``optimizer.pt`` keyed by position in
    its groups' order, ``scheduler.pt``. DeepSpeed (a DeepSpeed source, or
    ``zero_stage`` given): ``global_stepN/`` and ``latest`` for
    ``opts.world_size`` ranks (the ZeRO writer). Both: ``trainer_state.json``
    (the source's, else one recording the step) and every carried file back
    byte for byte."""
    if dst.suffix == ".safetensors":
        raise RavexError(f"{dst}: a Trainer checkpoint is a directory (checkpoint-N), not a .safetensors file",
                         hint="name the output directory, e.g. checkpoint-100; --to safetensors writes weights alone", path=str(dst))
    stage = zero_stage or (ckpt.objects.get("zero") or {}).get("stage")
    if isinstance(stage, int):
        from .zero.writer import plan_write as zero_plan

        inner = zero_plan(ckpt, dst, opts, zero_stage=stage, precision=precision)
        files: list[OutFile] = list(inner.files)
    else:
        if opts.world_size > 1:
            raise RavexError(f"{dst}: a plain Trainer checkpoint has no ranks (every rank of a DDP run holds the same state), so --world-size {opts.world_size} has nothing to shard",
                             hint="leave --world-size out, or give --zero-stage to write the checkpoint of a Trainer run under DeepSpeed", path=str(dst))
        inner = safetensors.plan_write(ckpt, dst, opts)
        files = list(inner.files) + training_files(ckpt, OPTIMIZER, SCHEDULER, opts)
    state = (ckpt.objects.get("extra") or {}).get("trainer_state")
    if not isinstance(state, dict):
        if ckpt.step is None:
            raise RavexError(f"{ckpt.path}: the checkpoint records no step, which trainer_state.json needs",
                             hint="convert from a checkpoint that records its step, or write safetensors weights (--to safetensors)", path=ckpt.path)
        state = {"global_step": ckpt.step}
    body = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    files.append(OutFile(STATE, len(body), small=[(0, body)]))
    made = {f.rel for f in files} | ({name for name, _ in inner.commit} if isinstance(inner.commit, list) else set())
    files += carried_files(ckpt, skip=made)
    summary = {**inner.summary, "files": sorted(f.rel for f in files), "tensors": len(ckpt.tensors), "bytes": sum(f.size for f in files)}
    return WritePlan(True, files, inner.commit, summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Any = None, *, zero_stage: int | None = None,
          precision: str | None = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    return run(plan_write(ckpt, dst, opts, zero_stage=zero_stage, precision=precision), dst, force=opts.force, progress=progress)
