"""The plan of the ZeRO writer (``zero_write``): what goes out, validated before
any byte is written.

From the checkpoint model: the param groups (members, hyper-parameters) with
each member's fp32 master and optimizer state, checked to be what a ZeRO flat
group can hold (the same per-element state for every member, one step per
group); the kind of every other model tensor (frozen parameter or buffer,
which DeepSpeed stores differently and most formats do not record); and the
small state DeepSpeed reads on load, synthesized where the source lacks it
(``ds_config``, the LR scheduler's position, ``ds_version``), each such choice
said in a note.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._dtypes import scalar_value
from ..._engine import chunk_bytes
from ..._output import FLOAT_DTYPES, Options, strip_name
from ..._torchfile.archive import open_archive
from ...errors import LayoutMismatchError, RavexError
from ...model import BUFFER, MODEL, OPTIM, Checkpoint, LogicalTensor
from .client import LIGHTNING_MARK

__all__ = ["DS_VERSION", "PRECISIONS", "SUB_GROUP_SIZE", "Group", "Param", "Plan", "find", "make_plan"]

DS_VERSION = "0.19.8"  # the DeepSpeed whose layout this writes (recorded when the source names none)
PRECISIONS = ("fp32", "bf16")
_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size
# Top-level keys of a model-states file; a source's client state may not take them.
_RESERVED = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
             "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
             "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version")
_OBJECTS_USED = ("optim.param_groups", "lr_scheduler", "loss_scaler", "zero", "extra")
HINT_GROUPS = ("a ZeRO checkpoint partitions the optimizer's param groups; convert a source that holds them "
               "(with their parameter names), or start DeepSpeed from the weights alone (load them into the module before deepspeed.initialize)")


def _mismatch(message: str, hint: str) -> LayoutMismatchError:
    return LayoutMismatchError(message, hint=hint)


@dataclass
class Param:
    name: str  # as DeepSpeed names it: the stored tensor's fqn (a tied parameter's first name)
    master: str  # logical tensor of its fp32 master
    shape: tuple[int, ...]
    listed: str  # as the param group lists it (a tied parameter may be listed under another name)
    state: dict[str, str] = field(default_factory=dict)  # per-element optimizer state key -> logical tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Group:
    params: list[Param]
    hyper: dict[str, Any]
    scalars: dict[str, str]  # state key -> logical tensor holding the group's value (Adam's step)
    moments: list[str]  # per-element state keys (exp_avg, exp_avg_sq)


@dataclass
class Plan:
    stage: int
    world_size: int
    precision: str
    tag: str
    groups: list[Group]
    order: list[str]  # module (state dict) names
    kinds: dict[str, str]  # stored name -> "param" | "frozen" | "buffer" | "either" (frozen or buffer: the source does not say)
    sources: dict[str, str]  # state dict name -> logical tensor (aliases resolved)
    shared: dict[str, str]  # tied parameter name -> the name it is stored under
    ds_config: dict[str, Any]
    ds_version: str
    counters: dict[str, int]  # global_steps, skipped_steps, global_samples (when known)
    clip_grad: float | None
    lr_scheduler: Any
    client: dict[str, Any]
    scripts: list[Path]
    notes: list[str]

    @property
    def module_dtype(self) -> str:
        return "bfloat16" if self.precision == "bf16" else "float32"

    def entry_dtype(self, name: str, ckpt: Checkpoint) -> str:
        """The dtype of a state-dict entry in ``module``: params (frozen ones too)
        in the working dtype, as DeepSpeed casts the model; buffers as they are."""
        kind = self.kinds[self.sources[name][len(MODEL):]]
        return self.module_dtype if kind in ("param", "frozen") else ckpt.tensors[self.sources[name]].dtype


def find(ckpt: Checkpoint, name: str) -> LogicalTensor | None:
    if name in ckpt.tensors or name in ckpt.aliases:
        return ckpt.resolve(name)
    return None


def _scalar_bytes(t: LogicalTensor) -> bytes:
    c = t.chunks[0] if len(t.chunks) == 1 else None
    if c is None or c.region.numel != 1:
        raise RavexError(f"'{t.name}' is a scalar stored in {len(t.chunks)} pieces", hint="the source checkpoint is damaged; read it with `ravex inspect`")
    return bytes(chunk_bytes(c))


def _scalar_value(t: LogicalTensor) -> float:
    return float(scalar_value(t.dtype, _scalar_bytes(t)))


def _hyper(ckpt: Checkpoint, g: int, entry: dict[str, Any], given: Sequence[Mapping[str, Any]] | None, adam: bool) -> dict[str, Any]:
    """Group ``g``'s hyper-parameters: the source's, with ``given[g]`` over them.
    torch's ``load_state_dict`` replaces each param group by the saved one, so
    what the optimizer steps with must all be there."""
    hyper = {str(k): v for k, v in entry.items() if k != "params"}
    if given is not None:
        hyper.update({str(k): v for k, v in given[g].items() if k != "params"})
    if isinstance(hyper.get("betas"), list):
        hyper["betas"] = tuple(hyper["betas"])
    missing = [k for k in (("lr", "betas", "eps", "weight_decay") if adam else ("lr",)) if k not in hyper]
    if missing:
        why = " (an elastic checkpoint does not save them)" if not entry.keys() - {"params"} else ""
        raise _mismatch(f"{ckpt.path}: param group {g} has no {', '.join(missing)}{why}; DeepSpeed's optimizer state must carry "
                        "every hyper-parameter the optimizer steps with",
                        "pass them, one dict per param group: write(..., hyperparameters=[...]) (the CLI's --hyperparameters FILE.json), "
                        "e.g. [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.state_dict()['param_groups']]")
    return hyper


def _groups(ckpt: Checkpoint, notes: list[str], given: Sequence[Mapping[str, Any]] | None) -> tuple[list[Group], list[str]]:
    """The param groups with their members' masters and optimizer state; and the
    names of zero-element members, which DeepSpeed does not optimize (they are
    saved as frozen parameters)."""
    raw = ckpt.objects.get("optim.param_groups")
    if not isinstance(raw, list) or not raw:
        raise _mismatch(f"{ckpt.path}: the source has no optimizer param groups", HINT_GROUPS)
    if given is not None and len(given) != len(raw):
        raise RavexError(f"hyperparameters has {len(given)} entries; the source has {len(raw)} param groups", hint="pass one dict per param group, in order")
    state_names = ckpt.optimizer_state_names()
    if not state_names:
        raise _mismatch(f"{ckpt.path}: the source holds no optimizer state (no Adam moments)",
                        "Ravex writes ZeRO checkpoints with the optimizer state DeepSpeed resumes from; to start DeepSpeed from "
                        "weights alone, load them into the module before deepspeed.initialize")
    seen: set[str] = set()
    out: list[Group] = []
    empty: list[str] = []
    for g, entry in enumerate(raw):
        names = entry.get("params") if isinstance(entry, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _mismatch(f"{ckpt.path}: param group {g} does not list its parameters by name", HINT_GROUPS)
        params: list[Param] = []
        for n in names:
            t = find(ckpt, MODEL + n)
            if t is None:
                raise _mismatch(f"{ckpt.path}: param group {g} names '{n}', which is not among the model's tensors",
                                "the optimizer state and the weights come from different models; convert a consistent checkpoint")
            stored = t.name[len(MODEL):]
            if stored in seen:
                raise _mismatch(f"{ckpt.path}: '{stored}' is in more than one param group (or twice in one)", HINT_GROUPS)
            seen.add(stored)
            if t.dtype not in FLOAT_DTYPES:
                raise _mismatch(f"{ckpt.path}: '{stored}' is {t.dtype}; ZeRO partitions floating-point parameters only", HINT_GROUPS)
            if t.numel == 0:
                empty.append(stored)
                continue
            params.append(Param(stored, t.name, t.shape, n))
        if not params:
            raise _mismatch(f"{ckpt.path}: param group {g} holds no parameter with elements; DeepSpeed's ZeRO cannot partition it",
                            "drop the empty group from the optimizer before converting")
        group = _group_state(ckpt, g, params, state_names, notes)
        group.hyper = _hyper(ckpt, g, entry, given, {"exp_avg", "exp_avg_sq"} <= set(group.moments))
        out.append(group)
    return out, empty


def _group_state(ckpt: Checkpoint, g: int, params: list[Param], state_names: list[str], notes: list[str]) -> Group:
    """Each member's optimizer state: per-element tensors (the param's shape) and
    scalars (0-d), the same keys for every member, one value per scalar."""
    scalars: dict[str, str] = {}
    moments: list[str] | None = None
    first_scalars: list[str] | None = None
    for p in params:
        keys_el: list[str] = []
        keys_sc: list[str] = []
        for s in state_names:
            t = next((x for x in (find(ckpt, f"{OPTIM}{s}/{n}") for n in dict.fromkeys([p.listed, p.name])) if x is not None), None)
            if t is None:
                continue
            if t.shape == p.shape and not (s == "step" and t.shape == ()):  # a 0-d param's step is still the group's
                p.state[s] = t.name
                keys_el.append(s)
            elif t.shape == ():
                keys_sc.append(s)
                if s not in scalars:
                    scalars[s] = t.name
                elif _scalar_bytes(t) != _scalar_bytes(ckpt.tensors[scalars[s]]) or t.dtype != ckpt.tensors[scalars[s]].dtype:
                    a, b = _scalar_value(ckpt.tensors[scalars[s]]), _scalar_value(t)
                    raise _mismatch(f"{ckpt.path}: param group {g}: optimizer state '{s}' is {a:g} for '{params[0].name}' and {b:g} for '{p.name}'; "
                                    "a ZeRO flat group keeps one value per group",
                                    "split the parameters into param groups that share their step before converting")
            else:
                raise _mismatch(f"{ckpt.path}: optimizer state '{s}' of '{p.name}' has shape {list(t.shape)}, the parameter {list(p.shape)}; "
                                "ZeRO flattens per-element state only (Adam-like optimizers)",
                                "convert this optimizer's state to torch_save or native instead")
        if moments is None:
            moments, first_scalars = keys_el, keys_sc
        elif keys_el != moments or keys_sc != first_scalars:
            raise _mismatch(f"{ckpt.path}: param group {g}: '{p.name}' has optimizer state {keys_sc + keys_el}, '{params[0].name}' has "
                            f"{(first_scalars or []) + moments}; a ZeRO flat group needs the same state for every member",
                            "a parameter that never received a gradient has no state yet; train one step with every parameter, or drop it from the group")
    assert moments is not None
    if not moments:
        raise _mismatch(f"{ckpt.path}: param group {g} has no per-element optimizer state", HINT_GROUPS)
    for key in moments:
        dtypes = {ckpt.tensors[p.state[key]].dtype for p in params}
        if dtypes != {"float32"}:
            notes.append(f"param group {g}: optimizer state '{key}' is {'/'.join(sorted(dtypes))} in the source, written as float32 (DeepSpeed keeps it in fp32)")
    return Group(params, {}, scalars, moments)  # hyper-parameters: _hyper


def _zero_source(ckpt: Checkpoint) -> tuple[list[str], list[Path]]:
    """From a DeepSpeed source's files: its module's key order, and its copies
    of DeepSpeed's recovery scripts."""
    if "zero" not in (ckpt.format, ckpt.source.get("format")):  # a Trainer checkpoint of a DeepSpeed run holds one
        return [], []
    root = ckpt.path
    tag = ckpt.source.get("tag")
    dirs = [root / str(tag), root] if tag else [root]
    for d in dirs:
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            if (d / name).is_file():
                ms = open_archive(d / name).root
                if not isinstance(ms, dict):
                    break
                module = ms.get("module")
                scripts = [root / s for s in _SCRIPTS if (root / s).is_file()]
                return [str(k) for k in module] if isinstance(module, dict) else [], scripts
    return [], []


