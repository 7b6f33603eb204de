"""A run driven by a framework (the Hugging Face Trainer, a Lightning Trainer, a plain loop over
``Accelerator.prepare``) and decorated with ``@ravex.train_loop(preemption_handler=True)``, SIGKILLed
between two checkpoints and started again with the same command, reproduces the uninterrupted run
bit for bit. Real processes throughout; the script is integration/framework_train.py (what it
logs is said there).

Per case (framework x randomness, and the HF Trainer fine-tuning a PEFT LoRA adapter):
(a) a reference run with ``RAVEX_ENABLED=0``;
(b) an uninterrupted run with Ravex (a checkpoint every 5 steps): the same log, line for line, and
    the same final weights and progress as (a) — Ravex does not perturb training;
(c) a run SIGKILLed right after step 23 (its newest checkpoint: step 20);
(d) the same command again: exit 0, it trains steps 21..40 only (the framework's budget, not 40
    more), each step's line (micro-batch losses, lr, the framework's epoch) is the reference's, and
    so are the final weights and the framework's final progress.
(a) runs alongside (c), and (b) alongside (d): two processes at a time. Every difference found is
reported together: the first differing step and its two lines.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _zygote import PRELOAD, Run, Zygote, base_env  # integration/ is no package

SCRIPT = Path(__file__).resolve().with_name("framework_train.py")
STEPS, EVERY, KILL = 40, 5, 23  # the kill lands 3 steps after the checkpoint at step 20
TIMEOUT = 300
FRAMEWORKS = ["hf", "lightning", "accelerate"]
NOISE = {"plain": {"noise": False, "workers": 0}, "noise": {"noise": True, "workers": 0}, "noise-workers2": {"noise": True, "workers": 2}}
SLOW = {"noise-workers2"}  # worker start-up on top of a case's four runs: cut first
# framework x randomness, and a PEFT LoRA adapter fine-tuned by the HF Trainer (randomness on)
CASES = [*((fw, n) for fw in FRAMEWORKS for n in NOISE), ("hf", "noise-lora")]
NOISE["noise-lora"] = {"noise": True, "workers": 0, "lora": True}


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """One process that has imported the frameworks and forks each run (integration/_zygote.py):
    a run is still a process of its own, killed by SIGKILL, without 5-6 s of imports each."""
    with Zygote(PRELOAD, base_env()) as z:
        yield z


def start(z: Zygote, tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> Run:
    env = {**base_env(), "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), "RAVEX_CHECKPOINT_EVERY": str(EVERY)}
    if opts["framework"] == "accelerate":  # its loop runs 100 epochs: Ravex's max_steps ends it
        env["RAVEX_MAX_STEPS"] = str(STEPS)
    env.update(env_extra)
    return z.start(SCRIPT, [json.dumps({**opts, "tag": tag}), str(tmp)], env, tmp, f"{tag}-{z.next_id + 1}")


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def log_lines(tmp: Path, tag: str) -> list[dict[str, Any]]:
    path = tmp / f"log-{tag}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(tmp: Path, tag: str) -> dict[str, Any] | None:
    path = tmp / f"out-{tag}.json"
    return json.loads(path.read_text()) if path.exists() else None


def differences(ref: list[dict[str, Any]], got: list[dict[str, Any]], what: str) -> list[str]:
    """What ``got`` logged unlike the reference: steps out of order, missing or extra, and the first step whose line differs."""
    problems = []
    by_step = {line["step"]: line for line in ref}
    steps = [line["step"] for line in got]
    if steps != sorted(set(steps)):
        problems.append(f"{what}: steps logged out of order or twice: {steps}")
    extra = [s for s in steps if s not in by_step]
    if extra:
        problems.append(f"{what}: logged steps the reference never logged: {extra[:10]}{' ...' if len(extra) > 10 else ''}")
    for line in got:
        want = by_step.get(line["step"])
        if want is not None and want != line:
            keys = ", ".join(k for k in {**want, **line} if want.get(k) != line.get(k))
            problems.append(f"{what}: first difference at step {line['step']} (in {keys}){two_lines(want, line, what)}")
            break
    return problems


def two_lines(want: Any, got: Any, what: str) -> str:
    width = max(len(what), len("reference"))
    return f"\n  {'reference'.ljust(width)}: {json.dumps(want)}\n  {what.ljust(width)}: {json.dumps(got)}"


def compare_runs(ref_log: list[dict[str, Any]], ref_out: dict[str, Any], log: list[dict[str, Any]], out: dict[str, Any] | None,
                 expect_steps: list[int], what: str) -> list[str]:
    problems = differences(ref_log, log, what)
    steps = [line["step"] for line in log]
    if steps != expect_steps:
        problems.append(f"{what}: logged steps {compact(steps)}, expected {compact(expect_steps)}")
    if out != ref_out:
        problems.append(f"{what}: final state differs{two_lines(ref_out, out, what)}")
    return problems


def compact(steps: list[int]) -> str:
    """[1, 2, 3, 7, 8] -> '1..3, 7..8'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in runs) or "none"


