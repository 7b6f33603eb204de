"""torch_save: one ``torch.save`` file holding a state dict or a training state.

Layouts people actually have (DESIGN.md, "conventions"):
- a bare state dict ``{name: tensor}``;
- ``{"model": sd, "optimizer": <torch optimizer state_dict, integer keyed>, ...}``;
- Ravex's portable layout ``{"model": sd, "optim": <keyed by parameter name>, ...}``;
- Lightning's ``{"state_dict": sd, "optimizer_states": [...], "global_step": n}``;
- any of these nested deeper, as ``dcp_to_torch_save`` writes the DCP recipe's
  ``{"app": {"model", "optim"}}``: found where the DCP reader finds them
  (:mod:`._nesting`).

Whichever it is, the reader records where the model and optimizer sat (and
whether the optimizer was keyed by position) as a ``StateLayout``, and the
writer puts them back there: a torch_save output of a torch_save source has the
source's keys, so the code that saved it loads it. ``layout="lightning"`` writes
Lightning's keys from any source (:data:`LIGHTNING`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._engine import page_residue
from .._layout import SOURCE_KEY, PathItem, StateLayout, layout_of, optimizer_tree, place, unflatten_optimizer
from .._output import Options, out_dtype
from .._paths import inside
from .._torchfile.archive import is_torch_zip, open_archive, verify_crcs
from .._torchfile.unpickle import TensorRef
from .._torchfile.write import STORAGE_TYPES, StorageOut, TensorOut, ZipLayout, dumps
from ..errors import CorruptCheckpointError, LayoutMismatchError, RavexError, UnknownFormatError
from ..info import NO_PARAM_MARKS, CheckpointInfo, FileInfo, TensorInfo
from ..model import MODEL, OBJ, OPTIM, Checkpoint, itemsize
from ..objects import key_of
from ..plan import OutFile, WritePlan, run
from ..storage import Location
from . import _nesting as state_tree
from .options import LAYOUT, WriteOptions, option
from .small_state import read_objects, tensor_chunk, to_pickle
from .torch_optimizer import add_param_state, check_optimizer, optimizer_info, saved_step

__all__ = ["LAYOUTS", "LIGHTNING", "SUFFIXES", "TorchSaveOptions", "describe", "find_model_and_optimizer", "read", "sniff"]

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
_OPTIM_KEYS = ("optim", "optimizer", "optimizer_state_dict")

# Lightning's Trainer.save_checkpoint: the model under "state_dict", one torch optimizer
# state dict per optimizer in "optimizer_states" (keyed by position), one scheduler
# state dict per scheduler in "lr_schedulers".
LIGHTNING = StateLayout(("state_dict",), ("optimizer_states", 0), optim_by_position=True)
_LIGHTNING_MARK = "pytorch-lightning_version"
# Written where the source is no Lightning checkpoint. Lightning migrates a checkpoint
# whose version is below a migration's (the last is 2.0.0's), and those migrations need
# keys (global_step, loops) that only Lightning itself saves; what is written here is
# the layout Lightning 2.x saves and loads.
_LIGHTNING_VERSION = "2.0.0"
# The layouts ``write`` takes: the source's own (where its reader recorded one), Ravex's
# portable {"model", "optim"}, Lightning's.
LAYOUTS = ("source", "portable", "lightning")


@dataclass(frozen=True)
class TorchSaveOptions(WriteOptions):
    """The options of a torch_save output: ``layout``, one of :data:`LAYOUTS`
    (None: the model and optimizer where the source had them, else the portable
    ``{"model", "optim"}``; ``"lightning"``: a ``.ckpt`` that Lightning's
    ``load_from_checkpoint`` loads)."""

    needs_param_groups: ClassVar[str | None] = ("torch's optimizer.load_state_dict replaces each param group by the saved one, "
                                                "so the optimizer would step without them")
    layout: str | None = option(None, LAYOUT)


def _candidates(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def _the_file(path: Path) -> Path:
    """The one torch.save file of a directory; a symbolic link out of it is refused."""
    return inside(path, _candidates(path)[0].name, "torch.save file", path)


def sniff(path: Path) -> list[str] | None:
    if path.is_file():
        if is_torch_zip(path):
            return [f"{path.name} is a torch.save zip archive"]
        if path.suffix in SUFFIXES:
            # Claim it so the user hears "corrupt" rather than "unknown format".
            return [f"{path.name} has a torch.save suffix (its contents are checked next)"]
        return None
    files = _candidates(path)
    if len(files) == 1 and is_torch_zip(files[0]):
        return [f"the directory holds one torch.save archive, {files[0].name}"]
    return None


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and all(
        isinstance(v, TensorRef) for v in obj.values()
    )


def find_model_and_optimizer(root: Any) -> tuple[str | None, dict[str, Any] | None, str | None, dict[str, Any] | None]:
    """(key of the model state dict or None for a bare one, the dict, key of the optimizer state, its dict)."""
    if _is_state_dict(root):
        return None, root, None, None
    if not isinstance(root, dict):
        return None, None, None, None
    model_key = next((k for k in _MODEL_KEYS if _is_state_dict(root.get(k))), None)
    optim_key = next((k for k in _OPTIM_KEYS if isinstance(root.get(k), dict) and ("state" in root[k] or unflatten_optimizer(root[k]))), None)
    optim = root[optim_key] if optim_key else None
    if optim is not None and "state" not in optim:
        optim = unflatten_optimizer(optim)  # torch.distributed.checkpoint's flatten_optimizer_state_dict form (torchtitan)
    states = root.get("optimizer_states")
    if optim is None and isinstance(states, list) and states and isinstance(states[0], dict):
        optim_key, optim = "optimizer_states[0]", states[0]
    return model_key, (root[model_key] if model_key else None), optim_key, optim


def _aliases(sd: dict[str, TensorRef]) -> dict[str, str]:
    first: dict[tuple[str, int, tuple[int, ...]], str] = {}
    out: dict[str, str] = {}
    for name, t in sd.items():
        key = (t.storage.key, t.storage_offset, t.shape)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _lightning_optimizers(states: Any, file: Path) -> CorruptCheckpointError | None:
    """Lightning's ``optimizer_states`` is a list of optimizer state dicts, one per
    optimizer; anything else is refused (the weights are still read)."""
    if isinstance(states, list) and all(isinstance(s, dict) for s in states):
        return None
    what = (f"a {type(states).__name__}" if not isinstance(states, list)
            else f"a list holding a {type(next(s for s in states if not isinstance(s, dict))).__name__}")
    return CorruptCheckpointError(
        f"{file}: a Lightning checkpoint whose 'optimizer_states' is {what}, not a list of optimizer state dicts "
        "(one per optimizer, as Trainer.save_checkpoint writes it)",
        hint="the file is damaged or was changed after Lightning saved it; convert the weights alone with --weights-only, "
             "or save the checkpoint again with Lightning",
        path=file,
    )


def _marked(ref: TensorRef) -> bool:
    """The file marks the entry a parameter (saved as an ``nn.Parameter`` or with requires_grad)."""
    return ref.is_parameter or ref.requires_grad


def describe(path: Path, reasons: list[str], param_names: list[str] | None = None) -> CheckpointInfo:
    """What :func:`read` finds, as ``inspect`` shows it (the pickle parsed once,
    no tensor byte read): the model entries with the kinds the file marks, the
    optimizer state keyed as the file keys it."""
    ckpt, found = _read(path, param_names, shallow=True)
    info = CheckpointInfo("torch_save", found.variant, str(path), world_size=1, step=ckpt.step, reasons=reasons)
    info.files = [FileInfo(found.file.name, found.file.stat().st_size, "state")]
    info.aliases = {a[len(MODEL):]: t[len(MODEL):] for a, t in ckpt.aliases.items() if a.startswith(MODEL)}
    # state_dict() detaches parameters, so a plain save records no flag: then
    # floating-point entries count as parameters (read's notes say so).
    marked = any(_marked(ref) for ref in found.sd.values())
    for name, ref in found.sd.items():
        t = ckpt.resolve(MODEL + name)
        param = _marked(ref) if marked else t.dtype.startswith(("float", "bfloat"))
        info.tensors.append(TensorInfo(name, t.shape, t.dtype, "param" if param else "other"))
    if found.optim is not None:
        info.optimizer, optim_tensors = optimizer_info(found.optim)
        info.tensors += optim_tensors
    info.notes = list(ckpt.notes)
    if found.model_key is not None:
        info.extra["model_key"] = found.model_key
        info.extra["optimizer_key"] = found.optim_key
    if found.nested:
        info.extra["state_layout"] = layout_of(ckpt.source).describe()
        info.reasons.append(f"model state dict at '{found.model_key}'" + (f", optimizer at '{found.optim_key}'" if found.optim_key else ""))
    if found.lightning is not None:
        extra = ckpt.objects.get("extra", {})
        info.extra["state_layout"] = layout_of(ckpt.source).describe()
        info.reasons.append(f"a PyTorch Lightning checkpoint ('{_LIGHTNING_MARK}' {found.lightning!r}): the model at 'state_dict', "
                            "the optimizers in 'optimizer_states'")
        info.extra["lightning"] = {"version": found.lightning, "optimizers": found.optimizers,
                                   "state": [k for k in extra if k != _LIGHTNING_MARK]}
    return info


def _embed(cands: list[str], shapes: list[tuple[int, ...] | None], sd: dict[str, TensorRef], used: set[str], reverse: bool) -> list[str] | None:
    """The earliest (or, with ``reverse``, latest) order-preserving match of a
    group's state shapes to unused model entries."""
    order = list(reversed(cands)) if reverse else cands
    wants = list(reversed(shapes)) if reverse else shapes
    out: list[str] = []
    pos = 0
    for want in wants:
        while pos < len(order) and (order[pos] in used or (want is not None and sd[order[pos]].shape != want)):
            pos += 1
        if pos >= len(order):
            return None
        out.append(order[pos])
        pos += 1
    return list(reversed(out)) if reverse else out


