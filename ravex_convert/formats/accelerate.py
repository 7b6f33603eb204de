"""accelerate: a directory written by Accelerate's ``accelerator.save_state``.

What ``save_state`` writes for one model, optimizer and scheduler (not under
FSDP or DeepSpeed), read as one checkpoint:

- ``model.safetensors``: the weights (the safetensors reader);
- ``optimizer.bin``: ``optimizer.state_dict()`` saved with torch.save, keyed by
  position. The optimizer was built by the user's code, from parameters in an
  order no file records (``model.safetensors`` lists names sorted), so the
  positions are named by ``--param-names``, or by shape where every position's
  shape is one model tensor's; otherwise the weights are read and the optimizer
  state is refused where it is needed, with the fix;
- ``scheduler.bin``: the LR scheduler's state dict (``objects["lr_scheduler"]``);
- everything else (``random_states_<rank>.pkl``, which pickle numpy state;
  ``scaler.pt``, ``sampler.bin``, ``custom_checkpoint_<i>.pkl``, a second
  model, optimizer or scheduler) carried as bytes (``_framework.carry``).

Under FSDP (``state_dict_type=SHARDED_STATE_DICT``) ``save_state`` writes,
instead of ``model.safetensors`` and ``optimizer.bin``, two DCP checkpoints,
read here as the same one checkpoint (the DCP reader reads each):

- ``pytorch_model_fsdp_0/``: ``dcp.save({"model": get_model_state_dict(model)})``,
  the model's tensors (parameters and persistent buffers) by name;
- ``optimizer_0/``: ``dcp.save({"optimizer": get_optimizer_state_dict(model, opt)})``,
  the optimizer state and param groups keyed by parameter name, so no position
  needs naming. Each of its parameters is checked to be a model tensor of the
  state's shape;
- ``scheduler.bin`` and the carried files as above; ``random_states_<rank>.pkl``
  is one file per rank of the run, carried as bytes like the rest.

The writer makes a directory ``accelerator.load_state`` accepts: the plain
layout, or the FSDP layout (a source written under FSDP, or ``--world-size``
above 1): the model and the optimizer each a DCP checkpoint sharded as FSDP2
shards at ``--world-size`` ranks (the DCP writer), which ``load_fsdp_model`` /
``load_fsdp_optimizer`` read at any world size. The carried files come back
byte for byte, the RNG files among them, one per rank of the *source*: at more
ranks than the source had, the ranks past it find no ``random_states_<rank>.pkl``,
and Accelerate's ``load_state`` then logs "Could not load random states" and
goes on with that rank's own RNG state (and its ``accelerator.step`` left as it
was); the summary says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .._layout import SOURCE_KEY, StateLayout
from .._output import Options
from .._torchfile.archive import open_archive
from ..errors import IncompleteCheckpointError, LayoutMismatchError, RavexError, UnknownFormatError
from ..info import CheckpointInfo, FileInfo, OptimizerInfo, TensorInfo
from ..model import MODEL, OPTIM, Checkpoint
from ..plan import OutFile, WritePlan, run
from ..storage import Location
from . import safetensors
from ._framework import FILES, carried_files, carry_rest, names_by_shape, read_optimizer, read_small, small_file, training_files
from .dcp import reader as dcp
from .torch_optimizer import optimizer_info, saved_step

__all__ = ["describe", "read", "sniff", "write"]

WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.bin"
SCHEDULER = "scheduler.bin"
_MARKS = (OPTIMIZER, SCHEDULER, "random_states_0.pkl")
MODEL_DIR = "pytorch_model_fsdp_0"  # save_fsdp_model's DCP checkpoint of model 0
OPTIM_DIR = "optimizer_0"  # save_fsdp_optimizer's, of optimizer 0
_FSDP = (MODEL_DIR, OPTIM_DIR)
LAYOUT_KEY = "accelerate_layout"  # Checkpoint.source: "fsdp" for a directory written under FSDP
_RNG = re.compile(r"^random_states_(\d+)\.pkl$")


def sniff(path: Path) -> list[str] | None:
    if not path.is_dir() or (path / "trainer_state.json").exists():
        return None
    marks = [m for m in _MARKS if (path / m).is_file()]
    if not marks:
        return None
    if (path / WEIGHTS).is_file():
        return [f"{WEIGHTS} beside {', '.join(marks)}: an Accelerate save_state directory"]
    if any((path / d).is_dir() for d in _FSDP):
        return [f"{', '.join(marks)} beside {', '.join(d + '/' for d in _FSDP if (path / d).is_dir())}: an Accelerate save_state directory (FSDP)"]
    return None


def _read(path: Path, param_names: list[str] | None = None, *, shallow: bool = False) -> tuple[Checkpoint, dict[str, Any] | None]:
    if not sniff(path):
        raise UnknownFormatError(f"{path}: not an Accelerate save_state directory", hint="point Ravex at the directory save_state wrote", path=path)
    if not (path / WEIGHTS).is_file():
        return _read_fsdp(path), None
    weights = safetensors.read(path / WEIGHTS)
    ckpt = Checkpoint("accelerate", path, world_size=1, tensors=weights.tensors, aliases=weights.aliases, notes=weights.notes)
    optim: dict[str, Any] | None = None
    if (path / OPTIMIZER).is_file():
        archive = open_archive(path / OPTIMIZER)
        root = archive.root
        if shallow and param_names is None:
            optim = root
        else:
            names, how = (param_names, "names from --param-names") if param_names is not None else (
                names_by_shape(ckpt, root) if isinstance(root, dict) else (None, "the file holds no optimizer state dict"))
            optim = read_optimizer(ckpt, archive, names, how, shallow=shallow)
            if names is not None:
                ckpt.notes.append(f"optimizer positions: {how}")
        ckpt.step = saved_step(archive, None, root if isinstance(root, dict) else None)  # the optimizer's own step count
    if (path / SCHEDULER).is_file():
        ckpt.objects["lr_scheduler"] = read_small(path / SCHEDULER, ckpt, "obj/lr_scheduler", shallow=shallow)
    carry_rest(ckpt, path, {WEIGHTS, OPTIMIZER, SCHEDULER})
    return ckpt, optim


# ---------------------------------------------------------------- under FSDP


def _inner(path: Path) -> tuple[Path, Path | None]:
    """The model's and the optimizer's DCP directories, each with its ``.metadata``
    (the optimizer's None where the run prepared no optimizer)."""
    model, optim = path / MODEL_DIR, path / OPTIM_DIR
    if not model.is_dir():
        raise IncompleteCheckpointError(
            f"{path}: {OPTIM_DIR}/ without {MODEL_DIR}/, so the model's half of this Accelerate FSDP save_state directory is missing",
            hint=f"copy {MODEL_DIR}/ too: save_state writes it beside {OPTIM_DIR}/", path=model)
    for d in (model, optim):
        meta = d / dcp.METADATA
        if d.is_dir() and not meta.is_file():
            raise IncompleteCheckpointError(
                f"{meta}: missing, so {d.name}/ is not a complete DCP checkpoint",
                hint=f"DCP writes .metadata last: the save did not finish, or the copy is partial; copy {d.name}/ again from where the run saved it",
                path=meta)
    return model, optim if optim.is_dir() else None


def _refuse_extra(part: Checkpoint, area: str, where: tuple[str, ...], d: Path, writer: str) -> None:
    """``part`` (one inner DCP, as the DCP reader read it) holds only what ``writer``
    saves there: tensors under ``area`` at DCP key ``where``, and the optimizer's param groups."""
    found = StateLayout.from_json(part.source.get(SOURCE_KEY))
    stray = [n for n in part.tensors if not n.startswith(area)] + [k for k in part.objects if k != "optim.param_groups" or area != OPTIM]
    placed = found.model if area == MODEL else found.optim
    if stray or (part.tensors and placed != where) or (area == OPTIM and found.optim_flat):
        what = f"'{stray[0]}'" if stray else f"its state at '{'.'.join(map(str, placed))}'"
        raise LayoutMismatchError(
            f"{d}: holds {what}, which Accelerate's {writer} does not write there (it saves {{'{where[0]}': ...}} alone)",
            hint=f"read it as the DCP checkpoint it is: `ravex inspect {d}`, `ravex convert {d} OUT --to ...`", path=d)


def _check_optimizer(ckpt: Checkpoint, optim: Checkpoint, d: Path) -> None:
    """Every parameter the optimizer names is a model tensor, its state shaped as it."""
    hint = f"{d.name}/ and {MODEL_DIR}/ come from different saves or runs; copy the save_state directory again, whole"
    groups = optim.objects.get("optim.param_groups")
    in_groups = [str(fqn) for g in (groups if isinstance(groups, list) else []) if isinstance(g, dict) for fqn in g.get("params") or []]
    for n, t in optim.tensors.items():
        fqn = n.split("/", 2)[2]
        if MODEL + fqn not in ckpt.tensors and MODEL + fqn not in ckpt.aliases:
            raise LayoutMismatchError(f"{d}: the optimizer holds state for '{fqn}', which {MODEL_DIR}/ does not hold", hint=hint, path=d)
        p = ckpt.resolve(MODEL + fqn)
        if t.shape and t.shape != p.shape:
            raise LayoutMismatchError(f"{d}: the optimizer's '{n.split('/')[1]}' of '{fqn}' has shape {list(t.shape)}, the parameter {list(p.shape)}",
                                      hint=hint, path=d)
    for fqn in in_groups:
        if MODEL + fqn not in ckpt.tensors and MODEL + fqn not in ckpt.aliases:
            raise LayoutMismatchError(f"{d}: a param group names '{fqn}', which {MODEL_DIR}/ does not hold", hint=hint, path=d)


def _read_fsdp(path: Path) -> Checkpoint:
    """The directory ``save_state`` writes under FSDP as one checkpoint (the module's docstring)."""
    model_dir, optim_dir = _inner(path)
    model = dcp.read(model_dir)
    _refuse_extra(model, MODEL, ("model",), model_dir, "save_fsdp_model")
    ckpt = Checkpoint("accelerate", path, world_size=model.world_size, tensors=dict(model.tensors), aliases=dict(model.aliases))
    ckpt.source[LAYOUT_KEY] = "fsdp"
    ckpt.source["metadata_form"] = model.source.get("metadata_form")
    if optim_dir is not None:
        optim = dcp.read(optim_dir)
        _refuse_extra(optim, OPTIM, ("optimizer",), optim_dir, "save_fsdp_optimizer")
        _check_optimizer(ckpt, optim, optim_dir)
        ckpt.tensors.update(optim.tensors)
        if "optim.param_groups" in optim.objects:
            ckpt.objects["optim.param_groups"] = optim.objects["optim.param_groups"]
        ckpt.step = optim.step
        if optim.world_size != model.world_size:
            ckpt.notes.append(f"{MODEL_DIR}/ was saved by {model.world_size} rank(s), {OPTIM_DIR}/ by {optim.world_size}")
    else:
        ckpt.notes.append(f"no {OPTIM_DIR}/ (the run prepared no optimizer): the weights alone are read")
    if (path / SCHEDULER).is_file():
        ckpt.objects["lr_scheduler"] = read_small(path / SCHEDULER, ckpt, "obj/lr_scheduler")
    carry_rest(ckpt, path, {SCHEDULER}, own_dirs=_FSDP)
    return ckpt


def _describe_fsdp(path: Path, reasons: list[str]) -> CheckpointInfo:
    """What :func:`_read_fsdp` finds, from the two DCP checkpoints' metadata (their items unopened)."""
    model_dir, optim_dir = _inner(path)
    m = dcp.describe(model_dir, [])
    info = CheckpointInfo("accelerate", "FSDP save_state", str(path), world_size=m.world_size, reasons=list(reasons))
    info.reasons.append(f"world size {m.world_size} inferred from {MODEL_DIR}/'s data file names (__<rank>_<n>.distcp)")
    info.files = [FileInfo(f"{MODEL_DIR}/{f.path}", f.bytes, f"weights ({f.role})", f.rank) for f in m.files]
    info.tensors = list(m.tensors)
    if optim_dir is not None:
        o = dcp.describe(optim_dir, [])
        info.files += [FileInfo(f"{OPTIM_DIR}/{f.path}", f.bytes, f"optimizer ({f.role})", f.rank) for f in o.files]
        info.tensors += [t for t in o.tensors if t.kind == "optim"]
        info.optimizer = o.optimizer or OptimizerInfo("unknown", [], None)
        info.step = o.step
    shown = Checkpoint("accelerate", path)
    if (path / SCHEDULER).is_file():
        info.files.append(FileInfo(SCHEDULER, (path / SCHEDULER).stat().st_size, "scheduler"))
    carry_rest(shown, path, {SCHEDULER}, own_dirs=_FSDP)
    carried = sorted((shown.objects.get("extra") or {}).get(FILES, {}))
    info.files += [FileInfo(n, (path / n).stat().st_size, "carried") for n in carried]
    info.notes = [*m.notes, *shown.notes] + ([] if optim_dir is not None else [f"no {OPTIM_DIR}/ (the run prepared no optimizer)"])
    info.extra["carried"] = carried
    info.extra["metadata_form"] = m.extra.get("metadata_form")
    return info


def _plan_fsdp(ckpt: Checkpoint, dst: Path | Location, opts: Options) -> WritePlan:
    """The FSDP layout: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each a DCP
    checkpoint as FSDP2 shards it at ``opts.world_size`` ranks (the DCP writer,
    keyed ``model`` and ``optimizer`` as Accelerate saves them), their two
    ``.metadata`` written last; ``scheduler.bin``; the carried files."""
    from ._framework import optimizer_tensors
    from .dcp import writer as dcp_writer

    ws = opts.world_size
    model = Checkpoint(ckpt.format, ckpt.path, ws, ckpt.step, source={SOURCE_KEY: StateLayout(("model",)).to_json()})
    model.tensors = {n: t for n, t in ckpt.tensors.items() if n.startswith(MODEL)}
    model.aliases = {a: t for a, t in ckpt.aliases.items() if a.startswith(MODEL)}
    if not model.tensors:
        raise RavexError(f"{ckpt.path}: the checkpoint holds no model weights, which {MODEL_DIR}/ needs", path=ckpt.path,
                         hint="convert a checkpoint that holds the model's weights")
    parts = [(MODEL_DIR, model)]
    per, groups = optimizer_tensors(ckpt)
    notes: list[str] = []
    if per or groups:
        optim = Checkpoint(ckpt.format, ckpt.path, ws, ckpt.step, source={SOURCE_KEY: StateLayout(("model",), ("optimizer",)).to_json()})
        optim.tensors = {t.name: t for states in per.values() for t in states.values()}
        optim.objects["optim.param_groups"] = groups
        parts.append((OPTIM_DIR, optim))
    else:
        notes.append(f"no optimizer state, so no {OPTIM_DIR}/: accelerator.load_state under FSDP needs one for each prepared optimizer")
    files: list[OutFile] = []
    commits: list[tuple[str, Any]] = []
    for d, part in parts:
        inner = dcp_writer.plan_write(part, dst / d, opts)
        for f in inner.files:
            f.rel = f"{d}/{f.rel}"
        files += inner.files
        commits.append((d, inner.commit))
    sched = ckpt.objects.get("lr_scheduler")
    if isinstance(sched, dict):
        files.append(small_file(SCHEDULER, ckpt, sched, opts))
    files += carried_files(ckpt, skip={f.rel for f in files})
    ranks = sorted(int(m.group(1)) for f in files if (m := _RNG.match(f.rel)))
    lacking = [r for r in range(ws) if r not in ranks]
    if ranks and lacking:
        notes.append(f"no random_states_<rank>.pkl for rank(s) {', '.join(map(str, lacking))} (the source's run had {len(ranks)} rank(s)): "
                     "accelerator.load_state there logs 'Could not load random states' and keeps that rank's own RNG state and step")

    def commit(sealed: dict[str, Any]) -> list[tuple[str, bytes]]:
        # each DCP's .metadata, once every data file of both is durable: the commit points
        out: list[tuple[str, bytes]] = []
        for d, c in commits:
            out += [(f"{d}/{rel}", data) for rel, data in (c(sealed) if callable(c) else c)]
        return out

    metadata = [f"{d}/{dcp.METADATA}" for d, _ in parts]
    summary: dict[str, Any] = {"files": sorted([f.rel for f in files] + metadata), "tensors": len(ckpt.tensors), "world_size": ws,
                               "layout": "fsdp", "bytes": sum(f.size for f in files)}
    if notes:
        summary["notes"] = notes
    return WritePlan(True, files, commit, summary, threads=opts.threads)


def read(path: Path, param_names: list[str] | None = None) -> Checkpoint:
    """The directory as one checkpoint (see the module's docstring)."""
    return _read(path, param_names)[0]


def describe(path: Path, reasons: list[str], param_names: list[str] | None = None) -> CheckpointInfo:
    """What :func:`read` finds; an optimizer keyed by position is shown by position."""
    if sniff(path) and not (path / WEIGHTS).is_file():
        return _describe_fsdp(path, reasons)
    ckpt, optim = _read(path, param_names, shallow=True)
    info = CheckpointInfo("accelerate", "save_state", str(path), world_size=1, step=ckpt.step, reasons=reasons)
    roles = {WEIGHTS: "weights", OPTIMIZER: "optimizer", SCHEDULER: "scheduler"}
    info.files = [FileInfo(p.name, p.stat().st_size, roles.get(p.name, "carried")) for p in sorted(path.iterdir()) if p.is_file()]
    info.tensors = [TensorInfo(n[len(MODEL):], t.shape, t.dtype) for n, t in ckpt.tensors.items() if n.startswith(MODEL)]
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items() if a.startswith(MODEL)}
    if optim is not None and isinstance(optim, dict):
        info.optimizer, shown = optimizer_info(optim)
        info.tensors += shown
        if param_names is None:
            ckpt.notes.append("optimizer state is keyed by position; a conversion names it by shape where that decides, else needs --param-names")
    info.notes = list(ckpt.notes)
    info.extra["carried"] = sorted((ckpt.objects.get("extra") or {}).get(FILES, {}))
    return info


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options) -> WritePlan:
    """A directory ``accelerator.load_state`` accepts: ``model.safetensors``,
    ``optimizer.bin`` keyed by position in its groups' order, ``scheduler.bin``,
    and every carried file back byte for byte (the RNG states among them).
    From a source written under FSDP, or for ``--world-size`` above 1, the FSDP
    layout instead (:func:`_plan_fsdp`)."""
    if ckpt.source.get(LAYOUT_KEY) == "fsdp" or opts.world_size > 1:
        return _plan_fsdp(ckpt, dst, opts)
    weights = safetensors.plan_write(ckpt, dst / WEIGHTS, opts)
    files: list[OutFile] = list(weights.files)
    files[0].rel = WEIGHTS
    files += training_files(ckpt, OPTIMIZER, SCHEDULER, opts)
    files += carried_files(ckpt, skip={f.rel for f in files})
    summary = {"files": sorted(f.rel for f in files), "tensors": len(ckpt.tensors), "bytes": sum(f.size for f in files)}
    return WritePlan(True, files, [], summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Any = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    return run(plan_write(ckpt, dst, opts), dst, force=opts.force, progress=progress)
