"""Where each parameter's elements sit in DeepSpeed ZeRO's flat partitions.

First pure geometry (``flat_group_pieces``, ``stage3_pieces``): given the
parameter sizes in flat-buffer order and the partition sizes, which rank holds
which elements of which parameter, and where in that rank's flat tensor they
are. Then the readers ``zero.read`` calls (``read_flat_groups``,
``read_stage3``), which check the optimizer files against that geometry and
turn the pieces into chunks pointing at file bytes. Nothing is loaded.

Stage 1/2 and BF16_Optimizer: a param group is one flat buffer, the params
concatenated in ``param_shapes`` order (each followed by its
``param_alignment_paddings`` entry when the save has them), padded at the end,
and cut into ``world_size`` equal partitions; rank r holds flat elements
``[r*P, (r+1)*P)``.

Stage 3: every parameter is split on its own into ``ceil(numel/ws)``-element
pieces (the last rank's padded); each rank concatenates its pieces, in
``param_shapes`` order across all groups, and cuts that into its sub-group
tensors. A param may straddle two sub-group tensors.

Verified against DeepSpeed 0.19.8 (``zero_to_fp32.py`` reconstructs the same
way) and the true state of the fixtures.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._dtypes import DTYPE_SIZES
from ..._torchfile.archive import TorchArchive
from ..._torchfile.unpickle import Record, TensorRef
from ...errors import CorruptCheckpointError
from ...model import MODEL, OPTIM, Box, Checkpoint, Chunk, Flat, LogicalTensor, Region, itemsize

__all__ = [
    "GeometryError",
    "Groups",
    "Piece",
    "RankFile",
    "check_slice_mappings",
    "corrupt",
    "flat_group_pieces",
    "read_flat_groups",
    "read_stage3",
    "stage3_partition",
    "stage3_pieces",
    "tensor_chunk",
]

# Said whenever the recorded sizes disagree with each other.
MIXED_HINT = (
    "the files of the tag directory may come from different saves, or be damaged; "
    "copy the whole tag directory again from where the run wrote it"
)


class GeometryError(ValueError):
    """The sizes a save records do not fit together; the caller names the file."""


@dataclass(frozen=True)
class Piece:
    """``length`` elements of one parameter, starting at element ``param_start``
    of the flattened parameter, held by ``rank`` at element ``tensor_start`` of
    its flat tensor number ``tensor`` (the param group for stage 1/2, the
    sub-group for stage 3)."""

    rank: int
    tensor: int
    tensor_start: int
    param_start: int
    length: int


def flat_group_pieces(
    numels: list[int], paddings: list[int] | None, partition: int, world_size: int, group: int
) -> tuple[list[list[Piece]], int]:
    """Stage 1/2: per parameter, the pieces each rank holds; and the number of
    flat elements the group uses (params plus their alignment paddings)."""
    if paddings is not None and len(paddings) != len(numels):
        raise GeometryError(f"param group {group}: {len(paddings)} alignment paddings for {len(numels)} parameters")
    if partition < 0:
        raise GeometryError(f"param group {group}: negative partition size {partition}")
    out: list[list[Piece]] = []
    offset = 0
    for i, n in enumerate(numels):
        pieces: list[Piece] = []
        end = offset + n
        if n > 0 and partition == 0:
            raise GeometryError(f"param group {group}: partitions are empty but the group holds parameters")
        if n > 0:
            for r in range(offset // partition, min(world_size, (end - 1) // partition + 1)):
                a, b = max(offset, r * partition), min(end, (r + 1) * partition)
                pieces.append(Piece(r, group, a - r * partition, a - offset, b - a))
        out.append(pieces)
        offset = end + (paddings[i] if paddings is not None else 0)
    used = offset
    if used > partition * world_size:
        raise GeometryError(
            f"param group {group}: the parameters need {used} flat elements but {world_size} partitions of {partition} hold only {partition * world_size}"
        )
    return out, used


def stage3_partition(numel: int, world_size: int) -> int:
    """Elements of one parameter each rank holds under ZeRO-3 (padded on the last ranks)."""
    return -(-numel // world_size)


def stage3_pieces(numels: list[int], sub_group_sizes: list[int], world_size: int) -> tuple[list[list[Piece]], list[int]]:
    """Stage 3: per parameter (``param_shapes`` order, all groups merged), the
    pieces each rank holds, and the sub-group its first element falls in (its
    "home", which names its param group and its step). ``sub_group_sizes`` are
    the lengths of each rank's sub-group tensors (the same on every rank)."""
    bounds = [0]
    for s in sub_group_sizes:
        bounds.append(bounds[-1] + s)
    need = sum(stage3_partition(n, world_size) for n in numels)
    if need != bounds[-1]:
        raise GeometryError(f"the parameters need {need} elements per rank but the sub-group tensors hold {bounds[-1]}")
    last = max(0, len(sub_group_sizes) - 1)

    def tensor_at(virtual: int) -> int:
        return min(bisect_right(bounds, virtual) - 1, last)

    out: list[list[Piece]] = []
    homes: list[int] = []
    virtual = 0
    for n in numels:
        p = stage3_partition(n, world_size)
        pieces: list[Piece] = []
        for r in range(world_size):
            length = max(0, min(p, n - r * p))
            done = 0
            while done < length:
                at = virtual + done
                j = tensor_at(at)
                take = min(length - done, bounds[j + 1] - at)
                pieces.append(Piece(r, j, at - bounds[j], r * p + done, take))
                done += take
        out.append(pieces)
        homes.append(tensor_at(virtual))
        virtual += p
    return out, homes