def _param_names_by_order(sd: dict[str, TensorRef], aliases: dict[str, str], optim: dict[str, Any],
                          param_names: list[str] | None, file: Path) -> dict[Any, str]:
    """torch's optimizer.state_dict() keys parameters by position in its param
    groups; the file does not say which parameter each position was. With
    ``param_names`` (the names in position order) that is given. Otherwise each
    group is matched, in order, to model entries whose shapes fit its state — and
    only when that match is the only one (buffers and frozen parameters can look
    like parameters); an ambiguous file is refused rather than guessed."""
    state = optim.get("state") or {}
    groups = [list(g.get("params", [])) for g in optim.get("param_groups") or []]
    ids = [pid for g in groups for pid in g]
    listed = [g.get("param_names") for g in optim.get("param_groups") or []]
    if param_names is None and listed and all(isinstance(n, list) and len(n) == len(g) for n, g in zip(listed, groups)):
        # torch's own names (an optimizer built from named_parameters(), or Ravex's output of --param-names)
        saved = [n for names in listed if isinstance(names, list) for n in names]
        if all(isinstance(n, str) and n in sd for n in saved):
            return dict(zip(ids, saved))
    hint = ("`ravex convert` takes the parameter names in optimizer order (--param-names FILE: one name per line, group after group); "
            "or save the optimizer keyed by name (torch.distributed.checkpoint.state_dict.get_state_dict); "
            "or leave the optimizer state out (--weights-only, for convert and verify)")
    if param_names is not None:
        if len(param_names) != len(ids):
            raise LayoutMismatchError(f"{file}: --param-names lists {len(param_names)} names; the optimizer state has {len(ids)} parameters", hint=hint)
        missing = [n for n in param_names if n not in sd]
        if missing:
            raise LayoutMismatchError(f"{file}: --param-names names '{missing[0]}', which is not in the model state dict", hint=hint)
        return dict(zip(ids, param_names))
    candidates = [n for n in sd if n not in aliases]
    used: set[str] = set()
    out: dict[Any, str] = {}
    for g in groups:
        shapes: list[tuple[int, ...] | None] = []
        for pid in g:
            per = state.get(pid)
            ref = next((v for k, v in per.items() if k != "step" and isinstance(v, TensorRef)), None) if isinstance(per, dict) else None
            shapes.append(ref.shape if ref is not None else None)
        early = _embed(candidates, shapes, sd, used, reverse=False)
        late = _embed(candidates, shapes, sd, used, reverse=True)
        if early is None or late is None:
            raise LayoutMismatchError(f"{file}: the optimizer state keys parameters by position, and its shapes do not match the model's entries in order", hint=hint)
        if early != late:
            diff = next(i for i, (x, y) in enumerate(zip(early, late)) if x != y)
            raise LayoutMismatchError(
                f"{file}: the optimizer state keys parameters by position, and position {g[diff]} could be '{early[diff]}' or '{late[diff]}' "
                "(a plain state dict does not mark which entries are buffers)",
                hint=hint,
            )
        out.update(zip(g, early))
        used.update(early)
    return out


