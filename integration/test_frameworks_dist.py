"""integration/test_frameworks.py under torchrun (gloo, CPU): a run driven by a framework (the
Hugging Face Trainer, a Lightning Trainer with ``strategy="ddp"``, a plain loop over
``Accelerator.prepare``; DDP in all three), SIGKILLed between two checkpoints and started again
with the same command, reproduces the uninterrupted run bit for bit on every rank. The training
script is integration/framework_train.py; under torchrun each rank writes ``log-<tag>-r<RANK>.jsonl``
and ``out-<tag>-r<RANK>.json``, with its own micro-batch losses.

With 60 items, batches of 4 and 2 ranks each rank has 8 batches an epoch: 4 steps with 2
micro-batches each. The kill after step 33 leaves the checkpoint at step 30 newest: two steps into
an epoch (the checkpoint at step 20 would be an epoch's end).

(a) Per framework, at 2 ranks, randomness on (dropout, shuffled data, a random ``__getitem__``;
    Accelerate's with 2 DataLoader workers: their replay under DDP; Lightning with its sanity check,
    ``self.log`` and a metric): a reference with
    ``RAVEX_ENABLED=0`` (its ranks forked by tests/_launch.py, alongside the run to kill), the run
    killed after step 33 (every rank SIGKILLs itself; torchrun tears down what is left), then the
    same command again: exit 0, every rank trains steps 31..40 only, each line (micro-batch losses,
    lr, the framework's epoch) the reference's, and so are every rank's final weights and progress.
(b) The Hugging Face run killed at 2 ranks resumes at 3: exit 0, it trains what is left of the
    budget (steps 31..40, no step twice, each step's lr the reference's: the schedule goes on from
    the checkpoint), global_step ends at 40 on every rank and the final weights are the same on
    all 3 (DDP keeps them so). Its batches are not the 2-rank run's: nothing is compared with it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _zygote import PRELOAD, Run, Zygote, base_env  # integration/ is no package

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().with_name("framework_train.py")
STEPS, EVERY, KILL = 40, 5, 33  # the kill lands 3 steps after the checkpoint at step 30
CKPT = KILL // EVERY * EVERY
NPROC = 2
TIMEOUT = 240.0  # one job, start to end (about 10 s here)
CASES: dict[str, dict[str, Any]] = {
    "hf": {"framework": "hf", "noise": True, "workers": 0},
    # Lightning with its defaults: the sanity check on, a validation loader whose last batch is partial,
    # self.log (sync_dist=True in validation) and a torchmetrics metric in the module
    "lightning": {"framework": "lightning", "noise": True, "workers": 0},
    "accelerate": {"framework": "accelerate", "noise": True, "workers": 2},
}


def job_env(tmp: Path, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> dict[str, str]:
    env = {**base_env(), "RAVEX_STORAGE_PATH": str(tmp / f"store-{tag}"), "RAVEX_CHECKPOINT_EVERY": str(EVERY)}
    if opts["framework"] == "accelerate":  # its loop runs 100 epochs: Ravex's max_steps ends it
        env["RAVEX_MAX_STEPS"] = str(STEPS)
    env.update(env_extra)
    return env


def argv(tmp: Path, opts: dict[str, Any], tag: str) -> list[str]:
    return [str(SCRIPT), json.dumps({**opts, "steps": STEPS, "tag": tag}), str(tmp)]


def job(z: Zygote, tmp: Path, nproc: int, opts: dict[str, Any], tag: str, env_extra: dict[str, str]) -> Run:
    """The script as a job of ``nproc`` gloo ranks forked by the zygote, with torchrun's variables
    (integration/_zygote.py); every rank's stdout and stderr in one file, as torchrun's."""
    return z.start(SCRIPT, argv(tmp, opts, tag)[1:], job_env(tmp, opts, tag, env_extra), tmp, f"{tag}-{z.next_id + 1}", nproc=nproc)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def log_lines(tmp: Path, tag: str, rank: int) -> list[dict[str, Any]]:
    path = tmp / f"log-{tag}-r{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(tmp: Path, tag: str, rank: int) -> dict[str, Any] | None:
    path = tmp / f"out-{tag}-r{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def newest_checkpoint(store: Path) -> int | None:
    """The step of the store's newest complete checkpoint (docs/format.md: the manifest is the commit point)."""
    manifest = store / "manifest.json"
    done = [c for c in json.loads(manifest.read_text())["checkpoints"] if c.get("status") == "complete"] if manifest.exists() else []
    return int(done[-1]["step"]) if done else None


def steps_of(lines: list[dict[str, Any]]) -> list[int]:
    return [int(line["step"]) for line in lines]


def first_difference(ref: list[dict[str, Any]], got: list[dict[str, Any]], what: str) -> str | None:
    """The first line of ``got`` unlike the reference's line of its step, with both lines."""
    by_step = {line["step"]: line for line in ref}
    for line in got:
        want = by_step.get(line["step"])
        if want != line:
            return f"{what}: first difference at step {line['step']}\n  reference: {json.dumps(want)}\n  {what}: {json.dumps(line)}"
    return None


# ---------------------------------------------------------------------------------------- the reference and the killed run