# ----------------------------------------------------------------------------
# From pieces to chunks: the optimizer files of every rank.


def corrupt(path: Path, message: str, hint: str | None = MIXED_HINT) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {message}", hint=hint, path=path)


@dataclass
class RankFile:
    """One rank's optimizer file: the archive and its ``optimizer_state_dict``."""

    rank: int
    archive: TorchArchive
    osd: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.archive.path

    def list_of(self, key: str, n: int | None = None) -> list[Any]:
        value = self.osd.get(key)
        if not isinstance(value, (list, tuple)) or (n is not None and len(value) != n):
            want = "a list" if n is None else f"a list of {n}"
            raise corrupt(self.path, f"optimizer_state_dict['{key}'] is not {want} (one entry per group)")
        return list(value)


@dataclass
class Groups:
    """What the optimizer files say about the param groups: member names in
    group order, hyper-parameters (None where the save keeps none) and notes."""

    members: list[list[str]] = field(default_factory=list)
    hyper: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)


def tensor_chunk(archive: TorchArchive, ref: Any, start: int, length: int, region: Region, what: str) -> Chunk:
    """Elements ``start .. start+length`` of the 1-D (or scalar) tensor ``ref``, as a chunk."""
    if not isinstance(ref, TensorRef):
        raise corrupt(archive.path, f"{what} is not a tensor")
    if ref.dtype not in DTYPE_SIZES or not ref.is_contiguous():
        raise corrupt(archive.path, f"{what} is a {ref.dtype} tensor with strides {list(ref.stride)}; ZeRO saves flat contiguous tensors")
    if start < 0 or length < 0 or start + length > ref.numel:
        raise corrupt(archive.path, f"{what} has {ref.numel} elements, but elements {start}..{start + length} are needed")
    size = itemsize(ref.dtype)
    stored = archive.storage_sizes.get(ref.storage.key, 0)
    if (ref.storage_offset + start + length) * size > stored:
        raise corrupt(archive.path, f"{what} runs past the end of its storage (data/{ref.storage.key}, {stored} bytes)", hint="the file is truncated or damaged; copy it again")
    return Chunk(region, ref.dtype, archive.path, archive.tensor_offset(ref) + start * size)


def _scalar_tensor(name: str, archive: TorchArchive, value: Any, what: str) -> LogicalTensor | None:
    """A per-group scalar (Adam's ``step``) as a 0-d tensor: the group's tensor
    bytes when it is a tensor, inline float32 bytes when it is a Python number."""
    if isinstance(value, TensorRef):
        if value.numel != 1:
            return None
        return LogicalTensor(name, (), value.dtype, [tensor_chunk(archive, value, 0, 1, Box((), ()), what)])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return LogicalTensor(name, (), "float32", [Chunk(Box((), ()), "float32", data=struct.pack("<f", float(value)))])
    return None


