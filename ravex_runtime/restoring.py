"""Putting a checked checkpoint into the live objects, all or nothing (``restoring``, not ``restore``:
the package exports a function ``restore``, which a submodule of that name would shadow).

A restore runs in three phases. :func:`~ravex_runtime.checking.plan` reads
everything the checkpoint holds and checks it against the live objects without
touching any of them (checking.py). Then the live state is snapshotted (copies
of the state dicts: cheap next to the load) and the plan applied. Should
applying still fail midway, the snapshot is put back and the failure is
reported like a mismatch; should putting it back fail too,
:class:`ResumeError` stops the run. Which checkpoint to restore, and the older
ones to fall back on, is resume.py's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from ravex_convert.errors import RavexError
from ravex_convert.model import Checkpoint

from .checking import SAME_RUN, Plan, plan
from .errors import ResumeError
from .sampler import LoaderState, generators_of, host_rng
from .state import Tracked, _is_dtensor, is_fsdp1, restore_rng

__all__ = ["apply_plan", "for_rank", "restore_into"]

log = logging.getLogger("ravex")


def _clone(value: Any) -> Any:
    """A copy that later in-place changes of the live state cannot reach."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _rng_now() -> dict[str, Any]:
    out = host_rng()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _snapshot(p: Plan) -> list[Callable[[], None]]:
    """Closures that put every object the plan touches back as it is now."""
    undo: list[Callable[[], None]] = []
    def load_back(obj: Any, sd: Any, strict: bool | None) -> Callable[[], None]:
        def back() -> None:
            obj.load_state_dict(sd) if strict is None else obj.load_state_dict(sd, strict=strict)
        return back

    for m, _ in p.models:
        undo.append(load_back(m, _clone({k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}), False))
    for obj, _ in [*p.optimizers, *p.stateful]:
        undo.append(load_back(obj, _clone(obj.state_dict()), None))
    if p.rng is not None:
        rng = _rng_now()
        undo.append(lambda: restore_rng(rng))
    for ld, st, _ in p.loaders:
        pending, gens = st.pending, {k: g.get_state() for k, g in generators_of(ld).items()}

        def loader_back(st: LoaderState = st, pending: Any = pending, ld: Any = ld, gens: dict[str, torch.Tensor] = gens) -> None:
            st.pending = pending
            for k, g in generators_of(ld).items():
                g.set_state(gens[k])
        undo.append(loader_back)
    return undo


def _apply(p: Plan) -> None:
    fsdp1 = next((m for m, _ in p.models if is_fsdp1(m)), None)
    for m, sd in p.models:
        if is_fsdp1(m):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(m, cast(Any, sd), options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            m.load_state_dict(sd, strict=False)  # names and shapes checked; extra state, if any, stays
    for obj, sd in [*p.optimizers, *p.stateful]:
        if isinstance(sd, dict) and sd.get("fsdp1") and fsdp1 is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            osd: Any = {k: v for k, v in sd.items() if k != "fsdp1"}
            set_optimizer_state_dict(fsdp1, obj, osd, options=StateDictOptions(full_state_dict=True))
        else:
            obj.load_state_dict(sd)
    if p.rng is not None:
        restore_rng(p.rng)
    for ld, st, saved in p.loaders:
        # Generators of a loader not yet iterated: their checkpoint state now; the position at its next iter().
        st.pending = saved
        st.trains = saved.get("trains") is not False  # a training loader boundaries at once; an evaluation's stays one
        for k, g in generators_of(ld).items():
            if k in (saved.get("generators") or {}):
                g.set_state(saved["generators"][k])


def _localize(p: Plan) -> None:
    """Whole tensors from the checkpoint made into this rank's shards where the live state is sharded
    (DTensors: FSDP2), by slicing here (no collective: every rank holds the whole tensor): the
    model's tensors, and the optimizer state shaped like a sharded parameter. At any world size:
    the shards are cut to the live mesh, not the saved one."""
    def local(saved: torch.Tensor, like: Any) -> Any:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None)

    for i, (m, sd) in enumerate(p.models):
        live = m.state_dict()
        if any(_is_dtensor(v) for v in live.values()):
            p.models[i] = (m, {k: local(v, live[k]) if _is_dtensor(live.get(k)) and not _is_dtensor(v) else v for k, v in sd.items()})
    for opt, osd in p.optimizers:
        params = [q for g in opt.param_groups for q in g["params"]]
        state: dict[Any, Any] = osd.get("state", {})
        for pid, st in state.items():
            q = params[pid] if isinstance(pid, int) and 0 <= pid < len(params) else None
            if q is None or not _is_dtensor(q):
                continue
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == q.shape:
                    st[k] = local(v, q)


