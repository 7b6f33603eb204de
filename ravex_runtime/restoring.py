"""Putting a checkpoint into the live objects, all or nothing (``restoring``, not ``restore``: the
package exports a function ``restore``, which a submodule of that name would shadow).

A restore runs in three phases. ``plan`` reads everything the checkpoint holds
and checks it against the live objects — every model tensor's name, shape and
dtype, the optimizers' parameter groups and state, schedulers, scalers, every
RNG state (each one tried on a scratch generator) — without touching any of
them; a checkpoint that does not fit raises here and the run can fall back to
an older one. Then the live state is snapshotted (copies of the state dicts:
cheap next to the load) and the plan applied. Should applying still fail
midway, the snapshot is put back and the failure is reported like a mismatch;
should putting it back fail too, :class:`ResumeError` stops the run.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ravex_convert.errors import CorruptCheckpointError, LayoutMismatchError, RavexError
from ravex_convert.model import MODEL, OBJ, OPTIM, Checkpoint

from .errors import ResumeError
from .foreign import ORIGIN_KEY, Adapted, Foreign, adapt, is_foreign, open_foreign
from .loading import is_lazy, load_checkpoint, load_torch_save, read_for, torch_save_files
from .sampler import LoaderState, generators_of
from .state import Tracked, is_fsdp1, restore_rng, unflatten
from .workers import check_states

__all__ = ["Resume", "ResumeError", "restore_into"]

log = logging.getLogger("ravex")

# Per-parameter optimizer state of torch.optim's element-wise optimizers: shaped like the parameter.
# (Other keys, e.g. Adafactor's row/column factors or scalar steps, are not shape-checked.)
_ELEMENTWISE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta",
                          "grad_avg", "ax", "prev", "step_size", "exp_inf"})
_SAME_RUN = "resume with the model, optimizer and schedulers built as the checkpointed run built them, or set fresh: true to start over"


def _mismatch(where: str, what: str) -> LayoutMismatchError:
    return LayoutMismatchError(f"{where}: {what}", hint=_SAME_RUN)


def _corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}", hint="the checkpoint is damaged; Ravex uses the one before it, or remove it")


@dataclass
class _Plan:
    """Everything to load, already checked against the live objects."""

    models: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = field(default_factory=list)
    optimizers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    stateful: list[tuple[Any, Any]] = field(default_factory=list)  # schedulers, scalers, tracked objects
    rng: dict[str, Any] | None = None
    loaders: list[tuple[Any, LoaderState, dict[str, Any]]] = field(default_factory=list)
    step: int | None = None


def _shape(t: torch.Tensor) -> list[int]:
    return [int(s) for s in t.shape]


# ---------------------------------------------------------------- models


def _plan_models(tensors: dict[str, torch.Tensor], roots: list[torch.nn.Module], where: str, weights_only: bool) -> list[Any]:
    out: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    prefixes = [MODEL if i == 0 else f"{OBJ}model.{i}/" for i in range(len(roots))]
    if not roots and any(n.startswith(MODEL) for n in tensors):
        raise _mismatch(where, "the checkpoint holds a model, but no model is known at the first iteration boundary")
    for m, prefix in zip(roots, prefixes):
        sd = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
        live = {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
        label = type(m).__name__ if prefix == MODEL else f"model #{prefixes.index(prefix)} ({type(m).__name__})"
        missing = sorted(live.keys() - sd.keys())
        unexpected = sorted(sd.keys() - live.keys())
        if missing or unexpected:
            what = (f"{label} does not match the checkpoint: missing in the checkpoint {missing[:5]}, "
                    f"in the checkpoint but not in the model {unexpected[:5]}")
            if not weights_only:
                raise _mismatch(where, what)
            log.warning("ravex: restoring %s: %s", where, what)
        for k in sorted(live.keys() & sd.keys()):
            a, b = live[k], sd[k]
            if a.shape != b.shape or (a.dtype != b.dtype and not weights_only):
                raise _mismatch(where, f"tensor '{prefix}{k}' is {list(b.shape)} {str(b.dtype).removeprefix('torch.')} in the checkpoint, "
                                       f"{list(a.shape)} {str(a.dtype).removeprefix('torch.')} in {label}")
        out.append((m, {k: v for k, v in sd.items() if k in live}))
    for n in tensors:
        if n.startswith(f"{OBJ}model.") and not any(n.startswith(p) for p in prefixes):
            raise _mismatch(where, f"the checkpoint holds a model this run did not build by its first iteration ('{n}')")
    return out


# ---------------------------------------------------------------- optimizers


def _check_optimizer(opt: Any, saved: Any, where: str, label: str, pnames: list[str] | None = None) -> None:
    """``saved`` (a torch optimizer state dict) fits ``opt``: groups, sizes, hyper-parameters, state."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) or not isinstance(saved.get("state", {}), dict):
        raise _corrupt(where, f"the state of {label} is not an optimizer state dict")
    groups = opt.param_groups
    if len(saved["param_groups"]) != len(groups):
        raise _mismatch(where, f"{label} ({type(opt).__name__}) has {len(groups)} parameter groups, the checkpoint {len(saved['param_groups'])}")
    params: list[torch.Tensor] = []
    for gi, (lg, sg) in enumerate(zip(groups, saved["param_groups"])):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
            raise _corrupt(where, f"parameter group {gi} of {label} is malformed")
        if len(sg["params"]) != len(lg["params"]):
            raise _mismatch(where, f"parameter group {gi} of {label} holds {len(lg['params'])} parameters, the checkpoint's {len(sg['params'])}")
        extra = sorted(set(sg) - set(lg) - {"params", "param_names"})
        if extra:
            raise _mismatch(where, f"parameter group {gi} of {label} has no setting {extra[:5]} that the checkpoint's has: "
                                   f"the checkpoint was written by another optimizer than {type(opt).__name__}")
        if pnames is not None:
            names = pnames[len(params):len(params) + len(lg["params"])]
            if list(sg.get("param_names") or names) != names:
                raise _mismatch(where, f"parameter group {gi} of {label} holds other parameters than the checkpoint's "
                                       f"(e.g. {[n for n in sg['param_names'] if n not in names][:3]})")
        params.extend(lg["params"])
    for pid, st in saved.get("state", {}).items():
        if not isinstance(pid, int) or not 0 <= pid < len(params) or not isinstance(st, dict):
            raise _mismatch(where, f"{label} has {len(params)} parameters; the checkpoint holds state for parameter {pid!r}")
        p = params[pid]
        for k, v in st.items():
            if k in _ELEMENTWISE and isinstance(v, torch.Tensor) and v.shape != p.shape:
                name = pnames[pid] if pnames is not None else f"parameter {pid}"
                raise _mismatch(where, f"{label} state '{k}' of {name} is {list(v.shape)} in the checkpoint, the parameter is {_shape(p)}")


