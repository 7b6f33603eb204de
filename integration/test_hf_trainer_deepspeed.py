"""The Hugging Face Trainer under DeepSpeed ZeRO-2 (CPU, gloo, torchrun), resharded by Ravex.

The Trainer saves ``checkpoint-N/`` with ``global_stepN/`` and ``latest`` at 2
ranks. DeepSpeed loads a ZeRO-2 checkpoint only at the world size that wrote it;
Ravex reshards the whole directory (the ZeRO files and the Trainer's own:
trainer_state.json, rng_state.pth, model.safetensors, ...). Checked:

- 2 -> 3 -> 2 ranks through Ravex, then resumed by the Trainer at 2 ranks: the
  final fp32 master weights are bit-identical to the Trainer resuming its own
  checkpoint at 2 ranks;
- resumed by the Trainer at 3 ranks from Ravex's 3-rank directory: it trains on
  to step 4, and the state it started from is the source's, bit for bit.
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

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "_hf_train.py"


def torchrun(n: int, out: Path, resume: Path | None = None) -> dict[str, torch.Tensor]:
    args = [str(SCRIPT), str(out), "4"] + ([str(resume)] if resume else []) + ["--zero", "2"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))  # DeepSpeed JIT-builds with ninja
    res = launch(n, args, cwd=Path.cwd(), env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return load_file(str(out / "final.safetensors"))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hfds") / "run"
    torchrun(2, out)
    return out


def test_read_as_one_checkpoint(run: Path) -> None:
    info = ravex_convert.inspect(run / "checkpoint-2")
    assert (info.format, info.world_size, info.zero_stage, info.step) == ("hf_trainer", 2, 2, 2)
    assert {"rng_state.pth", "training_args.bin", "model.safetensors", "zero_to_fp32.py"} <= set(info.extra["carried"])


def test_resharded_there_and_back_resumes_as_the_trainer_does(run: Path, tmp_path: Path) -> None:
    ref = torchrun(2, tmp_path / "ref", run / "checkpoint-2")
    three, two = tmp_path / "ws3" / "checkpoint-2", tmp_path / "ws2" / "checkpoint-2"
    three.parent.mkdir()
    two.parent.mkdir()
    ravex_convert.reshard(run / "checkpoint-2", three, 3)
    ravex_convert.reshard(three, two, 2)
    assert json.loads((two / "trainer_state.json").read_text()) == json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert (two / "rng_state.pth").read_bytes() == (run / "checkpoint-2" / "rng_state.pth").read_bytes()
    assert equal(torchrun(2, tmp_path / "resumed", two), ref)


def test_the_trainer_resumes_at_three_ranks(run: Path, tmp_path: Path) -> None:
    three = tmp_path / "ws3" / "checkpoint-2"
    three.parent.mkdir()
    ravex_convert.reshard(run / "checkpoint-2", three, 3)
    assert len(list((three / "global_step2").glob("zero_pp_rank_*_optim_states.pt"))) == 3
    assert ravex_convert.verify(run / "checkpoint-2", three).identical
    final = torchrun(3, tmp_path / "resumed", three)
    state = json.loads((tmp_path / "resumed" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    start = load_file(str(run / "final.safetensors"))
    assert final.keys() == start.keys() and all(torch.isfinite(v).all() for v in final.values())


def test_a_plain_script_resumes_from_it(run: Path, tmp_path: Path) -> None:
    """``resume_from`` the Trainer's DeepSpeed ``checkpoint-2`` in a plain decorated script, one
    process (integration/plain_resume.py): the weights put in are DeepSpeed's own fp32
    consolidation of it, bit for bit; Adam's step count and the scheduler's are 2; the data
    position is DeepSpeed's ``global_samples``; it trains steps 3 and 4."""
    import subprocess

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    script = Path(__file__).resolve().with_name("plain_resume.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVEX_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", RAVEX_STORAGE_PATH=str(tmp_path / "store"),
               RAVEX_RESUME_FROM=str(run / "checkpoint-2"))
    opts = {"kind": "hf", "tag": "ds", "steps": 4, "dump": True, "one_group": True}
    res = subprocess.run([sys.executable, "-P", str(script), json.dumps(opts), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "skips the 16 samples" in res.stderr and "DeepSpeed's global_samples" in res.stderr
    ref = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoint-2"))
    got = {k.removeprefix("model/"): v for k, v in load_file(str(tmp_path / "restored-ds.safetensors")).items() if k.startswith("model/")}
    assert len(ref) == 29 and all(torch.equal(got[k], ref[k]) for k in ref)  # the tied head too: the embedding's
    seen = json.loads((tmp_path / "restored-ds.json").read_text())
    assert seen["adam_step"] == 2 and seen["scheduler"]["last_epoch"] == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "log-ds.jsonl").read_text().splitlines()] == [3, 4]
