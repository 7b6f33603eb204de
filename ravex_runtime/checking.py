"""Whether a checkpoint fits the live objects: the first phase of a restore, which touches nothing.

:func:`plan` reads everything the checkpoint holds and checks it against the
live objects — every model tensor's name, shape and dtype, the optimizers'
parameter groups and state, schedulers, scalers, tracked objects, every RNG
state (each one tried on a scratch generator), each loader's position — and
returns a :class:`Plan`: what to load into what, already checked. A checkpoint
that does not fit raises :class:`~ravex_convert.errors.LayoutMismatchError`, a
damaged one :class:`~ravex_convert.errors.CorruptCheckpointError`, and the run
can fall back to an older one. Applying the plan is restoring.py's.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from ravex_convert.errors import CorruptCheckpointError, LayoutMismatchError, RavexError
from ravex_convert.model import MODEL, OBJ, OPTIM, Checkpoint

from .sampler import LoaderState, generators_of
from .state import Tracked, is_fsdp1, unflatten
from .workers import check_states

__all__ = ["SAME_RUN", "Plan", "plan"]

log = logging.getLogger("ravex")

# Per-parameter optimizer state of torch.optim's element-wise optimizers: shaped like the parameter.
# (Other keys, e.g. Adafactor's row/column factors or scalar steps, are not shape-checked.)
_ELEMENTWISE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta",
                          "grad_avg", "ax", "prev", "step_size", "exp_inf"})
SAME_RUN = "resume with the model, optimizer and schedulers built as the checkpointed run built them, or set fresh: true to start over"


def _mismatch(where: str, what: str) -> LayoutMismatchError:
    return LayoutMismatchError(f"{where}: {what}", hint=SAME_RUN)


def _corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}", hint="the checkpoint is damaged; Ravex uses the one before it, or remove it")


@dataclass
class Plan:
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


def _match_loaders(live: Tracked, saved_l: list[Any]) -> list[tuple[int, int]]:
    """(live position, saved position) of each live DataLoader that has a saved one: in order, the
    first saved one of the same identity not taken yet (sampler.identity); a saved one without an
    identity (an older checkpoint), or a live one none matches, by the same position."""
    taken: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for i, (ld, st) in enumerate(live.loaders):
        if ld is None:
            continue
        j = next((j for j, s in enumerate(saved_l) if j not in taken and isinstance(s, dict) and s.get("identity") == st.identity), None)
        if j is None and i < len(saved_l) and i not in taken and saved_l[i] is not None and "identity" not in saved_l[i]:
            j = i
        if j is not None:
            taken.add(j)
            pairs.append((i, j))
    return pairs


def _plan_loaders(live: Tracked, objs: dict[str, Any], where: str) -> list[tuple[Any, LoaderState, dict[str, Any]]]:
    saved_l = objs.get("loaders") or []
    if not isinstance(saved_l, list):
        raise _corrupt(where, "'loaders' is not a list")
    out: list[tuple[Any, LoaderState, dict[str, Any]]] = []
    for j, saved in enumerate(saved_l):
        if saved is not None and not (isinstance(saved, dict) and all(isinstance(saved.get(k, 0), int) for k in ("epoch", "consumed"))
                                      and isinstance(saved.get("identity", ""), str)):
            raise _corrupt(where, f"the position of DataLoader #{j} is malformed")
    for i, j in _match_loaders(live, saved_l):
        ld, st = live.loaders[i]
        saved = saved_l[j]
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
        held = saved.get("held") or []
        if not isinstance(held, list) or not all(isinstance(h, dict) for h in held):
            raise _corrupt(where, f"the read-ahead states of DataLoader #{i} are not a list of random states")
        for h in held:
            _check_rng(h, where)
        if not isinstance(saved.get("wrapper_epoch", 0), int):
            raise _corrupt(where, f"the wrapper's epoch of DataLoader #{i} is not an integer")
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



# ---------------------------------------------------------------- the plan


def plan(live: Tracked, ckpt: Checkpoint, tensors: dict[str, torch.Tensor], weights_only: bool, where: str) -> Plan:
    """Read and check everything against the live objects; touches none of them."""
    try:
        objs = {k: unflatten(v, tensors) for k, v in ckpt.objects.items()}
    except RavexError as exc:
        raise _corrupt(where, exc.message) from None
    p = Plan(models=_plan_models(tensors, live.models, where, weights_only))
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