@dataclass
class _Found:
    """Where the file keeps what :func:`read` took, for :func:`describe`."""

    file: Path
    variant: str  # state_dict (a bare one) | model | training_state
    model_key: str | None
    sd: dict[str, TensorRef]
    optim_key: str | None
    optim: dict[str, Any] | None
    lightning: str | None = None  # the pytorch-lightning_version of a Lightning checkpoint
    optimizers: int = 0  # how many optimizers it holds
    model_at: tuple[PathItem, ...] = ()  # where the model sits in the file's tree (): the top level
    optim_at: tuple[PathItem, ...] | None = None  # where the optimizer sits; None: no optimizer
    nested: bool = False  # found below the top level's keys (by _nesting)


def _find(file: Path, root: Any) -> _Found:
    """Where the model and optimizer sit: under the top level's keys, else
    nested (``{"app": {"model", "optim"}}``, at any depth), else nowhere: refused."""
    model_key, sd, optim_key, optim = find_model_and_optimizer(root)
    if sd is not None:
        optim_at = LIGHTNING.optim if optim_key == "optimizer_states[0]" else (optim_key,) if optim_key is not None else None
        variant = "state_dict" if model_key is None else ("training_state" if optim is not None else "model")
        return _Found(file, variant, model_key, sd, optim_key, optim, model_at=(model_key,) if model_key is not None else (), optim_at=optim_at)
    nested = state_tree.find(root) if isinstance(root, dict) else None  # a state tree's top level is a dict, as DCP's
    if nested is None:
        where = (f", at the top level ({', '.join(repr(k) for k in list(root)[:8])}) or nested below it" if isinstance(root, dict) and root
                 else " (it holds an empty dict)" if isinstance(root, dict) else f" (it holds a {type(root).__name__}, not a dict)")
        raise UnknownFormatError(
            f"{file}: a torch.save file, but no model state dict found in it{where}",
            hint="Ravex reads a bare state dict, a dict with one of the keys " + ", ".join(_MODEL_KEYS) + ", or such a dict nested at "
                 "any depth (as dcp_to_torch_save writes {'app': {'model': ..., 'optim': ...}}); save the model's state_dict() in one of these",
            path=file,
        )
    optim_at = nested.optim
    if optim_at is not None:
        optim = state_tree.at(root, optim_at)
        optim = unflatten_optimizer(optim) if nested.optim_flat else optim
        optim_at = optim_at if optim is not None else None
    return _Found(file, "training_state" if optim is not None else "model", state_tree.dotted(nested.model), nested.sd,
                  state_tree.dotted(optim_at) if optim_at is not None else None, optim, model_at=nested.model, optim_at=optim_at, nested=True)