def _address(value: Any) -> tuple[int, int] | None:
    """``fragment_address(numel, start)`` as (numel, start); None when it is not
    one (a damaged file: the caller's cross-check then names the parameter)."""
    pair: Any = None
    if isinstance(value, Record):
        if isinstance(value.state, dict) and "numel" in value.state:
            pair = (value.state.get("numel"), value.state.get("start"))
        elif len(value.args) == 2:
            pair = value.args
    elif isinstance(value, tuple) and len(value) == 2:
        pair = value
    if pair is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        return None
    return int(pair[0]), int(pair[1])


def _hyper(groups: Any, n: int, path: Path) -> list[dict[str, Any]]:
    if not isinstance(groups, list) or len(groups) != n or not all(isinstance(g, dict) for g in groups):
        raise corrupt(path, f"the optimizer's param_groups are not a list of {n} dicts")
    out = []
    for g in groups:
        h = {str(k): v for k, v in g.items() if k != "params"}
        if isinstance(h.get("betas"), list):
            h["betas"] = tuple(h["betas"])
        out.append(h)
    return out


def read_flat_groups(ckpt: Checkpoint, param_shapes: list[dict[str, tuple[int, ...]]], ranks: list[RankFile], bf16_optimizer: bool) -> Groups:
    """ZeRO stage 1/2 and BF16_Optimizer: masters and optimizer state of every
    trainable parameter, as chunks of each rank's flat group partitions."""
    ws = len(ranks)
    n_groups = len(param_shapes)
    first = ranks[0]
    out = Groups()
    alignment = first.osd.get("param_alignment_paddings")
    if alignment is not None and (not isinstance(alignment, list) or len(alignment) != n_groups):
        raise corrupt(first.path, f"param_alignment_paddings is not a list of {n_groups} lists")
    # Elastic checkpoints keep a lean state per group (padding cut like the
    # master's) and no param_groups; the rigid form is torch's state_dict.
    elastic = isinstance(first.osd.get("base_optimizer_state"), list)
    states: list[list[dict[str, Any]]] = []  # [rank][group]
    for rf in ranks:
        base = rf.osd.get("base_optimizer_state")
        if isinstance(base, list) != elastic:
            raise corrupt(rf.path, "rank files disagree on elastic_checkpoint (lean per-group state in some, torch's state_dict in others)")
        if elastic:
            per = rf.list_of("base_optimizer_state", n_groups)
        elif isinstance(base, dict) and isinstance(base.get("state"), dict) and isinstance(base.get("param_groups"), list):
            pg = base["param_groups"]
            if len(pg) != n_groups:
                raise corrupt(rf.path, f"the optimizer has {len(pg)} param groups, the model states list {n_groups}")
            per = []
            for g, group in enumerate(pg):
                ids = group.get("params") if isinstance(group, dict) else None
                if not isinstance(ids, list) or len(ids) != 1:
                    raise corrupt(rf.path, f"param group {g} of the base optimizer holds {ids!r}; ZeRO 1/2 keeps one flat tensor per group")
                per.append(base["state"].get(ids[0]) or {})
        else:
            raise corrupt(rf.path, "optimizer_state_dict has no 'base_optimizer_state' with 'state' and 'param_groups'")
        states.append([s if isinstance(s, dict) else {} for s in per])
    if elastic:
        out.notes.append("elastic checkpoint: the optimizer state per group is lean (padding removed) and the group hyper-parameters were not saved")
    else:
        out.hyper = _hyper(first.osd["base_optimizer_state"]["param_groups"], n_groups, first.path)
    masters = [rf.list_of("single_partition_of_fp32_groups", n_groups) for rf in ranks]
    paddings = [rf.list_of("group_paddings", n_groups) for rf in ranks]

    for g, shapes in enumerate(param_shapes):
        names = list(shapes)
        out.members.append(names)
        # The partition size: BF16_Optimizer saves the padded partition, ZeRO 1/2
        # cut the padding (group_paddings[g] of that rank) from the fp32 slice.
        sizes = set()
        for r, rf in enumerate(ranks):
            m = masters[r][g]
            if not isinstance(m, TensorRef) or len(m.shape) != 1:
                raise corrupt(rf.path, f"single_partition_of_fp32_groups[{g}] is not a 1-D tensor")
            pad = paddings[r][g]
            if not isinstance(pad, int) or pad < 0:
                raise corrupt(rf.path, f"group_paddings[{g}] is {pad!r}")
            sizes.add(m.numel + (0 if bf16_optimizer else pad))
        if len(sizes) != 1:
            raise corrupt(first.path, f"param group {g}: the ranks' partitions differ in size ({sorted(sizes)}) after taking group_paddings into account")
        partition = sizes.pop()
        try:
            pieces, _ = flat_group_pieces(
                [_numel(s) for s in shapes.values()], None if alignment is None else list(alignment[g]), partition, ws, g
            )
        except GeometryError as exc:
            raise corrupt(first.path, str(exc)) from None
        order, note = check_slice_mappings(ranks, g, shapes, None if alignment is None else list(alignment[g]), partition, pieces)
        out.members[-1] = order
        if note:
            out.notes.append(note)
        state_keys = _state_keys(states, g, ranks)
        for r, rf in enumerate(ranks):
            want = masters[r][g].numel if elastic else partition
            for k in state_keys:
                if states[r][g][k].numel != want:
                    raise corrupt(rf.path, f"optimizer state '{k}' of param group {g} has {states[r][g][k].numel} elements, the partition {want}")
        step_of_group = states[0][g].get("step")
        if elastic and step_of_group is None:
            step_of_group = first.osd.get("base_optimizer_state_step")
        for name, shape, per in zip(names, shapes.values(), pieces):
            master = ckpt.add(LogicalTensor(MODEL + name, tuple(shape), masters[0][g].dtype))
            moments = {k: ckpt.add(LogicalTensor(f"{OPTIM}{k}/{name}", tuple(shape), states[0][g][k].dtype)) for k in state_keys}
            for pc in per:
                rf = ranks[pc.rank]
                region = Flat(pc.param_start, pc.length)
                what = f"the fp32 partition of param group {g}"
                master.chunks.append(tensor_chunk(rf.archive, masters[pc.rank][g], pc.tensor_start, pc.length, region, what))
                for k, lt in moments.items():
                    lt.chunks.append(tensor_chunk(rf.archive, states[pc.rank][g][k], pc.tensor_start, pc.length, region, f"optimizer state '{k}' of param group {g}"))
            step = _scalar_tensor(f"{OPTIM}step/{name}", first.archive, step_of_group, f"the step of param group {g}")
            if step is not None:
                ckpt.add(step)
        for k in states[0][g]:
            if k not in state_keys and k != "step":
                out.notes.append(f"optimizer state '{k}' of param group {g} is neither a partition-sized tensor nor a scalar; not read")
    return out


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _state_keys(states: list[list[dict[str, Any]]], g: int, ranks: list[RankFile]) -> list[str]:
    """The per-element optimizer state names of group ``g`` (Adam: exp_avg, exp_avg_sq),
    the same on every rank."""
    keys = [str(k) for k, v in states[0][g].items() if isinstance(v, TensorRef) and len(v.shape) >= 1]
    for r, per in enumerate(states):
        mine = [str(k) for k, v in per[g].items() if isinstance(v, TensorRef) and len(v.shape) >= 1]
        if mine != keys:
            raise corrupt(ranks[r].path, f"param group {g} has optimizer state {mine}, rank 0 has {keys}")
    return keys