def _state_by_name(objs: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> dict[str, dict[str, Any]]:
    """The first optimizer's per-parameter state as saved: ``{fqn: {state: tensor or value}}``, from
    the ``optim/<state>/<fqn>`` tensors and ``optim.scalars``."""
    by_name: dict[str, dict[str, Any]] = {}
    for n, t in tensors.items():
        if n.startswith(OPTIM):
            parts = n.split("/", 2)
            if len(parts) != 3:
                raise _corrupt(where, f"optimizer tensor '{n}' is not named optim/<state>/<parameter>")
            by_name.setdefault(parts[2], {})[parts[1]] = t
    scalars = objs.get("optim.scalars") or {}
    if not isinstance(scalars, dict):
        raise _corrupt(where, "optim.scalars is not a mapping")
    for fqn, sc in scalars.items():
        if not isinstance(sc, dict):
            raise _corrupt(where, f"optim.scalars of '{fqn}' is not a mapping")
        by_name.setdefault(str(fqn), {}).update(sc)
    return by_name


def _plan_optimizer0(opt: Any, objs: dict[str, Any], tensors: dict[str, torch.Tensor], pnames: list[str], where: str) -> dict[str, Any]:
    """The first optimizer is saved by parameter name (``optim/<key>/<fqn>``): back to torch's form, checked."""
    saved_groups = objs["optim.param_groups"]
    if not isinstance(saved_groups, list):
        raise _corrupt(where, "optim.param_groups is not a list")
    by_name = _state_by_name(objs, tensors, where)
    unknown = sorted(set(by_name) - set(pnames))
    if unknown:
        raise _mismatch(where, f"the checkpoint holds optimizer state for parameters this run's optimizer does not hold: {unknown[:5]}")
    state = {i: by_name[n] for i, n in enumerate(pnames) if n in by_name}
    groups: list[dict[str, Any]] = []
    live = opt.state_dict()["param_groups"]
    for gi, sg in enumerate(saved_groups):
        if not isinstance(sg, dict):
            raise _corrupt(where, f"parameter group {gi} of the optimizer is not a mapping")
        names = sg.get("params")
        groups.append({**{k: v for k, v in sg.items() if k != "params"}, "param_names": names,
                       "params": live[gi]["params"] if gi < len(live) and isinstance(names, list) and len(names) == len(live[gi]["params"]) else names})
    sd = {"state": state, "param_groups": groups}
    _check_optimizer(opt, sd, where, "the optimizer", pnames)
    # What load_state_dict gets: the live group (ids and any key the checkpoint lacks) updated by the saved settings.
    sd["param_groups"] = [{**lg, **{k: v for k, v in sg.items() if k not in ("params", "param_names")}} for lg, sg in zip(live, groups)]
    return sd


def _plan_fsdp1_optimizer(opt: Any, objs: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    """The first optimizer of an FSDP1 model, as torch's state-dict API takes it back (keyed by
    parameter name; it flattens it onto the FSDP1 flat parameters): groups by count, names as saved."""
    groups = objs["optim.param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise _corrupt(where, "optim.param_groups is not a list of groups")
    if len(groups) != len(opt.param_groups):
        raise _mismatch(where, f"the optimizer ({type(opt).__name__}) has {len(opt.param_groups)} parameter groups, the checkpoint {len(groups)}")
    state = _state_by_name(objs, tensors, where)
    model = {n[len(MODEL):] for n in tensors if n.startswith(MODEL)}
    unknown = sorted(set(state) - model)
    if unknown:
        raise _mismatch(where, f"the checkpoint holds optimizer state for parameters the model does not hold: {unknown[:5]}")
    return {"state": state, "param_groups": [dict(g) for g in groups], "fsdp1": True}


def _plan_optimizers(live: Tracked, objs: dict[str, Any], tensors: dict[str, torch.Tensor], names: dict[int, str], where: str) -> list[Any]:
    opts = live.optimizers
    saved = (1 if "optim.param_groups" in objs else 0) + sum(1 for k in objs if k.startswith("optimizer."))
    if saved != len(opts):
        raise _mismatch(where, f"the checkpoint holds the state of {saved} optimizer(s), this run built {len(opts)} by its first iteration")
    out: list[tuple[Any, dict[str, Any]]] = []
    for i, opt in enumerate(opts):
        if i == 0 and "optim.param_groups" in objs and live.models and is_fsdp1(live.models[0]):
            out.append((opt, _plan_fsdp1_optimizer(opt, objs, tensors, where)))
        elif i == 0 and "optim.param_groups" in objs:
            pnames = [names.get(id(p), f"param.{k}") for k, p in enumerate(p for g in opt.param_groups for p in g["params"])]
            out.append((opt, _plan_optimizer0(opt, objs, tensors, pnames, where)))
        else:
            key = f"optimizer.{i}"
            if key not in objs:
                raise _mismatch(where, f"the checkpoint holds no state for optimizer #{i} ({type(opt).__name__})")
            _check_optimizer(opt, objs[key], where, f"optimizer #{i}")
            out.append((opt, objs[key]))
    return out


# ---------------------------------------------------------------- schedulers, scalers, tracked objects


def _plan_stateful(objs: dict[str, Any], live: list[Any], base: str, what: str, where: str) -> list[tuple[Any, Any]]:
    keys = [base if i == 0 else f"{base}.{i}" for i in range(len(live))]
    saved = [k for k in objs if k == base or k.startswith(f"{base}.")]
    if sorted(saved) != sorted(keys):
        raise _mismatch(where, f"the checkpoint holds {len(saved)} {what}(s), this run built {len(live)} by its first iteration")
    out: list[tuple[Any, Any]] = []
    for obj, key in zip(live, keys):
        sd, cur = objs[key], obj.state_dict()
        if not isinstance(sd, dict):
            raise _corrupt(where, f"the state of {key} is not a mapping")
        extra = sorted(set(sd) - set(cur))
        if extra or (cur and not sd):
            raise _mismatch(where, f"{key} ({type(obj).__name__}) does not match the checkpoint's (settings {extra[:5] or 'none'}): "
                                   f"another {what} was checkpointed")
        for k in ("base_lrs", "_last_lr"):
            if isinstance(cur.get(k), list) and isinstance(sd.get(k), list) and len(cur[k]) != len(sd[k]):
                raise _mismatch(where, f"{key} ({type(obj).__name__}) drives {len(cur[k])} parameter groups, the checkpoint's {len(sd[k])}")
        _check_tree(cur, sd, where, key)
        out.append((obj, sd))
    return out


def _grad_scalers(objs: dict[str, Any]) -> dict[str, Any]:
    """The AMP GradScaler states (``grad_scaler``, ``grad_scaler.<i>``). Stores written by
    Ravex before 0.2 kept them under ``loss_scaler``, the key DeepSpeed's own loss scaler
    has (``cur_scale``, ``dynamic``): those are read as GradScalers, a DeepSpeed one never is."""
    ours = {k: v for k, v in objs.items() if k == "grad_scaler" or k.startswith("grad_scaler.")}
    if ours:
        return ours
    old = {k: v for k, v in objs.items() if k == "loss_scaler" or k.startswith("loss_scaler.")}
    if old and all(isinstance(v, dict) and "cur_scale" not in v for v in old.values()):
        return {"grad_scaler" + k[len("loss_scaler"):]: v for k, v in old.items()}
    return {}


def _check_tree(live: Any, saved: Any, where: str, path: str) -> None:
    """Where the live state and the saved one both hold a tensor, shapes and dtypes agree."""
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live.shape != saved.shape or live.dtype != saved.dtype:
            raise _mismatch(where, f"{path} is {list(saved.shape)} {saved.dtype} in the checkpoint, {list(live.shape)} {live.dtype} live")
    elif isinstance(live, dict) and isinstance(saved, dict):
        for k in live.keys() & saved.keys():
            _check_tree(live[k], saved[k], where, f"{path}/{k}")
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        for i, (a, b) in enumerate(zip(live, saved)):
            _check_tree(a, b, where, f"{path}/{i}")


def _plan_tracked(live: Tracked, objs: dict[str, Any], where: str) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    tracked = objs.get("tracked") or {}
    if not isinstance(tracked, dict):
        raise _corrupt(where, "'tracked' is not a mapping")
    for name, obj in live.named.items():
        saved = tracked.get(name)
        if saved is None:
            log.warning("ravex: tracked object %r is not in the checkpoint; it starts fresh", name)
            continue
        _check_tree(obj.state_dict(), saved, where, f"tracked object {name!r}")
        out.append((obj, saved))
    return out


# ---------------------------------------------------------------- RNG and loaders


def _check_torch_state(t: Any, where: str, what: str, device: Any = "cpu") -> None:
    """A generator state: a uint8 tensor the size this generator's own state has, accepted by a scratch generator."""
    ref = torch.Generator(device=device).get_state()
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != ref.numel():
        got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise _corrupt(where, f"{what} is {got}, expected a uint8 tensor of {ref.numel()} bytes")
    try:
        torch.Generator(device=device).set_state(t)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _corrupt(where, f"{what} is refused by torch: {exc}") from None


def _check_rng(state: Any, where: str) -> None:
    if not isinstance(state, dict):
        raise _corrupt(where, "the RNG state is not a mapping")
    if "python" in state:
        py = state["python"]
        try:
            if not isinstance(py, (list, tuple)) or len(py) != 3 or not isinstance(py[1], (list, tuple)):
                raise ValueError("not (version, internal state, gauss_next)")
            random.Random().setstate((py[0], tuple(py[1]), py[2]))
        except (ValueError, TypeError, OverflowError) as exc:
            raise _corrupt(where, f"the Python random state is malformed: {exc}") from None
    if "torch" in state:
        _check_torch_state(state["torch"], where, "the torch RNG state")
    if "numpy" in state:
        import numpy as np

        st = state["numpy"]
        if (not isinstance(st, (list, tuple)) or len(st) != 5 or not isinstance(st[0], str) or not isinstance(st[1], np.ndarray)
                or st[1].dtype != np.uint32 or st[1].shape != (624,)):
            raise _corrupt(where, "the NumPy random state is not ('MT19937', 624 uint32 words, pos, has_gauss, cached_gaussian)")
        try:
            np.random.RandomState().set_state(tuple(st))
        except (ValueError, TypeError) as exc:
            raise _corrupt(where, f"the NumPy random state is refused by NumPy: {exc}") from None
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if not isinstance(cuda, list) or len(cuda) != torch.cuda.device_count():
            raise _mismatch(where, f"the checkpoint holds CUDA RNG states for {len(cuda) if isinstance(cuda, list) else '?'} devices, "
                                   f"this process sees {torch.cuda.device_count()}")
        for i, t in enumerate(cuda):
            _check_torch_state(t, where, f"the CUDA RNG state of device {i}", device=f"cuda:{i}")


def _plan_loaders(live: Tracked, objs: dict[str, Any], where: str) -> list[tuple[Any, LoaderState, dict[str, Any]]]:
    saved_l = objs.get("loaders") or []
    if not isinstance(saved_l, list):
        raise _corrupt(where, "'loaders' is not a list")
    out: list[tuple[Any, LoaderState, dict[str, Any]]] = []
    for i, (ld, st) in enumerate(live.loaders):
        if ld is None or i >= len(saved_l) or saved_l[i] is None:
            continue
        saved = saved_l[i]
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k, 0), int) for k in ("epoch", "consumed")):
            raise _corrupt(where, f"the position of DataLoader #{i} is malformed")
        gens = generators_of(ld)
        persistent: dict[str, Any] = saved["persistent"] if isinstance(saved.get("persistent"), dict) else {}
        for group, states in (("epoch_start", saved.get("epoch_start")), ("generators", saved.get("generators")),
                              ("persistent/base_start", persistent.get("base_start"))):
            states = states or {}
            if not isinstance(states, dict):
                raise _corrupt(where, f"{group} of DataLoader #{i} is not a mapping")
            for k, t in states.items():
                g = gens.get(k)
                if k == "torch" or g is not None:
                    _check_torch_state(t, where, f"{group}/{k} of DataLoader #{i}", device=g.device if g is not None and k != "torch" else "cpu")
        for group in ("start", "last"):
            workers = persistent.get(group) or {}
            if not isinstance(workers, dict):
                raise _corrupt(where, f"persistent/{group} of DataLoader #{i} is not a mapping")
            for w, states in workers.items():
                try:
                    if not str(w).isdigit():
                        raise ValueError(f"worker id {w!r} is not a number")
                    check_states(states)
                except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
                    raise _corrupt(where, f"the state of worker {w} (persistent/{group}) of DataLoader #{i} is malformed: {exc}") from None
        out.append((ld, st, saved))
    return out