def for_rank(ckpt: Checkpoint, rank: int, world_size: int | None) -> Checkpoint:
    """The checkpoint as rank ``rank`` restores it: its own random streams and data positions in
    place of rank 0's (``ranks``, written by a run on many ranks). A rank the saved run did not
    have (more ranks now) keeps the random streams its script seeded, and takes the data position
    of rank ``rank`` modulo the saved world size (a DistributedSampler's epoch is dealt out again:
    sampler.py); a checkpoint of one process resumed on many: every rank takes its position, and
    rank 0 alone its streams."""
    objs = dict(ckpt.objects)
    ranks = objs.pop("ranks", None)
    objs.pop("distributed", None)
    if isinstance(ranks, list) and ranks:
        n = len(ranks)
        mine = ranks[rank] if rank < n else None
        if isinstance(mine, dict):
            objs["rng"], objs["loaders"] = mine.get("rng", {}), mine.get("loaders", [])
        else:
            objs.pop("rng", None)
            other = ranks[rank % n]
            objs["loaders"] = other.get("loaders", []) if isinstance(other, dict) else []
            log.warning("ravex: rank %d did not exist in the %d-rank run that wrote the checkpoint: its random streams start as its script "
                        "seeded them, its data position is rank %d's", rank, n, rank % n, extra={"every_rank": True})
    elif rank > 0:
        objs.pop("rng", None)
    if world_size is not None and isinstance(ranks, list) and ranks and len(ranks) != world_size and rank == 0:
        log.warning("ravex: the checkpoint was written by %d ranks and resumes on %d: ranks below %d continue their own random streams; "
                    "a DistributedSampler's epoch goes on with the samples not yet trained on", len(ranks), world_size, min(len(ranks), world_size))
    out = copy.copy(ckpt)
    out.objects = objs
    return out


def restore_into(live: Tracked, ckpt: Checkpoint, tensors: dict[str, torch.Tensor], *, weights_only: bool, where: str) -> int | None:
    """Restore ``ckpt`` into the live objects, all or nothing; returns the step it saved (None when
    it saved none, or with ``weights_only``). The step counter is the caller's to set.

    A checkpoint that does not fit raises :class:`~ravex_convert.errors.LayoutMismatchError`
    or :class:`~ravex_convert.errors.CorruptCheckpointError` with nothing touched; a failure
    while applying puts the previous state back and raises :class:`RavexError`; a failure to
    put it back raises :class:`ResumeError` (the process must not train on)."""
    return apply_plan(plan(live, ckpt, tensors, weights_only, where), where)


def apply_plan(p: Plan, where: str, undo: bool = True) -> int | None:
    """Put a checked plan into the live objects (see :func:`restore_into`). Without ``undo`` (a
    checkpoint with nothing to fall back on), no copy of the live state is kept: a failure midway
    raises :class:`ResumeError`."""
    _localize(p)
    if not undo:
        try:
            _apply(p)
        except Exception as exc:
            raise ResumeError(f"{where}: restoring failed midway ({type(exc).__name__}: {exc}); the live objects hold part of the "
                              "checkpoint, so the run stops", hint="start the script again; if it fails the same way, " + SAME_RUN) from exc
        return p.step
    undo_all = _snapshot(p)
    try:
        _apply(p)
    except Exception as exc:
        try:
            for back in undo_all:
                back()
        except Exception as again:  # noqa: BLE001 - any failure here leaves the objects half-restored
            raise ResumeError(f"{where}: restoring failed midway ({type(exc).__name__}: {exc}) and the live objects could not be put back "
                              f"({type(again).__name__}: {again}); they hold part of the checkpoint, so the run stops",
                              hint="start the script again; if it fails the same way, " + SAME_RUN) from exc
        raise RavexError(f"{where}: restoring failed midway ({type(exc).__name__}: {exc}); the live objects were put back as they were",
                         hint=SAME_RUN) from exc
    return p.step