def _classify(ckpt: Checkpoint, opts: Options, stage: int, trainable: set[str], frozen_empty: list[str],
              buffers: Collection[str] | None, notes: list[str]) -> tuple[dict[str, str], list[str], list[Path]]:
    """Every stored model tensor's kind. DeepSpeed keeps a frozen parameter in
    ``frozen_param_fragments`` (and, under stage 3, as a placeholder in
    ``module``) but a buffer only in ``module``. The checkpoint model says which
    is which where the source did (DeepSpeed, the runtime's stores: each
    tensor's ``kind``); ``buffers`` (--buffers) says it for the others."""
    src_order, scripts = _zero_source(ckpt)
    if opts.strip_prefix:
        def strip(n: str) -> str:
            return strip_name(MODEL + n, opts.strip_prefix)[len(MODEL):]
        src_order = [strip(n) for n in src_order]
    known: set[str] | None = None
    if buffers is not None:
        given = set(buffers)
        unknown = sorted(given - {n[len(MODEL):] for n in ckpt.tensors if n.startswith(MODEL)} - {a[len(MODEL):] for a in ckpt.aliases})
        if unknown:
            raise RavexError(f"buffers names '{unknown[0]}', which is not among the checkpoint's model tensors",
                             hint="list the model's persistent buffers by their state-dict names")
        known = given
    kinds: dict[str, str] = {}
    either: list[str] = []
    for n, t in ckpt.tensors.items():
        if not n.startswith(MODEL):
            continue
        name = n[len(MODEL):]
        if name in trainable:
            kinds[name] = "param"
        elif name in frozen_empty:
            kinds[name] = "frozen"
        elif known is not None:
            kinds[name] = "buffer" if name in known else "frozen"
        elif t.kind is not None:
            kinds[name] = "buffer" if t.kind == BUFFER else "frozen"  # recorded: frozen, or a parameter without optimizer state
        elif t.dtype not in FLOAT_DTYPES:
            kinds[name] = "buffer"
        else:
            kinds[name] = "either"
            either.append(name)
    if either:
        if stage == 3:
            raise _mismatch(f"{ckpt.path}: the source does not say which of {', '.join(either)} are buffers and which frozen parameters; "
                            "ZeRO-3 stores the two differently (a frozen parameter is partitioned, a buffer is not)",
                            "pass the model's persistent buffer names (write(..., buffers=[...]); the CLI's --buffers), "
                            "e.g. [n for n, _ in model.named_buffers()]")
        if stage == 1:
            notes.append(f"the source does not say which of {', '.join(either)} are buffers and which frozen parameters: listed in "
                         "buffer_names (ZeRO-1 keeps both only in the module state, which is all DeepSpeed loads)")
        else:
            notes.append(f"the source does not say which of {', '.join(either)} are buffers and which frozen parameters: recorded as "
                         "frozen parameters, kept in their own dtype (DeepSpeed loads buffers from the module state and ignores "
                         "frozen_param_fragments entries that are not parameters)")
    names = ckpt.model_names()
    order = [n for n in src_order if n in names] + [n for n in names if n not in src_order]
    return kinds, order, scripts