# ---------------------------------------------------------------- plan, snapshot, apply


def plan(live: Tracked, ckpt: Checkpoint, tensors: dict[str, torch.Tensor], weights_only: bool, where: str) -> _Plan:
    """Read and check everything against the live objects; touches none of them."""
    try:
        objs = {k: unflatten(v, tensors) for k, v in ckpt.objects.items()}
    except RavexError as exc:
        raise _corrupt(where, exc.message) from None
    p = _Plan(models=_plan_models(tensors, live.models, where, weights_only))
    if weights_only:
        return p
    p.optimizers = _plan_optimizers(live, objs, tensors, live.param_names(), where)
    p.stateful = [*_plan_stateful(objs, live.schedulers, "lr_scheduler", "LR scheduler", where),
                  *_plan_stateful(_grad_scalers(objs), live.scalers, "grad_scaler", "GradScaler", where),
                  *_plan_tracked(live, objs, where)]
    if "rng" in objs:
        _check_rng(objs["rng"], where)
        p.rng = objs["rng"]
    p.loaders = _plan_loaders(live, objs, where)
    step = objs.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise _corrupt(where, f"step is {step!r}, not a non-negative integer")
    p.step = step
    return p


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
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state(legacy=True)
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _snapshot(p: _Plan) -> list[Callable[[], None]]:
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


