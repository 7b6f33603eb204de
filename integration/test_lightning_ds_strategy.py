"""Lightning's DeepSpeed strategy (CPU, gloo, 3 ranks) resumes what Ravex resharded.

The sources are the fixtures Lightning itself wrote at 2 ranks (lightning_ds2_ws2: ZeRO-2,
lightning_ds3_ws2: ZeRO-3; fixtures/_lightning_ds.py). DeepSpeed loads a ZeRO checkpoint only at
the world size that wrote it; Ravex writes each for 3 ranks (``reshard`` for the ZeRO-2 one,
``convert --to zero --zero-stage 3 --world-size 3`` for the ZeRO-3 one). One job of 3 ranks
(integration/lightning_ds_train.py) then runs ``Trainer.fit(ckpt_path=...)`` under Lightning's
DeepSpeed strategy on each, one after the other, 2 steps further (6 -> 8). Checked, for both:

- the state the run started from (taken at ``on_train_start``, after Lightning and DeepSpeed
  restored it, gathered): fp32 masters, Adam moments and the Counter callback's tensor
  bit-identical to the live state recorded when Lightning saved the source; global step 6; the
  scheduler's state and the optimizer's lrs as recorded; the callback's count 6;
- the run trained on: global step 8, the callback's count 8, every weight changed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ravex_convert

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().with_name("lightning_ds_train.py")
DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_lightnings_deepspeed_strategy_resumes_at_three_ranks(tmp_path: Path) -> None:
    dirs = {2: tmp_path / "zero2" / "last.ckpt", 3: tmp_path / "zero3" / "last.ckpt"}
    for d in dirs.values():
        d.parent.mkdir()
    ravex_convert.reshard(DATA / "lightning_ds2_ws2" / "checkpoint" / "last.ckpt", dirs[2], 3)
    ravex_convert.convert(DATA / "lightning_ds3_ws2" / "checkpoint" / "last.ckpt", dirs[3], "zero", ravex_convert.ConvertOptions(world_size=3),
                          writer={"zero_stage": 3})
    args = [str(SCRIPT), "8"]
    for stage, d in dirs.items():
        args += [str(d), str(stage), str(d.parent / "out")]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))  # DeepSpeed JIT-builds with ninja
    res = launch(3, args, cwd=tmp_path, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    for stage, d in dirs.items():
        ref = DATA / f"lightning_ds{stage}_ws2" / "reference"
        true, meta = load_file(str(ref / "true_state.safetensors")), json.loads((ref / "true_state.json").read_text())
        out = d.parent / "out"
        start, end = load_file(str(out / "start.safetensors")), load_file(str(out / "end.safetensors"))
        assert start.keys() == true.keys() == end.keys(), stage
        assert all(torch.equal(start[k].reshape(-1).view(torch.uint8), true[k].reshape(-1).view(torch.uint8)) for k in true), stage
        began, ended = json.loads((out / "start.json").read_text()), json.loads((out / "end.json").read_text())
        assert (began["world_size"], began["global_step"], began["count"]) == (3, 6, 6), stage
        assert began["lr_scheduler"] == meta["lr_scheduler_state"] and began["lrs"] == [g["lr"] for g in meta["param_groups"]], stage
        assert (ended["global_step"], ended["count"]) == (8, 8), stage
        weights = [k for k in true if k.startswith("model/")]
        assert len(weights) == 4 and not any(torch.equal(start[k], end[k]) for k in weights), stage
        assert all(torch.isfinite(v).all() for v in end.values()), stage
