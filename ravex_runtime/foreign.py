"""Resuming from a checkpoint another program wrote (``resume_from``: a DeepSpeed ZeRO checkpoint,
a DCP directory, a torch.save file, a safetensors file).

The converters read it (:func:`open_foreign`: described, nothing loaded). At the first iteration
boundary, when the model, optimizer, schedulers and loaders exist, :func:`adapt` turns it into the
runtime's own form, fitted to the live objects:

- every model tensor is read straight into the live dtype (DeepSpeed's fp32 masters are cast where
  the live parameters are bf16: said once), and where the live parameter is an FSDP2 shard, only
  this rank's rows are read;
- the optimizer state is matched by parameter name; the parameter groups must hold the same
  parameters as the saved ones, and their hyper-parameters are the checkpoint's (a live value that
  differs is reported);
- an LR scheduler of the same kind takes the saved state; of another kind (or with none saved) it
  is set to the saved step count;
- the first DataLoader skips the samples the saved run trained on (DeepSpeed's ``global_samples``;
  else the step count times this run's global batch).

What comes out is checked by :mod:`.restoring` like one of Ravex's own checkpoints. Every mismatch
raises before anything is touched, naming the tensor or the group; only then are the bytes read,
the weights straight into the live parameters. There is nothing to fall back on (the run stops
when a foreign checkpoint cannot be put in), so no copy of the live state is kept to undo it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ravex_convert._names import prefix_hint, prefix_match
from ravex_convert.errors import LayoutMismatchError, RavexError
from ravex_convert.model import MODEL, OPTIM, Checkpoint, LogicalTensor, Region, TensorLink
from ravex_convert.objects import RESUMED_FROM
from ravex_convert.storage import resolve

from .loading import TS_FILE, as_shard, read_regions, shard_box
from .sampler import _distributed_sampler, _sampler_of
from .state import Tracked, _is_dtensor, is_fsdp1, tensor_view

__all__ = ["ORIGIN_KEY", "Adapted", "Foreign", "adapt", "is_foreign", "open_foreign", "open_init"]

log = logging.getLogger("ravex")

# In every checkpoint a run resumed from a foreign one writes (objects["extra"]): where it came
# from. A later start with the same resume_from continues from the store instead.
ORIGIN_KEY = RESUMED_FROM

# Settings of torch.optim that choose an implementation, not the training: the live ones are kept.
_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})
_TITLES = {"zero": "DeepSpeed ZeRO", "dcp": "DCP", "torch_save": "torch.save", "safetensors": "safetensors", "native": "Ravex store"}


@dataclass
class Foreign:
    """A checkpoint another program wrote, as the converters read it (nothing loaded)."""

    path: Path
    format: str
    ckpt: Checkpoint

    @property
    def title(self) -> str:
        return _TITLES.get(self.format, self.format)

    @property
    def label(self) -> str:
        step = f" (step {self.ckpt.step})" if self.ckpt.step is not None else ""
        return f"{self.title} checkpoint {self.path}{step}"

    def origin(self) -> dict[str, Any]:
        return {"format": self.format, "path": str(self.path), "step": self.ckpt.step}


def is_foreign(src: str) -> bool:
    """``src`` (a path) is no checkpoint of Ravex's own runtime: not a store, not one of its
    checkpoint directories, not a file of its torch_save backend."""
    p = resolve(src).path
    if (p / "ravex-store.json").is_file() or (p / "checkpoint.json").is_file():
        return False
    return not (p.is_file() and TS_FILE.fullmatch(p.name) is not None)


def open_foreign(src: str, share: tuple[int, int] | None = None) -> Foreign:
    """Detect and describe ``src`` (errors name the path and what Ravex reads). ``share``: (rank,
    world size) of a job whose every rank opens it: each checks the CRC-32s of its share of a
    DeepSpeed checkpoint's storages (every one is checked, once)."""
    from ravex_convert.detect import detect
    from ravex_convert.formats import registry

    d = detect(src)
    if d.format == "native":
        raise RavexError(f"resume_from {src}: a Ravex store's file, not the store", hint="point resume_from at the store directory", path=d.path)
    fmt = registry.get(d.format)
    return Foreign(d.path, d.format, fmt.read(d.path, **fmt.given(crc_share=share)))