def _apply(p: _Plan) -> None:
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
        for k, g in generators_of(ld).items():
            if k in (saved.get("generators") or {}):
                g.set_state(saved["generators"][k])


def _localize(p: _Plan) -> None:
    """Whole tensors from the checkpoint made into this rank's shards where the live state is sharded
    (DTensors: FSDP2), by slicing here (no collective: every rank holds the whole tensor): the
    model's tensors, and the optimizer state shaped like a sharded parameter. At any world size:
    the shards are cut to the live mesh, not the saved one."""
    from .state import _is_dtensor

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


def apply_plan(p: _Plan, where: str, undo: bool = True) -> int | None:
    """Put a checked plan into the live objects (see :func:`restore_into`). Without ``undo`` (a
    checkpoint with nothing to fall back on), no copy of the live state is kept: a failure midway
    raises :class:`ResumeError`."""
    _localize(p)
    if not undo:
        try:
            _apply(p)
        except Exception as exc:
            raise ResumeError(f"{where}: restoring failed midway ({type(exc).__name__}: {exc}); the live objects hold part of the "
                              "checkpoint, so the run stops", hint="start the script again; if it fails the same way, " + _SAME_RUN) from exc
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
                              hint="start the script again; if it fails the same way, " + _SAME_RUN) from exc
        raise RavexError(f"{where}: restoring failed midway ({type(exc).__name__}: {exc}); the live objects were put back as they were",
                         hint=_SAME_RUN) from exc
    return p.step