def _read(path: Path, param_names: list[str] | None = None, *, shallow: bool = False) -> tuple[Checkpoint, _Found]:
    """The one parse of the file. ``shallow`` (for describe): no byte of
    tensor data is read (no CRC pass; a strided view is left without its
    chunk, instead of gathered), so the result says what the file holds but is
    not for converting."""
    file = path if path.is_file() else _the_file(path)
    archive = open_archive(file)
    root = archive.root
    found = _find(file, root)
    model_key, sd, optim_key, optim = found.model_key, found.sd, found.optim_key, found.optim
    if optim is not None:
        check_optimizer(optim, optim_key, file)
    ckpt = Checkpoint("torch_save", file, world_size=1, step=saved_step(archive, root, optim))
    lightning = isinstance(root, dict) and not found.nested and model_key == "state_dict" and (_LIGHTNING_MARK in root or "optimizer_states" in root)
    more: list[Any] = []  # a Lightning checkpoint's second, third, ... optimizer
    if lightning:
        found.lightning = str(root.get(_LIGHTNING_MARK, "unknown"))
        bad = _lightning_optimizers(root.get("optimizer_states", []), file)
        if bad is not None:
            ckpt.source["optimizer_error"] = bad  # the weights are fine; convert and verify of the rest raise this
            ckpt.notes.append(f"optimizer state left out: {bad.message}")
        elif optim_key == "optimizer_states[0]":
            more = root["optimizer_states"][1:]
            for i, other in enumerate(more, 1):
                check_optimizer(other, f"optimizer_states[{i}]", file)
            found.optimizers = 1 + len(more)
    if not any(_marked(ref) for ref in sd.values()):
        ckpt.notes.append(NO_PARAM_MARKS)
    state = (optim.get("state") or {}) if optim is not None else {}
    by_index = any(isinstance(k, int) for k in state)
    if by_index:
        ckpt.notes.append("optimizer state is keyed by parameter index (torch's optimizer.state_dict()); names come from parameter order")
    if model_key is not None:
        # Where the model and optimizer sat (and how the optimizer was keyed): a torch_save output puts them back there,
        # so the code that saved the file loads the output (a flattened optimizer, as a torchtitan DCP written out as
        # torch.save, stays flattened).
        optim_at = found.optim_at
        flat = optim_at is not None and optim_at != LIGHTNING.optim and "state" not in state_tree.at(root, optim_at)
        where = LIGHTNING.optim if lightning and optim_at is None else optim_at or ("optim",)
        ckpt.source[SOURCE_KEY] = StateLayout(found.model_at, where, flat, by_index, by_index and param_names is not None).to_json()
    if not shallow:
        verify_crcs(archive)  # every storage's bytes against the CRC-32 torch.save recorded (RAVEX_NO_CRC=1 skips)
    aliases = _aliases(sd)
    for name, ref in sd.items():
        if name in aliases:
            ckpt.aliases[MODEL + name] = MODEL + aliases[name]
        else:
            ckpt.add(tensor_chunk(archive, ref, MODEL + name, shallow))
    if optim is not None:
        try:
            names = _param_names_by_order(sd, aliases, optim, param_names, file) if by_index else {k: k for k in state}
        except LayoutMismatchError as exc:
            # The weights are fine; only the optimizer state cannot be named.
            # Whoever needs it (convert without --weights-only, verify) raises this.
            ckpt.source["optimizer_error"] = exc
            ckpt.notes.append(f"optimizer state left out: {exc.message}")
            names = {}
        for key, per in state.items():
            fqn = names.get(key)
            if fqn is None or not isinstance(per, dict):
                continue
            add_param_state(ckpt, archive, fqn, per, shallow)
        groups = []
        for g in optim.get("param_groups") or []:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [names.get(p, p) for p in g.get("params", [])]
            groups.append(g2)
        ckpt.objects["optim.param_groups"] = groups
    for i, other in enumerate(more, 1):
        # kept whole, as saved (keyed by position), under the objects key of a further optimizer
        ckpt.objects[f"optimizer.{i}"] = read_objects(archive, other, ckpt, f"{OBJ}optimizer.{i}", shallow)
    if isinstance(root, dict) and model_key is not None:  # a bare state dict is all model
        # the rest, at its nesting (a nested model's dict goes with its last entry; Lightning's list of optimizers whole)
        taken = [(*found.model_at, name) for name in sd] if found.nested else [found.model_at]
        if found.optim_at is not None:
            taken.append(found.optim_at[:1] if found.optim_at == LIGHTNING.optim else found.optim_at)
        for key, value in (state_tree.pruned(root, taken) or {}).items():
            ckpt.objects.setdefault("extra", {})[str(key)] = read_objects(archive, value, ckpt, f"{OBJ}{key}", shallow)
    return ckpt, found