def _ds_config(ckpt: Checkpoint, stage: int, precision: str, ws: int, notes: list[str]) -> dict[str, Any]:
    prov = ckpt.objects.get("zero")
    src = prov.get("ds_config") if isinstance(prov, dict) else None
    if not isinstance(src, dict) or not src:
        notes.append("the source has no DeepSpeed config: ds_config records only the stage and precision (DeepSpeed loads with the config it is started with)")
        return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    cfg: dict[str, Any] = copy.deepcopy(src)
    zo = cfg.get("zero_optimization")
    cfg["zero_optimization"] = {**(zo if isinstance(zo, dict) else {}), "stage": stage}
    if cfg["zero_optimization"].pop("elastic_checkpoint", None):
        notes.append("the source was an elastic checkpoint; the files written are rigid (DeepSpeed loads them with elastic_checkpoint on or off)")
    for key, on in (("bf16", precision == "bf16"), ("fp16", False)):
        if isinstance(cfg.get(key), dict) or on:
            cfg[key] = {**(cfg.get(key) or {}), "enabled": on}
    tbs, gas = cfg.get("train_batch_size"), cfg.get("gradient_accumulation_steps", 1)
    if isinstance(tbs, int) and isinstance(gas, int) and gas > 0 and "train_micro_batch_size_per_gpu" in cfg:
        if tbs % (gas * ws) == 0:
            cfg["train_micro_batch_size_per_gpu"] = tbs // (gas * ws)
        else:
            notes.append(f"ds_config: train_batch_size {tbs} is not a multiple of {gas} x {ws} ranks; the recorded micro-batch size was left as it was")
    notes.append(f"ds_config is the source's with zero_optimization.stage {stage}, {precision}" +
                 (" and the micro-batch size for the new world size" if "train_micro_batch_size_per_gpu" in cfg else "") +
                 " (a record: DeepSpeed loads with the config it is started with)")
    return cfg


