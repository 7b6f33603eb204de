"""Writing DeepSpeed ZeRO checkpoints (stage 1, 2, 3; fp32 or bf16) that
DeepSpeed's own ``engine.load_checkpoint(dir)`` resumes at the chosen world
size, with no universal-checkpoint step.

The output is what DeepSpeed 0.19.8's ``save_checkpoint`` writes at world size N
(``Options.world_size``), field by field (zero.py's docstring and
fixtures/README.md describe the files):

- ``latest`` (the tag, no newline) and ``<tag>/``;
- ``<tag>/mp_rank_00_model_states.pt`` (stage 1/2) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3): ``module``
  (the state dict: params in the working dtype, cast from the fp32 masters;
  under stage 3 empty placeholders), ``buffer_names``, ``param_shapes`` (one
  dict per flat tensor: per param group, under stage 3 per sub-group),
  frozen parameters (stage 2: whole; stage 3: each rank's piece), ``shared_params``,
  ``lr_scheduler``, ``global_steps``, ``dp_world_size`` = N, ``ds_config``, ...;
- ``<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: rank r's fp32
  master partition and the optimizer state of its flat tensors (one per param
  group for stage 1/2, one per sub-group for stage 3), the group
  hyper-parameters, and DeepSpeed's bookkeeping (paddings, partition counts,
  ``param_slice_mappings``, the loss scaler, the stage).

What DeepSpeed reads back on load (``_load_checkpoint``, ``_load_zero_checkpoint``,
``stage_1_and_2._load_legacy_checkpoint``, ``stage3._rigid_load_state_dict``):
``module`` strictly into the model, ``frozen_param_fragments`` by name for every
frozen parameter (stage 2/3), ``dp_world_size`` (must equal the world size it
runs at), ``lr_scheduler``, ``global_steps``, ``skipped_steps``; from each
rank's optimizer file the torch optimizer state dict (param groups, per flat
tensor state), the fp32 partitions, ``loss_scaler`` (a real ``LossScaler``: it
is used), ``dynamic_loss_scale``, ``overflow``, ``ds_version``, and
``clip_grad``, which *overrides* the engine's configured clipping (so it is
left out when the source does not say, and the engine's config stands).

Tensor bytes are never loaded in Python: each target file is planned as a zip
archive and the Rust executor copies (and casts: fp32 masters -> bf16 module
weights) every piece in place. The pickles name DeepSpeed's classes without
importing DeepSpeed (``PickleObject``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._output import Options
from ..._torchfile.write import PickleObject, TensorOut
from ...errors import RavexError
from ...model import MODEL, Box, Checkpoint, Flat, TensorLink, itemsize
from ...plan import OutFile, WritePlan, run
from ...storage import Location
from . import reader as zero
from .layout import Piece, stage3_partition
from .write_layout import ArchiveOut, FlatGroup, Stage3Layout, archive_files, by_rank, plan_flat_group, plan_stage3
from .write_plan import DS_VERSION, PRECISIONS, SUB_GROUP_SIZE, Group, Param, Plan, find, make_plan

__all__ = ["DS_VERSION", "PRECISIONS", "write"]


def _loss_scaler() -> PickleObject:
    # What DeepSpeed keeps without fp16: a static LossScaler at scale 1.0.
    return PickleObject("deepspeed.runtime.fp16.loss_scaler", "LossScaler", (), {"cur_scale": 1.0, "dynamic": False}, newobj=True)


def _stage_enum(stage: int) -> PickleObject:
    return PickleObject("deepspeed.runtime.zero.config", "ZeroStageEnum", (stage,))


def _size(shape: tuple[int, ...]) -> PickleObject:
    return PickleObject("torch", "Size", (tuple(shape),))


def _address(n: int, start: int) -> PickleObject:
    return PickleObject("deepspeed.utils.tensor_fragment", "fragment_address", (), {"numel": n, "start": start}, newobj=True)


# ----------------------------------------------------------------------------
# The files


def _objects(value: Any, ckpt: Checkpoint, archive: ArchiveOut, cache: dict[str, TensorOut]) -> Any:
    """Small state with its ``TensorLink`` s turned into tensors of ``archive``."""
    if isinstance(value, TensorLink):
        if value.name not in cache:
            t = find(ckpt, value.name)
            if t is None:
                raise RavexError(f"the state names tensor '{value.name}', which is not in the checkpoint")
            cache[value.name] = out = archive.tensor(t.dtype, t.shape)
            archive.fill(out, t.name, t.whole())
        return cache[value.name]
    if isinstance(value, dict):
        return type(value)((k, _objects(v, ckpt, archive, cache)) for k, v in value.items())
    if isinstance(value, list):
        return [_objects(v, ckpt, archive, cache) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects(v, ckpt, archive, cache) for v in value)
    return value


def _model_states(plan: Plan, ckpt: Checkpoint, relpath: str, rank: int, shapes: list[OrderedDict[str, Any]]) -> ArchiveOut:
    a = ArchiveOut(relpath)
    ws = plan.world_size
    outs: dict[str, TensorOut] = {}

    def entry(stored: str) -> TensorOut:
        if stored not in outs:
            kind = plan.kinds[stored]
            logical = MODEL + stored
            t = ckpt.tensors[logical]
            dtype = plan.entry_dtype(stored, ckpt)
            if plan.stage == 3 and kind in ("param", "frozen"):
                outs[stored] = a.tensor(dtype, (0,))  # ZeRO-3 saves parameters as empty placeholders
            else:
                outs[stored] = a.tensor(dtype, t.shape)
                a.fill(outs[stored], logical, t.whole())
        return outs[stored]

    module = OrderedDict((n, entry(plan.sources[n][len(MODEL):])) for n in plan.order)
    frozen = [n for n in plan.order if n not in plan.shared and plan.kinds.get(n) in (("frozen",) if plan.stage == 3 else ("frozen", "either"))]
    buffers = [n for n in plan.order if plan.kinds[plan.sources[n][len(MODEL):]] in (("buffer", "either") if plan.stage == 1 else ("buffer",))]
    fragments: OrderedDict[str, TensorOut] | None = None
    if plan.stage == 2:
        fragments = OrderedDict((n, outs[n]) for n in frozen)
    elif plan.stage == 3:
        fragments = OrderedDict()
        for n in frozen:
            t = ckpt.tensors[MODEL + n]
            p = stage3_partition(t.numel, ws)
            piece = a.tensor(plan.entry_dtype(n, ckpt), (p,))
            length = max(0, min(p, t.numel - rank * p))
            a.fill(piece, t.name, Flat(rank * p, length))
            fragments[n] = piece
    cache: dict[str, TensorOut] = {}
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None if plan.stage == 1 else OrderedDict((n, _size(ckpt.tensors[MODEL + n].shape)) for n in frozen),
        "shared_params": dict(plan.shared) if rank == 0 else {},
        "frozen_param_fragments": fragments,
        "lr_scheduler": _objects(plan.lr_scheduler, ckpt, a, cache),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": plan.counters["skipped_steps"],
        "global_steps": plan.counters["global_steps"],
    }
    if "global_samples" in plan.counters:
        state["global_samples"] = plan.counters["global_samples"]
    state.update({"dp_world_size": ws, "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                  "ds_config": plan.ds_config, "ds_version": plan.ds_version})
    for k, v in plan.client.items():
        state.setdefault(k, _objects(v, ckpt, a, cache))
    a.root = state
    return a


def _osd_head(plan: Plan) -> dict[str, Any]:
    head: dict[str, Any] = {"loss_scaler": _loss_scaler(), "dynamic_loss_scale": False, "overflow": False}
    if plan.clip_grad is not None:
        head["clip_grad"] = plan.clip_grad
    return head


def _scalar_state(a: ArchiveOut, ckpt: Checkpoint, group: Group) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, logical in group.scalars.items():
        t = ckpt.tensors[logical]
        out[key] = a.tensor(t.dtype, ())
        a.fill(out[key], logical, Box((), ()))
    return out


def _optim_flat(plan: Plan, ckpt: Checkpoint, relpath: str, rank: int, flats: list[FlatGroup], members: list[list[Param]]) -> ArchiveOut:
    """Stage 1/2: rank ``rank``'s optimizer file (``members``: each group's params in flat-buffer order)."""
    a = ArchiveOut(relpath)
    state: dict[int, dict[str, Any]] = {}
    masters: list[TensorOut] = []
    for g, (group, fg) in enumerate(zip(plan.groups, flats)):
        per = _scalar_state(a, ckpt, group)
        moments = {k: a.tensor("float32", (fg.partition,)) for k in group.moments}
        per.update(moments)
        state[g] = per
        master = a.tensor("float32", (fg.lean(rank),), requires_grad=True)
        masters.append(master)
        for i, pc in fg.held[rank]:
            p = members[g][i]
            region = Flat(pc.param_start, pc.length)
            a.fill(master, p.master, region, pc.tensor_start)
            for k, out in moments.items():
                a.fill(out, p.state[k], region, pc.tensor_start)
    osd = _osd_head(plan)
    osd["base_optimizer_state"] = {"state": state, "param_groups": [{**g.hyper, "params": [i]} for i, g in enumerate(plan.groups)]}
    osd["single_partition_of_fp32_groups"] = masters
    osd["zero_stage"] = _stage_enum(plan.stage)
    osd["group_paddings"] = [fg.group_padding(rank) for fg in flats]
    osd["param_alignment_paddings"] = [list(fg.paddings) for fg in flats]
    osd["partition_count"] = [plan.world_size] * len(flats)
    osd["ds_version"] = plan.ds_version
    osd["param_slice_mappings"] = [OrderedDict((n, _address(*addr)) for n, addr in fg.mappings[rank].items()) for fg in flats]
    a.root = {"optimizer_state_dict": osd, "ds_config": plan.ds_config, "ds_version": plan.ds_version}
    return a


def _optim_stage3(plan: Plan, ckpt: Checkpoint, relpath: str, layout: Stage3Layout, mine: list[tuple[int, Piece]]) -> ArchiveOut:
    """Stage 3: one rank's optimizer file (``mine``: the pieces that rank holds)."""
    a = ArchiveOut(relpath)
    state: dict[int, dict[str, Any]] = {}
    flats: list[TensorOut] = []
    moments: list[dict[str, TensorOut]] = []
    for k, size in enumerate(layout.sub_sizes):
        group = plan.groups[layout.sub_to_group[k]]
        per = _scalar_state(a, ckpt, group)
        moments.append({key: a.tensor("float32", (size,)) for key in group.moments})
        per.update(moments[k])
        state[k] = per
        flats.append(a.tensor("float32", (size,), requires_grad=True))
    params = [p for g in plan.groups for p in g.params]
    for i, pc in mine:
        p = params[i]
        region = Flat(pc.param_start, pc.length)
        a.fill(flats[pc.tensor], p.master, region, pc.tensor_start)
        for key, out in moments[pc.tensor].items():
            a.fill(out, p.state[key], region, pc.tensor_start)
    groups = [{**g.hyper, "params": [k for k, owner in enumerate(layout.sub_to_group) if owner == i]} for i, g in enumerate(plan.groups)]
    osd: dict[str, Any] = {"zero_stage": _stage_enum(3)}
    osd.update(_osd_head(plan))
    osd.pop("clip_grad", None)  # ZeRO-3 does not save it
    osd["partition_count"] = plan.world_size
    osd["optimizer_state_dict"] = {"state": state, "param_groups": groups}
    osd["fp32_flat_groups"] = flats
    a.root = {"optimizer_state_dict": osd, "ds_config": plan.ds_config, "ds_version": plan.ds_version}
    return a