def open_init(src: str, share: tuple[int, int] | None = None) -> Foreign:
    """``init_from``: a Ravex store (its newest complete checkpoint) or any checkpoint
    :func:`open_foreign` takes, described, nothing loaded."""
    p = resolve(src).path
    if (p / "ravex-store.json").is_file():
        from ravex_convert.formats.native import reader as native

        return Foreign(p, "native", native.read(p))
    if (p / "checkpoint.json").is_file():
        raise RavexError(f"init_from {src}: one checkpoint directory of a Ravex store", hint=f"name the store ({p.parent.parent}): its newest "
                         "complete checkpoint is used", path=p)
    return open_foreign(src, share)


def _mismatch(f: Foreign, what: str, hint: str) -> LayoutMismatchError:
    return LayoutMismatchError(f"{f.label}: {what}", hint=hint, path=f.path)


def _dtype(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


# ---------------------------------------------------------------- names


def name_map(f: Foreign, saved: list[str], live: list[str], tied: dict[str, str] | None = None) -> dict[str, str]:
    """live name -> the checkpoint's name of the same tensor. Names that differ only by a wrapper's
    prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``, on either side) are matched, and
    that is said; a tied parameter's second name (``tied``: name -> the first one) may be missing
    (safetensors keeps one of them); any other difference raises, naming the tensors."""
    tied = tied or {}
    try:
        return _name_map(f, saved, live)
    except LayoutMismatchError as exc:
        rest = [n for n in live if n not in tied]
        if len(rest) == len(live):
            raise
        try:
            out = _name_map(f, saved, rest)
        except LayoutMismatchError:
            raise exc from None  # the error naming every live name
        return {**out, **{n: out[first] for n, first in tied.items() if first in out}}


def _name_map(f: Foreign, saved: list[str], live: list[str]) -> dict[str, str]:
    found = prefix_match(saved, live)
    if found is not None:
        ps, pl = found
        if ps or pl:
            log.warning("ravex: the checkpoint's tensor names %s the live model's %s: matched without it",
                        f"start with '{ps}'" if ps else "have no prefix", f"start with '{pl}'" if pl else "have none")
        return {n: ps + n[len(pl):] for n in live}
    want = set(saved)
    missing = sorted(set(live) - want)
    extra = sorted(want - set(live))
    hint = "build the model the saved run trained (the same modules and names)"
    why = prefix_hint(live, saved, "model's", "checkpoint's")
    if why is not None:
        hint = f"{why} (Ravex matches names that differ by such a wrapper prefix alone): {hint}"
    what = []
    if missing:
        what.append(f"{len(missing)} of the model's tensors are not in it ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    if extra:
        what.append(f"it holds {len(extra)} tensors the model does not ({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})")
    raise _mismatch(f, "; ".join(what), hint)


# ---------------------------------------------------------------- reading into the live layout


class _Reads:
    """The tensors to read, each laid out as its live counterpart on this rank: one job for all of
    them, run by :meth:`run` once everything is checked. A model tensor is read straight into the
    live one's memory where it can be (nothing else holds a second copy of the weights)."""

    def __init__(self, f: Foreign):
        self.f = f
        self.items: list[tuple[LogicalTensor, Region, bytearray | memoryview, str | None]] = []
        self.cast: list[str] = []
        self.nbytes = 0  # read by run(): model and optimizer tensors, all a foreign read takes
        self._into: set[tuple[int, tuple[int, ...]]] = set()  # live memory already read into (a tied tensor's second name)

    def like(self, t: LogicalTensor, live: torch.Tensor, what: str, *, into_live: bool = False) -> torch.Tensor:
        """A tensor for ``t`` laid out as ``live``, in ``live``'s dtype: this rank's shard (a DTensor)
        where ``live`` is an FSDP2 shard (:func:`.loading.shard_box`), else the whole tensor.
        ``into_live``: ``live``'s own memory, where it is a contiguous CPU tensor (then ``live`` is
        returned)."""
        if tuple(t.shape) != tuple(live.shape):
            raise _mismatch(self.f, f"{what} is {list(t.shape)} {t.dtype} in the checkpoint, {list(live.shape)} {_dtype(live.dtype)} in this run",
                            "build the model (and its optimizer) with the shapes the saved run had")
        dtype = _dtype(live.dtype)
        if dtype != t.dtype:
            if not (live.dtype.is_floating_point and t.dtype in ("float32", "float64", "float16", "bfloat16")):
                raise _mismatch(self.f, f"{what} is {t.dtype} in the checkpoint and {dtype} in this run",
                                "give the tensor the dtype the saved run had")
            self.cast.append(f"{what} {t.dtype} -> {dtype}")
        box = shard_box(live)
        if box is not None:
            mine: torch.Tensor = cast(Any, live)._local_tensor
            if into_live and tuple(mine.shape) == box.sizes and mine.is_contiguous():
                return self._into_live(t, box, mine, dtype, live)
            local = torch.empty(box.sizes, dtype=live.dtype)
            self._add(t, box, local, dtype)
            return as_shard(local, live)
        if into_live and live.device.type == "cpu" and not _is_dtensor(live) and live.is_contiguous():
            return self._into_live(t, t.whole(), live, dtype, live)
        whole = torch.empty(tuple(t.shape), dtype=live.dtype)  # on the CPU: the restore moves it where the live one is
        self._add(t, t.whole(), whole, dtype)
        return whole

    def _into_live(self, t: LogicalTensor, region: Region, memory: torch.Tensor, dtype: str, live: torch.Tensor) -> torch.Tensor:
        key = (memory.data_ptr(), tuple(memory.shape))
        if key not in self._into:
            self._into.add(key)
            self._add(t, region, memory, dtype)
        return live

    def as_saved(self, t: LogicalTensor) -> torch.Tensor:
        whole = torch.empty(tuple(t.shape), dtype=getattr(torch, t.dtype))
        self._add(t, t.whole(), whole, None)
        return whole

    def _add(self, t: LogicalTensor, region: Region, out: torch.Tensor, dtype: str | None) -> None:
        if out.numel():
            self.items.append((t, region, tensor_view(out), dtype))

    def run(self) -> None:
        read_regions(self.items)
        self.nbytes = sum(len(view) for _, _, view, _ in self.items)
        self.items = []


@dataclass
class Adapted:
    """A foreign checkpoint fitted to the live objects. ``tensors`` hold no bytes until :meth:`fill`
    (some of them are the live tensors themselves): call it once the plan is checked."""

    ckpt: Checkpoint
    tensors: dict[str, torch.Tensor]
    reads: _Reads

    def fill(self) -> None:
        self.reads.run()

    @property
    def bytes_read(self) -> int:
        return self.reads.nbytes


# ---------------------------------------------------------------- adapt


def adapt(f: Foreign, live: Tracked, rank: int, *, weights_only: bool = False) -> Adapted:
    """``f`` in the runtime's form, fitted to ``live`` (this rank's part of each sharded tensor read,
    nothing else): what :func:`.restoring.plan` checks and puts in. Raises
    :class:`LayoutMismatchError` for anything that does not fit, before anything is read.
    ``weights_only`` (``init_from``): the model's tensors alone; the optimizer, schedulers, step and
    data position are the live run's, fresh."""
    ckpt = f.ckpt
    if not live.models:
        raise _mismatch(f, "no model is known at the first iteration boundary", "build the model before the training loop's first iteration")
    if len(live.models) > 1:
        raise _mismatch(f, f"this run built {len(live.models)} models; a checkpoint of another program holds one",
                        "resume a run with one model from it")
    model = live.models[0]
    if is_fsdp1(model):
        raise _mismatch(f, "the model is wrapped in FSDP1 (FullyShardedDataParallel), which a resume from another program's checkpoint "
                           "does not take yet", "shard it with FSDP2's fully_shard, or convert the checkpoint first "
                           "(ravex convert SRC OUT --to dcp) and load that with torch's dcp.load")
    reads = _Reads(f)
    tensors: dict[str, torch.Tensor] = {}
    live_sd = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    first: dict[int, str] = {}
    tied = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    names = name_map(f, ckpt.model_names(), list(live_sd), {n: t for n, t in tied.items() if n != t and n in live_sd})
    for k, v in live_sd.items():
        tensors[MODEL + k] = reads.like(ckpt.resolve(MODEL + names[k]), v, f"tensor '{k}'", into_live=True)
    objs: dict[str, Any] = {}
    if not weights_only:
        _optimizer(f, live, names, reads, tensors, objs)
    if reads.cast and rank == 0:
        log.warning("ravex: %d tensors of %s are cast to this run's dtype (e.g. %s)", len(reads.cast), f.label, reads.cast[0])
    step = ckpt.step if isinstance(ckpt.step, int) and not isinstance(ckpt.step, bool) else None
    if objs:
        _schedulers(f, live, objs, step)
        _loaders(f, live, objs, step, rank)
        objs["step"] = step if step is not None else 0
    weights_only = not objs
    for i, sc in enumerate(live.scalers if not weights_only else []):  # DeepSpeed's own loss scaler is another object: a GradScaler starts fresh
        objs["grad_scaler" if i == 0 else f"grad_scaler.{i}"] = sc.state_dict()
    out = Checkpoint(f"foreign:{f.format}", f.path, world_size=ckpt.world_size, step=None if weights_only else step, objects=objs,
                     source={"weights_only": weights_only})
    return Adapted(out, tensors, reads)


def _optimizer(f: Foreign, live: Tracked, names: dict[str, str], reads: _Reads, tensors: dict[str, torch.Tensor], objs: dict[str, Any]) -> None:
    ckpt = f.ckpt
    saved_groups = ckpt.objects.get("optim.param_groups")
    # keyed by position, and the reader could not tell which parameter each is (Accelerate's optimizer.bin by shape)
    unnamed = ckpt.source.get("optimizer_error") is not None
    has_state = unnamed or any(n.startswith(OPTIM) for n in ckpt.tensors)
    if not live.optimizers:
        if has_state:
            log.warning("ravex: %s holds optimizer state, but this run has no optimizer by its first iteration: only the weights are loaded", f.label)
        return
    if not has_state and not isinstance(saved_groups, list):
        log.warning("ravex: %s holds weights only: the optimizer, LR schedulers and data position start fresh", f.label)
        return
    if len(live.optimizers) > 1:
        raise _mismatch(f, f"this run built {len(live.optimizers)} optimizers; the checkpoint holds the state of one",
                        "resume a run with one optimizer from it")
    opt = live.optimizers[0]
    pn = live.param_names()
    live_groups = [[names.get(pn.get(id(p), ""), pn.get(id(p), "?")) for p in g["params"]] for g in opt.param_groups]
    from ravex_convert.formats import registry

    positional = unnamed or (isinstance(saved_groups, list) and saved_groups and any(isinstance(p, int) for g in saved_groups for p in g.get("params", [])))
    if positional and "param_names" in registry.get(f.format).options:
        # Keyed by position (torch.save, Accelerate, HF Trainer): the live optimizer's order names them, as --param-names would.
        order = [n for g in live_groups for n in g]
        ckpt = f.ckpt = registry.get(f.format).read(f.path, param_names=order)
        saved_groups = ckpt.objects.get("optim.param_groups")
    err = ckpt.source.get("optimizer_error")
    if err is not None:
        raise _mismatch(f, f"its optimizer state cannot be matched to parameters: {err}",
                        "build the optimizer's parameter groups as the saved run did (the same parameters in the same order)")
    if not isinstance(saved_groups, list):
        raise _mismatch(f, "it holds optimizer state but no parameter groups", "resume from a checkpoint that saved the optimizer whole")
    live_pnames = {v: k for k, v in names.items()}  # the checkpoint's name -> the live one
    _groups(f, opt, saved_groups, live_groups, live_pnames, bool(live.schedulers), objs)
    # State by parameter name, for the parameters the live optimizer holds.
    params = {n: p for g, lg in zip(opt.param_groups, live_groups) for p, n in zip(g["params"], lg)}
    by_name: dict[str, dict[str, LogicalTensor]] = {}
    for n, t in ckpt.tensors.items():
        if n.startswith(OPTIM):
            parts = n.split("/", 2)
            if len(parts) == 3:
                by_name.setdefault(parts[2], {})[parts[1]] = t
    found = ckpt.objects.get("optim.state")
    scalars: dict[str, Any] = found if isinstance(found, dict) else {}
    unknown = sorted(set(by_name) - set(params))
    if unknown:
        raise _mismatch(f, f"it holds optimizer state for parameters this run's optimizer does not train: {', '.join(unknown[:5])}",
                        "train the same parameters as the saved run (a parameter it froze is frozen here too)")
    without = sorted(n for n in params if n not in by_name and n not in scalars)
    if by_name and without:
        raise _mismatch(f, f"it holds no optimizer state for {len(without)} parameters this run trains ({', '.join(without[:5])})",
                        "freeze what the saved run froze (requires_grad=False), or put those parameters in no optimizer")
    kept_scalars: dict[str, Any] = {}
    for n, states in by_name.items():
        p, fqn = params[n], live_pnames.get(n, n)
        for s, t in states.items():
            if tuple(t.shape) == tuple(p.shape) and t.shape:
                tensors[f"{OPTIM}{s}/{fqn}"] = reads.like(t, p.detach(), f"optimizer state '{s}' of '{fqn}'")
            elif not t.shape:
                tensors[f"{OPTIM}{s}/{fqn}"] = reads.as_saved(t)
            else:
                raise _mismatch(f, f"optimizer state '{s}' of '{fqn}' is {list(t.shape)} in the checkpoint, the parameter {list(p.shape)}",
                                "resume with the optimizer the saved run used")
    for n, sc in scalars.items():
        if n in params and isinstance(sc, dict):
            kept_scalars[live_pnames.get(n, n)] = dict(sc)
    if kept_scalars:
        objs["optim.scalars"] = kept_scalars


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _groups(f: Foreign, opt: Any, saved: list[Any], live_groups: list[list[str]], to_live: dict[str, str], scheduled: bool,
            objs: dict[str, Any]) -> None:
    """The saved parameter groups mapped onto the live ones: the same parameters in each (by name),
    the checkpoint's hyper-parameters (differences said once)."""
    def layout(groups: list[list[str]]) -> str:
        return "; ".join(f"group {i}: {len(g)} ({', '.join(g[:3])}{', ...' if len(g) > 3 else ''})" for i, g in enumerate(groups))

    saved_names = [[str(p) for p in g.get("params", [])] if isinstance(g, dict) else [] for g in saved]
    help_ = (f"build the optimizer's parameter groups as the saved run did: {layout(saved_names)} (`ravex inspect` lists them; "
             "the order within a group does not matter)")
    if len(saved) != len(live_groups):
        raise _mismatch(f, f"it holds {len(saved)} parameter groups, this run's optimizer ({type(opt).__name__}) {len(live_groups)}: "
                           f"{layout(live_groups)}", help_)
    out, said, dropped = [], [], set()
    for gi, (sg, lg, names) in enumerate(zip(saved, opt.param_groups, live_groups)):
        if set(saved_names[gi]) != set(names):
            gone, new = sorted(set(saved_names[gi]) - set(names)), sorted(set(names) - set(saved_names[gi]))
            raise _mismatch(f, f"parameter group {gi} holds other parameters in the checkpoint than in this run (only in the checkpoint: "
                               f"{gone[:3] or 'none'}, only here: {new[:3] or 'none'})", help_)
        hyper = {k: v for k, v in sg.items() if k not in ("params", "param_names")}
        if not hyper:
            raise _mismatch(f, f"parameter group {gi} has no hyper-parameters in it (lr, betas, weight decay: DeepSpeed's "
                               "elastic_checkpoint saves leave them out), so the optimizer cannot be continued as it was",
                            "save the run again without elastic_checkpoint, or start from its weights with ravex.load_weights()")
        used: dict[str, Any] = {}
        for k, v in hyper.items():
            if k in _IMPLEMENTATION:
                continue
            if k not in lg:
                dropped.add(k)
                continue
            used[k] = v
            if k == "lr" and scheduled:
                continue  # driven by the scheduler: its saved value is the one to continue from
            if not _same(lg[k], v):
                said.append(f"group {gi} {k}: {lg[k]!r} here, {v!r} in the checkpoint")
        out.append({**used, "params": [to_live.get(n, n) for n in names]})
    if said:
        log.warning("ravex: this run's optimizer settings differ from the checkpoint's; the checkpoint's are used: %s", "; ".join(said))
    if dropped:
        log.warning("ravex: the checkpoint's parameter groups have settings %s that %s does not take: left out", sorted(dropped), type(opt).__name__)
    objs["optim.param_groups"] = out


# ---------------------------------------------------------------- schedulers and data position


def _links(value: Any) -> bool:
    """``value`` holds a tensor (a link to one the checkpoint stores): not taken whole."""
    if isinstance(value, TensorLink):
        return True
    if isinstance(value, dict):
        return any(_links(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_links(v) for v in value)
    return False


def _scheduler_steps(saved: Any) -> int | None:
    """The step count a saved scheduler state stands for: torch's ``last_epoch``, DeepSpeed's
    ``last_batch_iteration`` (which counts from -1)."""
    if not isinstance(saved, dict):
        return None
    for key, shift in (("last_epoch", 0), ("last_batch_iteration", 1)):
        v = saved.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v + shift
    return None


def _saved_scheduler(ckpt: Checkpoint) -> Any:
    """The first LR scheduler's saved state: Ravex's ``lr_scheduler`` object (DeepSpeed, the HF
    Trainer's ``scheduler.pt``, Accelerate's ``scheduler.bin``), torchtitan's ``lr_scheduler``
    key, or the first of a Lightning ``.ckpt``'s ``lr_schedulers``."""
    found = ckpt.objects.get("lr_scheduler")
    extra = ckpt.objects.get("extra")
    if found is None and isinstance(extra, dict):
        found = extra.get("lr_scheduler")
        several = extra.get("lr_schedulers")
        if found is None and isinstance(several, list) and several:
            found = several[0]
    return found


def _lightning_batches(ckpt: Checkpoint) -> int | None:
    """The training batches a Lightning ``.ckpt`` records as done (its fit loop's progress)."""
    extra = ckpt.objects.get("extra")
    loops = extra.get("loops") if isinstance(extra, dict) else None
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    progress = fit.get("epoch_loop.batch_progress") if isinstance(fit, dict) else None
    total = progress.get("total") if isinstance(progress, dict) else None
    done = total.get("processed") if isinstance(total, dict) else None
    return done if isinstance(done, int) and not isinstance(done, bool) and done >= 0 else None


def _schedulers(f: Foreign, live: Tracked, objs: dict[str, Any], step: int | None) -> None:
    saved = _saved_scheduler(f.ckpt)
    lrs = [g.get("lr") for g in objs.get("optim.param_groups", [])]
    for i, sch in enumerate(live.schedulers):
        key = "lr_scheduler" if i == 0 else f"lr_scheduler.{i}"
        cur = sch.state_dict()
        # The same kind: the same keys. A LambdaLR's lr_lambdas (its functions' own attributes, not where the
        # schedule stands) may be missing: DCP drops a list of empty dicts, and torchtitan's partials have none.
        if i == 0 and isinstance(saved, dict) and set(saved) <= set(cur) and set(cur) - set(saved) <= {"lr_lambdas"} and not _links(saved):
            objs[key] = {**cur, **saved}
            continue
        count = _scheduler_steps(saved) if i == 0 else None
        if count is None:
            count = step
            why = "the checkpoint holds no LR scheduler state; one scheduler step per optimizer step is assumed"
        else:
            kind = ", ".join(sorted(saved)[:4]) if isinstance(saved, dict) else "?"
            why = f"the checkpoint's scheduler is another kind ({kind}): only its step count is carried"
        if count is None:
            log.warning("ravex: LR scheduler #%d (%s) starts fresh: %s says neither a step nor a scheduler state", i, type(sch).__name__, f.label)
            objs[key] = cur
            continue
        state = dict(cur)
        state["last_epoch"] = count
        if "_step_count" in state:
            state["_step_count"] = count + 1
        if "_last_lr" in state and len(lrs) == len(state["_last_lr"]) and all(isinstance(x, float) for x in lrs):
            state["_last_lr"] = list(lrs)
        if "_is_initial" in state:
            state["_is_initial"] = False
        log.warning("ravex: LR scheduler #%d (%s) is set to step %d: %s", i, type(sch).__name__, count, why)
        objs[key] = state


def _samples(f: Foreign, step: int | None, per_step: int) -> tuple[int, str]:
    """(samples the saved run trained on, where that figure comes from)."""
    zero = f.ckpt.objects.get("zero")
    if isinstance(zero, dict):
        if isinstance(zero.get("global_samples"), int):
            return int(zero["global_samples"]), "DeepSpeed's global_samples"
        tbs = (zero.get("ds_config") or {}).get("train_batch_size")
        if isinstance(tbs, int) and step is not None:
            return step * tbs, "global_steps x train_batch_size"
    batches = _lightning_batches(f.ckpt)
    if batches is not None:
        return batches * per_step, f"the batches Lightning's fit loop records x this run's global batch ({per_step})"
    return (step or 0) * per_step, f"the step count x this run's global batch ({per_step}: one batch per rank per step assumed)"


def _loaders(f: Foreign, live: Tracked, objs: dict[str, Any], step: int | None, rank: int) -> None:
    loaders = [(i, ld) for i, (ld, _) in enumerate(live.loaders) if ld is not None]
    if not loaders:
        return
    i, ld = loaders[0]
    if len(loaders) > 1 and rank == 0:
        log.warning("ravex: only the first DataLoader is moved past the samples %s trained on; the other %d start at their beginning",
                    f.label, len(loaders) - 1)
    batch = getattr(ld, "batch_size", None)
    try:
        length = len(ld)
    except TypeError:
        length = None
    if not isinstance(batch, int) or not length or isinstance(getattr(ld, "dataset", None), torch.utils.data.IterableDataset):
        log.warning("ravex: the DataLoader has no batch size and length (an IterableDataset, or a batch sampler of its own): it starts at its "
                    "beginning, not past the samples %s trained on", f.label)
        return
    sampler = _sampler_of(ld)
    dist = _distributed_sampler(sampler)
    ranks = int(sampler.num_replicas) if dist else 1
    done, source = _samples(f, step, batch * ranks)
    per_epoch = length * batch * ranks
    epoch, within = divmod(done, per_epoch)
    saved: dict[str, Any] = {"epoch": epoch, "consumed": 0, "length": length, "replayable": True, "epoch_start": {}, "generators": {}}
    if hasattr(sampler, "set_epoch") and hasattr(sampler, "epoch"):
        saved["sampler_epoch"] = epoch
    if dist:
        # Whole steps of this run's: its own batches are skipped; else the epoch's rest is dealt out again.
        whole = within % (batch * ranks) == 0
        saved["consumed"] = within // (batch * ranks) if whole else 0
        saved["distributed_sampler"] = {"num_replicas": ranks if whole else f.ckpt.world_size or ranks, "rank": int(sampler.rank),
                                        "batch_size": batch, "offset": 0 if whole else within, "dataset_len": len(sampler.dataset)}
    else:
        saved["consumed"] = within // batch
        if within % batch and rank == 0:
            log.warning("ravex: %d samples is not a whole number of batches of %d: the DataLoader resumes at the batch they begin", within, batch)
    if rank == 0:
        log.warning("ravex: DataLoader #%d skips the %d samples %s trained on (%s): epoch %d, %d samples into it",
                    i, done, f.label, source, epoch, within)
    loaders_state: list[Any] = [None] * len(live.loaders)
    loaders_state[i] = saved
    objs["loaders"] = loaders_state