def _lr_scheduler(ckpt: Checkpoint, groups: list[Group], step: int, client: dict[str, Any], notes: list[str]) -> Any:
    sched = ckpt.objects.get("lr_scheduler")
    if sched is None and "lr_scheduler" in client:
        sched = client.pop("lr_scheduler")
    if sched is not None:
        return sched
    if LIGHTNING_MARK in client and "lr_schedulers" in client:
        notes.append("lr_scheduler is None, as Lightning's DeepSpeed strategy saves it: Lightning keeps its schedulers in its own "
                     "'lr_schedulers' and loads DeepSpeed with load_lr_scheduler_states=False")
        return None
    lrs = [g.hyper.get("lr") for g in groups]
    base = [g.hyper.get("initial_lr") for g in groups]
    if all(isinstance(v, (int, float)) for v in lrs + base):
        # torch's LRScheduler.load_state_dict is __dict__.update: these keys set
        # the position and leave the scheduler's own settings as constructed.
        notes.append(f"the source has no LR-scheduler state: synthesized one at step {step} from the param groups' initial_lr and lr "
                     "(base_lrs, last_epoch, _last_lr; lr_lambdas [None] so LambdaLR accepts it), assuming one scheduler step per "
                     "optimizer step; pass load_lr_scheduler_states=False to DeepSpeed to keep a scheduler as constructed instead")
        return {"base_lrs": base, "last_epoch": step, "_step_count": step + 1, "_is_initial": False,
                "_get_lr_called_within_step": False, "_last_lr": lrs, "lr_lambdas": [None] * len(groups)}
    notes.append("the source has no LR-scheduler state and its param groups lack initial_lr: lr_scheduler is None "
                 "(start DeepSpeed without a scheduler, or load with load_lr_scheduler_states=False)")
    return None