def _archives(plan: Plan, ckpt: Checkpoint) -> list[ArchiveOut]:
    ws = plan.world_size
    zo = plan.ds_config.get("zero_optimization") or {}
    prefix = "bf16_" if plan.precision == "bf16" else ""
    optim_name = f"{plan.tag}/{prefix}zero_pp_rank_{{r}}_mp_rank_00_optim_states.pt"
    out: list[ArchiveOut] = []
    if plan.stage in (1, 2):
        align = 16 // math.gcd(16, itemsize(plan.module_dtype)) if zo.get("parameter_alignment") else 1
        round_robin = bool(zo.get("round_robin_gradients"))
        flats = [plan_flat_group(g, [p.name for p in group.params], [p.numel for p in group.params], ws,
                                 param_alignment=align, round_robin=round_robin) for g, group in enumerate(plan.groups)]
        if round_robin:
            plan.notes.append("round_robin_gradients: each group's flat buffer is in DeepSpeed's round-robin order for this world size")
        by_name = [{p.name: p for p in group.params} for group in plan.groups]
        members = [[names[n] for n in fg.names] for names, fg in zip(by_name, flats)]  # flat-buffer order
        shapes = [OrderedDict((p.name, _size(p.shape)) for p in ps) for ps in members]
        out.append(_model_states(plan, ckpt, f"{plan.tag}/mp_rank_00_model_states.pt", 0, shapes))
        out.extend(_optim_flat(plan, ckpt, optim_name.format(r=r), r, flats, members) for r in range(ws))
        return out
    sub = zo.get("sub_group_size", SUB_GROUP_SIZE)
    sub = int(sub) if isinstance(sub, (int, float)) and not isinstance(sub, bool) else SUB_GROUP_SIZE
    layout = plan_stage3([[(p.name, p.numel) for p in g.params] for g in plan.groups], ws, sub)
    if len(layout.sub_sizes) > len(plan.groups):
        plan.notes.append(f"zero_optimization.sub_group_size {sub}: {len(layout.sub_sizes)} sub-groups; the DeepSpeed run must use the same value")
    params = [p for g in plan.groups for p in g.params]
    shapes = [OrderedDict((params[i].name, _size(params[i].shape)) for i in members) for members in layout.sub_members]
    for r in range(ws):
        out.append(_model_states(plan, ckpt, f"{plan.tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt", r, shapes))
    out.extend(_optim_stage3(plan, ckpt, optim_name.format(r=r), layout, mine) for r, mine in enumerate(by_rank(layout.pieces, ws)))
    return out


