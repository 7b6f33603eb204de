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

The writer makes a directory ``accelerator.load_state`` accepts. An
Accelerate FSDP directory (``pytorch_model_fsdp_0/``, ``optimizer_0/``) is
refused with the way round it: each of those is a DCP checkpoint Ravex reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._output import Options
from .._torchfile.archive import open_archive
from ..errors import RavexError, UnknownFormatError
from ..info import CheckpointInfo, FileInfo, TensorInfo
from ..model import MODEL, Checkpoint
from ..plan import OutFile, WritePlan, run
from . import safetensors
from ._framework import FILES, carried_files, carry_rest, names_by_shape, read_optimizer, read_small, training_files

__all__ = ["describe", "read", "sniff", "write"]

WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.bin"
SCHEDULER = "scheduler.bin"
_MARKS = (OPTIMIZER, SCHEDULER, "random_states_0.pkl")
_FSDP = ("pytorch_model_fsdp_0", "optimizer_0")


def sniff(path: Path) -> list[str] | None:
    if not path.is_dir() or (path / "trainer_state.json").exists():
        return None
    marks = [m for m in _MARKS if (path / m).is_file()]
    if not marks:
        return None
    if (path / WEIGHTS).is_file():
        return [f"{WEIGHTS} beside {', '.join(marks)}: an Accelerate save_state directory"]
    if any((path / d).is_dir() for d in _FSDP):
        return [f"{', '.join(marks)} beside {'/'.join(d for d in _FSDP if (path / d).is_dir())}/: an Accelerate save_state directory (FSDP)"]
    return None


def _read(path: Path, param_names: list[str] | None = None, *, shallow: bool = False) -> tuple[Checkpoint, dict[str, Any] | None]:
    if not sniff(path):
        raise UnknownFormatError(f"{path}: not an Accelerate save_state directory", hint="point Ravex at the directory save_state wrote", path=path)
    if not (path / WEIGHTS).is_file():
        inner = [d for d in _FSDP if (path / d).is_dir()]
        raise RavexError(
            f"{path}: an Accelerate save_state directory written under FSDP ({', '.join(d + '/' for d in inner)}), which Ravex does not read as one yet",
            hint=f"each of those is a DCP checkpoint Ravex reads on its own: `ravex convert {path / inner[0]} OUT --to ...`",
            path=path)
    weights = safetensors.read(path / WEIGHTS)
    ckpt = Checkpoint("accelerate", path, world_size=1, tensors=weights.tensors, aliases=weights.aliases, notes=weights.notes)
    optim: dict[str, Any] | None = None
    if (path / OPTIMIZER).is_file():
        from .torch_save import _step

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
        ckpt.step = _step(archive, None, root if isinstance(root, dict) else None)  # the optimizer's own step count
    if (path / SCHEDULER).is_file():
        ckpt.objects["lr_scheduler"] = read_small(path / SCHEDULER, ckpt, "obj/lr_scheduler", shallow=shallow)
    carry_rest(ckpt, path, {WEIGHTS, OPTIMIZER, SCHEDULER})
    return ckpt, optim


def read(path: Path, param_names: list[str] | None = None) -> Checkpoint:
    """The directory as one checkpoint (see the module's docstring)."""
    return _read(path, param_names)[0]


def describe(path: Path, reasons: list[str], param_names: list[str] | None = None) -> CheckpointInfo:
    """What :func:`read` finds; an optimizer keyed by position is shown by position."""
    from .torch_save import _optimizer_info

    ckpt, optim = _read(path, param_names, shallow=True)
    info = CheckpointInfo("accelerate", "save_state", str(path), world_size=1, step=ckpt.step, reasons=reasons)
    roles = {WEIGHTS: "weights", OPTIMIZER: "optimizer", SCHEDULER: "scheduler"}
    info.files = [FileInfo(p.name, p.stat().st_size, roles.get(p.name, "carried")) for p in sorted(path.iterdir()) if p.is_file()]
    info.tensors = [TensorInfo(n[len(MODEL):], t.shape, t.dtype) for n, t in ckpt.tensors.items() if n.startswith(MODEL)]
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items() if a.startswith(MODEL)}
    if optim is not None and isinstance(optim, dict):
        info.optimizer, shown = _optimizer_info(optim)
        info.tensors += shown
        if param_names is None:
            ckpt.notes.append("optimizer state is keyed by position; a conversion names it by shape where that decides, else needs --param-names")
    info.notes = list(ckpt.notes)
    info.extra["carried"] = sorted((ckpt.objects.get("extra") or {}).get(FILES, {}))
    return info


def plan_write(ckpt: Checkpoint, dst: Path, opts: Options) -> WritePlan:
    """A directory ``accelerator.load_state`` accepts: ``model.safetensors``,
    ``optimizer.bin`` keyed by position in its groups' order, ``scheduler.bin``,
    and every carried file back byte for byte (the RNG states among them)."""
    weights = safetensors.plan_write(ckpt, dst / WEIGHTS, opts)
    files: list[OutFile] = list(weights.files)
    files[0].rel = WEIGHTS
    files += training_files(ckpt, OPTIMIZER, SCHEDULER, opts)
    files += carried_files(ckpt, skip={f.rel for f in files})
    summary = {"files": sorted(f.rel for f in files), "tensors": len(ckpt.tensors), "bytes": sum(f.size for f in files)}
    return WritePlan(True, files, [], summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path, opts: Options, progress: Any = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    return run(plan_write(ckpt, dst, opts), dst, force=opts.force, progress=progress)