def make_plan(ckpt: Checkpoint, opts: Options, stage: int, precision: str | None, tag: str | None, buffers: Collection[str] | None,
              hyperparameters: Sequence[Mapping[str, Any]] | None) -> Plan:
    """Everything ``zero_write.write`` needs, checked; raises before any byte is written."""
    if stage not in (1, 2, 3):
        raise RavexError(f"--zero-stage {stage}: Ravex writes ZeRO stages 1, 2 and 3", hint="pass --zero-stage 1, 2 or 3")
    ws = opts.world_size
    if ws < 1:
        raise RavexError(f"--world-size {ws}: a ZeRO checkpoint needs at least one rank", hint="pass --world-size 1 or more")
    if opts.dtype is not None:
        raise RavexError(f"--dtype {opts.dtype} does not apply to --to zero: the fp32 masters stay fp32",
                         hint="use --precision bf16 for a bf16 DeepSpeed run (module weights in bf16), --precision fp32 otherwise")
    if opts.weights_only:
        raise _mismatch("--weights-only leaves nothing a ZeRO checkpoint can hold: its files are the optimizer's partitions", HINT_GROUPS)
    notes: list[str] = []
    src_precision = ckpt.source.get("precision")
    if precision is None:
        if src_precision == "fp16":
            raise RavexError("the source trained in fp16; say which precision the DeepSpeed run resumes in",
                             hint="pass --precision fp32 or --precision bf16 (Ravex does not write fp16 ZeRO checkpoints)")
        precision = "bf16" if src_precision == "bf16" else "fp32"
    if precision not in PRECISIONS:
        raise RavexError(f"--precision {precision}: Ravex writes ZeRO checkpoints in {' or '.join(PRECISIONS)}",
                         hint="fp16 needs DeepSpeed's dynamic loss-scaler state, which Ravex does not write; use fp32 or bf16")
    groups, empty = _groups(ckpt, notes, hyperparameters)
    if empty:
        notes.append(f"{', '.join(empty)}: no elements; DeepSpeed does not optimize such parameters and saves them as frozen")
    trainable = {p.name for g in groups for p in g.params}
    kinds, order, scripts = _classify(ckpt, opts, stage, trainable, empty, buffers, notes)
    for g in groups:
        for p in g.params:
            dt = ckpt.tensors[p.master].dtype
            if dt != "float32":
                notes.append(f"'{p.name}': the source holds it in {dt}; its fp32 master is that value upcast (exact, no extra precision)")
    sources = {n: ckpt.resolve(MODEL + n).name for n in order}
    shared = {n: sources[n][len(MODEL):] for n in order if MODEL + n in ckpt.aliases
              and kinds[sources[n][len(MODEL):]] in ("param", "frozen")}
    found = ckpt.objects.get("zero")
    prov: dict[str, Any] = found if isinstance(found, dict) else {}
    step = ckpt.step if ckpt.step is not None else prov.get("global_steps")
    if not isinstance(step, int):
        values = [_scalar_value(ckpt.tensors[g.scalars["step"]]) for g in groups if "step" in g.scalars]
        step = int(values[0]) if values else 0
        notes.append(f"the source records no global step: global_steps is {step}" + (" (Adam's step)" if values else ""))
    counters = {"skipped_steps": int(prov.get("skipped_steps", 0)), "global_steps": step}
    if isinstance(prov.get("global_samples"), int):
        counters["global_samples"] = prov["global_samples"]
    ds_config = _ds_config(ckpt, stage, precision, ws, notes)
    clip = prov.get("clip_grad")
    if not isinstance(clip, (int, float)) or isinstance(clip, bool):
        clip = ds_config.get("gradient_clipping") if isinstance(ds_config.get("gradient_clipping"), (int, float)) else None
    if clip is None and stage != 3:
        notes.append("clip_grad is left out: DeepSpeed then keeps the gradient clipping of the config it is started with")
    extra = ckpt.objects.get("extra")
    client = {str(k): v for k, v in extra.items()} if isinstance(extra, dict) else {}
    sched = _lr_scheduler(ckpt, groups, step, client, notes)
    for k in [k for k in client if k in _RESERVED]:
        notes.append(f"the source's top-level '{k}' is not written: DeepSpeed uses that key itself")
        del client[k]
    left = [k for k in ckpt.objects if k not in _OBJECTS_USED]
    if left:
        notes.append(f"not written (a ZeRO checkpoint has no place for them): {', '.join(left)}")
    scaler = ckpt.objects.get("loss_scaler")
    if scaler is None:
        notes.append("loss_scaler: DeepSpeed's static LossScaler at scale 1.0 (what it uses without fp16)")
    elif not isinstance(scaler, dict) or scaler.get("cur_scale") != 1.0 or scaler.get("dynamic"):
        notes.append(f"the source's loss scaler ({scaler}) is replaced by the static LossScaler at scale 1.0 that {precision} runs use")
    # DeepSpeed records the version that saved; these files have 0.19.8's layout, whatever the source's was
    src_version = ckpt.source.get("ds_version")
    if src_version != DS_VERSION:
        was = f"the source was saved by {src_version}" if isinstance(src_version, str) else "the source names none"
        notes.append(f"ds_version {DS_VERSION}: the DeepSpeed whose layout Ravex writes ({was}; DeepSpeed requires the field)")
    if tag is None:
        tag = str(ckpt.source["tag"]) if "zero" in (ckpt.format, ckpt.source.get("format")) and ckpt.source.get("tag") else f"global_step{step}"
    if not tag or "/" in tag or tag in (".", ".."):
        raise RavexError(f"--tag '{tag}': not a directory name", hint="pass a tag like global_step100")
    if not scripts:
        notes.append("zero_to_fp32.py is not written (it is DeepSpeed's script; the source had no copy)")
    return Plan(stage, ws, precision, tag, groups, order, kinds, sources, shared, ds_config, DS_VERSION, counters,
                 float(clip) if clip is not None else None, sched, client, scripts, notes)