def _slice_mappings(ranks: list[RankFile], g: int) -> list[dict[str, tuple[int, int] | None]] | None:
    """Per rank, ``param_slice_mappings[g]`` as name -> (numel, start); None when the save has none."""
    out: list[dict[str, tuple[int, int] | None]] = []
    for rf in ranks:
        mappings = rf.osd.get("param_slice_mappings")
        if mappings is None:
            return None
        if not isinstance(mappings, list) or g >= len(mappings) or not isinstance(mappings[g], dict):
            raise corrupt(rf.path, f"param_slice_mappings has no dict for param group {g}")
        out.append({str(k): _address(v) for k, v in mappings[g].items()})
    return out


def _expected_mappings(names: list[str], pieces: list[list[Piece]], ws: int) -> list[dict[str, tuple[int, int] | None]]:
    out: list[dict[str, tuple[int, int] | None]] = [{} for _ in range(ws)]
    for name, per in zip(names, pieces):
        for pc in per:
            out[pc.rank][name] = (pc.length, pc.tensor_start)
    return out


def check_slice_mappings(
    ranks: list[RankFile], g: int, shapes: dict[str, tuple[int, ...]], alignment: list[int] | None, partition: int, pieces: list[list[Piece]]
) -> tuple[list[str], str | None]:
    """``param_slice_mappings`` (what DeepSpeed says each rank holds) must agree
    with the layout computed from ``param_shapes``. Returns the group's member
    names in optimizer order, and a note when DeepSpeed's own mappings are wrong.

    One disagreement is DeepSpeed's, not the file's: with ``round_robin_gradients``
    (ZeRO-2) the flat buffer and ``param_shapes`` follow the shuffled order, but
    the mappings are computed in the unshuffled (optimizer) order as if no
    shuffle had happened, so they point at other params' elements (as do
    ``safe_get_full_fp32_param`` and ``ds_to_universal``, which use them).
    DeepSpeed 0.19.8, measured: the ``param_shapes`` order matches the module's
    own weights and zero_to_fp32; the mappings do not."""
    names = list(shapes)
    saved = _slice_mappings(ranks, g)
    if saved is None or saved == _expected_mappings(names, pieces, len(ranks)):
        return names, None
    # The unshuffled order is what the mappings list, rank by rank, by start.
    seen = sorted(((r, addr[1], name) for r, per in enumerate(saved) for name, addr in per.items() if addr is not None))
    order = list(dict.fromkeys(name for _, _, name in seen))
    if sorted(order) == sorted(names) and not any(alignment or []):
        try:
            unshuffled, _ = flat_group_pieces([_numel(shapes[n]) for n in order], None, partition, len(ranks), g)
        except GeometryError:
            unshuffled = []
        if saved == _expected_mappings(order, unshuffled, len(ranks)):
            note = (
                f"param group {g}: the flat buffer is in round-robin order (round_robin_gradients); DeepSpeed's "
                "param_slice_mappings assume the unshuffled order and point at the wrong elements (so do "
                "safe_get_full_fp32_param and ds_to_universal); Ravex follows param_shapes, which matches the module's weights"
            )
            return order, note
    expected = _expected_mappings(names, pieces, len(ranks))
    for r, (mine, theirs) in enumerate(zip(expected, saved)):
        diff = sorted(set(mine) ^ set(theirs)) or sorted(k for k in theirs if theirs[k] != mine.get(k))
        if diff:
            name = diff[0]
            raise corrupt(
                ranks[r].path,
                f"param_slice_mappings of param group {g} places '{name}' at (numel, start) {theirs.get(name)}, "
                f"but the flat layout from param_shapes puts it at {mine.get(name)}",
            )
    raise corrupt(ranks[0].path, f"param_slice_mappings of param group {g} disagree with the flat layout from param_shapes")


