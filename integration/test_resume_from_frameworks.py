"""``resume_from`` a framework's own checkpoint directory: a plain decorated PyTorch script
(integration/plain_resume.py, no loading code) started from what the Hugging Face Trainer
(``checkpoint-N``), Lightning (a ``.ckpt`` of ``ModelCheckpoint``), Accelerate (``save_state``) and a
torchtitan-style DCP (model keys at the top level, flattened ``optimizer``, ``lr_scheduler``,
``train_state``) wrote, trains on as the framework itself went on.

The sources are real runs of integration/framework_train.py with Ravex off (``RAVEX_ENABLED=0``):
20 steps of one micro-batch, no randomness, the framework's own checkpoint every 10 steps. The
torchtitan-style one is plain_resume.py itself with Ravex off, saving at step 10 with
``torch.distributed.checkpoint``. Each plain run resumes from the step-10 checkpoint and trains
steps 11..20. Checked against the source run's own steps 11..20: the losses and the learning
rates bit for bit, and the final weights (a digest of every parameter's bytes) but for the HF
Trainer's; and the scheduler state put in is the one saved (the same kind of scheduler: mapped
whole), Adam's step count 10. The HF Trainer's final weights are not compared: plain_resume.py's
replica of its update is not the Trainer's bit for bit even without a resume (uninterrupted, 20
steps: the losses of steps 9 and 10 differ in their last bits and the final weights differ), so
the difference is the replica's, not the resume's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _zygote import PRELOAD, Run, Zygote, base_env  # integration/ is no package

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).resolve().parent
FRAMEWORK = HERE / "framework_train.py"
PLAIN = HERE / "plain_resume.py"
STEPS, AT, TIMEOUT = 20, 10, 300
# where each source keeps its step-10 checkpoint, under the sources' directory
CHECKPOINT = {"hf": "hf-hf/checkpoint-10", "lightning": "lightning-lightning/checkpoints/epoch=0-step=10.ckpt",
              "accelerate": "accelerate-accelerate/step10", "titan": "titan-titan/step-10"}


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote(PRELOAD, base_env()) as z:
        yield z


def finished(z: Zygote, run: Run) -> None:
    z.finish(run, TIMEOUT)
    assert run.returncode == 0, "\n".join(run.stderr.splitlines()[-30:])


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Path:
    """The four source runs, at once."""
    tmp = tmp_path_factory.mktemp("sources")
    env = {**base_env(), "RAVEX_ENABLED": "0"}
    runs = [zygote.start(FRAMEWORK, [json.dumps({"framework": fw, "tag": fw, "ga": 1, "steps": STEPS, "fw_ckpt": True, "fw_every": AT}), str(tmp)],
                         env, tmp, fw) for fw in ("hf", "lightning", "accelerate")]
    runs.append(zygote.start(PLAIN, [json.dumps({"kind": "titan", "tag": "titan", "steps": STEPS, "save_at": AT}), str(tmp)], env, tmp, "titan"))
    for run in runs:
        finished(zygote, run)
    for kind, rel in CHECKPOINT.items():
        assert (tmp / rel).exists(), f"the {kind} run wrote no {rel}"
    return tmp


def log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def resume(z: Zygote, tmp: Path, kind: str, source: Path, tag: str) -> Run:
    env = {**base_env(), "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), "RAVEX_RESUME_FROM": str(source), "RAVEX_CHECKPOINT_EVERY": "100"}
    return z.start(PLAIN, [json.dumps({"kind": kind, "tag": tag, "steps": STEPS}), str(tmp)], env, tmp, tag)


def saved_scheduler(sources: Path, kind: str) -> dict[str, Any]:
    """The scheduler's state as the framework saved it, read with torch's own loader."""
    import torch

    ckpt = sources / CHECKPOINT[kind]
    if kind == "titan":
        found: dict[str, Any] = json.loads((ckpt.parent / f"scheduler-{AT}.json").read_text())
        return found
    if kind == "lightning":
        state = torch.load(ckpt, weights_only=True)["lr_schedulers"][0]
    else:
        state = torch.load(ckpt / ("scheduler.pt" if kind == "hf" else "scheduler.bin"), weights_only=True)
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


@pytest.mark.parametrize("kind", list(CHECKPOINT))
def test_a_plain_script_goes_on_from_the_frameworks_checkpoint(sources: Path, zygote: Zygote, tmp_path: Path, kind: str) -> None:
    run = resume(zygote, tmp_path, kind, sources / CHECKPOINT[kind], kind)
    finished(zygote, run)
    got = log(tmp_path / f"log-{kind}.jsonl")
    want = {line["step"]: line for line in log(sources / f"log-{kind}.jsonl")}
    assert [line["step"] for line in got] == list(range(AT + 1, STEPS + 1)), run.stderr[-3000:]
    for line in got:
        ref = want[line["step"]]
        assert line["loss"] == (ref["loss"][0] if isinstance(ref["loss"], list) else ref["loss"]), (line, ref)
        assert line["lr"] == ref["lr"], (line, ref)
    if kind != "hf":  # the plain replica of the Trainer's update is not the Trainer's bit for bit (the module docstring)
        want_weights = json.loads((sources / f"out-{kind}.json").read_text())["weights"]
        assert json.loads((tmp_path / f"out-{kind}.json").read_text())["weights"] == want_weights, "the final weights differ"
    restored = json.loads((tmp_path / f"restored-{kind}.json").read_text())
    assert restored["scheduler"] == json.loads(json.dumps(saved_scheduler(sources, kind)))
    assert restored["adam_step"] == AT
    assert "is set to step" not in run.stderr  # the saved scheduler was taken whole, not rebuilt from a step count


@pytest.mark.parametrize(("kind", "source", "said"), [
    ("hf", "lightning", "of the model's tensors are not in it"),
], ids=["lightning-ckpt-into-gpt2"])
def test_a_mismatch_stops_before_the_first_step(sources: Path, zygote: Zygote, tmp_path: Path, kind: str, source: str, said: str) -> None:
    run = resume(zygote, tmp_path, kind, sources / CHECKPOINT[source], "bad")
    zygote.finish(run, TIMEOUT)
    assert run.returncode != 0
    assert said in run.stderr, run.stderr[-3000:]
    assert log(tmp_path / "log-bad.jsonl") == []


# The strategies' layouts, as the frameworks wrote them at 2 ranks (fixtures/_lightning_ds.py,
# fixtures/_accelerate_fsdp.py): fixture -> (the plain script's kind, the checkpoint the user names).
STRATEGY = {"lightning_ds2_ws2": ("lightning_ds", "checkpoint/last.ckpt"), "lightning_ds3_ws2": ("lightning_ds", "checkpoint/last.ckpt"),
            "accelerate_fsdp2_ws2": ("accelerate_fsdp", "checkpoint/state")}


@pytest.mark.parametrize("fixture", list(STRATEGY))
def test_a_plain_script_resumes_a_strategys_directory(zygote: Zygote, tmp_path: Path, fixture: str) -> None:
    """Lightning's DeepSpeed strategy (ZeRO-2, ZeRO-3) and Accelerate under FSDP2, 2 ranks, resumed by
    one process: the weights, buffers and Adam moments put in are the live state recorded at the
    save, bit for bit; the scheduler's state is the saved one; Adam's step count is the saved step;
    three more steps are trained. (Those runs shuffled or ran 2 ranks: their continuation's losses
    are not compared.)"""
    import torch
    from safetensors.torch import load_file

    data = Path(__file__).resolve().parents[1] / "fixtures" / "data" / fixture
    kind, rel = STRATEGY[fixture]
    meta = json.loads((data / "reference" / "true_state.json").read_text())
    step = meta.get("global_step", meta.get("optimizer_step"))
    env = {**base_env(), "RAVEX_STORAGE_PATH": str(tmp_path / "store"), "RAVEX_RESUME_FROM": str(data / rel), "RAVEX_CHECKPOINT_EVERY": "100"}
    run = zygote.start(PLAIN, [json.dumps({"kind": kind, "tag": "s", "steps": step + 3, "dump": True}), str(tmp_path)], env, tmp_path, "s")
    finished(zygote, run)
    true = {k: v for k, v in load_file(str(data / "reference" / "true_state.safetensors")).items() if k.startswith(("model/", "optim/exp_avg"))}
    got = load_file(str(tmp_path / "restored-s.safetensors"))
    assert set(got) == set(true)
    assert all(torch.equal(got[k], true[k]) for k in true), [k for k in true if not torch.equal(got[k], true[k])]
    seen = json.loads((tmp_path / "restored-s.json").read_text())
    assert seen["scheduler"] == {k: v for k, v in meta["lr_scheduler_state"].items() if k != "lr_lambdas"}
    assert seen["adam_step"] == step
    assert [line["step"] for line in log(tmp_path / "log-s.jsonl")] == [step + 1, step + 2, step + 3]