# ---------------------------------------------------------------- which checkpoint: newest first, falling back


_Found = tuple[Checkpoint, dict[str, torch.Tensor]]
_SAME_RUN_HINT = "resume with the model, optimizer and schedulers built as the checkpointed run built them"


class Resume:
    """Which checkpoint of a store a resume puts in, and the older ones it falls back on.

    ``pending`` is the one loaded (checksums verified) and not yet restored; ``index`` and
    ``label`` name the one being tried (``index`` is None for a checkpoint that is not one of
    this store's); ``unrestorable`` lists this store's checkpoints that were skipped, damaged or
    not fitting the live objects (while any is, keep_last prunes nothing), and ``failures`` why
    each checkpoint tried was skipped, for the error when none is left.
    """

    def __init__(self, store: Path, backend: str, source: str):
        self.store, self.backend, self.source = store, backend, source  # source: the configuration's, for hints
        self.pending: _Found | None = None
        self.index: int | None = None
        self.label = ""
        self.unrestorable: list[int] = []
        self.failures: list[str] = []
        self._candidates: Iterator[tuple[int | None, str, _Found]] = iter(())
        # resume_from names a checkpoint another program wrote: read into the live layout at restore
        self.foreign: Foreign | None = None
        # where the run came from, when it began from a foreign checkpoint (kept in every checkpoint it writes)
        self.origin: dict[str, Any] | None = None
        self.share: tuple[int, int] | None = None  # (rank, world size): the checksums this rank checks, of a foreign one
        # a rank of a job on many ranks: a native checkpoint's tensors are read when the live objects
        # exist, each rank its own rows of the sharded ones (loading.read_for), not whole at the start
        self.lazy = False
        self.bytes_read: int | None = None  # of the checkpoint restored, what this rank read (lazy and foreign ones)

    def restore(self, live: Tracked, rank: int | None = None) -> int | None:
        """Put ``pending`` into ``live``, all or nothing; one that does not fit is reported and the one
        before it tried. The step restored, or None when nothing is pending; :class:`ResumeError` when
        none is left to try, or a failed restore could not be undone. ``rank``: a rank of a job that
        has no process group (each rank restores alone, taking its own streams)."""
        while self.pending is not None:
            ckpt, tensors = self.pending
            try:
                if self.foreign is not None:
                    fitted = adapt(self.foreign, live, rank or 0)
                    ckpt, tensors = fitted.ckpt, fitted.tensors
                    p = plan(live, ckpt, tensors, bool(ckpt.source.get("weights_only")), self.label)
                    fitted.fill()
                    self.bytes_read = fitted.bytes_read
                    step = apply_plan(p, self.label, undo=False)
                else:
                    if rank is not None:
                        ckpt = for_rank(ckpt, rank, None)
                    if is_lazy(ckpt, tensors):
                        tensors, self.bytes_read = read_for(ckpt, live)
                    step = restore_into(live, ckpt, tensors, weights_only=False, where=self.label)
            except ResumeError:
                raise
            except Exception as exc:  # whatever the reason, nothing was restored: try the one before (foreign: stop)
                why = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
                if self.foreign is not None:
                    raise self._foreign_failed(why, exc) from exc
                log.error("ravex: %s cannot be restored into this run: %s", self.label, why)
                self.skipped(self.store, self.index, why if why.startswith(self.label) else f"{self.label}: {why}")
                self.pending = None
                del ckpt, tensors
                self.pending = self._next()
                continue
            self.pending = None  # restored: its tensors are no longer needed
            self._restored(ckpt)
            if self.unrestorable:
                log.warning("ravex: resumed from %s, not from the newest checkpoint: %s could not be used (see above)", self.label,
                            ", ".join(str(i) for i in self.unrestorable))
            return step if step is not None else int(ckpt.step or 0)
        return None

    def restore_agreed(self, live: Tracked, coord: Any, src: str | int | None, shared: bool = True) -> int | None:
        """:meth:`restore` on every rank of a job, agreed: rank 0 names the checkpoint; a rank that
        does not see it (its store is not rank 0's) gets it from rank 0; each rank takes its own
        random streams and data position from it and checks it against its live objects; it is
        put in only when every rank can, else every rank goes on to the one rank 0 tries next."""
        while True:
            named = coord.broadcast((self.index, self.label, self.pending[0].step) if coord.rank == 0 and self.pending is not None else None)
            if named is None:
                if self.pending is not None:
                    log.warning("ravex: rank %d has %s, but rank 0 resumes from nothing: this rank starts fresh too", coord.rank, self.label)
                self.pending = None
                return None
            index, label, step = named
            if coord.rank != 0 and not shared and self.foreign is None:
                # A store of its own (another machine): a checkpoint there with the same index may be
                # another run's; the state comes from rank 0's.
                self.pending = None
            elif coord.rank != 0 and (self.pending is None or self.index != index or self.pending[0].step != step):
                self.pending = None
                try:
                    self.pending = (load_checkpoint(self.store, index, lazy=self.lazy) if index is not None else self.find(src))
                except Exception:  # noqa: BLE001 - whatever it is, this rank gets it from rank 0 below
                    self.pending = None
                if self.pending is not None and self.pending[0].step != step:
                    self.pending = None
            have = coord.all_gather(self.pending is not None)
            if not all(have) and self.foreign is not None:
                raise ResumeError(f"{label}: rank(s) {[r for r, h in enumerate(have) if not h]} cannot read it",
                                  hint="put the checkpoint resume_from names where every rank reads it (the same path on each machine)")
            if not all(have):
                # Storage that not every rank sees: rank 0 sends what it loaded.
                ours = self.pending if coord.rank == 0 else None
                if ours is not None and is_lazy(*ours):
                    ours = (ours[0], read_for(ours[0], Tracked())[0])  # whole: the other ranks cannot read it
                sent = coord.broadcast((ours[0].step, ours[0].objects, ours[0].source, ours[1]) if ours is not None else None)
                if self.pending is None:
                    ckpt = Checkpoint("native", self.store, step=sent[0], objects=sent[1], source=sent[2])
                    self.pending = (ckpt, sent[3])
            self.index, self.label = index, label
            assert self.pending is not None
            ckpt, tensors = self.pending
            mine = ckpt
            err: str | None = None
            p: _Plan | None = None
            fitted: Adapted | None = None
            try:
                if self.foreign is not None:
                    fitted = adapt(self.foreign, live, coord.rank)
                    mine, tensors = fitted.ckpt, fitted.tensors
                else:
                    mine = for_rank(ckpt, coord.rank, coord.size)
                    if is_lazy(mine, tensors):
                        tensors, self.bytes_read = read_for(mine, live)  # this rank's rows of the sharded tensors
                p = plan(live, mine, tensors, bool(mine.source.get("weights_only")), label)
            except Exception as exc:  # noqa: BLE001 - reported to every rank: nobody restores it
                err = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
            errs = coord.all_gather(err)
            bad = [(r, e) for r, e in enumerate(errs) if e is not None]
            if not bad:
                assert p is not None
                failure: str | None = None
                try:
                    if fitted is not None:
                        fitted.fill()
                        self.bytes_read = fitted.bytes_read
                    restored = apply_plan(p, label, undo=fitted is None)
                except Exception as exc:  # noqa: BLE001 - told to every rank below
                    failure = exc.message if isinstance(exc, RavexError) else f"{type(exc).__name__}: {exc}"
                failures = [(r, f) for r, f in enumerate(coord.all_gather(failure)) if f is not None]
                if failures:
                    # Some rank holds the checkpoint and another does not: no rank may train on.
                    raise ResumeError(f"{label}: restoring failed on rank {failures[0][0]} ({failures[0][1]}); the ranks no longer "
                                      "hold one state, so the run stops before its first step",
                                      hint="start the job again; if it fails the same way, " + _SAME_RUN, path=self.store)
                self.pending = None
                self._restored(mine)
                return restored if restored is not None else int(mine.step or 0)
            why = "; ".join(f"rank {r}: {e}" for r, e in bad[:3])
            if self.foreign is not None:
                same = len({e for _, e in bad}) == 1
                raise self._foreign_failed(bad[0][1] if same else why, None)
            log.error("ravex: %s cannot be restored into this run: %s", label, why)
            self.skipped(self.store, index, f"{label}: {why}")
            del ckpt, tensors, mine, p
            self.pending = None
            stop: ResumeError | None = None
            if coord.rank == 0:
                try:
                    self.pending = self._next()
                except ResumeError as exc:
                    stop = exc
            verdict = coord.broadcast((stop.message, stop.hint) if stop is not None else None)
            if stop is not None:
                raise stop
            if verdict is not None:
                raise ResumeError(f"rank 0 found no checkpoint every rank can resume from: {verdict[0]}", hint=verdict[1], path=self.store)

    def find(self, src: str | int | None) -> _Found | None:
        """The checkpoint named by ``src`` (an index of the store, a store, a checkpoint directory, a ``.pt``
        file: what ``resume_from`` names), or with None the newest complete one; None when the store has
        none. Damaged ones are skipped (newest first); the older ones are kept to fall back on."""
        self._candidates, self.failures, self.foreign = iter(()), [], None
        source = self.source
        if isinstance(src, str) and is_foreign(src):
            return self._foreign_start(src)
        if isinstance(src, str) and src.endswith(".pt"):
            return self._only(None, f"checkpoint {src}", load_torch_save(Path(src)))
        if isinstance(src, int) and self.backend == "torch_save":
            files = torch_save_files(self.store)
            found = files.get(src) if src >= 0 else (list(files.values())[src] if -src <= len(files) else None)
            if found is None:
                raise RavexError(f"resume_from {src}: {self.store} holds no such checkpoint (it has {len(files)})", hint="use -1 for the newest")
            return self._only(int(found.name[5:13]), f"checkpoint {found}", load_torch_save(found))
        if isinstance(src, str):
            p = Path(src)
            if (p / "ravex-store.json").is_file():
                self._candidates = self._native_candidates(p)
                return self._next(first=True)
            if (p / "checkpoint.json").is_file():
                return self._only(None, f"checkpoint {p}", load_checkpoint(p))
            raise RavexError(f"resume_from {src}: neither a Ravex store nor a checkpoint directory of one",
                             hint=f"set resume_from in {source} to a store, a checkpoints/<index> directory, or an index", path=p)
        if isinstance(src, int):
            ckpt, tensors = load_checkpoint(self.store, src, lazy=self.lazy)
            index = ckpt.source.get("index")
            return self._only(index, f"checkpoint {index} (step {ckpt.step}) of {self.store}", (ckpt, tensors))
        if self.backend == "torch_save":
            self._candidates = self._torch_save_candidates()
            return self._next(first=True)
        if not (self.store / "ravex-store.json").is_file():
            return None
        self._candidates = self._native_candidates(self.store)
        return self._next(first=True)

    def _foreign_start(self, src: str) -> _Found | None:
        """``resume_from`` names another program's checkpoint: it is the start, unless the store
        already holds checkpoints of the run that began from it (a restart after a kill), which
        then go on from the store's newest."""
        f = open_foreign(src, self.share)
        if self.backend == "torch_save":
            own = self._torch_save_candidates()
        elif (self.store / "ravex-store.json").is_file():
            own = self._native_candidates(self.store)
        else:
            own = iter(())
        first = next(own, None)
        if first is None and self.failures:
            self._next()  # the store's checkpoints are all damaged: raises, never starts over
        if first is not None:
            extra = first[2][0].objects.get("extra")
            origin = extra.get(ORIGIN_KEY) if isinstance(extra, dict) else None
            if not (isinstance(origin, dict) and origin.get("path") == str(f.path)):
                raise ResumeError(f"{self.store} already holds checkpoints of a run that did not begin from {f.label}, which "
                                  f"resume_from names (in {self.source})",
                                  hint="give this run its own storage.path (an empty directory), or remove resume_from to continue "
                                       "the store's own run", path=self.store)
            log.warning("ravex: the store already holds checkpoints of the run that began from %s: it goes on from the store's newest", f.label)
            self._candidates = itertools.chain([first], own)
            return self._next(first=True)
        self.foreign = f
        return self._only(None, f.label, (f.ckpt, {}))

    def _foreign_failed(self, why: str, exc: BaseException | None) -> ResumeError:
        hint = exc.hint if isinstance(exc, RavexError) and exc.hint else "resume with the model, optimizer and schedulers the saved run built"
        return ResumeError(f"{self.label} cannot be resumed into this run: {why.removeprefix(self.label + ': ')}", hint=hint,
                           path=self.foreign.path if self.foreign is not None else None)

    def _restored(self, ckpt: Checkpoint) -> None:
        """Remember where the run began: the foreign checkpoint, or what the restored one says."""
        if self.foreign is not None:
            self.origin = self.foreign.origin()
            return
        extra = ckpt.objects.get("extra")
        origin = extra.get(ORIGIN_KEY) if isinstance(extra, dict) else None
        self.origin = origin if isinstance(origin, dict) else None

    def _only(self, index: int | None, label: str, found: _Found) -> _Found:
        """A checkpoint the configuration (or the caller) names: nothing to fall back on."""
        self.index, self.label = index, label
        log.warning("ravex: resuming from %s", label)
        return found

    def _next(self, first: bool = False) -> _Found | None:
        """The next checkpoint to try, newest first; None when there is none left."""
        for index, label, found in self._candidates:
            self.index, self.label = index, label
            log.warning("ravex: %s %s", "resuming from" if first else "falling back to", label)
            return found
        self.index = None
        if self.failures:
            # Every checkpoint there is was tried: never start over on a store whose checkpoints are all damaged.
            more = f"\n  ... and {len(self.failures) - 5} older ones" if len(self.failures) > 5 else ""
            raise ResumeError(f"{self.store}: no checkpoint of the store can be resumed from:\n  - " + "\n  - ".join(self.failures[:5]) + more,
                              hint="fix what the error names (" + _SAME_RUN_HINT + "), restore the store from a copy, "
                                   "or set fresh: true (RAVEX_FRESH=1) to start over", path=self.store)
        return None

    def skipped(self, store: Path, index: int | None, why: str) -> None:
        self.failures.append(why)
        if store == self.store and index is not None and index not in self.unrestorable:
            self.unrestorable.append(index)

    def _native_candidates(self, store: Path) -> Iterator[tuple[int | None, str, _Found]]:
        from ravex_convert.formats.native import reader as native

        manifest = native.read_manifest(store)
        entries = [e for e in manifest["checkpoints"] if isinstance(e, dict) and e.get("status") == "complete"]
        for e in reversed(entries):
            index = int(e["index"])
            try:
                ckpt, tensors = load_checkpoint(store, index, lazy=self.lazy)
            except RavexError as exc:  # CorruptCheckpointError, IncompleteCheckpointError and the rest: skip it
                log.warning("ravex: checkpoint %s of %s is damaged and is skipped: %s", index, store, exc)
                self.skipped(store, index, exc.message)
                continue
            yield (index if store == self.store else None), f"checkpoint {index} (step {ckpt.step}) of {store}", (ckpt, tensors)

    def _torch_save_candidates(self) -> Iterator[tuple[int | None, str, _Found]]:
        for i, path in reversed(list(torch_save_files(self.store).items())):
            try:
                found = load_torch_save(path)
            except Exception as exc:  # noqa: BLE001 - torch.load reports damage in many exception types
                log.warning("ravex: checkpoint %s is damaged and is skipped: %s", path, exc)
                self.skipped(self.store, i, f"checkpoint {path}: {exc}")
                continue
            yield i, f"checkpoint {i} (step {found[0].step}) of {self.store}", found