def make_killed(z: Zygote, d: Path, opts: dict[str, Any]) -> None:
    """In ``d``: the reference (tag ``ref``, Ravex off) and the run killed after step ``KILL`` (tag
    ``kill``), both at ``NPROC`` ranks, checked; the killed run's store is ``d/store-kill``."""
    kill_p = job(z, d, NPROC, opts, "kill", {"KILL_AT_STEP": str(KILL)})
    ref = z.finish(job(z, d, NPROC, opts, "ref", {"RAVEX_ENABLED": "0"}), TIMEOUT)  # alongside
    kill = z.finish(kill_p, TIMEOUT)
    assert ref.returncode == 0, f"the reference run (RAVEX_ENABLED=0) failed:\n{tail(ref.stderr)}"
    for r in range(NPROC):
        assert steps_of(log_lines(d, "ref", r)) == list(range(1, STEPS + 1)), f"reference rank {r}: steps {steps_of(log_lines(d, 'ref', r))}"
        assert outcome(d, "ref", r) is not None, f"reference rank {r} wrote no out file"
    assert kill.returncode != 0, f"the run to kill at step {KILL} exited 0:\n{tail(kill.stderr)}"
    problems = []
    for r in range(NPROC):
        got = steps_of(log_lines(d, "kill", r))
        # Every rank kills itself after logging step KILL; a rank torchrun tore down first may not have logged it.
        if got != list(range(1, len(got) + 1)) or not (CKPT < len(got) <= KILL) or (r == 0 and len(got) != KILL):
            problems.append(f"killed run rank {r}: logged steps {got[:3]}..{got[-3:]}, expected 1..{KILL}")
        diff = first_difference(log_lines(d, "ref", r), log_lines(d, "kill", r), f"killed run rank {r}")
        if diff:
            problems.append(diff)
    newest = newest_checkpoint(d / "store-kill")
    if newest != CKPT:
        problems.append(f"the killed run's newest checkpoint is at step {newest}, expected {CKPT}")
    assert not problems, "\n".join(problems) + f"\nthe job's stderr (last lines):\n{tail(kill.stderr)}"


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """The frameworks imported once; each job's ranks forked from it (integration/_zygote.py)."""
    with Zygote(PRELOAD, base_env()) as z:
        yield z


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Callable[[str, Path], None]:
    """``killed(case, dest)``: copies into ``dest`` the reference and the killed run of ``case``
    (made once for the module: (a) and (b) resume the same Hugging Face run)."""
    made: dict[str, Path] = {}

    def get(case: str, dest: Path) -> None:
        if case not in made:
            d = tmp_path_factory.mktemp(f"killed-{case}")
            make_killed(zygote, d, CASES[case])
            made[case] = d
        shutil.copytree(made[case], dest, dirs_exist_ok=True)

    return get


def resume(z: Zygote, tmp: Path, nproc: int, opts: dict[str, Any]) -> tuple[Run, dict[int, int]]:
    """The killed run's command again, at ``nproc`` ranks; how many lines each rank had logged before it."""
    before = {r: len(log_lines(tmp, "kill", r)) for r in range(nproc)}
    done = z.finish(job(z, tmp, nproc, opts, "kill", {}), TIMEOUT)
    assert done.returncode == 0, f"the resumed run exited {done.returncode}:\n{tail(done.stderr)}"
    assert "resuming from checkpoint" in done.stderr and f"(step {CKPT})" in done.stderr, tail(done.stderr)
    return done, before


# ---------------------------------------------------------------------------------------- (a) the same world size


@pytest.mark.parametrize("case", list(CASES))
def test_killed_job_resumes_bit_identically_on_every_rank(case: str, tmp_path: Path, killed: Callable[[str, Path], None],
                                                        zygote: Zygote) -> None:
    killed(case, tmp_path)
    done, before = resume(zygote, tmp_path, NPROC, CASES[case])
    problems = []
    for r in range(NPROC):
        ref = log_lines(tmp_path, "ref", r)
        new = log_lines(tmp_path, "kill", r)[before[r]:]
        if steps_of(new) != list(range(CKPT + 1, STEPS + 1)):
            problems.append(f"resumed run rank {r}: logged steps {steps_of(new)}, expected {CKPT + 1}..{STEPS}")
        diff = first_difference(ref, new, f"resumed run rank {r}")
        if diff:
            problems.append(diff)
        want, got = outcome(tmp_path, "ref", r), outcome(tmp_path, "kill", r)
        if got != want:
            problems.append(f"resumed run rank {r}: final state differs\n  reference: {json.dumps(want)}\n  resumed run: {json.dumps(got)}")
    assert not problems, "\n".join(problems) + f"\nthe job's stderr (last lines):\n{tail(done.stderr)}"


# ---------------------------------------------------------------------------------------- (b) another world size


def test_hf_killed_at_2_ranks_resumes_at_3_and_trains_what_is_left(tmp_path: Path, killed: Callable[[str, Path], None],
                                                                  zygote: Zygote) -> None:
    nproc = 3
    killed("hf", tmp_path)
    done, before = resume(zygote, tmp_path, nproc, CASES["hf"])
    lr = {line["step"]: line["lr"] for line in log_lines(tmp_path, "ref", 0)}
    problems, weights = [], set()
    for r in range(nproc):
        new = log_lines(tmp_path, "kill", r)[before[r]:]
        if steps_of(new) != list(range(CKPT + 1, STEPS + 1)):
            problems.append(f"rank {r}: logged steps {steps_of(new)}, expected {CKPT + 1}..{STEPS}")
        wrong_lr = [(line["step"], line["lr"], lr.get(line["step"])) for line in new if line["lr"] != lr.get(line["step"])]
        if wrong_lr:
            problems.append(f"rank {r}: first step whose lr is not the reference's (step, lr, the reference's): {wrong_lr[0]}")
        out = outcome(tmp_path, "kill", r)
        if out is None or out["global_step"] != STEPS or out["step"] != STEPS:
            problems.append(f"rank {r}: final state {out}, expected global_step {STEPS}")
        else:
            weights.add(out["weights"])
    if len(weights) > 1:
        problems.append(f"the ranks end with different weights: {sorted(weights)}")
    assert not problems, "\n".join(problems) + f"\nthe job's stderr (last lines):\n{tail(done.stderr)}"