def plan_write(ckpt: Checkpoint, dst: Path | Location, opts: Options, *, zero_stage: int, precision: str | None = None, tag: str | None = None,
               buffers: Collection[str] | None = None, hyperparameters: Sequence[Mapping[str, Any]] | None = None) -> WritePlan:
    """Plan ``ckpt`` as a DeepSpeed ZeRO-``zero_stage`` checkpoint directory for
    ``opts.world_size`` ranks at ``dst`` (built beside it, renamed into place;
    ``latest`` is written last).

    ``precision``: ``"fp32"`` or ``"bf16"`` (module weights in bf16, cast from the
    fp32 masters, and the ``bf16_`` file prefix) — the precision the DeepSpeed run
    resumes in; by default the source's (fp32 for non-DeepSpeed sources).
    ``tag``: the tag directory (default: the source's tag, else ``global_step<N>``).
    ``buffers``: the model's persistent buffer names, where the source cannot say
    which non-trained tensors are buffers and which frozen parameters (needed
    for stage 3 from a non-DeepSpeed source that has any).
    ``hyperparameters``: one dict per param group (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ...; a ``params`` entry is ignored) laid over the source's:
    needed where the source does not record them (a DeepSpeed elastic checkpoint).

    Returns a summary: ``files``, ``tensors``, ``bytes``, ``world_size``,
    ``zero_stage``, ``precision``, ``tag`` and ``notes`` (what was synthesized or
    left out). Raises :class:`LayoutMismatchError` where the source's optimizer
    state cannot become ZeRO's (no param groups or no optimizer state, members of
    one group with different steps or state, non per-element state)."""
    plan = make_plan(ckpt, opts, zero_stage, precision, tag, buffers, hyperparameters)
    archives = _archives(plan, ckpt)
    files, size = archive_files(ckpt, archives)
    for script in plan.scripts:  # zero_to_fp32.py and its like, copied as the source has them
        data = script.read_bytes()
        files.append(OutFile(script.name, len(data), small=[(0, data)]))
    names = [zero.LATEST] + [s.name for s in plan.scripts] + [a.relpath for a in archives]
    summary = {"files": names, "tensors": len(ckpt.tensors), "bytes": size + len(plan.tag), "world_size": plan.world_size,
               "zero_stage": plan.stage, "precision": plan.precision, "tag": plan.tag, "notes": plan.notes}
    # `latest` names the tag DeepSpeed loads: written once everything it names is in place
    return WritePlan(True, files, [(zero.LATEST, plan.tag.encode())], summary, threads=opts.threads)


def write(ckpt: Checkpoint, dst: Path | Location, opts: Options, progress: Callable[[int], None] | None = None, *, zero_stage: int,
          precision: str | None = None, tag: str | None = None, buffers: Collection[str] | None = None,
          hyperparameters: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """:func:`plan_write`, executed and committed."""
    plan = plan_write(ckpt, dst, opts, zero_stage=zero_stage, precision=precision, tag=tag, buffers=buffers, hyperparameters=hyperparameters)
    return run(plan, dst, force=opts.force, progress=progress)
