"""ZeRO checkpoints Ravex wrote at a new world size (and stage) are resumed by
DeepSpeed itself — ``engine.load_checkpoint(dir)`` under torchrun, gloo, CPU —
with no universal-checkpoint step: the restored fp32 masters, Adam moments,
module weights and buffers are bit-identical to the true state the source run
recorded, the per-group steps, hyper-parameters, LR scheduler and global step
are the source's, and three more training steps follow DeepSpeed's own
uninterrupted continuation (``losses_next``, recorded at world size 2).
Covered: ZeRO-2 -> 2, 3 -> 1, 2 -> 3, 3 -> 3 (fp32), 3 -> 3 (bf16), ZeRO-3 with
sub-groups, DeepSpeed's own elastic ZeRO-2 save (which DeepSpeed cannot load),
all from world size 2 to 3; the FSDP2 DCP fixture as ZeRO-2 and ZeRO-3 at world
size 2; a bf16 ZeRO-1 file under BF16_Optimizer. The control: DeepSpeed refuses
its own world-size-2 checkpoint at 3.

Loss tolerances. The restored state is exact (checked bit for bit first); what
differs from the reference run is the world size: each rank's slice of the
global batch and the order of the gradient all-reduce change, so fp32 sums
round differently (fixtures/README.md: fp32 runs of this model agree across
frameworks and world sizes to about 1e-6; measured here: at most 1.3e-7
relative). Relative 1e-5 leaves room for that and still catches any state not
restored (a fresh optimizer or a missed param group moves the third loss by
about 1e-2). In bf16, gradients and weights are rounded to 8 significant bits
after reductions whose order changes with the world size, and ZeRO-3's own
linear layers round a bf16 forward differently from the plain module's (the
same restored bf16 weights give a first loss 2.2e-4 apart under ZeRO-3 and
under BF16_Optimizer; the latter equals a plain torch forward bit for bit).
Measured: up to 2.4e-4 relative; allowed: 1e-3. Judged by outputs, not exit codes: every rank ends
with a barrier and os._exit(0), and a late gloo abort could not hide a result.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _launch import launch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "fixtures" / "data"
BUFFERS = ["out_scale", "blocks.0.attn.softmax_scale", "blocks.1.attn.softmax_scale"]
RTOL = {False: 1e-5, True: 1e-3}  # by bf16

WORKER = r'''
"""Resume Ravex-written ZeRO checkpoints under DeepSpeed (one engine after another, one process group).

    torchrun --standalone --nproc_per_node N worker.py FIXTURES_DIR CASES_JSON OUT_JSON