def read(path: Path, param_names: list[str] | None = None) -> Checkpoint:
    """The file's model state dict as ``model/<name>`` (tied entries as aliases),
    its optimizer state as ``optim/<state>/<name>`` (position keys named by
    ``param_names`` or by matching shapes in order; where that is ambiguous the
    weights are read and ``source["optimizer_error"]`` says why the optimizer
    state is not), and the other top-level entries as ``objects["extra"]``.
    Every storage's CRC-32 is checked first (RAVEX_NO_CRC=1 skips it)."""
    return _read(path, param_names)[0]


def _nesting(ckpt: Checkpoint, layout: str | None) -> StateLayout:
    if layout in (None, "source"):
        return layout_of(ckpt.source)
    if layout == "portable":
        return StateLayout()
    if layout == "lightning":
        return LIGHTNING
    raise RavexError(f"--layout {layout}: not a torch_save layout", hint=f"use one of {', '.join(LAYOUTS)}")


def _lightning_keys(ckpt: Checkpoint, root: dict[str, Any], outs: dict[str, TensorOut], notes: list[str]) -> set[str]:
    """Lightning's keys for a checkpoint another program wrote; the objects keys they
    took. ``load_from_checkpoint`` reads ``state_dict`` and the version;
    ``Trainer.fit(ckpt_path=...)`` also ``optimizer_states`` and ``lr_schedulers``
    (a KeyError without them) and, to continue its count of steps and epochs,
    ``loops``, which only Lightning writes (and which is not made up here)."""
    root[_LIGHTNING_MARK] = _LIGHTNING_VERSION
    if ckpt.step is not None:
        root["global_step"] = ckpt.step
    named = sorted((k for k in ckpt.objects if (found := key_of(k)) is not None and found.name.startswith("lr_scheduler")),
                   key=lambda k: 0 if k == "lr_scheduler" else int(k.rpartition(".")[2]))
    if named:
        root["lr_schedulers"] = [to_pickle(ckpt.objects[k], outs) for k in named]
    has_optim = "optimizer_states" in root
    resumes = "would restore the weights, optimizer and scheduler but count steps and epochs from 0" if has_optim and named else \
        "cannot resume from it (it needs optimizer_states and lr_schedulers)"
    notes.append(f"written in Lightning's layout (state_dict{', optimizer_states' if has_optim else ''}{', lr_schedulers' if named else ''}, "
                 f"{_LIGHTNING_MARK} '{_LIGHTNING_VERSION}'): LightningModule.load_from_checkpoint loads it; the source holds no "
                 f"Lightning loop state (loops), so Trainer.fit(ckpt_path=...) {resumes}")
    return set(named)


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options, layout: str | None = None) -> WritePlan:
    """One ``torch.save`` file that ``torch.load(weights_only=True)`` reads, tied
    names all present, sharing one storage. ``layout``: ``"source"`` (None) puts
    the model and optimizer where the source's reader recorded them (a torch.save
    source's own keys, a position-keyed optimizer keyed by position again, a DCP
    source's nesting), else in the portable layout ``{"model", "optim", ...}``
    (optimizer state keyed by parameter name, as get_state_dict returns it);
    ``"portable"`` always that; ``"lightning"`` Lightning's keys (:data:`LIGHTNING`)."""
    nesting = _nesting(ckpt, layout)
    notes: list[str] = []
    layout_out = ZipLayout("archive")
    storages: dict[str, StorageOut] = {}
    outs: dict[str, TensorOut] = {}
    for i, (name, t) in enumerate(ckpt.tensors.items()):
        dtype = out_dtype(t, opts)
        if dtype not in STORAGE_TYPES:
            raise RavexError(f"tensor '{name}' has dtype {dtype}, which Ravex cannot write to torch.save yet")
        storages[name] = StorageOut(str(i), dtype, t.numel)
        outs[name] = TensorOut(storages[name], t.shape)
    for alias, target in ckpt.aliases.items():
        outs[alias] = outs[target]
    root: dict[str, Any] = {}
    model = OrderedDict((n[len(MODEL):], outs[n]) for n in list(ckpt.tensors) + list(ckpt.aliases) if n.startswith(MODEL))
    place(root, nesting.model, model)
    optim_state: dict[str, dict[str, Any]] = {}
    for n in ckpt.tensors:
        if n.startswith(OPTIM):
            _, state, fqn = n.split("/", 2)
            optim_state.setdefault(fqn, {})[state] = outs[n]
    if optim_state or "optim.param_groups" in ckpt.objects:
        try:
            tree = optimizer_tree(nesting, optim_state, to_pickle(ckpt.objects.get("optim.param_groups", []), outs))
        except ValueError as exc:
            raise LayoutMismatchError(f"{ckpt.path}: cannot key the optimizer state by position: {exc}",
                                      hint="write it keyed by name: --layout portable") from None
        place(root, nesting.optim, tree)
    extra = ckpt.objects.get("extra")
    taken: set[str] = set()
    if layout == "lightning" and not (isinstance(extra, dict) and _LIGHTNING_MARK in extra):
        taken = _lightning_keys(ckpt, root, outs, notes)  # a Lightning source has its own keys in extra
    # A list of optimizers (Lightning's): the further ones (objects "optimizer.<i>") follow the first.
    listed = nesting.optim[:-1] if nesting.optim and isinstance(nesting.optim[-1], int) else None
    for key, value in ckpt.objects.items():
        if key == "optim.param_groups" or key in taken:
            continue
        schema = key_of(key)
        if key == "extra" and isinstance(value, dict):
            for k, v in value.items():  # a torch.save source's own top-level keys go back to the top
                place(root, (str(k),), to_pickle(v, outs))
        elif listed is not None and schema is not None and schema.name == "optimizer.<i>":
            place(root, (*listed, int(nesting.optim[-1]) + int(key.rpartition(".")[2])), to_pickle(value, outs))
        else:
            root[key] = to_pickle(value, outs)
    if ckpt.step is not None and nesting.portable:
        root.setdefault("step", ckpt.step)  # a source's own layout keeps its own step keys, and no other
    pickle_bytes = dumps(root)
    records: list[tuple[str, int, int | None]] = []
    for name, s in storages.items():
        t = ckpt.tensors[name]
        found = page_residue(t, t.whole(), s.dtype)  # same page offset as the source: whole-page copies
        records.append((s.key, s.numel * itemsize(s.dtype), found[0] if found else None))
    data_entries = layout_out.add_torch_save(pickle_bytes, records)
    entries = {name: layout_out.entries[i] for name, i in zip(storages, data_entries, strict=True)}
    out = OutFile("", layout_out.size, small=layout_out.small(), crc_ranges=layout_out.ranges(), finish=layout_out.late)
    out.fills = [(t, entries[name].data_offset, t.whole(), storages[name].dtype) for name, t in ckpt.tensors.items()]
    summary = {"files": [dst.name], "tensors": len(ckpt.tensors), "bytes": layout_out.total}
    if notes:
        summary["notes"] = notes
    return WritePlan(False, [out], summary=summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Any = None, *, layout: str | None = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    return run(plan_write(ckpt, dst, opts, layout), dst, force=opts.force, progress=progress)