def read_stage3(ckpt: Checkpoint, param_shapes: list[dict[str, tuple[int, ...]]], ranks: list[RankFile]) -> Groups:
    """ZeRO-3: masters and optimizer state of every trainable parameter, as
    chunks of each rank's sub-group tensors (``fp32_flat_groups``)."""
    ws = len(ranks)
    first = ranks[0]
    out = Groups()
    flats = [rf.list_of("fp32_flat_groups") for rf in ranks]
    n_sub = len(flats[0])
    inners: list[dict[str, Any]] = []
    for r, rf in enumerate(ranks):
        if len(flats[r]) != n_sub:
            raise corrupt(rf.path, f"{len(flats[r])} sub-group tensors in fp32_flat_groups, rank 0 has {n_sub}")
        for k, t in enumerate(flats[r]):
            if not isinstance(t, TensorRef) or len(t.shape) != 1:
                raise corrupt(rf.path, f"fp32_flat_groups[{k}] is not a 1-D tensor")
            if t.numel != flats[0][k].numel:
                raise corrupt(rf.path, f"fp32_flat_groups[{k}] has {t.numel} elements, rank 0's {flats[0][k].numel}; ZeRO-3 ranks hold equal sub-groups")
        inner = rf.osd.get("optimizer_state_dict")
        if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) or not isinstance(inner.get("param_groups"), list):
            raise corrupt(rf.path, "optimizer_state_dict has no torch optimizer state ('optimizer_state_dict' with 'state' and 'param_groups')")
        inners.append(inner)
    # The torch optimizer's param_groups list the sub-groups (by packed index,
    # which is the sub-group number: sub-groups are made group by group).
    hyper_groups = inners[0]["param_groups"]
    out.hyper = _hyper(hyper_groups, len(hyper_groups), first.path)
    sub_to_group: dict[int, int] = {}
    for g, group in enumerate(hyper_groups):
        for k in group.get("params") or []:
            if not isinstance(k, int) or not 0 <= k < n_sub or k in sub_to_group:
                raise corrupt(first.path, f"param group {g} lists sub-group {k!r}; there are {n_sub} sub-groups in fp32_flat_groups")
            sub_to_group[k] = g
    if len(sub_to_group) != n_sub:
        missing = sorted(set(range(n_sub)) - set(sub_to_group))
        raise corrupt(first.path, f"sub-groups {missing} belong to no param group of the optimizer")

    names = [n for shapes in param_shapes for n in shapes]
    shapes_all = [tuple(s) for shapes in param_shapes for s in shapes.values()]
    if len(set(names)) != len(names):
        raise corrupt(first.path, "param_shapes names a parameter twice")
    try:
        pieces, homes = stage3_pieces([_numel(s) for s in shapes_all], [t.numel for t in flats[0]], ws)
    except GeometryError as exc:
        raise corrupt(first.path, str(exc)) from None
    states: list[list[dict[str, Any]]] = [[(inner["state"].get(k) or {}) for k in range(n_sub)] for inner in inners]
    keys_by_sub = [_state_keys(states, k, ranks) for k in range(n_sub)]
    for r, rf in enumerate(ranks):
        for k in range(n_sub):
            for key in keys_by_sub[k]:
                if states[r][k][key].numel != flats[r][k].numel:
                    raise corrupt(rf.path, f"optimizer state '{key}' of sub-group {k} has {states[r][k][key].numel} elements, fp32_flat_groups[{k}] {flats[r][k].numel}")
    out.members = [[] for _ in hyper_groups]
    for name, shape, per, home in zip(names, shapes_all, pieces, homes):
        out.members[sub_to_group[home]].append(name)
        subs = sorted({pc.tensor for pc in per}) or [home]
        keys = keys_by_sub[subs[0]]
        if any(keys_by_sub[k] != keys for k in subs):
            raise corrupt(first.path, f"'{name}' straddles sub-groups {subs} whose optimizer state differs ({[keys_by_sub[k] for k in subs]})")
        master = ckpt.add(LogicalTensor(MODEL + name, shape, flats[0][home].dtype))
        moments = {key: ckpt.add(LogicalTensor(f"{OPTIM}{key}/{name}", shape, states[0][subs[0]][key].dtype)) for key in keys}
        for pc in per:
            rf = ranks[pc.rank]
            region = Flat(pc.param_start, pc.length)
            master.chunks.append(tensor_chunk(rf.archive, flats[pc.rank][pc.tensor], pc.tensor_start, pc.length, region, f"fp32_flat_groups[{pc.tensor}]"))
            for key, lt in moments.items():
                ref = states[pc.rank][pc.tensor][key]
                lt.chunks.append(tensor_chunk(rf.archive, ref, pc.tensor_start, pc.length, region, f"optimizer state '{key}' of sub-group {pc.tensor}"))
        step = _scalar_tensor(f"{OPTIM}step/{name}", first.archive, states[0][home].get("step"), f"the step of sub-group {home}")
        if step is not None:
            ckpt.add(step)
    return out