"""
import json
import os
import sys
import traceback

fixtures, cases_path, out_path = sys.argv[1:4]
sys.path.insert(0, fixtures)

import deepspeed
import model as M
import torch
import torch.distributed as dist
from _workers import ds_config
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from safetensors.torch import load_file


def same(a, b):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    lanes = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(lanes), b.view(lanes))


def resume(case, rank, ws):
    truth = load_file(os.path.join(case["truth"], "true_state.safetensors"))
    meta = json.load(open(os.path.join(case["truth"], "true_state.json")))
    model = M.build_model()
    with torch.no_grad():  # nothing matches unless load_checkpoint restores it
        for p in model.parameters():
            p.add_(1.0)
    spec = {"stage": case["stage"], "ws": ws, "bf16": case["bf16"], "bf16opt": case.get("bf16opt", False), "zx": case.get("zx", {})}
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=M.param_groups(model), config=ds_config(spec),
                                                   lr_scheduler=M.make_scheduler)
    res = {"name": case["name"], "optimizer": type(engine.optimizer).__name__, "mismatches": []}
    load_path, _ = engine.load_checkpoint(case["ckpt"])
    res["loaded"] = load_path is not None
    bad = res["mismatches"]
    opt = engine.optimizer
    if case["stage"] in (1, 2) and hasattr(opt, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 ZeRO-1/2 can leave a group's hp fragments without their optimizer
        # state (fixtures/README.md); relink with its own routine, as the fixture worker does
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    named = list(engine.module.named_parameters())
    for n, p in named:
        if p.requires_grad:
            res.setdefault("checked", 0)
            res["checked"] += 1
            if not same(safe_get_full_fp32_param(p), truth[f"model/{n}"]):
                bad.append(f"fp32 master {n}")
            for key in ("exp_avg", "exp_avg_sq"):
                if not same(safe_get_full_optimizer_state(p, key), truth[f"optim/{key}/{n}"]):
                    bad.append(f"{key} {n}")
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None, enabled=case["stage"] == 3):
        for n, p in named:
            if not same(p.detach().clone(), truth[f"module/{n}"]):
                bad.append(f"module {n}")
    for n, b in engine.module.named_buffers():
        if f"model/{n}" in truth and not same(b, truth[f"model/{n}"]):
            bad.append(f"buffer {n}")
    base = opt.optimizer
    if case["stage"] == 3:
        flats, owner = opt.fp32_partitioned_groups_flat, opt.sub_group_to_group_id
    else:
        flats = [g["params"][0] for g in base.param_groups]
        owner = {i: i for i in range(len(flats))}
    steps = {}
    for i, f in enumerate(flats):
        steps.setdefault(owner[i], set()).add(float(base.state[f]["step"]))
    res["group_steps"] = [sorted(steps[g]) for g in sorted(steps)]
    res["param_groups"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in base.param_groups]
    res["expected_param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in meta["param_groups"]]
    res["lr_scheduler"] = scheduler.state_dict()
    res["expected_lr_scheduler"] = meta["lr_scheduler_state"]
    res["global_steps"] = engine.global_steps
    losses = []
    for step in range(M.STEPS_BEFORE_SAVE, M.STEPS_BEFORE_SAVE + M.STEPS_AFTER_SAVE):
        x, y = M.batch(step, rank, ws)
        loss = M.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        lo = loss.detach().float().clone()
        dist.all_reduce(lo)
        losses.append((lo / ws).item())
    res["losses"] = losses
    res["expected_losses"] = meta["losses_next"]
    engine.destroy()
    return res


def main():
    deepspeed.init_distributed()
    rank, ws = dist.get_rank(), dist.get_world_size()
    results = []
    for case in json.load(open(cases_path)):
        try:
            results.append(resume(case, rank, ws))
        except Exception:
            results.append({"name": case["name"], "error": traceback.format_exc()[-3000:]})
        dist.barrier()
    if rank == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


main()
'''


def _write(src: str, dst: Path, world_size: int, stage: int, **kw: Any) -> None:
    from ravex_convert import read_checkpoint
    from ravex_convert._output import Options, select
    from ravex_convert.formats.zero import writer as zero_write

    opts = Options(world_size=world_size)
    zero_write.write(select(read_checkpoint(DATA / src / "checkpoint"), opts), dst, opts, zero_stage=stage, **kw)


def _resume(tmp_path: Path, world_size: int, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "results.json"
    # DS_ACCELERATOR: no GPU; the venv's bin on PATH: DeepSpeed JIT-builds its CPU comm op with ninja
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    res = launch(world_size, [str(tmp_path / "worker.py"), str(REPO / "fixtures"), str(tmp_path / "cases.json"), str(out)],
                 cwd=tmp_path, env=env)
    assert out.is_file(), f"no results (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return {r["name"]: r for r in json.loads(out.read_text())}


def _check(r: dict[str, Any], bf16: bool) -> None:
    assert "error" not in r, r.get("error")
    assert r["loaded"] and r["mismatches"] == [] and r["checked"] == 37, r["mismatches"][:10]
    assert r["group_steps"] == [[3.0], [3.0]]  # each param group's (every ZeRO-3 sub-group's) Adam step
    assert r["param_groups"] == r["expected_param_groups"]  # lr, weight decay, betas, ... of EACH group
    assert r["lr_scheduler"] == r["expected_lr_scheduler"]
    assert r["global_steps"] == 3
    for got, want in zip(r["losses"], r["expected_losses"], strict=True):
        assert abs(got - want) <= RTOL[bf16] * abs(want), (r["name"], r["losses"], r["expected_losses"])


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_resumes_resharded_zero_at_world_size_3(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    cases: list[dict[str, Any]] = [
        # the control: DeepSpeed refuses its own ws2 checkpoint at ws3
        {"name": "deepspeed_own_ws2", "ckpt": str(DATA / "zero2_ws2_fp32" / "checkpoint"), "truth": str(DATA / "zero2_ws2_fp32" / "reference"),
         "stage": 2, "bf16": False},
    ]
    # (name, source fixture, target stage, writer options, engine zero_optimization extras).
    # ZeRO-3 engines last: a ZeRO-3 engine leaves DeepSpeed's patched autograd functions
    # behind, and a later stage-1/2 engine in the same process would compute differently.
    elastic = json.loads((DATA / "zero2e_ws2_fp32" / "reference" / "true_state.json").read_text())["param_groups"]
    for name, src, stage, kw, zx in (
            ("zero2_to_zero2", "zero2_ws2_fp32", 2, {}, {}),
            # DeepSpeed's own elastic ZeRO-2 save, which it cannot load (FIELD-NOTES), with the run's hyper-parameters
            ("zero2_elastic_to_zero2", "zero2e_ws2_fp32", 2, {"hyperparameters": elastic}, {}),
            ("zero3_to_zero1", "zero3_ws2_fp32", 1, {}, {}),
            ("zero2_to_zero3", "zero2_ws2_fp32", 3, {}, {}),
            ("zero3_to_zero3", "zero3_ws2_fp32", 3, {}, {}),
            ("zero3_subgroups_to_zero3", "zero3sg_ws2_fp32", 3, {}, {"sub_group_size": 200}),
            ("zero3_bf16_to_zero3", "zero3_ws2_bf16", 3, {}, {})):
        _write(src, tmp_path / name, 3, stage, **kw)
        cases.append({"name": name, "ckpt": str(tmp_path / name), "truth": str(DATA / src / "reference"), "stage": stage,
                      "bf16": "bf16" in src, "zx": zx})
    results = _resume(tmp_path, 3, cases)
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in results["deepspeed_own_ws2"].get("error", "")
    for c in cases[1:]:
        _check(results[c["name"]], c["bf16"])


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_resumes_fsdp2_checkpoint_as_zero(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    truth = str(DATA / "fsdp2_ws2" / "reference")
    _write("fsdp2_ws2", tmp_path / "fsdp2_as_zero2", 2, 2)  # buffers vs frozen left to the writer's default
    _write("fsdp2_ws2", tmp_path / "fsdp2_as_zero3", 2, 3, buffers=BUFFERS)
    # a bf16 stage-1 file is also what BF16_Optimizer (bf16 + fp32 gradient accumulation) loads
    _write("zero3_ws2_bf16", tmp_path / "zero3_bf16_as_bf16_optimizer", 2, 1)
    cases = [
        {"name": "fsdp2_as_zero2", "ckpt": str(tmp_path / "fsdp2_as_zero2"), "truth": truth, "stage": 2, "bf16": False},
        {"name": "zero3_bf16_as_bf16_optimizer", "ckpt": str(tmp_path / "zero3_bf16_as_bf16_optimizer"),
         "truth": str(DATA / "zero3_ws2_bf16" / "reference"), "stage": 1, "bf16": True, "bf16opt": True},
        {"name": "fsdp2_as_zero3", "ckpt": str(tmp_path / "fsdp2_as_zero3"), "truth": truth, "stage": 3, "bf16": False},
    ]
    results = _resume(tmp_path, 2, cases)
    for c in cases:
        _check(results[c["name"]], c["bf16"])
    assert results["zero3_bf16_as_bf16_optimizer"]["optimizer"] == "BF16_Optimizer"