@pytest.mark.parametrize(("framework", "noise"), [pytest.param(fw, n, marks=[pytest.mark.slow] if n in SLOW else [], id=f"{fw}-{n}")
                                                  for fw, n in CASES])
def test_sigkill_between_checkpoints_then_resume_is_bit_identical(framework: str, noise: str, tmp_path: Path, zygote: Zygote) -> None:
    z = zygote
    opts = {"framework": framework, "steps": STEPS, **NOISE[noise]}
    ref_p = start(z, tmp_path, opts, "ref", {"RAVEX_ENABLED": "0"})
    kill = z.finish(start(z, tmp_path, opts, "kill", {"KILL_AT_STEP": str(KILL)}), TIMEOUT)
    ref = z.finish(ref_p, TIMEOUT)
    assert ref.returncode == 0, f"the reference run (RAVEX_ENABLED=0) failed:\n{tail(ref.stderr)}"
    ref_log, ref_out = log_lines(tmp_path, "ref"), outcome(tmp_path, "ref")
    ref_steps = [line["step"] for line in ref_log]
    assert ref_steps == list(range(1, STEPS + 1)) and ref_out is not None, f"the reference run logged steps {compact(ref_steps)}, out: {ref_out}"
    killed = log_lines(tmp_path, "kill")
    killed_steps = compact([line["step"] for line in killed])
    assert kill.returncode == -signal.SIGKILL, f"the run to kill at step {KILL} exited {kill.returncode}, logged steps {killed_steps}:\n{tail(kill.stderr)}"
    problems = differences(ref_log, killed, "killed run")
    if killed_steps != f"1..{KILL}":
        problems.append(f"killed run: logged steps {killed_steps}, expected 1..{KILL}")

    run_p = start(z, tmp_path, opts, "run", {})
    resume = z.finish(start(z, tmp_path, opts, "kill", {}), TIMEOUT)  # the same command as the killed run's
    run = z.finish(run_p, TIMEOUT)
    if run.returncode != 0:
        problems.append(f"the uninterrupted Ravex run exited {run.returncode}:\n{tail(run.stderr)}")
    else:
        problems += compare_runs(ref_log, ref_out, log_lines(tmp_path, "run"), outcome(tmp_path, "run"), list(range(1, STEPS + 1)),
                                 "uninterrupted Ravex run")  # any difference here: Ravex perturbs training
    if resume.returncode != 0:
        problems.append(f"the resumed run exited {resume.returncode}:\n{tail(resume.stderr)}")
    else:
        problems += compare_runs(ref_log, ref_out, log_lines(tmp_path, "kill")[len(killed):], outcome(tmp_path, "kill"),
                                 list(range(KILL // EVERY * EVERY + 1, STEPS + 1)), "resumed run")
    if problems:
        for what, res in (("uninterrupted Ravex run", run), ("resumed run", resume)):
            if any(p.startswith(what) for p in problems):
                problems.append(f"stderr of the {what} (last lines):\n{tail(res.stderr)}")
        pytest.fail("\n\n".join(problems), pytrace=False)


# The wording "written twice" is decided by ravex_runtime (ravex_runtime/frameworks/__init__.py,
# warn_own_checkpoints): grep for it there when it changes.
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_frameworks_own_checkpointing_is_warned_about_once(framework: str, tmp_path: Path, zygote: Zygote) -> None:
    res = zygote.finish(start(zygote, tmp_path, {"framework": framework, "steps": 12, "fw_ckpt": True}, "fw", {}), TIMEOUT)
    assert res.returncode == 0, tail(res.stderr)
    assert res.stderr.count("written twice") == 1, res.stderr
