"""``init_from``: a new run's model starts from another checkpoint's weights (a Ravex store, or
any checkpoint ``resume_from`` takes) and nothing else of it: the optimizer, the schedulers, the
step and the data position start fresh. Once the run has checkpoints of its own, a restart
resumes from them. In one process, with the fixtures' model (tests/test_runtime_foreign.py's
decorated script)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DATA, run_ravex
from test_runtime_foreign import M, run, said, true_state

from ravex_convert.objects import INITIALISED_FROM
from ravex_runtime.config import ConfigError, load_config
from ravex_runtime.errors import ResumeError
from ravex_runtime.status import store_status

FRESH_LRS = [M.DECAY_LR * M.warmup(0), M.NO_DECAY_LR * M.warmup(0)]


def assert_fresh_start(seen: dict[str, object]) -> None:
    """Step 0, the scheduler's first lr, the data from its first sample, Adam's step count the steps this run took."""
    assert seen["step0"] == 0
    assert seen["lr0"] == FRESH_LRS
    assert seen["samples"][0] == list(range(M.GLOBAL_BATCH))  # type: ignore[index]
    opt = seen["opt"]
    taken = len(seen["losses"])  # type: ignore[arg-type]
    assert taken and all(float(st["step"]) == taken for st in opt.state.values())  # type: ignore[attr-defined]


def test_from_a_deepspeed_checkpoint_the_weights_alone(env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RAVEX_INIT_FROM", str(DATA / "zero3_ws2_fp32" / "checkpoint"))
    with said(caplog):
        seen = run(steps=1)
    true = true_state("zero3_ws2_fp32")
    for k, v in seen["restored"].items():
        assert torch.equal(v, true[f"model/{k}"]), k
    assert not torch.equal(seen["built"]["embed.weight"], seen["restored"]["embed.weight"])  # the built weights were replaced
    assert_fresh_start(seen)
    assert "starts from the weights of DeepSpeed ZeRO checkpoint" in caplog.text


def test_from_a_ravex_store_then_restarts_resume_the_runs_own(env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ravex_convert

    first = run(steps=5)  # the pretraining run: checkpoints at steps 2 and 4 in env's store
    assert first["losses"]
    pre = ravex_convert.load_state_dict(env)  # its newest checkpoint's weights (step 5, at the end)
    monkeypatch.setenv("RAVEX_STORAGE_PATH", str(tmp_path / "finetune"))
    monkeypatch.setenv("RAVEX_INIT_FROM", str(env))
    seen = run(steps=3)
    for k, v in seen["restored"].items():
        assert torch.equal(v, pre[k]), k
    assert_fresh_start(seen)
    st = store_status(tmp_path / "finetune")
    rows = st["checkpoints"]
    assert rows and all(r["initialised_from"] == {"format": "native", "path": str(env), "step": 5} for r in rows)
    assert all(r["began_from"] is None for r in rows)
    said_ = run_ravex("status", tmp_path / "finetune")
    assert said_.returncode == 0 and f"the run's model began from the weights of the native checkpoint {env} (step 5) (init_from)" in said_.stdout
    # killed and started again with the same settings: it goes on from its own store, not from init_from
    again = run(steps=1)
    assert again["step0"] == rows[-1]["step"] and again["step0"] > 0
    assert ravex_convert.read_checkpoint(tmp_path / "finetune").objects["extra"][INITIALISED_FROM]["path"] == str(env)


def test_a_model_that_does_not_fit_stops_before_the_first_step(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAVEX_INIT_FROM", str(DATA / "zero3_ws2_fp32" / "checkpoint"))
    seen: dict[str, object] = {}
    with pytest.raises(ResumeError, match="of the model's tensors are not in it"):
        run(build=lambda: torch.nn.Sequential(torch.nn.Linear(3, 3)), make_opt=lambda m: torch.optim.AdamW(m.parameters()),
            make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), seen=seen)
    assert seen["losses"] == []


def test_init_from_and_resume_from_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both resume_from and init_from"):
        load_config(tmp_path, {"RAVEX_INIT_FROM": str(tmp_path / "a"), "RAVEX_RESUME_FROM": str(tmp_path / "b")})
    with pytest.raises(ConfigError, match="init_from takes no index"):
        load_config(tmp_path, {"RAVEX_INIT_FROM": "-1"})
