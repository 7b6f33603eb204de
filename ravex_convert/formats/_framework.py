"""What the framework directory layouts share (an HF Trainer ``checkpoint-N``,
an Accelerate ``save_state`` directory): a directory of files, each written by
its own ``torch.save`` or ``save_file`` call.

- **Carried files.** Every file Ravex does not parse (RNG pickles, which hold
  numpy state; ``training_args.bin``, a pickled Python class; tokenizer and
  config files; a second model) is read as its bytes: one ``uint8`` logical
  tensor ``obj/files/<name>`` located in the file, linked from
  ``objects["extra"]["files"]``. Nothing in it is unpickled, so nothing in it
  runs; a writer of the same layout puts the file back byte for byte, and any
  other target keeps the bytes (a store, DCP and torch.save carry ``obj/``
  tensors), so a round trip loses none of them.
- **A position-keyed optimizer.** ``optimizer.state_dict()`` keys parameters by
  position across its groups; the file does not name them. The names come from
  whoever knows the order (``--param-names``, or the architecture a layout can
  rebuild) and are checked against the model's shapes before any is used.
- **Writing.** :func:`torch_file` lays out one ``torch.save`` archive (the zip
  records torch writes, the tensors' bytes copied by the executor);
  :func:`carried_files` puts the carried files back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from .._engine import page_residue
from .._layout import by_position
from .._output import Options, out_dtype
from .._paths import inside
from .._torchfile.archive import TorchArchive, open_archive, verify_crcs
from .._torchfile.unpickle import TensorRef
from .._torchfile.write import STORAGE_TYPES, StorageOut, TensorOut, ZipLayout, dumps
from ..errors import LayoutMismatchError, RavexError
from ..model import MODEL, OBJ, OPTIM, Box, Checkpoint, Chunk, LogicalTensor, TensorLink, itemsize
from ..plan import OutFile
from .small_state import read_objects, to_pickle
from .torch_optimizer import add_param_state, check_optimizer

__all__ = ["FILES", "carried_files", "carry", "carry_rest", "name_positions", "names_by_shape", "optimizer_file", "optimizer_tensors", "position_keyed", "positional_optimizer",
           "read_optimizer", "read_small", "small_file", "torch_file", "training_files"]

FILES = "files"  # objects["extra"][FILES]: file name -> TensorLink of its bytes
_PREFIX = f"{OBJ}{FILES}/"


def carry(ckpt: Checkpoint, directory: Path, names: Iterable[str]) -> list[str]:
    """Each named file of ``directory`` as its bytes (nothing parsed); the names carried."""
    files: dict[str, Any] = ckpt.objects.setdefault("extra", {}).setdefault(FILES, {})
    carried: list[str] = []
    for name in names:
        f = inside(directory, name, "file", directory)
        size = f.stat().st_size
        t = LogicalTensor(_PREFIX + name, (size,), "uint8")
        t.chunks.append(Chunk(Box((0,), (size,)), "uint8", f, 0) if size else Chunk(Box((0,), (0,)), "uint8", data=b""))
        ckpt.add(t)
        files[name] = TensorLink(t.name)
        carried.append(name)
    return carried


def carried_files(ckpt: Checkpoint, skip: Iterable[str] = ()) -> list[OutFile]:
    """The carried files, put back byte for byte (but those named in ``skip``,
    which the writer makes itself)."""
    links = (ckpt.objects.get("extra") or {}).get(FILES) or {}
    out: list[OutFile] = []
    for name, link in links.items():
        if name in skip or not isinstance(link, TensorLink) or link.name not in ckpt.tensors:
            continue
        if "/" in name or name in ("", ".", ".."):
            raise RavexError(f"{ckpt.path}: a carried file is named '{name}', which is not a plain file name",
                             hint="the checkpoint was changed after Ravex read it; read it again from the framework's directory", path=ckpt.path)
        t = ckpt.tensors[link.name]
        f = OutFile(name, t.numel)
        if t.numel:
            f.fills.append((t, 0, t.whole(), "uint8"))
        out.append(f)
    return out


def carry_rest(ckpt: Checkpoint, directory: Path, parsed: Collection[str], own_dirs: Collection[str] = ()) -> None:
    """Every file of ``directory`` not in ``parsed`` carried (:func:`carry`), and
    notes saying which, and which directories (but ``own_dirs``, read already) were not read."""
    rest = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in parsed)
    skipped = sorted(p.name for p in directory.iterdir() if not p.is_file() and p.name not in own_dirs)
    carry(ckpt, directory, rest)
    if rest:
        ckpt.notes.append(f"carried as bytes, not parsed: {', '.join(rest)}")
    if skipped:
        ckpt.notes.append(f"not read (directories): {', '.join(skipped)}")


def read_small(file: Path, ckpt: Checkpoint, prefix: str, *, shallow: bool = False) -> Any:
    """A small torch.save file (a scheduler's or scaler's state dict) as plain
    values, any tensor in it moved out to an ``obj/`` logical tensor (``shallow``:
    for ``inspect``, no CRC pass)."""
    archive = open_archive(file)
    if not shallow:
        verify_crcs(archive)
    return read_objects(archive, archive.root, ckpt, prefix, shallow)  # the same walk the torch_save reader does


def position_keyed(optim: dict[str, Any]) -> list[int]:
    """The parameter positions of a torch optimizer state dict, group after group."""
    return [p for g in optim.get("param_groups") or [] for p in g.get("params", [])]


def read_optimizer(ckpt: Checkpoint, archive: TorchArchive, names: list[str] | None, unnamed: str, *, shallow: bool = False) -> dict[str, Any]:
    """``optimizer.state_dict()`` saved with torch.save, into ``ckpt`` as
    ``optim/<state>/<name>`` and ``objects["optim.param_groups"]`` (names in
    place of positions). ``names``: the parameter names in position order, or
    None, when ``unnamed`` says why there are none: the weights are still read,
    and ``source["optimizer_error"]`` stops whoever needs the optimizer state.
    ``archive``: the file, opened (once) by the caller. Returns the optimizer
    state dict as the restricted unpickler read it."""
    file = archive.path
    optim = archive.root
    check_optimizer(optim, file.name, file)
    if not shallow:
        verify_crcs(archive)
    state = optim.get("state") or {}
    ids = position_keyed(optim)
    try:
        by_id = name_positions(ckpt, file, optim, ids, names, unnamed)
    except LayoutMismatchError as exc:
        ckpt.source["optimizer_error"] = exc
        ckpt.notes.append(f"optimizer state left out: {exc.message}")
        return dict(optim)
    for key, per in state.items():
        fqn = by_id.get(key)
        if fqn is not None:
            add_param_state(ckpt, archive, fqn, per, shallow)
    ckpt.objects["optim.param_groups"] = [{**{k: v for k, v in g.items() if k != "params"}, "params": [by_id[p] for p in g.get("params", [])]}
                                          for g in optim.get("param_groups") or []]
    return dict(optim)


def name_positions(ckpt: Checkpoint, file: Path, optim: dict[str, Any], ids: list[Any], names: list[str] | None, unnamed: str) -> dict[Any, str]:
    """Position -> parameter name, every one checked: as many names as
    positions, each a model tensor of ``ckpt``, and each position's state
    tensors shaped as that tensor."""
    hint = ("pass the parameter names in optimizer order (--param-names FILE: one name per line, group after group; "
            "the training script can write it: `names = {id(p): n for n, p in model.named_parameters()}`, then "
            "`[names[id(p)] for g in optimizer.param_groups for p in g['params']]`), or convert the weights alone with --weights-only")
    if names is None:
        raise LayoutMismatchError(f"{file}: the optimizer state keys parameters by position, and {unnamed}", hint=hint, path=file)
    if len(names) != len(ids):
        raise LayoutMismatchError(f"{file}: {len(names)} parameter names for an optimizer state of {len(ids)} parameters", hint=hint, path=file)
    state = optim.get("state") or {}
    for pid, name in zip(ids, names, strict=True):
        t = ckpt.resolve(MODEL + name) if MODEL + name in ckpt.tensors or MODEL + name in ckpt.aliases else None
        if t is None:
            raise LayoutMismatchError(f"{file}: position {pid} is named '{name}', which the model weights do not hold", hint=hint, path=file)
        for sname, value in (state.get(pid) or {}).items():
            if isinstance(value, TensorRef) and value.numel > 1 and value.shape != t.shape:
                raise LayoutMismatchError(
                    f"{file}: position {pid} is named '{name}', of shape {list(t.shape)}, but its '{sname}' has shape {list(value.shape)}",
                    hint=hint, path=file)
    return dict(zip(ids, names, strict=True))


def names_by_shape(ckpt: Checkpoint, optim: dict[str, Any]) -> tuple[list[str] | None, str]:
    """Position -> name where shapes alone decide it: each position's state is
    shaped as exactly one model tensor, a different one for every position. Not
    a guess: two tensors of one shape make it refuse, and why is returned."""
    state = optim.get("state") or {}
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for n, t in ckpt.tensors.items():
        if n.startswith(MODEL):
            by_shape.setdefault(t.shape, []).append(n[len(MODEL):])
    names: list[str] = []
    for pid in position_keyed(optim):
        ref = next((v for v in (state.get(pid) or {}).values() if isinstance(v, TensorRef) and v.numel > 1), None)
        if ref is None:
            return None, f"position {pid} holds no state tensor to tell its shape by"
        held = by_shape.get(ref.shape, [])
        if len(held) != 1:
            shown = ", ".join(f"'{h}'" for h in held[:3]) + (", ..." if len(held) > 3 else "")
            return None, (f"{len(held)} model tensors have position {pid}'s shape {list(ref.shape)}" + (f" ({shown})" if held else "")
                          + ", so shapes cannot name the positions")
        names.append(held[0])
    if len(set(names)) != len(names):
        return None, "two positions have the shape of one model tensor"
    return names, "names by shape (every position's shape is one model tensor's)"


def optimizer_tensors(ckpt: Checkpoint) -> tuple[dict[str, dict[str, LogicalTensor]], list[dict[str, Any]]]:
    """The optimizer state by parameter name (``{fqn: {state: tensor}}``, in
    the checkpoint's order) and its param groups; refused when there is state
    but no groups to give it positions."""
    per: dict[str, dict[str, LogicalTensor]] = {}
    for n, t in ckpt.tensors.items():
        if n.startswith(OPTIM):
            _, sname, fqn = n.split("/", 2)
            per.setdefault(fqn, {})[sname] = t
    groups = ckpt.objects.get("optim.param_groups")
    if per and not isinstance(groups, list):
        raise RavexError(f"{ckpt.path}: the optimizer state has no param groups, so its positions cannot be written",
                         hint="convert the weights alone (--weights-only), or from a checkpoint that records the optimizer's groups",
                         path=ckpt.path)
    return per, list(groups or [])


def torch_file(rel: str, tensors: list[LogicalTensor], root: Callable[[dict[str, TensorOut]], Any], opts: Options) -> OutFile:
    """One torch.save archive holding ``root(outs)``, where ``outs`` maps each
    of ``tensors`` to the tensor the pickle names (one storage each); the
    executor copies their bytes into place."""
    layout = ZipLayout("archive")
    storages: dict[str, StorageOut] = {}
    outs: dict[str, TensorOut] = {}
    for i, t in enumerate(tensors):
        dtype = out_dtype(t, opts)
        if dtype not in STORAGE_TYPES:
            raise RavexError(f"tensor '{t.name}' has dtype {dtype}, which Ravex cannot write to torch.save yet")
        storages[t.name] = StorageOut(str(i), dtype, t.numel)
        outs[t.name] = TensorOut(storages[t.name], t.shape)
    pickle_bytes = dumps(root(outs))
    records: list[tuple[str, int, int | None]] = []
    for t in tensors:
        s = storages[t.name]
        found = page_residue(t, t.whole(), s.dtype)
        records.append((s.key, s.numel * itemsize(s.dtype), found[0] if found else None))
    entries = layout.add_torch_save(pickle_bytes, records)
    out = OutFile(rel, layout.size, small=layout.small(), crc_ranges=layout.ranges(), finish=layout.late)
    out.fills = [(t, layout.entries[e].data_offset, t.whole(), storages[t.name].dtype) for t, e in zip(tensors, entries, strict=True)]
    return out


def positional_optimizer(ckpt: Checkpoint, outs: dict[str, TensorOut]) -> dict[str, Any]:
    """The optimizer state dict as ``optimizer.state_dict()`` writes it: state
    and ``params`` keyed by position, group after group (``_layout.by_position``)."""
    per, groups = optimizer_tensors(ckpt)
    extra_state = ckpt.objects.get("optim.state")
    state: dict[str, dict[str, Any]] = {fqn: {s: outs[t.name] for s, t in states.items()} for fqn, states in per.items()}
    for fqn, values in (extra_state.items() if isinstance(extra_state, dict) else ()):
        if isinstance(values, dict):
            state.setdefault(fqn, {}).update(values)
    try:
        return by_position(state, groups)
    except ValueError as exc:
        raise RavexError(f"{ckpt.path}: {exc}", hint="the checkpoint's param groups do not match its state; convert the weights alone with --weights-only",
                         path=ckpt.path) from None


def optimizer_file(rel: str, ckpt: Checkpoint, opts: Options) -> OutFile | None:
    """``rel`` as torch.save of the position-keyed optimizer state dict; None when there is none."""
    per, _ = optimizer_tensors(ckpt)
    if not per:
        return None
    tensors = [t for states in per.values() for t in states.values()]
    return torch_file(rel, tensors, lambda outs: positional_optimizer(ckpt, outs), opts)


def training_files(ckpt: Checkpoint, optimizer: str, scheduler: str, opts: Options) -> list[OutFile]:
    """``optimizer`` (the position-keyed optimizer state dict) and ``scheduler``
    (``objects["lr_scheduler"]``) as torch.save files, those the checkpoint has."""
    files: list[OutFile] = []
    opt = optimizer_file(optimizer, ckpt, opts)
    if opt is not None:
        files.append(opt)
    sched = ckpt.objects.get("lr_scheduler")
    if isinstance(sched, dict):
        files.append(small_file(scheduler, ckpt, sched, opts))
    return files


def small_file(rel: str, ckpt: Checkpoint, value: Any, opts: Options) -> OutFile:
    """``rel`` as torch.save of ``value`` (a scheduler's state dict), its tensor links resolved."""
    links: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, TensorLink):
            links.append(v.name)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    tensors = [ckpt.tensors[n] for n in dict.fromkeys(links) if n in ckpt.tensors]
    return torch_file(rel, tensors, lambda outs: to_pickle(value, outs), opts)
